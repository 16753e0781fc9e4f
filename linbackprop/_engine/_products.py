"""The parallel parts: one vmapped application per kind — ℒ's off-diagonal product and its
adjoint (`state_product`), ℳ*h (`param_forward`) and ℳΛ (`param_adjoint`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._plan import Plan
from ._loop import layer_arguments, own_residuals
from ._maps import LayerMaps, layer_vjp
from ._rows import Primal, read_row, read_rows, scatter_add


# -- the parallel parts: one vmapped application per kind -------------------------------------------
def _per_kind(plan: Plan, prim: Primal, k: int, apply: Callable[[LayerMaps, Any], Any], args: Any,
              args_axes: Any = 0) -> Any:
    """``apply`` to every member layer of kind k at once, vmapped over the stacked residuals
    (``args_axes``: as vmap's in_axes for ``args``; None where all members take the same value)."""
    kind = plan.kinds[k]
    members = np.arange(kind.size)
    # A weight shared along a sequence goes in once: with remat the layers are re-linearised here,
    # and n gathered copies of it were kept (a 15-layer segment of an RNN: 15 copies of A and B).
    theta, inputs = layer_arguments(plan, kind, prim, members, shared_once=True)
    theta_axes = tuple(0 if row is None else None for row in kind.shared_rows)
    own = None if prim.residuals is None else own_residuals(prim, kind, members)
    out = read_rows(prim.states[kind.out_group], kind.by_member.out[:-1])

    def one(theta, inputs, own, out, a):
        return apply(LayerMaps(plan, kind, layer_vjp(plan, kind, prim, own, theta, inputs, out)), a)

    return jax.vmap(one, in_axes=(theta_axes, 0, 0, 0, args_axes))(theta, inputs, own, out, args)


def state_product(plan: Plan, prim: Primal, e: list[Any], adjoint: bool = False) -> list[Any]:
    """ℒ E = E − D_UΦ E, or ℒ* E with ``adjoint``; every layer at once (no recursion)."""
    out = list(e)
    for k, kind in enumerate(plan.kinds):
        n = kind.size
        if e[kind.out_group] is None:  # integer states: rows of the identity only
            continue
        if not adjoint:
            reads = tuple(read_rows(e[g], kind.by_member.reads[:n, r]) if e[g] is not None else None
                          for r, g in enumerate(kind.read_groups))
            dz = _per_kind(plan, prim, k, lambda m, a: m.state_forward(a), reads)
            g = kind.out_group
            out[g] = scatter_add(out[g], kind.by_member.out[:n], jax.tree.map(jnp.negative, dz))
        else:
            lam = read_rows(e[kind.out_group], kind.by_member.out[:n])
            cts = _per_kind(plan, prim, k, lambda m, a: m.state_adjoint(a), lam)
            for r, (g, ct) in enumerate(zip(kind.read_groups, cts)):
                if ct is not None and out[g] is not None:
                    out[g] = scatter_add(out[g], kind.by_member.reads[:n, r], jax.tree.map(jnp.negative, ct))
    return out


def param_forward(plan: Plan, prim: Primal, h: list[Any], into: list[Any]) -> list[Any]:
    """``into`` + ℳ* h (state layout): row i gets ∂Φ_i/∂θ h_{S_i}, all layers of a kind at once."""
    out = list(into)
    for k, kind in enumerate(plan.kinds):
        n = kind.size
        if out[kind.out_group] is None or not kind.param_groups:
            continue
        # A block every member uses (a weight shared along a sequence) goes in once, not gathered n
        # times: the transpose (ℳΛ in reverse mode) then sums over the members inside the product
        # instead of forming n cotangents and adding them up.
        hs = tuple(read_row(h[g], row) if row is not None else read_rows(h[g], kind.by_member.params[:n, p])
                   for p, (g, row) in enumerate(zip(kind.param_groups, kind.shared_rows)))
        axes = tuple(None if row is not None else 0 for row in kind.shared_rows)
        dz = _per_kind(plan, prim, k, lambda m, a: m.param_forward(a), hs, axes)
        g = kind.out_group
        out[g] = scatter_add(out[g], kind.by_member.out[:n], dz)
    return out


def param_adjoint(plan: Plan, prim: Primal, lam: list[Any]) -> list[Any]:
    """ℳ Λ (parameter layout): block k sums (∂Φ_i/∂θ_k)* Λ_i over the layers i that use it."""
    out = [g.zeros(plan.unrolled, tangent=True) for g in plan.param_groups]
    for k, kind in enumerate(plan.kinds):
        n = kind.size
        if lam[kind.out_group] is None or not kind.param_groups:
            continue
        lam_k = read_rows(lam[kind.out_group], kind.by_member.out[:n])
        cts = _per_kind(plan, prim, k, lambda m, a: m.param_adjoint(a), lam_k)
        for p, (g, ct) in enumerate(zip(kind.param_groups, cts)):
            out[g] = scatter_add(out[g], kind.by_member.params[:n, p], ct)
    return out
