r"""Damped least-squares directions from one SVD of the rows, for every λ at once, their
predicted decreases and their lengths.

With K = U diag(s) Vᵀ (thin) and g = Kᵀb, the direction of the damped problem
min ‖K d − b‖² + λ‖d − p‖² (p a prior: SPRING's momentum μ·d_prev, or 0) is

$$d(\lambda) = V e + (p - V V^T p) + g_\perp / \lambda,\qquad
  e = \frac{c + \lambda V^T p}{s^2 + \lambda},\qquad c = V^T g = s \odot U^T b,$$

g_⊥ the part of g outside K's row space (zero where g = Kᵀb, or where K has as many rows
as columns). From b, c = s ⊙ Uᵀb never multiplies by K twice, so d keeps the digits that
the Gram KKᵀ (or KᵀK) loses: κ(K), not κ(K)², bounds its error (Golub & Van Loan §5.3).
The quadratic model's predicted decrease is exact in the same coordinates:

$$\text{pred}(\lambda) = g^T d - \tfrac12 \lVert K d \rVert^2
  = c^T e + g_\perp^T p + \lVert g_\perp \rVert^2/\lambda - \tfrac12 \lVert s \odot e \rVert^2 .$$
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Spectral(NamedTuple):
    """K's thin SVD K = U diag(s) Vᵀ and g's coordinates in it: ``s`` [m], ``u`` [R, m], ``c`` =
    Vᵀg [m] (s ⊙ Uᵀb from residuals), ``rest`` = g − V c [P] (g outside K's rows). V [P, m] is
    ``v``, or — where the rows are fewer than the parameters — Q W of the thin QR Kᵀ = Q R and
    the SVD Rᵀ = U diag(s) Wᵀ, kept as LAPACK's reflectors (``reflectors``, ``taus``) and ``w``:
    the SVD of the R × R factor instead of the R × P rows (0.9 s against 2.5 s on the deep-wide
    PINN's 1,020 × 9,873 rows), and V never formed."""

    u: jax.Array
    s: jax.Array
    c: jax.Array
    rest: jax.Array
    v: jax.Array | None = None
    reflectors: jax.Array | None = None
    taus: jax.Array | None = None
    w: jax.Array | None = None

    def to_params(self, e: jax.Array) -> jax.Array:
        """V eᵀ for coordinates e [n, m]: [n, P]."""
        if self.v is not None:
            return e @ self.v.T
        inside = self.w @ e.T  # [m, n]
        padded = jnp.zeros((self.reflectors.shape[0], e.shape[0]), e.dtype).at[: inside.shape[0]].set(inside)
        return jax.lax.linalg.ormqr(self.reflectors, self.taus, padded, transpose=False).T

    def from_params(self, x: jax.Array) -> jax.Array:
        """Vᵀx for x [P]: [m]."""
        if self.v is not None:
            return self.v.T @ x
        inside = jax.lax.linalg.ormqr(self.reflectors, self.taus, x[:, None], transpose=True)[: self.w.shape[0], 0]
        return self.w.T @ inside


def spectral(k: jax.Array, g: jax.Array, residuals: jax.Array | None = None) -> Spectral:
    """K [R, P]'s thin SVD with g's coordinates: Kᵀb's from the residuals b where given, and
    what g holds besides Kᵀb (beyond the round-off of forming it) as any gradient's."""
    if k.shape[0] < k.shape[1]:
        h, taus = jnp.linalg.qr(k.T, mode="raw")
        reflectors = h.T  # [P, R]: R on and above the diagonal, the reflectors below
        u, s, wt = jnp.linalg.svd(jnp.triu(reflectors[: k.shape[0]]).T)
        basis = dict(reflectors=reflectors, taus=taus, w=wt.T)
    else:
        u, s, vt = jnp.linalg.svd(k, full_matrices=False)
        basis = dict(v=vt.T)
    sp = Spectral(u, s, jnp.zeros_like(s), jnp.zeros_like(g), **basis)
    if residuals is None:
        return _with_gradient(sp, g, k)
    # g given beside b: what g holds besides Kᵀb (weight decay, an earlier transform of a chain)
    # is used as any gradient is; Kᵀb's own part comes from b, to κ(K)'s round-off. The part
    # within the round-off of forming Kᵀb (|K|ᵀ|b| ε per entry) is Kᵀb itself.
    extra = g - k.T @ residuals
    slack = 64 * jnp.finfo(k.dtype).eps * (jnp.abs(k).T @ jnp.abs(residuals))
    extra = jnp.where(jnp.abs(extra) > slack, extra, 0)
    with_extra = _with_gradient(sp, extra, k)
    return with_extra._replace(c=s * (u.T @ residuals) + with_extra.c)


def _with_gradient(sp: Spectral, g: jax.Array, k: jax.Array) -> Spectral:
    """``sp`` with g's coordinates: c = Vᵀg and the rest g − V c."""
    c = sp.from_params(g)
    # with as many rows as parameters V is square: g has no part outside, only round-off
    rest = g - sp.to_params(c[None])[0] if k.shape[0] < k.shape[1] else jnp.zeros_like(g)
    return sp._replace(c=c, rest=rest)


def directions(sp: Spectral, lams: jax.Array, prior: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The damped directions d(λ) for each λ of ``lams`` [n] ([n, P]) and their predicted
    decreases gᵀd − ½‖Kd‖² ([n]); ``prior`` p [P] (SPRING's μ·d_prev) or None."""
    lams = lams[:, None]
    w = jnp.zeros_like(sp.s) if prior is None else sp.from_params(prior)
    e = (sp.c + lams * w) / (sp.s ** 2 + lams)  # [n, m]
    outside = sp.rest[None, :] / lams
    d = sp.to_params(e) + outside
    predicted = e @ sp.c + jnp.sum(sp.rest ** 2) / lams[:, 0] - 0.5 * jnp.sum((sp.s * e) ** 2, axis=1)
    if prior is not None:
        d = d + (prior - sp.to_params(w[None])[0])[None, :]
        predicted = predicted + jnp.vdot(sp.rest, prior)
    return d, predicted


def distances(sp: Spectral, lams: jax.Array, prior: jax.Array | None = None) -> jax.Array:
    r"""‖d(λ) − p‖ for each λ of ``lams`` [n], without forming d: the step's length from the
    prior (from θ where there is none), $\sqrt{\sum_i ((c_i - s_i^2 w_i)/(s_i^2 + λ))^2 +
    \lVert g_\perp \rVert^2/λ^2}$, w = Vᵀp; V's columns are orthonormal and g_⊥ is outside them."""
    w = jnp.zeros_like(sp.s) if prior is None else sp.from_params(prior)
    inside = jnp.sum(((sp.c - sp.s ** 2 * w) / (sp.s ** 2 + lams[:, None])) ** 2, axis=1)
    rest = jnp.sum(sp.rest ** 2)
    return jnp.sqrt(inside + jnp.where(rest > 0, rest / lams ** 2, 0.0))
