"""The seed's example (backbackback.jl) in linbackprop.

N = 6 layers produce U₁..U₆ from U₀ for m = 10 data points, d = [5, 4, 4, 4, 4, 3, 1],
σ(x) = exp(−x). Besides the chain weights W_{i,i−1}, layers 3, 5 and 6 read U₁, U₂ and U₃
through skip weights W₃₁, W₅₂, W₆₃, and layers 3 and 4 share both their chain weight and their
bias: K = 13 blocks, numbered as in the seed (weights θ₁..θ₈, biases θ₉..θ₁₃).
The gradient of J(θ) = ‖U_N − Y‖²/(2m) + α/2 ⟨θ, θ⟩ is ∇θJ = ℳ((ℒ*)⁻¹∇Uℓ) + αθ.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._graph import Layer, Network
from .._operators import linearize
from .._solve import grad_by_solve

D = [5, 4, 4, 4, 4, 3, 1]  # feature sizes of U₀, …, U₆
W = [[(0, 1)], [(1, 2)], [(2, 3), (1, 6)], [(3, 3)], [(4, 4), (2, 7)], [(5, 5), (3, 8)]]  # j => k
B = [9, 10, 11, 11, 12, 13]
M_POINTS, ALPHA = 10, 1e-2


def sigma(x: jax.Array) -> jax.Array:
    return jnp.exp(-x)


def seed_layer(theta: tuple, *states: jax.Array) -> jax.Array:
    """σ(Σ_j W_ij U_j + b_i): ``theta`` holds one weight per read state, then the bias."""
    *weights, bias = theta
    return sigma(sum(w @ u for w, u in zip(weights, states)) + bias[:, None])


def seed_network() -> Network:
    layers = [Layer(i, seed_layer, tuple(j for j, _ in W[i - 1]), (*(k for _, k in W[i - 1]), B[i - 1]))
              for i in range(1, 7)]
    return Network(layers, inputs=[0], outputs=6)


def seed_problem(seed: int = 42) -> tuple[Network, dict, jax.Array, jax.Array]:
    """The network, θ (0.01·randn blocks), U₀ and Y, in float64."""
    rng = np.random.default_rng(seed)
    init = lambda *dims: jnp.asarray(0.01 * rng.standard_normal(dims), jnp.float64)
    u0, y = init(D[0], M_POINTS), init(D[-1], M_POINTS)
    theta: dict[int, Any] = {}
    for i in range(1, 7):
        for j, k in W[i - 1]:
            theta[k] = init(D[i], D[j])
        theta[B[i - 1]] = init(D[i])
    return seed_network(), theta, u0, y


def seed_loss(net: Network, y: jax.Array):
    def loss(theta: dict, u0: jax.Array) -> jax.Array:
        fit = jnp.sum((net(theta, u0) - y) ** 2) / (2 * M_POINTS)
        return fit + ALPHA / 2 * sum(jnp.vdot(p, p) for p in theta.values())

    return loss


def main(seed: int = 42) -> dict[str, float]:
    """Print the patterns of ℒ and ℳ*, and check the gradient; returns the relative errors."""
    with jax.enable_x64(True):
        net, theta, u0, y = seed_problem(seed)
        loss = seed_loss(net, y)
        lin = linearize(net, theta, u0)
        print(lin.L)
        print()
        print(lin.M.T)
        print()
        # The seed's lines, through the operators: Λ = ℒ* \ ∇Uℓ, ∇J = ℳΛ + αθ.
        grad_u = {i: jnp.zeros_like(lin.states[i]) for i in net.order}
        grad_u[6] = (lin.states[6] - y) / M_POINTS
        lam = lin.L.T.solve(grad_u)
        by_formula = {k: g + ALPHA * theta[k] for k, g in lin.M.mv(lam).items()}
        by_solve = jax.jit(grad_by_solve(loss))(theta, u0)
        by_jax = jax.jit(jax.grad(loss))(theta, u0)

        rng = np.random.default_rng(seed + 1)
        h = {k: jnp.asarray(rng.standard_normal(np.shape(p))) for k, p in theta.items()}
        eps = 1e-6
        shifted = lambda s: {k: theta[k] + s * eps * h[k] for k in theta}
        jitted_loss = jax.jit(loss)
        directional = (jitted_loss(shifted(1.0), u0) - jitted_loss(shifted(-1.0), u0)) / (2 * eps)
        dot = lambda g: sum(jnp.vdot(g[k], h[k]) for k in theta)
        rel = lambda a, b: float(max(jnp.max(jnp.abs(a[k] - b[k])) for k in theta)
                                 / max(jnp.max(jnp.abs(b[k])) for k in theta))
        result = {
            "versus_finite_difference": float(abs(directional - dot(by_solve)) / abs(dot(by_solve))),
            "versus_jax_grad": rel(by_solve, by_jax),
            "formula_versus_grad_by_solve": rel(by_formula, by_solve),
        }
    stored = int(lin.L.pattern.sum())
    below = int(np.tril(lin.L.pattern, -1).sum())
    print(f"ℒ stores {stored} of {lin.L.pattern.size} blocks, {below} below the diagonal")
    for name, value in result.items():
        print(f"{name} = {value:.3e}")
    return result
