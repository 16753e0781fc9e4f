"""The static layout of a network at given shapes: buffers, kinds of layer, index tables.

The solve runs one ``lax.fori_loop`` step per layer. To keep the compiled program independent of
depth, layers are grouped into *kinds* (same function, same parameter and input shapes): the loop
body holds one branch per kind, not per layer. Same-shaped states (and parameter blocks) are
stacked into one buffer per *group*, and static integer tables say, for every step, which kind
runs, which rows of which buffers it reads, and where its results go.

Each kind is linearised once abstractly (``jax.eval_shape`` of ``jax.vjp``) to learn the pytree
structure of its residuals. Residuals that are the layer's own arguments verbatim (weights,
input states) are not stored again: they are re-read from the parameter and state buffers.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import types
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal

from ._graph import Layer, Network, Row, Stack, call_layer
from ._stacking import explicit_sharding, mesh_of, place, take, zeros_of
from ._traced import computation_of

Aval = jax.ShapeDtypeStruct


def leaf_aval(x: Any, where: str) -> Aval:
    """The shape and dtype of one leaf, or a clear error for a non-array leaf."""
    if isinstance(x, (jax.Array, np.ndarray, np.generic, Aval)) or hasattr(x, "aval"):
        weak = x.weak_type if isinstance(x, Aval) else isinstance(x, jax.Array) and jax.typeof(x).weak_type
        return Aval(np.shape(x), x.dtype, sharding=explicit_sharding(x), weak_type=bool(weak))
    if isinstance(x, (bool, int, float, complex)):
        return Aval((), jnp.result_type(x), weak_type=True)
    raise TypeError(
        f"{where} has a leaf of type {type(x).__name__} ({x!r}); states, inputs and parameter "
        "blocks must be arrays or pytrees of arrays."
    )


def differentiable_dtype(dtype: Any) -> bool:
    """Float and complex leaves have tangents; integer, bool and PRNG-key leaves do not (JAX gives
    them float0 tangents)."""
    return not jax.dtypes.issubdtype(dtype, jax.dtypes.extended) and jnp.issubdtype(dtype, jnp.inexact)


def dtype_key(dtype: Any) -> Any:
    """A dtype as plans key on it (numpy's, or JAX's extended dtype such as a PRNG key's)."""
    return dtype if jax.dtypes.issubdtype(dtype, jax.dtypes.extended) else np.dtype(dtype)


def float0_zeros(shape: tuple[int, ...]) -> np.ndarray:
    """The tangent of a leaf without tangents, as JAX's vjp and jvp expect it."""
    return np.zeros(shape, jax.dtypes.float0)


@jax.tree_util.register_pytree_node_class
class RowList:
    """A buffer kept as a list of rows: unrolled plans index only statically, so nothing needs to
    be stacked (and XLA never copies a whole buffer to update one row)."""

    def __init__(self, rows: list[Any]):
        self.rows = list(rows)

    def tree_flatten(self) -> tuple[list[Any], None]:
        return self.rows, None

    @classmethod
    def tree_unflatten(cls, _: None, rows: list[Any]) -> RowList:
        return cls(rows)


@dataclasses.dataclass(frozen=True)
class Group:
    """Same-shaped states (or parameter blocks), stacked along a new leading axis.

    Buffers of (co)tangents — Z, Λ, h, ℳΛ — have the *tangent layout*: the same pytree with None
    at the leaves that have no tangent (integer, bool, PRNG key), so a state {"h": floats, "key":
    key} carries Λ for "h" alone. `tangent` converts a member's (co)tangent into that
    layout, `full_tangent` back into JAX's (float0 zeros at those leaves).
    """

    treedef: Any
    leaves: tuple[Aval, ...]  # of one row
    names: tuple[Hashable, ...]
    pad: bool  # one extra row that absorbs the writes of inactive kinds (state groups only)
    stacked_rows: int | None = None  # a block or input used by rows (lbp.Row): its single name *is* the buffer

    @property
    def rows(self) -> int:
        return self.stacked_rows if self.stacked_rows is not None else len(self.names) + int(self.pad)

    @property
    def pad_row(self) -> int:
        """Where inactive kinds read and write: the pad row, or row 0 where there is none (their
        reads are discarded and their writes add zeros)."""
        return self.rows - 1 if self.pad else 0

    @functools.cached_property
    def diff_leaves(self) -> tuple[bool, ...]:
        return tuple(differentiable_dtype(a.dtype) for a in self.leaves)

    @property
    def differentiable(self) -> bool:
        """Whether any leaf has a tangent (else the group's tangent buffers are None)."""
        return any(self.diff_leaves)

    def _avals(self, tangent: bool) -> list[Aval | None]:
        return [a if d or not tangent else None for a, d in zip(self.leaves, self.diff_leaves)]

    def zeros(self, as_rows: bool = False, tangent: bool = False) -> Any:
        if as_rows and self.stacked_rows is None:
            return RowList([self.row_zeros(tangent)] * self.rows)
        return self.treedef.unflatten([None if a is None else zeros_of(a, (self.rows,)) for a in self._avals(tangent)])

    def row_zeros(self, tangent: bool = False) -> Any:
        return self.treedef.unflatten([None if a is None else zeros_of(a) for a in self._avals(tangent)])

    def row_avals(self, tangent: bool = False) -> Any:
        return self.treedef.unflatten(self._avals(tangent))

    def tangent(self, value: Any) -> Any:
        """A member's (co)tangent in the tangent layout: None where a leaf has no tangent."""
        return self.treedef.unflatten([v if d else None for v, d in
                                       zip(self.treedef.flatten_up_to(value), self.diff_leaves)])

    def full_tangent(self, value: Any, lead: tuple[int, ...] = ()) -> Any:
        """A member's (co)tangent as JAX wants it: float0 zeros where a leaf has no tangent
        (``lead``: leading axes of ``value``, e.g. the rows of a stacked block)."""
        return self.treedef.unflatten([v if d else float0_zeros((*lead, *a.shape)) for v, d, a in
                                       zip(self.treedef.flatten_up_to(value), self.diff_leaves, self.leaves)])

    def typed(self, value: Any) -> Any:
        """A member (or stacked members) as the layers see it: weakly typed where the network was
        given a weakly typed leaf (a Python scalar), as in the plain call. Buffers hold strongly
        typed arrays of the same dtype and values."""
        if not any(a.weak_type for a in self.leaves):
            return value
        return self.treedef.unflatten([weakly_typed(x) if a.weak_type else x for x, a in
                                       zip(self.treedef.flatten_up_to(value), self.leaves)])

    def cast(self, value: Any, tangent: bool = False) -> Any:
        """One member (or, for a stacked block, the whole block) with the group's dtypes."""
        return self.treedef.unflatten([None if a is None else as_dtype(x, a.dtype) for x, a in
                                       zip(self.treedef.flatten_up_to(value), self._avals(tangent))])

    def stack(self, values: list[Any], as_rows: bool = False, slots: list[int] | None = None,
              tangent: bool = False) -> Any:
        """The members ``values`` at rows ``slots`` (default: all members, in order), zeros in the
        other rows (and in the pad row where the group has one); with ``as_rows`` a
        `RowList`; with ``tangent`` in the tangent layout."""
        if self.stacked_rows is not None:
            (value,) = values
            return self.cast(value, tangent)
        slots = tuple(range(len(values)) if slots is None else slots)
        if as_rows:
            rows = [self.row_zeros(tangent)] * self.rows
            for s, v in zip(slots, values):
                rows[s] = self.cast(v, tangent)
            return RowList(rows)
        leaves = [self.treedef.flatten_up_to(v) for v in values]
        return self.treedef.unflatten([
            None if a is None else place([as_dtype(row[n], a.dtype) for row in leaves], slots, self.rows)
            for n, a in enumerate(self._avals(tangent))])


def _weak_conversion() -> Callable[..., Any] | None:
    """JAX's private conversion to a weakly typed array (there is no public one), or None."""
    try:
        from jax._src.lax.lax import _convert_element_type
    except ImportError:  # pragma: no cover - another JAX layout
        return None
    return _convert_element_type


_TO_WEAK = _weak_conversion()


def weakly_typed(x: Any) -> Any:
    """``x`` as a weakly typed array; without JAX's private conversion, ``x`` as it is (a layer
    given a Python scalar then sees a strongly typed one: values equal, dtype promotion may widen)."""
    if _TO_WEAK is None:
        return x
    return _TO_WEAK(x, weak_type=True)


def as_dtype(x: Any, dtype: Any) -> Any:
    """``x`` as an array of ``dtype`` (PRNG keys are passed through: they have no casts)."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return x
    return jnp.asarray(x, dtype)  # also strong-types a weakly typed x, as the plan's avals are


class MemberRows(NamedTuple):
    """Where each member layer of a kind finds its data: row m is the m-th member (in network
    order), plus a last pad row of valid indices that no data is read from. Entries are rows of
    the buffer of the matching group (``Kind.param_groups``, ``read_groups``, ``out_group``)."""

    params: np.ndarray  # [n + 1, P]: the row of each parameter block (of a stacked block: its Row index)
    reads: np.ndarray  # [n + 1, R]: the row of each state read
    out: np.ndarray  # [n + 1]: the row the member writes its output to


class StepRows(NamedTuple):
    """The same per step of the loop (N steps, one per layer): what step i does *if* it runs this
    kind. Steps of other kinds point at pad rows, so a branch can run on any step without a
    condition on its indices."""

    member: np.ndarray  # [N]: the member that step i is (n, the pad row, for other kinds' steps)
    out: np.ndarray  # [N]: the state row step i writes (the group's pad row for other kinds)
    reads: np.ndarray  # [N, R]: the state rows step i reads (pad rows for other kinds)


@dataclasses.dataclass(frozen=True, eq=False)
class Kind:
    """Layers that share a function and the shapes of their parameters and inputs: one branch
    of the loop's switch, one batched call in the products. Where its members' data lives:
    ``by_member`` (per member layer) and ``by_step`` (per step of the loop)."""

    fn: Any
    layers: tuple[Layer, ...]
    param_groups: tuple[int, ...]
    read_groups: tuple[int, ...]
    out_group: int
    by_member: MemberRows
    by_step: StepRows
    out_aval: Any
    vjp_treedef: Any
    res_sources: tuple[tuple[str, int], ...]  # per residual leaf: ("arg" | "out" | "own", index)
    kept: tuple[int, ...]  # the own residuals that are stored ...
    recipes: dict[int, Recipe]  # ... and those recomputed from them (cheap elementwise ops)
    own_groups: tuple[int, ...]  # per stored residual: its residual buffer
    own_offsets: tuple[int, ...]  # ... and the row of the kind's first member in it
    probe: Any  # the analysis's jaxpr, replayed by the forward pass: (θ, inputs) leaves ↦ output, own residuals

    @property
    def size(self) -> int:
        return len(self.layers)

    @functools.cached_property
    def shared_rows(self) -> tuple[int | None, ...]:
        """Per parameter slot: the row when all of several members use the same one (a weight
        shared along a sequence), else None."""
        rows = self.by_member.params[:self.size]
        return tuple(int(rows[0, p]) if self.size > 1 and np.all(rows[:, p] == rows[0, p]) else None
                     for p in range(rows.shape[1]))

    def rebuild(self, own: tuple[Any, ...], theta: tuple[Any, ...], inputs: tuple[Any, ...], out: Any) -> Any:
        """The layer's VJP from its stored residuals, its (re-read) arguments and its output."""
        found = {"own": dict(zip(self.kept, own)), "arg": jax.tree.leaves((theta, inputs)),
                 "out": jax.tree.leaves(out)}
        for n, recipe in self.recipes.items():
            found["own"][n] = recipe(found)
        return self.vjp_treedef.unflatten([found[where][n] for where, n in self.res_sources])


class Forwarding(NamedTuple):
    """Reads in a stretch of the forward loop that are the previous step's output: the loop
    carries that output instead of writing it and reading it back (a round trip through a big
    buffer that dominates latency-bound steps: a narrow chain is 10–20 % faster without it)."""

    group: int  # the state group every step of the stretch writes its output to
    read: dict[int, int]  # kind -> the read slot that is always the previous step's output
    first_row: int | None  # the row the stretch's first step reads there: the carry's start


@dataclasses.dataclass(frozen=True, eq=False)
class Writes:
    """Where the steps of a loop write. Steps of all kinds share *slots*, one per (buffer, n-th
    value a step writes into it), so a step writes, per buffer, as many values as the kind that
    writes most there — not one set per kind. Inactive slots write zeros into a pad row (or add
    zeros)."""

    buffers: tuple[Hashable, ...]  # per slot: the buffer, ("state" | "res" | "param" | "tangent", index)
    rows: np.ndarray  # [N, S]: the row each step writes in each slot
    of_kind: tuple[tuple[int, ...], ...]  # per kind: the slot of each value it writes
    tangent: frozenset[str] = frozenset()  # the families whose buffers have the tangent layout


def make_writes(kinds: tuple[Kind, ...], step_kind: np.ndarray, targets: list[list[tuple[Hashable, np.ndarray]]],
                pad_rows: dict[Hashable, int]) -> Writes:
    """``targets[k]``: per value kind k writes, its buffer and the row for each member."""
    need: dict[Hashable, int] = {}
    for values in targets:
        for b in {b for b, _ in values}:
            need[b] = max(need.get(b, 0), sum(1 for bb, _ in values if bb == b))
    slots = [(b, j) for b in need for j in range(need[b])]
    index = {slot: n for n, slot in enumerate(slots)}
    of_kind = []
    for values in targets:
        seen: dict[Hashable, int] = {}
        mine = []
        for b, _ in values:
            mine.append(index[(b, seen.get(b, 0))])
            seen[b] = seen.get(b, 0) + 1
        of_kind.append(tuple(mine))
    rows = np.array([[pad_rows[b] for b, _ in slots]] * len(step_kind), dtype=np.int32)
    rows = rows.reshape(len(step_kind), len(slots))
    for i, k in enumerate(step_kind):
        member = kinds[k].by_step.member[i]
        for (_, member_rows), s in zip(targets[k], of_kind[k]):
            rows[i, s] = member_rows[member]
    return Writes(tuple(b for b, _ in slots), rows, tuple(of_kind))


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """Everything static about one network at one set of shapes (made once, cached): the state
    and parameter buffers (``*_groups``: one stacked buffer per structure of same-shaped values;
    ``*_loc``: name -> (group, row), row None for a stacked block, which is the whole buffer),
    the kinds of layer with their rows (``Kind.by_member``, ``Kind.by_step``), the kind of each
    step (``step_kind``, one step per layer in network order) and the stored residuals' buffers.
    The engine reads only these tables; every index in them is known at trace time."""

    net: Network
    state_groups: tuple[Group, ...]
    param_groups: tuple[Group, ...]
    state_loc: dict[Hashable, tuple[int, int]]
    param_loc: dict[Hashable, tuple[int, int]]
    kinds: tuple[Kind, ...]
    step_kind: np.ndarray  # [N]
    res_avals: tuple[Aval, ...]  # the stored residuals, one buffer per shape and dtype ...
    res_rows: tuple[int, ...]  # ... with this many rows (and a pad row)
    res_as_rows: tuple[bool, ...]  # per residual buffer: kept as a list of rows (see _ResidualBuffers)
    unrolled: bool = False  # the substitutions as straight-line code (shallow networks, see loop_pays)
    full: Plan | None = None  # for a compact plan (see ``compact``): the plan it was made from
    to_compact: tuple[np.ndarray, ...] | None = None  # ... and per state group, its row of each full row
    # per kind: (its first layer, θ avals, input avals, what it computed there: computation_of)
    computations: tuple[tuple[Layer, tuple, tuple, Hashable], ...] = ()

    @functools.cached_property
    def compact(self) -> Plan:
        """The layout for a sweep that keeps only what is read again: a forward pass without
        residuals (``jvp_by_solve``'s, with its tangents). States that later steps read only from
        the loop's carry (the previous step's output, see ``forwarding``) and that are no input or
        output of the network get no row: their writes go to the pad row. A chain keeps its
        input and output rows only, instead of every state (and every tangent)."""
        if self.unrolled or self.full is not None:
            return self
        needed = [set() for _ in self.state_groups]
        for name in (*self.net.inputs, *self.net.outputs):
            g, row = self.state_loc[name]
            needed[g].add(row)  # None for a stacked input: its group is kept whole
        for start, stop, _ in self.segments:
            fwd = self.forwarding(start, stop)
            for j in range(start, stop):
                k = int(self.step_kind[j])
                kind = self.kinds[k]
                for r, g in enumerate(kind.read_groups):
                    if not (fwd is not None and j > start and fwd.read.get(k) == r):
                        needed[g].add(int(kind.by_step.reads[j, r]))
        groups, remap = [], []
        for g, group in enumerate(self.state_groups):
            if group.stacked_rows is not None:
                groups.append(group)
                remap.append(np.arange(group.rows, dtype=np.int32))
                continue
            keep = [row for row in range(len(group.names)) if row in needed[g]]
            new = np.full(group.rows, len(keep), dtype=np.int32)  # default: the new pad row
            new[keep] = np.arange(len(keep))
            groups.append(dataclasses.replace(group, names=tuple(group.names[row] for row in keep)))
            remap.append(new)
        loc = {name: (g, None if row is None else int(remap[g][row])) for name, (g, row) in self.state_loc.items()}

        def columns(table: np.ndarray, gs: tuple[int, ...]) -> np.ndarray:
            out = table.copy()
            for r, g in enumerate(gs):
                out[:, r] = remap[g][table[:, r]]
            return out

        kinds = tuple(dataclasses.replace(
            kind,
            by_member=kind.by_member._replace(reads=columns(kind.by_member.reads, kind.read_groups),
                                              out=remap[kind.out_group][kind.by_member.out]),
            by_step=kind.by_step._replace(reads=columns(kind.by_step.reads, kind.read_groups),
                                          out=remap[kind.out_group][kind.by_step.out]),
        ) for kind in self.kinds)
        return dataclasses.replace(self, state_groups=tuple(groups), state_loc=loc, kinds=kinds, full=self,
                                   to_compact=tuple(remap))

    @functools.cached_property
    def to_full(self) -> tuple[np.ndarray, ...]:
        """For a compact plan, per state group, the full plan's row of each of its rows (the pad
        row's: the pad row)."""
        out = []
        for g, (remap, group) in enumerate(zip(self.to_compact, self.state_groups)):
            rows = np.full(group.rows, self.full.state_groups[g].pad_row, dtype=np.int32)
            for full_row, row in enumerate(remap):
                if row != group.pad_row or not group.pad:
                    rows[row] = full_row
            out.append(rows)
        return tuple(out)

    @functools.cached_property
    def segments(self) -> list[tuple[int, int, int]]:
        """The loop's segments (start, stop, period): period 0 switches over kinds step by step;
        a period p > 0 runs p steps of known kinds per iteration (no switch)."""
        return periodic_segments(self.step_kind, len(self.kinds))

    def writes(self, loop: str, with_params: bool = False, absent: frozenset[int] = frozenset()) -> Writes:
        """The write slots of ``loop``: "forward", "forward+res", "forward+tangent", "forward_sub"
        or "back"; ``absent``: state groups without a (co)tangent buffer in this solve."""
        key = (loop, with_params, absent)
        cache = self.__dict__.setdefault("_writes", {})
        if key not in cache:
            targets = [self._targets(k, loop, with_params, absent) for k in self.kinds]
            writes = make_writes(self.kinds, self.step_kind, targets, self._pad_rows())
            tangent = {"forward_sub": {"state"}, "back": {"state", "param"}, "forward+tangent": {"tangent"}}
            cache[key] = dataclasses.replace(writes, tangent=frozenset(tangent.get(loop, ())))
        return cache[key]

    @functools.cached_property
    def params_shared_by_members(self) -> bool:
        """Whether every kind with several members uses, in each parameter slot, one and the same
        row for all of them (weights shared along a sequence), and some kind has parameters."""
        many = [kind for kind in self.kinds if kind.size > 1 and kind.param_groups]
        return bool(many) and all(row is not None for kind in many for row in kind.shared_rows)

    @functools.cached_property
    def input_only_groups(self) -> frozenset[int]:
        """State groups that hold network inputs only: no layer writes them, so they need a
        (co)tangent buffer only where an input of theirs has a tangent."""
        inputs = set(self.net.inputs)
        return frozenset(g for g, group in enumerate(self.state_groups) if set(group.names) <= inputs)

    @functools.cached_property
    def params_written_once(self) -> frozenset[int]:
        """Parameter groups no row of which two layers (or two slots of one layer) use: in the
        back substitution each of their rows of ℳΛ is set once, not accumulated (a read saved)."""
        once = set()
        for g in range(len(self.param_groups)):
            rows = [kind.by_member.params[:kind.size, p] for kind in self.kinds
                    for p, pg in enumerate(kind.param_groups) if pg == g]
            rows = np.concatenate(rows) if rows else np.zeros(0, np.int32)
            if len(np.unique(rows)) == len(rows):
                once.add(g)
        return frozenset(once)

    def forwarding(self, start: int, stop: int) -> Forwarding | None:
        """Which reads of steps ``start:stop`` are always the previous step's output (None: none,
        or the steps write their outputs to different groups)."""
        if self.full is not None:  # the compact layout aliases rows: decide on the full one
            fwd = self.full.forwarding(start, stop)
            if fwd is None or fwd.first_row is None:
                return fwd
            name = self.full.state_groups[fwd.group].names[fwd.first_row]
            return fwd._replace(first_row=self.state_loc[name][1])
        cache = self.__dict__.setdefault("_forwarding_cache", {})
        if (start, stop) not in cache:
            cache[(start, stop)] = self._forwarding(start, stop)
        return cache[(start, stop)]

    def carried_only(self, start: int, stop: int) -> bool:
        """For a compact plan: whether the steps of ``start:stop`` but the last keep no row — their
        outputs live in the loop's carry alone (a chain), so the loop need neither write them nor
        read their (co)tangents back."""
        fwd = self.forwarding(start, stop)
        if self.full is None or fwd is None:
            return False
        pad = self.state_groups[fwd.group].pad_row
        return all(self.kinds[int(self.step_kind[t])].by_step.out[t] == pad for t in range(start, stop - 1))

    def _forwarding(self, start: int, stop: int) -> Forwarding | None:
        step_kind = self.step_kind[start:stop]
        present = sorted({int(k) for k in step_kind})
        groups = {self.kinds[k].out_group for k in present}
        if len(groups) != 1:
            return None
        (group,) = groups
        out_rows = np.array([self.kinds[k].by_step.out[start + n] for n, k in enumerate(step_kind)])
        read: dict[int, int] = {}
        for k in present:
            kind = self.kinds[k]
            later = np.flatnonzero(step_kind == k)
            later = later[later > 0]  # the stretch's first step reads its start value
            for r, g in enumerate(kind.read_groups):
                if g == group and np.array_equal(kind.by_step.reads[start + later, r], out_rows[later - 1]):
                    read[k] = r
                    break
        if not read:
            return None
        first = int(step_kind[0])
        first_row = int(self.kinds[first].by_step.reads[start, read[first]]) if first in read else None
        return Forwarding(group, read, first_row)

    def _pad_rows(self) -> dict[Hashable, int]:
        return {**{(family, g): grp.pad_row for g, grp in enumerate(self.state_groups)
                   for family in ("state", "tangent")},
                **{("res", r): n for r, n in enumerate(self.res_rows)},
                **{("param", p): 0 for p in range(len(self.param_groups))}}  # adds zeros to row 0

    def _targets(self, kind: Kind, loop: str, with_params: bool,
                 absent: frozenset[int]) -> list[tuple[Hashable, np.ndarray]]:
        n = kind.size
        out_diff = self.state_groups[kind.out_group].differentiable
        if loop in ("forward", "forward+res", "forward+tangent"):
            values = [(("state", kind.out_group), kind.by_member.out[:n])]
            if loop == "forward+res":
                values += [(("res", r), off + np.arange(n)) for r, off in zip(kind.own_groups, kind.own_offsets)]
            if loop == "forward+tangent" and out_diff:
                values += [(("tangent", kind.out_group), kind.by_member.out[:n])]
            return values
        if not out_diff:  # integer states carry no tangent or cotangent
            return []
        if loop == "forward_sub":
            return [(("state", kind.out_group), kind.by_member.out[:n])]
        values = [(("state", g), kind.by_member.reads[:n, r]) for r, g in enumerate(kind.read_groups)
                  if self.state_groups[g].differentiable and g not in absent]
        if with_params:
            values += [(("param", g), kind.by_member.params[:n, p]) for p, g in enumerate(kind.param_groups)]
        return values

    @property
    def depth(self) -> int:
        return len(self.step_kind)

    # -- packing --------------------------------------------------------------------------------
    def pack_params(self, theta: dict[Hashable, Any], tangent: bool = False) -> list[Any]:
        """Parameter-layout buffers (``tangent``: of tangents, in the tangent layout)."""
        return [g.stack([theta[name] for name in g.names], self.unrolled, tangent=tangent) for g in self.param_groups]

    def pack_states(self, values: dict[Hashable, Any], tangent: bool = False) -> list[Any]:
        """State-layout buffers holding ``values`` (by name) and zeros elsewhere. With ``tangent``:
        (co)tangent buffers in the tangent layout, None for groups without tangents."""
        out = []
        for g in self.state_groups:
            if tangent and not g.differentiable:
                out.append(None)
            elif not any(name in values for name in g.names):
                out.append(g.zeros(self.unrolled, tangent))
            else:
                slots = [n for n, name in enumerate(g.names) if name in values]
                out.append(g.stack([values[g.names[n]] for n in slots], self.unrolled, slots, tangent))
        return out

    def unpack(self, bufs: list[Any], names: tuple[Hashable, ...], loc: dict,
               groups: tuple[Group, ...] | None = None) -> dict[Hashable, Any]:
        """The rows ``names`` of the buffers. With ``groups`` (the buffers hold tangents), as JAX
        wants them: float0 zeros where a leaf has no tangent."""
        by_group: dict[int, list[Hashable]] = {}
        out = {}
        for name in names:
            g, slot = loc[name]
            if groups is not None and (bufs[g] is None or slot is None):  # no tangent, or a stacked block
                lead = (groups[g].rows,) if slot is None else ()
                buf = groups[g].row_avals(tangent=True) if bufs[g] is None else bufs[g]
                out[name] = groups[g].full_tangent(buf, lead)
            elif slot is None:  # a stacked block: the buffer itself
                out[name] = bufs[g]
            else:
                by_group.setdefault(g, []).append(name)
        for g, members in by_group.items():
            slots = [loc[n][1] for n in members]
            if isinstance(bufs[g], RowList):
                rows = [bufs[g].rows[s] for s in slots]
            else:
                rows = take(bufs[g], slots)
            if groups is not None:
                rows = [groups[g].full_tangent(r) for r in rows]
            out.update(zip(members, rows))
        return {name: out[name] for name in names}


class Same:
    """``obj`` in a key, compared by identity: ``==`` may call two different computations equal
    (0.0 == -0.0, dataclass fields with ``compare=False``, a user-defined ``__eq__``)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj  # held, so that its id cannot be reused while the key lives

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Same) and self.obj is other.obj

    def __hash__(self) -> int:
        return id(self.obj)


def function_key(fn: Any) -> Any:
    """Equal only for callables that provably run the same computation.

    Lambdas written inside a loop are distinct objects with the same code; keying on what they
    are made of — the same code object, globals, and defaults and closure cells holding the same
    *objects* — lets them share one kind (one branch of the loop) instead of one per layer.
    ``functools.partial`` and bound methods are keyed likewise by their parts; any other callable
    by its identity. Every part is compared by identity, never with ``==``: a wrong merge would
    run one layer's function for another's (a silent wrong gradient), a missed one only costs
    compile time.
    """
    if isinstance(fn, types.FunctionType):
        cells = []
        for cell in fn.__closure__ or ():
            try:
                cells.append(Same(cell.cell_contents))
            except ValueError:  # an empty cell: only that very cell is the same
                cells.append(Same(cell))
        kw = tuple((k, Same(v)) for k, v in sorted((fn.__kwdefaults__ or {}).items()))
        return ("function", Same(fn.__code__), Same(fn.__globals__),
                tuple(map(Same, fn.__defaults__ or ())), kw, tuple(cells))
    if isinstance(fn, functools.partial):
        kw = tuple((k, Same(v)) for k, v in sorted(fn.keywords.items()))
        return ("partial", function_key(fn.func), tuple(map(Same, fn.args)), kw)
    if isinstance(fn, types.MethodType):
        return ("method", function_key(fn.__func__), Same(fn.__self__))
    return Same(fn)


def _avals_of(tree: Any, where: str) -> tuple[Any, tuple[Aval, ...]]:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple(leaf_aval(x, where) for x in leaves)


# Residuals computed from others by a few of these are recomputed in the back substitution
# instead of stored (tanh's 1 − t next to t, sigmoid's s(1 − s) next to s): less memory, fewer writes.
CHEAP_PRIMITIVES = frozenset({"add", "sub", "mul", "neg", "integer_pow", "square", "convert_element_type"})
MAX_RECIPE_DEPTH = 3


class Recipe:
    """An own residual as a few elementwise equations of the layer's linearisation, whose inputs
    are stored residuals, the output or the arguments (``sources``: var -> (where, index))."""

    def __init__(self, eqns: list, sources: dict):
        self.eqns, self.sources = eqns, sources

    def __call__(self, found: dict[str, Any]) -> Any:
        env = {var: found[where][n] for var, (where, n) in self.sources.items()}
        for eqn in self.eqns:
            args = [v.val if isinstance(v, Literal) else env[v] for v in eqn.invars]
            outs = eqn.primitive.bind(*args, **eqn.params)
            env.update(zip(eqn.outvars, outs if eqn.primitive.multiple_results else [outs]))
        return env[self.eqns[-1].outvars[0]]


def _recipe(var: Any, available: dict, producers: dict, depth: int) -> tuple[list, dict] | None:
    if var in available:
        return [], {var: available[var]}
    eqn = producers.get(var)
    if eqn is None or eqn.primitive.name not in CHEAP_PRIMITIVES or depth == 0:
        return None
    eqns: list = []
    used: dict = {}
    for v in eqn.invars:
        if isinstance(v, Literal):
            continue
        sub = _recipe(v, available, producers, depth - 1)
        if sub is None:
            return None
        eqns += [e for e in sub[0] if all(e is not f for f in eqns)]
        used.update(sub[1])
    return [*eqns, eqn], used


def _recipes(jaxpr: Any, n_out: int) -> tuple[tuple[int, ...], dict[int, Recipe]]:
    """Which own residuals (the jaxpr's outputs after the n_out output leaves) to store, and
    recipes for the others."""
    own_vars = jaxpr.outvars[n_out:]
    available = {v: ("arg", n) for n, v in enumerate(jaxpr.invars)}
    available.update({v: ("out", n) for n, v in enumerate(jaxpr.outvars[:n_out]) if not isinstance(v, Literal)})
    producers = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
    kept, pinned, recipes = set(range(len(own_vars))), set(), {}
    for j, var in enumerate(own_vars):
        if j in pinned or isinstance(var, Literal):
            continue
        others = {w: ("own", k) for k, w in enumerate(own_vars) if k in kept and k != j and not isinstance(w, Literal)}
        found = _recipe(var, {**available, **others}, producers, MAX_RECIPE_DEPTH)
        if found is not None and found[0]:
            kept.discard(j)
            recipes[j] = Recipe(*found)
            pinned |= {n for where, n in found[1].values() if where == "own"}
    return tuple(sorted(kept)), recipes


def _analyse_kind(layer: Layer, theta_avals: tuple[Any, ...], input_avals: tuple[Any, ...]):
    """Abstractly linearise one layer: its output shape and the structure of its residuals."""
    found: dict[str, Any] = {}

    def probe(theta, *inputs):
        out, vjp = jax.vjp(lambda t, *u: call_layer(layer, t, u), theta, *inputs)
        leaves, treedef = jax.tree.flatten(vjp)
        known = {"arg": jax.tree.leaves((theta, inputs)), "out": jax.tree.leaves(out), "own": []}
        sources = []
        for leaf in leaves:  # residuals that are arguments or the output are re-read, not stored
            where = next((w for w in ("arg", "out", "own") if any(leaf is a for a in known[w])), None)
            if where is None:
                where = "own"
                known["own"].append(leaf)
            sources.append((where, next(n for n, a in enumerate(known[where]) if leaf is a)))
        found.update(treedef=treedef, sources=tuple(sources))
        return out, tuple(known["own"])

    closed, (out_aval, own) = jax.make_jaxpr(probe, return_shape=True)(theta_avals, *input_avals)
    _avals_of(out_aval, f"The output of layer {layer.name!r}")
    try:
        kept, recipes = _recipes(closed.jaxpr, len(jax.tree.leaves(out_aval)))
    except (AttributeError, TypeError, KeyError, ValueError):  # jaxpr internals changed: store them all
        kept, recipes = tuple(range(len(own))), {}
    return out_aval, found["treedef"], found["sources"], tuple(own[n] for n in kept), kept, recipes, closed


# The loop pays when kinds of layer repeat: one compiled body then serves many steps. A shallow
# network, or one whose layers are nearly all different, runs faster as straight-line code (no
# switch, static indices), and its program is small anyway. Measured with `python
# benchmarks/profile.py engine-rule` (compile and run time, loop against unrolled; the numbers
# are in docs/performance.md): from 6 layers and 2 per kind on average the loop compiles in
# less time and runs as fast or faster.
LOOP_MIN_DEPTH = 6
LOOP_MIN_LAYERS_PER_KIND = 2


def loop_pays(depth: int, kinds: int) -> bool:
    return depth >= LOOP_MIN_DEPTH and depth >= LOOP_MIN_LAYERS_PER_KIND * kinds


MAX_PERIOD = 8  # the longest pattern of kinds a loop iteration runs without a switch


def periodic_segments(step_kind: np.ndarray, kinds: int) -> list[tuple[int, int, int]]:
    """Split the steps into (start, stop, period): the longest stretch whose kinds repeat with a
    period of at most MAX_PERIOD (period 0 elsewhere; one kind needs no pattern).

    For a period p, ``same[m]`` says that step m + p has the kind of step m. A run of r
    consecutive True from ``run_start`` means steps run_start .. run_start + r + p − 1 follow the
    pattern of their first p steps: r + p steps, cut to whole periods (and to the end), which is
    what ``covered`` counts. A stretch is worth a segment of its own from two whole periods on.
    Shorter periods are tried first and win ties: a run of one kind between others (a
    transformer's blocks between its embedding and head) is period 1, its layer compiled once in
    the loop body, not twice as period 2 would (measured: `benchmarks/profile.py engine-rule`).
    """
    n = len(step_kind)
    best = (0, 0, 0)  # covered, start, period
    if kinds > 1:
        for period in range(1, MAX_PERIOD + 1):
            same = np.append(step_kind[period:] == step_kind[:-period], [False] * period)
            run_start = 0
            for m in range(n + 1):
                if m == n or not same[m]:
                    covered = ((m + period - run_start) // period) * period  # a run of matches + one period
                    covered = min(covered, n - run_start) // period * period
                    if covered >= 2 * period and covered > best[0]:
                        best = (covered, run_start, period)
                    run_start = m + 1
    covered, start, period = best
    if not period:
        return [(0, n, 0)]
    parts = [(0, start, 0), (start, start + covered, period), (start + covered, n, 0)]
    return [p for p in parts if p[1] > p[0]]


@functools.lru_cache(maxsize=32)
def make_plan(net: Network, param_structs: tuple, input_structs: tuple, engine: str = "auto",
              generation: int = 0) -> Plan:
    """The layout for ``net`` at the given shapes (``param_structs`` follows ``net.param_names``);
    ``generation`` (`plans_generation`) keys the cache only."""
    _plans_made.count += 1
    params = {p: _unstruct(s) for p, s in zip(net.param_names, param_structs)}
    plain = [(p, a) for p, a in params.items() if p not in net.stacked_blocks]
    param_groups, param_loc = _group(plain, pad=False)
    for p in net.param_names:
        if p in net.stacked_blocks:  # its own group; the layers' Row entries are its slots
            treedef, leaves = param_structs[net.param_names.index(p)]
            param_loc[p] = (len(param_groups), None)
            rows = tuple(_row_of(Aval(sh, d, sharding=x, weak_type=w)) for sh, d, x, w in leaves)
            param_groups += (Group(treedef, rows, (p,), False, leaves[0][0][0]),)

    def slot(p: Hashable) -> tuple[int, int]:
        return (param_loc[p.block][0], p.index) if isinstance(p, Row) else param_loc[p]

    def read_slot(r: Hashable) -> tuple[int, int]:
        return (state_loc[r.block][0], r.index) if isinstance(r, Row) else state_loc[r]

    avals: dict[Hashable, Any] = {name: _unstruct(s) for name, s in zip(net.inputs, input_structs)}
    kind_info: dict[Any, tuple] = {}
    computations: list[tuple[Layer, tuple, tuple, Hashable]] = []
    layer_kind: list[Any] = []
    for layer in net.layers:
        theta = tuple(_row_aval(params, p) for p in layer.params)
        ins = tuple(_row_aval(avals, r) for r in layer.reads)
        key = (function_key(layer.fn), _structure(theta), _structure(ins), tuple(slot(p)[0] for p in layer.params),
               tuple(isinstance(r, Row) and r.block for r in layer.reads))
        if key not in kind_info:
            kind_info[key] = _analyse_kind(layer, theta, ins)
            computations.append((layer, theta, ins, computation_of(layer, theta, ins)))
        avals[layer.name] = kind_info[key][0]
        layer_kind.append(key)

    state_groups, state_loc = _group([(n, a) for n, a in avals.items() if n not in net.stacked_inputs], pad=True)
    for name in net.inputs:
        if name in net.stacked_inputs:  # its own group, like a stacked block: rows are the Row indices
            treedef, leaves = input_structs[net.inputs.index(name)]
            state_loc[name] = (len(state_groups), None)
            rows = tuple(_row_of(Aval(sh, d, sharding=x, weak_type=w)) for sh, d, x, w in leaves)
            state_groups += (Group(treedef, rows, (name,), False, leaves[0][0][0]),)
    _check_stacks(net, state_groups, state_loc)

    keys = list(dict.fromkeys(layer_kind))
    step_kind = np.array([keys.index(k) for k in layer_kind], dtype=np.int32)
    residuals = _ResidualBuffers()
    straight_only = _straight_line_kinds(step_kind, len(keys))
    kinds = []
    for k, key in enumerate(keys):
        members = np.flatnonzero(step_kind == k)
        layers = tuple(net.layers[n] for n in members)
        first = layers[0]
        out_aval, treedef, sources, own, kept, recipes, probe = kind_info[key]
        pgroups = tuple(slot(p)[0] for p in first.params)
        rgroups = tuple(read_slot(r)[0] for r in first.reads)
        ogroup = state_loc[first.name][0]
        by_member = MemberRows(
            params=_table([[slot(p)[1] for p in layer.params] for layer in layers], len(pgroups)),
            reads=_table([[read_slot(r)[1] for r in layer.reads] for layer in layers], len(rgroups)),
            out=_table([[state_loc[layer.name][1]] for layer in layers], 1)[:, 0])
        kinds.append(Kind(
            fn=_fresh(first.fn), layers=layers, param_groups=pgroups, read_groups=rgroups, out_group=ogroup,
            by_member=by_member, by_step=_by_step(by_member, members, len(net.layers), state_groups, rgroups, ogroup),
            out_aval=out_aval, vjp_treedef=treedef, res_sources=sources, kept=kept,
            recipes=recipes, probe=probe, **residuals.assign(own, len(layers), as_rows=k in straight_only)))
    unrolled = engine == "unrolled" or (engine == "auto" and not loop_pays(len(net.layers), len(kinds)))
    return Plan(net=net, state_groups=state_groups, param_groups=param_groups, state_loc=state_loc,
                param_loc=param_loc, kinds=tuple(kinds), step_kind=step_kind, res_avals=tuple(residuals.avals),
                res_rows=tuple(residuals.rows), res_as_rows=tuple(residuals.as_rows), unrolled=unrolled,
                computations=tuple(computations))


def _straight_line_kinds(step_kind: np.ndarray, kinds: int) -> frozenset[int]:
    """Kinds whose layers all run as straight-line steps (see ``_engine._segment``: a stretch
    shorter than the number of kinds), where no loop switches over kinds: no loop ever writes
    their residuals, so they can be kept as a list of rows."""
    segments = periodic_segments(step_kind, kinds)
    if any(period == 0 and stop - start >= kinds for start, stop, period in segments):
        return frozenset()  # a loop with a switch writes (zeros) into every kind's slots
    straight = np.zeros(len(step_kind), bool)
    for start, stop, period in segments:
        straight[start:stop] = period == 0
    return frozenset(k for k in range(kinds) if straight[step_kind == k].all())


def _table(rows: list[list[int]], width: int) -> np.ndarray:
    """``rows`` as an int32 table of ``width`` columns, with a pad row of zeros appended."""
    return np.array([*rows, [0] * width], dtype=np.int32).reshape(len(rows) + 1, width)


def _by_step(by_member: MemberRows, members: np.ndarray, n_steps: int, state_groups: tuple[Group, ...],
             read_groups: tuple[int, ...], out_group: int) -> StepRows:
    """A kind's rows per step of the loop: its members' at their steps, pad rows elsewhere."""
    pads = np.array([state_groups[g].pad_row for g in read_groups], dtype=np.int32)
    member = np.full(n_steps, len(members), dtype=np.int32)
    member[members] = np.arange(len(members))
    out = np.full(n_steps, state_groups[out_group].pad_row, dtype=np.int32)
    out[members] = by_member.out[:-1]
    reads = np.tile(pads, (n_steps, 1)).reshape(n_steps, len(read_groups))
    reads[members] = by_member.reads[:-1]
    return StepRows(member=member, out=out, reads=reads)


class _ResidualBuffers:
    """The stored residuals of all kinds share one buffer per shape and dtype; each kind's
    members take consecutive rows of it. Kinds that only run straight-line (``as_rows``: a
    transformer's embedding and head) get buffers of their own kept as lists of rows: plain
    values, where rows of a shared buffer are zeroed and written outside the loops (≈ 10 kernels
    of a 12-block GPT)."""

    def __init__(self) -> None:
        self.avals: list[Aval] = []
        self.rows: list[int] = []
        self.as_rows: list[bool] = []

    def assign(self, own: tuple[Aval, ...], members: int, as_rows: bool = False) -> dict[str, tuple[int, ...]]:
        """Rows for ``members`` layers storing residuals ``own``: per residual, its buffer and the
        row of the first member (the Kind fields ``own_groups`` and ``own_offsets``)."""
        groups, offsets = [], []
        for a in own:
            a = Aval(a.shape, a.dtype, sharding=explicit_sharding(a))
            r = None if as_rows else next((r for r, (b, own) in enumerate(zip(self.avals, self.as_rows))
                                           if b == a and not own), None)
            if r is None:  # a new buffer
                r = len(self.avals)
                self.avals.append(a)
                self.rows.append(0)
                self.as_rows.append(as_rows)
            groups.append(r)
            offsets.append(self.rows[r])
            self.rows[r] += members
        return {"own_groups": tuple(groups), "own_offsets": tuple(offsets)}


def _fresh(fn: Any) -> Any:
    """``fn`` as a new function object. JAX's trace caches (``jax.vjp``, ``jax.jvp``) compare
    functions with ``==``: two layer functions that compare equal but compute different things
    (dataclass fields with ``compare=False``) would share one trace."""

    def kind_fn(theta: tuple, *inputs: Any) -> Any:
        return fn(theta, *inputs)

    return kind_fn


def _row_aval(avals: dict[Hashable, Any], p: Hashable) -> Any:
    """The aval a layer receives for a block or state name (one row of it for a ``Row``)."""
    if isinstance(p, Row):
        return jax.tree.map(_row_of, avals[p.block])
    return avals[p]


def _check_stacks(net: Network, groups: tuple[Group, ...], loc: dict[Hashable, tuple[int, Any]]) -> None:
    """Every [`Stack`][linbackprop.Stack] output holds states of one structure, shape and dtype (one group)."""
    for item in net.output_spec:
        if isinstance(item, Stack):
            first = item.names[0]
            for name in item.names:
                # Groups may differ in weak types alone (a Python scalar input beside a state):
                # jnp.stack of such states is strongly typed, and so is the Stack.
                if loc[name][1] is None or loc[first][1] is None or (
                        loc[name][0] != loc[first][0]
                        and _strong(groups[loc[name][0]].row_avals()) != _strong(groups[loc[first][0]].row_avals())):
                    shown = lambda n: groups[loc[n][0]].row_avals() if loc[n][1] is not None else "a stacked input"
                    raise ValueError(
                        f"{item!r}: state {name!r} ({shown(name)}) and state {first!r} ({shown(first)}) differ in "
                        "structure, shape or dtype; a Stack needs states of one shape.")


def _strong(tree: Any) -> Any:
    """Structure, shapes and dtypes of a pytree of avals, weak types left out."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((tuple(a.shape), dtype_key(a.dtype)) for a in leaves)


def _structure(tree: Any) -> Any:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((tuple(a.shape), dtype_key(a.dtype), explicit_sharding(a), bool(a.weak_type)) for a in leaves)


def _row_of(a: Aval) -> Aval:
    """The aval of one row of a stacked leaf."""
    sharding = explicit_sharding(a)
    if sharding is not None:
        sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*sharding.spec[1:]))
    return Aval(a.shape[1:], a.dtype, sharding=explicit_sharding(Aval(a.shape[1:], a.dtype, sharding=sharding)),
                weak_type=a.weak_type)


def _group(items: list[tuple[Hashable, Any]], pad: bool) -> tuple[tuple[Group, ...], dict]:
    by_key: dict[Any, list[Hashable]] = {}
    avals: dict[Any, Any] = {}
    for name, aval in items:
        key = _structure(aval)
        by_key.setdefault(key, []).append(name)
        avals[key] = aval
    groups, loc = [], {}
    for g, (key, names) in enumerate(by_key.items()):
        treedef, leaves = key
        groups.append(Group(treedef=treedef, leaves=tuple(Aval(s, d, sharding=x, weak_type=w) for s, d, x, w in leaves),
                            names=tuple(names), pad=pad))
        for slot, name in enumerate(names):
            loc[name] = (g, slot)
    return tuple(groups), loc


def plan_for(net: Network, theta: dict[Hashable, Any], inputs: tuple[Any, ...], engine: str = "auto") -> Plan:
    """Validate the arguments' leaves and return the (cached) plan for their shapes.

    ``engine``: "loop" (``lax.fori_loop`` substitutions), "unrolled", or "auto" (`loop_pays`).
    """
    param_structs = tuple(_struct_of(theta[p], f"Parameter block {p!r}") for p in net.param_names)
    input_structs = tuple(_struct_of(x, f"Network input {name!r}") for name, x in zip(net.inputs, inputs))
    with mesh_of((theta, inputs)):  # the layers' analysis types its arrays on the arguments' mesh
        return make_plan(net, param_structs, input_structs, engine, _generation[0])


# Bumped whenever a plan is found stale: every plan and compiled solve is then made anew (what
# changed — a global a layer reads — may be read by any network's layers, and by the segments
# of checkpointed calls, which are networks of their own).
_generation = [0]
_generation_lock = threading.Lock()


class _Counter(threading.local):
    count = 0


_plans_made = _Counter()  # plans made by this thread (make_plan runs in the thread that asks)


def plans_generation() -> int:
    """The generation of the plans: caches of what is compiled from plans key on it too."""
    return _generation[0]


def current_plan(net: Network, theta: dict[Hashable, Any], inputs: tuple[Any, ...], engine: str = "auto") -> Plan:
    """`plan_for`, made anew — with every cached plan and compiled solve — where a layer
    computes something other than when its plan was made (a Python global it reads changed:
    ``computation_of`` differs). Called where a network call enters the solve from user code
    (once per trace: each kind's layer traced once more), so that outside the user's ``jit`` a
    result is always what ``jax.grad`` gives; under it, JAX's own caching holds."""
    made = _plans_made.count
    plan = plan_for(net, theta, inputs, engine)
    if _plans_made.count != made:  # made just now, from what the layers compute now
        return plan
    with mesh_of((theta, inputs)):
        stale = any(computation_of(layer, th, ins) != was for layer, th, ins, was in plan.computations)
    if stale:
        with _generation_lock:
            _generation[0] += 1
        plan = plan_for(net, theta, inputs, engine)
    return plan


def _struct_of(tree: Any, where: str) -> Any:
    treedef, avals = _avals_of(tree, where)
    return treedef, tuple((tuple(a.shape), dtype_key(a.dtype), explicit_sharding(a), bool(a.weak_type)) for a in avals)


def _unstruct(struct: Any) -> Any:
    treedef, leaves = struct
    return treedef.unflatten([Aval(s, d, sharding=x, weak_type=w) for s, d, x, w in leaves])
