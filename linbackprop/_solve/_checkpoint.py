"""Checkpointed calls: keep a few states through the forward pass, recompute the rest in the
back substitution.

With ``checkpoints=k`` the N layers (topological order) are cut into at most k + 1 segments of
L = ⌈N / (k + 1)⌉ consecutive layers. Each segment is a network of its own, called under
``jax.checkpoint``: the forward pass keeps only what later segments read (for a chain: the
segment's last state, k states in all) and the network's outputs; in reverse mode JAX runs each
segment's forward pass again, just before that segment's back substitution (ℒ restricted to the
segment's rows, its right-hand side the cotangents of the states it hands on).

Memory: the kept states plus one segment's states, residuals and Λ — O(k + N/k) states, least
at k ≈ √N. Time: every layer runs forward twice (the last segment once): at most one forward
pass more than without checkpoints. Evenly spaced segments cost at most 2× the forward
evaluations for O(√N) memory. ``call`` may itself be a checkpointed call (the nested schedule
of ``_transforms``: levels of evenly spaced segments, memory like k, recomputations like
log N, as Griewank's binomial schedule); stacked inputs then go down whole with offsets.

Segments that are translates of each other — same functions, reads reaching back at most one
segment, rows of stacked blocks and inputs anywhere (an RNN, a chain of ``Row``-stacked
blocks) — become one network and run as a ``lax.scan``: the program does not
grow with the number of segments. The scan slices its rows of stacked blocks and inputs in its
body from the whole arrays (no copy of most rows when segments do not tile them), and stacks
only the outputs wanted beyond the next segment: a state only the next segment reads travels in
the carry alone (else it would be kept twice, as checkpoint and as stacked output).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._graph import Network, Stack, stack_states, stack_trees, under_vmap
from .._options import POLICY
from ._segments import Segment, split, units

# ``call(net, theta, inputs, offsets)`` runs one network; ``offsets`` maps names of stacked inputs
# given whole (larger than the network reads) to the row where the network's row 0 is.
Call = Callable[[Network, dict, tuple, dict], Any]


class _Scanned:
    """The outputs of a run of translated segments: ``ys[k]`` stacks output ``kept[k]`` of every
    segment of the run, ``last`` holds the last segment's carried outputs (positions ``carried``);
    ``grid[s][out]`` is the network's name for output ``out`` of segment ``s``. Outputs that only
    the next segment reads travel in the carry alone, not stacked as well."""

    def __init__(self, ys: tuple, kept: tuple[int, ...], last: tuple, carried: list[int],
                 grid: list[list[Hashable]]):
        self.ys, self.grid = ys, [[row[out] for out in kept] for row in grid]
        self.where = {name: (s, k) for s, row in enumerate(self.grid) for k, name in enumerate(row)}
        self.where |= {grid[-1][out]: ("last", i) for i, out in enumerate(carried) if grid[-1][out] not in self.where}
        self.last = last

    def one(self, name: Hashable) -> Any:
        s, k = self.where[name]
        if s == "last":
            return self.last[k]
        return jax.tree.map(lambda a: a[s], self.ys[k])

    def stacked(self, names: tuple[Hashable, ...], at: int) -> tuple[Any, int] | None:
        """Rows of a Stack from ``names[at]`` on that are whole outputs of the run, as one array:
        every output of every segment in order, or one output of every segment. Else None."""
        everything = [name for row in self.grid for name in row]
        if everything and list(names[at:at + len(everything)]) == everything:
            stacked = stack_trees(self.ys, axis=1)
            return jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), stacked), len(everything)
        for out in range(len(self.grid[0])):
            column = [row[out] for row in self.grid]
            if list(names[at:at + len(column)]) == column:
                return self.ys[out], len(column)
        return None


def checkpointed_call(net: Network, theta: dict, inputs: tuple, checkpoints: int, call: Call,
                      offsets: dict[Hashable, Any] | None = None,
                      longest_period: int = POLICY.longest_checkpoint_period) -> Any:
    """``net(theta, *inputs)`` segment by segment, every segment but the last under
    ``jax.checkpoint``; translated segments as one ``lax.scan``. ``call`` runs one network (it may
    be a checkpointed call again: the nested schedule). ``offsets``: stacked inputs given whole,
    read from that row on; segments hand them on whole too, with their own offsets (a slice per
    level would copy a level's rows). ``longest_period``: as in `split`."""
    segments = split(net, checkpoints, longest_period)
    given = dict(zip(net.inputs, inputs))
    offsets = offsets or {}
    grouped = _typed_units(net, units(segments), theta, given)
    cut = _Cuts(grouped, theta, {x: v for x, v in given.items() if x not in offsets})
    values: dict[Hashable, Any] = dict(given)
    runs: list[_Scanned] = []

    def value(name: Hashable) -> Any:
        if name in values:
            return values[name]
        return next(run.one(name) for run in runs if name in run.where)

    for n, unit in enumerate(grouped):
        before = tuple(value(name) for name in unit[0].before_names)
        if len(unit) > 1:
            first = unit[0]
            carried = [first.returns.index(len(first.net.layers) - d) for d in first.before]
            kept = tuple(sorted(set(range(len(first.returns))).difference(carried).union(
                *(sg.far for sg in unit[:-1]))))
            last, ys = _scan(unit, theta, given, before, carried, kept, call, offsets)
            grid = [[net.layers[sg.start + j].name for j in sg.returns] for sg in unit]
            runs.append(_Scanned(ys, kept, last, carried, grid))
        else:
            outs = _run(unit[0], cut.pieces(n), theta, given, before, checkpoint=n < len(grouped) - 1, call=call,
                        offsets=offsets)
            values.update((net.layers[unit[0].start + j].name, out) for j, out in zip(unit[0].returns, outs))
    result = [_gather(item, value, runs) for item in net.output_spec]
    return result[0] if net.single_output else tuple(result)


def _typed_units(net: Network, units: list[tuple[Segment, ...]], theta: dict, given: dict) -> list[tuple[Segment, ...]]:
    """``units`` with every scan's first segment run on its own where the states it reads differ
    in structure, shape or dtype from those the segments hand on (an RNN's h0 unbatched, or float32
    under x64): a scan carries one type. Types follow by abstract evaluation, one segment a unit."""
    avals: dict[Hashable, Any] = {name: _aval(x) for name, x in given.items()}
    out: list[tuple[Segment, ...]] = []
    pending = list(units)
    while pending:
        unit = pending.pop(0)
        first = unit[0]
        before = tuple(avals[name] for name in first.before_names)
        outs = _abstract_outputs(first, theta, given, before)
        if len(unit) > 1:
            carried = [outs[first.returns.index(len(first.net.layers) - d)] for d in first.before]
            if _types(tuple(carried)) != _types(before):
                out.append((first,))
                pending.insert(0, unit[1:])
                avals.update((net.layers[first.start + j].name, o) for j, o in zip(first.returns, outs))
                continue
        out.append(unit)
        for sg in unit:  # translates of the first: the same types
            avals.update((net.layers[sg.start + j].name, o) for j, o in zip(sg.returns, outs))
    return out


def _aval(x: Any) -> Any:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a)), x)


def _types(trees: Any) -> Any:
    leaves, treedef = jax.tree.flatten(trees)
    return treedef, [(tuple(a.shape), np.dtype(a.dtype)) for a in leaves]


def _abstract_outputs(seg: Segment, theta: dict, given: dict, before: tuple) -> tuple:
    """The types of a segment's returned states (plain evaluation, traced abstractly)."""
    def outputs(before):
        rows = tuple(jax.tree.map(lambda a, b=b, n=n: lax.slice_in_dim(a, b, b + n), given[x])
                     for x, b, n in seg.row_inputs)
        blocks = {blk: jax.tree.map(lambda a, b=b, n=n: lax.slice_in_dim(a, b, b + n), theta[blk])
                  for blk, b, n in seg.row_blocks}
        theta_seg = {p: blocks[p] if p in blocks else theta[p] for p in seg.net.param_names}
        states = seg.net.states(theta_seg, *before, *(given[x] for x in seg.whole), *rows)
        return tuple(states[("layer", j)] for j in seg.returns)

    return jax.eval_shape(outputs, before)


class _Cuts:
    """The rows of each stacked input and block that each segment run on its own reads, cut in
    one ``lax.split`` where their ranges follow one another (its transpose, a concatenation,
    assembles the gradient without a full-size buffer per segment), else by one slice each.
    (Scans slice their rows from the whole source in their body: no copy.)"""

    def __init__(self, units: list[tuple[Segment, ...]], theta: dict, given: dict):
        ranges: dict[tuple[str, Hashable], list[tuple[int, int, int]]] = {}  # source -> (unit, start, stop)
        for n, (seg, *more) in enumerate(units):
            for kind, table in (("input", seg.row_inputs), ("block", seg.row_blocks)):
                for name, base, span in table if not more else ():
                    if kind == "block" or name in given:  # (inputs with offsets are handed on whole)
                        ranges.setdefault((kind, name), []).append((n, base, base + span))
        self._pieces: dict[int, dict[tuple[str, Hashable], Any]] = {n: {} for n in range(len(units))}
        for (kind, name), parts in ranges.items():
            source = given[name] if kind == "input" else theta[name]
            rows = jax.tree.leaves(source)[0].shape[0]
            bounds = [b for _, start, stop in parts for b in (start, stop)]
            if bounds == sorted(bounds):  # in order, not overlapping: one split
                cuts = sorted({b for b in bounds if 0 < b < rows})
                pieces = jax.tree.map(lambda a, cuts=cuts: lax.split(a, np.diff([0, *cuts, rows]).tolist()), source)
                where = {start: i for i, start in enumerate([0, *cuts])}
                for n, start, _ in parts:
                    self._pieces[n][(kind, name)] = jax.tree.map(
                        lambda _, p, i=where[start]: p[i], source, pieces, is_leaf=lambda x: isinstance(x, list))
            else:
                for n, start, stop in parts:
                    self._pieces[n][(kind, name)] = jax.tree.map(lambda a, b=start, e=stop: lax.slice_in_dim(a, b, e),
                                                                 source)

    def pieces(self, unit: int) -> dict[tuple[str, Hashable], Any]:
        """Per ("input" | "block", name): the rows unit ``unit`` reads, from its first row read."""
        return self._pieces[unit]


def _run(seg: Segment, pieces: dict, theta: dict, given: dict, before: tuple, checkpoint: bool,
         call: Call, offsets: dict[Hashable, Any]) -> tuple:
    """One segment called on its own (under ``jax.checkpoint`` unless it is the last)."""
    rows = tuple(given[x] if x in offsets else pieces[("input", x)] for x, _, _ in seg.row_inputs)
    starts = tuple(offsets[x] + base if x in offsets else 0 for x, base, _ in seg.row_inputs)
    blocks = {b: pieces[("block", b)] for b, _, _ in seg.row_blocks}

    def run(theta_seg: dict, before: tuple, whole: tuple, rows: tuple, starts: tuple) -> tuple:
        at = {("input", x): start for (x, _, _), start in zip(seg.row_inputs, starts)}
        return tuple(call(seg.net, theta_seg, (*before, *whole, *rows), at))

    if checkpoint:
        run = jax.checkpoint(run)
    theta_seg = {p: blocks[p] if p in blocks else theta[p] for p in seg.net.param_names}
    return run(theta_seg, before, tuple(given[x] for x in seg.whole), rows, starts)


def _scan(run: tuple[Segment, ...], theta: dict, given: dict, before: tuple,
          carried: list[int], kept: tuple[int, ...], call: Call, offsets: dict[Hashable, Any]) -> tuple[tuple, tuple]:
    """Segments that translate one another as one ``lax.scan`` over the first one's network,
    checkpointed: it carries the states the next segment reads (outputs ``carried``) and stacks
    outputs ``kept``. Its rows of stacked blocks are scanned over where the run takes all rows in
    order (a reshape; not under vmap), else sliced in the body at each segment's first row (a table scanned over:
    rows may move by any amount from segment to segment); stacked inputs likewise, except that
    inputs sliced in the body go to ``call`` whole with the row to start from (``offsets``), so a
    nested checkpointed call slices only its leaves' rows. Returns (last carry, stacked)."""
    first, n = run[0], len(run)
    ranges = first.row_inputs + first.row_blocks
    k = len(first.row_inputs)
    bases = np.array([sg.bases for sg in run], np.int32).reshape(n, len(ranges))  # [segment, source]
    sources = [given[x] for x, _, _ in first.row_inputs] + [theta[b] for b, _, _ in first.row_blocks]

    # Under vmap a reshaped source's batch axis is moved behind the segments' axis: a copy of the
    # whole source, twice. Sliced in the body instead, only the rows of one segment at a time are.
    batched = under_vmap()

    def scanned(source: Any, r: int, span: int) -> Any:
        rows = jax.tree.leaves(source)[0].shape[0]
        if batched or (r < k and first.row_inputs[r][0] in offsets) \
                or not np.array_equal(bases[:, r], span * np.arange(n)) or n * span != rows:
            return None  # not the whole source in order (or under vmap): sliced inside the body
        return jax.tree.map(lambda a: a.reshape(n, span, *a.shape[1:]), source)

    xs = [scanned(src, r, span) for r, (src, (_, _, span)) in enumerate(zip(sources, ranges))]
    stacked = {b for b, _, _ in first.row_blocks}
    plain = {p: theta[p] for p in first.net.param_names if p not in stacked}
    whole = tuple(given[x] for x in first.whole)

    def body(carry: tuple, step: tuple) -> tuple:
        base, rows = step
        inputs, at = [], {}
        for r, (x, _, _) in enumerate(first.row_inputs):
            if rows[r] is not None:
                inputs.append(rows[r])
            else:  # whole, from its row: a nested call slices only its leaves' rows
                inputs.append(sources[r])
                at[("input", x)] = offsets.get(x, 0) + base[r]
        blocks = {blk: row if row is not None else jax.tree.map(
            lambda a, b=base[k + i], span=span: lax.dynamic_slice_in_dim(a, b, span), sources[k + i])
            for i, ((blk, _, span), row) in enumerate(zip(first.row_blocks, rows[k:]))}
        outs = tuple(call(first.net, {**plain, **blocks}, (*carry, *whole, *inputs), at))
        return tuple(outs[i] for i in carried), tuple(outs[i] for i in kept)

    return lax.scan(jax.checkpoint(body, prevent_cse=False), before, (jnp.asarray(bases), xs))


def _gather(item: Hashable | Stack, value: Callable[[Hashable], Any], runs: list[_Scanned]) -> Any:
    """An output item: a name's state, or a Stack, built from whole outputs of scans where its
    names line up with them (one reshape), else state by state."""
    if not isinstance(item, Stack):
        return value(item)
    parts, at = [], 0
    while at < len(item.names):
        found = next((hit for run in runs if item.names[at] in run.where
                      for hit in [run.stacked(item.names, at)] if hit is not None), None)
        if found is None:
            parts.append(jax.tree.map(lambda a: a[None], value(item.names[at])))
            at += 1
        else:
            parts.append(found[0])
            at += found[1]
    if len(parts) == 1:
        return parts[0]
    _check_same(item, parts)
    return jax.tree.map(lambda *p: jnp.concatenate(p), *parts)


def _check_same(item: Stack, parts: list[Any]) -> None:
    rows = [jax.tree.map(lambda a: a[0], p) for p in parts]
    stack_states(item, rows)  # raises the Stack's error where the states differ
