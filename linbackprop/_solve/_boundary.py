"""A network call's boundary with the solve: the forward pass that stores the linearisation
(`prepare`), the inputs' tangents placed on their rows (E₀ dU₀, `input_tangents`) and the outputs
read from theirs (𝒫 U and 𝒫 Z: `outputs_of`, `output_tangents`) — what every `SolveVariant`
shares around its own substitutions.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from .._engine import Primal, forward, read_row, read_rows
from .._graph import Network, Stack, explicit_sharding, stack_trees, take, zeros_of
from .._options import Settings
from .._plan import Plan, RowList, differentiable_dtype, plan_for


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


def outputs_of(plan: Plan, bufs: list[Any]) -> tuple[Any, ...]:
    """The call's output items (as ``net(...)`` returns them, always a tuple) from the state
    buffers: a name's row, or a Stack's rows (one slice where they are consecutive, else one
    gather)."""
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


def is_zero(t: Any) -> bool:
    return all(isinstance(leaf, SymbolicZero) for leaf in jax.tree.leaves(t, is_leaf=symbolic))


def symbolic(x: Any) -> bool:
    return isinstance(x, SymbolicZero)


def instantiate(t: Any) -> Any:
    """Symbolic zeros as arrays (None where the leaf has no tangent: a float0 zero)."""
    def one(z):
        if not symbolic(z):
            return z
        if not differentiable_dtype(z.aval.dtype):
            return None
        return zeros_of(z.aval)

    if isinstance(t, dict):  # by name: names may mix types (0 and "xs"), which pytrees cannot sort
        return {name: jax.tree.map(one, v, is_leaf=symbolic) for name, v in t.items()}
    return jax.tree.map(one, t, is_leaf=symbolic)


def anchor(dtheta: Any, dinputs: Any) -> jax.Array | None:
    """A tangent leaf of floats, if any."""
    return next((leaf for leaf in jax.tree.leaves((dtheta, dinputs), is_leaf=symbolic)
                 if not symbolic(leaf) and differentiable_dtype(leaf.dtype)), None)


def input_tangents(plan: Plan, dinputs: tuple) -> list[Any]:
    """E₀ dU₀: the inputs' tangents on the identity rows of the inputs (tangent layout). Groups of
    inputs alone, none with a tangent, get no buffer (None): the back substitution then forms no
    cotangent for them (a stacked sequence xs read at every step, say)."""
    given = {name: dx for name, dx in zip(plan.net.inputs, dinputs) if not is_zero(dx)}
    bufs = plan.pack_states(instantiate(given), tangent=True)
    moving = {plan.state_loc[name][0] for name in given}
    return [None if g in plan.input_only_groups and g not in moving else b for g, b in enumerate(bufs)]


def zeros_made_with(anchor: jax.Array, bufs: list[Any], keep: set[int]) -> list[Any]:
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


def moves_params(net: Network, dtheta: dict) -> bool:
    return not all(is_zero(dtheta[p]) for p in net.param_names)


def _tangent_or_zero(plan: Plan, item: Hashable | Stack, z: list[Any]) -> Any:
    """The tangent of an output item from the solution Z, as JAX wants it (float0 zeros at leaves
    without tangents)."""
    g, rows = _rows_of(plan, item)
    if g is None:
        return stack_trees([_tangent_or_zero(plan, name, z) for name in item.names])
    if z[g] is None:
        return zero_tangent(plan, item)
    group = plan.state_groups[g]
    if rows is None:  # a stacked input returned as an output
        return group.full_tangent(z[g], (group.rows,))
    if isinstance(item, Stack):
        return group.full_tangent(read_rows(z[g], rows), (len(rows),))
    return group.full_tangent(read_row(z[g], rows))


def zero_tangent(plan: Plan, item: Hashable | Stack) -> Any:
    g, rows = _rows_of(plan, item)
    if g is None:
        return stack_trees([zero_tangent(plan, name) for name in item.names])
    group = plan.state_groups[g]
    if rows is None or isinstance(item, Stack):
        lead = (group.rows if rows is None else len(rows),)
        return group.full_tangent(jax.tree.map(lambda a: zeros_of(a, lead), group.row_avals(True)), lead)
    return group.full_tangent(group.row_zeros(tangent=True))
