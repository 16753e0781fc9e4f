"""Time to a target loss on the digits MLP of ``--rows kfac`` (or ``--problem cnn``: the digits
CNN, conv 3×3 16 → conv 3×3 32 → dense 10), as users time it: ``lbp.kfac`` (one pass; its
``inverse`` options), kfac-jax (its records from ``benchmarks/kfac_jax_digits.py``, run in its
own environment), Adam and ``optax.contrib.muon`` (each the best rate of a grid whose best is
inside it), five seeds each by default.

    OPENBLAS_NUM_THREADS=1 <kfac-jax env>/bin/python benchmarks/kfac_jax_digits.py --out kfac_jax.json
    OPENBLAS_NUM_THREADS=1 python benchmarks/kfac_time_to_loss.py --kfac-jax kfac_jax.json
    OPENBLAS_NUM_THREADS=1 python benchmarks/kfac_time_to_loss.py --problem cnn --seeds 2 \
        --kfac-steps 40 --first-order-steps 250 --rates 0.003,0.01,0.03 --inverses exact,factored

For every run: compile excluded (each seed's run is made once to compile every program it uses,
then again from the start, timed; the first run's wall time less the timed run's step time is
the compile column), the loss at step n is the loss at θ_n before step n (what each optimizer's
step returns), and the seconds to a target are the summed step times before the first step whose
loss is at or below it. The table gives the median over the seeds (a seed that does not reach a
target within its steps counts as never: "—" where most do not).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the package from the repository
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np
import optax

import linbackprop as lbp
from benchmarks.kfac_rows import digits_cnn_problem, digits_problem

PROBLEMS = {"mlp": digits_problem, "cnn": digits_cnn_problem}

TARGETS = (1e-2, 1e-3, 1e-4)
RATES = (1e-3, 3e-3, 1e-2, 3e-2, 1e-1)  # Adam's and Muon's grid: each best rate inside it


def timed(step, carry: tuple, steps: int) -> tuple[list[float], list[float], float]:
    """``steps`` steps from ``carry``, twice: the losses and step seconds of the second, timed run,
    and the first run's extra wall time (compile)."""
    def once(carry):
        losses, times = [], []
        for n in range(steps):
            start = time.perf_counter()
            carry = jax.block_until_ready(step(*carry, n))
            times.append(time.perf_counter() - start)
            losses.append(float(carry[-1]))
        return losses, times

    start = time.perf_counter()
    once(carry)
    first = time.perf_counter() - start
    losses, times = once(carry)
    return losses, times, first - sum(times)


def kfac_run(problem: str, seed: int, steps: int, damping_decay: float = 0.95, inverse: str = "exact") -> tuple:
    loss, params, batch = PROBLEMS[problem](seed)
    shapes = jax.eval_shape(lambda p: lbp.gauss_newton(loss, factors=True, samples=1, key=jax.random.key(0))(
        p, *batch)[2].factors, params)
    # the state's structure from init: one program, no second trace
    opt = lbp.kfac(factors=shapes, damping_decay=damping_decay, inverse=inverse)

    @jax.jit
    def step(p, state, _value, n):
        key = jax.random.fold_in(jax.random.key(1), n)
        value, grad, G = lbp.gauss_newton(loss, factors=True, samples=1, key=key)(p, *batch)
        updates, state = opt.update(grad, state, p, curvature=G)
        return optax.apply_updates(p, updates), state, value

    return timed(step, (params, opt.init(params), jnp.zeros((), jnp.float32)), steps)


def first_order_run(problem: str, make, rate: float, seed: int, steps: int) -> tuple:
    loss, params, batch = PROBLEMS[problem](seed)
    tx = make(rate)

    @jax.jit
    def step(p, state, _value, n):
        value, grad = lbp.value_and_grad_by_solve(loss)(p, *batch)
        updates, state = tx.update(grad, state, p)
        return optax.apply_updates(p, updates), state, value

    return timed(step, (params, tx.init(params), jnp.zeros((), jnp.float32)), steps)


def seconds_to(losses: list[float], times: list[float], target: float) -> float:
    hit = next((n for n, value in enumerate(losses) if value <= target), None)
    return math.inf if hit is None else float(sum(times[:hit]))


def summary(name: str, runs: list[dict]) -> str:
    cells = []
    for target in TARGETS:
        t = float(np.median([seconds_to(r["losses"], r["times"], target) for r in runs]))
        cells.append("—" if math.isinf(t) else f"{t:.3f}")
    mean_step = np.mean([np.mean(r["times"]) for r in runs]) * 1e3
    compile_s = float(np.median([r["compile"] for r in runs]))
    return f"| {name} | " + " | ".join(cells) + f" | {compile_s:.1f} | {mean_step:.2f} |"


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problem", choices=sorted(PROBLEMS), default="mlp")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--kfac-steps", type=int, default=150)
    parser.add_argument("--first-order-steps", type=int, default=1000)
    parser.add_argument("--kfac-jax", default="", help="kfac_jax_digits.py's JSON records ('' for none)")
    parser.add_argument("--rates", default=",".join(f"{r:g}" for r in RATES),
                        help="Adam's and Muon's grid ('none': neither)")
    parser.add_argument("--damping-decays", default="0.95,0.9", help="lbp.kfac's damping_decay values")
    parser.add_argument("--inverses", default="exact", help="lbp.kfac's inverse values ('exact', 'factored')")
    parser.add_argument("--out", default="", help="a JSON file for every run's losses and step times")
    args = parser.parse_args(argv)
    groups: dict[str, list[dict]] = {}
    names = {0.95: "`lbp.kfac()` (one pass, one sampled column; λ × 0.95⁵, its default)"}
    for inverse in args.inverses.split(",") if args.kfac_steps else ():  # --kfac-steps 0: first-order only
        for decay in (float(d) for d in args.damping_decays.split(",")):
            name = names.get(decay, f"`lbp.kfac(damping_decay={decay:g})` (λ × {decay:g}⁵)")
            if inverse != "exact":
                name = f"`lbp.kfac(inverse={inverse!r}" + (")`" if decay == 0.95 else f", damping_decay={decay:g})`")
            for seed in range(args.seeds):
                losses, times, compile_s = kfac_run(args.problem, seed, args.kfac_steps, decay, inverse)
                groups.setdefault(name, []).append({"losses": losses, "times": times, "compile": compile_s})
    if args.kfac_jax:
        for record in json.loads(Path(args.kfac_jax).read_text()):
            groups.setdefault(record["name"] + f" on JAX {record['jax']}", []).append(record)
    makers = {"Adam": optax.adam, "Muon (`optax.contrib.muon`)": optax.contrib.muon} if args.rates != "none" else {}
    rates = () if args.rates == "none" else tuple(float(r) for r in args.rates.split(","))
    for name, make in makers.items():
        by_rate = {}
        for rate in rates:
            by_rate[rate] = [dict(zip(("losses", "times", "compile"),
                                      first_order_run(args.problem, make, rate, seed, args.first_order_steps)))
                             for seed in range(args.seeds)]
        best = min(rates, key=lambda r: np.median([run["losses"][-1] for run in by_rate[r]]))
        edge = " (at the grid's edge)" if best in (rates[0], rates[-1]) else ""
        groups[f"{name}, lr {best:g} (best of {', '.join(f'{r:g}' for r in rates)}){edge}"] = by_rate[best]
    lines = [f"`OPENBLAS_NUM_THREADS={__import__('os').environ.get('OPENBLAS_NUM_THREADS', 'unset')} python "
             f"benchmarks/kfac_time_to_loss.py {' '.join(argv if argv is not None else sys.argv[1:])}"
             f"`, JAX {jax.__version__}:",
             "", "| optimizer | s to 1e-2 | s to 1e-3 | s to 1e-4 | compile (s) | mean step (ms) |",
             "|---|---|---|---|---|---|"]
    lines += [summary(name, runs) for name, runs in groups.items()]
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text(json.dumps(groups))
    return lines


if __name__ == "__main__":
    main()
