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

import dataclasses
import functools
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._graph import Network, stack_states
from ._layer import Layer, Row, Stack
from ._policy import POLICY
from ._stacking import under_vmap

# ``call(net, theta, inputs, offsets)`` runs one network; ``offsets`` maps names of stacked inputs
# given whole (larger than the network reads) to the row where the network's row 0 is.
Call = Callable[[Network, dict, tuple, dict], Any]


@dataclasses.dataclass(frozen=True)
class Segment:
    """Layers ``start:stop`` of a network as a network of their own (``net``), with local names:
    layer j of the segment is ``("layer", j)``; it reads the states of earlier segments as inputs
    ``("before", d)`` (the state d positions before the segment's start), network inputs as
    ``("input", name)``, and rows ``base .. base + span − 1`` of stacked inputs and blocks as rows
    0 .. span − 1 of slices."""

    net: Network
    start: int
    before: tuple[int, ...]  # the d of each ("before", d) input, in input order
    whole: tuple[Hashable, ...]  # network inputs read whole, in input order
    row_inputs: tuple[tuple[Hashable, int, int], ...]  # (input, base, span), in input order
    row_blocks: tuple[tuple[Hashable, int, int], ...]  # (block, base, span)
    returns: tuple[int, ...]  # the local positions j whose states the segment returns
    before_names: tuple[Hashable, ...] = ()  # the network's names for the ("before", d) inputs
    far: tuple[int, ...] = ()  # outputs (positions in returns) wanted beyond the next segment

    def translates(self, other: Segment, length: int) -> bool:
        """Whether this segment is ``other``'s computation on other rows of the stacked inputs and
        blocks (any rows: a scan step slices them at a table's offsets), reading at most one
        segment (``length`` layers) back: then both are steps of one scan."""
        return self.net == other.net and max(self.before, default=0) <= length

    @property
    def bases(self) -> tuple[int, ...]:
        """The first row this segment reads of each stacked input and block, in table order."""
        return tuple(base for _, base, _ in self.row_inputs + self.row_blocks)


def segment_length(layers: int, checkpoints: int) -> int:
    """⌈N/(k+1)⌉ layers per segment: k + 1 segments at most, k states kept between them."""
    return -(-layers // (checkpoints + 1))


@functools.lru_cache(maxsize=32)
def split(net: Network, checkpoints: int, longest_period: int = POLICY.longest_checkpoint_period
          ) -> tuple[Segment, ...]:
    """The segments of ``net`` for ``checkpoints`` kept states (see the module docstring). Where
    ⌈N/(k+1)⌉-layer segments are not translates of each other — layers repeating with a period
    that does not divide that length (two kinds alternating, three kinds with skips) — segments
    of the next multiple of the period (at most twice as long, so at most k states kept) are,
    if any (periods up to ``longest_period``): one scan, a program that does not grow with k."""
    length = segment_length(len(net.layers), checkpoints)
    segments = _split(net, length)
    if len(_units(segments)) <= 3:  # one scan, and a first and a last segment of their own
        return segments
    for period in range(2, longest_period + 1):
        longer = period * -(-length // period)
        if longer == length or longer > 2 * length:
            continue
        candidate = _split(net, longer)
        if len(_units(candidate)) <= 3:
            return candidate
    return segments


def _split(net: Network, length: int) -> tuple[Segment, ...]:
    """``net`` cut into segments of ``length`` layers."""
    layers = net.layers
    position = {layer.name: i for i, layer in enumerate(layers)}
    last_read = {}
    for i, layer in enumerate(layers):
        for r in layer.reads:
            if not isinstance(r, Row) and r in position:
                last_read[r] = i
    outputs = set(net.outputs)
    segments = []
    for start in range(0, len(layers), length):
        stop = min(start + length, len(layers))
        segments.append(_segment(net, layers[start:stop], start, stop, position, last_read, outputs))
    if len(segments) > 2 and not segments[1].translates(segments[0], length):
        # The first segment reads network inputs where the next reads the states before it (a
        # chain's input, an RNN's h0): read as those, it joins the scan of its translates.
        as_before = _inputs_in_place_of_states(net, segments[0], segments[1])
        if as_before:
            first = _segment(net, layers[:length], 0, length, position, last_read, outputs, as_before)
            if segments[1].translates(first, length):
                segments[0] = first
    return tuple(segments)


def _inputs_in_place_of_states(net: Network, first: Segment, second: Segment) -> dict[Hashable, int]:
    """Network inputs that the first segment reads exactly where the second reads ("before", d):
    input -> d (empty where that does not describe every such read)."""
    found: dict[Hashable, int] = {}
    for a, b in zip(first.net.layers, second.net.layers):
        for r1, r2 in zip(a.reads, b.reads):
            if isinstance(r2, tuple) and not isinstance(r2, Row) and r2[:1] == ("before",):
                if not (isinstance(r1, tuple) and r1[:1] == ("input",)) or found.get(r1[1], r2[1]) != r2[1]:
                    return {}
                found[r1[1]] = r2[1]
    # One to one: two inputs read where the second segment reads one state twice are two values
    # (a translate would read one of them for both: a wrong result).
    return found if len(set(found.values())) == len(found) else {}


def _segment(net: Network, layers: tuple[Layer, ...], start: int, stop: int, position: dict,
             last_read: dict, outputs: set, as_before: dict[Hashable, int] | None = None) -> Segment:
    as_before = as_before or {}
    rows: dict[Hashable, list[int]] = {}
    blocks: dict[Hashable, list[int]] = {}
    for layer in layers:
        for r in layer.reads:
            if isinstance(r, Row):
                rows.setdefault(r.block, []).append(r.index)
        for p in layer.params:
            if isinstance(p, Row):
                blocks.setdefault(p.block, []).append(p.index)
    base = {("input", x): min(ix) for x, ix in rows.items()} | {("block", b): min(ix) for b, ix in blocks.items()}

    def read(r: Hashable) -> Hashable:
        if isinstance(r, Row):
            return Row(("input", r.block), r.index - base[("input", r.block)])
        if r not in position:
            return ("before", as_before[r]) if r in as_before else ("input", r)
        j = position[r] - start
        return ("layer", j) if j >= 0 else ("before", -j)

    def param(p: Hashable) -> Hashable:
        return Row(p.block, p.index - base[("block", p.block)]) if isinstance(p, Row) else p

    local = [Layer(("layer", j), layer.fn, tuple(map(read, layer.reads)), tuple(map(param, layer.params)))
             for j, layer in enumerate(layers)]
    named = {read(r)[1]: r for layer in layers for r in layer.reads
             if not isinstance(r, Row) and read(r)[0] == "before"}
    before = tuple(sorted(named))  # nearest first
    whole = tuple(x for x in net.inputs if x not in as_before and any(
        r == x for layer in layers for r in layer.reads if not isinstance(r, Row)))
    row_inputs = tuple((x, base[("input", x)], max(rows[x]) - base[("input", x)] + 1) for x in net.inputs
                       if x in rows)
    row_blocks = tuple((b, base[("block", b)], max(ix) - base[("block", b)] + 1) for b, ix in blocks.items())
    returns = tuple(j for j, layer in enumerate(layers)
                    if layer.name in outputs or last_read.get(layer.name, -1) >= stop)
    inputs = [("before", d) for d in before] + [("input", x) for x in whole] + [("input", x) for x, _, _ in row_inputs]
    seg_net = Network(local, inputs, [("layer", j) for j in returns])
    far = tuple(out for out, j in enumerate(returns) if layers[j].name in outputs
                or last_read.get(layers[j].name, -1) >= stop + len(layers))
    return Segment(seg_net, start, before, whole, row_inputs, row_blocks, returns,
                   tuple(named[d] for d in before), far)


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
            stacked = jax.tree.map(lambda *ys: jnp.stack(ys, axis=1), *self.ys)
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
    units = _typed_units(net, _units(segments), theta, given)
    cut = _Cuts(units, theta, {x: v for x, v in given.items() if x not in offsets})
    values: dict[Hashable, Any] = dict(given)
    runs: list[_Scanned] = []

    def value(name: Hashable) -> Any:
        if name in values:
            return values[name]
        return next(run.one(name) for run in runs if name in run.where)

    for n, unit in enumerate(units):
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
            outs = _run(unit[0], cut.pieces(n), theta, given, before, checkpoint=n < len(units) - 1, call=call,
                        offsets=offsets)
            values.update((net.layers[unit[0].start + j].name, out) for j, out in zip(unit[0].returns, outs))
    result = [_gather(item, value, runs) for item in net.output_spec]
    return result[0] if net.single_output else tuple(result)


def rows_cut(net: Network, checkpoints: int, longest_period: int = POLICY.longest_checkpoint_period
             ) -> dict[tuple[str, Hashable], int]:
    """Per stacked input or block (``("input" | "block", name)``): how many of its rows the
    segments that run on their own read — cut out as pieces (copies; a block's gradient is
    concatenated back from pieces). Scans slice their rows in place."""
    out: dict[tuple[str, Hashable], int] = {}
    for unit in _units(split(net, checkpoints, longest_period)):
        if len(unit) == 1:
            for kind, table in (("input", unit[0].row_inputs), ("block", unit[0].row_blocks)):
                for name, _, span in table:
                    out[(kind, name)] = out.get((kind, name), 0) + span
    return out


def _units(segments: tuple[Segment, ...]) -> list[tuple[Segment, ...]]:
    """Segments grouped into what runs as one: a run of translates (a scan), or one segment."""
    units, s = [], 0
    while s < len(segments):
        stop = s + 1
        while stop < len(segments) and segments[stop].translates(segments[s], len(segments[s].net.layers)):
            stop += 1
        units.append(segments[s:stop])
        s = stop
    return units


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


def row_spans(net: Network) -> dict[Hashable, int]:
    """Per stacked input of ``net``: how many rows it reads (its largest ``Row`` index + 1)."""
    spans: dict[Hashable, int] = {}
    for layer in net.layers:
        for r in layer.reads:
            if isinstance(r, Row):
                spans[r.block] = max(spans.get(r.block, 0), r.index + 1)
    return spans


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
