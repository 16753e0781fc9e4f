"""The blocks K-FAC preconditions: a weight leaf with its Kronecker terms — its bias joined to it
where [`kfac_factors`][linbackprop.kfac_factors] put a [`BiasOf`][linbackprop.BiasOf] there — or
a leaf with its GGN diagonal (the array ``kfac_factors`` gives there, or ``diagonal=``'s where
the factors have None); and the gradient read as each block's matrix and back.

A joint block of W ([..., in, out] read row-major as the λ-free factor's side first) and its bias
b ([..., out]) is the matrix [W; b] ([..., in + 1, out]: ``side="left"``), or [W, b] ([..., out,
in + 1]) where the ones column is in the right factor.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .._curvature import BiasOf, Kronecker, is_factor
from ._kronecker import Curvature, Diagonal


class CurvatureBlock(NamedTuple):
    """One preconditioned block: the weight's (or lone leaf's) index among the gradient's leaves,
    its bias's index (None without), the side of the bias's row, and the curvature."""

    leaf: int
    bias: int | None
    side: str | None
    curvature: Curvature


def blocks_of(grad: Any, factors: Any, diagonal: Any, name: str) -> list[CurvatureBlock]:
    """The blocks covering every leaf of ``grad`` once, in order of their first leaf. ``name``:
    the transform asking (for its errors)."""
    paths = jax.tree_util.tree_flatten_with_path(grad)[0]
    keys = [jax.tree_util.keystr(path) for path, _ in paths]
    flat_factors = jax.tree.flatten(factors, is_leaf=is_factor)[0]
    if len(flat_factors) != len(paths):
        raise ValueError(f"{name}: factors has {len(flat_factors)} leaves, the gradient {len(paths)}; pass "
                         "factors=lbp.kfac_factors(loss)(params, *batch) for the same parameters.")
    flat_diag = [None] * len(paths) if diagonal is None else jax.tree.leaves(diagonal, is_leaf=lambda x: x is None)
    if len(flat_diag) != len(paths):
        raise ValueError(f"{name}: diagonal has {len(flat_diag)} leaves, the gradient {len(paths)}; pass "
                         "diagonal=lbp.diag_ggn(loss)(params, *batch).")
    bias_of = {}
    for n, f in enumerate(flat_factors):
        if isinstance(f, BiasOf):  # the block kfac_factors decided: the weight's index among its leaves
            if f.leaves != len(flat_factors) or not isinstance(flat_factors[f.leaf], (Kronecker, tuple)):
                raise ValueError(f"{name}: {keys[n]} is the bias of {f.weight} (leaf {f.leaf} of {f.leaves}), which "
                                 f"has no Kronecker factors among these {len(flat_factors)} leaves; pass the whole "
                                 "factors=lbp.kfac_factors(loss)(params, *batch) for the same parameters.")
            bias_of[f.leaf] = (n, f.side)
    out = []
    for n, ((_, g), f, d) in enumerate(zip(paths, flat_factors, flat_diag)):
        if isinstance(f, BiasOf):
            continue
        if not isinstance(f, (Kronecker, tuple)):  # kfac_factors' diagonal of the leaf, or diagonal='s
            values = d if f is None else f
            if values is None:
                raise ValueError(f"{name}: {keys[n]} has no Kronecker factors (not a dense product); pass its GGN "
                                 "diagonal: diagonal=lbp.diag_ggn(loss)(params, *batch).")
            if jnp.shape(values) != jnp.shape(g):
                raise ValueError(f"{name}: the diagonal of {keys[n]} has shape {jnp.shape(values)}, the leaf "
                                 f"{jnp.shape(g)}.")
            out.append(CurvatureBlock(n, None, None, Diagonal(jnp.asarray(values))))
            continue
        terms = (f,) if isinstance(f, Kronecker) else tuple(f)
        bias, side = bias_of.get(n, (None, None))
        size = jnp.size(g) + (0 if bias is None else jnp.size(paths[bias][1]))
        for term in terms:
            rows = term.left.shape[:-2]
            if term.right.shape[:-2] != rows or size != math.prod(rows + (term.left.shape[-1], term.right.shape[-1])):
                with_bias = "" if bias is None else f" with its bias {keys[bias]} {jnp.shape(paths[bias][1])}"
                raise ValueError(f"{name}: the factors of {keys[n]} ({term.left.shape}, {term.right.shape}) do not "
                                 f"match its shape {jnp.shape(g)}{with_bias}.")
        out.append(CurvatureBlock(n, bias, side, terms))
    return out


def block_matrix(block: CurvatureBlock, leaves: list[jax.Array]) -> jax.Array:
    """The block's entries: the leaf as it is, or [W; b] / [W, b] as a [..., L, R] matrix."""
    g = leaves[block.leaf]
    if block.bias is None:
        return g
    left, right = block.curvature[0]
    rows = left.shape[:-2]
    b = leaves[block.bias]
    if block.side == "left":
        return jnp.concatenate([g.reshape(*rows, left.shape[-1] - 1, right.shape[-1]),
                                b.reshape(*rows, 1, right.shape[-1])], axis=-2)
    return jnp.concatenate([g.reshape(*rows, left.shape[-1], right.shape[-1] - 1),
                            b.reshape(*rows, left.shape[-1], 1)], axis=-1)


def split_block(block: CurvatureBlock, matrix: jax.Array, leaves: list[jax.Array]) -> list[tuple[int, jax.Array]]:
    """(index, value) of the block's leaves from its matrix (shaped as ``leaves``)."""
    if block.bias is None:
        return [(block.leaf, matrix.reshape(jnp.shape(leaves[block.leaf])))]
    if block.side == "left":
        w, b = matrix[..., :-1, :], matrix[..., -1:, :]
    else:
        w, b = matrix[..., :-1], matrix[..., -1:]
    return [(block.leaf, w.reshape(jnp.shape(leaves[block.leaf]))),
            (block.bias, b.reshape(jnp.shape(leaves[block.bias])))]


def blockwise(blocks: list[CurvatureBlock], leaves: list[jax.Array], per_block: list[jax.Array]) -> list[jax.Array]:
    """The gradient's leaves from each block's matrix (``per_block``, in the order of ``blocks``)."""
    out: list[Any] = [None] * len(leaves)
    for block, matrix in zip(blocks, per_block, strict=True):
        for n, value in split_block(block, matrix, leaves):
            out[n] = value
    return out
