"""A physics-informed network for the Poisson equation, trained four ways on one time budget.

−Δu = f on [0, 1]², u = 0 on the boundary, f = 2π² sin(πx) sin(πy), so u* = sin(πx) sin(πy): the
setup of Dangel, Müller and Zeinhofer (NeurIPS 2024, the kfac-pinns experiments): 900 interior
and 120 boundary points, float64, a tanh MLP (2-64-1 by default). ``lbp.forward_laplacian``
lifts the network so that every layer propagates (u, ∇u, Δu) from its own function; the loss

    ½ mean((Δu + f)²) over the interior + ½ mean(u²) over the boundary

is then a loss of the lifted network's outputs, and the Gauss–Newton matrix of those outputs is
the Gramian of energy natural gradient descent (ENGD). Methods, each in one jitted step:

- Gauss–Newton to machine precision (``probe``): ``lbp.scale_by_gauss_newton(step="probe")`` on
  the loss's terms (``terms=``: the residuals' Jacobian rows and the residuals from one solve): one
  SVD a step, 24 trust radii probed at once, the radius where the safe gain ratio crosses the
  target;
- ENGD: ``lbp.scale_by_gauss_newton`` on the residuals' Jacobian rows (``lbp.ggn_factor(loss,
  rank=1)``: one back substitution), exact — a P × P solve, or the Woodbury solve where the
  points are fewer than the parameters — with Levenberg–Marquardt damping from the gain ratio;
- Hessian-free: the same with ``solver="cg"`` (a few conjugate-gradient products with G);
- K-FAC: ``lbp.kfac`` (KFAC*: step size and momentum from the quadratic model with exact G
  products, Levenberg–Marquardt damping) on ``lbp.kfac_factors`` of the loss written as two
  network calls — the lifted network on the interior points, the plain one on the boundary —
  which gives a Kronecker pair per call at each weight (the interior's over the u, ∇u and Δu rows:
  K-FAC "expand"), biases in their weights' blocks, inverted as their damped sum;
- Adam with three learning rates.

The L2 error sqrt(mean((u − u*)²)) over 9000 uniform points (and relative to ‖u*‖) is printed
and plotted against the seconds spent in the steps.

    python examples/pinn_poisson.py [--seconds 30] [--widths 64] [--out pinn_poisson.png]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import linbackprop as lbp

jax.config.update("jax_enable_x64", True)


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help shows the description as written and each option's default."""


def cpu_options() -> dict:
    """XLA:CPU hands float64 dots to YNNPACK fusions, which ran this problem's steps 1.3–2× slower
    than XLA's own loops (the K-FAC step on 2-64-1: 7.5 against 4.2 ms with JAX 0.10.2, 5.2
    against 4.0 ms with 0.12; ``python benchmarks/profile.py float64``); every method's step is
    compiled without them (docs/guides/training.md, "float64 on the CPU"). An XLA without the
    option gets its defaults."""
    options = {"xla_cpu_experimental_ynn_fusion_type": ""}
    if jax.default_backend() != "cpu":
        return {}
    try:
        jax.jit(lambda x: x + 1, compiler_options=options).lower(1.0).compile()
    except jax.errors.JaxRuntimeError:  # "No such compile option": its defaults (printed)
        return {}
    return options


CPU_OPTIONS = cpu_options()
jit = functools.partial(jax.jit, compiler_options=CPU_OPTIONS or None)


def exact(x: jax.Array) -> jax.Array:
    return jnp.sin(jnp.pi * x[:, 0]) * jnp.sin(jnp.pi * x[:, 1])


def source(x: jax.Array) -> jax.Array:
    return 2 * jnp.pi ** 2 * exact(x)


def boundary_points(n: int, key: jax.Array) -> jax.Array:
    """n points spread uniformly over the four edges of the unit square."""
    t = jax.random.uniform(key, (n,), jnp.float64)
    side = jnp.arange(n) % 4
    return jnp.stack([jnp.where(side == 0, 0.0, jnp.where(side == 1, 1.0, t)),
                      jnp.where(side == 2, 0.0, jnp.where(side == 3, 1.0, t))], axis=1)


def network(widths: tuple[int, ...]) -> lbp.Network:
    """The tanh MLP 2-widths-1 as a Network: x ↦ tanh(x W + b) per hidden layer, a linear head."""
    dense = lambda th, u: jnp.tanh(u @ th[0] + th[1])
    head = lambda th, u: u @ th[0] + th[1]
    layers = [lbp.Layer(i + 1, dense, (i,), (f"W{i}", f"b{i}")) for i in range(len(widths))]
    layers.append(lbp.Layer("u", head, (len(widths),), ("Wout", "bout")))
    return lbp.Network(layers, [0], "u")


def two_call_loss(widths: tuple[int, ...] = (64,), interior: int = 900):
    """The same loss as `make_problem`'s, written as two network calls: the lifted network on the
    interior points, the plain network on the boundary (K-FAC's two terms)."""
    net = network(widths)
    lifted = lbp.forward_laplacian(net)

    def loss(p: dict, points: jax.Array) -> jax.Array:
        _, _, lap = lifted(p, points[:interior])
        return (0.5 * jnp.mean((lap[:, 0] + source(points[:interior])) ** 2)
                + 0.5 * jnp.mean(net(p, points[interior:])[:, 0] ** 2))

    return loss


def residual_terms(widths: tuple[int, ...] = (64,), interior: int = 900):
    """The residuals of `make_problem`'s loss as named terms, for ``scale_by_gauss_newton``'s
    ``terms=``: the PDE's at the interior points, the boundary values at the rest; with weights
    ½ and ½ their weighted least squares Σ w_t·mean(r_t²) is that loss."""
    lifted = lbp.forward_laplacian(network(widths))

    def terms(p: dict, points: jax.Array) -> dict:
        u, _, lap = lifted(p, points)
        return {"pde": lap[:interior, 0] + source(points[:interior]), "bc": u[interior:, 0]}

    return terms


def initial_parameters(widths: tuple[int, ...], init: str, seed: int = 0) -> dict:
    """Starting parameters of the 2-widths-1 MLP: ``"uniform"`` (equinox's default, weights and
    biases uniform in ±1/√fan_in), ``"normal"`` (weights normal/√fan_in, biases zero), or the
    path of an .npz holding ``W0, b0, W1, b1, …`` layer by layer (``Wi`` of shape (fan_in,
    fan_out), the last pair the linear head's)."""
    sizes = (2, *widths, 1)
    names = [(f"W{i}", f"b{i}") for i in range(len(widths))] + [("Wout", "bout")]
    if init in ("uniform", "normal"):
        keys = jax.random.split(jax.random.key(seed), 2 * len(names))
        params = {}
        for n, ((w, b), (m, k)) in enumerate(zip(names, itertools.pairwise(sizes))):
            bound = 1.0 / np.sqrt(m)
            if init == "uniform":
                params[w] = jax.random.uniform(keys[2 * n], (m, k), jnp.float64, -bound, bound)
                params[b] = jax.random.uniform(keys[2 * n + 1], (k,), jnp.float64, -bound, bound)
            else:
                params[w] = jax.random.normal(keys[2 * n], (m, k), jnp.float64) * bound
                params[b] = jnp.zeros(k, jnp.float64)
        return params
    stored = np.load(init)
    params = {}
    for n, ((w, b), (m, k)) in enumerate(zip(names, itertools.pairwise(sizes))):
        if f"W{n}" not in stored or f"b{n}" not in stored:
            raise ValueError(f"--init {init}: no W{n} / b{n} (the file holds {sorted(stored.files)}; a 2-"
                             f"{'-'.join(map(str, widths))}-1 MLP needs W0, b0 … W{len(names) - 1}, b{len(names) - 1})")
        if stored[f"W{n}"].shape != (m, k) or stored[f"b{n}"].shape != (k,):
            raise ValueError(f"--init {init}: W{n} is {stored[f'W{n}'].shape} and b{n} {stored[f'b{n}'].shape}, "
                             f"where --widths {','.join(map(str, widths))} needs ({m}, {k}) and ({k},)")
        params[w], params[b] = jnp.asarray(stored[f"W{n}"], jnp.float64), jnp.asarray(stored[f"b{n}"], jnp.float64)
    return params


def make_problem(widths: tuple[int, ...] = (64,), interior: int = 900, boundary: int = 120, seed: int = 0):
    """The tanh MLP as a Network, its forward-Laplacian lift, initial parameters, the points
    (interior first, then boundary: one lifted call, one batch) and the loss."""
    sizes = (2, *widths)
    net = network(widths)
    keys = jax.random.split(jax.random.key(seed), len(sizes) + 3)
    params = {}
    for i, (m, n) in enumerate(itertools.pairwise(sizes)):
        params[f"W{i}"] = jax.random.normal(keys[i], (m, n), jnp.float64) / jnp.sqrt(m)
        params[f"b{i}"] = jnp.zeros(n)
    params["Wout"] = jax.random.normal(keys[len(sizes)], (sizes[-1], 1), jnp.float64) / jnp.sqrt(sizes[-1])
    params["bout"] = jnp.zeros(1)
    points = jnp.concatenate([jax.random.uniform(keys[-3], (interior, 2), jnp.float64),
                              boundary_points(boundary, keys[-2])])
    lifted = lbp.forward_laplacian(net)

    def loss(p: dict, points: jax.Array) -> jax.Array:
        u, _, lap = lifted(p, points)
        inner = lap[:interior, 0] + source(points[:interior])
        return 0.5 * jnp.mean(inner ** 2) + 0.5 * jnp.mean(u[interior:, 0] ** 2)

    test = jax.random.uniform(keys[-1], (9000, 2), jnp.float64)
    scale = float(jnp.sqrt(jnp.mean(exact(test) ** 2)))

    @jit
    def error(p: dict) -> jax.Array:
        return jnp.sqrt(jnp.mean((net(p, test)[:, 0] - exact(test)) ** 2))

    return params, points, loss, error, scale


def engd(loss, params, points, jit_step=None):
    """Energy natural gradient: the exact (G + λI)⁻¹ g from the residuals' Jacobian rows
    (``ggn_factor(rank=1)``: one residual per point), Levenberg–Marquardt damped. ``jit_step``:
    how the step is compiled (by default as below)."""
    tx = optax.chain(lbp.scale_by_gauss_newton(damping=1e-3, min_damping=1e-12), optax.scale(-1.0))
    # the Woodbury step's time is the Gram KKᵀ of the rows (1020 × 9873 on the deep-wide network),
    # one large product, which YNNPACK's fusions do in about half the time of XLA's loops
    # (`python benchmarks/profile.py woodbury`): XLA's defaults there, `CPU_OPTIONS` for the
    # small dense solve of 2-64-1
    if jit_step is None:
        woodbury = points.shape[0] < sum(x.size for x in jax.tree.leaves(params))
        jit_step = jax.jit if woodbury else jit

    @jit_step
    def step(state):
        p, s = state
        value, grad = lbp.value_and_grad_by_solve(loss)(p, points)
        rows = lbp.ggn_factor(loss, rank=1)(p, points)
        updates, s = tx.update(grad, s, p, rows=rows, value=value, value_fn=lambda q: loss(q, points))
        return optax.apply_updates(p, updates), s

    return step, (params, tx.init(params))


def probed(terms, params, points, probes: int = 24, target: float = 0.075, sketch: int | None = None):
    """Gauss–Newton to machine precision: the loss's terms named to the step (``terms=``, weights
    ½ and ½: `make_problem`'s loss), which makes the residuals' Jacobian rows and the residuals by
    one solve; one SVD of the rows a step, ``probes`` trust radii around the last, their losses in
    one batched call, the radius where the safe gain ratio crosses ``target`` (``step="probe"``);
    the directions from the residuals themselves, so they keep κ(K)'s digits, not κ(K)²'s.
    ``sketch``: rows of a fresh count sketch of the rows every step (DSGNAR's 2,000), or None."""
    tx = optax.chain(lbp.scale_by_gauss_newton(step="probe", probes=probes, target=target, sketch=sketch,
                                               weights={"pde": 0.5, "bc": 0.5}), optax.scale(-1.0))

    @jit
    def step(state):
        p, s = state
        updates, s = tx.update(p, s, p, terms=lambda q: terms(q, points))  # p: the updates' shape
        return optax.apply_updates(p, updates), s

    return step, (params, tx.init(params))


def hessian_free(loss, params, points, maxiter: int = 50):
    """Conjugate gradients on G + λI (products with G on the stored linearisation), warm-started,
    Levenberg–Marquardt damped."""
    tx = optax.chain(lbp.scale_by_gauss_newton(damping=1e-3, maxiter=maxiter, solver="cg", min_damping=1e-12,
                                               tol=1e-10),
                     optax.scale(-1.0))

    @jit
    def step(state):
        p, s = state
        value, grad, G = lbp.gauss_newton(loss)(p, points)
        updates, s = tx.update(grad, s, p, curvature=G, value=value, value_fn=lambda q: loss(q, points))
        return optax.apply_updates(p, updates), s

    return step, (params, tx.init(params))


def kfac(loss, params, points, approximation: str = "expand"):
    """KFAC* (``lbp.kfac``) on the loss of two calls (`two_call_loss`): a Kronecker pair per call."""
    # inverses every step (kfac-pinns' T_inv = 1): on 2-64-1 better per second than every 5th.
    # Two terms take λ into each factor as √(λ/2) (π-scaled): the floor 1e-20 lets that reach
    # ≈ 1e-10, kfac-pinns' damping of each factor; at 1e-12 (≈ 1e-6 a factor) K-FAC stalled
    # near 5e-7 where 1e-20 went on to 2e-7 (60,000 steps each).
    opt = lbp.kfac(damping=1e-3, decay=0.95, update_every=1, min_damping=1e-20)

    @jit
    def step(state):
        p, s = state
        value, grad, G = lbp.gauss_newton(loss)(p, points)
        factors = lbp.kfac_factors(loss, approximation=approximation)(p, points)
        updates, s = opt.update(grad, s, p, factors=factors, curvature=G, value=value,
                                value_fn=lambda q, **_: loss(q, points))
        return optax.apply_updates(p, updates), s

    state = (params, opt.init(params))
    return step, step(state)  # the first step makes K-FAC's state (its factors' structure)


def adam(loss, params, points, learning_rate: float):
    tx = optax.adam(learning_rate)

    @jit
    def step(state):
        p, s = state
        updates, s = tx.update(lbp.grad_by_solve(loss)(p, points), s, p)
        return optax.apply_updates(p, updates), s

    return step, (params, tx.init(params))


def run(step, state, error, seconds: float, overhead: float = 0.05,
        clock=time.perf_counter, max_steps: int = 0) -> tuple[np.ndarray, np.ndarray, int, float]:
    """Steps for ``seconds`` of step time (after compiling): (seconds, L2 error) after some of the
    steps, how many steps, and the seconds the first call took (compiling, excluded from the budget).

    The error is measured after a step once the step time since the last measurement is at least
    its own cost over ``overhead``, and after the last step: a cheap step (Adam's) is not measured
    after each one, so the wall time stays near the budget instead of doubling. ``clock``: wall
    time by default; ``time.process_time`` counts this process's CPU seconds (all its threads), a
    budget that another process's load does not shrink. ``max_steps``: stop after that many steps
    instead (0: the seconds decide)."""
    began = clock()
    state = jax.block_until_ready(step(state))  # compile
    compiled = clock() - began
    error(state[0]).block_until_ready()  # compile
    start = clock()
    times, errors = [0.0], [float(error(state[0]))]
    cost = clock() - start
    spent, measured, steps = 0.0, 0.0, 0
    while (steps < max_steps) if max_steps else (spent < seconds):
        start = clock()
        state = jax.block_until_ready(step(state))
        spent += clock() - start
        steps += 1
        if spent - measured >= cost / overhead or spent >= seconds or steps == max_steps:
            start = clock()
            times.append(spent)
            errors.append(float(error(state[0])))
            cost, measured = clock() - start, spent
    return np.array(times), np.array(errors), steps, compiled


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=_Help)
    parser.add_argument("--seconds", type=float, default=30.0, help="step time of each method")
    parser.add_argument("--widths", default="64", help="hidden widths, e.g. 64 or 64,64,48,48")
    parser.add_argument("--methods", default="probe,engd,hessian-free,kfac,adam",
                        help="any of probe, engd, hessian-free, kfac, adam")
    parser.add_argument("--kfac-approximation", default="expand", choices=("expand", "reduce"),
                        help="K-FAC's factors of the weights shared by u, ∇u and Δu")
    parser.add_argument("--out", default="pinn_poisson.png", help="PNG of the error curves ('' for none)")
    parser.add_argument("--seed", type=int, default=0, help="the initial parameters' seed (the points stay)")
    parser.add_argument("--init", default="",
                        help="uniform (equinox's ±1/√fan_in weights and biases), normal (normal/√fan_in weights, "
                             "zero biases), or an .npz of W0, b0, W1, b1, … (Wi of shape (fan_in, fan_out)); "
                             "'' for the example's own start")
    parser.add_argument("--steps", type=int, default=0,
                        help="each method runs this many steps instead of --seconds (0: the seconds decide)")
    parser.add_argument("--clock", default="wall", choices=("wall", "cpu"),
                        help="the budget's clock: wall time, or this process's CPU time (steady under others' load)")
    args = parser.parse_args(argv)
    widths = tuple(int(w) for w in args.widths.split(","))
    params, points, loss, error, scale = make_problem(widths)
    if args.init:
        params = initial_parameters(widths, args.init, args.seed)
    elif args.seed:
        params = make_problem(widths, seed=args.seed)[0]
    n = sum(x.size for x in jax.tree.leaves(params))
    methods = args.methods.split(",")
    budget = f"{args.steps} steps" if args.steps else f"{args.seconds:g} s"
    print(f"2-{'-'.join(map(str, widths))}-1: {n} parameters, {points.shape[0]} points, {budget} per method"
          f" (jax {jax.__version__}, compiler options {CPU_OPTIONS or 'default'}"
          f"{'; the Woodbury ENGD step with XLA defaults' if CPU_OPTIONS and points.shape[0] < n else ''})")
    runs = {}
    if "engd" in methods:
        solver = "Woodbury" if points.shape[0] < n else "dense"
        runs[f"ENGD ({solver})"] = lambda: engd(loss, params, points)
    if "probe" in methods:
        runs["Gauss–Newton, probed (SVD)"] = lambda: probed(residual_terms(widths), params, points)
    if "hessian-free" in methods:
        runs["Hessian-free (CG)"] = lambda: hessian_free(loss, params, points)
    if "kfac" in methods:
        terms = two_call_loss(widths, interior=900)
        runs["K-FAC (KFAC*)"] = lambda: kfac(terms, params, points, approximation=args.kfac_approximation)
    if "adam" in methods:
        for lr in (1e-3, 3e-3, 1e-2):
            runs[f"Adam, lr {lr:g}"] = lambda lr=lr: adam(loss, params, points, lr)
    curves, result = {}, {}
    for name, make in runs.items():
        times, errors, steps, compiled = run(*make(), error, args.seconds,
                                             clock=time.process_time if args.clock == "cpu" else time.perf_counter,
                                             max_steps=args.steps)
        curves[name], result[name] = (times, errors), float(np.nanmin(errors))
        at = {s: float(np.nanmin(errors[times <= s])) for s in (10.0, 30.0, 100.0)
              if s < args.seconds and not args.steps}
        print(f"{name:26s} {steps:7d} steps  L2 error {result[name]:.2e}  relative {result[name] / scale:.2e}"
              f"  compile {compiled:.1f} s" + "".join(f"  ({e:.2e} at {s:g} s)" for s, e in at.items()),
              flush=True)
    if args.out:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.4, 4))
        for name, (times, errors) in curves.items():
            ax.loglog(np.maximum(times, 1e-2), np.fmin.accumulate(errors), label=name,
                      lw=1 if name.startswith("Adam") else 2)
        ax.set_xlabel("seconds in the steps")
        ax.set_ylabel("L2 error")
        ax.set_title(f"Poisson 2-d, tanh MLP 2-{'-'.join(map(str, widths))}-1 ({n} parameters), float64")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.out, dpi=110)
        print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
