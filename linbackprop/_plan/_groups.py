"""Buffers of a plan: same-shaped states (or parameter blocks) stacked along a new leading
axis (`Group`), or kept as a list of rows (`RowList`), and the dtype rules they follow.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._graph import explicit_sharding, not_an_array, place, zeros_of

Aval = jax.ShapeDtypeStruct


def leaf_aval(x: Any, where: str) -> Aval:
    """The shape and dtype of one leaf, or a clear error for a non-array leaf."""
    if isinstance(x, (jax.Array, np.ndarray, np.generic, Aval)) or hasattr(x, "aval"):
        weak = x.weak_type if isinstance(x, Aval) else isinstance(x, jax.Array) and jax.typeof(x).weak_type
        return Aval(np.shape(x), x.dtype, sharding=explicit_sharding(x), weak_type=bool(weak))
    if isinstance(x, (bool, int, float, complex)):
        return Aval((), jnp.result_type(x), weak_type=True)
    raise not_an_array(x, where)


def differentiable_dtype(dtype: Any) -> bool:
    """Float and complex leaves have tangents; integer, bool and PRNG-key leaves do not (JAX gives
    them float0 tangents)."""
    return not jax.dtypes.issubdtype(dtype, jax.dtypes.extended) and jnp.issubdtype(dtype, jnp.inexact)


def dtype_key(dtype: Any) -> Any:
    """A dtype as plans key on it (numpy's, or JAX's extended dtype such as a PRNG key's)."""
    return dtype if jax.dtypes.issubdtype(dtype, jax.dtypes.extended) else np.dtype(dtype)


def float0_zeros(shape: tuple[int, ...]) -> np.ndarray:
    """The tangent of a leaf without tangents, as JAX's vjp and jvp expect it."""
    return np.zeros(shape, jax.dtypes.float0)


@jax.tree_util.register_pytree_node_class
class RowList:
    """A buffer kept as a list of rows: unrolled plans index only statically, so nothing needs to
    be stacked (and XLA never copies a whole buffer to update one row)."""

    def __init__(self, rows: list[Any]):
        self.rows = list(rows)

    def tree_flatten(self) -> tuple[list[Any], None]:
        return self.rows, None

    @classmethod
    def tree_unflatten(cls, _: None, rows: list[Any]) -> RowList:
        return cls(rows)


@dataclasses.dataclass(frozen=True)
class Group:
    """Same-shaped states (or parameter blocks), stacked along a new leading axis.

    Buffers of (co)tangents — Z, Λ, h, ℳΛ — have the *tangent layout*: the same pytree with None
    at the leaves that have no tangent (integer, bool, PRNG key), so a state {"h": floats, "key":
    key} carries Λ for "h" alone. `tangent` converts a member's (co)tangent into that
    layout, `full_tangent` back into JAX's (float0 zeros at those leaves).
    """

    treedef: Any
    leaves: tuple[Aval, ...]  # of one row
    names: tuple[Hashable, ...]
    pad: bool  # one extra row that absorbs the writes of inactive kinds (state groups only)
    stacked_rows: int | None = None  # a block or input used by rows (lbp.Row): its single name *is* the buffer

    @property
    def rows(self) -> int:
        return self.stacked_rows if self.stacked_rows is not None else len(self.names) + int(self.pad)

    @property
    def pad_row(self) -> int:
        """Where inactive kinds read and write: the pad row, or row 0 where there is none (their
        reads are discarded and their writes add zeros)."""
        return self.rows - 1 if self.pad else 0

    @functools.cached_property
    def diff_leaves(self) -> tuple[bool, ...]:
        return tuple(differentiable_dtype(a.dtype) for a in self.leaves)

    @property
    def differentiable(self) -> bool:
        """Whether any leaf has a tangent (else the group's tangent buffers are None)."""
        return any(self.diff_leaves)

    def _avals(self, tangent: bool) -> list[Aval | None]:
        return [a if d or not tangent else None for a, d in zip(self.leaves, self.diff_leaves)]

    def zeros(self, as_rows: bool = False, tangent: bool = False) -> Any:
        if as_rows and self.stacked_rows is None:
            return RowList([self.row_zeros(tangent)] * self.rows)
        return self.treedef.unflatten([None if a is None else zeros_of(a, (self.rows,)) for a in self._avals(tangent)])

    def row_zeros(self, tangent: bool = False) -> Any:
        return self.treedef.unflatten([None if a is None else zeros_of(a) for a in self._avals(tangent)])

    def row_avals(self, tangent: bool = False) -> Any:
        return self.treedef.unflatten(self._avals(tangent))

    def tangent(self, value: Any) -> Any:
        """A member's (co)tangent in the tangent layout: None where a leaf has no tangent."""
        return self.treedef.unflatten([v if d else None for v, d in
                                       zip(self.treedef.flatten_up_to(value), self.diff_leaves)])

    def full_tangent(self, value: Any, lead: tuple[int, ...] = ()) -> Any:
        """A member's (co)tangent as JAX wants it: float0 zeros where a leaf has no tangent
        (``lead``: leading axes of ``value``, e.g. the rows of a stacked block)."""
        return self.treedef.unflatten([v if d else float0_zeros((*lead, *a.shape)) for v, d, a in
                                       zip(self.treedef.flatten_up_to(value), self.diff_leaves, self.leaves)])

    def typed(self, value: Any) -> Any:
        """A member (or stacked members) as the layers see it: weakly typed where the network was
        given a weakly typed leaf (a Python scalar), as in the plain call. Buffers hold strongly
        typed arrays of the same dtype and values."""
        if not any(a.weak_type for a in self.leaves):
            return value
        return self.treedef.unflatten([weakly_typed(x) if a.weak_type else x for x, a in
                                       zip(self.treedef.flatten_up_to(value), self.leaves)])

    def cast(self, value: Any, tangent: bool = False) -> Any:
        """One member (or, for a stacked block, the whole block) with the group's dtypes."""
        return self.treedef.unflatten([None if a is None else as_dtype(x, a.dtype) for x, a in
                                       zip(self.treedef.flatten_up_to(value), self._avals(tangent))])

    def stack(self, values: list[Any], as_rows: bool = False, slots: list[int] | None = None,
              tangent: bool = False) -> Any:
        """The members ``values`` at rows ``slots`` (default: all members, in order), zeros in the
        other rows (and in the pad row where the group has one); with ``as_rows`` a
        `RowList`; with ``tangent`` in the tangent layout."""
        if self.stacked_rows is not None:
            (value,) = values
            return self.cast(value, tangent)
        slots = tuple(range(len(values)) if slots is None else slots)
        if as_rows:
            rows = [self.row_zeros(tangent)] * self.rows
            for s, v in zip(slots, values):
                rows[s] = self.cast(v, tangent)
            return RowList(rows)
        leaves = [self.treedef.flatten_up_to(v) for v in values]
        return self.treedef.unflatten([
            None if a is None else place([as_dtype(row[n], a.dtype) for row in leaves], slots, self.rows)
            for n, a in enumerate(self._avals(tangent))])


def _weak_conversion() -> Callable[..., Any] | None:
    """JAX's private conversion to a weakly typed array (there is no public one), or None."""
    try:
        from jax._src.lax.lax import _convert_element_type
    except ImportError:  # pragma: no cover - another JAX layout
        return None
    return _convert_element_type


_TO_WEAK = _weak_conversion()


def weakly_typed(x: Any) -> Any:
    """``x`` as a weakly typed array; without JAX's private conversion, ``x`` as it is (a layer
    given a Python scalar then sees a strongly typed one: values equal, dtype promotion may widen)."""
    if _TO_WEAK is None:
        return x
    return _TO_WEAK(x, weak_type=True)


def as_dtype(x: Any, dtype: Any) -> Any:
    """``x`` as an array of ``dtype`` (PRNG keys are passed through: they have no casts)."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return x
    return jnp.asarray(x, dtype)  # also strong-types a weakly typed x, as the plan's avals are
