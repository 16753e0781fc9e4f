"""Kinds of layer (same function, same parameter and input shapes: one branch of the loop
body), their rows in the buffers per member and per step, and the write slots they share.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
from collections.abc import Hashable
from typing import Any, NamedTuple

import numpy as np

from .._graph import Layer
from ._residuals import Recipe, Source, rebuilt_vjp


class Sweep(enum.Enum):
    """The loops over the layers (each with its own write slots, `Plan.writes`)."""

    FORWARD = enum.auto()  # the forward pass, states only
    FORWARD_RESIDUALS = enum.auto()  # the forward pass storing each kind's residuals
    FORWARD_TANGENTS = enum.auto()  # the forward pass with the forward substitution fused in
    FORWARD_SUBSTITUTION = enum.auto()  # ℒ Z = b
    BACK_SUBSTITUTION = enum.auto()  # ℒ* Λ = b (with ℳΛ formed in the loop: parameter slots)


class Family(enum.Enum):
    """The kinds of buffer a loop writes into: (family, index) names one."""

    STATE = enum.auto()  # a state group's buffer (of states, or of their tangents or adjoints)
    TANGENT = enum.auto()  # the tangents of a state group, beside its states (FORWARD_TANGENTS)
    RESIDUAL = enum.auto()  # a stored-residual buffer
    PARAM = enum.auto()  # a parameter group's buffer (ℳΛ formed in the back substitution)


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
    res_sources: tuple[tuple[Source, int], ...]  # per residual leaf: where it comes from, and its index there
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
        return rebuilt_vjp(self.vjp_treedef, self.res_sources, self.kept, self.recipes, own, theta, inputs, out)


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

    buffers: tuple[tuple[Family, int], ...]  # per slot: the buffer, (family, index)
    rows: np.ndarray  # [N, S]: the row each step writes in each slot
    of_kind: tuple[tuple[int, ...], ...]  # per kind: the slot of each value it writes
    tangent: frozenset[Family] = frozenset()  # the families whose buffers have the tangent layout


def make_writes(kinds: tuple[Kind, ...], step_kind: np.ndarray, targets: list[list[tuple[Hashable, np.ndarray]]],
                pad_rows: dict[Hashable, int]) -> Writes:
    """``targets[k]``: per value kind k writes, its buffer and the row for each member."""
    need: dict[Hashable, int] = {}
    for values in targets:
        for b in dict.fromkeys(b for b, _ in values):  # first-seen order: a set's would vary by process
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
