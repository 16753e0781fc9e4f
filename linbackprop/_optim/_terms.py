r"""The loss's terms named to the Gauss–Newton step: residuals given as a pytree of terms (a PDE's
interior, its boundary, its initial condition), the weighted least squares

$$L(\theta) = \sum_t w_t \,\operatorname{mean}\big(r_t(\theta)^2\big),$$

its Jacobian rows K and residuals b (L = ½‖b‖², ∇L = Kᵀb) from the library's own solve
(`ggn_factor(rank=1, residuals=True)` of L), and the weights' adaptation as DSGNAR's code writes
it: with the terms' losses $l_t = w_t\,\operatorname{mean}(r_t^2)$ and their mean m,

$$w_t \leftarrow w_t \Big(\frac{m}{l_t + 10^{-8}}\Big)^{\text{rate}},\qquad w \leftarrow w / \operatorname{mean}(w),$$

which raises the weight of a term that lags the others.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .._curvature import ggn_factor

# DSGNAR's floor under a term's loss in the adaptation (an absolute 1e-8, as its code has it):
# once every term is far below it the factors agree and the weights stop moving
LOSS_FLOOR = 1e-8


class FromTerms(NamedTuple):
    """What the step needs, made from the terms at θ: the rows K [R, …], the residuals b [R],
    the loss L(θ), L as a function of the parameters, ∇L = Kᵀb (parameter-shaped) and each
    term's mean(r_t²) (the weights' tree)."""

    rows: Any
    residuals: jax.Array
    value: jax.Array
    value_fn: Callable
    gradient: Any
    mean_squares: Any


def weighted(terms: Callable, weights: Any) -> Callable:
    """L(θ) = Σ_t w_t · mean(r_t(θ)²) for the terms' function and weights of the same tree (None:
    every weight 1)."""
    return lambda params: _weighted_sum(_mean_squares(terms(params)), weights)


def from_terms(terms: Callable, weights: Any, params: Any) -> FromTerms:
    """K, b, L(θ), L, ∇L and the terms' mean squares at ``params`` (one solve for the rows; the
    terms evaluated once more for L(θ) and the mean squares together)."""
    loss = weighted(terms, weights)
    rows, b = ggn_factor(loss, rank=1, residuals=True)(params)
    gradient = jax.tree.map(lambda r: jnp.tensordot(b, r, axes=1), rows)
    mean_squares = _mean_squares(terms(params))
    return FromTerms(rows, b, _weighted_sum(mean_squares, weights), loss, gradient, mean_squares)


def _mean_squares(residuals: Any) -> Any:
    return jax.tree.map(lambda r: jnp.mean(r ** 2), residuals)


def _weighted_sum(mean_squares: Any, weights: Any) -> jax.Array:
    """Σ_t w_t · mean(r_t²), the same operations wherever L is evaluated (θ and every candidate)."""
    ws = jax.tree.map(lambda _: 1.0, mean_squares) if weights is None else weights
    _check_structure(mean_squares, ws)
    return sum(w * m for m, w in zip(jax.tree.leaves(mean_squares), jax.tree.leaves(ws)))


def adapted(weights: Any, mean_squares: Any, rate: float) -> Any:
    """The weights after one adaptation (module docstring) from the terms' mean(r_t²)."""
    ws, structure = jax.tree.flatten(weights)
    losses = jnp.stack([w * m for w, m in zip(ws, jax.tree.leaves(mean_squares))])
    factors = (jnp.mean(losses) / (losses + LOSS_FLOOR)) ** rate
    raised = jnp.stack(ws) * factors
    return jax.tree.unflatten(structure, list(raised / jnp.mean(raised)))


def _check_structure(residuals: Any, weights: Any) -> None:
    if jax.tree.structure(residuals) != jax.tree.structure(weights):
        raise ValueError(f"scale_by_gauss_newton: the terms function returned {jax.tree.structure(residuals)}, "
                         f"the weights are {jax.tree.structure(weights)}: give weights= one number per term, "
                         "in the same tree (e.g. {'pde': 1.0, 'bc': 1.0} for a dict of two terms).")
