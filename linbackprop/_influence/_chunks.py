"""Examples in chunks: a function of a few examples at a time, so that memory is bounded by the
chunk, not by the data set.

The full chunks go through one ``lax.map`` (one compiled body however many chunks), the
remainder (fewer examples) through one more call of the function: every chunk holds real
examples only. Padding the last chunk instead would put made-up inputs into K-FAC's input-side
factor, which sums over the examples a call sees whatever their losses' weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def example_count(arrays: tuple, what: str) -> int:
    """The examples of ``arrays`` (their common leading axis); ``what`` names them in errors."""
    if not isinstance(arrays, tuple):
        raise TypeError(f"influence: {what} must be a tuple of arrays (the arguments after params, each with a "
                        f"leading axis of examples), got {type(arrays).__name__}; write ({what},) for one array.")
    leaves = jax.tree.leaves(arrays)
    if not leaves:
        raise ValueError(f"influence: {what} holds no arrays; pass the data whose leading axis is the example.")
    sizes = {jnp.shape(x)[0] if jnp.ndim(x) else None for x in leaves}
    if len(sizes) != 1 or None in sizes:
        shapes = [jnp.shape(x) for x in leaves]
        raise ValueError(f"influence: the arrays of {what} must share their leading axis (the examples); their "
                         f"shapes are {shapes}.")
    return sizes.pop()


def chunked(fn: Callable[..., Any], arrays: tuple, size: int | None, what: str) -> list[tuple[Any, int]]:
    """``fn(index, *chunk)`` over consecutive chunks of ``size`` examples of ``arrays`` (all of
    them at once where ``size`` is None): a list of (its results stacked on a leading axis, one
    entry per chunk; the chunk's examples), in order. ``index`` is the chunk's number (a traced
    int32 scalar: fold it into a PRNG key)."""
    total = example_count(arrays, what)
    size = total if size is None else min(size, total)
    full, rest = divmod(total, size)
    out = []
    if full == 1:
        out.append((jax.tree.map(lambda r: r[None], fn(jnp.int32(0), *jax.tree.map(lambda x: x[:size], arrays))),
                    size))
    elif full > 1:
        stacked = jax.tree.map(lambda x: x[:full * size].reshape(full, size, *x.shape[1:]), arrays)
        out.append((jax.lax.map(lambda xs: fn(xs[0], *xs[1]), (jnp.arange(full, dtype=jnp.int32), stacked)), size))
    if rest:
        tail = jax.tree.map(lambda x: x[full * size:], arrays)
        out.append((jax.tree.map(lambda r: r[None], fn(jnp.int32(full), *tail)), rest))
    return out


def summed(fn: Callable[..., Any], arrays: tuple, size: int | None, what: str) -> Any:
    """Σ over the chunks of ``fn(index, *chunk)`` (a pytree of arrays)."""
    parts = [jax.tree.map(lambda r: jnp.sum(r, axis=0), stacked) for stacked, _ in chunked(fn, arrays, size, what)]
    return jax.tree.map(lambda *xs: sum(xs[1:], xs[0]), *parts)


def concatenated(fn: Callable[..., Any], arrays: tuple, size: int | None, what: str, axis: int = 0) -> jax.Array:
    """``fn(*chunk)`` (an array with the chunk's examples on ``axis``) over the chunks, joined
    along ``axis`` in the examples' order."""
    parts = []
    for stacked, n in chunked(lambda _, *chunk: fn(*chunk), arrays, size, what):
        moved = jnp.moveaxis(stacked, 0, axis)  # [..., chunks, n, ...]
        parts.append(moved.reshape(*moved.shape[:axis], moved.shape[axis] * n, *moved.shape[axis + 2:]))
    return jnp.concatenate(parts, axis=axis)
