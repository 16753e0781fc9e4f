"""A convolution's kernel cotangent as a product of patches, so that K-FAC factors it as it
factors a dense layer (Grosse & Martens' KFC).

For one example, a convolution y = conv(x, W) reads at each output position t the patch p_t of x
its window covers (the input channels and the window's offsets, dilated, strided, padded):
y_t = p_tᵀ W, W read as a [patch size, output channels] matrix. Its kernel cotangent is then a
sum of outer products over the positions,

    W̄ = Σ_t p_t ȳ_tᵀ = Pᵀ Ȳ          (P [positions, patch size], Ȳ [positions, channels])

— what JAX's transpose rule computes as one convolution of x with ȳ (the roles of batch and
features swapped, strides and dilations exchanged). `patch_products` rewrites such equations of
a per-example VJP as the patches P of x (im2col: strided slices of the padded input, one per
window offset, at the forward convolution's strides, dilations and padding) and one
``dot_general`` of P with ȳ over the examples' and the positions' axes, then a reshape to the
kernel's layout: a product the
K-FAC machinery reads as it reads x_bᵀ y_b of a dense layer (A = Σ p pᵀ over examples and
positions, Γ = Σ ȳ ȳᵀ; a bias summed over the positions joins the block with a ones column).
The values are the same; only the form changes.

Handled: any number of spatial axes, window strides, padding, lhs and rhs dilation, any layout
whose kernel has its output-channel axis first or last (HWIO, OIHW, …). Left as they are (their
leaves take the GGN diagonal): feature or batch groups (a depthwise convolution's blocks are
per group), output-channel axes in the middle of the kernel.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Literal

from .._graph import evaluate
from ._outer_products import depending


def patch_products(closed: Any, example_args: list, varying: list[bool]) -> Any:
    """The jaxpr of a per-example VJP (``closed``, at ``example_args``) with the kernel cotangents
    of its convolutions (a ``conv_general_dilated`` of a λ-free input with an operand moving with
    the ``varying`` arguments) computed as patches times the output cotangent
    (`as_patch_product`); ``closed`` itself where there are none (the VJP is traced once)."""
    moving = depending(closed.jaxpr, varying)
    chosen = {id(eqn) for eqn in closed.jaxpr.eqns if _kernel_cotangent(eqn, moving)}
    if not chosen:
        return closed

    def rule(eqn: Any, ins: list) -> list | None:
        if id(eqn) not in chosen:
            return None
        product = as_patch_product(eqn.params, tuple(eqn.outvars[0].aval.shape), *ins)
        return None if product is None else [product]

    return jax.make_jaxpr(lambda *args: evaluate(closed.jaxpr, closed.consts, args, rule=rule))(*example_args)


def _kernel_cotangent(eqn: Any, moving: set) -> bool:
    """A convolution of a λ-free operand (the layer's input) with one moving with the adjoint
    (the output's cotangent), without groups: the form of a kernel's cotangent."""
    if eqn.primitive.name != "conv_general_dilated":
        return False
    if eqn.params["feature_group_count"] != 1 or eqn.params["batch_group_count"] != 1:
        return False
    x, g = eqn.invars
    return (not isinstance(x, Literal) and x not in moving) and (not isinstance(g, Literal) and g in moving)


def _swapped(spec: tuple[int, ...]) -> tuple[int, ...]:
    """A dimension spec with its first two entries exchanged (JAX's transpose rule's
    ``_conv_spec_transpose``: batch ↔ feature, output ↔ input channels)."""
    return (spec[1], spec[0], *spec[2:])


def as_patch_product(params: dict, kernel_shape: tuple[int, ...], x: jax.Array, g: jax.Array) -> jax.Array | None:
    """The kernel cotangent conv(x, ȳ) that JAX's transpose rule forms, as Pᵀ Ȳ: P the patches of
    x, Ȳ = ``g`` the output's cotangent. None where the kernel's output-channel axis is neither
    first nor last, or the patches do not come out shaped as ``g``.

    The transpose rule's parameters are the forward convolution's, exchanged: its window strides
    are the forward rhs dilation and its rhs dilation the forward strides, the lhs dilation and
    the low padding are the forward ones, and its dimension specs are the forward input's,
    output's and kernel's with batch and features swapped. The forward high padding is the
    smallest that gives ``g``'s number of positions (more would only add positions dropped)."""
    lhs_t, rhs_t, out_t = params["dimension_numbers"]
    lhs_spec, out_spec, kernel_spec = _swapped(lhs_t), _swapped(rhs_t), _swapped(out_t)
    out_channels = kernel_spec[0]
    ndim = len(kernel_shape)
    if out_channels not in (0, ndim - 1):
        return None
    strides, rhs_dilation, lhs_dilation = params["rhs_dilation"], params["window_strides"], params["lhs_dilation"]
    positions = [g.shape[out_spec[2 + k]] for k in range(len(strides))]
    padding = []
    for k, (lo, _) in enumerate(params["padding"]):
        size_in = (x.shape[lhs_spec[2 + k]] - 1) * lhs_dilation[k] + 1
        window = (kernel_shape[kernel_spec[2 + k]] - 1) * rhs_dilation[k] + 1
        padding.append((lo, (positions[k] - 1) * strides[k] + window - size_in - lo))
    patches = _patches(x, lhs_spec, out_spec, kernel_spec, kernel_shape, strides, padding, lhs_dilation,
                       rhs_dilation, positions)
    if patches is None:
        return None
    size = math.prod(n for d, n in enumerate(kernel_shape) if d != out_channels)
    features = out_spec[1]
    if tuple(patches.shape) != tuple(size if d == features else n for d, n in enumerate(g.shape)):
        return None
    contracted = tuple(d for d in range(g.ndim) if d != features)
    operands = (patches, g) if out_channels == ndim - 1 else (g, patches)
    product = lax.dot_general(*operands, ((contracted, contracted), ((), ())), precision=params.get("precision"),
                              preferred_element_type=params.get("preferred_element_type"))
    return product.reshape(kernel_shape)


def _patches(x: jax.Array, lhs_spec: tuple, out_spec: tuple, kernel_spec: tuple, kernel_shape: tuple,
             strides: tuple, padding: list, lhs_dilation: tuple, rhs_dilation: tuple,
             positions: list) -> jax.Array | None:
    """The patches of ``x`` the forward convolution's window reads (im2col: strided slices of the
    padded, dilated input, one per window offset — copies, no arithmetic), laid out as the
    output: its batch and spatial axes where the output has them, its feature axis the patch's
    entries, ordered as the kernel's axes other than its output channels, row-major."""
    spatial = len(strides)
    canonical = jnp.transpose(x, lhs_spec)  # [N, C, spatial…]
    low_high_interior = [(0, 0, 0), (0, 0, 0)] + [(lo, hi, d - 1) for (lo, hi), d in zip(padding, lhs_dilation)]
    padded = lax.pad(canonical, jnp.zeros((), x.dtype), low_high_interior)
    window = [kernel_shape[kernel_spec[2 + k]] for k in range(spatial)]
    taken = []
    for offset in itertools.product(*(range(w) for w in window)):
        start = [0, 0, *(o * d for o, d in zip(offset, rhs_dilation))]
        limit = [*padded.shape[:2], *((b + (p - 1) * s + 1) for b, p, s in zip(start[2:], positions, strides))]
        if any(end > n for end, n in zip(limit, padded.shape)):
            return None  # not the window of a convolution with these positions
        taken.append(lax.slice(padded, start, limit, (1, 1, *strides)))
    stacked = jnp.stack(taken, axis=2).reshape(*padded.shape[:2], *window, *positions)  # [N, C, window…, P…]
    # the patch's axes in the kernel's order: the input channels (axis 1) and the window's (2 + k)
    role = {kernel_spec[1]: 1, **{kernel_spec[2 + k]: 2 + k for k in range(spatial)}}
    order = [role[d] for d in range(len(kernel_shape)) if d != kernel_spec[0]]
    ordered = jnp.transpose(stacked, [0, *order, *range(2 + spatial, 2 + 2 * spatial)])
    flat = ordered.reshape(stacked.shape[0], -1, *positions)  # [N, K, P…]: the output's canonical layout
    return jnp.transpose(flat, np.argsort(out_spec))
