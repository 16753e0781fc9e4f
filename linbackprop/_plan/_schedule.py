"""How the loop runs the layers: its segments
(stretches where the pattern of kinds repeats with a period, run without a switch).
"""

from __future__ import annotations

import numpy as np


def periodic_segments(step_kind: np.ndarray, kinds: int, max_period: int) -> list[tuple[int, int, int]]:
    """Split the steps into (start, stop, period): the longest stretch whose kinds repeat with a
    period of at most ``max_period`` (`Policy.max_period`; period 0 elsewhere; one kind needs no pattern).

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
        for period in range(1, max_period + 1):
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


def straight_line_kinds(step_kind: np.ndarray, kinds: int, max_period: int) -> frozenset[int]:
    """Kinds whose layers all run as straight-line steps (see ``engine._loop``: a stretch
    shorter than the number of kinds), where no loop switches over kinds: no loop ever writes
    their residuals, so they can be kept as a list of rows."""
    segments = periodic_segments(step_kind, kinds, max_period)
    if any(period == 0 and stop - start >= kinds for start, stop, period in segments):
        return frozenset()  # a loop with a switch writes (zeros) into every kind's slots
    straight = np.zeros(len(step_kind), bool)
    for start, stop, period in segments:
        straight[start:stop] = period == 0
    return frozenset(k for k in range(kinds) if straight[step_kind == k].all())
