"""K-FAC on scikit-learn's digits (``python benchmarks/run.py --rows kfac``): ``lbp.kfac`` against
Adam on a tanh MLP 64-128-128-10, full batch (1,797 images), float32.

The rows: K-FAC's loss after 100 steps against the best of three Adam rates after 250 steps, and
the time of a K-FAC step (fresh factors from one sampled column per example, the gradient with G,
the two G products of the step size and momentum, the inverses every ``update_every`` steps)
against a gradient + Adam step, both averaged over their whole runs (the late steps included:
the factors' cost changes as the softmax saturates), then each part of the step against one
gradient, early (the initial parameters) and late (after K-FAC's 100 steps), as interleaved
medians.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

import linbackprop as lbp

from .timing import interleaved, seconds_per_step

SIZES = (64, 128, 128, 10)
ADAM_RATES = (1e-3, 3e-3, 1e-2)


def digits_problem() -> tuple[Callable, dict, tuple]:
    """The loss (mean cross-entropy of the MLP), its initial parameters and the full batch."""
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    x, y = jnp.asarray(images / 16.0, jnp.float32), jnp.asarray(labels)
    dense = lambda th, u: jnp.tanh(u @ th[0] + th[1])
    head = lambda th, u: u @ th[0] + th[1]
    layers = [lbp.Layer(i + 1, dense if i < len(SIZES) - 2 else head, (i,), (f"W{i}", f"b{i}"))
              for i in range(len(SIZES) - 1)]
    net = lbp.Network(layers, [0], len(SIZES) - 1)
    keys = jax.random.split(jax.random.key(0), len(SIZES) - 1)
    params = {}
    for i, (m, n) in enumerate(itertools.pairwise(SIZES)):
        params[f"W{i}"] = jax.random.normal(keys[i], (m, n), jnp.float32) / jnp.sqrt(m)
        params[f"b{i}"] = jnp.zeros(n, jnp.float32)

    def loss(p, x, y):
        logp = jax.nn.log_softmax(net(p, x))
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))

    return loss, params, (x, y)


def kfac_rows(repeats: int) -> list[tuple[str, str, str]]:
    """The rows of the K-FAC table (medians of ``repeats`` runs taken in turn)."""
    loss, params, batch = digits_problem()
    opt = lbp.kfac()

    @jax.jit
    def kfac_step(p, state, key):
        key, sample = jax.random.split(key)
        value, grad, G = lbp.gauss_newton(loss)(p, *batch)
        factors = lbp.kfac_factors(loss, samples=1, key=sample)(p, *batch)
        updates, state = opt.update(grad, state, p, factors=factors, curvature=G, value=value,
                                    value_fn=lambda q, **_: loss(q, *batch))
        return optax.apply_updates(p, updates), state, key

    (late, _, _), t_kfac = seconds_per_step(kfac_step, (params, opt.init(params), jax.random.key(1)), 98, warmup=2)
    kfac_loss = float(loss(late, *batch))

    adam = []
    for rate in ADAM_RATES:
        tx = optax.adam(rate)

        @jax.jit
        def adam_step(p, state, tx=tx):
            grad = lbp.grad_by_solve(loss)(p, *batch)
            updates, state = tx.update(grad, state, p)
            return optax.apply_updates(p, updates), state

        (p, _), t_adam = seconds_per_step(adam_step, (params, tx.init(params)), 248, warmup=2)
        adam.append((float(loss(p, *batch)), rate, t_adam))
    best, rate, t_adam = min(adam)
    rows = [("digits MLP 64-128-128-10 (tanh, full batch, float32): `lbp.kfac` loss after 100 steps",
             f"{kfac_loss:.2e}", f"< {best:.2e} (Adam after 250 steps, best of rates "
                                 f"{', '.join(f'{r:g}' for r in ADAM_RATES)}: {rate:g})"),
            ("same, a K-FAC step / a gradient + Adam step (means over the runs)",
             f"{t_kfac / t_adam:.1f} ({t_kfac * 1e3:.1f} / {t_adam * 1e3:.2f} ms)", "≤ 3")]
    key = jax.random.key(2)
    parts = {"`gauss_newton` (value, gradient, G)": lambda p: lbp.gauss_newton(loss)(p, *batch)[:2],
             "`gauss_newton` and the two G products (`G.gram`)":
                 lambda p: lbp.gauss_newton(loss)(p, *batch)[2].gram([p, p]),
             "`kfac_factors`, one sampled column": lambda p: lbp.kfac_factors(loss, samples=1, key=key)(p, *batch)}
    gradient = jax.jit(lambda p: lbp.grad_by_solve(loss)(p, *batch))
    for when, p in (("early", params), ("late", late)):
        compiled = [jax.jit(f) for f in parts.values()]
        times = interleaved([(gradient, (p,)), *((f, (p,)) for f in compiled)], repeats)
        for name, t in zip(parts, times[1:]):
            rows.append((f"same, {when}: {name} / a gradient", f"{t / times[0]:.2f} ({t * 1e3:.1f} / "
                                                                f"{times[0] * 1e3:.2f} ms)", "—"))
    rows.append(("OpenBLAS threads of the factorisations (`OPENBLAS_NUM_THREADS`)",
                 os.environ.get("OPENBLAS_NUM_THREADS", "unset (OpenBLAS's default)"), "—"))
    for row in rows:
        print(row, flush=True)
    return rows
