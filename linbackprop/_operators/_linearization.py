"""The network linearised at (θ, U₀): its states, the stored linearisation of every layer, and
the operators ℒ = I − D_UΦ and ℳ built on it (``linearize``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax

from .._graph import Network, call_layer, layer_theta, resolve
from .._options import Settings, current
from .._plan import current_plan
from .._solve import prepare
from ._network_operators import ParamOperator, StateOperator


class Linearization:
    r"""The network linearised at (θ, U₀): its states and the operators ℒ and ℳ.

    ``L`` and ``M`` act on dicts; ``L.T.solve(g)`` is the back substitution of the adjoint
    equation, so ``lin.M.mv(lin.L.T.solve(grad_U))`` is the gradient ℳ (ℒ*)⁻¹ ∇_Uℓ.

    Attributes:
        net: the network.
        params: its parameter blocks, as given.
        states: every state U, ``{name: value}`` (the inputs included).
        L: ℒ = I − $D_U\Phi$, a [`StateOperator`][linbackprop.StateOperator].
        M: ℳ (ℳ* as ``M.T``), a [`ParamOperator`][linbackprop.ParamOperator].

    Examples:
        >>> import jax, jax.numpy as jnp, linbackprop as lbp
        >>> scale = lambda th, u: jnp.sin(u * th[0])
        >>> net = lbp.Network([lbp.Layer(1, scale, (0,), ("a",)),
        ...                    lbp.Layer(2, scale, (1,), ("b",))], [0], 2)
        >>> p, x = {"a": 0.5, "b": 2.0}, 1.0
        >>> lin = lbp.linearize(net, p, x)
        >>> lam = lin.L.T.solve({1: 0.0, 2: 1.0})             # ∇_Uℓ for ℓ = U₂
        >>> g = lin.M.mv(lam)
        >>> bool(jnp.allclose(g["a"], jax.grad(lambda p: net(p, x))(p)["a"]))
        True
    """

    def __init__(self, net: Network, params: Mapping, inputs: tuple[Any, ...]):
        net.check_inputs(inputs)
        self.params = net.select_params(params)
        # the default options, whatever transform linearize is called in: the plan and the
        # forward pass must agree on the engine (and keep residuals); the policy in force
        settings = Settings(policy=current().policy)
        self._plan = current_plan(net, self.params, tuple(inputs), settings.engine, settings.policy)
        self._prim = jax.jit(lambda theta, inputs: prepare(net, theta, inputs, settings)[1])(self.params,
                                                                                            tuple(inputs))
        self._jitted: dict = {}
        self.states = {**dict(zip(net.inputs, inputs)),
                       **self._plan.unpack(self._prim.states, net.order, self._plan.state_loc)}
        self.L = StateOperator(self, adjoint=False)
        self.M = ParamOperator(self, adjoint=False)

    @property
    def net(self) -> Network:
        return self._plan.net

    def _staged(self, engine_fn: Callable, **static: Any) -> Callable:
        """``engine_fn(plan, prim, *args)`` compiled once per linearisation (eager calls of the
        engine would dispatch, and compile, its operations one by one)."""
        key = (engine_fn, tuple(sorted(static.items())))
        if key not in self._jitted:
            plan = self._plan
            self._jitted[key] = jax.jit(lambda prim, *args: engine_fn(plan, prim, *args, **static))
        return self._jitted[key]

    @property
    def layer_states(self) -> dict:
        return {name: self.states[name] for name in self.net.order}

    def _layer_vjp(self, layer):
        theta = layer_theta(layer, self.params)
        inputs = tuple(resolve(r, self.states) for r in layer.reads)  # a Row: that row of a stacked input
        out, vjp = jax.vjp(lambda t, *u: call_layer(layer, t, u), theta, *inputs)
        return vjp, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), out)


def linearize(net: Network, params: Mapping, *inputs: Any) -> Linearization:
    r"""Linearise ``net`` at ``params`` and ``inputs``: ``lin.states``, ``lin.L``, ``lin.M``.

    Each layer's $\Phi_i$ is linearised once (``jax.linearize``): ℒ = I − $D_U\Phi$, unit lower block
    triangular with the DAG as its pattern, and ℳ* = $D_\theta\Phi$, as operators on dicts of states and
    of blocks.

    Args:
        net: the network.
        params: its parameter blocks, ``{block name: array}``.
        *inputs: its inputs, in ``net.inputs`` order.

    Returns:
        A [`Linearization`][linbackprop.Linearization]: the states U and the operators ℒ (``L``)
            and ℳ (``M``).

    Raises:
        KeyError: a block the network uses missing from ``params``.
        TypeError: a number of inputs other than ``net.inputs``'.

    Examples:
        >>> import jax.numpy as jnp, linbackprop as lbp
        >>> dense = lambda th, x: jnp.tanh(x @ th[0])
        >>> net = lbp.Network([lbp.Layer(1, dense, (0,), ("W1",)),
        ...                    lbp.Layer(2, dense, (1,), ("W2",))], inputs=[0], outputs=2)
        >>> lin = lbp.linearize(net, {"W1": jnp.eye(2), "W2": jnp.eye(2)}, jnp.ones((3, 2)))
        >>> lin.L.pattern.astype(int).tolist()
        [[1, 0], [1, 1]]
    """
    return Linearization(net, params, inputs)
