"""Samples of H's per-example blocks for the sampled curvature (``samples=M``): a rank-one term
of a diagonally dominant block read off its entries (no factorisation), else a Gaussian through
the block's Cholesky root.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from .._graph import sharded_as

# up to this many coordinates a block's Cholesky factor is formed column by column over the whole
# batch at once, where LAPACK is called once per example (`python benchmarks/profile.py roots`:
# 1,797 blocks of 4 × 4 0.35 → 0.14 ms, of 6 × 6 0.66 → 0.32 ms); from about 10 the unrolled
# columns gain less than they take to compile (1.3 s at 10; 3.9 s at 32, slower than LAPACK from 20)
SMALL_BLOCK = 6


def block_roots(h: jax.Array) -> jax.Array:
    """Per block of h [B, ..., C, C], R [B, ..., C, C] with R Rᵀ = H + δ I (Cholesky), δ =
    2 C ε (max_b' diag H_b' + max diag H_b): round-off at the batch's scale and at the
    example's. A block whose Cholesky fails is first made diagonally dominant, each diagonal
    entry raised to its row's off-diagonal sum H_ii ← max(H_ii, Σ_j≠i |H_ij|), then factored
    the same way — no eigendecomposition (a batch of ``eigh`` costs as much as several
    gradients). For softmax cross-entropy that is H's exact diagonal (H 1 = 0: H_ii = p_i(1 −
    p_i) = Σ_j≠i p_i p_j), which float32 loses to cancellation once an example's softmax
    saturates, while its off-diagonal products stay accurate. For a block that is indefinite
    in fact it is a positive semi-definite surrogate above H (the exact ``samples=None``
    path keeps H's eigenvalues as they are). What is still not finite (a NaN in H) takes the
    square root of its diagonal's positive part."""
    return jnp.moveaxis(_root(jnp.moveaxis(h.reshape(-1, *h.shape[-2:]), 0, -1)), -1, 0).reshape(h.shape)


def _round_off(h: jax.Array) -> jax.Array:
    """δ_b of `block_roots` for blocks h [N, C, C]: 2 C ε (max_b' diag H_b' + max diag H_b) —
    round-off of a sum of C entries at the batch's scale and at the example's (a NaN block does
    not set the batch's scale). At ε, not √ε: in float32 C √ε · max diag was 3.4 % of the largest
    entry for C = 98, and the dominance test (`block_sampler`) C times that, which took
    non-dominant blocks for dominant ones and sampled H + diag(deficit)."""
    coords, eps = h.shape[-1], jnp.finfo(h.dtype).eps
    largest = jnp.max(jnp.diagonal(h, axis1=-2, axis2=-1), axis=-1)
    batch_scale = jnp.max(jnp.where(jnp.isfinite(largest), largest, 0))
    return 2 * coords * eps * (batch_scale + largest) + jnp.finfo(h.dtype).tiny


def block_sampler(h: jax.Array) -> Callable[[jax.Array], jax.Array]:
    r"""``draw(key)``: for blocks h [B, ..., C, C], one sample s of each block with
    E[s sᵀ] = H, [B, ... · C] (blocks after the batch: each drawn independently, flattened).
    Where the group's blocks are diagonally dominant — softmax cross-entropy's
    c(diag p − ppᵀ) (off-diagonals ≤ 0, rows summing to 0), squared errors' c I, any one
    output — H_b is a sum of rank-one terms read off its entries,

    $$H = \sum_{i<j} |H_{ij}|\,(e_i + \sigma_{ij} e_j)(e_i + \sigma_{ij} e_j)^T
          + \sum_i \Big(H_{ii} - \sum_{j \ne i} |H_{ij}|\Big)\, e_i e_i^T, \qquad
          \sigma_{ij} = \operatorname{sign} H_{ij},$$

    and s_b = ±√W_b v_t is one term t drawn with probability w_t / W_b (W_b the weights'
    sum, v_t its vector) and a random sign (E[s_b] = 0, so samples of blocks that meet in
    one product, the positions of a shared weight, do not correlate): one uniform per
    example and no factorisation, as kfac-jax's one sampled label per example (s = √c (p −
    e_y), y ~ p, for cross-entropy). A negative excess counts as 0 — round-off, as float32
    cross-entropy's diagonal once the softmax saturates — where `block_roots` would sample
    nothing closer to H_b: where the excesses raised to 0 add no more to the trace than
    their shift δ_b I (C δ_b), or where H_b + δ_b I is not positive definite (1ᵀH_b 1 < −C
    δ_b, a Rayleigh quotient below −δ_b), which `block_roots` raises to dominance too. Otherwise
    (`lax.cond`: one branch runs) s = R_b z, z ~ N(0, I), with `block_roots`. For a
    block with zero excess ‖s_b‖² = tr H_b at every draw (a Gaussian's varies), and one
    output's sample is its exact root."""
    batch, coords = h.shape[0], h.shape[-1]
    flat = h.reshape(-1, coords, coords)
    at = jnp.arange(coords)
    magnitude = jnp.where(at[:, None] == at, 0, jnp.abs(flat))
    excess = jnp.diagonal(flat, axis1=-2, axis2=-1) - jnp.sum(magnitude, axis=-1)
    # a block's terms sample it raised to dominance (each negative excess taken as 0); where that
    # adds no more to its trace than the Cholesky's shift δ_b I, or where H_b + δ_b I is not
    # positive definite (1ᵀH_b 1 / C < −δ_b: `block_roots` would raise it to dominance as well), the
    # terms sample what the roots would; else the group takes the roots (False for a NaN)
    shift = coords * _round_off(flat)
    dominant = jnp.all((jnp.sum(jnp.maximum(-excess, 0), axis=-1) <= shift) | (jnp.sum(flat, axis=(1, 2)) < -shift))
    # the terms of row i: (i, j) for j > i weighing |H_ij|, and (i, i) the excess
    spare = jnp.maximum(excess, 0)
    row_weights = jnp.sum(jnp.where(at[:, None] < at, magnitude, 0), axis=-1) + spare
    row_upto = jnp.cumsum(row_weights, axis=-1)
    total = row_upto[:, -1]
    roots = jax.lax.cond(dominant, lambda: jnp.zeros_like(flat), lambda: block_roots(flat))  # only where needed

    def by_terms(key: jax.Array) -> jax.Array:
        # P(term) = w / W by the inverse CDF in two stages — row i from the running row sums, then
        # the term within row i at the same uniform's remainder (uniform there) — and the
        # uniform's second half draws −v: E[s] = 0, so samples of blocks that meet in one
        # product (positions of a shared weight, groups) do not correlate
        doubled = sharded_as(jax.random.uniform(key, total.shape, h.dtype), total) * (2 * total)  # total's sharding
        flip = doubled >= total
        u = jnp.where(flip, doubled - total, doubled)
        i = jnp.minimum(jnp.sum(row_upto <= u[:, None], axis=-1), coords - 1)
        pick = lambda x: jnp.take_along_axis(x, i[:, None], axis=-1)[:, 0]
        rest = u - pick(row_upto) + pick(row_weights)
        row = jnp.take_along_axis(flat, i[:, None, None], axis=1)[:, 0]  # H_i·
        terms = jnp.where(at > i[:, None], jnp.abs(row), jnp.where(at == i[:, None], pick(spare)[:, None], 0))
        j = jnp.clip(jnp.sum(jnp.cumsum(terms, axis=-1) <= rest[:, None], axis=-1), i, coords - 1)
        sign = jnp.where(i != j, jnp.sign(jnp.take_along_axis(row, j[:, None], axis=-1)[:, 0]), 0)  # σ_ij
        v = (at == i[:, None]) + sign[:, None] * (at == j[:, None])
        return (jnp.where(flip, -1, 1) * jnp.sqrt(total))[:, None] * v.astype(h.dtype)

    def by_roots(key: jax.Array) -> jax.Array:
        return jnp.einsum("nij,nj->ni", roots, sharded_as(jax.random.normal(key, flat.shape[:-1], h.dtype),
                                                          flat[..., 0]))

    def draw(key: jax.Array) -> jax.Array:
        return jax.lax.cond(dominant, by_terms, by_roots, key).reshape(batch, -1)

    draw.roots = roots  # what a next group's factorisation waits on (`_graph.in_turn`)
    return draw


def _root(h: jax.Array) -> jax.Array:
    """`block_roots` of one group's blocks, the examples on the last axis: h [C, C, B]
    (each step below one vectorised operation over all examples: with the examples first, the
    shifts, checks and repairs of the 1,797 10 × 10 blocks of the digits MLP took 0.2–0.6 ms
    longer)."""
    coords = h.shape[0]
    eye = jnp.eye(coords, dtype=h.dtype)[:, :, None]
    diagonal = jnp.diagonal(h, axis1=0, axis2=1).T  # [C, B]

    def factor(h: jax.Array) -> tuple[jax.Array, jax.Array]:
        shift = _round_off(jnp.moveaxis(h, -1, 0))
        chol = _cholesky(h + shift * eye)
        return chol, jnp.all(jnp.isfinite(chol), axis=(0, 1))

    chol, ok = factor(h)

    def repair() -> tuple[jax.Array, jax.Array]:
        off = jnp.sum(jnp.abs(h), axis=1) - jnp.abs(diagonal)
        return factor(h + eye * jnp.maximum(off - diagonal, 0.0)[:, None, :])

    repaired, repaired_ok = jax.lax.cond(jnp.all(ok), lambda: (chol, ok), repair)
    fallback = eye * jnp.sqrt(jnp.maximum(diagonal, 0.0))[:, None, :]
    return jnp.where(ok, chol, jnp.where(repaired_ok, repaired, fallback))


def _cholesky(a: jax.Array) -> jax.Array:
    """Lower L with L Lᵀ = a for symmetric matrices [C, C, B] (the examples last), NaN where one
    is not positive definite (as ``jnp.linalg.cholesky``). Small blocks column by column in
    Crout's order, each step over all examples at once."""
    coords = a.shape[0]
    if coords > SMALL_BLOCK:
        return jnp.moveaxis(jnp.linalg.cholesky(jnp.moveaxis(a, -1, 0)), 0, -1)
    columns: list[jax.Array] = []
    for j in range(coords):
        v = a[j:, j]
        for done in columns:  # column j of h less what the earlier columns of L account for
            v = v - done[j:] * done[j]
        columns.append(jnp.concatenate([jnp.zeros_like(a[:j, j]), v / jnp.sqrt(v[0])]))  # sharded as a
    return jnp.stack(columns, axis=1)
