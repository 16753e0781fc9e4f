"""Benchmarks: grad_by_solve against jax.grad, side by side in one process.

    python benchmarks/run.py [--repeats 15] [--write-readme]

Every row times jit(grad_by_solve) and the reference jit(jax.grad) interleaved (medians of
``--repeats`` runs each) and prints the ratio; absolute times are not comparable across runs on
a noisy machine. Compile times are lower+compile of each. Peak memory is temp + argument + output
bytes from ``compiled.memory_analysis()``. With ``--write-readme`` the table replaces the one
between the markers in README.md.
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import linbackprop as lbp


def residual(th, u):
    return u + jnp.tanh(u @ th[0] + th[1])


def chain(depth: int, width: int, batch: int):
    net = lbp.Network([lbp.Layer(i, residual, (i - 1,), (("W", i), ("b", i))) for i in range(1, depth + 1)], [0], depth)
    key = jax.random.PRNGKey(0)
    Ws = jax.random.normal(key, (depth, width, width), jnp.float32) * (0.5 / np.sqrt(width))
    bs = jnp.zeros((depth, width), jnp.float32)
    params = {}
    for i in range(1, depth + 1):
        params[("W", i)], params[("b", i)] = Ws[i - 1], bs[i - 1]
    x = jax.random.normal(key, (batch, width), jnp.float32)
    loss = lambda p, x: jnp.sum(net(p, x) ** 2)

    def scan_loss(stacked, x):
        u, _ = jax.lax.scan(lambda u, wb: (residual(wb, u), None), x, stacked)
        return jnp.sum(u**2)

    return loss, (params, x), scan_loss, ((Ws, bs), x)


def compile_timed(fn, args):
    t = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled, time.perf_counter() - t


def peak(compiled) -> int:
    m = compiled.memory_analysis()
    return m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes


def interleaved(fns, repeats):
    times = [[] for _ in fns]
    for f, args in fns:
        jax.block_until_ready(f(*args))
    for _ in range(repeats):
        for n, (f, args) in enumerate(fns):
            t = time.perf_counter()
            jax.block_until_ready(f(*args))
            times[n].append(time.perf_counter() - t)
    return [float(np.median(t)) for t in times]


def row_chain(name, depth, width, batch, repeats):
    loss, args, scan_loss, scan_args = chain(depth, width, batch)
    ours, c_ours = compile_timed(lbp.grad_by_solve(loss), args)
    ref, c_ref = compile_timed(jax.grad(scan_loss), scan_args)
    fwd, _ = compile_timed(loss, args)
    t_ours, t_ref, t_fwd = interleaved([(ours, args), (ref, scan_args), (fwd, args)], repeats)
    return {
        "network": name, "reference": "jit(jax.grad), lax.scan over stacked weights",
        "run ratio": t_ours / t_ref, "solve ms": t_ours * 1e3, "reference ms": t_ref * 1e3,
        "compile s": c_ours, "reference compile s": c_ref, "peak ratio": peak(ours) / peak(ref),
        "grad / forward": t_ours / t_fwd,
    }


def table(rows):
    head = ("| network | reference | run ratio (solve / ref) | solve ms | ref ms | compile s (solve / ref) "
            "| peak memory ratio | grad / forward |")
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['network']} | {r['reference']} | {r['run ratio']:.2f} | {r['solve ms']:.2f} | "
                     f"{r['reference ms']:.2f} | {r['compile s']:.2f} / {r['reference compile s']:.2f} | "
                     f"{r['peak ratio']:.2f} | {r['grad / forward']:.2f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--write-readme", action="store_true")
    args = parser.parse_args()
    rows = [
        row_chain("deep chain: depth 128, width 128, batch 64", 128, 128, 64, args.repeats),
        row_chain("deep narrow chain: depth 512, width 32, batch 8", 512, 32, 8, args.repeats),
    ]
    text = table(rows)
    print(text)
    if args.write_readme:
        readme = Path(__file__).resolve().parents[1] / "README.md"
        block = (f"<!-- benchmark table -->\n`python benchmarks/run.py --write-readme` on "
                 f"{jax.devices()[0].platform.upper()}, jax {jax.__version__}:\n\n{text}\n<!-- /benchmark table -->")
        content = readme.read_text()
        content = re.sub(r"<!-- benchmark table -->.*<!-- /benchmark table -->", lambda _: block, content, flags=re.S)
        readme.write_text(content)


if __name__ == "__main__":
    main()
