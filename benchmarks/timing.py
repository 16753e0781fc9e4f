"""The one place that times things: compiled programs, runs interleaved side by side, steps of a
training loop, memory from the compiled program."""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import numpy as np


def compiled(fn: Callable, args: tuple, jit: Callable = jax.jit):
    """``jit(fn)`` lowered and compiled for ``args``, and the seconds that took."""
    start = time.perf_counter()
    out = jit(fn).lower(*args).compile()
    return out, time.perf_counter() - start


def memory(c) -> tuple[int, int]:
    """(peak, temp) bytes."""
    m = c.memory_analysis()
    return m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes, m.temp_size_in_bytes


def interleaved(runs: list, repeats: int) -> list[float]:
    times: list[list[float]] = [[] for _ in runs]
    for f, args in runs:
        jax.block_until_ready(f(*args))
    for _ in range(repeats):
        for n, (f, args) in enumerate(runs):
            start = time.perf_counter()
            jax.block_until_ready(f(*args))
            times[n].append(time.perf_counter() - start)
    return [float(np.median(t)) for t in times]


def seconds_per_step(step: Callable, carry: tuple, steps: int, warmup: int = 1) -> tuple[tuple, float]:
    """A training loop timed: ``warmup`` calls ``carry = step(*carry)`` (they compile), then
    ``steps`` more; the last carry and the mean seconds of those ``steps``."""
    for _ in range(warmup):
        carry = jax.block_until_ready(step(*carry))
    start = time.perf_counter()
    for _ in range(steps):
        carry = step(*carry)
    jax.block_until_ready(carry)
    return carry, (time.perf_counter() - start) / steps
