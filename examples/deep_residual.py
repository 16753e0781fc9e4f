"""A 512-layer residual network: compile and step times of grad_by_solve versus jax.grad.

Every layer is u + tanh(u W_i + b_i) with its own blocks, so the network has one *kind* of layer
and grad_by_solve compiles one loop body whatever the depth, while jax.grad of the same network
(a Python loop over the layers) is unrolled by XLA layer by layer. Each runs twice: with one
array per block (a dict of 2·depth arrays) and with the blocks stacked, layers using rows
``lbp.Row("W", i)`` of them. jax.grad over lax.scan of the stacked weights — the hand-written
best practice — is shown too.

    python examples/deep_residual.py [--depth 512] [--width 32] [--batch 8]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import linbackprop as lbp


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help shows the description as written and each option's default."""


def residual(theta, u):
    w, b = theta
    return u + jnp.tanh(u @ w + b)


def timed(fn, args, repeats: int) -> tuple[float, float, jax.Array]:
    """(compile seconds, median step seconds, result) of jit(fn)."""
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - start
    out = jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return compile_s, float(np.median(times)), out


def main(depth: int = 512, width: int = 32, batch: int = 8, repeats: int = 20) -> dict:
    net = lbp.Network([lbp.Layer(i, residual, (i - 1,), (("W", i), ("b", i))) for i in range(1, depth + 1)],
                      inputs=[0], outputs=depth)
    key_w, key_x = jax.random.split(jax.random.PRNGKey(0))
    ws = jax.random.normal(key_w, (depth, width, width)) * (0.5 / np.sqrt(width))
    bs = jnp.zeros((depth, width))
    params = {}
    for i in range(1, depth + 1):
        params[("W", i)], params[("b", i)] = ws[i - 1], bs[i - 1]
    x = jax.random.normal(key_x, (batch, width))
    loss = lambda p, x: jnp.sum(net(p, x) ** 2)
    stacked = lbp.Network([lbp.Layer(i, residual, (i - 1,), (lbp.Row("W", i - 1), lbp.Row("b", i - 1)))
                           for i in range(1, depth + 1)], inputs=[0], outputs=depth)
    stacked_loss = lambda p, x: jnp.sum(stacked(p, x) ** 2)

    def scan_loss(stacked, x):
        u, _ = jax.lax.scan(lambda u, wb: (residual(wb, u), None), x, stacked)
        return jnp.sum(u**2)

    print(f"{depth} residual layers, width {width}, batch {batch}, {jax.devices()[0].platform.upper()}")
    rows = {
        "grad_by_solve": timed(lbp.grad_by_solve(loss), (params, x), repeats),
        "jax.grad (unrolled)": timed(jax.grad(loss), (params, x), repeats),
        "grad_by_solve (Row)": timed(lbp.grad_by_solve(stacked_loss), ({"W": ws, "b": bs}, x), repeats),
        "jax.grad (unrolled, Row)": timed(jax.grad(stacked_loss), ({"W": ws, "b": bs}, x), repeats),
        "jax.grad (lax.scan)": timed(jax.grad(scan_loss), ((ws, bs), x), repeats),
    }
    for name, (compile_s, step_s, _) in rows.items():
        print(f"{name:25s} compile {compile_s:6.2f} s   step {step_s * 1e3:8.3f} ms")
    g_solve, g_unrolled = rows["grad_by_solve"][2], rows["jax.grad (unrolled)"][2]
    scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(g_unrolled))
    difference = max(float(jnp.max(jnp.abs(g_solve[k] - g_unrolled[k]))) for k in params) / scale
    unrolled_w = jnp.stack([g_unrolled[("W", i)] for i in range(1, depth + 1)])
    rows_w = rows["grad_by_solve (Row)"][2]["W"]
    difference = max(difference, float(jnp.max(jnp.abs(rows_w - unrolled_w))) / scale)
    print(f"largest difference of the gradients (relative to the largest entry): {difference:.1e}")
    return {name: {"compile_s": c, "step_s": s} for name, (c, s, _) in rows.items()} | {"difference": difference}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=_Help)
    parser.add_argument("--depth", type=int, default=512, help="residual layers")
    parser.add_argument("--width", type=int, default=32, help="width of each layer")
    parser.add_argument("--batch", type=int, default=8, help="examples per batch")
    args = parser.parse_args()
    main(args.depth, args.width, args.batch)
