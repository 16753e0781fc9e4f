r"""K-FAC's preconditioner, shared by `scale_by_kfac` and `kfac`: the factors averaged over steps,
their damped inverses held for ``update_every`` steps, and the preconditioned gradient
$(\bar F + \lambda I)^{-1} g$ block by block.

Two averages, each as published: `kfac`'s is kfac-jax's bias-corrected weighted average
$\bar F_t = \sum_k d^k F_{t-k} / \sum_k d^k$ (the first step's average is its own factors, and a
batch whose factors are not finite is left out); `scale_by_kfac`'s the exponential moving average
$\bar F_t = d\,\bar F_{t-1} + (1 - d)\, F_t$ from $\bar F_1 = F_1$.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .._curvature import Kronecker
from ._blocks import CurvatureBlock, block_matrix, blockwise
from ._kronecker import apply, decompose, decompose_all


def all_finite(tree: Any) -> jax.Array:
    """Whether every entry of every leaf of ``tree`` is finite (True for no leaves)."""
    leaves = jax.tree.leaves(tree)
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])) if leaves else jnp.asarray(True)


class FactorAverage(NamedTuple):
    """kfac-jax's weighted average: the decayed sums $\\sum_k d^k F_{t-k}$ and $\\sum_k d^k$."""

    sums: Any
    weight: jax.Array

    @classmethod
    def zeros(cls, fresh: list, dtype: Any) -> FactorAverage:
        return cls(jax.tree.map(jnp.zeros_like, fresh), jnp.zeros((), dtype))

    def add(self, fresh: list, decay: float) -> FactorAverage:
        """The sums with this step's factors; factors that are not finite are left out (and
        ``eigh`` never sees a NaN: LAPACK's iterations need not end on one)."""
        finite = all_finite(fresh)
        sums = jax.tree.map(lambda s, f: jnp.where(finite, decay * s + f, s), self.sums, fresh)
        return FactorAverage(sums, jnp.where(finite, decay * self.weight + 1, self.weight))

    def average(self) -> list:
        return jax.tree.map(lambda s: s / jnp.maximum(self.weight, 1e-30).astype(s.dtype), self.sums)


def moving_average(old: list | None, fresh: list, decay: float) -> list:
    """$d\\,\\bar F + (1 - d) F$, or the fresh factors where there is no average yet."""
    if old is None:
        return fresh
    return jax.tree.map(lambda o, f: decay * o + (1 - decay) * f, old, fresh)


def _terms(curvature: Any) -> Any:
    """A block's curvature as `decompose` takes it: a diagonal, or a tuple of Kronecker terms."""
    return (curvature,) if isinstance(curvature, Kronecker) else curvature


class Preconditioner(NamedTuple):
    """The damped inverses of averaged curvatures (``factored``: one term's factors damped apart
    and inverted by Cholesky; else λ added exactly to their eigendecompositions), and the
    direction they give."""

    factored: bool

    def decompose(self, averaged: list, damping: jax.Array) -> list:
        """Every block's decomposition (`_kronecker.decompose_all`: equal shapes together)."""
        return decompose_all([_terms(c) for c in averaged], damping, self.factored)

    def placeholders(self, averaged: list, damping: jax.Array) -> list:
        """Zero decompositions of the right shapes (a state's structure before the first)."""
        shapes = jax.eval_shape(lambda c: [decompose(_terms(x), damping, self.factored) for x in c], averaged)
        return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)

    def refreshed(self, averaged: list, held: list | None, damping: jax.Array, now: jax.Array | bool) -> list:
        """Fresh decompositions where ``now``, else the ``held`` ones. A decomposition of averages
        that are not finite (an overflow), or with results that are not, is not taken: the held
        one serves."""
        if held is None:
            return self.decompose(averaged, damping)

        def fresh_or_held() -> list:
            new = self.decompose(averaged, damping)
            ok = all_finite(averaged) & all_finite(new)
            return jax.tree.map(lambda n, h: jnp.where(ok, n, h), new, held)

        return jax.lax.cond(now, fresh_or_held, lambda: held)

    @staticmethod
    def direction(blocks: list[CurvatureBlock], leaves: list[jax.Array], inverses: list, damping: jax.Array) -> list:
        """$(\\bar F + \\lambda I)^{-1} g$ per leaf: each block's inverse applied to its matrix
        (a weight with its bias as one more row)."""
        return blockwise(blocks, leaves, [apply(inv, block_matrix(block, leaves), damping)
                                          for inv, block in zip(inverses, blocks)])

