"""Viscous Burgers' equation with a physics-informed network, Gauss–Newton to machine precision.

u_t + u u_x − ν u_xx = 0 on [−1, 1] × [0, 1], ν = 0.01/π, u(x, 0) = −sin πx, u(±1, t) = 0: one of
DSGNAR's problems (Webb, Jerad & Cartis 2026), with a shock forming at x = 0. The network is a tanh
MLP of (x, t); ``lbp.forward_laplacian(net, second=(1, 0))`` lifts it so that every layer carries
(u, (u_x, u_t), u_xx), and one layer more turns those into the residual r = u_t + u u_x − ν u_xx:
the loss ½ mean(r²) + ½ mean((u − g)²) over the initial and boundary points is then a least-squares
loss of two network calls, whose rows and residuals ``lbp.ggn_factor(loss, rank=1,
residuals=True)`` gives from one back substitution. The step is
``lbp.scale_by_gauss_newton(step="probe")``.

The reference is the exact solution by the Cole–Hopf transform,
u = −∫ sin π(x − η) F(x − η) e^{−η²/4νt} dη / ∫ F(x − η) e^{−η²/4νt} dη, F(y) = e^{−cos πy / 2πν},
each integral by the trapezoidal rule over η = √(4νt) z, |z| ≤ 9 (spectrally accurate for this
smooth, decaying integrand); its own error is printed (the same rule with half the nodes).
The relative L2 error is over a 256 × 100 grid of (x, t).

    python examples/burgers.py [--seconds 300] [--widths 16,16,16] [--out burgers.png]
"""

from __future__ import annotations

import argparse
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import linbackprop as lbp

jax.config.update("jax_enable_x64", True)
NU = 0.01 / np.pi


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help shows the description as written and each option's default."""


def reference(x: np.ndarray, t: np.ndarray, nodes: int = 4001) -> np.ndarray:
    """The exact u(x, t) (Cole–Hopf), x and t broadcast together; t = 0 gives −sin πx."""
    x, t = np.broadcast_arrays(np.asarray(x, np.float64), np.asarray(t, np.float64))
    z = np.linspace(-9.0, 9.0, nodes)
    weight = np.exp(-z ** 2)  # e^{−η²/4νt} with η = √(4νt) z
    out = -np.sin(np.pi * x)
    moving = np.flatnonzero(t > 0)
    for chunk in np.array_split(moving, max(1, len(moving) // 512)):  # [512, nodes] at a time: in cache
        y = x[chunk][:, None] - np.sqrt(4 * NU * t[chunk])[:, None] * z[None, :]
        # F(y) = e^{−cos πy / 2πν}, scaled by its largest value per point (the ratio is unchanged)
        exponent = -np.cos(np.pi * y) / (2 * np.pi * NU)
        f = np.exp(exponent - exponent.max(axis=1, keepdims=True)) * weight
        out[chunk] = -np.trapezoid(np.sin(np.pi * y) * f, z, axis=1) / np.trapezoid(f, z, axis=1)
    return out


def network(widths: tuple[int, ...]) -> lbp.Network:
    dense = lambda th, h: jnp.tanh(h @ th[0] + th[1])
    layers = [lbp.Layer(i + 1, dense, (i,), (f"W{i}", f"b{i}")) for i in range(len(widths))]
    layers.append(lbp.Layer("u", lambda th, h: h @ th[0] + th[1], (len(widths),), ("Wout", "bout")))
    return lbp.Network(layers, [0], "u")


def residual_network(net: lbp.Network) -> lbp.Network:
    """The lifted network with one layer more: r = u_t + u u_x − ν u_xx from (u, ∇u, u_xx)."""
    lifted = lbp.forward_laplacian(net, second=(1.0, 0.0))

    def residual(theta: tuple, lifted_u: tuple) -> jax.Array:
        u, grad, u_xx = lifted_u
        return grad[..., 1] + u * grad[..., 0] - NU * u_xx

    return lbp.Network([*lifted.layers, lbp.Layer("r", residual, ("u",))], lifted.inputs, "r")


def make_problem(widths: tuple[int, ...] = (16, 16, 16), interior: int = 1200, initial: int = 150,
                 boundary: int = 150, seed: int = 0):
    """Initial parameters, the points (interior; initial and boundary together, with their
    targets), the loss, and the relative L2 error against the reference."""
    sizes = (2, *widths)
    keys = jax.random.split(jax.random.key(seed), len(sizes) + 4)
    params = {}
    for i, (m, n) in enumerate(itertools.pairwise(sizes)):
        params[f"W{i}"] = jax.random.normal(keys[i], (m, n), jnp.float64) / jnp.sqrt(m)
        params[f"b{i}"] = jnp.zeros(n)
    params["Wout"] = jax.random.normal(keys[len(sizes)], (sizes[-1], 1), jnp.float64) / jnp.sqrt(sizes[-1])
    params["bout"] = jnp.zeros(1)
    inner = jax.random.uniform(keys[-4], (interior, 2), jnp.float64) * jnp.array([2.0, 1.0]) - jnp.array([1.0, 0.0])
    x0 = jax.random.uniform(keys[-3], (initial,), jnp.float64, -1.0, 1.0)
    tb = jax.random.uniform(keys[-2], (boundary,), jnp.float64)
    edge = jnp.concatenate([jnp.stack([x0, jnp.zeros(initial)], 1),
                            jnp.stack([jnp.where(jnp.arange(boundary) % 2 == 0, -1.0, 1.0), tb], 1)])
    target = jnp.concatenate([-jnp.sin(jnp.pi * x0), jnp.zeros(boundary)])
    net = network(widths)
    pde = residual_network(net)

    def loss(p: dict, inner: jax.Array, edge: jax.Array) -> jax.Array:
        return 0.5 * jnp.mean(pde(p, inner)[:, 0] ** 2) + 0.5 * jnp.mean((net(p, edge)[:, 0] - target) ** 2)

    xs, ts = np.meshgrid(np.linspace(-1, 1, 256), np.linspace(0, 1, 100))
    grid = jnp.asarray(np.stack([xs.ravel(), ts.ravel()], 1))
    exact = jnp.asarray(reference(xs.ravel(), ts.ravel()))
    norm = jnp.sqrt(jnp.mean(exact ** 2))

    @jax.jit
    def error(p: dict) -> jax.Array:
        return jnp.sqrt(jnp.mean((net(p, grid)[:, 0] - exact) ** 2)) / norm

    return params, (inner, edge), loss, error


def probed(loss, params, batch):
    tx = optax.chain(lbp.scale_by_gauss_newton(step="probe"), optax.scale(-1.0))

    @jax.jit
    def step(state):
        p, s = state
        value, grad = lbp.value_and_grad_by_solve(loss)(p, *batch)
        rows, residuals = lbp.ggn_factor(loss, rank=1, residuals=True)(p, *batch)
        updates, s = tx.update(grad, s, p, rows=rows, residuals=residuals, value=value,
                               value_fn=lambda q: loss(q, *batch))
        return optax.apply_updates(p, updates), s

    return step, (params, tx.init(params))


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=_Help)
    parser.add_argument("--seconds", type=float, default=300.0, help="step time (compile excluded)")
    parser.add_argument("--widths", default="16,16,16", help="hidden widths")
    parser.add_argument("--out", default="burgers.png", help="PNG of the error against seconds ('' for none)")
    args = parser.parse_args(argv)
    widths = tuple(int(w) for w in args.widths.split(","))
    xs = np.linspace(-1, 1, 64)
    check = float(np.max(np.abs(reference(xs, 1.0) - reference(xs, 1.0, nodes=2001))))
    params, batch, loss, error = make_problem(widths)
    n = sum(x.size for x in jax.tree.leaves(params))
    print(f"Burgers, 2-{'-'.join(map(str, widths))}-1: {n} parameters, {batch[0].shape[0]} interior and "
          f"{batch[1].shape[0]} initial/boundary points (jax {jax.__version__}); the reference's own error "
          f"(half the nodes) {check:.1e}")
    step, state = probed(loss, params, batch)
    began = time.perf_counter()
    state = jax.block_until_ready(step(state))
    compiled = time.perf_counter() - began
    spent, steps, times, errors = 0.0, 0, [0.0], [float(error(state[0]))]
    while spent < args.seconds:
        began = time.perf_counter()
        state = jax.block_until_ready(step(state))
        spent += time.perf_counter() - began
        steps += 1
        if steps % 10 == 0 or spent >= args.seconds:
            times.append(spent)
            errors.append(float(error(state[0])))
    times, errors = np.array(times), np.array(errors)
    at = {s: float(np.min(errors[times <= s])) for s in (10.0, 30.0, 100.0) if s < args.seconds}
    print(f"probed Gauss–Newton: {steps} steps, relative L2 error {errors.min():.2e}, compile {compiled:.1f} s"
          + "".join(f"  ({e:.2e} at {s:g} s)" for s, e in at.items()))
    if args.out:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.4, 4))
        ax.loglog(np.maximum(times, 1e-1), np.fmin.accumulate(errors), lw=2, label="Gauss–Newton, probed (SVD)")
        ax.set_xlabel("seconds in the steps")
        ax.set_ylabel("relative L2 error")
        ax.set_title(f"Burgers, ν = 0.01/π, tanh MLP 2-{'-'.join(map(str, widths))}-1, float64")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.out, dpi=110)
        print(f"wrote {args.out}")
    return {"error": float(errors.min()), "steps": steps}


if __name__ == "__main__":
    main()
