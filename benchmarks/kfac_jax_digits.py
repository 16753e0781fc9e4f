"""kfac-jax's optimizer on the digits MLP of ``--rows kfac``: its half of the time-to-loss table
(``benchmarks/kfac_time_to_loss.py``). It runs in an environment of its own: kfac-jax 0.0.8 needs
JAX ≤ 0.7, linbackprop needs 0.10 or newer, so the two cannot share a process.

    python3.11 -m venv /tmp/kfj && /tmp/kfj/bin/pip install "kfac-jax==0.0.8" "jax[cpu]==0.7.0" scikit-learn
    OPENBLAS_NUM_THREADS=1 /tmp/kfj/bin/python benchmarks/kfac_jax_digits.py --out kfac_jax.json
    OPENBLAS_NUM_THREADS=1 /tmp/kfj/bin/python benchmarks/kfac_jax_digits.py --problem cnn --steps 8 \
        --seeds 1 --warmup 6 --decays 0.95 --out kfac_jax_cnn.json

The same network (tanh MLP 64-128-128-10, full batch of 1,797 images, float32, the same
initialisation as ``kfac_rows.digits_problem(seed)``), kfac-jax's adaptive learning rate,
momentum and damping (KFAC*, as ``lbp.kfac``'s defaults: initial damping 1e-3, curvature decay
0.95, inverses every 5 steps, λ adapted every 5 steps) with its default estimator
``ggn_curvature_prop`` (random vectors through the loss's Hessian root, one per example) and its
inverses of the π-damped factors (LU, ``jnp.linalg.inv``). Two settings of λ's adaptation:
0.95⁵ per adaptation (``lbp.kfac``'s) and kfac-jax's own default 0.9⁵.

As users time it: kfac-jax compiles one program per kind of step (a plain step, one that also
updates the inverses, one that also adapts the damping); each seed's run is made once to warm
all of them (its wall time less the timed run's step time is the compile column), then again
from the start, timed. The loss at step n is the loss at θ_n, before step n (kfac-jax's
``stats["loss"]``, as ``lbp.kfac``'s step returns it), with step n's time spent after it.
Writes one JSON record per (setting, seed): the losses, the step times and the compile time.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import kfac_jax
from digits_problems import SIZES, cnn_params, digits, mean_cross_entropy, mlp_params


def problem(seed: int) -> tuple:
    """The loss (registered for kfac-jax), the initial parameters and the full batch: the MLP of
    ``kfac_rows.digits_problem``, the same initialisation (`digits_problems`)."""

    def loss(p, batch):
        x, y = batch
        h = x
        for i in range(len(SIZES) - 1):
            h = h @ p[f"W{i}"] + p[f"b{i}"]
            h = jnp.tanh(h) if i < len(SIZES) - 2 else h
        kfac_jax.register_softmax_cross_entropy_loss(h, y)
        return mean_cross_entropy(h, y)

    return loss, mlp_params(seed), digits()


def cnn_problem(seed: int) -> tuple:
    """The digits CNN of ``kfac_time_to_loss.py --problem cnn`` (``kfac_rows.digits_cnn_problem``:
    8×8×1 → conv 3×3 16 → conv 3×3 32, SAME, tanh → dense 10), the same initialisation; kfac-jax
    finds the convolutions and the dense layer by its graph matching."""
    conv = lambda u, k, b: jnp.tanh(jax.lax.conv_general_dilated(
        u, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")) + b)

    def loss(p, batch):
        x, y = batch
        h = conv(conv(x, p["K1"], p["k1"]), p["K2"], p["k2"])
        h = h.reshape(h.shape[0], -1) @ p["H"] + p["h"]
        kfac_jax.register_softmax_cross_entropy_loss(h, y)
        return mean_cross_entropy(h, y)

    return loss, cnn_params(seed), digits((-1, 8, 8, 1))


def run(optimizer, params: dict, batch: tuple, steps: int) -> tuple[list[float], list[float]]:
    """``steps`` steps from ``params``: the loss at θ_n and step n's seconds, each step waited for."""
    rng = jax.random.key(1)
    params = jax.tree.map(jnp.copy, params)  # kfac-jax's step donates its arguments' buffers
    state = optimizer.init(params, rng, batch)
    losses, times = [], []
    for n in range(steps):
        rng, key = jax.random.split(rng)
        start = time.perf_counter()
        params, state, stats = optimizer.step(params, state, key, batch=batch, global_step_int=n)
        jax.block_until_ready((params, state))
        times.append(time.perf_counter() - start)
        losses.append(float(stats["loss"]))
    return losses, times


def main(steps: int, seeds: int, out: str | None, which: str = "mlp", warmup: int = 11,
         decays: tuple[float, ...] = (0.95, 0.9)) -> list[dict]:
    records = []
    for decay in decays:
        for seed in range(seeds):
            loss, params, batch = (problem if which == "mlp" else cnn_problem)(seed)
            optimizer = kfac_jax.Optimizer(
                value_and_grad_func=jax.value_and_grad(loss), l2_reg=0.0, use_adaptive_learning_rate=True,
                use_adaptive_momentum=True, use_adaptive_damping=True, initial_damping=1e-3, curvature_ema=0.95,
                inverse_update_period=5, damping_adaptation_interval=5, damping_adaptation_decay=decay,
                num_burnin_steps=0, multi_device=False)
            start = time.perf_counter()
            run(optimizer, params, batch, warmup)  # every kind of step, compiled: the warm-up run
            warm = time.perf_counter() - start
            losses, times = run(optimizer, params, batch, steps)
            compile_s = warm - sum(times[:warmup])
            name = f"kfac-jax {kfac_jax.__version__} (λ × {decay}⁵{', its default' if decay == 0.9 else ''})"
            records.append({"name": name, "seed": seed, "losses": losses, "times": times, "compile": compile_s,
                            "jax": jax.__version__})
            print(f"{name}, seed {seed}: loss {losses[-1]:.3e} after {steps} steps, mean step "
                  f"{sum(times) / len(times) * 1e3:.2f} ms, compile {compile_s:.2f} s", flush=True)
    if out:
        with open(out, "w") as f:
            json.dump(records, f)
    return records


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--out", default="kfac_jax.json", help="the JSON records ('' for none)")
    parser.add_argument("--problem", choices=["mlp", "cnn"], default="mlp",
                        help="the digits MLP, or the digits CNN (its steps take seconds here: few steps, one seed)")
    parser.add_argument("--warmup", type=int, default=11,
                        help="the warm-up run's steps (every kind of step; 6 covers them: steps 0 and 5 update "
                             "the inverses and the damping)")
    parser.add_argument("--decays", default="0.95,0.9", help="λ's adaptation settings, comma-separated")
    args = parser.parse_args()
    main(args.steps, args.seeds, args.out, args.problem, args.warmup,
         tuple(float(d) for d in args.decays.split(",")))
