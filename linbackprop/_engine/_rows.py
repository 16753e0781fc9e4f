"""Rows of buffers: the stored forward pass (`Primal`) and the helpers that read, write and
scatter rows of a buffer — a stacked pytree, or a `RowList` when the plan is unrolled — and
index them by a loop's step (`Index`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._graph import index_row, stack_trees, update_row, zeros_of
from .._plan import Plan, RowList, as_dtype


@functools.partial(jax.tree_util.register_dataclass, data_fields=["params", "states", "residuals"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Primal:
    """Everything the linear maps need: parameters, states and per-kind own residuals.

    ``residuals`` is None in the rematerialising mode: only the states are kept, and every
    product re-linearises its layers from their (re-read) parameters and inputs.
    """

    params: list[Any]
    states: list[Any]
    residuals: list[Any] | None


# -- small buffer helpers (a buffer: a stacked pytree, or a RowList when the plan is unrolled) -----
def _cast(value: Any, like: Any) -> Any:
    return jax.tree.map(lambda v, b: as_dtype(v, b.dtype), value, like)


def read_row(buf: Any, i: Any, written: bool = False) -> Any:
    """Row i; ``written``: of a buffer the loop also writes (see `index_scalar`)."""
    i = index_scalar(i, affine=not written)
    if isinstance(buf, RowList):
        return buf.rows[int(i)]
    return jax.tree.map(lambda b: index_row(b, i), buf)


def set_row(buf: Any, i: Any, value: Any) -> Any:
    i = index_scalar(i, affine=False)
    if isinstance(buf, RowList):
        rows = list(buf.rows)
        rows[int(i)] = _cast(value, rows[int(i)])
        return RowList(rows)
    return jax.tree.map(lambda b, v: update_row(b, i, as_dtype(v, b.dtype)), buf, value)


def add_row(buf: Any, i: Any, value: Any) -> Any:
    i = index_scalar(i, affine=False)
    if isinstance(buf, RowList):
        rows = list(buf.rows)
        rows[int(i)] = jax.tree.map(lambda b, v: b + v.astype(b.dtype), rows[int(i)], value)
        return RowList(rows)

    def add(b, v):
        return update_row(b, i, index_row(b, i) + v.astype(b.dtype))

    return jax.tree.map(add, buf, value)


def _contiguous(idx: Any) -> int | None:
    """The start of a static index table that is a contiguous range (then slices, not gathers)."""
    if isinstance(idx, np.ndarray) and idx.ndim == 1 and len(idx) and np.array_equal(idx, idx[0] + np.arange(len(idx))):
        return int(idx[0])
    return None


def read_rows(buf: Any, idx: Any) -> Any:
    if isinstance(buf, RowList):
        return stack_trees([buf.rows[int(i)] for i in idx])
    start = _contiguous(idx)
    if start is not None:
        return jax.tree.map(lambda b: lax.slice_in_dim(b, start, start + len(idx)), buf)
    return jax.tree.map(lambda b: b[idx], buf)


def _unstacked(tree: Any, n: int) -> list[Any]:
    """The n rows of a stacked pytree, by one split per leaf: its transpose is one concatenation,
    where n row slices transpose to n padded copies of the whole (XLA kept them all live: a
    checkpointed RNN's segments held O(rows²) temporaries)."""
    leaves, treedef = jax.tree.flatten(tree)
    split = [list(x) if x.dtype == jax.dtypes.float0 else [r.reshape(x.shape[1:]) for r in lax.split(x, (1,) * n)]
             for x in leaves]
    return [treedef.unflatten([rows[m] for rows in split]) for m in range(n)]


def scatter_add(buf: Any, idx: Any, value: Any) -> Any:
    if isinstance(buf, RowList):
        for i, row in zip(idx, _unstacked(value, len(idx))):
            buf = add_row(buf, i, row)
        return buf
    start = _contiguous(idx)
    if start is not None:
        def add(b, v):
            part = lax.slice_in_dim(b, start, start + len(idx)) + v.astype(b.dtype)
            return part if part.shape == b.shape else lax.dynamic_update_slice_in_dim(b, part, start, 0)

        return jax.tree.map(add, buf, value)
    return jax.tree.map(lambda b, v: b.at[idx].add(v.astype(b.dtype)), buf, value)


def zeros_like_aval(tree: Any, lead: tuple[int, ...] = ()) -> Any:
    return jax.tree.map(lambda a: zeros_of(a, lead), tree)


class Index:
    """A step-dependent index inside a loop: ``values[t]`` for the loop counter ``t``.

    Lookups through the plan's tables compose in numpy at trace time (`index_at`), so the
    program computes each index it uses once, from ``t``: as c + d·t where the values are affine
    in t — the usual case, and then reads of different blocks at the same row are one and the
    same XLA kernel (compile time) — else by one gather from a constant (`index_scalar`).
    """

    __slots__ = ("t", "values")

    def __init__(self, t: jax.Array, values: np.ndarray):
        self.t, self.values = t, values

    def __getitem__(self, key: Any) -> Index:  # columns of a table row: values[:, key]
        key = key[1:] if isinstance(key, tuple) and key[0] is Ellipsis else key
        return Index(self.t, self.values[(slice(None), *(key if isinstance(key, tuple) else (key,)))])

    def __add__(self, offset: int) -> Index:
        return Index(self.t, self.values + offset)

    __radd__ = __add__


def index_at(table: np.ndarray, i: Any) -> Any:
    """Entry i of a static table (i: an int when unrolled, or an `Index`)."""
    return Index(i.t, table[i.values]) if isinstance(i, Index) else table[i]


def index_scalar(i: Any, affine: bool = True) -> Any:
    """An index as the program computes it: static when it is, else c + d·t, else a gather.

    ``affine=False`` (rows of buffers the loop writes): always a gather from a table XLA cannot
    see into. Where XLA can compare a read's index with an earlier write's, it fuses the write
    into the read, which then needs the buffer as it was, and copies the whole buffer each step.
    """
    if not isinstance(i, Index):
        return i
    v = i.values.astype(np.int64)
    d = int(v[1] - v[0]) if len(v) > 1 else 0
    if affine and np.array_equal(v, v[0] + d * np.arange(len(v))):
        return int(v[0]) if d == 0 else int(v[0]) + d * i.t
    table = lax.optimization_barrier(jnp.asarray(v, np.int32))
    return index_row(table, i.t)


# -- between a plan's layout and its compact one ------------------------------------------------


def out_rows(plan: Plan) -> np.ndarray:
    """Per step, the row its output has in ``plan``'s layout (its group: the step's kind's)."""
    return np.array([plan.kinds[int(k)].by_step.out[t] for t, k in enumerate(plan.step_kind)], np.int32)


def rows_not_carried(zplan: Plan, forwarded: Callable) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per state group, the full layout's rows that no step of a stretch carrying Λ writes
    (``forwarded``: a stretch's `Forwarding`, None where the loop carries nothing) and that the
    compact layout keeps — the inputs, the outputs of steps that carry nothing — with their rows
    there. Every other row is a carried step's or zero."""
    full = zplan.full
    carried = [np.zeros(group.rows, bool) for group in full.state_groups]
    rows = out_rows(full)
    for start, stop, _ in zplan.segments:
        fwd = forwarded((start, stop))
        if fwd is not None:
            carried[fwd.group][rows[start:stop]] = True
    out = []
    for g, group in enumerate(zplan.state_groups):
        to_compact = np.asarray(zplan.to_compact[g])
        kept = ~carried[g] & ((to_compact != group.pad_row) if group.pad else True)
        out.append((np.nonzero(kept)[0].astype(np.int32), to_compact[kept].astype(np.int32)))
    return out


def take_rows(bufs: list[Any], tables: tuple[np.ndarray, ...]) -> list[Any]:
    """Each group's buffer at the rows its table lists (between a plan's layout and its compact
    one: ``Plan.to_compact``, ``Plan.to_full``)."""
    return [None if b is None else jax.tree.map(lambda x, m=m: x[m], b) for b, m in zip(bufs, tables)]


def without_pad(plan: Plan, bufs: list[Any]) -> list[Any]:
    """The buffers with their pad rows zero (a scalar set: it keeps an explicitly sharded buffer's
    sharding, where a row of zeros made here would carry none)."""
    return [b if b is None or not group.pad else jax.tree.map(lambda x, r=group.pad_row: x.at[r].set(0), b)
            for b, group in zip(bufs, plan.state_groups)]


def at_inputs(plan: Plan, bufs: list[Any]) -> list[Any]:
    """The buffers at the rows of the network's inputs, zeros elsewhere."""
    out = []
    for g, (b, group) in enumerate(zip(bufs, plan.state_groups)):
        rows = [plan.state_loc[name][1] for name in plan.net.inputs if plan.state_loc[name][0] == g]
        if b is None or None in rows:  # a stacked input: the whole group
            out.append(b)
            continue
        mask = np.zeros(group.rows, bool)
        mask[rows] = True
        out.append(jax.tree.map(lambda x, m=mask: jnp.where(m.reshape(-1, *[1] * (x.ndim - 1)), x, 0), b))
    return out
