"""ℒ = I − D_UΦ and ℳ* = D_θΦ as block-sparse operators over named states and blocks.

Vectors of 𝒰 are dicts {layer name: state}; vectors of Θ are dicts {block name: block}.
Every product and solve visits only the stored blocks (the pattern); nothing is materialised
except by ``todense()``, which is meant for tiny networks.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._engine import Primal, back_substitution, forward_substitution, param_adjoint, param_forward, state_product
from .._graph import Network, Row, block_matrix_text, block_of
from .._plan import Plan
from ._operator_type import Block, IdentityBlock, LinearOperator, dense_matrix


class _Operator(LinearOperator):
    def __init__(self, lin: Any, adjoint: bool):  # the Linearization that holds this operator
        self._lin = lin
        self._adjoint = adjoint

    @property
    def linearization(self) -> Any:
        """The [`Linearization`][linbackprop.Linearization] this operator belongs to (its states
        and parameters)."""
        return self._lin

    @property
    def adjoint(self) -> bool:
        """Whether this is the adjoint (ℒ*, ℳ*) of ℒ or ℳ."""
        return self._adjoint

    @property
    def symbol(self) -> str:
        base = "ℒ" if isinstance(self, StateOperator) else "ℳ"
        return base + ("*" if self._adjoint else "")

    @property
    def _plan(self) -> Plan:
        return self._lin._plan

    @property
    def _prim(self) -> Primal:
        return self._lin._prim

    def _check(self, x: Mapping, names: tuple, space: str) -> None:
        if not isinstance(x, Mapping):
            raise TypeError(f"Vectors of {space} are dicts keyed by name, got {type(x).__name__}.")
        missing = [n for n in names if n not in x]
        extra = [n for n in x if n not in names]
        if missing or extra:
            raise KeyError(f"A vector of {space} needs exactly the keys {list(names)!r}; "
                           f"missing {missing!r}, unexpected {extra!r}.")

    def _states_in(self, e: Mapping) -> list[Any]:
        net = self._plan.net
        self._check(e, net.order, "𝒰 (states)")
        return self._plan.pack_states(dict(e), tangent=True)

    def _states_out(self, bufs: list[Any]) -> dict:
        return self._plan.unpack(bufs, self._plan.net.order, self._plan.state_loc, self._plan.state_groups)

    def _params_in(self, h: Mapping) -> list[Any]:
        self._check(h, self._plan.net.param_names, "Θ (parameters)")
        return self._plan.pack_params(dict(h), tangent=True)

    def _params_out(self, bufs: list[Any]) -> dict:
        return self._plan.unpack(bufs, self._plan.net.param_names, self._plan.param_loc, self._plan.param_groups)

    def _dense(self, fn: Callable[[dict], dict], in_example: dict, in_names: tuple) -> jax.Array:
        return dense_matrix(lambda x: [fn(dict(zip(in_names, x)))[n] for n in self._out_names],
                      [in_example[n] for n in in_names])


class StateOperator(_Operator):
    r"""ℒ = I − $D_U\Phi$ (unit lower block triangular), or its adjoint ℒ* with ``.T``.

    Block (i, j) is $-\partial\Phi_i/\partial U_j$, stored only where layer i reads layer j: the pattern below the
    diagonal is the DAG.

    Attributes:
        T: ℒ* for ℒ (and ℒ for ℒ*).
        pattern: the [N, N] bool block pattern: the identity and the DAG's reads.

    Examples:
        >>> import jax.numpy as jnp, linbackprop as lbp
        >>> step = lambda th, u: jnp.tanh(u @ th[0])
        >>> net = lbp.Network([lbp.Layer(i, step, (i - 1,), (("W", i),)) for i in (1, 2, 3)],
        ...                   [0], 3)
        >>> params = {("W", i): jnp.eye(2) for i in (1, 2, 3)}
        >>> lin = lbp.linearize(net, params, jnp.ones((1, 2)))
        >>> g = {i: jnp.ones((1, 2)) for i in (1, 2, 3)}
        >>> lam = lin.L.T.solve(g)                         # back substitution: ℒ* Λ = g
        >>> bool(jnp.allclose(lin.L.T.mv(lam)[1], g[1]))
        True
        >>> lin.L.todense().shape
        (6, 6)
    """

    @property
    def T(self) -> StateOperator:  # noqa: N802
        return StateOperator(self._lin, not self._adjoint)

    @property
    def _out_names(self) -> tuple:
        return self._plan.net.order

    def mv(self, e: Mapping) -> dict:
        """ℒ E (or ℒ* E): every layer at once.

        Args:
            e: a dict over the states (``net.order``, inputs included) of state-shaped values.

        Returns:
            The product, a dict over the same states.
        """
        product = self._lin._staged(state_product, adjoint=self._adjoint)
        return self._states_out(product(self._prim, self._states_in(e)))

    def solve(self, g: Mapping) -> dict:
        """Z with ℒ Z = G by forward substitution, or Λ with ℒ* Λ = G by back substitution.

        Args:
            g: a dict over the states (those left out are zero), e.g. ∇_Uℓ for ℒ*.

        Returns:
            Z (or Λ), a dict over every state.
        """
        if self._adjoint:
            sub = self._lin._staged(back_substitution, grads=None, compact=False, every_row=False)
        else:
            sub = self._lin._staged(forward_substitution, h=None, compact=False, rhs_full=False)
        return self._states_out(sub(self._prim, self._states_in(g)))

    @property
    def pattern(self) -> np.ndarray:
        """N x N bool over ``net.order``: True where a block is stored (identity included)."""
        p = state_pattern(self._plan.net)
        return p.T.copy() if self._adjoint else p

    def todense(self) -> jax.Array:
        """The dense matrix: states flattened (C order), concatenated along ``net.order``."""
        return self._dense(self.mv, self._lin.layer_states, self._plan.net.order)

    def block(self, i: Hashable, j: Hashable) -> Block:
        r"""Block (i, j) as a linear map with its adjoint (ℒ* blocks with ``.T``).

        Args:
            i: the state of the block row (the layer whose inputs it differentiates).
            j: the state of the block column (one that layer reads).

        Returns:
            ℐ on the diagonal, $-\partial\Phi_i/\partial U_j$ below it.

        Raises:
            KeyError: layer ``i`` does not read ``j`` (the block is zero).
        """
        if self._adjoint:
            return self.T.block(j, i).T
        net, states = self._plan.net, self._lin.states
        if i == j and i in net.order:
            return IdentityBlock("ℐ", i, j, lambda x: x, lambda x: x, states[j], states[i])
        layer = _layer(net, i)
        if j not in layer.reads:
            raise KeyError(f"Block ({i!r}, {j!r}) of ℒ is zero: layer {i!r} does not read {j!r}.")
        vjp, out_aval = self._lin._layer_vjp(layer)
        reads = [r for r, name in enumerate(layer.reads) if name == j]  # a state read twice: both

        def adjoint(lam):
            cts = vjp(lam)
            return jax.tree.map(lambda *c: -sum(c), *(cts[1 + r] for r in reads))

        return Block("ℒ", i, j, lambda e: jax.linear_transpose(adjoint, out_aval)(e)[0], adjoint,
                     states[j], states[i])

    def __repr__(self) -> str:
        net, p = self._plan.net, self.pattern
        symbol = "ℒ′" if self._adjoint else "ℒ"
        title = f"{p.shape[0]}×{p.shape[1]} {symbol} over layers {list(net.order)!r}: {int(p.sum())} stored blocks"
        return block_matrix_text(p, net.order, net.order, symbol, title, diagonal="ℐ")


class ParamOperator(_Operator):
    r"""ℳ : 𝒰 → Θ (the adjoint of ℳ* = $D_\theta\Phi$), or ℳ* with ``.T``.

    ℳ Λ sums, for every block $\theta_k$, $(\partial\Phi_i/\partial\theta_k)^* \Lambda_i$ over the layers i that use
    $\theta_k$.

    Attributes:
        T: ℳ* for ℳ (and ℳ for ℳ*).
        pattern: the bool pattern of which layer uses which parameter block (blocks by
            layers for ℳ, transposed for ℳ*).

    Examples:
        >>> import jax.numpy as jnp, linbackprop as lbp
        >>> scale = lambda th, u: u * th[0]
        >>> net = lbp.Network([lbp.Layer(1, scale, (0,), ("a",)),
        ...                    lbp.Layer(2, scale, (1,), ("a",))], [0], 2)
        >>> lin = lbp.linearize(net, {"a": 3.0}, 2.0)          # U₁ = 6, U₂ = 18
        >>> float(lin.M.mv({1: 1.0, 2: 1.0})["a"])            # ∂Φ₁/∂a + ∂Φ₂/∂a = U₀ + U₁
        8.0
        >>> lin.M.pattern.tolist()  # block "a" is shared by both layers
        [[True, True]]
    """

    @property
    def T(self) -> ParamOperator:  # noqa: N802
        return ParamOperator(self._lin, not self._adjoint)

    @property
    def _out_names(self) -> tuple:
        return self._plan.net.order if self._adjoint else self._plan.net.param_names

    def mv(self, x: Mapping) -> dict:
        """ℳ Λ (dict over blocks), or ℳ* h (dict over layers) with ``.T``.

        Args:
            x: Λ, a dict over the states (ℳ), or h, a dict over the parameter blocks (ℳ*).

        Returns:
            A dict over the parameter blocks (ℳ), or over the layers' states (ℳ*).
        """
        plan, prim = self._plan, self._prim
        if self._adjoint:
            zero = [g.zeros(plan.unrolled, tangent=True) if g.differentiable else None for g in plan.state_groups]
            return self._states_out(self._lin._staged(param_forward)(prim, self._params_in(x), zero))
        return self._params_out(self._lin._staged(param_adjoint)(prim, self._states_in(x)))

    @property
    def pattern(self) -> np.ndarray:
        """K x N bool over (``net.param_names``, ``net.order``); N x K for ℳ*."""
        p = param_pattern(self._plan.net)
        return p.T.copy() if self._adjoint else p

    def todense(self) -> jax.Array:
        if self._adjoint:
            return self._dense(self.mv, self._lin.params, self._plan.net.param_names)
        return self._dense(self.mv, self._lin.layer_states, self._plan.net.order)

    def block(self, k: Hashable, i: Hashable) -> Block:
        r"""Block (k, i) of ℳ: $\Lambda_i \mapsto (\partial\Phi_i/\partial\theta_k)^* \Lambda_i$ (ℳ* blocks with
        ``.T``).

        Args:
            k: the parameter block.
            i: the layer.

        Returns:
            The block as an operator with its adjoint.

        Raises:
            KeyError: layer ``i`` does not use block ``k`` (the block is zero).
        """
        if self._adjoint:
            return self.T.block(i, k).T
        layer = _layer(self._plan.net, i)
        slots = [n for n, p in enumerate(layer.params) if block_of(p) == k]
        if not slots:
            raise KeyError(f"Block ({k!r}, {i!r}) of ℳ is zero: layer {i!r} does not use block {k!r}.")
        vjp, out_aval = self._lin._layer_vjp(layer)
        whole = self._lin.params[k]

        def adjoint(lam):
            cts = vjp(lam)[0]
            total = jax.tree.map(jnp.zeros_like, whole)
            for n in slots:  # a Row's cotangent lands in its row of the stacked block
                p = layer.params[n]
                add = (lambda t, c, r=p.index: t.at[r].add(c)) if isinstance(p, Row) else (lambda t, c: t + c)
                total = jax.tree.map(add, total, cts[n])
            return total

        return Block("ℳ", k, i, adjoint, lambda h: jax.linear_transpose(adjoint, out_aval)(h)[0],
                     self._lin.states[i], whole)

    def __repr__(self) -> str:
        net, p = self._plan.net, self.pattern
        if self._adjoint:
            title = f"{p.shape[0]}×{p.shape[1]} ℳ* (layers × parameter blocks): {int(p.sum())} stored blocks"
            return block_matrix_text(p, net.order, net.param_names, "ℳ′", title)
        title = f"{p.shape[0]}×{p.shape[1]} ℳ (parameter blocks × layers): {int(p.sum())} stored blocks"
        return block_matrix_text(p, net.param_names, net.order, "ℳ", title)


def _layer(net: Network, name: Hashable):
    for layer in net.layers:
        if layer.name == name:
            return layer
    raise KeyError(f"No layer named {name!r}; the layers are {list(net.order)!r}.")


def state_pattern(net: Network) -> np.ndarray:
    index = {name: n for n, name in enumerate(net.order)}
    p = np.eye(len(index), dtype=bool)
    for layer in net.layers:
        for r in layer.reads:
            if r in index:
                p[index[layer.name], index[r]] = True
    return p


def param_pattern(net: Network) -> np.ndarray:
    index = {name: n for n, name in enumerate(net.param_names)}
    p = np.zeros((len(index), len(net.order)), dtype=bool)
    for i, layer in enumerate(net.layers):
        for k in layer.params:
            p[index[block_of(k)], i] = True
    return p
