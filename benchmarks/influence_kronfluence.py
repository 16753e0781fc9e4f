"""`lbp.influence` beside kronfluence (PyTorch) on the same weights, data and λ: how far their
EK-FAC scores agree, and what each costs on this machine. Our half; kronfluence's is
``benchmarks/kronfluence_digits.py`` (its own environment: the commands are there).

``--export PATH``: the influence benchmark's MLP (ReLU 64-128-64-10 trained on its 1,000 digits)
with its data, its 300 queries and our EK-FAC's default λ, for kronfluence's half.
``--compare PATH``: our EK-FAC (the program compiled first, its compile reported apart; then fit
+ scores timed), against kronfluence's scores read from PATH: Pearson's correlation over all
Q × N scores and the mean over queries of Spearman's over the training examples; kronfluence's
two seeds against each other (its sampled labels' noise) as the ceiling.
"""

from __future__ import annotations

import argparse
import resource
import time

import jax
import jax.numpy as jnp
import numpy as np

import linbackprop as lbp

from .influence_lds import TRAIN, cross_entropy, dense, margin, mlp, spearman, split, trained


def agreement(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """(Pearson over all entries, mean over rows of Spearman over the columns)."""
    return float(np.corrcoef(a.ravel(), b.ravel())[0, 1]), float(np.mean(spearman(a.T, b.T)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--export", help="write the weights, data and λ for kronfluence's half")
    parser.add_argument("--compare", help="kronfluence's scores (its half's output)")
    parser.add_argument("--batch-size", type=int, default=250, help="our batch_size (memory: the fit's rows)")
    args = parser.parse_args()
    train, query = split()
    params = trained("mlp", jax.random.key(0), jnp.ones(TRAIN), train, 750, 0.05)
    losses = lambda p, x, y: cross_entropy(mlp(p, x), y)
    measure = lambda p, x, y: margin(mlp(p, x), y)
    attr = lbp.influence(losses, method="ekfac", layers=dense, batch_size=args.batch_size)
    run = jax.jit(lambda p, q, t: attr.fit(p, *t).scores(measure, p, q, t))
    start = time.perf_counter()
    program = run.lower(params, query, train).compile()
    compile_seconds = time.perf_counter() - start
    damping = float(jax.jit(attr.fit)(params, *train).damping)
    if args.export:
        arrays = {f"{k}{n}": np.asarray(layer[k]) for n, layer in enumerate(params) for k in ("W", "b")}
        np.savez(args.export, train_x=np.asarray(train[0]), train_y=np.asarray(train[1]),
                 query_x=np.asarray(query[0]), query_y=np.asarray(query[1]), damping=damping, **arrays)
        print(f"wrote {args.export}: λ = {damping:.4g}")
        return
    jax.block_until_ready(program(params, query, train))
    times = []
    for _ in range(3):
        start = time.perf_counter()
        ours = np.asarray(program(params, query, train))
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    theirs = np.load(args.compare)
    print(f"λ = {damping:.4g}; ours: fit + scores {np.median(times):.2f} s (compile {compile_seconds:.1f} s), "
          f"peak RSS {peak / 2**20:.0f} MiB; kronfluence: fit + scores {theirs['seconds'][0]:.1f} s, "
          f"peak RSS {float(theirs['peak']) / 2**20:.0f} MiB")
    print("| scores | against | Pearson | mean Spearman per query |")
    print("|---|---|---|---|")
    rows = [("ours, EK-FAC", "kronfluence EK-FAC, same λ, seed 0", ours, theirs["fixed"]),
            ("ours, EK-FAC", "kronfluence EK-FAC, same λ, seed 1", ours, theirs["fixed_seed1"]),
            ("kronfluence, seed 0", "kronfluence, seed 1 (its own noise)", theirs["fixed"], theirs["fixed_seed1"]),
            ("ours, EK-FAC", "kronfluence, its heuristic λ (per module)", ours, theirs["heuristic"]),
            ("ours, EK-FAC", "kronfluence, same λ, 64 labels drawn per example", ours, theirs["drawn64"]),
            ("kronfluence, 64 drawn, seed 0", "kronfluence, 64 drawn, seed 1", theirs["drawn64"],
             theirs["drawn64_seed1"]),
            ("ours, EK-FAC", "kronfluence, same λ, 1,024 labels drawn per example", ours, theirs["drawn1024"])]
    for a, b, x, y in rows:
        pearson, rank = agreement(x, y)
        print(f"| {a} | {b} | {pearson:.4f} | {rank:.4f} |")


if __name__ == "__main__":
    main()
