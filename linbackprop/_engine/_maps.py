"""The four block maps of one layer (ℒ's and ℳ's blocks and their adjoints), from its rebuilt
linearisation: `LayerMaps`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from .._plan import Group, Kind, Plan
from ._loop import layer_arguments, own_residuals
from ._rows import Primal, index_at, read_row, zeros_like_aval


# -- the four block maps of one layer, from its rebuilt VJP ---------------------------------------
class LayerMaps:
    """The blocks of one layer i: ∂Φ_i/∂U (ℒ, negated) and ∂Φ_i/∂θ (ℳ*), with adjoints.

    (Co)tangents come in and go out in the tangent layout of their group (None at leaves without
    tangents, see `Group`); the layer's VJP sees JAX's float0 zeros there.
    """

    def __init__(self, plan: Plan, kind: Kind, vjp: Callable):
        self.vjp = vjp
        self.kind = kind
        self.out: Group = plan.state_groups[kind.out_group]
        self.reads: tuple[Group, ...] = tuple(plan.state_groups[g] for g in kind.read_groups)
        self.params: tuple[Group, ...] = tuple(plan.param_groups[g] for g in kind.param_groups)
        self.diff_reads = tuple(g.differentiable for g in self.reads)

    def _cotangents(self, lam: Any) -> tuple:
        return self.vjp(self.out.full_tangent(lam))

    def _of_reads(self, cts: tuple) -> tuple:
        return tuple(g.tangent(ct) if d else None for ct, g, d in zip(cts[1:], self.reads, self.diff_reads))

    def _of_params(self, cts: tuple) -> tuple:
        return tuple(g.tangent(ct) for ct, g in zip(cts[0], self.params))

    def state_adjoint(self, lam: Any) -> tuple:
        """(∂Φ_i/∂U_j)* Λ_i for each read j (None for reads without tangents)."""
        return self._of_reads(self._cotangents(lam))

    def param_adjoint(self, lam: Any) -> tuple:
        """(∂Φ_i/∂θ_{S_i})* Λ_i, one cotangent per parameter slot of the layer."""
        return self._of_params(self._cotangents(lam))

    def adjoints(self, lam: Any) -> tuple[tuple, tuple]:
        """Both, from one VJP call (two would trace the VJP twice and double the program until
        XLA's CSE: the back substitution with ℳΛ in the loop)."""
        cts = self._cotangents(lam)
        return self._of_reads(cts), self._of_params(cts)

    def state_forward(self, z_reads: tuple, h: tuple | None = None) -> Any:
        """Σ_j ∂Φ_i/∂U_j Z_j, the transpose of `state_adjoint`; with ``h`` (one tangent per
        parameter slot) plus ∂Φ_i/∂θ h, both from one transposed VJP."""
        keep = [r for r, (z, d) in enumerate(zip(z_reads, self.diff_reads)) if d and z is not None]
        if not keep and h is None:
            return zeros_like_aval(self.out.row_avals(tangent=True))

        def adjoint(lam):
            cts = self._cotangents(lam)
            reads = tuple(self.reads[r].tangent(cts[1 + r]) for r in keep)
            if h is None:
                return reads
            return reads, tuple(g.tangent(ct) for ct, g in zip(cts[0], self.params))

        z = tuple(z_reads[r] for r in keep)
        return self._transpose(adjoint, z if h is None else (z, h))

    def param_forward(self, h: tuple) -> Any:
        """∂Φ_i/∂θ h_{S_i}, the transpose of `param_adjoint`."""
        return self._transpose(self.param_adjoint, h)

    def _transpose(self, adjoint: Callable, x: Any) -> Any:
        """The forward map whose adjoint is ``adjoint``, applied to ``x`` (JAX transposes the VJP)."""
        try:
            return jax.linear_transpose(adjoint, self.out.row_avals(tangent=True))(x)[0]
        except NotImplementedError as err:
            names = [layer.name for layer in self.kind.layers][:4]
            raise NotImplementedError(
                f"Layer(s) {names!r}: the solve needs this layer's derivative as a linear map, obtained by "
                f"transposing its VJP, and JAX cannot transpose it ({err}). This happens when the layer "
                "calls a jax.custom_vjp function whose backward is not linear in its cotangent (clipping "
                "the gradient, say). Give that function a linear backward (a jax.custom_jvp for a "
                "gradient-clipping layer), or differentiate this network with jax.grad."
            ) from err


def layer_vjp(plan: Plan, kind: Kind, prim: Primal, own: Any, theta: tuple, inputs: tuple, out: Any) -> Callable:
    if prim.residuals is None:  # remat: linearise again
        return jax.vjp(kind.fn, theta, *inputs)[1]
    return kind.rebuild(own, theta, inputs, out)


def layer_maps(plan: Plan, kind: Kind, prim: Primal, k: int, pos: Any) -> LayerMaps:
    theta, inputs = layer_arguments(plan, kind, prim, pos)
    out = read_row(prim.states[kind.out_group], index_at(kind.by_member.out, pos))
    own = None if prim.residuals is None else own_residuals(prim, kind, pos)
    return LayerMaps(plan, kind, layer_vjp(plan, kind, prim, own, theta, inputs, out))
