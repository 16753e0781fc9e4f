"""kfac-jax's optimizer on the digits MLP of ``--rows kfac``, for the side-by-side in the training
guide. It runs in an environment of its own: kfac-jax 0.0.8 needs JAX ≤ 0.7, linbackprop needs
0.10 or newer, so the two cannot share a process.

    python3.11 -m venv /tmp/kfj && /tmp/kfj/bin/pip install "kfac-jax==0.0.8" "jax[cpu]==0.7.0" scikit-learn
    OPENBLAS_NUM_THREADS=1 /tmp/kfj/bin/python benchmarks/kfac_jax_digits.py [--steps 100]

The same network (tanh MLP 64-128-128-10, full batch of 1,797 images, float32, the same
initialisation as ``kfac_rows.digits_problem``), kfac-jax's adaptive learning rate, momentum and
damping (KFAC*, as ``lbp.kfac``'s defaults: initial damping 1e-3, decay 0.95, inverses every 5
steps, λ adapted every 5 steps by 0.95⁵ — kfac-jax's own default is 0.9⁵ —, its default estimator
``ggn_curvature_prop``: random vectors through H's root, one per example). Prints the loss every 10 steps and
the median time per step after the first two (they compile).
"""

from __future__ import annotations

import argparse
import itertools
import time

import jax
import jax.numpy as jnp
import kfac_jax
from sklearn.datasets import load_digits

SIZES = (64, 128, 128, 10)


def main(steps: int = 100) -> dict:
    images, labels = load_digits(return_X_y=True)
    x, y = jnp.asarray(images / 16.0, jnp.float32), jnp.asarray(labels)
    keys = jax.random.split(jax.random.key(0), len(SIZES) - 1)  # kfac_rows.digits_problem's
    params = {}
    for i, (m, n) in enumerate(itertools.pairwise(SIZES)):
        params[f"W{i}"] = jax.random.normal(keys[i], (m, n), jnp.float32) / jnp.sqrt(m)
        params[f"b{i}"] = jnp.zeros(n, jnp.float32)

    def logits(p, x):
        h = x
        for i in range(len(SIZES) - 1):
            h = h @ p[f"W{i}"] + p[f"b{i}"]
            h = jnp.tanh(h) if i < len(SIZES) - 2 else h
        return h

    def loss(p, batch):
        x, y = batch
        out = logits(p, x)
        kfac_jax.register_softmax_cross_entropy_loss(out, y)
        logp = jax.nn.log_softmax(out)
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))

    optimizer = kfac_jax.Optimizer(
        value_and_grad_func=jax.value_and_grad(loss), l2_reg=0.0, use_adaptive_learning_rate=True,
        use_adaptive_momentum=True, use_adaptive_damping=True, initial_damping=1e-3, curvature_ema=0.95,
        inverse_update_period=5, damping_adaptation_interval=5, damping_adaptation_decay=0.95, num_burnin_steps=0,
        multi_device=False)
    rng = jax.random.key(1)
    state = optimizer.init(params, rng, (x, y))
    losses, times = [], []
    for n in range(steps):
        rng, key = jax.random.split(rng)
        start = time.perf_counter()
        params, state, stats = optimizer.step(params, state, key, batch=(x, y), global_step_int=n)
        jax.block_until_ready(params)
        times.append(time.perf_counter() - start)
        losses.append(float(stats["loss"]))
        if (n + 1) % 10 == 0:
            print(f"step {n + 1:4d}: loss {losses[-1]:.3e}", flush=True)
    # the median: kfac-jax compiles a step of each kind (inverses, damping adaptation) on first use
    median = sorted(times[2:])[len(times[2:]) // 2]
    final = float(loss(params, (x, y)))
    print(f"kfac-jax {kfac_jax.__version__}, jax {jax.__version__}: loss after {steps} steps {final:.3e}, "
          f"{median * 1e3:.2f} ms per step (median), {sum(times[2:]) / len(times[2:]) * 1e3:.2f} ms (mean)")
    return {"losses": losses, "final_loss": final, "ms_per_step": median * 1e3}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    main(parser.parse_args().steps)
