"""The training set's curvature as influence functions use it: the damped inverse (G + λI)⁻¹ of
one approximation of the GGN, applied to one example's gradient.

Each is a pytree (its arrays the leaves, its layout static), so that a fitted curvature passes
through ``jax.jit``, and each gives its eigenvalues' mean, from which the default damping is
taken (kronfluence's 0.1 × the mean eigenvalue):

- `Identity`: G + λI replaced by I (gradient dot products).
- `DiagonalCurvature`: diag G, (g ⊘ (diag G + λ)).
- `EigenCurvature`: per block (a weight with its bias, read as the [L, R] matrix [W; b]) an
  eigenbasis Q_A ⊗ Q_Γ and one eigenvalue per entry, s (K-FAC: s = a γᵀ; EK-FAC: s refitted as
  the mean square of the examples' rotated gradients, George et al. 2018):

      (G + λI)⁻¹ vec X ≈ vec(Q_A [(Q_Aᵀ X Q_Γ) ⊘ (s + λ)] Q_Γᵀ)

  and leaves without Kronecker factors by their exact GGN diagonal.
- `DenseCurvature`: G itself, eigendecomposed (small models: the reference).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from .._curvature import Kronecker
from .._optim import CurvatureBlock, Diagonal, block_matrix, split_block


def _eigh(m: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Eigenvalues (floored at 0: the matrices are Gram matrices, negatives are round-off) and
    eigenvectors of a symmetric matrix (or a stack of them)."""
    values, vectors = jnp.linalg.eigh((m + jnp.swapaxes(m, -1, -2)) / 2)
    return jnp.maximum(values, 0.0), vectors


@functools.partial(jax.tree_util.register_dataclass, data_fields=[], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Identity:
    """G + λI replaced by I: the influence of the plain gradient dot product."""

    def apply(self, g: Any, damping: jax.Array) -> Any:
        del damping
        return g

    def mean_eigenvalue(self) -> jax.Array:
        return jnp.ones(())


@functools.partial(jax.tree_util.register_dataclass, data_fields=["values"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class DiagonalCurvature:
    """diag G, shaped like the gradient: (G + λI)⁻¹ g ≈ g ⊘ (diag G + λ)."""

    values: Any

    def apply(self, g: Any, damping: jax.Array) -> Any:
        return jax.tree.map(lambda x, d: x / (d + damping), g, self.values)

    def mean_eigenvalue(self) -> jax.Array:
        leaves = jax.tree.leaves(self.values)
        return sum(jnp.sum(x) for x in leaves) / sum(x.size for x in leaves)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["bases", "values"],
                   meta_fields=["blocks", "treedef"])
@dataclasses.dataclass(frozen=True)
class EigenCurvature:
    """K-FAC's and EK-FAC's curvature: per block, its eigenbasis (Q_A, Q_Γ) and eigenvalues s
    [..., L, R] — or, for a leaf without Kronecker factors, None and its GGN diagonal.

    Attributes:
        bases: per block, (Q_A, Q_Γ), or None for a diagonal leaf.
        values: per block, s [..., L, R] (one per entry of [W; b]), or the leaf's diagonal.
        blocks: per block, (weight leaf, bias leaf or None, the bias's side) — static.
        treedef: the gradient's tree structure — static.
    """

    bases: list
    values: list
    blocks: tuple
    treedef: Any

    def _block(self, n: int) -> CurvatureBlock:
        qa, qg = self.bases[n]
        return CurvatureBlock(*self.blocks[n], (Kronecker(qa, qg),))

    def rotated(self, n: int, leaves: list) -> jax.Array:
        """Q_Aᵀ X Q_Γ of block n, X its entries in ``leaves`` (one example's gradient)."""
        qa, qg = self.bases[n]
        x = block_matrix(self._block(n), leaves)
        x = x.reshape(qa.shape[:-2] + (qa.shape[-1], qg.shape[-1]))
        return jnp.swapaxes(qa, -1, -2) @ x @ qg

    def apply(self, g: Any, damping: jax.Array) -> Any:
        leaves = self.treedef.flatten_up_to(g)
        out: list[Any] = [None] * len(leaves)
        for n, (basis, values) in enumerate(zip(self.bases, self.values)):
            if basis is None:
                leaf = self.blocks[n][0]
                out[leaf] = leaves[leaf] / (values + damping)
                continue
            qa, qg = basis
            scaled = self.rotated(n, leaves) / (values + damping)
            for m, value in split_block(self._block(n), qa @ scaled @ jnp.swapaxes(qg, -1, -2), leaves):
                out[m] = value
        return self.treedef.unflatten(out)

    def mean_eigenvalue(self) -> jax.Array:
        return sum(jnp.sum(v) for v in self.values) / sum(v.size for v in self.values)


def eigen_curvature(blocks: list[CurvatureBlock], treedef: Any) -> EigenCurvature:
    """K-FAC's curvature from `blocks_of`'s blocks: A ⊗ Γ's eigenbases and s = a γᵀ. One
    Kronecker term per block (a loss calling its network once per example)."""
    bases, values = [], []
    for block in blocks:
        if isinstance(block.curvature, Diagonal):
            bases.append(None)
            values.append(block.curvature.values)
            continue
        (left, right), = block.curvature
        (a, qa), (gamma, qg) = _eigh(left), _eigh(right)
        bases.append((qa, qg))
        values.append(a[..., :, None] * gamma[..., None, :])
    return EigenCurvature(bases, values, tuple((b.leaf, b.bias, b.side) for b in blocks), treedef)


def refitted(curvature: EigenCurvature, rows: Any, block: int = 256) -> list:
    """Σ over the rows r of K (G = Σ_r k_r k_rᵀ; a pytree with a leading axis of rows) of the
    squares of each block's rotated rows, (Q_Aᵀ K_r Q_Γ)²: G's diagonal in the eigenbasis, the
    eigenvalues EK-FAC refits (diagonal leaves: None, their diagonal is exact already). The rows
    go ``block`` at a time (zero rows pad the last: they add nothing), so the rotated rows never
    all exist at once."""
    leaves = curvature.treedef.flatten_up_to(rows)
    count = leaves[0].shape[0]
    size = min(block, count)
    steps = -(-count // size)
    padded = [jnp.pad(x, [(0, steps * size - count)] + [(0, 0)] * (x.ndim - 1)).reshape(steps, size, *x.shape[1:])
              for x in leaves]

    def squares(n: int) -> jax.Array:
        def add(total: jax.Array, chunk: list) -> tuple[jax.Array, None]:
            return total + jnp.sum(jax.vmap(lambda *row: curvature.rotated(n, list(row)) ** 2)(*chunk), axis=0), None

        return jax.lax.scan(add, jnp.zeros_like(curvature.values[n]), padded)[0]

    return [None if basis is None else squares(n) for n, basis in enumerate(curvature.bases)]


@functools.partial(jax.tree_util.register_dataclass, data_fields=["vectors", "values"],
                   meta_fields=["treedef", "shapes"])
@dataclasses.dataclass(frozen=True)
class DenseCurvature:
    """G over the gradient's entries (leaves in tree order, each row-major), eigendecomposed:
    (G + λI)⁻¹ g = V [(Vᵀ g) ⊘ (w + λ)]."""

    vectors: jax.Array
    values: jax.Array
    treedef: Any
    shapes: tuple

    def apply(self, g: Any, damping: jax.Array) -> Any:
        flat = jnp.concatenate([jnp.ravel(x) for x in self.treedef.flatten_up_to(g)])
        solved = self.vectors @ ((self.vectors.T @ flat) / (self.values + damping))
        sizes = [math.prod(s) for s in self.shapes]
        ends = [sum(sizes[:n + 1]) for n in range(len(sizes))]
        parts = jnp.split(solved, ends[:-1])
        return self.treedef.unflatten([p.reshape(s) for p, s in zip(parts, self.shapes)])

    def mean_eigenvalue(self) -> jax.Array:
        return jnp.mean(self.values)


def dense_curvature(gram: jax.Array, treedef: Any, shapes: tuple) -> DenseCurvature:
    values, vectors = _eigh(gram)
    return DenseCurvature(vectors, values, treedef, shapes)


def flattened(per_example: Any) -> jax.Array:
    """[B, P]: each example's gradient (a pytree with a leading axis B) as one row, its leaves
    in tree order, each row-major."""
    leaves = jax.tree.leaves(per_example)
    batch = leaves[0].shape[0]
    return jnp.concatenate([x.reshape(batch, -1) for x in leaves], axis=1)
