"""K-FAC's curvature of one parameter leaf and its damped inverse: a sum of Kronecker products
(one per term of the loss) or a diagonal, decomposed once and applied with the damping of the
step.

One term, F = A ⊗ Γ with A = Q_A diag(a) Q_Aᵀ and Γ = Q_Γ diag(γ) Q_Γᵀ (``eigh``):

    (A ⊗ Γ + λI)⁻¹ vec X = vec(Q_A [(Q_Aᵀ X Q_Γ) ⊘ (a γᵀ + λ)] Q_Γᵀ)

— λ added exactly, and, since λ enters only the elementwise division, the decomposition holds
while λ adapts every step. Two terms, F = A ⊗ B + C ⊗ D (a PINN's interior and boundary), are
diagonalised simultaneously (Martens & Grosse 2015, appendix B): with the damped factors A', C'
(and B', D'), K₁ = A'^{-1/2} E₁ from A'^{-1/2} C' A'^{-1/2} = E₁ diag(s₁) E₁ᵀ (K₂, s₂ from B', D'),

    (A' ⊗ B' + C' ⊗ D')⁻¹ vec X = vec(K₁ [(K₁ᵀ X K₂) ⊘ (s₁ s₂ᵀ + 1)] K₂ᵀ),

the damping split over the terms and factors as Tikhonov's π-scaled √(λ/2) (the cross terms it
adds are positive semi-definite: the damped sum is ⪰ F + λI); this λ is the one of the step that
decomposed. More terms: the second and later are merged into one Kronecker product, (mean of
their A) ⊗ (sum of their Γ) — exact where they share A — and the pair inverted as above.

Factored (one term, ``factored=True``; `scale_by_kfac`'s, and `kfac(inverse="factored")`'s, as
kfac-jax by default): (A + π√λ I)⁻¹ X (Γ + √λ/π I)⁻¹ with both inverses by Cholesky — much
cheaper than ``eigh`` on a large factor, but λ is the one of the step that decomposed and the
cross terms π√λ I ⊗ Γ + A ⊗ (√λ/π) I are added to the damping.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from .._curvature import Kronecker
from .._graph import in_turn


class Diagonal(NamedTuple):
    """A leaf without Kronecker factors: its GGN diagonal (``diagonal=lbp.diag_ggn(...)``)."""

    values: jax.Array


class EigenPair(NamedTuple):
    """One Kronecker term's eigendecompositions: A = Q_A diag(a) Q_Aᵀ, Γ = Q_Γ diag(γ) Q_Γᵀ."""

    left_vectors: jax.Array
    left_values: jax.Array
    right_vectors: jax.Array
    right_values: jax.Array


class FactoredPair(NamedTuple):
    """One Kronecker term's factors damped apart and inverted: (A + π√λ I)⁻¹ and (Γ + √λ/π I)⁻¹
    (Martens & Grosse's factored Tikhonov damping, kfac-jax's default; Cholesky, not ``eigh``)."""

    left_inverse: jax.Array
    right_inverse: jax.Array


class JointPair(NamedTuple):
    """Two damped Kronecker terms diagonalised together: K₁, s₁ (left side), K₂, s₂ (right)."""

    left_basis: jax.Array
    left_values: jax.Array
    right_basis: jax.Array
    right_values: jax.Array


Curvature = tuple[Kronecker, ...] | Diagonal
Inverse = EigenPair | FactoredPair | JointPair | Diagonal


def symmetric(m: jax.Array) -> jax.Array:
    return (m + jnp.swapaxes(m, -1, -2)) / 2


def _eigh(m: jax.Array) -> tuple[jax.Array, jax.Array]:
    # LAPACK's iterations need not end on a NaN or an infinity: such entries never reach it
    values, vectors = jnp.linalg.eigh(symmetric(jnp.where(jnp.isfinite(m), m, 0)))
    return jnp.maximum(values, 0.0), vectors  # factors are Gram matrices: negative values are round-off


def _mean_trace(m: jax.Array) -> jax.Array:
    return jnp.trace(m, axis1=-2, axis2=-1) / m.shape[-1]


def _damped(term: Kronecker, share: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A + π√s I and Γ + (√s/π) I, π² = (tr A / dim A) / (tr Γ / dim Γ): Tikhonov damping s
    split between the factors in proportion to their scales (Martens & Grosse, section 6.3)."""
    left, right = term
    tiny = jnp.finfo(left.dtype).tiny
    pi = jnp.sqrt(jnp.maximum(_mean_trace(left), tiny) / jnp.maximum(_mean_trace(right), tiny))[..., None, None]
    root = jnp.sqrt(share)
    eye = lambda m: jnp.eye(m.shape[-1], dtype=m.dtype)
    return left + pi * root * eye(left), right + root / pi * eye(right)


def _joint(first: jax.Array, second: jax.Array) -> tuple[jax.Array, jax.Array]:
    """K, s with Kᵀ first K = I and Kᵀ second K = diag(s) (first positive definite)."""
    values, vectors = _eigh(first)
    # a damped factor is positive definite; its smallest eigenvalues floored at round-off of the largest
    floor = values.shape[-1] * jnp.finfo(values.dtype).eps * jnp.max(values, axis=-1, keepdims=True)
    values = jnp.maximum(values, jnp.maximum(floor, jnp.finfo(values.dtype).tiny))
    root_inverse = (vectors / jnp.sqrt(values)[..., None, :]) @ jnp.swapaxes(vectors, -1, -2)
    s, e = _eigh(root_inverse @ second @ root_inverse)
    return root_inverse @ e, s


def _spd_inverse(m: jax.Array) -> jax.Array:
    """A damped factor's inverse by Cholesky (its symmetric part: round-off may break the symmetry)."""
    eye = jnp.broadcast_to(jnp.eye(m.shape[-1], dtype=m.dtype), m.shape)
    return jax.scipy.linalg.cho_solve(jax.scipy.linalg.cho_factor(symmetric(m)), eye)


def decompose(curvature: Curvature, damping: jax.Array, factored: bool = False) -> Inverse:
    """The decomposition `apply` uses. ``damping`` enters where terms are two or more, and with
    ``factored`` (one term: its factors damped apart, π-scaled, and inverted by Cholesky);
    otherwise `apply` adds it exactly."""
    if isinstance(curvature, Diagonal):
        return curvature
    if len(curvature) == 1 and factored:
        left, right = _damped(curvature[0], damping)
        return FactoredPair(*in_turn(_spd_inverse, [left, right]))  # LAPACK's calls in turn
    if len(curvature) == 1:
        (left, right), = curvature
        (a, qa), (g, qg) = in_turn(_eigh, [left, right])  # LAPACK's calls in turn (`_graph._in_turn`)
        return EigenPair(qa, a, qg, g)
    first, rest = curvature[0], curvature[1:]
    if len(rest) > 1:
        rest = (Kronecker(sum(t.left for t in rest) / len(rest), sum(t.right for t in rest)),)
    share = damping / 2
    a, b = _damped(first, share)
    c, d = _damped(rest[0], share)
    (k1, s1), (k2, s2) = in_turn(lambda pair: _joint(*pair), [(a, c), (b, d)])
    return JointPair(k1, s1, k2, s2)


def decompose_all(curvatures: list, damping: jax.Array, factored: bool = False) -> list:
    """`decompose` of every block's curvature, the exact one-term blocks' factors of equal shape
    eigendecomposed together (one batched ``eigh`` per shape: the MLP's 129 × 129 and 128 × 128
    pairs), LAPACK's calls one after another (`in_turn`)."""
    single = [i for i, c in enumerate(curvatures) if not factored and not isinstance(c, Diagonal) and len(c) == 1]
    out = dict(zip((i for i in range(len(curvatures)) if i not in single),
                   in_turn(lambda c: decompose(c, damping, factored),
                           [c for i, c in enumerate(curvatures) if i not in single])))
    by_shape: dict[tuple, list[tuple[int, int]]] = {}
    for i in single:
        for side, m in enumerate(curvatures[i][0]):
            by_shape.setdefault((m.shape, m.dtype), []).append((i, side))
    groups = list(by_shape.values())
    eighs = in_turn(lambda ms: _eigh(jnp.stack(ms)), [[curvatures[i][0][side] for i, side in g] for g in groups])
    parts: dict[tuple[int, int], tuple[jax.Array, jax.Array]] = {}
    for g, (values, vectors) in zip(groups, eighs):
        for n, where in enumerate(g):
            parts[where] = values[n], vectors[n]
    for i in single:
        (a, qa), (gamma, qg) = parts[i, 0], parts[i, 1]
        out[i] = EigenPair(qa, a, qg, gamma)
    return [out[i] for i in range(len(curvatures))]


def apply(inverse: Inverse, g: jax.Array, damping: jax.Array) -> jax.Array:
    """(F + λI)⁻¹ g for one leaf ``g`` (read as [..., dim A, dim Γ] row-major)."""
    if isinstance(inverse, Diagonal):
        return g / (inverse.values + damping)
    if isinstance(inverse, FactoredPair):  # λ inside the damped factors
        left, right = inverse
        return (left @ g.reshape(left.shape[:-2] + (left.shape[-1], right.shape[-1])) @ right).reshape(g.shape)
    if isinstance(inverse, EigenPair):  # λ exactly, as it is now
        left, right, shift = inverse.left_vectors, inverse.right_vectors, damping
    else:  # λ inside the damped factors
        left, right, shift = inverse.left_basis, inverse.right_basis, 1
    x = g.reshape(left.shape[:-2] + (left.shape[-1], right.shape[-1]))
    rotated = jnp.swapaxes(left, -1, -2) @ x @ right
    rotated = rotated / (inverse.left_values[..., :, None] * inverse.right_values[..., None, :] + shift)
    return (left @ rotated @ jnp.swapaxes(right, -1, -2)).reshape(g.shape)


def dense(curvature: Curvature) -> jax.Array:
    """F as a dense matrix over the leaf's entries in row-major order (tests, tiny leaves)."""
    if isinstance(curvature, Diagonal):
        return jnp.diag(curvature.values.ravel())
    rows = sum(jax.vmap(jnp.kron)(t.left.reshape(-1, *t.left.shape[-2:]), t.right.reshape(-1, *t.right.shape[-2:]))
               for t in curvature)
    return jax.scipy.linalg.block_diag(*rows)  # a Row-stacked leaf: one block per row
