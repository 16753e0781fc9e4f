"""An equinox GRU as written (``python benchmarks/run.py --rows capture``): ``eqx.nn.GRUCell``
in a ``lax.scan`` over a sequence, the loss reading every hidden state, differentiated with
``layers=eqx.nn.GRUCell`` against ``eqx.filter_value_and_grad`` of the same loss: run time
(interleaved medians) and compile time (lower + compile, medians of fresh builds)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import linbackprop as lbp

from .timing import compiled, interleaved


def gru_rows(repeats: int, steps: int = 64, batch: int = 32, features: int = 16,
             hidden: int = 64, builds: int = 3) -> list[tuple[str, str, str]]:
    import equinox as eqx

    cell = eqx.nn.GRUCell(features, hidden, key=jax.random.key(0))
    xs = jax.random.normal(jax.random.key(1), (steps, batch, features))

    def loss(cell, xs):
        def step(h, x):
            h = jax.vmap(cell)(x, h)
            return h, h

        _, hs = jax.lax.scan(step, jnp.zeros((batch, hidden)), xs)
        return jnp.mean(hs**2)

    makers = {"ours": lambda: lbp.value_and_grad_by_solve(loss, layers=eqx.nn.GRUCell),
              "theirs": lambda: eqx.filter_value_and_grad(loss)}
    programs, seconds = {}, {name: [] for name in makers}
    for _ in range(builds):
        for name, make in makers.items():
            # JAX's in-memory caches would serve the second build of the same program (equinox's
            # measured 0.00 s): every build starts cold
            jax.clear_caches()
            programs[name], took = compiled(make(), (cell, xs), jit=eqx.filter_jit)
            seconds[name].append(took)
    t_ours, t_theirs = interleaved([(programs["ours"], (cell, xs)), (programs["theirs"], (cell, xs))], repeats)
    c_ours, c_theirs = (float(np.median(seconds[name])) for name in ("ours", "theirs"))
    title = f"equinox GRU as written ({steps} steps, batch {batch}, {features} → {hidden}, the loss on every state)"
    return [(f"{title}, `layers=eqx.nn.GRUCell` / `eqx.filter_value_and_grad`: run",
             f"{t_ours / t_theirs:.2f} ({t_ours * 1e3:.1f} / {t_theirs * 1e3:.1f} ms)", "<= 1.1"),
            ("same, compile (lower + compile, medians of fresh builds)",
             f"{c_ours / c_theirs:.2f} ({c_ours:.2f} / {c_theirs:.2f} s)", "<= 1.5")]
