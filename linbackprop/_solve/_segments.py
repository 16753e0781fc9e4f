"""Where a checkpointed call cuts: the N layers in topological order as at most k + 1 segments
of L = ⌈N / (k + 1)⌉ consecutive layers, each a network of its own reading the states of earlier
segments as inputs; runs of segments that are translates of each other (one scan); and how many
rows of stacked inputs and blocks the segments read. ``_checkpoint`` runs them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Hashable

from .._graph import Layer, Network, Row
from .._options import POLICY


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
    if len(units(segments)) <= 3:  # one scan, and a first and a last segment of their own
        return segments
    for period in range(2, longest_period + 1):
        longer = period * -(-length // period)
        if longer == length or longer > 2 * length:
            continue
        candidate = _split(net, longer)
        if len(units(candidate)) <= 3:
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


def rows_cut(net: Network, checkpoints: int, longest_period: int = POLICY.longest_checkpoint_period
             ) -> dict[tuple[str, Hashable], int]:
    """Per stacked input or block (``("input" | "block", name)``): how many of its rows the
    segments that run on their own read — cut out as pieces (copies; a block's gradient is
    concatenated back from pieces). Scans slice their rows in place."""
    out: dict[tuple[str, Hashable], int] = {}
    for unit in units(split(net, checkpoints, longest_period)):
        if len(unit) == 1:
            for kind, table in (("input", unit[0].row_inputs), ("block", unit[0].row_blocks)):
                for name, _, span in table:
                    out[(kind, name)] = out.get((kind, name), 0) + span
    return out


def units(segments: tuple[Segment, ...]) -> list[tuple[Segment, ...]]:
    """Segments grouped into what runs as one: a run of translates (a scan), or one segment."""
    units, s = [], 0
    while s < len(segments):
        stop = s + 1
        while stop < len(segments) and segments[stop].translates(segments[s], len(segments[s].net.layers)):
            stop += 1
        units.append(segments[s:stop])
        s = stop
    return units


def row_spans(net: Network) -> dict[Hashable, int]:
    """Per stacked input of ``net``: how many rows it reads (its largest ``Row`` index + 1)."""
    spans: dict[Hashable, int] = {}
    for layer in net.layers:
        for r in layer.reads:
            if isinstance(r, Row):
                spans[r.block] = max(spans.get(r.block, 0), r.index + 1)
    return spans
