r"""The KFAC* step (Martens & Grosse §7): the update u = α Δ + μ δ from the preconditioned
direction Δ and the previous update δ, with (α, μ) minimising the damped quadratic model

$$m(u) = g^\top u + \tfrac12 u^\top (G + \lambda I) u$$

over that plane, from exact Gauss–Newton products (forward substitutions only).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from .._curvature import GaussNewton
from ._preconditioner import all_finite


class KfacStarStep(NamedTuple):
    """The step u and what chose it: α, μ, b = (gᵀΔ, gᵀδ), the Gram matrix of [Δ, δ] under G
    (zeros where not measured), and whether the step was not finite (then zeros)."""

    update: Any
    alpha: jax.Array
    mu: jax.Array
    b: jax.Array
    gram: jax.Array
    broken: jax.Array

    def predicted_change(self) -> jax.Array:
        """m(u) − m(0) without λ (kfac-jax's ρ's denominator): wᵀb + ½ wᵀ M w, w = (α, μ)."""
        w = jnp.stack([self.alpha, self.mu])
        return w @ self.b + 0.5 * w @ self.gram @ w


def kfac_star(grad: Any, direction: Any, previous: Any, curvature: GaussNewton | None, damping: jax.Array,
              learning_rate: float | None, momentum: float | None) -> KfacStarStep:
    """u = α Δ + μ δ with (α, μ) from the model (or fixed where given). With C = G + λI, (α, μ)
    solves ((ΔᵀCΔ, ΔᵀCδ), (δᵀCΔ, δᵀCδ)) (α, μ)ᵀ = −(gᵀΔ, gᵀδ)ᵀ; G's products only where a
    coefficient is chosen (``curvature`` None otherwise), δ's none where μ is fixed at 0. A step
    that is not finite (a singular model, an overflow) comes out as zeros."""
    dtype = damping.dtype
    vdot = optax.tree.vdot
    b = jnp.stack([vdot(grad, direction), vdot(grad, previous)]).astype(dtype)
    if curvature is None:
        gram = jnp.zeros((2, 2), dtype)
    elif momentum is not None and momentum == 0:  # δ's products would be multiplied by μ = 0
        gram = jnp.zeros((2, 2), dtype).at[0, 0].set(curvature.gram([direction])[0, 0].astype(dtype))
    else:
        gram = curvature.gram([direction, previous]).astype(dtype)
    norms = jnp.array([[vdot(direction, direction), vdot(direction, previous)],
                       [vdot(direction, previous), vdot(previous, previous)]], dtype)
    alpha, mu = coefficients(gram + damping * norms, b, learning_rate, momentum, dtype)
    update = optax.tree.add(optax.tree.scale(alpha, direction), optax.tree.scale(mu, previous))
    broken = ~all_finite(update)
    update = jax.tree.map(lambda u: jnp.where(broken, jnp.zeros_like(u), u), update)
    return KfacStarStep(update, alpha, mu, b, gram, broken)


def coefficients(m: jax.Array, b: jax.Array, learning_rate: float | None, momentum: float | None,
                 dtype: Any) -> tuple[jax.Array, jax.Array]:
    """(α, μ) minimising bᵀw + ½ wᵀ M w over the coefficients not fixed; the momentum's row and
    column vanish on the first step (δ = 0), where μ is 0 and α is the 1-D minimiser."""
    tiny = jnp.finfo(dtype).tiny
    if learning_rate is not None and momentum is not None:
        return jnp.asarray(learning_rate, dtype), jnp.asarray(momentum, dtype)
    if momentum is not None:  # α alone: −(b₀ + μ M₀₁) / M₀₀
        mu = jnp.asarray(momentum, dtype)
        return -(b[0] + mu * m[0, 1]) / jnp.maximum(m[0, 0], tiny), mu
    if learning_rate is not None:  # μ alone
        alpha = jnp.asarray(learning_rate, dtype)
        mu = jnp.where(m[1, 1] > 0, -(b[1] + alpha * m[0, 1]) / jnp.where(m[1, 1] > 0, m[1, 1], 1), 0)
        return alpha, mu.astype(dtype)
    det = m[0, 0] * m[1, 1] - m[0, 1] ** 2
    # δ = 0 (the first step, a rejected one) or Δ ∥ δ: the plane is a line, α alone
    degenerate = det <= 64 * jnp.finfo(dtype).eps * m[0, 0] * m[1, 1]
    safe_det = jnp.where(degenerate, 1, det)
    alpha2 = (-b[0] * m[1, 1] + b[1] * m[0, 1]) / safe_det
    mu2 = (-b[1] * m[0, 0] + b[0] * m[0, 1]) / safe_det
    alpha1 = -b[0] / jnp.maximum(m[0, 0], tiny)
    return jnp.where(degenerate, alpha1, alpha2).astype(dtype), jnp.where(degenerate, 0, mu2).astype(dtype)
