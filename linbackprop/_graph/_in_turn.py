"""LAPACK calls one after another: XLA's CPU runtime in JAX 0.10 deadlocks when two batched
factorisations run at once.

A batched ``eigh`` (or Cholesky) on the CPU splits its batch over the intra-op thread pool and
waits for the parts (``jax::ParallelBatchMap``). XLA's concurrency-optimised scheduler runs
independent kernels at the same time on that same pool: with two such kernels on a 2-core machine
every pool thread waits for parts that no free thread is left to run (seen as a K-FAC step of the
transformer LM sitting at 0 % CPU, two ``lapack_ssyevd_ffi`` in ``BlockingCounter::Wait``). Each
call's input made to depend on the previous call's output keeps them in turn: by adding zero
times one finite entry of it, since XLA:CPU drops ``lax.optimization_barrier`` before it schedules
(the compiled step had none left) and folds no product with zero in floating point (inf · 0 is
NaN). What the calls cost is unchanged: each already uses every core.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp


def in_turn(f: Callable[[Any], Any], values: Sequence[Any],
            waits_on: Callable[[Any], Any] = lambda out: out) -> list[Any]:
    """``[f(v) for v in values]``, each call after the one before it (its input waits on the
    arrays ``waits_on`` picks of the previous output: all of it by default), the values
    unchanged."""
    out: list[Any] = []
    for value in values:
        if out:
            value = _after(value, waits_on(out[-1]))
        out.append(f(value))
    return out


def _after(value: Any, previous: Any) -> Any:
    """``value`` as it is, computed after all of ``previous``: + 0 · (a finite entry of each of
    its leaves — of one leaf only, the next call waited for one of two factorisations)."""
    entries = [jnp.ravel(leaf)[0].astype(jnp.float32) for leaf in jax.tree.leaves(previous) if jnp.size(leaf)]
    zero = sum(jnp.where(jnp.isfinite(e), e, 0) for e in entries) * 0
    return jax.tree.map(lambda x: x + zero.astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.inexact) else x, value)
