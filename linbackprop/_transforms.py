"""grad_by_solve, value_and_grad_by_solve, jvp_by_solve: JAX's transforms, with every Network
call differentiated by the linear solve.

How a Network call is differentiated:

    ℒ Z = ℳ* h + E₀ dU₀        (forward substitution; E₀ places the input tangents)
    outputs' tangents = 𝒫 Z

is the call's JVP rule (a ``jax.custom_jvp``), and the solve is a linear-solve primitive of our
own (``_solve``) whose transpose is the back substitution ℒ* Λ = 𝒫* ḡ. Reverse mode is JAX transposing that
rule: the back substitution runs, then ℳ Λ — the transpose of the batched ℳ* h — is applied to
all layers of a kind at once, after the loop. Because everything is a JVP rule plus
transposition, jit, vmap, jvp-of-grad (Hessian-vector products) and jax.hessian all compose.
Under jvp_by_solve alone, whose tangents are never transposed, the rule runs the substitution
inside the forward loop instead (one JVP per layer, nothing stored).

Outside these transforms a Network call is plain JAX code, so ``jax.grad`` of the same function
is the independent reference. The mode is a JAX configuration state included in the jit key,
so ``grad_by_solve(jax.jit(f))`` traces ``f`` again instead of reusing a plain trace.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from ._capture import rewrite
from ._checkpoint import checkpointed_call, row_spans, rows_cut, segment_length, split
from ._engine import (
    Primal,
    forward,
    param_forward,
    read_row,
    read_rows,
)
from ._graph import Network, Stack, set_call
from ._plan import Plan, current_plan, differentiable_dtype, leaf_aval, plan_for, plans_generation
from ._settings import Settings, current, settings_changed, solving, solving_with
from ._solve import solve
from ._stacking import explicit_sharding, mesh_of, under_vmap, zeros_of


class _Interceptor(threading.local):
    def __init__(self) -> None:
        self.handler: Callable[[Network, Any, tuple], Any] | None = None


_INTERCEPTOR = _Interceptor()


@contextlib.contextmanager
def calls_intercepted(handler: Callable[[Network, Any, tuple], Any] | None):
    """Inside, every Network call ``net(params, *inputs)`` is ``handler(net, params, inputs)``
    instead (which runs with no handler: calling ``net`` there is the ordinary call). The
    curvature transforms split a function into its network calls and the rest this way."""
    old, _INTERCEPTOR.handler = _INTERCEPTOR.handler, handler
    try:
        yield
    finally:
        _INTERCEPTOR.handler = old


def network_call(net: Network, params: Any, inputs: tuple[Any, ...]) -> Any:
    handler = _INTERCEPTOR.handler
    if handler is not None:
        with calls_intercepted(None):
            return handler(net, params, tuple(inputs))
    net.check_inputs(inputs)
    theta = net.select_params(params)
    for where, tree in [*((f"Parameter block {n!r}", b) for n, b in theta.items()),
                        *((f"Network input {n!r}", x) for n, x in zip(net.inputs, inputs))]:
        for leaf in jax.tree.leaves(tree):
            leaf_aval(leaf, where)
    if not solving():
        return net.pick_outputs(net.states(theta, *inputs))
    live = net.live  # layers that reach no output are not part of the solve
    if live is None:  # the outputs are network inputs: nothing to solve (JAX differentiates them)
        return net.pick_outputs(dict(zip(net.inputs, inputs)))
    theta = {p: theta[p] for p in live.param_names}
    plan = current_plan(live, theta, inputs, current().engine)  # made anew where a layer's computation changed
    k = current().checkpoints
    if k and not current().forward_only and k < len(live.layers) - 1:
        levels = (k,)
        if current().schedule == "nested":
            state = _state_bytes(plan)
            level_cost = _nbytes(theta) / max(sum(state.values()) / len(state), 1)
            levels = nested_levels(len(live.layers), k, level_cost)
        if checkpoints_keep_less(live, theta, inputs, levels):
            with mesh_of((theta, inputs)), settings_changed(segments=True):
                # Nested: stacked inputs go down whole, each level adding its offset (a cut per
                # segment would copy the rows of every level).
                whole = {x: 0 for x in live.stacked_inputs} if len(levels) > 1 else {}
                return checkpointed_call(live, theta, tuple(inputs), levels[0], _checkpointed(levels[1:]), whole)
    with mesh_of((theta, inputs)):
        outs = _jitted_call_by_solve(live, theta, tuple(inputs))
    return outs[0] if net.single_output else outs


# States a leaf segment of the nested schedule keeps per layer (its states, Λ, residuals and the
# products of its layers): measured on RNNs against memory_analysis().
LEAF_STATES_PER_LAYER = 4.0
# What a level costs besides its parameter cotangents, in states: its scan's own buffers, and a
# price on the forward sweep it recomputes (a level must save that much memory to be worth it).
LEVEL_STATES = 8.0
MAX_LEVELS = 6


def nested_levels(layers: int, checkpoints: int, level_cost: float = 0.0) -> tuple[int, ...]:
    """The checkpoints of each level of the nested schedule for ``layers`` layers and at most
    ``checkpoints`` states in all: each level cuts each segment of the level above into evenly
    spaced segments (the last one shorter). Chosen to keep least, in states: at each level, per
    distinct segment length (each a program of its own, whose buffers XLA does not share with
    the others') the states it keeps and ``LEVEL_STATES``; ``level_cost`` per level (its scan's
    parameter cotangents: ≈ the parameters, in states); ``LEAF_STATES_PER_LAYER`` per layer of
    each distinct leaf segment. So remainders cost — a segment of another length is another
    program below it — and levels that divide the layers evenly win (RNN, 2048 = 8 · 8 · 8 · 4
    steps, 45 states: 7 + 7 + 7 and leaves of 4 layers keep 0.64× of equinox's checkpointed scan
    with 45; 23 + 22 and their remainders kept 1.2×).
    Each level recomputes every layer once more: d + 1 forward evaluations — memory like k and
    recomputations growing like log N, the binomial (revolve) schedule's trade-off."""

    @functools.cache
    def best(lengths: frozenset[int], budget: int, left: int) -> tuple[float, tuple[int, ...]]:
        leaves = (LEAF_STATES_PER_LAYER * sum(lengths), ())
        if left == 0 or budget < 1 or max(lengths) <= 2:
            return leaves
        options = [leaves]
        top = max(lengths)
        spread = max(1, budget // left)
        ks = {spread, spread - 1, spread - 2, budget} | {n - 1 for n in range(2, min(top, budget + 1) + 1)
                                                         if top % n == 0 and n - 1 >= spread // 2}
        for k in sorted(x for x in ks if 1 <= x <= budget):
            below, kept, programs = set(), 0, 0
            for length in lengths:  # each distinct length: a program of its own, with its own buffers
                if k >= length - 1:  # too short to cut: handed to the level below as it is
                    below.add(length)
                    continue
                seg = -(-length // (k + 1))
                count = -(-length // seg)
                kept, programs = kept + count - 1, programs + 1
                below |= {seg, length - (count - 1) * seg}
            if programs:
                cost, rest = best(frozenset(below), budget - k, left - 1)
                options.append((cost + kept + programs * LEVEL_STATES + level_cost, (k, *rest)))
        return min(options, key=lambda o: (o[0], len(o[1])))

    levels = best(frozenset({layers}), checkpoints, MAX_LEVELS)[1]
    return levels or (checkpoints,)


def _checkpointed(levels: tuple[int, ...]) -> Callable[[Network, dict, tuple, dict], tuple]:
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
    inner = _checkpointed(levels[1:])

    def call(net: Network, theta: dict, inputs: tuple, offsets: dict) -> tuple:
        if levels[0] >= len(net.layers) - 1:  # too short to cut: the level below
            return tuple(inner(net, theta, inputs, offsets))
        return tuple(checkpointed_call(net, theta, inputs, levels[0], inner, offsets))

    return call


def _nbytes(tree: Any) -> int:
    return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


def _state_bytes(plan: Plan) -> dict[Hashable, int]:
    """Bytes of one row of each state (by name)."""
    return {name: _nbytes(plan.state_groups[g].row_avals()) for name, (g, _) in plan.state_loc.items()}


# A checkpointed call runs only where it is predicted to keep at most this fraction of the plain
# call's memory (and bound to keep no more). The estimate is rough — XLA's buffer assignment
# decides; against memory_analysis() it was within 0.6–1.4× on chains, RNNs, a GPT and a
# three-kind DAG, up to 2.3× low for short chains with remat=True — so only a clear saving
# checkpoints.
CHECKPOINT_SAVING = 0.5


def checkpoints_keep_less(net: Network, theta: dict, inputs: tuple, levels: tuple[int, ...]) -> bool:
    """Whether checkpointing with ``levels`` is predicted to keep at most ``CHECKPOINT_SAVING``
    of what the same call keeps without, and bound to keep no more
    (`checkpoint_memory_ratio`)."""
    estimate, bound = checkpoint_memory_ratio(net, theta, inputs, levels)
    return estimate <= CHECKPOINT_SAVING and bound <= 1.0


def checkpoint_memory_ratio(net: Network, theta: dict, inputs: tuple,
                            levels: tuple[int, ...]) -> tuple[float, float]:
    """What checkpointing with ``levels`` (states per level, `nested_levels`) is predicted
    to keep, as a fraction of the same call without (by the shapes alone): an estimate and a
    pessimistic bound.

    The estimate. Without: every state, every stored residual and Λ. With: the states the top
    level's segments return (outputs, and states later segments read), twice (kept, then stacked
    or concatenated into the outputs), twice the states each level below keeps, twice a leaf
    segment's share of the above (its recomputation and its back substitution), and the rows of
    stacked blocks and inputs cut out for segments that run on their own, with their gradients.
    Where every state is an output (a ``Stack`` of them), or with one checkpoint (two halves),
    checkpointing keeps no less; the call then runs without it.

    The bound adds what a leaf segment may copy — the rows of stacked blocks its layers have to
    themselves, and its products with them (a chain of width 64 and batch 4 in 7-layer segments:
    1.09× the plain call's temporaries) — and counts the plain call at its least: with ℳΛ formed
    in the back substitution it carries Λ from step to step instead of keeping every Λ (one
    example, ``param_products="in_loop"``: 1.26× before). Both are rough — XLA's buffer
    assignment decides — and were checked against ``memory_analysis()`` over random networks
    (``benchmarks/profile.py checkpoint-memory --sweep``)."""
    plan = plan_for(net, theta, inputs, current().engine)
    state = _state_bytes(plan)
    # Products with the Jacobians of a checkpointed call (gauss_newton) transpose the scan over
    # its segments once per product, each into a parameter-sized cotangent stack of zeros that XLA
    # allocates before the first: measured one more copy of the parameters per product in the
    # program; counted as two (a solver's loop, CG, holds one product in its body). Under vmap the
    # scan's parameter cotangents are stacked per example and then moved into the result's layout
    # (a 24-layer chain, 4 examples: 2.3× the plain call's temporaries): counted the same.
    param_cotangents = 2 * _nbytes(theta) if current().products or under_vmap() else 0
    residuals = 0 if current().remat else sum(_nbytes(a) * (n + 1) for a, n in zip(plan.res_avals, plan.res_rows))
    layers = [layer.name for layer in net.layers]
    states = sum(state[name] for name in layers)
    plain = 2 * states + residuals
    segments = split(net, levels[0])
    kept = sum(state[layers[sg.start + j]] for sg in segments for j in sg.returns)
    leaf, below = max(len(sg.net.layers) for sg in segments), 0
    for k in levels[1:]:
        if k < leaf - 1:
            leaf, below = segment_length(leaf, k), below + 2 * k * states / len(layers)
    given = dict(zip(net.inputs, inputs))
    cut = 0
    for (kind, name), rows in rows_cut(net, levels[0]).items():
        source = theta[name] if kind == "block" else given[name]
        cut += 2 * _nbytes(source) * rows // max(jax.tree.leaves(source)[0].shape[0], 1)
    checkpointed = 2 * kept + below + 2 * leaf * plain / len(layers) + cut + param_cotangents
    segment_rows = 2 * leaf * _own_param_row_bytes(plan) / len(layers)
    least = states + residuals if params_in_loop(current().param_products, current().remat, plan) else plain
    return checkpointed / plain, (checkpointed + segment_rows) / least


def _own_param_row_bytes(plan: Plan) -> int:
    """Bytes of the parameter rows the layers do not share with the other members of their kind
    (a chain's stacked weights; nothing of an RNN's A, B, c), summed over the layers."""
    return sum(kind.size * _nbytes(plan.param_groups[g].row_avals()) for kind in plan.kinds
               for g, row in zip(kind.param_groups, kind.shared_rows) if row is None)


def outputs_of(plan: Plan, bufs: list[Any]) -> tuple[Any, ...]:
    """The call's output items (as ``net(...)`` returns them, always a tuple) from state buffers."""
    return _outputs(plan, bufs)


def output_tangents(plan: Plan, z: list[Any]) -> tuple[Any, ...]:
    """The output items' tangents 𝒫 Z from state-layout tangents Z (linear in Z; its transpose
    places output cotangents into the right-hand side of the back substitution)."""
    return tuple(_tangent_or_zero(plan, o, z) for o in plan.net.output_spec)


def _outputs(plan: Plan, bufs: list[Any]) -> tuple[Any, ...]:
    """The call's results from the state buffers: a name's row, or a Stack's rows (one slice
    where they are consecutive, else one gather)."""
    singles = [item for item in plan.net.output_spec if not isinstance(item, Stack)]
    outs = plan.unpack(bufs, tuple(singles), plan.state_loc)
    result = []
    for item in plan.net.output_spec:
        g, rows = _rows_of(plan, item)
        if g is None:  # a Stack over groups that differ in weak types only: strongly typed
            result.append(_stack([read_row(bufs[gn], r) for gn, r in map(plan.state_loc.get, item.names)]))
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


def _stack(values: list[Any]) -> Any:
    """Pytrees stacked leaf by leaf (float0 tangents with numpy: JAX has no float0 arrays)."""
    def one(*leaves):
        if all(isinstance(x, np.ndarray) and x.dtype == jax.dtypes.float0 for x in leaves):
            return np.stack(leaves)
        return jnp.stack(leaves)

    return jax.tree.map(one, *values)


def prepare(net: Network, theta: dict[Hashable, Any], inputs: tuple[Any, ...]) -> tuple[Plan, Primal]:
    """The plan at these shapes and the forward pass with every layer's residuals."""
    plan = plan_for(net, theta, inputs, current().engine)
    prim = _forward_pass(plan, not current().remat, plan.pack_params(theta),
                         plan.pack_states(dict(zip(net.inputs, inputs))))
    return plan, prim


# The forward pass as a custom_jvp whose rule is its plain JVP: a network call's JVP rule is
# partially evaluated under jax.grad, and JAX's partial evaluation of a loop re-analyses its body
# even where every input is known (the forward pass's are); a custom_jvp call with known inputs is
# bound as it is (measured: tracing the 12-block GPT 0.20 -> 0.15 s).
@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _forward_pass(plan: Plan, residuals: bool, params: list[Any], states: list[Any]) -> Primal:
    return forward(plan, params, states, residuals=residuals)


@_forward_pass.defjvp
def _forward_pass_jvp(plan: Plan, residuals: bool, primals: tuple, tangents: tuple) -> tuple:
    return jax.jvp(lambda p, s: forward(plan, p, s, residuals=residuals), primals, tangents)


# Steps whose largest state has at least this many elements, or this many rows (a batch: the
# elements over the last axis), are compute-bound on CPU: there ℳ after the loop saves no time but
# keeps Λ of every layer (the loop carries it). Measured on chains of depth 128–256, widths 16–128
# (`python benchmarks/run.py --rows headline` sweeps sizes): after the loop 0.72–0.98× in it at
# 8–16 rows, par at 32 (0.92–1.08), 1.03–1.2× from 64 rows, par from 8192 elements. Accelerators
# stay latency-bound to much larger sizes; their threshold is an estimate, not a measurement yet.
COMPUTE_BOUND_ELEMENTS = {"cpu": 8192}
COMPUTE_BOUND_ELEMENTS_ELSEWHERE = 1 << 18
COMPUTE_BOUND_ROWS = {"cpu": 32}
# With one row (batch 1, or unbatched states) each layer's weight product is an outer product,
# which XLA on CPU forms batched by broadcasting, in the transposed layout, then copies into the
# gradient: a weights-sized temporary for no time saved (chain 128×64×1: 2,164 against 84 KB of
# temporaries — jax.grad over lax.scan 116 KB — at 0.96–1.09× the loop's time).
AFTER_LOOP_MIN_ROWS = {"cpu": 2}


def after_loop_pays(elements: int, rows: int, backend: str) -> bool:
    """Whether ℳ batched after the loop pays on ``backend`` for steps whose largest state has
    ``elements`` elements in ``rows`` rows: where they are latency-bound, from two rows on CPU."""
    rows_bound = COMPUTE_BOUND_ROWS.get(backend)
    return (elements < COMPUTE_BOUND_ELEMENTS.get(backend, COMPUTE_BOUND_ELEMENTS_ELSEWHERE)
            and (rows_bound is None or rows < rows_bound) and rows >= AFTER_LOOP_MIN_ROWS.get(backend, 1))


def _largest_state(plan: Plan) -> tuple[int, int]:
    """(elements, rows) of the largest state of any kind (rows: of its largest leaf, the elements
    over the last axis)."""
    def size(a: Any) -> int:
        return int(np.prod(a.shape))

    leaves = max((jax.tree.leaves(k.out_aval) for k in plan.kinds), key=lambda ls: sum(map(size, ls)))
    leaf = max(leaves, key=size)
    return sum(map(size, leaves)), size(leaf) // leaf.shape[-1] if leaf.shape and leaf.shape[-1] else 1


def params_in_loop(param_products: str, remat: bool, plan: Plan, checkpointed: bool = False) -> bool:
    """The rule for where ℳΛ is formed. After the loop, batched per kind, where that pays
    (`after_loop_pays`: latency-bound steps, of two rows or more on CPU) — in the loop
    with remat (re-linearising every layer a second time after the loop would cost a forward
    pass), when the solve is unrolled (few layers per kind: little to batch), when steps are
    compute-bound (batching saves nothing; keeping every Λ costs memory) or of one row (outer
    products, formed and copied in another layout after the loop), and when the members of every
    kind share all their blocks (a recurrent network's weights:
    in the loop ℳΛ adds into one small row; measured 0.7–1.0× jax.grad over lax.scan against
    1.3–1.5× after the loop, T = 2048, width 64).

    Except, with ``checkpointed`` (a segment of a checkpointed call: memory asked for, and the
    call predicted to save it), an unrolled solve whose members share their blocks, even where
    ``param_products="in_loop"`` is asked for: after, the members' products are one product summed
    over them, where unrolled in the loop XLA keeps every layer's product alive for one fused sum
    (the short segments of the nested schedule: RNN, T = 2048, 45 checkpoints: 448 → 300 KB of
    temporaries, a little faster; a 64-step RNN in 10-layer segments kept 1.4× the plain call's)."""
    if checkpointed and plan.unrolled and plan.params_shared_by_members:
        return False  # whatever param_products says (see above): memory was asked for
    if param_products != "auto":
        return param_products == "in_loop"
    return (remat or plan.unrolled or not after_loop_pays(*_largest_state(plan), jax.default_backend())
            or plan.params_shared_by_members)


def solve_joint(plan: Plan, prim: Primal, h: list[Any], rhs: list[Any], compact: bool = False) -> list[Any]:
    """Z with ℒ Z = rhs + ℳ* h, as one solve over (h, Z) that forms ℳ* h in the loop, and whose
    transpose forms ℳΛ in the loop.

    The joint matrix [[I, 0], [−ℳ*, ℒ]] is unit lower triangular too: the forward substitution
    adds ∂Φ_i/∂θ h at step i, and its transpose [[I, −ℳ], [0, ℒ*]] is solved by the back
    substitution for Λ with ℳΛ accumulated step by step, both from the same linearisation of each
    layer (the in-loop alternative to the batched ℳ* and ℳ). ``compact``: rhs (at the input rows)
    and Z in the layout of ``plan.compact``.
    """
    return solve(plan, prim, (h, rhs), joint=True, compact=compact)[1]


def solve_forward(plan: Plan, prim: Primal, rhs: list[Any], compact: bool = False,
                  rhs_full: bool = False) -> list[Any]:
    """Z with ℒ Z = rhs, differentiable in rhs (transpose: back substitution) and in prim.
    ``compact``: Z in the layout of ``plan.compact``, and rhs too unless ``rhs_full``."""
    return solve(plan, prim, rhs, compact=compact, rhs_full=rhs_full)


def _call_by_solve(net: Network, theta: dict, inputs: tuple) -> tuple[Any, ...]:
    """The call's outputs (the primal of the custom JVP made per network in ``_jitted_call_by_solve``)."""
    plan = plan_for(net, theta, inputs, current().engine).compact
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
    plan = plan_for(net, theta, inputs, current().engine)
    anchor = _anchor(dtheta, dinputs)
    if anchor is None:  # no tangent of floats anywhere: the outputs' tangents are zeros
        return _call_by_solve(net, theta, inputs), tuple(_zero_tangent(plan, o) for o in net.output_spec)
    if current().forward_only:
        return _jvp_in_forward_sweep(plan.compact, theta, inputs, dtheta, dinputs)
    return _jvp_by_linear_solve(plan, theta, inputs, dtheta, dinputs)


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
    return _outputs(plan, prim.states), tuple(_tangent_or_zero(plan, o, z) for o in net.output_spec)


def _jvp_by_linear_solve(plan: Plan, theta: dict, inputs: tuple, dtheta: dict, dinputs: tuple) -> tuple:
    """The forward pass with residuals, then ℒ Z = ℳ* h + E₀ dU₀ as a transposable linear solve:
    reverse mode is its transpose, the back substitution (with ℳΛ batched after it, the transpose
    of the batched ℳ* h, or formed in the loop: ``solve_joint``)."""
    net = plan.net
    prim = prepare(net, theta, inputs)[1]
    moves_params = _moves_params(net, dtheta)
    in_loop = (moves_params and params_in_loop(current().param_products, current().remat, plan, current().segments)
               and all(g.differentiable for g in plan.param_groups))
    # The solve keeps Z only where it is read again or returned (plan.compact): a chain carries
    # Z_i from step to step instead of writing a [depth, batch, width] buffer for every product.
    # rhs is in that layout too (at the input rows alone), but where ℳ* h is formed before the
    # loop (``rhs_full``: every row).
    compact = not plan.unrolled
    rhs_full = moves_params and not in_loop
    layout = plan.compact if compact and not rhs_full else plan  # of rhs
    rhs = _input_tangents(layout, dinputs)
    if moves_params:  # the groups without input tangents start from zeros made in the linear program
        given = {layout.state_loc[name][0] for name, dx in zip(net.inputs, dinputs) if not _is_zero(dx)}
        rhs = _zeros_made_with(_anchor(dtheta, dinputs), rhs, keep=given)
    if moves_params and not in_loop:
        rhs = param_forward(plan, prim, plan.pack_params(_instantiate(dtheta), tangent=True), rhs)
    # Parts of rhs built from symbolic zeros alone are constants: the solve's transpose gives
    # them no cotangent (see _solve).
    if in_loop:
        z = solve_joint(plan, prim, plan.pack_params(_instantiate(dtheta), tangent=True), rhs, compact)
    else:
        z = solve_forward(plan, prim, rhs, compact, rhs_full)
    layout = plan.compact if compact else plan  # of Z
    return _outputs(plan, prim.states), tuple(_tangent_or_zero(layout, o, z) for o in net.output_spec)


def _tangent_or_zero(plan: Plan, item: Hashable | Stack, z: list[Any]) -> Any:
    """The tangent of an output item from the solution Z, as JAX wants it (float0 zeros at leaves
    without tangents)."""
    g, rows = _rows_of(plan, item)
    if g is None:
        return _stack([_tangent_or_zero(plan, name, z) for name in item.names])
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
        return _stack([_zero_tangent(plan, name) for name in item.names])
    group = plan.state_groups[g]
    if rows is None or isinstance(item, Stack):
        lead = (group.rows if rows is None else len(rows),)
        return group.full_tangent(jax.tree.map(lambda a: zeros_of(a, lead), group.row_avals(True)), lead)
    return group.full_tangent(group.row_zeros(tangent=True))


# A network call is a jax.custom_jvp whose primal (_call_by_solve) and rule (_call_by_solve_jvp,
# its symbolic zeros static) are each a jax.jit: called eagerly, JAX compiles the solve (and its
# JVP and transpose) as a whole instead of dispatching its operations one by one, and the traces
# are cached: a loss that calls one network 20 times traces in 0.16 s (1.0 s with the rule traced
# per call). Under differentiation only the rule is traced; a jit around the custom_jvp traced the
# undifferentiated forward pass as well (measured: 0.84 -> 0.70 s of tracing for the 12-block GPT).
#
# One custom_jvp and jit per network, the most recently used JITTED_NETWORKS kept: JAX's caches
# hold a function's traces, executables and what its layers close over weakly keyed on the
# function, so they go with it, and a program that builds networks in a loop keeps memory bounded.
# (One global custom_jvp with the network as a static argument kept every network until JAX's
# own LRU caches evicted it: ~4 MB per network, up to thousands of networks.)
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


# -- the public transforms ---------------------------------------------------------------------
set_call(network_call)  # Network.__call__ runs network_call from now on (see _graph.set_call)


def solve_mode(fun: Callable, settings: Settings | None = None, /, **options: Any) -> Callable:
    """``fun`` run with Network calls differentiated by the solve (any JAX transform of it, e.g.
    ``jax.linearize``, then uses the solve's rules), with ``settings`` (or ``Settings.of(**options)``:
    the keywords of grad_by_solve, and ``products``: linearised once for many products, which the
    memory rule for checkpoints counts)."""
    return _in_solve_mode(fun, fun, Settings.of(**options) if settings is None else settings)


def _in_solve_mode(transformed: Callable, fun: Callable, settings: Settings) -> Callable:
    @functools.wraps(fun)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with solving_with(settings):
            return transformed(*args, **kwargs)

    return wrapped


def grad_by_solve(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False, *,
                  remat: bool = False, checkpoints: int | None = None, schedule: str = "even",
                  param_products: str = "auto", engine: str = "auto", layers: Any = None,
                  **grad_kwargs: Any) -> Callable:
    """Drop-in for ``jax.grad``: every Network call in ``fun`` is differentiated by the solve.

    For a loss J(θ) = ℓ(U(θ), θ) the gradient is ∇_θJ = ℳ Λ + ∇_θℓ, where Λ solves the adjoint
    equation ℒ* Λ = ∇_Uℓ by back substitution (one solve for every parameter direction).
    Network inputs may be differentiated too (``argnums``); several networks, repeated calls and
    direct uses of the parameters (regularisers) add up.

    With ``remat=True`` the forward pass keeps only the states U; the back substitution and ℳ
    re-linearise each layer from its inputs (one more forward evaluation, less memory).

    With ``checkpoints=k`` the forward pass keeps only k states (those where ⌈N/(k+1)⌉-layer
    segments meet, besides inputs and outputs); in reverse mode each segment's states are
    recomputed just before its back substitution. Memory O(k + N/k) states (k ≈ √N: O(√N)),
    time at most one forward pass more. Segments that repeat (an RNN, ``Row``-stacked blocks) run
    as one ``lax.scan``, so the program does not grow with k. ``schedule="nested"`` spends the k
    states on levels of segments within segments instead (d levels of k/d states, d chosen from
    the shapes to keep least; the guide "Sequences and memory" shows how): at most k states kept plus a short
    leaf segment, each layer evaluated d + 1 times — memory like k and recomputations growing like
    log N, the trade-off of the binomial (revolve) schedule; the default ``"even"`` is faster
    where its O(k + N/k) fits. Checkpointing never costs memory:
    where it is not predicted (from the shapes) to keep at most half of what the call keeps
    without, or a pessimistic bound says it may keep more — every state an output, one
    checkpoint, stacked weights larger than the states — the call runs without it.

    ``param_products`` says where ℳΛ is formed: ``"after"`` the back substitution, for all layers
    of a kind at once (one batched product: off the sequential path), or ``"in_loop"``, layer by
    layer inside it, from the same linearisation as the ℒ* block. ``"auto"`` (default) is
    ``"after"`` where the loop runs latency-bound steps (small states), and ``"in_loop"`` with
    ``remat=True`` (it saves re-linearising every layer once more), when the solve is unrolled
    (little to batch) or when steps are compute-bound (batching saves no time, costs memory).
    With ``checkpoints``, short unrolled segments whose layers share their blocks form ℳΛ after
    their substitution whatever ``param_products`` says (it keeps less memory there).

    ``engine``: ``"loop"`` runs the substitutions as ``lax.fori_loop``s over the layers (compiled
    once per kind of layer), ``"unrolled"`` as straight-line code; ``"auto"`` (default) loops when
    kinds repeat (at least 6 layers and 2 per kind on average), else unrolls.

    Examples:
        >>> import jax, jax.numpy as jnp, linbackprop as lbp
        >>> net = lbp.Network([lbp.Layer("y", lambda th, x: jnp.tanh(x @ th[0]), ("x",), ("W",))],
        ...                   inputs=["x"], outputs="y")
        >>> loss = lambda p, x: jnp.sum(net(p, x) ** 2)
        >>> p, x = {"W": jnp.ones((3, 2))}, jnp.ones((4, 3))
        >>> g = lbp.grad_by_solve(loss)(p, x)
        >>> bool(jnp.allclose(g["W"], jax.grad(loss)(p, x)["W"]))
        True
    """
    settings = Settings.of(remat=remat, checkpoints=checkpoints, schedule=schedule, param_products=param_products,
                           engine=engine)
    if layers is not None:
        return _with_layers(fun, argnums, has_aux, layers, settings, grad_kwargs, with_value=False)
    return _in_solve_mode(jax.grad(fun, argnums=argnums, has_aux=has_aux, **grad_kwargs), fun, settings)


def value_and_grad_by_solve(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False, *,
                            remat: bool = False, checkpoints: int | None = None, schedule: str = "even",
                            param_products: str = "auto", engine: str = "auto", layers: Any = None,
                            **grad_kwargs: Any) -> Callable:
    """Drop-in for ``jax.value_and_grad``, differentiating Network calls by the solve
    (``remat``, ``checkpoints``, ``schedule``, ``param_products`` and ``engine`` as in
    [`grad_by_solve`][linbackprop.grad_by_solve]).

    Examples:
        >>> import jax.numpy as jnp, linbackprop as lbp
        >>> net = lbp.Network([lbp.Layer("y", lambda th, x: x * th[0], ("x",), ("a",))], ["x"], "y")
        >>> value, grads = lbp.value_and_grad_by_solve(lambda p: net(p, 2.0))({"a": 3.0})
        >>> float(value), float(grads["a"])
        (6.0, 2.0)
    """
    settings = Settings.of(remat=remat, checkpoints=checkpoints, schedule=schedule, param_products=param_products,
                           engine=engine)
    if layers is not None:
        return _with_layers(fun, argnums, has_aux, layers, settings, grad_kwargs, with_value=True)
    return _in_solve_mode(jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux, **grad_kwargs), fun, settings)


def _with_layers(fun: Callable, argnums: int | Sequence[int], has_aux: bool, layers: Any, settings: Settings,
                 grad_kwargs: dict, with_value: bool) -> Callable:
    """grad_by_solve / value_and_grad_by_solve of a model as it is: ``fun`` traced with the calls
    of ``layers`` as the layers of a network (``_capture.rewrite``), differentiated by the solve,
    and the gradient given back in each argument's own type (an nnx module's Param state, an
    equinox module, the pytree); an nnx module's other state (RNG counts) is updated as nnx.grad
    updates it."""
    single = isinstance(argnums, int)
    nums = (argnums,) if single else tuple(argnums)

    @functools.wraps(fun)
    def run(*args: Any) -> Any:
        found = rewrite(fun, args, nums, layers)

        def split_aux(*parts: Any) -> tuple:
            result, states = found.fun(*parts)
            value, aux = result if has_aux else (result, None)
            return value, (aux, states)

        grad = jax.value_and_grad(split_aux, tuple(range(len(nums))), has_aux=True, **grad_kwargs)
        (value, (aux, states)), grads = _in_solve_mode(grad, split_aux, settings)(*found.args)
        found.write_back(states)
        grads = found.gradient(grads, single)
        if with_value:
            return ((value, aux) if has_aux else value), grads
        return (grads, aux) if has_aux else grads

    return run


def jvp_by_solve(fun: Callable, primals: Sequence[Any], tangents: Sequence[Any], has_aux: bool = False, *,
                 engine: str = "auto", layers: Any = None):
    """Drop-in for ``jax.jvp``: Network calls are differentiated by forward substitution
    ℒ Z = ℳ* h (+ the input tangents), first layer to last (``engine`` as in
    [`grad_by_solve`][linbackprop.grad_by_solve]).

    Row i of the substitution needs only layer i's linearisation, so it runs inside the forward
    loop (one JVP per layer, nothing stored). Reverse mode of the result (``jax.grad`` of it)
    differentiates that loop with JAX's rules; for gradients use [`grad_by_solve`][linbackprop.grad_by_solve], whose
    forward rule stays a transposable linear solve.

    Examples:
        >>> import jax.numpy as jnp, linbackprop as lbp
        >>> net = lbp.Network([lbp.Layer("y", lambda th, x: x * th[0], ("x",), ("a",))], ["x"], "y")
        >>> y, dy = lbp.jvp_by_solve(lambda p: net(p, 2.0), ({"a": 3.0},), ({"a": 1.0},))
        >>> float(y), float(dy)
        (6.0, 2.0)
    """
    if layers is not None:
        found = rewrite(fun, tuple(primals), tuple(range(len(primals))), layers)
        rest = found.args[-1]
        leaves = [list(a.leaves_of(t)) for a, t in zip(found.arguments, tangents)]
        inner = lambda *diffs: found.fun(*diffs, rest)[0]
        with solving_with(Settings(engine=engine, forward_only=True)):
            return jax.jvp(inner, tuple(found.args[:-1]), tuple(leaves), has_aux=has_aux)
    with solving_with(Settings(engine=engine, forward_only=True)):
        return jax.jvp(fun, primals, tangents, has_aux=has_aux)
