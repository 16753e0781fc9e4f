r"""The probed step: a trust radius Δ carried from step to step, ``probes`` radii around it, the
damping of each from the secular equation, every candidate's loss in one batched call, and the
largest radius whose gain ratio — and every shorter one's — stays at the target (DSGNAR's rule,
Webb, Jerad & Cartis 2026, written from its description).

For radii $r_j = Δ \cdot \text{spread}^{t_j}$, t evenly spaced in [−1, 1], λ_j solves
‖d(λ_j) − p‖ = r_j (`damping_for_radius`: the length falls monotonically in λ, so bisection on
log λ over the damping bounds finds it to round-off); the gain ratio of each is
ρ_j = (f(θ) − f(θ − d_j)) / pred_j, clipped to [−1, 1] (−1 where the loss is not finite), and the
*safe* ratio is its running minimum over increasing radius. The radius chosen is where the safe
ratio crosses the target, interpolated in log r between the last probe above and the first below;
its candidate is evaluated once more and taken where it lowers the loss, else the last probe
above (which did). All above: the largest probe, and Δ grows by ``spread``; none: no step (zeros)
and Δ shrinks by ``spread``. The safe ratio is what keeps the path from a step that the model
predicts well only by luck between worse ones: taking the longest candidate with ρ ≥ target
instead stalled 2-64-1 Poisson runs at 10⁻⁹–10⁻⁶ (docs/guides/training.md, the ablation).

With a row sketch (`count_sketch`, fresh every step) the candidates are those of the sketched
least squares min ‖S(K d − b)‖² + λ‖d‖² and their predictions its own, the gain ratios still of
the true loss: the model's metric moves from step to step, which kept every measured start of the
2-64-1 PINN off the minima of the fitted points' loss that the unsketched steps ended in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ._spectral import Spectral, directions, distances

# buckets each row of a count sketch goes to: DSGNAR's 4
HASHES = 4
# bisection steps on log λ: 64 halvings of the widest bracket (log(1e300/1e-300) ≈ 1,400) leave
# it below 1e-16, λ to round-off
BISECTIONS = 64


class Probed(NamedTuple):
    """One probed step: the direction [P] (zeros where none was taken), the next trust radius
    and the damping of the step taken (or of the shortest probe where none was)."""

    direction: jax.Array
    radius: jax.Array
    damping: jax.Array


def damping_for_radius(sp: Spectral, radii: jax.Array, floor: float, ceiling: float,
                       prior: jax.Array | None = None) -> jax.Array:
    """λ_j with ‖d(λ_j) − p‖ = r_j for each radius [n]: the floor where even d(floor) is shorter,
    the ceiling where even d(ceiling) is longer."""
    floor = max(floor, float(jnp.finfo(sp.s.dtype).tiny))
    lo = jnp.full(radii.shape, jnp.log(floor), sp.s.dtype)
    hi = jnp.full(radii.shape, jnp.log(ceiling), sp.s.dtype)

    def halve(_, bracket):
        lo, hi = bracket
        mid = 0.5 * (lo + hi)
        longer = distances(sp, jnp.exp(mid), prior) > radii
        return jnp.where(longer, mid, lo), jnp.where(longer, hi, mid)

    lo, hi = jax.lax.fori_loop(0, BISECTIONS, halve, (lo, hi))
    return jnp.exp(hi)


def probed(sp: Spectral, radius: jax.Array, before: jax.Array, value_of: Callable[[jax.Array], jax.Array],
           probes: int, spread: float, target: float, floor: float, ceiling: float,
           prior: jax.Array | None = None, probe_batch: int | None = None) -> Probed:
    """The step from trust radius Δ = ``radius``: ``value_of(d)`` is the loss at θ − d; the
    probes' losses come from it under ``jax.lax.map`` in batches of ``probe_batch``."""
    dtype = sp.s.dtype
    radii = radius * jnp.asarray(spread, dtype) ** jnp.linspace(-1.0, 1.0, probes, dtype=dtype)
    lams = damping_for_radius(sp, radii, floor, ceiling, prior)
    d, predicted = directions(sp, lams, prior)
    after = jax.lax.map(value_of, d, batch_size=probe_batch)
    rho = jnp.clip((before - after) / jnp.where(predicted > 0, predicted, 1.0), -1.0, 1.0)
    rho = jnp.where(jnp.isfinite(after) & (predicted > 0), rho, -1.0)
    safe = jax.lax.cummin(rho)
    above = jnp.sum(safe >= target)  # safe falls with the radius: the first `above` probes
    last = jnp.maximum(above - 1, 0)
    following = jnp.minimum(above, probes - 1)
    share = (safe[last] - target) / jnp.maximum(safe[last] - safe[following], jnp.finfo(dtype).tiny)
    crossing = radii[last] * (radii[following] / radii[last]) ** jnp.clip(share, 0.0, 1.0)
    lam = damping_for_radius(sp, crossing[None], floor, ceiling, prior)
    step, _ = directions(sp, lam, prior)
    value = value_of(step[0])
    taken = jnp.isfinite(value) & (value < before)
    between = Probed(jnp.where(taken, step[0], d[last]), jnp.where(taken, crossing, radii[last]),
                     jnp.where(taken, lam[0], lams[last]))
    every = Probed(d[-1], radii[-1], lams[-1])
    none = Probed(jnp.zeros_like(d[0]), radii[0], lams[0])
    choose = lambda a, b, c: jnp.where(above == probes, a, jnp.where(above == 0, c, b))
    return jax.tree.map(choose, every, between, none)


def count_sketch(key: jax.Array, k: jax.Array, b: jax.Array, size: int, hashes: int = HASHES
                 ) -> tuple[jax.Array, jax.Array]:
    """S K and S b for a fresh count sketch S [size, R]: each row added into ``hashes`` buckets
    drawn uniformly, with signs ±1/√hashes, so that E[SᵀS] = I (DSGNAR's row sketch)."""
    buckets = jax.random.randint(key, (hashes, k.shape[0]), 0, size)
    signs = jax.random.rademacher(jax.random.fold_in(key, 1), (hashes, k.shape[0]), k.dtype) / hashes ** 0.5
    sketched = lambda x: sum(jax.ops.segment_sum(signs[j].reshape(-1, *[1] * (x.ndim - 1)) * x, buckets[j], size)
                             for j in range(hashes))
    return sketched(k), sketched(b)


def first_radius(sp: Spectral, damping: jax.Array, prior: jax.Array | None = None) -> jax.Array:
    """Δ of the first step: the length of the direction at the first damping λ₀."""
    return distances(sp, damping[None], prior)[0]
