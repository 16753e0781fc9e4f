r"""Levenberg–Marquardt damping: λ moved by how well the quadratic model predicted the change of
the loss over a step, for `kfac` and `scale_by_gauss_newton` alike.

Both measure the gain ratio

$$\rho = \frac{f(\theta + u) - f(\theta)}{m(u) - m(0)}$$

(the actual change over the model's) and keep λ in [``min_damping``, ``max_damping``]; they differ
in the rule that maps ρ to λ's factor, each as published:

- Martens & Grosse (K-FAC, §6.5): every few steps λ / ω where ρ < ¼, λ · ω where ρ > ¾, ω < 1
  the decay per adaptation; a model that predicts no decrease gives no ratio to trust (ρ = −∞).
- Nielsen (1999; Madsen, Nielsen & Tingleff): after each step that lowered the loss
  λ · max(⅓, 1 − (2ρ − 1)³), after each that did not λ · ν, ν doubling with every failure in a row.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class DampingBounds(NamedTuple):
    """λ's floor and ceiling."""

    min_damping: float
    max_damping: float

    def clip(self, lam: jax.Array) -> jax.Array:
        return jnp.clip(lam, self.min_damping, self.max_damping).astype(lam.dtype)


def gain_ratio(before: jax.Array, after: jax.Array, predicted_change: jax.Array) -> jax.Array:
    """ρ = (f(θ + u) − f(θ)) / (m(u) − m(0)), and −∞ where there is no ratio to trust: the loss
    after the step not finite, or a model that predicts no decrease (fixed coefficients along an
    ascent), so that a loss increase never lowers λ through ρ's sign."""
    rho = (after - before) / predicted_change
    return jnp.where(jnp.isfinite(after) & (predicted_change < 0), jnp.nan_to_num(rho, nan=-jnp.inf), -jnp.inf)


def martens_grosse(lam: jax.Array, rho: jax.Array, omega: float, bounds: DampingBounds) -> jax.Array:
    """λ / ω where ρ < ¼, λ · ω where ρ > ¾, else λ (Martens & Grosse's rule; ω < 1)."""
    factor = jnp.where(rho < 0.25, 1 / omega, jnp.where(rho > 0.75, omega, 1.0))
    return bounds.clip(lam * factor)


def raised(lam: jax.Array, omega: float, bounds: DampingBounds) -> jax.Array:
    """λ / ω: a step that failed (not finite, or rejected) asks for more damping."""
    return bounds.clip(lam / omega)


def nielsen(lam: jax.Array, nu: jax.Array, before: jax.Array, after: jax.Array, predicted_decrease: jax.Array,
            bounds: DampingBounds) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Nielsen's rule: (λ, ν, decreased) after a step that changed the loss from ``before`` to
    ``after`` where the model predicted ``predicted_decrease`` (> 0). A NaN λ (a non-finite first
    step's scale) stays NaN, to be measured again at the next step; ν is kept finite (λ is
    clipped anyway)."""
    decreased = jnp.isfinite(after) & (after < before)
    rho = jnp.where(decreased, (before - after) / jnp.maximum(predicted_decrease, jnp.finfo(lam.dtype).tiny), -1.0)
    factor = jnp.where(decreased, jnp.maximum(1 / 3, 1 - (2 * rho - 1) ** 3), nu)
    lam = jnp.clip(lam * factor.astype(lam.dtype), bounds.min_damping, bounds.max_damping)
    nu = jnp.where(decreased, 2, jnp.minimum(2 * nu, 2.0 ** 60)).astype(nu.dtype)
    return lam, nu, decreased
