"""A Network call in solve mode: `network_call` (what ``Network.__call__`` runs inside the transforms), a
``jax.custom_jvp`` per network whose rule is the forward substitution, and its solves.

    ℒ Z = ℳ* h + E₀ dU₀        (forward substitution; E₀ places the input tangents)
    outputs' tangents = 𝒫 Z

is the call's JVP rule, and the solve is a linear-solve primitive of our own (``_primitive``) whose
transpose is the back substitution ℒ* Λ = 𝒫* ḡ. Reverse mode is JAX transposing that rule: the
back substitution runs, then ℳ Λ — the transpose of the batched ℳ* h — is applied to all layers of
a kind at once, after the loop (or in it: the call's `SolveVariant`). Under ``jvp_by_solve`` alone, whose
tangents are never transposed, the rule runs the substitution inside the forward loop instead (one
JVP per layer, nothing stored).

The settings are read where JAX calls in — `network_call` from the user's code, the primal and
the rule of the custom JVP from JAX — and passed down from there.
"""

from __future__ import annotations

import collections
import functools
import threading
from collections.abc import Callable
from typing import Any

import jax
from jax.custom_derivatives import SymbolicZero

from .._engine import Primal, forward
from .._graph import Network, mesh_of
from .._options import Settings, current, settings_changed
from .._plan import Plan, current_plan, plan_for, plans_generation
from ._boundary import anchor, moves_params, outputs_of, symbolic, zero_tangent
from ._checkpoint import checkpointed_call
from ._choice import solve_variant
from ._memory_model import checkpoint_levels
from ._segments import row_spans
from ._variant import StoredSolve


def network_call(net: Network, theta: dict, inputs: tuple[Any, ...]) -> Any:
    """A Network call in solve mode (``Network.__call__`` runs it where the transforms name it
    their solver): ``theta`` the network's blocks, the arguments checked."""
    live = net.live  # layers that reach no output are not part of the solve
    if live is None:  # the outputs are network inputs: nothing to solve (JAX differentiates them)
        return net.pick_outputs(dict(zip(net.inputs, inputs)))
    theta = {p: theta[p] for p in live.param_names}
    settings = current()
    plan = current_plan(live, theta, inputs, settings.engine, settings.policy)  # anew where a layer changed
    levels = checkpoint_levels(plan, theta, inputs, settings)
    if levels is not None:
        with mesh_of((theta, inputs)), settings_changed(segments=True):
            # Nested: stacked inputs go down whole, each level adding its offset (a cut per
            # segment would copy the rows of every level).
            whole = {x: 0 for x in live.stacked_inputs} if len(levels) > 1 else {}
            return checkpointed_call(live, theta, tuple(inputs), levels[0], _checkpointed(levels[1:], settings),
                                     whole, settings.policy.longest_checkpoint_period)
    with mesh_of((theta, inputs)):
        outs = _jitted_call_by_solve(live, theta, tuple(inputs))
    return outs[0] if net.single_output else outs


def _checkpointed(levels: tuple[int, ...], settings: Settings) -> Callable[[Network, dict, tuple, dict], tuple]:
    """A network call checkpointed with ``levels[0]`` states, each of its segments called the same
    way with the levels below (the nested schedule; one level: evenly spaced). Stacked inputs
    come whole with the row to start from (``offsets``); the solve at the leaves slices them."""
    if not levels:
        def leaf(net: Network, theta: dict, inputs: tuple, offsets: dict) -> tuple:
            if offsets:
                spans = row_spans(net)
                inputs = tuple(jax.tree.map(lambda a, x=x: jax.lax.dynamic_slice_in_dim(a, offsets[x], spans[x]), v)
                               if x in offsets else v for x, v in zip(net.inputs, inputs))
            return _jitted_call_by_solve(net, theta, inputs)

        return leaf
    inner = _checkpointed(levels[1:], settings)

    def call(net: Network, theta: dict, inputs: tuple, offsets: dict) -> tuple:
        if levels[0] >= len(net.layers) - 1:  # too short to cut: the level below
            return tuple(inner(net, theta, inputs, offsets))
        return tuple(checkpointed_call(net, theta, inputs, levels[0], inner, offsets,
                                       settings.policy.longest_checkpoint_period))

    return call


def _call_by_solve(net: Network, theta: dict, inputs: tuple) -> tuple[Any, ...]:
    """The call's outputs (the primal of the custom JVP made per network in ``_jitted_call_by_solve``)."""
    return _outputs_by_solve(net, theta, inputs, current())


def _outputs_by_solve(net: Network, theta: dict, inputs: tuple, settings: Settings) -> tuple[Any, ...]:
    """The call's outputs from a forward pass that keeps only what is read again."""
    plan = plan_for(net, theta, inputs, settings.engine, settings.policy).compact
    prim = forward(plan, plan.pack_params(theta), plan.pack_states(dict(zip(net.inputs, inputs))),
                   residuals=False)
    return outputs_of(plan, prim.states)


def _call_by_solve_jvp(net: Network, primals: tuple, tangents: tuple) -> tuple:
    """The JVP rule of a network call: the outputs and their tangents 𝒫 Z, where ℒ Z = ℳ* h + E₀ dU₀,
    solved as the call's `SolveVariant` says."""
    theta, inputs = primals
    dtheta, dinputs = tangents
    settings = current()
    plan = plan_for(net, theta, inputs, settings.engine, settings.policy)
    if anchor(dtheta, dinputs) is None:  # no tangent of floats anywhere: the outputs' tangents are zeros
        return (_outputs_by_solve(net, theta, inputs, settings),
                tuple(zero_tangent(plan, o) for o in net.output_spec))
    variant = solve_variant(plan, settings, moves_params(net, dtheta))
    return variant.jvp(theta, inputs, dtheta, dinputs, settings)


def stored_tangents(plan: Plan, prim: Primal, settings: Settings, dtheta: dict, dinputs: tuple | None = None
                    ) -> tuple[Any, ...]:
    """The output items' tangents 𝒫 Z on a stored forward pass ``prim``: ℒ Z = ℳ* h + E₀ dU₀ as
    a transposable linear solve — reverse mode is its transpose, the back substitution, with ℳΛ
    where the call's `SolveVariant` forms it (batched after it, the transpose of the batched ℳ* h,
    or in the loop). ``dinputs`` None: the inputs held (data)."""
    net = plan.net
    dinputs = tuple(None for _ in net.inputs) if dinputs is None else dinputs
    variant = solve_variant(plan, settings, moves_params(net, dtheta))
    if not isinstance(variant, StoredSolve):
        raise ValueError(f"{variant!r} stores no linearisation: the curvature transforms solve on a stored "
                         "forward pass, which jvp_by_solve's settings (forward_only) do not keep.")
    return variant.stored_tangents(prim, dtheta, dinputs)


# A network call is a jax.custom_jvp whose primal (_call_by_solve) and rule (_call_by_solve_jvp,
# its symbolic zeros static) are each a jax.jit: called eagerly, JAX compiles the solve (and its
# JVP and transpose) as a whole instead of dispatching its operations one by one, and the traces
# are cached (a loss that calls one network many times traces the rule once). Under
# differentiation only the rule is traced; a jit around the custom_jvp would trace the
# undifferentiated forward pass as well (the tracing times: docs/performance.md).
#
# One custom_jvp and jit per network, the most recently used JITTED_NETWORKS kept: JAX's caches
# hold a function's traces, executables and what its layers close over weakly keyed on the
# function, so they go with it, and a program that builds networks in a loop keeps memory bounded.
# (One global custom_jvp with the network as a static argument would keep every network until
# JAX's own LRU caches evicted it, thousands of them.)
JITTED_NETWORKS = 32
_jitted: collections.OrderedDict[tuple[Network, int], Callable] = collections.OrderedDict()
_jitted_lock = threading.Lock()


def _solver_of(net: Network) -> Callable:
    call = jax.custom_jvp(jax.jit(functools.partial(_call_by_solve, net)))
    rule = jax.jit(functools.partial(_rule_with_zeros, net), static_argnums=0)

    def jvp(primals: tuple, tangents: tuple) -> tuple:
        leaves, treedef = jax.tree.flatten(tangents, is_leaf=symbolic)
        zeros = tuple(leaf.aval if symbolic(leaf) else None for leaf in leaves)
        return rule((treedef, zeros), primals, [leaf for leaf in leaves if not symbolic(leaf)])

    call.defjvp(jvp, symbolic_zeros=True)
    return call


def _rule_with_zeros(net: Network, layout: tuple, primals: tuple, given: list) -> tuple:
    """The JVP rule, jitted: the symbolic zeros of the tangents are static (``layout``)."""
    treedef, zeros = layout
    rest = iter(given)
    leaves = [SymbolicZero(aval) if aval is not None else next(rest) for aval in zeros]
    return _call_by_solve_jvp(net, primals, jax.tree.unflatten(treedef, leaves))


def _jitted_call_by_solve(net: Network, theta: dict, inputs: tuple) -> tuple[Any, ...]:
    key = (net, plans_generation())  # a new generation of plans: compiled anew (see current_plan)
    with _jitted_lock:
        call = _jitted.get(key)
        if call is None:
            for old in [k for k in _jitted if k[1] != key[1]]:
                del _jitted[old]
            call = _jitted[key] = _solver_of(net)
            if len(_jitted) > JITTED_NETWORKS:
                _jitted.popitem(last=False)
        else:
            _jitted.move_to_end(key)
    return call(theta, inputs)
