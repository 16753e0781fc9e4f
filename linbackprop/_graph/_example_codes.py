"""The codes `_example_flow` gives every element of a value, and how operations that move or
combine elements map them: the lattice (`FREE`, an example's id, `SUMMED`, `MIXED`), its joins,
reductions along axes, and the rules of the operations that move elements (reshapes, slices,
padding: applied to the code arrays), contract them (``dot_general``, convolutions) or reduce
windows of them (pooling).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

FREE, SUMMED, MIXED = -1, -2, -3

CODE = np.int32
KNOWN_LIMIT = 1 << 22  # integer values carried along up to this many elements (index arrays)

# what operations do with elements, by primitive name
LINEAR_UNARY = {"neg", "copy", "copy_p", "real", "imag", "conj", "reduce_precision", "pvary"}
ADDITIVE = {"add", "sub", "add_any"}
ELEMENTWISE = {
    "abs", "acos", "acosh", "and", "asin", "asinh", "atan", "atan2", "atanh", "bessel_i0e", "bessel_i1e", "cbrt",
    "ceil", "clamp", "clz", "complex", "cos", "cosh", "digamma", "eq", "erf", "erf_inv", "erfc", "exp", "exp2",
    "expm1", "floor", "ge", "gt", "igamma", "igammac", "igamma_grad_a", "integer_pow", "is_finite", "le",
    "lgamma", "log", "log1p", "logistic", "lt", "max", "min", "ne", "nextafter", "not", "or", "polygamma",
    "population_count", "pow", "random_gamma_grad", "regularized_incomplete_beta", "rem", "round", "rsqrt",
    "shift_left", "shift_right_arithmetic", "shift_right_logical", "sign", "sin", "sinh", "sqrt", "square", "tan",
    "tanh", "xor", "zeta", "convert_element_type", "stop_gradient", "bitcast_convert_type",
    "random_seed", "random_fold_in", "random_clone", "threefry2x32", "one_minus_square",
} | LINEAR_UNARY | ADDITIVE | {"mul", "div", "select_n"}
# one operand, one result of its shape, and still not elementwise: never taken for a new unary
# operation of JAX's (those are elementwise: `unary_elementwise`)
NOT_ELEMENTWISE = {
    "fft", "cholesky", "eigh", "eig", "qr", "lu", "svd", "schur", "hessenberg", "tridiagonal",
    "triangular_solve", "psum", "pmax", "pmin", "ppermute", "pbroadcast", "all_to_all", "all_gather",
    "psum_scatter", "reduce_scatter", "axis_index", "cumsum", "cumprod", "cummax", "cummin",
    "cumlogsumexp", "rev", "sort", "top_k", "argsort", "reduce_window", "reduce_window_sum",
    "reduce_window_max", "reduce_window_min", "custom_linear_solve", "linear_solve",
}
PASS_THROUGH = {"sharding_constraint", "mesh_cast", "reshard", "device_put", "optimization_barrier", "pvary",
                 "name", "copy_p"}
SINGLE_REDUCTIONS = {"reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "reduce_xor",
                      "argmax", "argmin"}
CUMULATIVE = {"cumsum": True, "cumprod": False, "cummax": False, "cummin": False, "cumlogsumexp": False}
WINDOWS = {"reduce_window_sum": True, "reduce_window_max": False, "reduce_window_min": False,
            "reduce_window": False}
CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
          "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr",
          "remat": "jaxpr", "checkpoint": "jaxpr", "remat2": "jaxpr", "custom_lin": None}


def row_codes(shape: Sequence[int], axis: int = 0, first: int = 0, positions: bool = False) -> np.ndarray:
    """Codes of an array whose examples lie along ``axis``: element (…, b, …) is example
    ``first + b``; with ``positions``, each (example, position) pair on ``axis`` and the axis
    after it is its own id, ``first + b · P + p``."""
    shape = tuple(int(s) for s in shape)
    ids = np.arange(shape[axis], dtype=np.int64)
    if positions:
        count = shape[axis + 1]
        ids = ids[:, None] * count + np.arange(count)[None, :]
        ids = ids.reshape((1,) * axis + ids.shape + (1,) * (len(shape) - axis - 2))
    else:
        ids = ids.reshape((1,) * axis + (-1,) + (1,) * (len(shape) - axis - 1))
    return np.broadcast_to((ids + first).astype(CODE), shape).copy()


def describe(code: int) -> str:
    """A code in words."""
    return {FREE: "no example", SUMMED: "a sum over examples", MIXED: "several examples at once"}.get(
        int(code), f"example {int(code)}")


# --- the walk over a jaxpr -------------------------------------------------------------------


def nonlinear(a: np.ndarray) -> np.ndarray:
    return np.where(a == SUMMED, MIXED, a)


def join_single(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """One value that reads both (nonlinearly): the same example, or free, keeps one id."""
    a, b = nonlinear(a), nonlinear(b)
    same = (a == b) | (b == FREE)
    return np.where(a == FREE, b, np.where(same, a, MIXED)).astype(CODE)


def join_add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """A sum of the two: terms of different examples add to a separable sum."""
    out = np.where(a == FREE, b, np.where((b == FREE) | (a == b), a, SUMMED))
    return np.where((a == MIXED) | (b == MIXED), MIXED, out).astype(CODE)


def join_either(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """A value that is one of the two (a branch, a loop's iterate): each reads one example at most."""
    return np.where((a == MIXED) | (b == MIXED), MIXED, join_add(a, b)).astype(CODE)


def mul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.where(b == FREE, a, np.where(a == FREE, b, join_single(a, b))).astype(CODE)


def div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.where(b == FREE, a, join_single(a, b)).astype(CODE)


def reduce(x: np.ndarray, axes: Sequence[int], additive: bool, keepdims: bool = False) -> np.ndarray:
    """Codes combined along ``axes``: a sum (``additive``) or any other combination."""
    axes = tuple(int(a) % max(x.ndim, 1) for a in axes) if x.ndim else ()
    if not axes:
        return x.astype(CODE)
    ids = x >= 0
    top = np.max(np.where(ids, x, -1), axis=axes, keepdims=keepdims)
    low = np.min(np.where(ids, x, np.iinfo(CODE).max), axis=axes, keepdims=keepdims)
    mixed = np.any(x == MIXED, axis=axes, keepdims=keepdims)
    summed = np.any(x == SUMMED, axis=axes, keepdims=keepdims)
    several = (top >= 0) & (low < top)
    if additive:
        out = np.where(mixed, MIXED, np.where(summed | several, SUMMED, np.where(top >= 0, top, FREE)))
    else:
        out = np.where(mixed | summed | several, MIXED, np.where(top >= 0, top, FREE))
    return np.asarray(out, CODE)


def whole(xs: Sequence[np.ndarray | None]) -> int:
    """Every element of every operand combined (nonlinearly): one code."""
    out = np.asarray(FREE, CODE)
    for x in xs:
        if x is not None:
            out = join_single(out, reduce(x, range(x.ndim), additive=False))
    return int(out)


def full_codes(code: np.ndarray | None, shape: Sequence[int]) -> np.ndarray:
    return np.full(tuple(shape), FREE, CODE) if code is None else np.broadcast_to(code, tuple(shape)).astype(CODE)


def known_constant(c: Any) -> tuple[np.ndarray, np.ndarray] | None:
    if isinstance(c, jax.core.Tracer) or not hasattr(c, "dtype"):
        return None
    if not (jnp.issubdtype(c.dtype, jnp.integer) or jnp.issubdtype(c.dtype, jnp.bool_)) or np.size(c) > KNOWN_LIMIT:
        return None
    try:
        values = np.asarray(c)
    except Exception:  # not on this process (an array over other processes' devices): unknown
        return None
    return values, np.ones(values.shape, bool)


def move(name: str, p: dict, full: list, shapes: list, fill: Any = FREE) -> list | None:
    """The operations that only move elements, applied to arrays of codes (or of what is known):
    None where ``name`` is not one of them."""
    x = full[0] if full else None
    if name == "reshape":
        return [np.reshape(x, p["new_sizes"])]
    if name == "broadcast_in_dim":
        shape, dims = tuple(p["shape"]), tuple(p["broadcast_dimensions"])
        expanded = np.reshape(x, [x.shape[dims.index(d)] if d in dims else 1 for d in range(len(shape))])
        return [np.broadcast_to(expanded, shape)]
    if name == "transpose":
        return [np.transpose(x, p["permutation"])]
    if name == "squeeze":
        return [np.squeeze(x, tuple(p["dimensions"]))]
    if name == "expand_dims":
        return [np.expand_dims(x, tuple(p["dimensions"]))]
    if name == "rev":
        return [np.flip(x, tuple(p["dimensions"]))]
    if name == "slice":
        strides = p.get("strides") or (1,) * x.ndim
        return [x[tuple(slice(a, b, s) for a, b, s in zip(p["start_indices"], p["limit_indices"], strides))]]
    if name == "concatenate":
        return [np.concatenate(full, axis=p["dimension"])]
    if name == "split":
        cuts = np.cumsum(p["sizes"])[:-1]
        return list(np.split(x, cuts, axis=p["axis"]))
    if name == "pad":
        value = full[1]
        with jax.ensure_compile_time_eval():
            out = jax.lax.pad(jnp.asarray(x), jnp.asarray(value, jnp.asarray(x).dtype), p["padding_config"])
        return [np.asarray(out)]
    if name == "copy" or name == "copy_p":
        return [x]
    if name == "iota":
        return [np.full(shapes[0], fill)]
    return None


def dot_general(lhs: np.ndarray, rhs: np.ndarray, dimension_numbers: Any, shape: tuple) -> np.ndarray:
    """Each output element: a sum over the contracted axes of products. Per operand, its
    elements along the contraction summed (``s``) and combined (``u``); a side that reads no
    example there gives the other's sum, else both must read the same example."""
    (lc, rc), (lb, rb) = dimension_numbers

    def arrange(x: np.ndarray, contract: Sequence[int], batch: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        free = [d for d in range(x.ndim) if d not in contract and d not in batch]
        moved = np.transpose(x, [*batch, *free, *contract])
        lead = moved.shape[:len(batch) + len(free)]
        flat = moved.reshape(*lead, -1) if contract else moved.reshape(*lead, 1)
        return reduce(flat, (flat.ndim - 1,), True), reduce(flat, (flat.ndim - 1,), False)

    s_l, u_l = arrange(lhs, lc, lb)
    s_r, u_r = arrange(rhs, rc, rb)
    nb = len(lb)
    nl, nr = s_l.ndim - nb, s_r.ndim - nb
    expand_l = lambda a: a.reshape(a.shape + (1,) * nr)
    expand_r = lambda a: a.reshape(a.shape[:nb] + (1,) * nl + a.shape[nb:])
    s_l, u_l, s_r, u_r = expand_l(s_l), expand_l(u_l), expand_r(s_r), expand_r(u_r)
    out = np.where(u_r == FREE, s_l, np.where(u_l == FREE, s_r, join_single(u_l, u_r)))
    return np.broadcast_to(out, shape).astype(CODE)


def convolution(lhs: np.ndarray, ins: list, p: dict, shape: tuple) -> np.ndarray:
    """A convolution keeps its batch axis apart (feature groups too; batch groups mix it): each
    output example reads its own input (summed over the window and features) and the kernel."""
    numbers = p["dimension_numbers"]
    lhs_spec, out_spec = numbers.lhs_spec, numbers.out_spec
    if p.get("batch_group_count", 1) != 1:
        return np.full(shape, whole(ins), CODE)
    batch_in, batch_out = lhs_spec[0], out_spec[0]
    kernel = whole([ins[1]])
    if kernel == FREE:
        per = reduce(np.moveaxis(lhs, batch_in, 0), range(1, lhs.ndim), additive=True)
    else:
        per = join_single(reduce(np.moveaxis(lhs, batch_in, 0), range(1, lhs.ndim), additive=False),
                           np.asarray(kernel, CODE))
    per = per.reshape((1,) * batch_out + (-1,) + (1,) * (len(shape) - batch_out - 1))
    return np.broadcast_to(per, shape).astype(CODE)


def window(x: np.ndarray, p: dict, shape: tuple, additive: bool) -> np.ndarray:
    """A windowed reduction (pooling): an axis whose window is one element, stride one and no
    padding or dilation keeps its elements apart; along any other the codes are combined."""
    out = x
    dims = p["window_dimensions"]
    strides = p.get("window_strides") or (1,) * x.ndim
    padding = p.get("padding") or ((0, 0),) * x.ndim
    base = p.get("base_dilation") or (1,) * x.ndim
    window = p.get("window_dilation") or (1,) * x.ndim
    for d in range(x.ndim):
        if dims[d] == 1 and strides[d] == 1 and tuple(padding[d]) == (0, 0) and base[d] == 1 and window[d] == 1:
            continue
        out = reduce(out, (d,), additive=additive, keepdims=True)
    return np.broadcast_to(out, shape).astype(CODE)


def unary_elementwise(eqn: Any) -> bool:
    """An operation this module does not name that reads one operand and returns one result of
    its shape, no sub-program, and none of the known exceptions (`NOT_ELEMENTWISE`): a unary
    elementwise operation (JAX adds them over its versions: ``one_minus_square`` in 0.12)."""
    return (len(eqn.invars) == 1 and len(eqn.outvars) == 1 and eqn.primitive.name not in NOT_ELEMENTWISE
            and tuple(eqn.invars[0].aval.shape) == tuple(eqn.outvars[0].aval.shape)
            and not any(hasattr(v, "eqns") or hasattr(getattr(v, "jaxpr", None), "eqns") for v in eqn.params.values()))
