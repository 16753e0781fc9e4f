"""Blocks into stacked buffers and back, compiled to a number of kernels independent of depth.

The loop indexes stacked buffers, but users hold one array per block: packing and unpacking
touch every block once, outside the loop. Written with ``jnp.stack`` and ``b[i]``, unpacking
(and JAX's transpose of stacking: the gradient) is one slice per block, each with its own static
offset, i.e. one XLA kernel per block — on CPU ~10–20 ms of compile time each, 10 s at 512
layers. Two small linear primitives fix that:

    place(x_1..x_n; slots, rows) = the buffer with x_k added at row slots[k], zeros elsewhere
    take(buf; slots)             = (buf[slots[0]], …, buf[slots[n-1]])

each the other's transpose. ``take`` reads every row with a dynamic index whose value XLA
cannot fold (`opaque_rows`), so all the n reads are one and the same kernel.
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

MANY = 8  # below this, plain slices (a handful of kernels) keep small programs simple


def opaque_rows(n: int) -> tuple[jax.Array, ...]:
    """The integers 0..n-1 as runtime scalars that XLA cannot fold into the kernels using them.

    A ``lax.cond`` on a predicate XLA cannot evaluate (a zero behind an optimization barrier)
    whose branches both return the constants: whichever runs, the values are exact. (The constants
    themselves behind the barrier compile 3-4x slower: XLA then treats each as a separate kernel.)
    """
    constants = tuple(np.int32(i) for i in range(n))
    return lax.cond(lax.optimization_barrier(jnp.zeros((), np.int32)) != 0, lambda: constants, lambda: constants)


def stack_trees(trees: list[Any], axis: int = 0) -> Any:
    """Pytrees of one structure stacked leaf by leaf along a new ``axis`` (the package's one
    stacking helper; float0 leaves, tangents without values, with numpy: JAX has no float0 arrays)."""
    def one(*leaves: Any) -> Any:
        if all(isinstance(x, np.ndarray) and x.dtype == jax.dtypes.float0 for x in leaves):
            return np.stack(leaves, axis)
        return jnp.stack(leaves, axis)

    return jax.tree.map(one, *trees)


def explicit_sharding(x: Any) -> NamedSharding | None:
    """The sharding of an array (or aval) whose type carries one — on a mesh with axes of type
    Explicit, ``jax.make_mesh``'s default — else None (unsharded, or sharded by XLA under Auto axes)."""
    if isinstance(x, (jax.ShapeDtypeStruct, jax.core.ShapedArray)):
        sharding = getattr(x, "sharding", None)
    else:
        try:
            sharding = jax.typeof(x).sharding
        except (TypeError, AttributeError):  # a Python scalar or another unsharded value
            return None
    if not isinstance(sharding, NamedSharding):
        return None
    # Replicated arrays on a mesh with Explicit axes count too: their type carries the mesh, which
    # JAX's rules need to shard the products that contract over a sharded axis (the batch of ℳΛ)
    # when no mesh is set (``jax.set_mesh``).
    explicit = any(kind == AxisType.Explicit for kind in sharding.mesh.axis_types)
    return sharding if explicit else None


def sharded_as(x: jax.Array, like: Any) -> jax.Array:
    """``x`` resharded as ``like`` (an array or an aval of the same shape) where ``like``'s type
    carries an explicit sharding; ``x`` as it is elsewhere. What a value built from constants (a
    basis, a draw) needs before it meets the user's explicitly sharded arrays."""
    sharding = explicit_sharding(like)
    if sharding is None or explicit_sharding(x) == sharding:
        return x
    with mesh_of(like):
        return jax.sharding.reshard(x, sharding.spec)


def replicated_result(x: jax.Array, contracted: tuple[int, ...]) -> dict:
    """``out_sharding=`` for a ``lax.dot_general`` of ``x`` with an operand of the same sharding
    that contracts ``contracted`` and keeps x's other axes twice over (a Gram matrix), where a
    contracted axis is explicitly sharded (the batch over a mesh with Explicit axes): replicated,
    the sum over the devices XLA's all-reduce. Elsewhere nothing (XLA chooses)."""
    sharding = explicit_sharding(x)
    if sharding is None or all(sharding.spec[d] is None for d in contracted if d < len(sharding.spec)):
        return {}
    free = x.ndim - len(contracted)
    return {"out_sharding": NamedSharding(sharding.mesh, P(*([None] * (2 * free))))}


def zeros_of(like: Any, lead: tuple[int, ...] = ()) -> jax.Array:
    """Zeros of shape ``(*lead, *like.shape)`` and ``like``'s dtype, sharded as ``like`` with the
    ``lead`` axes unsharded: a buffer that rows of explicitly sharded states are written into must
    have their sharding. ``like``: an array or an aval."""
    shape = (*lead, *like.shape)
    sharding = explicit_sharding(like)
    if sharding is None:
        return jnp.zeros(shape, like.dtype)
    with mesh_of(like):
        return jnp.zeros(shape, like.dtype, out_sharding=NamedSharding(sharding.mesh, P(*(None for _ in lead),
                                                                                          *sharding.spec)))


def mesh_of(tree: Any) -> contextlib.AbstractContextManager:
    """The abstract mesh of the first explicitly sharded leaf of ``tree`` as JAX's current one,
    where none is set (no ``jax.set_mesh``): inside jit, JAX then types the arrays the solve
    creates (zeros, residual buffers) on that mesh, as it types the user's arrays; without it
    (JAX 0.12) their shardings would be dropped and mismatch those of the user's arrays."""
    if not jax.sharding.get_abstract_mesh().empty:
        return contextlib.nullcontext()
    for leaf in jax.tree.leaves(tree):
        sharding = explicit_sharding(leaf)
        if sharding is not None:
            mesh = sharding.mesh if isinstance(sharding.mesh, AbstractMesh) else sharding.mesh.abstract_mesh
            return jax.sharding.use_abstract_mesh(mesh)
    return contextlib.nullcontext()


def under_vmap() -> bool:
    """Whether the arrays are traced under ``jax.vmap`` (JAX's own test of its trace stack)."""
    try:
        from jax._src.core import unsafe_am_i_under_a_vmap
    except ImportError:  # pragma: no cover - another JAX layout: assume not (the plain programs)
        return False
    return unsafe_am_i_under_a_vmap()


# -- place ------------------------------------------------------------------------------------------
def _place_impl(*xs: jax.Array, slots: tuple[int, ...], rows: int) -> jax.Array:
    stacked = jnp.stack(xs)
    first = slots[0]
    if _plain_ops_only(stacked):  # PRNG keys (no pad, no add: their slots are distinct) and sharded rows
        blank = zeros_of(xs[0], (rows,)).at[np.asarray(slots)]
        return blank.set(stacked) if jax.dtypes.issubdtype(stacked.dtype, jax.dtypes.extended) else blank.add(stacked)
    if slots == tuple(range(first, first + len(xs))):  # consecutive rows: a pad with zeros (XLA CPU
        # splits a concatenate with zeros into log2(rows) broadcast kernels)
        padding = [(first, rows - first - len(xs), 0)] + [(0, 0, 0)] * (stacked.ndim - 1)
        return lax.pad(stacked, jnp.zeros((), stacked.dtype), padding)
    return jnp.zeros((rows, *stacked.shape[1:]), stacked.dtype).at[np.asarray(slots)].add(stacked)


def _place_abstract(*xs: Any, slots: tuple[int, ...], rows: int) -> jax.core.ShapedArray:
    return jax.core.ShapedArray((rows, *xs[0].shape), xs[0].dtype)


def _place_transpose(ct: jax.Array, *xs: Any, slots: tuple[int, ...], rows: int) -> list[jax.Array]:
    return take_p.bind(ct, slots=slots)


def _place_batch(args: tuple, dims: tuple, slots: tuple[int, ...], rows: int) -> tuple[jax.Array, int]:
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    xs = [jnp.broadcast_to(a, (size, *a.shape)) if d is None else jnp.moveaxis(a, d, 0)
          for a, d in zip(args, dims)]
    return place_p.bind(*xs, slots=slots, rows=rows), 1


place_p = Primitive("linbackprop_place")
place_p.def_impl(_place_impl)
place_p.def_abstract_eval(_place_abstract)
mlir.register_lowering(place_p, mlir.lower_fun(_place_impl, multiple_results=False))
ad.deflinear2(place_p, _place_transpose)
batching.primitive_batchers[place_p] = _place_batch


# -- row access -------------------------------------------------------------------------------------
# lax.dynamic_index_in_dim and dynamic_update_index_in_dim are jitted wrappers: every call is a
# nested jit that JAX's JVP, partial evaluation and transposition then walk. These bind the
# primitives directly (indices are never negative here): about a fifth less tracing time.
def index_row(buf: jax.Array, i: Any) -> jax.Array:
    """buf[i] along the leading axis."""
    return lax.squeeze(lax.dynamic_slice_in_dim(buf, i, 1, 0, allow_negative_indices=False), (0,))


def update_row(buf: jax.Array, i: Any, row: jax.Array) -> jax.Array:
    """buf with row i replaced."""
    return lax.dynamic_update_slice_in_dim(buf, lax.expand_dims(row, (0,)), i, 0, allow_negative_indices=False)


# -- take -------------------------------------------------------------------------------------------
def _take_impl(buf: jax.Array, *, slots: tuple[int, ...]) -> list[jax.Array]:
    rows = opaque_rows(buf.shape[0])
    return [index_row(buf, rows[s]) for s in slots]


def _take_abstract(buf: Any, *, slots: tuple[int, ...]) -> list[jax.core.ShapedArray]:
    return [jax.core.ShapedArray(buf.shape[1:], buf.dtype)] * len(slots)


def _take_transpose(cts: list, buf: Any, *, slots: tuple[int, ...]) -> list[jax.Array]:
    aval = buf.aval
    cts = [jnp.zeros(aval.shape[1:], aval.dtype) if type(ct) is ad.Zero else ct for ct in cts]
    return [place_p.bind(*cts, slots=slots, rows=aval.shape[0])]


def _take_batch(args: tuple, dims: tuple, slots: tuple[int, ...]) -> tuple[list[jax.Array], list[int]]:
    (buf,), (d,) = args, dims
    return take_p.bind(jnp.moveaxis(buf, d, 1), slots=slots), [0] * len(slots)


take_p = Primitive("linbackprop_take")
take_p.multiple_results = True
take_p.def_impl(_take_impl)
take_p.def_abstract_eval(_take_abstract)
mlir.register_lowering(take_p, mlir.lower_fun(_take_impl, multiple_results=True))
ad.deflinear2(take_p, _take_transpose)
batching.primitive_batchers[take_p] = _take_batch


def _plain_ops_only(x: Any) -> bool:
    """PRNG keys and other extended dtypes, and explicitly sharded arrays: stacked and read with
    plain ops (the primitives lower numeric arrays without sharding types only)."""
    dtype = jnp.result_type(x) if not hasattr(x, "dtype") else x.dtype
    return jax.dtypes.issubdtype(dtype, jax.dtypes.extended) or explicit_sharding(x) is not None


# -- on pytrees ---------------------------------------------------------------------------------------
def place(leaves: list[jax.Array], slots: tuple[int, ...], rows: int) -> jax.Array:
    """One stacked leaf: ``leaves[k]`` at row ``slots[k]`` of ``rows`` (zeros elsewhere)."""
    if len(leaves) < MANY or _plain_ops_only(leaves[0]):
        return _place_impl(*leaves, slots=slots, rows=rows)
    return place_p.bind(*leaves, slots=slots, rows=rows)


def take(buf: Any, slots: list[int]) -> list[Any]:
    """Rows ``slots`` of a stacked pytree buffer, one pytree per slot."""
    slots = tuple(int(s) for s in slots)
    leaves, treedef = jax.tree.flatten(buf)
    columns = [[leaf[s] for s in slots] if len(slots) < MANY or _plain_ops_only(leaf)
               else take_p.bind(leaf, slots=slots) for leaf in leaves]
    return [treedef.unflatten([c[k] for c in columns]) for k in range(len(slots))]
