"""Finding mislabelled training examples by their self-influence, on a flax nnx model as written.

    OPENBLAS_NUM_THREADS=1 python -m benchmarks.influence_mislabels

scikit-learn's digits, the influence benchmark's 1,000 training images with 10 % of their labels
changed to another class (seeded); an nnx MLP 64-128-64-10 (ReLU, ``nnx.Linear`` layers) trained
on them (SGD with momentum, minibatches of 64, ``--steps``); then each method's self-influence
s_i = ∇ℓ_iᵀ (G + λI)⁻¹ ∇ℓ_i at its default damping, and the fraction of the flipped examples among
the 10 % and 20 % with the largest s_i (a random ranking finds 10 % and 20 %). The training loss
itself ranks too: the baseline any ranking must beat. Three training seeds, mean and range.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import linbackprop as lbp

from .influence_lds import TRAIN, cross_entropy, split


class Mlp(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.layers = nnx.List([nnx.Linear(64, 128, rngs=rngs), nnx.Linear(128, 64, rngs=rngs),
                                nnx.Linear(64, 10, rngs=rngs)])

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers[:-1]:
            x = jax.nn.relu(layer(x))
        return self.layers[-1](x)


def flipped(labels: jax.Array, fraction: float, seed: int) -> tuple[jax.Array, np.ndarray]:
    """The labels with ``fraction`` of them moved to another class, and which."""
    rng = np.random.default_rng(seed)
    which = np.zeros(len(labels), bool)
    which[rng.choice(len(labels), int(fraction * len(labels)), replace=False)] = True
    shift = rng.integers(1, 10, len(labels))
    return jnp.where(which, (labels + shift) % 10, labels), which


def trained(seed: int, x: jax.Array, y: jax.Array, steps: int) -> Mlp:
    model = Mlp(nnx.Rngs(seed))
    optimizer = nnx.Optimizer(model, optax.sgd(0.05, momentum=0.9), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, batch):
        grads = nnx.grad(lambda m: jnp.mean(cross_entropy(m(x[batch]), y[batch])))(model)
        optimizer.update(model, grads)

    rng = np.random.default_rng(seed)
    for _ in range(steps):
        step(model, optimizer, jnp.asarray(rng.integers(0, TRAIN, 64)))
    return model


def found(scores: np.ndarray, which: np.ndarray, top: float) -> float:
    """The fraction of the flipped examples among the ``top`` fraction with the largest scores."""
    ranked = np.argsort(-scores)[:int(top * len(scores))]
    return float(which[ranked].sum() / which.sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=750)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--methods", nargs="+", default=["identity", "diagonal", "kfac", "ekfac"])
    args = parser.parse_args()
    (x, labels), _ = split()
    y, which = flipped(labels, 0.1, seed=0)
    losses = lambda m, x, y: cross_entropy(m(x), y)
    results: dict[str, list] = {name: [] for name in ["training loss", *args.methods]}
    seconds: dict[str, list] = {name: [] for name in args.methods}
    for seed in range(args.seeds):
        model = trained(seed, x, y, args.steps)
        results["training loss"].append([found(np.asarray(losses(model, x, y)), which, top) for top in (0.1, 0.2)])
        for method in args.methods:
            start = time.perf_counter()
            attr = lbp.influence(losses, method=method, layers=nnx.Linear, batch_size=250)
            scores = np.asarray(attr.fit(model, x, y).self_scores(model, x, y))
            seconds[method].append(time.perf_counter() - start)
            results[method].append([found(scores, which, top) for top in (0.1, 0.2)])
    print(f"{which.sum()} of {TRAIN} labels flipped; {args.seeds} trainings (mean, min–max)")
    print("| ranked by | flips in the top 10 % | in the top 20 % | fit + self-scores |")
    print("|---|---|---|---|")
    for name, rows in results.items():
        rows = np.asarray(rows)
        cells = [f"{rows[:, k].mean():.2f} ({rows[:, k].min():.2f}–{rows[:, k].max():.2f})" for k in range(2)]
        cost = f"{np.mean(seconds[name]):.1f} s" if name in seconds else "—"
        label = "the training loss" if name == "training loss" else f"self-influence, {name}"
        print(f"| {label} | {cells[0]} | {cells[1]} | {cost} |")


if __name__ == "__main__":
    main()
