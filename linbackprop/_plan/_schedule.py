"""How the layers are run: where a loop pays over straight-line steps, and the loop's segments
(stretches where the pattern of kinds repeats with a period, run without a switch).
"""

from __future__ import annotations

import numpy as np

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


def straight_line_kinds(step_kind: np.ndarray, kinds: int) -> frozenset[int]:
    """Kinds whose layers all run as straight-line steps (see ``engine._loop``: a stretch
    shorter than the number of kinds), where no loop switches over kinds: no loop ever writes
    their residuals, so they can be kept as a list of rows."""
    segments = periodic_segments(step_kind, kinds)
    if any(period == 0 and stop - start >= kinds for start, stop, period in segments):
        return frozenset()  # a loop with a switch writes (zeros) into every kind's slots
    straight = np.zeros(len(step_kind), bool)
    for start, stop, period in segments:
        straight[start:stop] = period == 0
    return frozenset(k for k in range(kinds) if straight[step_kind == k].all())
