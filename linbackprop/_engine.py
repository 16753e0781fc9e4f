"""The engine: forward pass, forward and back substitution, and the block-sparse products.

Vectors of 𝒰 are lists of state-layout buffers (one stacked pytree per group of same-shaped
states, network inputs included); vectors of Θ are lists of parameter-layout buffers.
Network inputs are rows of ℒ with the identity and nothing else, so the same solve also
yields the cotangents (or takes the tangents) of the inputs.

The substitutions are ``lax.fori_loop`` over the topologically ordered layers (or the same body
unrolled with static indices, for shallow networks: ``Plan.unrolled``). The body switches over
*kinds* of layer (not layers), every branch returns only the current layer's small results, and
every write into a large buffer happens outside the switch: a branch that updated a buffer would
make XLA copy it on every step. Kinds share write *slots* (``Plan.writes``): per buffer, a step
writes as many rows as the kind that writes most there; inactive slots write zeros into a pad row
(or add zeros). Stored residuals of all kinds share buffers by shape and dtype.

ℳΛ is formed after the back substitution by default: for all layers of a kind at once, vmapped
over the stacked residuals — one batched product per kind instead of one small one per layer
(reverse mode gets it as JAX's transpose of the batched ℳ*h of the forward rule). Inside the loop
(``back_substitution(..., grads=...)``) is the alternative.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import jaxpr_as_fun

from ._outer import OuterFactors, SquareSums, weighted_square_sum
from ._plan import Group, Kind, Plan, RowList, Writes, as_dtype
from ._stacking import index_row, update_row, zeros_of


@functools.partial(jax.tree_util.register_dataclass, data_fields=["params", "states", "residuals"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Primal:
    """Everything the linear maps need: parameters, states and per-kind own residuals.

    ``residuals`` is None in the rematerialising mode: only the states are kept, and every
    product re-linearises its layers from their (re-read) parameters and inputs.
    """

    params: list[Any]
    states: list[Any]
    residuals: list[Any] | None


# -- small buffer helpers (a buffer: a stacked pytree, or a RowList when the plan is unrolled) -----
def _cast(value: Any, like: Any) -> Any:
    return jax.tree.map(lambda v, b: as_dtype(v, b.dtype), value, like)


def read_row(buf: Any, i: Any, written: bool = False) -> Any:
    """Row i; ``written``: of a buffer the loop also writes (see `_scalar`)."""
    i = _scalar(i, affine=not written)
    if isinstance(buf, RowList):
        return buf.rows[int(i)]
    return jax.tree.map(lambda b: index_row(b, i), buf)


def _set_row(buf: Any, i: Any, value: Any) -> Any:
    i = _scalar(i, affine=False)
    if isinstance(buf, RowList):
        rows = list(buf.rows)
        rows[int(i)] = _cast(value, rows[int(i)])
        return RowList(rows)
    return jax.tree.map(lambda b, v: update_row(b, i, as_dtype(v, b.dtype)), buf, value)


def _add_row(buf: Any, i: Any, value: Any) -> Any:
    i = _scalar(i, affine=False)
    if isinstance(buf, RowList):
        rows = list(buf.rows)
        rows[int(i)] = jax.tree.map(lambda b, v: b + v.astype(b.dtype), rows[int(i)], value)
        return RowList(rows)

    def add(b, v):
        return update_row(b, i, index_row(b, i) + v.astype(b.dtype))

    return jax.tree.map(add, buf, value)


def _contiguous(idx: Any) -> int | None:
    """The start of a static index table that is a contiguous range (then slices, not gathers)."""
    if isinstance(idx, np.ndarray) and idx.ndim == 1 and len(idx) and np.array_equal(idx, idx[0] + np.arange(len(idx))):
        return int(idx[0])
    return None


def read_rows(buf: Any, idx: Any) -> Any:
    if isinstance(buf, RowList):
        return jax.tree.map(lambda *r: jnp.stack(r), *[buf.rows[int(i)] for i in idx])
    start = _contiguous(idx)
    if start is not None:
        return jax.tree.map(lambda b: lax.slice_in_dim(b, start, start + len(idx)), buf)
    return jax.tree.map(lambda b: b[idx], buf)


def _unstacked(tree: Any, n: int) -> list[Any]:
    """The n rows of a stacked pytree, by one split per leaf: its transpose is one concatenation,
    where n row slices transpose to n padded copies of the whole (XLA kept them all live: a
    checkpointed RNN's segments held O(rows²) temporaries)."""
    leaves, treedef = jax.tree.flatten(tree)
    split = [list(x) if x.dtype == jax.dtypes.float0 else [r.reshape(x.shape[1:]) for r in lax.split(x, (1,) * n)]
             for x in leaves]
    return [treedef.unflatten([rows[m] for rows in split]) for m in range(n)]


def _scatter_add(buf: Any, idx: Any, value: Any) -> Any:
    if isinstance(buf, RowList):
        for i, row in zip(idx, _unstacked(value, len(idx))):
            buf = _add_row(buf, i, row)
        return buf
    start = _contiguous(idx)
    if start is not None:
        def add(b, v):
            part = lax.slice_in_dim(b, start, start + len(idx)) + v.astype(b.dtype)
            return part if part.shape == b.shape else lax.dynamic_update_slice_in_dim(b, part, start, 0)

        return jax.tree.map(add, buf, value)
    return jax.tree.map(lambda b, v: b.at[idx].add(v.astype(b.dtype)), buf, value)


def _zeros_like_aval(tree: Any, lead: tuple[int, ...] = ()) -> Any:
    return jax.tree.map(lambda a: zeros_of(a, lead), tree)


class Index:
    """A step-dependent index inside a loop: ``values[t]`` for the loop counter ``t``.

    Lookups through the plan's tables compose in numpy at trace time (`_at`), so the
    program computes each index it uses once, from ``t``: as c + d·t where the values are affine
    in t — the usual case, and then reads of different blocks at the same row are one and the
    same XLA kernel (compile time) — else by one gather from a constant (`_scalar`).
    """

    __slots__ = ("t", "values")

    def __init__(self, t: jax.Array, values: np.ndarray):
        self.t, self.values = t, values

    def __getitem__(self, key: Any) -> Index:  # columns of a table row: values[:, key]
        key = key[1:] if isinstance(key, tuple) and key[0] is Ellipsis else key
        return Index(self.t, self.values[(slice(None), *(key if isinstance(key, tuple) else (key,)))])

    def __add__(self, offset: int) -> Index:
        return Index(self.t, self.values + offset)

    __radd__ = __add__


def _at(table: np.ndarray, i: Any) -> Any:
    """Entry i of a static table (i: an int when unrolled, or an `Index`)."""
    return Index(i.t, table[i.values]) if isinstance(i, Index) else table[i]


def _scalar(i: Any, affine: bool = True) -> Any:
    """An index as the program computes it: static when it is, else c + d·t, else a gather.

    ``affine=False`` (rows of buffers the loop writes): always a gather from a table XLA cannot
    see into. Where XLA can compare a read's index with an earlier write's, it fuses the write
    into the read, which then needs the buffer as it was, and copies the whole buffer each step.
    """
    if not isinstance(i, Index):
        return i
    v = i.values.astype(np.int64)
    d = int(v[1] - v[0]) if len(v) > 1 else 0
    if affine and np.array_equal(v, v[0] + d * np.arange(len(v))):
        return int(v[0]) if d == 0 else int(v[0]) + d * i.t
    table = lax.optimization_barrier(jnp.asarray(v, np.int32))
    return index_row(table, i.t)


class Step(NamedTuple):
    """A step of a substitution: its index (an int when unrolled, else an `Index`) and its
    kind when known at trace time (unrolled, one kind, or inside a periodic segment)."""

    index: Any
    kind: int | None
    segment: tuple[int, int] | None = None  # (start, stop) of the loop segment, when looping


def _loop(plan: Plan, body: Callable[[Step, Any], Any], init: Any, reverse: bool = False,
          enter: Callable[[int, int, Any], Any] | None = None,
          leave: Callable[[int, int, Any], Any] | None = None) -> Any:
    """Run ``body`` over the steps, first to last (or last to first): straight-line code when the
    plan is unrolled, else ``lax.fori_loop``s over its segments (``Plan.segments``), each entered
    with ``enter(start, stop, carry)`` and left with ``leave(start, stop, carry)`` where given."""
    carry = init
    if plan.unrolled:
        steps = range(plan.depth)
        for i in reversed(steps) if reverse else steps:
            carry = body(Step(i, int(plan.step_kind[i])), carry)
        return carry
    for start, stop, period in reversed(plan.segments) if reverse else plan.segments:
        if enter is not None:
            carry = enter(start, stop, carry)
        carry = _segment(plan, body, carry, start, stop, period, reverse)
        if leave is not None:
            carry = leave(start, stop, carry)
    return carry


def _segment(plan: Plan, body: Callable, carry: Any, start: int, stop: int, period: int, reverse: bool) -> Any:
    if period == 0 and stop - start < len(plan.kinds):
        # Fewer steps than kinds (a transformer's embedding or head): straight-line steps of known
        # kinds. A loop of one step would compile a switch over every kind, and write every
        # kind's slots, for each such step (a 12-block GPT: 120 → 64 kernels outside its loops).
        for i in range(stop - 1, start - 1, -1) if reverse else range(start, stop):
            carry = body(Step(i, int(plan.step_kind[i]), (start, stop)), carry)
        return carry
    if period == 0:  # kinds in no pattern: one step per iteration, a switch over kinds
        single = 0 if len(plan.kinds) == 1 else None

        steps = np.arange(start, stop)[::-1] if reverse else np.arange(start, stop)

        def one(t, c):
            return body(Step(Index(t, steps), single, (start, stop)), c)

        return lax.fori_loop(0, stop - start, one, carry)
    # Kinds repeat with this period: one iteration runs `period` steps of known kinds, no switch.
    blocks = (stop - start) // period

    firsts = start + period * (np.arange(blocks)[::-1] if reverse else np.arange(blocks))

    def block(t, c):
        for j in reversed(range(period)) if reverse else range(period):
            c = body(Step(Index(t, firsts + j), int(plan.step_kind[start + j]), (start, stop)), c)
        return c

    return lax.fori_loop(0, blocks, block, carry)


def _arguments(plan: Plan, kind: Kind, prim: Primal, pos: Any, written: bool = False,
               shared_once: bool = False) -> tuple[tuple, tuple]:
    """θ and input states of the kind's member ``pos`` (an index or an array of indices);
    ``written``: the loop writes the states; ``shared_once``: a block all members use is read
    once (one row, not a row per member)."""
    if isinstance(pos, np.ndarray):  # all members at once: static tables
        theta = tuple(read_row(prim.params[g], row) if shared_once and row is not None
                      else read_rows(prim.params[g], kind.by_member.params[pos, p])
                      for p, (g, row) in enumerate(zip(kind.param_groups, kind.shared_rows)))
        inputs = tuple(read_rows(prim.states[g], kind.by_member.reads[pos, r]) for r, g in enumerate(kind.read_groups))
    else:
        pslots, rslots = _at(kind.by_member.params, pos), _at(kind.by_member.reads, pos)
        theta = tuple(read_row(prim.params[g], pslots[..., p]) for p, g in enumerate(kind.param_groups))
        inputs = tuple(read_row(prim.states[g], rslots[..., r], written) for r, g in enumerate(kind.read_groups))
    theta = tuple(plan.param_groups[g].typed(t) for t, g in zip(theta, kind.param_groups))
    inputs = tuple(plan.state_groups[g].typed(u) for u, g in zip(inputs, kind.read_groups))
    return theta, inputs


def _own(prim: Primal, kind: Kind, pos: Any) -> tuple:
    """The stored residuals of the kind's member ``pos`` (an index or an array of indices)."""
    take = read_rows if isinstance(pos, np.ndarray) else read_row
    return tuple(take(prim.residuals[r], off + pos) for r, off in zip(kind.own_groups, kind.own_offsets))


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
            return _zeros_like_aval(self.out.row_avals(tangent=True))

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


def _vjp(plan: Plan, kind: Kind, prim: Primal, own: Any, theta: tuple, inputs: tuple, out: Any) -> Callable:
    if prim.residuals is None:  # remat: linearise again
        return jax.vjp(kind.fn, theta, *inputs)[1]
    return kind.rebuild(own, theta, inputs, out)


def layer_maps(plan: Plan, kind: Kind, prim: Primal, k: int, pos: Any) -> LayerMaps:
    theta, inputs = _arguments(plan, kind, prim, pos)
    out = read_row(prim.states[kind.out_group], _at(kind.by_member.out, pos))
    own = None if prim.residuals is None else _own(prim, kind, pos)
    return LayerMaps(plan, kind, _vjp(plan, kind, prim, own, theta, inputs, out))


# -- the sequential parts --------------------------------------------------------------------------
def _slot_zeros(plan: Plan, writes: Writes, buffer: tuple[str, int]) -> Any:
    """Zeros shaped like one row of ``buffer``: what an inactive kind writes into a slot."""
    family, n = buffer
    if family == "res":
        return _zeros_like_aval(plan.res_avals[n])
    group = (plan.param_groups if family == "param" else plan.state_groups)[n]
    return group.row_zeros(tangent=family in writes.tangent)


def _step(plan: Plan, step: Step, writes: Writes, branch: Callable[[int, Any], Any], operand: Any,
          carried: Any = None) -> Any:
    """The step's values, one per write slot: the branch of the step's kind fills its slots; with
    several kinds (a ``lax.switch``), the other slots hold zeros. None: nothing to write.

    With ``carried`` (zeros shaped like a value the loop carries to the next step), a branch
    returns (its values, that value or None) and so does this: (slots, value)."""
    def place(k: int, values: list) -> list:
        out: list = [None] * len(writes.buffers)
        for v, s in zip(values, writes.of_kind[k]):
            out[s] = v
        return out

    def run_kind(k: int, op: Any) -> Any:
        if carried is None:
            return place(k, branch(k, op))
        values, extra = branch(k, op)
        return place(k, values), carried if extra is None else extra

    if step.kind is not None:
        return run_kind(step.kind, operand)

    def make(k):
        def run(op):
            out = run_kind(k, op)
            slots = out if carried is None else out[0]
            slots = [_slot_zeros(plan, writes, writes.buffers[s]) if v is None else v for s, v in enumerate(slots)]
            return slots if carried is None else (slots, out[1])

        return run

    return lax.switch(_scalar(_at(plan.step_kind, step.index)), [make(k) for k in range(len(plan.kinds))], operand)


def _write(bufs: dict[str, list], writes: Writes, i: Any, values: list, add: bool,
           set_buffers: frozenset = frozenset()) -> None:
    """All writes of a step, outside any switch: XLA updates the big buffers in place.
    ``add``: values are added, except into ``set_buffers`` (rows written once: set)."""
    rows = _at(writes.rows, i)
    by_buffer: dict[tuple[str, int], list[int]] = {}
    for s, v in enumerate(values):
        if v is not None:
            by_buffer.setdefault(writes.buffers[s], []).append(s)
    for (family, n), slots in by_buffer.items():
        buf = bufs[family][n]
        if (family, n) in set_buffers:
            for s in slots:
                buf = _set_row(buf, rows[s], values[s])
        elif len(slots) == 1 or isinstance(buf, RowList) or not add:
            for s in slots:
                buf = (_add_row if add else _set_row)(buf, rows[s], values[s])
        else:  # one scatter: the write depends on every value, so on every read behind them
            idx = jnp.stack([jnp.asarray(_scalar(rows[s], affine=False)) for s in slots])
            buf = jax.tree.map(lambda b, *vs: b.at[idx].add(jnp.stack([v.astype(b.dtype) for v in vs])),
                               buf, *[values[s] for s in slots])
        bufs[family][n] = buf


def _jvp_moving(fn: Callable, theta: tuple, inputs: tuple, dtheta: tuple, dinputs: tuple) -> tuple[Any, Any]:
    """fn(θ, *inputs) and its derivative along the tangents that are not None (the rest held)."""
    moving = [(0, p, t) for p, t in enumerate(dtheta) if t is not None]
    moving += [(1, r, t) for r, t in enumerate(dinputs) if t is not None]

    def f(*args):
        th, ins = list(theta), list(inputs)
        for (where, n, _), a in zip(moving, args):
            (th if where == 0 else ins)[n] = a
        return fn(tuple(th), *ins)

    primals = tuple((theta if where == 0 else inputs)[n] for where, n, _ in moving)
    if not primals:  # nothing moves: the tangent is zero
        out = fn(theta, *inputs)
        return out, jax.tree.map(jnp.zeros_like, out)
    return jax.jvp(f, primals, tuple(t for _, _, t in moving))


def _with_residuals(plan: Plan, k: int, theta: tuple, inputs: tuple) -> list[Any]:
    """A forward step that keeps the layer's residuals: its output, then its stored residuals.
    The plan's analysis traced the layer's linearisation once already: its jaxpr is replayed, so
    the stored residuals are always those of the analysed linearisation (whatever the arguments:
    one array passed twice, weak types) and the layer's Python is not traced again."""
    kind = plan.kinds[k]
    values = jaxpr_as_fun(kind.probe)(*jax.tree.leaves((theta, inputs)))
    n_out = len(jax.tree.leaves(kind.out_aval))
    out = jax.tree.unflatten(jax.tree.structure(kind.out_aval), values[:n_out])
    return [out, *(values[n_out + n] for n in kind.kept)]


def _with_tangent(plan: Plan, kind: Kind, pos: Any, theta: tuple, inputs: tuple, h: list[Any] | None,
                  tangents: list[Any], carried: tuple[int, Any] | None) -> list[Any]:
    """A forward step that also takes row i of the forward substitution: U_i, then Z_i =
    ∂Φ_i/∂θ h + Σ_j ∂Φ_i/∂U_j Z_j (one JVP of the layer). ``carried``: (read slot, Z) of a read
    that the loop carries instead of reading it from ``tangents``."""
    pslots, rslots = _at(kind.by_member.params, pos), _at(kind.by_member.reads, pos)
    pgroups, sgroups = plan.param_groups, plan.state_groups
    dtheta = tuple(None if h is None or not pgroups[g].differentiable
                   else pgroups[g].full_tangent(read_row(h[g], pslots[..., p]))
                   for p, g in enumerate(kind.param_groups))
    dinputs = [None if tangents[g] is None else read_row(tangents[g], rslots[..., r], written=True)
               for r, g in enumerate(kind.read_groups)]
    if carried is not None and carried[1] is not None:
        dinputs[carried[0]] = carried[1]
    dinputs = [None if d is None else sgroups[g].full_tangent(d) for d, g in zip(dinputs, kind.read_groups)]
    out, dout = _jvp_moving(kind.fn, theta, inputs, dtheta, tuple(dinputs))
    if tangents[kind.out_group] is None:
        return [out]
    return [out, sgroups[kind.out_group].tangent(dout)]


def _carry_start(plan: Plan, start: int, stop: int, states: list[Any], tangents: list[Any] | None) -> Any:
    """What the loop carries into segment ``start:stop`` (see ``Plan.forwarding``): the output the
    segment's first step reads, and its tangent; None where nothing is carried."""
    fwd = plan.forwarding(start, stop)
    if fwd is None:
        return None

    def start_row(bufs, tangent):
        if bufs[fwd.group] is None:
            return None
        if fwd.first_row is None:
            return plan.state_groups[fwd.group].row_zeros(tangent)
        return read_row(bufs[fwd.group], fwd.first_row)

    return start_row(states, False), start_row(tangents, True) if tangents is not None else None


def forward(plan: Plan, params: list[Any], states: list[Any], residuals: bool = True,
            tangents: tuple[list[Any] | None, list[Any]] | None = None) -> Any:
    """U = Φ(U, θ) by forward substitution; with ``residuals``, each layer's VJP residuals too.

    With ``tangents`` = (h, Z₀) — parameter- and state-layout tangents, None for constant groups —
    the same sweep also solves ℒ Z = ℳ* h + Z₀: row i, Z_i = ∂Φ_i/∂θ h + Σ_j ∂Φ_i/∂U_j Z_j (+ Z₀_i),
    needs only layer i's linearisation, at hand the moment U_i is computed (a JVP of the layer),
    so nothing is stored for it. Returns (Primal, Z) then.
    """
    assert not (residuals and tangents is not None)
    h = tangents[0] if tangents is not None else None
    writes = plan.writes("forward+res" if residuals else "forward+tangent" if tangents is not None else "forward")

    def body(step, carry):
        states, res, tans, prev = carry
        fwd = plan.forwarding(*step.segment) if step.segment else None

        def branch(k, operand):
            sts, tns, prev = operand
            kind = plan.kinds[k]
            pos = _at(kind.by_step.member, step.index)
            theta, inputs = _arguments(plan, kind, Primal(params, sts, []), pos, written=True)
            carried = fwd is not None and k in fwd.read  # the previous step's output, carried
            if carried:
                r = fwd.read[k]
                inputs = (*inputs[:r], plan.state_groups[fwd.group].typed(prev[0]), *inputs[r + 1:])
            if residuals:
                return _with_residuals(plan, k, theta, inputs)
            if tangents is None:
                return [kind.fn(theta, *inputs)]
            return _with_tangent(plan, kind, pos, theta, inputs, h, tns, (fwd.read[k], prev[1]) if carried else None)

        values = _step(plan, step, writes, branch, (states, tans, prev))
        bufs = {"state": list(states), "res": list(res), "tangent": list(tans)}
        _write(bufs, writes, step.index, values, add=False)
        if fwd is not None:  # every kind here writes its output to fwd.group: the same slots
            slots = writes.of_kind[step.kind if step.kind is not None else next(iter(fwd.read))]
            group = plan.state_groups[fwd.group]
            prev = (group.cast(values[slots[0]]),
                    group.cast(values[slots[1]], tangent=True) if prev[1] is not None else None)
        return bufs["state"], bufs["res"], bufs["tangent"], prev

    def enter(start, stop, carry):
        states, res, tans, _ = carry
        return states, res, tans, _carry_start(plan, start, stop, states, tans if tangents is not None else None)

    res0 = [RowList([_zeros_like_aval(a)] * (n + 1)) if plan.unrolled or as_rows else _zeros_like_aval(a, (n + 1,))
            for a, n, as_rows in zip(plan.res_avals, plan.res_rows, plan.res_as_rows)] if residuals else []
    tans0 = list(tangents[1]) if tangents is not None else [None] * len(plan.state_groups)
    states, res, tans, _ = _loop(plan, body, (list(states), res0, tans0, None), enter=enter)
    prim = Primal(params, states, res if residuals else None)
    return (prim, tans) if tangents is not None else prim


def forward_substitution(plan: Plan, prim: Primal, rhs: list[Any], h: list[Any] | None = None,
                         compact: bool = False, rhs_full: bool = False) -> list[Any]:
    """Z with ℒ Z = rhs: Z_i = rhs_i + Σ_j ∂Φ_i/∂U_j Z_j, first layer to last. With ``h``
    (parameter-layout tangents), ℒ Z = rhs + ℳ* h: ∂Φ_i/∂θ h is formed in the loop, from the same
    linearisation of each layer (the transpose of ℳΛ accumulated in the back substitution).

    ``compact``: Z in the layout of ``plan.compact`` — rows only for the states read again from
    the buffer or returned (inputs and outputs); the others go from step to step in the loop's
    carry — and rhs read at the input rows only (a tangent of the inputs: every row a layer
    writes is set, not added to). Returns that layout, its pad row zero. With ``rhs_full`` rhs is
    in the full layout and read at every row (ℳ* h formed before the loop): Z_i = rhs_i + ..., Z
    still compact."""
    compact = compact and not plan.unrolled  # unrolled: rows are values XLA drops where unread
    zplan = plan.compact if compact else plan
    writes = zplan.writes("forward_sub")
    everywhere = rhs if compact and rhs_full else None
    if everywhere is not None:  # the buffer starts from rhs at its rows (the inputs' among them)
        rhs = take_rows(rhs, zplan.to_full)

    def forwarded(segment: tuple[int, int] | None) -> Any:
        fwd = zplan.forwarding(*segment) if compact and segment else None
        return None if fwd is None or rhs[fwd.group] is None else fwd  # integer states: no tangent

    def body(step, carry):
        z, prev = carry
        i = step.index
        fwd = forwarded(step.segment)

        def branch(k, operand):
            zz, prev = operand
            kind = plan.kinds[k]
            if zz[kind.out_group] is None:  # an integer state: no tangent
                return []
            pos = _at(kind.by_step.member, i)
            slots = _at(zplan.kinds[k].by_member.reads, pos)
            reads = [read_row(zz[g], slots[r], written=True) if zz[g] is not None else None
                     for r, g in enumerate(kind.read_groups)]
            if fwd is not None and k in fwd.read and prev is not None:  # the previous step's Z
                reads[fwd.read[k]] = prev
            hs = None
            if h is not None and kind.param_groups:
                pslots = _at(kind.by_member.params, pos)
                hs = tuple(read_row(h[g], pslots[..., p]) for p, g in enumerate(kind.param_groups))
            value = layer_maps(plan, kind, prim, k, pos).state_forward(tuple(reads), hs)
            if everywhere is not None:
                value = jax.tree.map(jnp.add, value, read_row(everywhere[kind.out_group], _at(kind.by_member.out, pos)))
            return [value]

        values = _step(zplan, step, writes, branch, (z, prev))
        bufs = {"state": list(z)}
        if fwd is None or not zplan.carried_only(*step.segment):  # else: the last step's, on leaving
            _write(bufs, writes, i, values, add=not compact)
        if fwd is not None:
            value = values[writes.of_kind[step.kind if step.kind is not None else next(iter(fwd.read))][0]]
            prev = None if value is None else zplan.state_groups[fwd.group].cast(value, tangent=True)
        return bufs["state"], prev

    def enter(start, stop, carry):
        z, _ = carry
        fwd = forwarded((start, stop))
        if fwd is None:
            return z, None
        group = zplan.state_groups[fwd.group]
        first = group.row_zeros(True) if fwd.first_row is None else read_row(z[fwd.group], fwd.first_row)
        return z, first

    def leave(start, stop, carry):
        z, prev = carry
        fwd = forwarded((start, stop))
        if fwd is None or not zplan.carried_only(start, stop):
            return carry
        last = int(zplan.kinds[int(plan.step_kind[stop - 1])].by_step.out[stop - 1])
        z = list(z)
        z[fwd.group] = _set_row(z[fwd.group], last, prev)
        return z, None

    # Without ``compact`` carrying Z_i to the next step was measured to save nothing: the step
    # still reads rhs_i from the buffer.
    z, _ = _loop(plan, body, (list(rhs), None), enter=enter, leave=leave)
    return without_pad(zplan, z) if compact else z


def back_substitution(plan: Plan, prim: Primal, rhs: list[Any], grads: list[Any] | None = None,
                      compact: bool = False) -> Any:
    """Λ with ℒ* Λ = rhs: Λ_j = rhs_j + Σ_{i reads j} (∂Φ_i/∂U_j)* Λ_i, last layer to first.

    With ``grads`` (parameter-layout buffers), ℳΛ is also added into them inside the loop, from
    the same linearisation of each layer; returns (Λ, grads + ℳΛ) then.

    ``compact``: the transpose of `forward_substitution`'s. rhs and Λ in the layout of
    ``plan.compact``; the cotangent of a read the forward substitution carried goes to the
    previous step in the loop's carry (for a state without a row, its Λ), into the buffer only
    at the start of the stretch. Λ is returned at the input rows, zeros elsewhere (the forward
    substitution reads rhs only there).
    """
    in_loop = grads is not None
    compact = compact and not plan.unrolled
    zplan = plan.compact if compact else plan
    absent = frozenset(g for g, b in enumerate(rhs) if b is None)  # no cotangent wanted (or none exists)
    writes = zplan.writes("back", with_params=in_loop, absent=absent)

    def forwarded(segment: tuple[int, int] | None) -> Any:
        fwd = zplan.forwarding(*segment) if compact and segment else None
        return None if fwd is None or fwd.group in absent else fwd

    def body(step, carry):
        lam, acc, ct_next = carry
        i = step.index
        fwd = forwarded(step.segment)
        only_carried = fwd is not None and zplan.carried_only(*step.segment)

        def branch(k, operand):
            ll, ct_next = operand
            kind = plan.kinds[k]
            if ll[kind.out_group] is None:  # an integer state: no cotangent to propagate
                return [] if fwd is None else ([], None)
            pos = _at(kind.by_step.member, i)
            if only_carried:  # Λ_i is the next step's cotangent alone (the last's: read on entry)
                lam_i = ct_next
            else:
                lam_i = read_row(ll[kind.out_group], _at(zplan.kinds[k].by_member.out, pos), written=True)
                if fwd is not None:  # plus the cotangent of the next step's carried read
                    lam_i = jax.tree.map(jnp.add, lam_i, ct_next)
            maps = layer_maps(plan, kind, prim, k, pos)
            cts, pcts = maps.adjoints(lam_i) if in_loop else (maps.state_adjoint(lam_i), ())
            carried = fwd.read.get(k) if fwd is not None else None
            passed = None if carried is None else cts[carried]
            # the carried read keeps its slot, written nothing (None: zeros where kinds switch)
            values = [None if r == carried else ct for r, (ct, g) in enumerate(zip(cts, kind.read_groups))
                      if ct is not None and g not in absent]
            values += list(pcts)
            return values if fwd is None else (values, passed)

        zeros = None if fwd is None else zplan.state_groups[fwd.group].row_zeros(True)
        out = _step(zplan, step, writes, branch, (lam, ct_next), carried=zeros)
        values, ct_next = (out, ct_next) if fwd is None else out
        bufs = {"state": list(lam), "param": list(acc)}
        # With kinds known at trace time no slot of a parameter group written once is inactive
        # (an inactive one adds zeros to row 0), so its rows are set: no read of the old row.
        once = frozenset(("param", g) for g in plan.params_written_once) if step.kind is not None else frozenset()
        _write(bufs, writes, i, values, add=True, set_buffers=once)
        return bufs["state"], bufs["param"], ct_next

    def enter(start, stop, carry):
        fwd = forwarded((start, stop))
        if fwd is None:
            return (*carry[:2], None)
        if zplan.carried_only(start, stop):  # the last step's Λ: complete, its readers are behind
            last = int(zplan.kinds[int(plan.step_kind[stop - 1])].by_step.out[stop - 1])
            return (*carry[:2], read_row(carry[0][fwd.group], last))
        return (*carry[:2], zplan.state_groups[fwd.group].row_zeros(True))

    def leave(start, stop, carry):
        lam, acc, ct = carry
        fwd = forwarded((start, stop))
        if fwd is not None and fwd.first_row is not None:  # the stretch's first read: a row
            lam = list(lam)
            lam[fwd.group] = _add_row(lam[fwd.group], fwd.first_row, ct)
        return lam, acc, None

    if compact:  # the pad row of rhs is no row of Λ (it must stay zero: unwritten states read it)
        rhs = without_pad(zplan, rhs)
    # ℳΛ goes into fresh zeros, added to ``grads`` after the loop: rows can then be set rather
    # than accumulated, and XLA drops the addition where ``grads`` is zeros (a gradient).
    acc = [g.zeros(plan.unrolled, tangent=True) for g in plan.param_groups] if in_loop else []
    lam, acc, _ = _loop(plan, body, (list(rhs), acc, None), reverse=True, enter=enter, leave=leave)
    lam = at_inputs(zplan, lam) if compact else lam
    return (lam, [jax.tree.map(jnp.add, g, a) for g, a in zip(grads, acc)]) if in_loop else lam


def take_rows(bufs: list[Any], tables: tuple[np.ndarray, ...]) -> list[Any]:
    """Each group's buffer at the rows its table lists (between a plan's layout and its compact
    one: ``Plan.to_compact``, ``Plan.to_full``)."""
    return [None if b is None else jax.tree.map(lambda x, m=m: x[m], b) for b, m in zip(bufs, tables)]


def without_pad(plan: Plan, bufs: list[Any]) -> list[Any]:
    """The buffers with their pad rows zero (a scalar set: it keeps an explicitly sharded buffer's
    sharding, where a row of zeros made here would carry none)."""
    return [b if b is None or not group.pad else jax.tree.map(lambda x, r=group.pad_row: x.at[r].set(0), b)
            for b, group in zip(bufs, plan.state_groups)]


def at_inputs(plan: Plan, bufs: list[Any]) -> list[Any]:
    """The buffers at the rows of the network's inputs, zeros elsewhere."""
    out = []
    for g, (b, group) in enumerate(zip(bufs, plan.state_groups)):
        rows = [plan.state_loc[name][1] for name in plan.net.inputs if plan.state_loc[name][0] == g]
        if b is None or None in rows:  # a stacked input: the whole group
            out.append(b)
            continue
        mask = np.zeros(group.rows, bool)
        mask[rows] = True
        out.append(jax.tree.map(lambda x, m=mask: jnp.where(m.reshape(-1, *[1] * (x.ndim - 1)), x, 0), b))
    return out


# -- the parallel parts: one vmapped application per kind -------------------------------------------
def _per_kind(plan: Plan, prim: Primal, k: int, apply: Callable[[LayerMaps, Any], Any], args: Any,
              args_axes: Any = 0) -> Any:
    """``apply`` to every member layer of kind k at once, vmapped over the stacked residuals
    (``args_axes``: as vmap's in_axes for ``args``; None where all members take the same value)."""
    kind = plan.kinds[k]
    members = np.arange(kind.size)
    # A weight shared along a sequence goes in once: with remat the layers are re-linearised here,
    # and n gathered copies of it were kept (a 15-layer segment of an RNN: 15 copies of A and B).
    theta, inputs = _arguments(plan, kind, prim, members, shared_once=True)
    theta_axes = tuple(0 if row is None else None for row in kind.shared_rows)
    own = None if prim.residuals is None else _own(prim, kind, members)
    out = read_rows(prim.states[kind.out_group], kind.by_member.out[:-1])

    def one(theta, inputs, own, out, a):
        return apply(LayerMaps(plan, kind, _vjp(plan, kind, prim, own, theta, inputs, out)), a)

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
            out[g] = _scatter_add(out[g], kind.by_member.out[:n], jax.tree.map(jnp.negative, dz))
        else:
            lam = read_rows(e[kind.out_group], kind.by_member.out[:n])
            cts = _per_kind(plan, prim, k, lambda m, a: m.state_adjoint(a), lam)
            for r, (g, ct) in enumerate(zip(kind.read_groups, cts)):
                if ct is not None and out[g] is not None:
                    out[g] = _scatter_add(out[g], kind.by_member.reads[:n, r], jax.tree.map(jnp.negative, ct))
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
        out[g] = _scatter_add(out[g], kind.by_member.out[:n], dz)
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
            out[g] = _scatter_add(out[g], kind.by_member.params[:n, p], ct)
    return out


def _per_example_param_cts(plan: Plan, prim: Primal, kind: Kind, lam: list[Any], batch: int, examples: Any) -> tuple:
    """Per parameter slot of ``kind``: [members, examples, ...] cotangents (∂Φ_i/∂θ)* Λ_i[b], each
    the layer's VJP on example b alone."""
    n = kind.size
    lam_k = read_rows(lam[kind.out_group], kind.by_member.out[:n])
    theta, inputs = _arguments(plan, kind, prim, np.arange(n))
    out_group = plan.state_groups[kind.out_group]
    param_groups = [plan.param_groups[g] for g in kind.param_groups]
    leaves, tree = jax.tree.flatten(inputs)  # each [n, ...]: the members stacked
    rows = jax.tree.leaves(tuple(plan.state_groups[g].row_avals() for g in kind.read_groups))
    batched = [bool(a.ndim) and a.shape[0] == batch for a in rows]
    if examples is not None:  # the members' rows of those examples: axis 1 (axis 0: the members)
        leaves = [jnp.take(x, examples, axis=1) if b else x for x, b in zip(leaves, batched)]
        lam_k = jax.tree.map(lambda x: jnp.take(x, examples, axis=1), lam_k)

    example = _example_vjp(kind, out_group, param_groups, tree, batched)
    member = lambda theta, leaves, lam_i: jax.vmap(example, in_axes=(None, [0 if b else None for b in batched], 0))(
        theta, leaves, lam_i)
    return jax.vmap(member)(theta, leaves, lam_k)


def _example_vjp(kind: Kind, out_group: Group, param_groups: list[Group], tree: Any, batched: list[bool]) -> Callable:
    """(θ, one example's input leaves, its Λ row) ↦ the member's parameter cotangents per slot:
    the layer's VJP on that example alone (``batched`` inputs get their batch axis back)."""
    def example(theta, leaves_b, lam_b):
        one = tree.unflatten([x[None] if b else x for x, b in zip(leaves_b, batched)])
        _, vjp = jax.vjp(lambda th: kind.fn(th, *one), theta)
        cts = vjp(out_group.full_tangent(jax.tree.map(lambda x: x[None], lam_b)))[0]
        return tuple(g.tangent(ct) for g, ct in zip(param_groups, cts))

    return example


def param_adjoint_per_example(plan: Plan, prim: Primal, lam: list[Any], batch: int,
                              examples: Any = None) -> list[Any]:
    """ℳ Λ split by example: parameter-layout buffers with a leading axis of ``batch``, row b the
    sum over layers of (∂Φ_i/∂θ)* Λ_i restricted to example b.

    The leading axis of every state (and of the rows of stacked inputs) is the batch: a layer's
    output for example b depends only on its inputs' row b (callers check it), so its parameter
    cotangent splits into one term per example — the VJP of the layer on that example alone
    (inputs and Λ_i of one row) — vmapped over the examples and over the kind's members.
    ``examples``: the indices of the examples wanted (default: all ``batch``).
    """
    wanted = batch if examples is None else len(examples)
    out = [jax.tree.map(lambda z: jnp.zeros((wanted, *z.shape), z.dtype), g.zeros(plan.unrolled, tangent=True))
           for g in plan.param_groups]
    for kind in plan.kinds:
        if lam[kind.out_group] is None or not kind.param_groups:
            continue
        cts = _per_example_param_cts(plan, prim, kind, lam, batch, examples)
        for p, (g, ct) in enumerate(zip(kind.param_groups, cts)):  # ct: [members, examples, ...]
            idx = kind.by_member.params[:kind.size, p]
            out[g] = jax.vmap(lambda o, c, idx=idx: _scatter_add(o, idx, c), in_axes=(0, 1))(out[g], ct)
    return out


def param_kinds(plan: Plan) -> list[Kind]:
    """The kinds with parameters whose output has a (co)tangent: those ℳ has blocks for."""
    return [k for k in plan.kinds if k.param_groups and plan.state_groups[k.out_group].differentiable]


def tangent_leaves(group: Group) -> int:
    """How many leaves a row of ``group`` has in the tangent layout."""
    return jax.tree.structure(group.row_avals(tangent=True)).num_leaves


def member_vjp(plan: Plan, prim: Primal, kind: Kind, batch: int) -> tuple:
    """One member's per-example VJP as a function of flat leaves (θ, one example's inputs, its Λ
    row) giving its parameter cotangent leaves; their example shapes; which of them are Λ (the
    adjoint: last); the kind's θ and input leaves (members stacked) with the vmap axes of the
    inputs over the examples; zeros shaped like one example's Λ leaves (for what ignores them)."""
    theta, inputs = _arguments(plan, kind, prim, np.arange(kind.size))
    out_group = plan.state_groups[kind.out_group]
    param_groups = [plan.param_groups[g] for g in kind.param_groups]
    leaves, tree = jax.tree.flatten(inputs)
    rows = jax.tree.leaves(tuple(plan.state_groups[g].row_avals() for g in kind.read_groups))
    batched = [bool(r.ndim) and r.shape[0] == batch for r in rows]
    th_leaves, th_tree = jax.tree.flatten(theta)
    lam_tree = jax.tree.structure(out_group.row_avals(tangent=True))
    lam_avals = jax.tree.leaves(out_group.row_avals(tangent=True))
    nt, nx = len(th_leaves), len(leaves)
    example_vjp = _example_vjp(kind, out_group, param_groups, tree, batched)
    per_example = lambda *flat: jax.tree.leaves(example_vjp(
        th_tree.unflatten(flat[:nt]), list(flat[nt:nt + nx]), lam_tree.unflatten(flat[nt + nx:])))
    one = lambda x, lead: jax.ShapeDtypeStruct(x.shape[lead:], x.dtype)
    example = [one(x, 1) for x in th_leaves] + [one(x, 2 if b else 1) for x, b in zip(leaves, batched)]
    example += [one(a, 1) for a in lam_avals]
    axes = [None] * nt + [0 if b else None for b in batched]
    varying = [False] * (nt + nx) + [True] * len(lam_avals)
    lam_zeros = [jnp.zeros(a.shape[1:], a.dtype) for a in lam_avals]
    return per_example, example, varying, th_leaves, leaves, axes, lam_zeros


class ParamSquares:
    """Σ_k Σ_b w_kb (ℳ Λ_k restricted to example b)², elementwise, in the parameter layout (no
    batch axis): what the GGN diagonal sums over its adjoints Λ_k. `parts` takes one (Λ_k,
    w_k); the caller adds the parts up over k and calls `total` once.

    Where a row of a block is used by one layer only, its per-example cotangents are squared and
    summed over the examples as they are formed (no [batch, parameters] buffer), and an outer
    product a_bᵀ δ_kb keeps Σ_k w_k δ_k² in its part: (a²)ᵀ(·) is one matrix product at the end
    (`SquareSums`). Rows used by several layers (shared blocks) first add the layers'
    contributions per example, then square, per k."""

    def __init__(self, plan: Plan, prim: Primal, batch: int):
        self.plan, self.prim, self.batch = plan, prim, batch
        uses: dict[tuple[int, int], int] = {}
        for kind in plan.kinds:
            for p, g in enumerate(kind.param_groups):
                for row in kind.by_member.params[:kind.size, p]:
                    uses[(g, int(row))] = uses.get((g, int(row)), 0) + 1
        self.exclusive = {g for g in range(len(plan.param_groups))
                          if all(n <= 1 for (gg, _), n in uses.items() if gg == g)}
        self.kinds = param_kinds(plan)
        self.members = [self._members(kind) for kind in self.kinds]

    def _members(self, kind: Kind) -> tuple:
        """The kind's θ and input leaves (members stacked), their vmap axes, the
        `SquareSums` of one member's per-example VJP, and zeros for its Λ leaves."""
        per_example, example, varying, th_leaves, leaves, axes, lam_zeros = member_vjp(
            self.plan, self.prim, kind, self.batch)
        squared = [g in self.exclusive for g in kind.param_groups
                   for _ in range(tangent_leaves(self.plan.param_groups[g]))]
        return th_leaves, leaves, axes, SquareSums(per_example, example, squared, varying), lam_zeros

    def parts(self, lam: list[Any], weights: jax.Array) -> tuple[list, list]:
        """One adjoint's share: per kind, its members' `SquareSums.parts` of the leaves of
        unshared rows (None for shared ones); per shared group, its squares (complete)."""
        plan = self.plan
        shared = {g: jax.tree.map(lambda z: jnp.zeros((self.batch, *z.shape), z.dtype),
                                  plan.param_groups[g].zeros(plan.unrolled, tangent=True))
                  for g in range(len(plan.param_groups)) if g not in self.exclusive}
        kinds = []
        for kind, (th, xs, axes, sums, _) in zip(self.kinds, self.members):
            lam_k = jax.tree.leaves(read_rows(lam[kind.out_group], kind.by_member.out[:kind.size]))
            parts = jax.vmap(lambda th, xs, lm, sums=sums, axes=axes: sums.parts(
                [*th, *xs, *lm], [*axes, *[0] * len(lm)], weights))(th, xs, lam_k)
            kept, at = [], 0
            for p, g in enumerate(kind.param_groups):
                tree = jax.tree.structure(plan.param_groups[g].row_avals(tangent=True))
                leaves, at = parts[at:at + tree.num_leaves], at + tree.num_leaves
                if g in self.exclusive:
                    kept.extend(leaves)
                    continue
                kept.extend([None] * tree.num_leaves)  # [members, batch, ...]: summed over layers, then squared
                ct = tree.unflatten(leaves)
                idx = kind.by_member.params[:kind.size, p]
                shared[g] = jax.vmap(lambda o, c, idx=idx: _scatter_add(o, idx, c), in_axes=(0, 1))(shared[g], ct)
            kinds.append(kept)
        squares = {g: jax.tree.map(lambda x: weighted_square_sum(x, weights), acc) for g, acc in shared.items()}
        return kinds, [squares.get(g) for g in range(len(plan.param_groups))]

    def total(self, parts: tuple[list, list]) -> list[Any]:
        """The parameter-layout squares from parts summed over the adjoints."""
        plan = self.plan
        kinds, squares = parts
        out = [g.zeros(plan.unrolled, tangent=True) if sq is None else sq
               for g, sq in zip(plan.param_groups, squares)]
        for kind, (th, xs, axes, sums, zeros), kept in zip(self.kinds, self.members, kinds):
            done = jax.vmap(lambda th, xs, part, sums=sums, axes=axes: sums.total(
                part, [*th, *xs, *zeros], [*axes, *[None] * len(zeros)]))(th, xs, kept)
            at = 0
            for p, g in enumerate(kind.param_groups):
                grp = plan.param_groups[g]
                tree = jax.tree.structure(grp.row_avals(tangent=True))
                if g in self.exclusive:
                    ct = tree.unflatten(done[at:at + tree.num_leaves])
                    out[g] = _scatter_add(out[g], kind.by_member.params[:kind.size, p], ct)
                at += tree.num_leaves
        return out


class ParamFactors:
    """K-FAC factors in the parameter layout, from the adjoints Λ_k and weights w_k of the GGN's
    columns (`parts` for one, added up over k by the caller; `total` once).

    Per parameter group and leaf whose every use is a product x_bᵀ y_b of one example's operands
    (a dense layer; positions of a sequence summed), the rows' factors (A/N, Γ) stacked — A = Σ
    x_bᵀ x_b over the examples and every layer (and position) using the row, Γ = Σ_k Σ_b w_kb
    y_kbᵀ y_kb, N the number of (example, layer, position) terms — in the order of the leaf's axes
    (`OuterFactors`): the GGN block of a row ≈ left ⊗ right. None elsewhere. A row used by
    several layers sums their factors (K-FAC "expand" for shared weights)."""

    def __init__(self, plan: Plan, prim: Primal, batch: int):
        self.plan, self.prim, self.batch = plan, prim, batch
        self.kinds = param_kinds(plan)
        self.members = []
        layouts: dict[tuple[int, int], Any] = {}
        for kind in self.kinds:
            per_example, example, varying, th, xs, axes, zeros = member_vjp(plan, prim, kind, batch)
            factors = OuterFactors(per_example, example, varying)
            self.members.append((th, xs, axes, factors, zeros))
            for n, (_, g, leaf) in enumerate(self._leaves(kind)):
                found = factors.layout(n) if factors.factored(n) else None
                layouts[(g, leaf)] = found if layouts.get((g, leaf), found) == found else None
        self.layouts = {key: lay for key, lay in layouts.items() if lay is not None}

    def _leaves(self, kind: Kind) -> list[tuple[int, int, int]]:
        """(slot, group, leaf) of each cotangent leaf of a member of ``kind``, in order."""
        return [(p, g, leaf) for p, g in enumerate(kind.param_groups)
                for leaf in range(tangent_leaves(self.plan.param_groups[g]))]

    def _gathered(self, grams: list, operand: int) -> dict[tuple[int, int], jax.Array]:
        """Per factored (group, leaf): the members' Gram matrices added into their rows."""
        out: dict[tuple[int, int], jax.Array] = {}
        for kind, per_kind in zip(self.kinds, grams):
            for n, (slot, g, leaf) in enumerate(self._leaves(kind)):
                if (g, leaf) not in self.layouts:
                    continue
                _, p, q = self.layouts[(g, leaf)]
                size = p if operand == 0 else q
                buf = out.get((g, leaf), jnp.zeros((self.plan.param_groups[g].rows, size, size), per_kind[n].dtype))
                out[(g, leaf)] = _scatter_add(buf, kind.by_member.params[:kind.size, slot], per_kind[n])
        return out

    def parts(self, lam: list[Any], weights: jax.Array) -> dict[tuple[int, int], jax.Array]:
        """One adjoint's Σ_b w_b y_bᵀ y_b per factored (group, leaf), rows stacked."""
        grams = []
        for kind, (th, xs, axes, factors, _) in zip(self.kinds, self.members):
            lam_k = jax.tree.leaves(read_rows(lam[kind.out_group], kind.by_member.out[:kind.size]))
            grams.append(jax.vmap(lambda th, xs, lm, f=factors, axes=axes: f.parts(
                [*th, *xs, *lm], [*axes, *[0] * len(lm)], weights))(th, xs, lam_k))
        return self._gathered(grams, 1)

    def total(self, parts: dict[tuple[int, int], jax.Array]) -> dict[int, list]:
        """Per parameter group, per leaf: (left, right) with rows stacked, or None."""
        grams, counts = [], {}
        for kind, (th, xs, axes, factors, zeros) in zip(self.kinds, self.members):
            grams.append(jax.vmap(lambda th, xs, f=factors, axes=axes: f.total(
                [*th, *xs, *zeros], [*axes, *[None] * len(zeros)]))(th, xs))
            for n, (slot, g, leaf) in enumerate(self._leaves(kind)):
                if (g, leaf) in self.layouts:
                    rows = counts.setdefault((g, leaf), np.zeros(self.plan.param_groups[g].rows, np.int64))
                    np.add.at(rows, kind.by_member.params[:kind.size, slot], factors.count(n, self.batch))
        fixed = self._gathered(grams, 0)
        out: dict[int, list] = {}
        for g, group in enumerate(self.plan.param_groups):
            out[g] = []
            for leaf in range(tangent_leaves(group)):
                if (g, leaf) not in self.layouts:
                    out[g].append(None)
                    continue
                fixed_first = self.layouts[(g, leaf)][0]
                a = fixed[(g, leaf)] / np.maximum(counts[(g, leaf)], 1).reshape(-1, 1, 1).astype(np.float64)
                a = a.astype(fixed[(g, leaf)].dtype)
                out[g].append((a, parts[(g, leaf)]) if fixed_first else (parts[(g, leaf)], a))
        return out


def param_adjoint_squares(plan: Plan, prim: Primal, lam: list[Any], batch: int, weights: jax.Array) -> list[Any]:
    """Σ_b w_b (ℳ Λ restricted to example b)², elementwise, in the parameter layout: one adjoint's
    `ParamSquares`."""
    squares = ParamSquares(plan, prim, batch)
    return squares.total(squares.parts(lam, weights))
