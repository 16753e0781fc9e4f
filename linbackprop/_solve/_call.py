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
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from .._engine import Primal, forward, read_row, read_rows
from .._graph import Network, Stack, explicit_sharding, mesh_of, stack_trees, take, zeros_of
from .._options import Settings, current, settings_changed
from .._plan import Plan, RowList, current_plan, differentiable_dtype, plan_for, plans_generation
from ._checkpoint import checkpointed_call
from ._memory_model import checkpoint_levels
from ._primitive import solve
from ._segments import row_spans
from ._variant import Params, solve_variant


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


def outputs_of(plan: Plan, bufs: list[Any]) -> tuple[Any, ...]:
    """The call's output items (as ``net(...)`` returns them, always a tuple) from state buffers."""
    return _outputs(plan, bufs)


def output_tangents(plan: Plan, z: list[Any]) -> tuple[Any, ...]:
    """The output items' tangents 𝒫 Z from state-layout tangents Z (linear in Z; its transpose
    places output cotangents into the right-hand side of the back substitution).

    The single states of one buffer are read together (`take`: one gather, whose transpose is
    one scatter): read one by one, each read's transpose pads a cotangent to the whole buffer,
    and a network returning each of its T states (a captured ``lax.scan``'s ys) spent O(T²)
    there — 2.2× ``jax.grad`` where the same network returning a ``Stack`` ran at 0.85×."""
    items = plan.net.output_spec
    by_group: dict[int, list[int]] = {}
    for n, item in enumerate(items):
        if not isinstance(item, Stack):
            g, row = _rows_of(plan, item)
            if row is not None and z[g] is not None and not isinstance(z[g], RowList):
                by_group.setdefault(g, []).append(n)
    out: list[Any] = [None] * len(items)
    for g, members in by_group.items():
        if len(members) > 1:
            rows = take(z[g], [_rows_of(plan, items[n])[1] for n in members])
            for n, row in zip(members, rows):
                out[n] = plan.state_groups[g].full_tangent(row)
    return tuple(_tangent_or_zero(plan, item, z) if value is None else value for item, value in zip(items, out))


def _outputs(plan: Plan, bufs: list[Any]) -> tuple[Any, ...]:
    """The call's results from the state buffers: a name's row, or a Stack's rows (one slice
    where they are consecutive, else one gather)."""
    singles = [item for item in plan.net.output_spec if not isinstance(item, Stack)]
    outs = plan.unpack(bufs, tuple(singles), plan.state_loc)
    result = []
    for item in plan.net.output_spec:
        g, rows = _rows_of(plan, item)
        if g is None:  # a Stack over groups that differ in weak types only: strongly typed
            result.append(stack_trees([read_row(bufs[gn], r) for gn, r in map(plan.state_loc.get, item.names)]))
            continue
        value = read_rows(bufs[g], rows) if isinstance(item, Stack) else outs[item]
        result.append(plan.state_groups[g].typed(value))
    return tuple(result)


def _rows_of(plan: Plan, item: Hashable | Stack) -> tuple[int | None, Any]:
    """The group and row (a Stack: the rows, as a static table) of an output item; (None, None)
    for a Stack whose states lie in several groups (same types but for weak types)."""
    if isinstance(item, Stack):
        if len({plan.state_loc[n][0] for n in item.names}) > 1:
            return None, None
        return plan.state_loc[item.names[0]][0], np.array([plan.state_loc[n][1] for n in item.names], np.int32)
    return plan.state_loc[item]


def prepare(net: Network, theta: dict[Hashable, Any], inputs: tuple[Any, ...],
            settings: Settings) -> tuple[Plan, Primal]:
    """The plan at these shapes and the forward pass with every layer's residuals (only the
    states with ``settings.remat``)."""
    plan = plan_for(net, theta, inputs, settings.engine, settings.policy)
    prim = _forward_pass(plan, not settings.remat, plan.pack_params(theta),
                         plan.pack_states(dict(zip(net.inputs, inputs))))
    return plan, prim


# The forward pass as a custom_jvp whose rule is its plain JVP: a network call's JVP rule is
# partially evaluated under jax.grad, and JAX's partial evaluation of a loop re-analyses its body
# even where every input is known (the forward pass's are); a custom_jvp call with known inputs is
# bound as it is (less tracing: docs/performance.md, "Measurements behind the code").
@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _forward_pass(plan: Plan, residuals: bool, params: list[Any], states: list[Any]) -> Primal:
    return forward(plan, params, states, residuals=residuals)


@_forward_pass.defjvp
def _forward_pass_jvp(plan: Plan, residuals: bool, primals: tuple, tangents: tuple) -> tuple:
    return jax.jvp(lambda p, s: forward(plan, p, s, residuals=residuals), primals, tangents)


def _call_by_solve(net: Network, theta: dict, inputs: tuple) -> tuple[Any, ...]:
    """The call's outputs (the primal of the custom JVP made per network in ``_jitted_call_by_solve``)."""
    return _outputs_by_solve(net, theta, inputs, current())


def _outputs_by_solve(net: Network, theta: dict, inputs: tuple, settings: Settings) -> tuple[Any, ...]:
    """The call's outputs from a forward pass that keeps only what is read again."""
    plan = plan_for(net, theta, inputs, settings.engine, settings.policy).compact
    prim = forward(plan, plan.pack_params(theta), plan.pack_states(dict(zip(net.inputs, inputs))),
                   residuals=False)
    return _outputs(plan, prim.states)


def _is_zero(t: Any) -> bool:
    return all(isinstance(leaf, SymbolicZero) for leaf in jax.tree.leaves(t, is_leaf=_symbolic))


def _symbolic(x: Any) -> bool:
    return isinstance(x, SymbolicZero)


def _instantiate(t: Any) -> Any:
    """Symbolic zeros as arrays (None where the leaf has no tangent: a float0 zero)."""
    def one(z):
        if not _symbolic(z):
            return z
        if not differentiable_dtype(z.aval.dtype):
            return None
        return zeros_of(z.aval)

    if isinstance(t, dict):  # by name: names may mix types (0 and "xs"), which pytrees cannot sort
        return {name: jax.tree.map(one, v, is_leaf=_symbolic) for name, v in t.items()}
    return jax.tree.map(one, t, is_leaf=_symbolic)


def _call_by_solve_jvp(net: Network, primals: tuple, tangents: tuple) -> tuple:
    """The JVP rule of a network call: the outputs and their tangents 𝒫 Z, where ℒ Z = ℳ* h + E₀ dU₀."""
    theta, inputs = primals
    dtheta, dinputs = tangents
    settings = current()
    plan = plan_for(net, theta, inputs, settings.engine, settings.policy)
    anchor = _anchor(dtheta, dinputs)
    if anchor is None:  # no tangent of floats anywhere: the outputs' tangents are zeros
        return (_outputs_by_solve(net, theta, inputs, settings),
                tuple(_zero_tangent(plan, o) for o in net.output_spec))
    if settings.forward_only:
        return _jvp_in_forward_sweep(plan.compact, theta, inputs, dtheta, dinputs)
    return _jvp_by_linear_solve(plan, settings, theta, inputs, dtheta, dinputs)


def _anchor(dtheta: Any, dinputs: Any) -> jax.Array | None:
    """A tangent leaf of floats, if any."""
    return next((leaf for leaf in jax.tree.leaves((dtheta, dinputs), is_leaf=_symbolic)
                 if not _symbolic(leaf) and differentiable_dtype(leaf.dtype)), None)


def _input_tangents(plan: Plan, dinputs: tuple) -> list[Any]:
    """E₀ dU₀: the inputs' tangents on the identity rows of the inputs (tangent layout). Groups of
    inputs alone, none with a tangent, get no buffer (None): the back substitution then forms no
    cotangent for them (a stacked sequence xs read at every step, say)."""
    given = {name: dx for name, dx in zip(plan.net.inputs, dinputs) if not _is_zero(dx)}
    bufs = plan.pack_states(_instantiate(given), tangent=True)
    moving = {plan.state_loc[name][0] for name in given}
    return [None if g in plan.input_only_groups and g not in moving else b for g, b in enumerate(bufs)]


def _zeros_made_with(anchor: jax.Array, bufs: list[Any], keep: set[int]) -> list[Any]:
    """The buffers (but those in ``keep``) as zeros computed from ``anchor`` (a tangent), though
    not from its values.

    Under ``jax.linearize`` (a Gauss–Newton operator) zeros made from constants are computed with
    the primal and stored in the linear function, which then reads, and copies to write into, a
    [depth, batch, width] buffer of zeros for every product; zeros made from a tangent are made
    inside it, where XLA folds them away. Explicitly sharded buffers keep their sharded zeros."""
    def one(z):
        if explicit_sharding(z) is not None:
            return z
        empty = jnp.ravel(anchor)[:0].astype(z.dtype)
        return jax.lax.pad(empty, jnp.zeros((), z.dtype), [(z.size, 0, 0)]).reshape(z.shape)

    return [b if b is None or g in keep else jax.tree.map(one, b) for g, b in enumerate(bufs)]


def _moves_params(net: Network, dtheta: dict) -> bool:
    return not all(_is_zero(dtheta[p]) for p in net.param_names)


def _jvp_in_forward_sweep(plan: Plan, theta: dict, inputs: tuple, dtheta: dict, dinputs: tuple) -> tuple:
    """jvp_by_solve, whose tangents are never transposed: the forward substitution runs inside the
    forward sweep (one JVP per layer, nothing stored)."""
    net = plan.net
    h = plan.pack_params(_instantiate(dtheta), tangent=True) if _moves_params(net, dtheta) else None
    prim, z = forward(plan, plan.pack_params(theta), plan.pack_states(dict(zip(net.inputs, inputs))),
                      residuals=False, tangents=(h, _input_tangents(plan, dinputs)))
    return _outputs(plan, prim.states), output_tangents(plan, z)


def _jvp_by_linear_solve(plan: Plan, settings: Settings, theta: dict, inputs: tuple, dtheta: dict,
                         dinputs: tuple) -> tuple:
    """The forward pass with residuals, then ℒ Z = ℳ* h + E₀ dU₀ as a transposable linear solve
    (`stored_tangents`)."""
    prim = prepare(plan.net, theta, inputs, settings)[1]
    return _outputs(plan, prim.states), stored_tangents(plan, prim, settings, dtheta, dinputs)


def stored_tangents(plan: Plan, prim: Primal, settings: Settings, dtheta: dict, dinputs: tuple | None = None
                    ) -> tuple[Any, ...]:
    """The output items' tangents 𝒫 Z on a stored forward pass ``prim``: ℒ Z = ℳ* h + E₀ dU₀ as
    a transposable linear solve — reverse mode is its transpose, the back substitution, with ℳΛ
    where the call's `SolveVariant` forms it (batched after it, the transpose of the batched ℳ* h,
    or in the loop). ``dinputs`` None: the inputs held (data)."""
    net = plan.net
    dinputs = tuple(None for _ in net.inputs) if dinputs is None else dinputs
    variant = solve_variant(plan, settings, _moves_params(net, dtheta))
    # rhs in the layout of Z (compact: at the input rows alone), but where ℳ* h is formed before
    # the loop (rhs_full: every row of the full layout).
    layout = plan.compact if variant.compact and not variant.rhs_full else plan
    rhs = _input_tangents(layout, dinputs)
    h = None
    if variant.params is not Params.NONE:  # groups without input tangents: zeros made in the linear program
        given = {layout.state_loc[name][0] for name, dx in zip(net.inputs, dinputs) if not _is_zero(dx)}
        rhs = _zeros_made_with(_anchor(dtheta, dinputs), rhs, keep=given)
        h = plan.pack_params(_instantiate(dtheta), tangent=True)
    # Parts of rhs built from symbolic zeros alone are constants: the solve's transpose gives
    # them no cotangent (see _primitive).
    z = solve(plan, prim, h, rhs, variant)
    layout = plan.compact if variant.compact else plan  # of Z
    return output_tangents(layout, z)


def _tangent_or_zero(plan: Plan, item: Hashable | Stack, z: list[Any]) -> Any:
    """The tangent of an output item from the solution Z, as JAX wants it (float0 zeros at leaves
    without tangents)."""
    g, rows = _rows_of(plan, item)
    if g is None:
        return stack_trees([_tangent_or_zero(plan, name, z) for name in item.names])
    if z[g] is None:
        return _zero_tangent(plan, item)
    group = plan.state_groups[g]
    if rows is None:  # a stacked input returned as an output
        return group.full_tangent(z[g], (group.rows,))
    if isinstance(item, Stack):
        return group.full_tangent(read_rows(z[g], rows), (len(rows),))
    return group.full_tangent(read_row(z[g], rows))


def _zero_tangent(plan: Plan, item: Hashable | Stack) -> Any:
    g, rows = _rows_of(plan, item)
    if g is None:
        return stack_trees([_zero_tangent(plan, name) for name in item.names])
    group = plan.state_groups[g]
    if rows is None or isinstance(item, Stack):
        lead = (group.rows if rows is None else len(rows),)
        return group.full_tangent(jax.tree.map(lambda a: zeros_of(a, lead), group.row_avals(True)), lead)
    return group.full_tangent(group.row_zeros(tangent=True))


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
        leaves, treedef = jax.tree.flatten(tangents, is_leaf=_symbolic)
        zeros = tuple(leaf.aval if _symbolic(leaf) else None for leaf in leaves)
        return rule((treedef, zeros), primals, [leaf for leaf in leaves if not _symbolic(leaf)])

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
