"""The probed Gauss–Newton step from many starts: examples/pinn_poisson.py's problem (900 + 120
points, float64), each start trained for the same seconds of steps (compile excluded), the least
L2 error by 5, 10, 20, 30, 100 and 300 s (those within the budget) and at the end, then the
median and the worst — and the ablation of its rule: the step with one ingredient changed.

    python -m benchmarks.pinn_starts [--seconds 30] [--starts uniform:0-7,normal:0-7]
        [--widths 64] [--variant library|longest|unsafe|nearest|sketch] [--target 0.075] [--probes 24]
        [--sketch ROWS] [--float32-steps N]
        [--out FILE.png]

Variants (written here from their descriptions, on the same SVD of the residuals' rows):
``library`` is ``lbp.scale_by_gauss_newton(step="probe")``; ``longest`` is the rule before it (a
grid of damping values λ_c·10^[−3, 3] around the last, the longest candidate with ρ ≥ 0.1);
``unsafe`` the radius rule on the raw gain ratios (the largest probe radius with ρ ≥ target,
interpolated towards the next) instead of their running minimum; ``nearest`` the safe rule's last
probe above the target, with no interpolation and no extra evaluation; ``sketch`` the safe rule on
a fresh count sketch of the rows every step (DSGNAR's: each row into 4 of 2,000 buckets, signs ±½),
the gain ratios still of the true loss.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

import linbackprop as lbp

from . import example

jax.config.update("jax_enable_x64", True)
MARKS = (5.0, 10.0, 20.0, 30.0, 100.0, 300.0)


def starts(spec: str) -> list[tuple[str, int]]:
    """``uniform:0-7,normal:0-7`` → [("uniform", 0), …, ("normal", 7)]."""
    out = []
    for part in spec.split(","):
        init, seeds = part.split(":")
        first, _, last = seeds.partition("-")
        out += [(init, seed) for seed in range(int(first), int(last or first) + 1)]
    return out


def library_step(pinn, terms, points, target: float, probes: int, float32_steps: int = 0,
                 sketch: int | None = None):
    """The example's probed step (``terms=``), with the rule's target and probes given: for each
    start, (step, its first state). ``float32_steps``: DSGNAR's first pass, that many steps with
    the parameters and points in float32, then float64 from where they got (the trust radius
    carried over)."""
    if not float32_steps:
        return lambda params: pinn.probed(terms, params, points, probes, target, sketch)

    def start(params):
        cast = lambda tree, dtype: jax.tree.map(lambda x: x.astype(dtype), tree)
        low, state = pinn.probed(terms, cast(params, jnp.float32), points.astype(jnp.float32), probes, target,
                                 sketch)
        high, first64 = pinn.probed(terms, params, points, probes, target, sketch)
        jax.block_until_ready(high(first64))  # compiled here: the switch's compile is not a step's time
        taken = [-1]  # run_start's compiling call of the float32 step is not one of the steps

        def step(state):
            if taken[0] < float32_steps:
                taken[0] += 1
                return low(state)
            if state[0][next(iter(state[0]))].dtype == jnp.float32:  # the switch: cast back, Δ kept
                p = cast(state[0], jnp.float64)
                fresh = pinn.probed(terms, p, points, probes, target, sketch)[1][1]
                inner = fresh[0]._replace(radius=jnp.asarray(state[1][0].radius, jnp.float64), key=state[1][0].key)
                state = (p, (inner, *fresh[1:]))
            return high(state)

        return step, state

    return start


def variant_step(pinn, loss, points, variant: str, target: float, probes: int):
    """A variant of the rule (module docstring) on the thin SVD of the rows, from the residuals."""

    def candidates(svd, lams):  # the directions and their predicted decreases
        c, s, vt = svd
        e = c / (s ** 2 + lams[:, None])
        return e @ vt, e @ c - 0.5 * jnp.sum((s * e) ** 2, axis=1)

    def for_radius(c, s, radii):  # bisection on log λ: ‖e(λ)‖ falls with λ
        lo, hi = jnp.full(radii.shape, jnp.log(1e-300)), jnp.full(radii.shape, jnp.log(1e8))
        for _ in range(64):
            mid = 0.5 * (lo + hi)
            longer = jnp.linalg.norm(c / (s ** 2 + jnp.exp(mid)[:, None]), axis=1) > radii
            lo, hi = jnp.where(longer, mid, lo), jnp.where(longer, hi, mid)
        return jnp.exp(hi)

    def count_sketch(key, k, b, size=2000, hashes=4):  # DSGNAR's row sketch: each row to 4 buckets, ±1/2
        buckets = jax.random.randint(key, (hashes, k.shape[0]), 0, size)
        signs = jax.random.rademacher(jax.random.fold_in(key, 1), (hashes, k.shape[0]), k.dtype) / hashes ** 0.5
        sketch = lambda x: sum(jax.ops.segment_sum(signs[j].reshape(-1, *[1] * (x.ndim - 1)) * x, buckets[j], size)
                               for j in range(hashes))
        return sketch(k), sketch(b)

    @pinn.jit
    def step(state):
        p, centre, key = state
        key, fresh = jax.random.split(key)
        flat, unravel = ravel_pytree(p)
        rows, b = lbp.ggn_factor(loss, rank=1, residuals=True)(p, points)
        k = jax.vmap(lambda r: ravel_pytree(r)[0])(rows)
        if variant == "sketch":  # a fresh sketch of the rows every step: the model's metric moves
            k, b = count_sketch(fresh, k, b)
        value_of = lambda d: loss(unravel(flat - d), points)
        before = loss(p, points)
        u, sv, vt = jnp.linalg.svd(k, full_matrices=False)
        svd = (sv * (u.T @ b), sv, vt)
        if variant == "longest":  # centre is λ_c
            lams = centre * 10.0 ** jnp.linspace(-3.0, 3.0, 32)
            d, predicted = candidates(svd, lams)
            after = jax.lax.map(value_of, d, batch_size=8)
            ok = (after < before) & (predicted > 0) & ((before - after) / predicted >= 0.1)
            best = jnp.argmin(jnp.where(ok, jnp.arange(32), 32))
            found = jnp.any(ok)
            return (unravel(jnp.where(found, flat - d[best], flat)),
                    jnp.where(found, lams[best], centre * 1e3), key)
        radii = centre * 3.0 ** jnp.linspace(-1.0, 1.0, probes)  # centre is Δ
        d, predicted = candidates(svd, for_radius(svd[0], sv, radii))
        after = jax.lax.map(value_of, d, batch_size=8)
        rho = jnp.where(jnp.isfinite(after) & (predicted > 0),
                        jnp.clip((before - after) / jnp.where(predicted > 0, predicted, 1.0), -1, 1), -1.0)
        ratio = rho if variant == "unsafe" else jax.lax.cummin(rho)
        above = ratio >= target
        last = jnp.max(jnp.where(above, jnp.arange(probes), -1))
        if variant == "nearest":
            found = last >= 0
            grown = jnp.where(last == probes - 1, radii[-1], radii[jnp.maximum(last, 0)])
            return (unravel(jnp.where(found, flat - d[jnp.maximum(last, 0)], flat)),
                    jnp.where(found, grown, radii[0]), key)
        following = jnp.minimum(last + 1, probes - 1)
        at = jnp.maximum(last, 0)
        share = jnp.clip((ratio[at] - target) / jnp.maximum(ratio[at] - ratio[following], 1e-300), 0, 1)
        crossing = jnp.where(last == probes - 1, radii[-1], radii[at] * (radii[following] / radii[at]) ** share)
        chosen, _ = candidates(svd, for_radius(svd[0], sv, crossing[None]))
        lower = value_of(chosen[0]) < before
        new = jnp.where(last < 0, flat, jnp.where(lower, flat - chosen[0], flat - d[at]))
        return unravel(new), jnp.maximum(jnp.where(last < 0, radii[0], jnp.where(lower, crossing, radii[at])),
                                         1e-16 * jnp.linalg.norm(flat)), key

    def start(params):
        flat = ravel_pytree(params)[0]
        centre = jnp.asarray(1e-3 if variant == "longest" else 0.1 * jnp.linalg.norm(flat))
        return step, (params, centre, jax.random.key(0))

    return start


def run_start(pinn, make, error, params, seconds: float, marks: tuple[float, ...]):
    """The least error by each of ``marks`` and after ``seconds`` of steps, the steps taken, and
    the curve (seconds, least error so far) every 10 steps."""
    step, state = make(params)
    jax.block_until_ready(step(state))  # compile (this first step is not counted)
    at, best, steps, spent = [], float(error(state[0])), 0, 0.0
    curve = [(0.0, best)]
    while spent < seconds:
        began = time.perf_counter()
        state = jax.block_until_ready(step(state))
        spent += time.perf_counter() - began
        steps += 1
        if steps % 10 == 0 or spent >= seconds:
            best = min(best, float(error(state[0])))
            curve.append((spent, best))
            while len(at) < len(marks) and spent >= marks[len(at)]:
                at.append(best)
    return at + [best] * (len(marks) - len(at)), best, steps, np.array(curve), state[0]


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="step time per start")
    parser.add_argument("--starts", default="uniform:0-7,normal:0-7", help="init:seeds, comma-separated")
    parser.add_argument("--widths", default="64", help="hidden widths, e.g. 64 or 64,64,48,48")
    parser.add_argument("--variant", default="library", choices=("library", "longest", "unsafe", "nearest", "sketch"))
    parser.add_argument("--target", type=float, default=0.075, help="the safe gain ratio's target")
    parser.add_argument("--probes", type=int, default=24, help="trust radii probed a step")
    parser.add_argument("--sketch", type=int, default=0, help="library: rows of the row sketch (0: none)")
    parser.add_argument("--float32-steps", type=int, default=0,
                        help="library: this many first steps in float32 (DSGNAR's first pass), then float64")
    parser.add_argument("--out", default="", help="a PNG of every start's error curve ('' for none)")
    parser.add_argument("--verbose", action="store_true", help="also each start's last loss on the fitted points")
    args = parser.parse_args(argv)
    pinn = example("pinn_poisson")
    widths = tuple(int(w) for w in args.widths.split(","))
    _, points, loss, error, scale = pinn.make_problem(widths)
    if args.variant == "library":
        make = library_step(pinn, pinn.residual_terms(widths), points, args.target, args.probes, args.float32_steps,
                            args.sketch or None)
    else:
        make = variant_step(pinn, loss, points, args.variant, args.target, args.probes)
    marks = [m for m in MARKS if m <= args.seconds]
    print(f"2-{'-'.join(map(str, widths))}-1, variant {args.variant}, target {args.target}, {args.probes} probes, "
          f"sketch {args.sketch or 'none'} (library), {args.float32_steps} float32 steps, "
          f"{args.seconds:g} s a start (jax {jax.__version__})")
    last = " | last loss" if args.verbose else ""
    print("| start | " + " | ".join(f"{m:g} s" for m in marks) + f" | least | steps{last} |")
    print("|---" * (len(marks) + 3 + args.verbose) + "|")
    finals, curves = [], {}
    for init, seed in starts(args.starts):
        params = pinn.initial_parameters(widths, init, seed)
        at, best, steps, curves[f"{init} {seed}"], final = run_start(pinn, make, error, params, args.seconds,
                                                                      tuple(marks))
        finals.append(best)
        cells = [f"{init} {seed}", *(f"{e:.1e}" for e in at[:len(marks)]), f"{best:.1e}", str(steps)]
        if args.verbose:
            cells.append(f"{float(loss(final, points)):.2e}")
        print("| " + " | ".join(cells) + " |", flush=True)
    print(f"median {np.median(finals):.1e}, worst {np.max(finals):.1e} (L2 error; relative: ÷ {scale:.3f})")
    if args.out:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.4, 4))
        for name, curve in curves.items():
            ax.loglog(np.maximum(curve[:, 0], 1e-1), curve[:, 1], lw=1, color="C0" if "uniform" in name else "C1")
        ax.plot([], [], color="C0", label="uniform starts")
        ax.plot([], [], color="C1", label="normal starts")
        ax.set_xlabel("seconds in the steps")
        ax.set_ylabel("L2 error (least so far)")
        ax.set_title(f"2-{'-'.join(map(str, widths))}-1 Poisson, probed Gauss–Newton ({args.variant}), "
                     f"{len(curves)} starts", fontsize=10)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.out, dpi=110)
        print(f"wrote {args.out}")
    return finals


if __name__ == "__main__":
    main()
