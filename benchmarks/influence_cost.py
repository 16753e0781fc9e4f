"""What `lbp.influence` costs: seconds and peak memory of the fit and of the scores, against the
plain form (every training example's gradient by ``jax.vmap(jax.grad)`` at once, the query
gradients preconditioned by the same fitted curvature, one product).

    OPENBLAS_NUM_THREADS=1 python -m benchmarks.influence_cost

The influence benchmark's MLP (ReLU 64-128-64-10, float32, 17,226 parameters; ``--widths``
other hidden widths) on N training images (the digits tiled with noise up to N) and
``--queries`` queries (300); ``batch_size`` 1,000. Each program
compiled once (excluded), then the median of ``--repeats`` runs; peak memory is the compiled
program's arguments + outputs + temporaries (``memory_analysis``). ``scores(by="gradients")``
forms a chunk's training gradients ([1,000, P]); ``by="ghost"`` none (each layer's parameter
tangent along a preconditioned query gradient contracted with the adjoints); ``by="forward"``
none (directional derivatives); the plain form all N at once. A wide MLP with a few queries
at a time, where a training gradient is large against the states:

    OPENBLAS_NUM_THREADS=1 python -m benchmarks.influence_cost --widths 1024,1024 --queries 16 --method kfac \
        --sizes 1000 --batch-size 250
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import linbackprop as lbp

from .influence_lds import cross_entropy, dense, margin, mlp
from .timing import compiled, memory


def data(n: int, key: jax.Array) -> tuple:
    from .digits_problems import digits

    images, labels = digits()
    reps = -(-n // len(labels))
    x = jnp.tile(images, (reps, 1))[:n]
    x = x + 0.05 * jax.random.normal(key, x.shape, x.dtype) * (jnp.arange(n) >= len(labels))[:, None]
    return x, jnp.tile(labels, reps)[:n]


def timed(fn, args: tuple, repeats: int) -> tuple[float, int]:
    import time

    program, _ = compiled(fn, args)
    jax.block_until_ready(program(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(program(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times)), memory(program)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--method", default="ekfac")
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--widths", default="128,64", help="the MLP's hidden widths")
    parser.add_argument("--queries", type=int, default=300)
    args = parser.parse_args()
    sizes = (64, *(int(w) for w in args.widths.split(",")), 10)
    keys = jax.random.split(jax.random.key(0), len(sizes))
    params = [{"W": jax.random.normal(k, (m, n), jnp.float32) / jnp.sqrt(m), "b": jnp.zeros(n, jnp.float32)}
              for k, m, n in zip(keys, sizes[:-1], sizes[1:])]
    print(f"MLP {'-'.join(map(str, sizes))}: {sum(x.size for x in jax.tree.leaves(params)):,} parameters, "
          f"{args.queries} queries, batch_size {args.batch_size}, {args.method}")
    query = data(args.queries, jax.random.key(1))
    losses = lambda p, x, y: cross_entropy(mlp(p, x), y)
    measure = lambda p, x, y: margin(mlp(p, x), y)
    attr = lbp.influence(losses, method=args.method, layers=dense, batch_size=args.batch_size)
    print("| N | what | seconds | peak memory |")
    print("|---|---|---|---|")
    for n in args.sizes:
        train = data(n, jax.random.key(2))
        fit_seconds, fit_bytes = timed(lambda p, x, y: attr.fit(p, x, y), (params, *train), args.repeats)
        fit = jax.jit(attr.fit)(params, *train)
        rows = [("fit", fit_seconds, fit_bytes)]
        for by in ("gradients", "ghost", "forward"):
            scores = lambda p, q, t, by=by: fit.scores(measure, p, q, t, by=by)
            rows.append((f'scores(by="{by}")', *timed(scores, (params, query, train), args.repeats)))

        def plain(p, q, t):
            flat = lambda g: jnp.concatenate([x.ravel() for x in jax.tree.leaves(g)])
            grad = lambda f: lambda x, y: jax.grad(lambda p: f(p, x[None], y[None])[0])(p)
            v = jax.vmap(lambda g: fit.curvature.apply(g, fit.damping))(jax.vmap(grad(measure))(*q))
            g = jax.vmap(lambda x, y: flat(grad(losses)(x, y)))(*t)  # [N, P]
            return jax.vmap(flat)(v) @ g.T

        rows.append(("plain: vmap(grad), preconditioned, multiplied", *timed(plain, (params, query, train),
                                                                              args.repeats)))
        for what, seconds, peak in rows:
            print(f"| {n:,} | {what} | {seconds:.3f} s | {peak / 2**20:.0f} MiB |")


if __name__ == "__main__":
    main()
