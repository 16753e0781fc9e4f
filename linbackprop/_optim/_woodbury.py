r"""Woodbury's identity for (λI + KᵀK)⁻¹ g with fewer rows than parameters, in the forms that
keep its digits: the Gram KKᵀ refined in float64 where refining converges, the thin QR of Kᵀ
in float32 and below the Gram's reach."""

from __future__ import annotations

import jax
import jax.numpy as jnp

# steps of iterative refinement after the Gram form's first solve: each multiplies the error by
# about ε·‖KKᵀ‖/λ; three left residuals below the QR form's at every λ from 1e-2 to 1e-12 on the
# deep-wide PINN's rows (`python benchmarks/profile.py woodbury`; docs/performance.md)
REFINEMENTS = 3
# the Gram form only where ε·‖KKᵀ‖/λ ≤ 1/GRAM_MARGIN (‖KKᵀ‖ bounded by its trace): there the first
# solve and three refinements bring the error to (1/GRAM_MARGIN)⁴ ≈ ε; below, refining amplifies
# the error (22–97 % off at λ = 1e-10 with ‖KKᵀ‖ = 1e6) and the QR form serves
GRAM_MARGIN = 1e4


def woodbury_solve(k: jax.Array, g: jax.Array, lam: jax.Array) -> jax.Array:
    r"""(λI + KᵀK)⁻¹ g for R rows K [R, P], R < P, by Woodbury's identity

    $$(\lambda I + K^T K)^{-1} g = \big(g - K^T (\lambda I + K K^T)^{-1} K g\big) / \lambda.$$

    In float64 (and wider) from the Gram KKᵀ — one matrix product and an R × R Cholesky
    factor — refined ``REFINEMENTS`` times, x ← x + W(g − λx − Kᵀ(Kx)) with W the formula
    above on the same factor: the subtraction of nearly equal vectors loses about ε·‖KKᵀ‖/λ of
    the components along K's large singular values, and each refinement multiplies that
    error by the same factor. The QR of Kᵀ (`_woodbury_qr`) costs 2–3× as much on the
    deep-wide PINN's 1,020 × 9,873 rows (its Householder panels are not matrix products)
    and left larger residuals at every λ measured; it serves float32 (where ε·‖KKᵀ‖/λ
    reaches 1 at λ ≈ 1e-7 ‖KKᵀ‖, and refining would not converge) and, under ``lax.cond``,
    every λ below ``GRAM_MARGIN`` · ε · tr(KKᵀ), where refining would amplify the error (and
    λI + KKᵀ may have no Cholesky factor in floating point). ``solver="svd"`` is exact to
    round-off at every λ (and from the residuals, to κ(K)'s round-off rather than κ(K)²'s)."""
    if jnp.finfo(g.dtype).bits < 64:
        return _woodbury_qr(k, g, lam)
    bare = k @ k.T
    gram = bare + lam * jnp.eye(k.shape[0], dtype=k.dtype)
    factor = jax.scipy.linalg.cho_factor(gram)
    converges = lam >= GRAM_MARGIN * jnp.finfo(g.dtype).eps * jnp.trace(bare)

    def refined() -> jax.Array:
        inverse = lambda r: (r - k.T @ jax.scipy.linalg.cho_solve(factor, k @ r)) / lam
        x = inverse(g)
        for _ in range(REFINEMENTS):
            x = x + inverse(g - lam * x - k.T @ (k @ x))
        return x

    return jax.lax.cond(converges & jnp.all(jnp.isfinite(factor[0])), refined, lambda: _woodbury_qr(k, g, lam))


def _woodbury_qr(k: jax.Array, g: jax.Array, lam: jax.Array) -> jax.Array:
    """`woodbury_solve` from the thin QR Kᵀ = QR: Q(RRᵀ + λI)⁻¹Qᵀg + (g − QQᵀg)/λ, the
    projection written out, so that float32 keeps its precision (Woodbury's own form subtracts
    nearly equal vectors). Q is kept as LAPACK's Householder reflectors and applied (ormqr),
    never formed: forming it cost as much again as the factorisation."""
    h, taus = jnp.linalg.qr(k.T, mode="raw")
    reflectors = h.T  # [P, R]: R on and above the diagonal, the reflectors below
    m = min(reflectors.shape)
    r = jnp.triu(reflectors[:m])
    apply_q = lambda c, transpose: jax.lax.linalg.ormqr(reflectors, taus, c[:, None], transpose=transpose)[:, 0]
    inside = apply_q(g, True)[:m]  # Qᵀg
    small = r @ r.T + lam * jnp.eye(m, dtype=r.dtype)
    solved = jax.scipy.linalg.cho_solve(jax.scipy.linalg.cho_factor(small), inside)
    # Q (RRᵀ + λI)⁻¹ Qᵀg + (g − QQᵀg)/λ, both Q products in one
    padded = jnp.zeros_like(g).at[:m].set(solved - inside / lam)
    return apply_q(padded, False) + g / lam
