"""The plan of a network at given shapes: its buffers, kinds, index tables and segments, and
the packing of parameters and states into its buffers (`Plan`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Hashable
from typing import Any

import numpy as np

from .._graph import Layer, Network, take
from .._options import POLICY
from ._groups import Aval, Group, RowList
from ._kinds import Family, Forwarding, Kind, Sweep, Writes, make_writes
from ._schedule import periodic_segments


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
    unrolled: bool = False  # the substitutions as straight-line code (shallow networks, see Policy.loop_pays)
    max_period: int = POLICY.max_period  # the longest pattern of kinds run without a switch (Policy.max_period)
    full: Plan | None = None  # for a compact plan (see ``compact``): the plan it was made from
    to_compact: tuple[np.ndarray, ...] | None = None  # ... and per state group, its row of each full row
    # per kind: (its first layer, θ avals, input avals, what it computed there: computation_of)
    computations: tuple[tuple[Layer, tuple, tuple, Hashable], ...] = ()
    serial: int = 0  # when it was made, in plans made by this process (`_make.current_plan`)

    @functools.cached_property
    def compact(self) -> Plan:
        """The layout for a sweep that keeps only what is read again: a forward pass without
        residuals (``jvp_by_solve``'s, with its tangents). States that later steps read only from
        the loop's carry (the previous step's output, see ``forwarding``) and that are no input or
        output of the network get no row: their writes go to the pad row. A chain keeps its
        input and output rows only, instead of every state (and every tangent)."""
        if self.unrolled:
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
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return CompactPlan(**{**fields, "state_groups": tuple(groups), "state_loc": loc, "kinds": kinds,
                              "full": self, "to_compact": tuple(remap)})

    @functools.cached_property
    def segments(self) -> list[tuple[int, int, int]]:
        """The loop's segments (start, stop, period): period 0 switches over kinds step by step;
        a period p > 0 runs p steps of known kinds per iteration (no switch)."""
        return periodic_segments(self.step_kind, len(self.kinds), self.max_period)

    def writes(self, loop: Sweep, with_params: bool = False, absent: frozenset[int] = frozenset()) -> Writes:
        """The write slots of ``loop``; ``with_params``: the back substitution forms ℳΛ;
        ``absent``: state groups without a (co)tangent buffer in this solve."""
        key = (loop, with_params, absent)
        cache = self.__dict__.setdefault("_writes", {})
        if key not in cache:
            targets = [self._targets(k, loop, with_params, absent) for k in self.kinds]
            writes = make_writes(self.kinds, self.step_kind, targets, self._pad_rows())
            tangent = {Sweep.FORWARD_SUBSTITUTION: {Family.STATE}, Sweep.FORWARD_TANGENTS: {Family.TANGENT},
                       Sweep.BACK_SUBSTITUTION: {Family.STATE, Family.PARAM}}
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
    def state_elements(self) -> int:
        """The elements of every state buffer in this layout: rows times a row's elements, summed."""
        return sum(group.rows * sum(math.prod(a.shape) for a in group.leaves) for group in self.state_groups)

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
        cache = self.__dict__.setdefault("_forwarding_cache", {})
        if (start, stop) not in cache:
            cache[(start, stop)] = self._forwarding(start, stop)
        return cache[(start, stop)]

    def carried_only(self, start: int, stop: int) -> bool:
        """Whether the steps of ``start:stop`` but the last keep no row (never in a full plan:
        every state has its row; see `CompactPlan`)."""
        return False

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
                   for family in (Family.STATE, Family.TANGENT)},
                **{(Family.RESIDUAL, r): n for r, n in enumerate(self.res_rows)},
                **{(Family.PARAM, p): 0 for p in range(len(self.param_groups))}}  # adds zeros to row 0

    def _targets(self, kind: Kind, loop: Sweep, with_params: bool,
                 absent: frozenset[int]) -> list[tuple[tuple[Family, int], np.ndarray]]:
        n = kind.size
        out_diff = self.state_groups[kind.out_group].differentiable
        if loop in (Sweep.FORWARD, Sweep.FORWARD_RESIDUALS, Sweep.FORWARD_TANGENTS):
            values = [((Family.STATE, kind.out_group), kind.by_member.out[:n])]
            if loop is Sweep.FORWARD_RESIDUALS:
                values += [((Family.RESIDUAL, r), off + np.arange(n))
                           for r, off in zip(kind.own_groups, kind.own_offsets)]
            if loop is Sweep.FORWARD_TANGENTS and out_diff:
                values += [((Family.TANGENT, kind.out_group), kind.by_member.out[:n])]
            return values
        if not out_diff:  # integer states carry no tangent or cotangent
            return []
        if loop is Sweep.FORWARD_SUBSTITUTION:
            return [((Family.STATE, kind.out_group), kind.by_member.out[:n])]
        values = [((Family.STATE, g), kind.by_member.reads[:n, r]) for r, g in enumerate(kind.read_groups)
                  if self.state_groups[g].differentiable and g not in absent]
        if with_params:
            values += [((Family.PARAM, g), kind.by_member.params[:n, p]) for p, g in enumerate(kind.param_groups)]
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


@dataclasses.dataclass(frozen=True, eq=False)
class CompactPlan(Plan):
    """A plan's compact layout (`Plan.compact`): rows only for the states read again, ``full``
    the plan it was made from and ``to_compact`` its row of each full row, per state group."""

    @property
    def compact(self) -> Plan:
        return self

    @functools.cached_property
    def to_full(self) -> tuple[np.ndarray, ...]:
        """Per state group, the full plan's row of each of its rows (the pad row's: the pad row)."""
        out = []
        for g, (remap, group) in enumerate(zip(self.to_compact, self.state_groups)):
            rows = np.full(group.rows, self.full.state_groups[g].pad_row, dtype=np.int32)
            for full_row, row in enumerate(remap):
                if row != group.pad_row or not group.pad:
                    rows[row] = full_row
            out.append(rows)
        return tuple(out)

    def forwarding(self, start: int, stop: int) -> Forwarding | None:
        """As the full plan's (the compact layout aliases rows: decided there), its first row in
        this layout."""
        fwd = self.full.forwarding(start, stop)
        if fwd is None or fwd.first_row is None:
            return fwd
        name = self.full.state_groups[fwd.group].names[fwd.first_row]
        return fwd._replace(first_row=self.state_loc[name][1])

    def carried_only(self, start: int, stop: int) -> bool:
        """Whether the steps of ``start:stop`` but the last keep no row — their outputs live in the
        loop's carry alone (a chain), so the loop need neither write them nor read their
        (co)tangents back."""
        fwd = self.forwarding(start, stop)
        if fwd is None:
            return False
        pad = self.state_groups[fwd.group].pad_row
        return all(self.kinds[int(self.step_kind[t])].by_step.out[t] == pad for t in range(start, stop - 1))
