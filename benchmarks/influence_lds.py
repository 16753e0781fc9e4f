"""The linear datamodeling score (LDS) of `lbp.influence` on scikit-learn's digits, against TRAK.

    OPENBLAS_NUM_THREADS=1 python -m benchmarks.influence_lds --model mlp
    OPENBLAS_NUM_THREADS=1 python -m benchmarks.influence_lds --model rnn

A fixed split (1,000 training images, 300 queries, from a seeded permutation); a model trained on
all 1,000 (SGD with momentum, minibatches of 64, ``--steps``); the ground truth from ``--subsets``
random half-size subsets of the training set, each trained ``--seeds`` times from other
initialisations and minibatch orders (all of them at once: ``jax.vmap`` of the training loop),
each query's margin (its label's logit minus the log-sum-exp of the others) averaged over the
seeds. A method's prediction for subset S is -Σ_{i∈S} S[q, i] (including example i moves the
query's margin by -S[q, i] to first order: S is the effect of removing it); the LDS is the mean
over queries of Spearman's rank correlation of prediction and truth over the subsets, with a
95 % interval (1.96 standard errors over the queries).

Methods: `lbp.influence`'s identity, diagonal, kfac, ekfac (and exact where P is small enough:
``--exact``), each over a damping sweep (multiples of the approximation's mean eigenvalue);
TRAK-1 (Park et al. 2023: the margin gradients of one model projected to ``--trak-dim``
dimensions by a Gaussian matrix, Φ (ΦᵀΦ + λI)⁻¹ φ_q times each training example's 1 - p_i,
the ridge λ swept as our damping: with k > N and no ridge the kernel is singular and the LDS
near 0).

Models: ``mlp``, ReLU 64-128-64-10; ``rnn``, an Elman RNN (hidden 32, tanh) reading the image's
8 rows with the same weights at every row, a dense head on its last state. The ground truth is
cached under ``build/`` (``--fresh`` retrains).
"""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import linbackprop as lbp

from .digits_problems import digits

TRAIN, QUERY = 1000, 300


@lbp.layer
def dense(p: dict, x: jax.Array) -> jax.Array:
    return x @ p["W"] + p["b"]


@lbp.layer
def cell(p: dict, h: jax.Array, x: jax.Array) -> jax.Array:
    return jnp.tanh(h @ p["Wh"] + x @ p["Wx"] + p["b"])


def mlp(p: list, x: jax.Array) -> jax.Array:
    for layer in p[:-1]:
        x = jax.nn.relu(dense(layer, x))
    return dense(p[-1], x)


def rnn(p: dict, x: jax.Array) -> jax.Array:
    rows = x.reshape(x.shape[0], 8, 8)
    h = jnp.zeros((x.shape[0], p["cell"]["Wh"].shape[0]), x.dtype)
    for t in range(8):
        h = cell(p["cell"], h, rows[:, t])
    return dense(p["head"], h)


def init(model: str, key: jax.Array) -> object:
    normal = lambda k, m, n: jax.random.normal(k, (m, n), jnp.float32) / jnp.sqrt(m)
    keys = jax.random.split(key, 4)
    if model == "mlp":
        sizes = (64, 128, 64, 10)
        return [{"W": normal(keys[i], m, n), "b": jnp.zeros(n, jnp.float32)}
                for i, (m, n) in enumerate(itertools.pairwise(sizes))]
    return {"cell": {"Wh": normal(keys[0], 32, 32), "Wx": normal(keys[1], 8, 32), "b": jnp.zeros(32, jnp.float32)},
            "head": {"W": normal(keys[2], 32, 10), "b": jnp.zeros(10, jnp.float32)}}


MODELS = {"mlp": mlp, "rnn": rnn}


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1)[:, 0]


def margin(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """The label's logit minus the log-sum-exp of the other logits."""
    own = jnp.take_along_axis(logits, labels[:, None], axis=1)[:, 0]
    others = jnp.where(jax.nn.one_hot(labels, logits.shape[1], dtype=bool), -jnp.inf, logits)
    return own - jax.nn.logsumexp(others, axis=1)


def split() -> tuple[tuple, tuple]:
    images, labels = digits()
    order = np.random.default_rng(0).permutation(len(labels))
    take = lambda idx: (images[idx], labels[idx])
    return take(order[:TRAIN]), take(order[TRAIN:TRAIN + QUERY])


def trained(model: str, key: jax.Array, weights: jax.Array, train: tuple, steps: int, rate: float) -> object:
    """SGD with momentum 0.9 on minibatches of 64 drawn (with replacement) from the examples with
    weight 1 — the whole set, or a subset."""
    forward = MODELS[model]
    init_key, data_key = jax.random.split(key)
    params = init(model, init_key)
    optimizer = optax.sgd(rate, momentum=0.9)

    def step(carry, k):
        params, state = carry
        batch = jax.random.choice(k, TRAIN, (64,), p=weights / jnp.sum(weights))
        grads = jax.grad(lambda p: jnp.mean(cross_entropy(forward(p, train[0][batch]), train[1][batch])))(params)
        updates, state = optimizer.update(grads, state)
        return (optax.apply_updates(params, updates), state), None

    (params, _), _ = jax.lax.scan(step, (params, optimizer.init(params)), jax.random.split(data_key, steps))
    return params


def ground_truth(model: str, args: argparse.Namespace, train: tuple, query: tuple) -> tuple[np.ndarray, np.ndarray]:
    """(masks [subsets, N], the queries' margins [subsets, Q] averaged over the seeds)."""
    path = Path("build") / f"influence_lds_{model}_{args.subsets}x{args.seeds}_{args.steps}.npz"
    if path.exists() and not args.fresh:
        cached = np.load(path)
        return cached["masks"], cached["margins"]
    rng = np.random.default_rng(1)
    masks = np.zeros((args.subsets, TRAIN), np.float32)
    for s in range(args.subsets):
        masks[s, rng.choice(TRAIN, TRAIN // 2, replace=False)] = 1
    forward = MODELS[model]

    @jax.jit
    def margins_of(keys, mask):
        params = jax.vmap(lambda k: trained(model, k, mask, train, args.steps, args.rate))(keys)
        return jnp.mean(jax.vmap(lambda p: margin(forward(p, query[0]), query[1]))(params), axis=0)

    start = time.perf_counter()
    out = []
    for s in range(args.subsets):  # the seeds of one subset at once (memory), the subsets in turn
        keys = jax.random.split(jax.random.key(1000 + s), args.seeds)
        out.append(np.asarray(margins_of(keys, jnp.asarray(masks[s]))))
    print(f"ground truth: {args.subsets} subsets x {args.seeds} seeds in {time.perf_counter() - start:.0f} s")
    path.parent.mkdir(exist_ok=True)
    np.savez(path, masks=masks, margins=np.stack(out))
    return masks, np.stack(out)


def spearman(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Spearman's rank correlation of each column of a with the same column of b."""
    rank = lambda x: np.argsort(np.argsort(x, axis=0), axis=0).astype(float)
    ra, rb = rank(a), rank(b)
    ra, rb = ra - ra.mean(0), rb - rb.mean(0)
    return np.sum(ra * rb, 0) / np.sqrt(np.sum(ra ** 2, 0) * np.sum(rb ** 2, 0))


def lds(scores: np.ndarray, masks: np.ndarray, margins: np.ndarray, sign: float = -1.0) -> tuple[float, float]:
    """Mean over queries of Spearman(prediction, truth) over the subsets, and its 95 % half-width."""
    rho = spearman(sign * masks @ scores.T, margins)
    rho = rho[np.isfinite(rho)]
    return float(rho.mean()), float(1.96 * rho.std(ddof=1) / np.sqrt(len(rho)))


def shown(mean: float, half: float) -> str:
    return f"{mean:.3f} ± {half:.3f}"


def trak(model: str, params: object, train: tuple, query: tuple, dim: int) -> callable:
    """TRAK-1's scores [Q, N] as a function of the ridge λ (a multiple of ΦᵀΦ's mean eigenvalue):
    the margins' gradients projected by a Gaussian R (P × dim), φ_q (ΦᵀΦ + λI)⁻¹ Φᵀ (1 - p)."""
    forward = MODELS[model]
    flat = lambda g: jnp.concatenate([x.ravel() for x in jax.tree.leaves(g)])
    grad = lambda x, y: flat(jax.grad(lambda p: margin(forward(p, x[None]), y[None])[0])(params))
    size = flat(params).size
    project = jax.random.normal(jax.random.key(7), (size, dim), jnp.float32) / np.sqrt(dim)
    phi = jax.lax.map(lambda xy: grad(*xy) @ project, train, batch_size=100)  # [N, dim]
    phi_q = jax.lax.map(lambda xy: grad(*xy) @ project, query, batch_size=100)
    kernel = phi.T @ phi
    p_own = jnp.exp(-cross_entropy(forward(params, train[0]), train[1]))

    def scores(factor: float) -> np.ndarray:
        solved = jnp.linalg.solve(kernel + factor * jnp.trace(kernel) / dim * jnp.eye(dim), phi.T)  # [dim, N]
        return np.asarray((phi_q @ solved) * (1 - p_own)[None, :])

    return scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="mlp")
    parser.add_argument("--subsets", type=int, default=100)
    parser.add_argument("--seeds", type=int, default=5, help="retrainings per subset")
    parser.add_argument("--steps", type=int, default=750)
    parser.add_argument("--rate", type=float, default=0.05)
    parser.add_argument("--dampings", type=float, nargs="+", default=[1e-3, 1e-2, 1e-1, 1.0, 10.0],
                        help="λ as multiples of each approximation's mean eigenvalue")
    parser.add_argument("--methods", nargs="+", default=["identity", "diagonal", "kfac", "ekfac"])
    parser.add_argument("--trak-dim", type=int, default=2048)
    parser.add_argument("--fresh", action="store_true", help="retrain the ground truth")
    parser.add_argument("--out", help="a PNG of the LDS against the damping, per method")
    args = parser.parse_args()
    train, query = split()
    forward = MODELS[args.model]
    params = trained(args.model, jax.random.key(0), jnp.ones(TRAIN), train, args.steps, args.rate)
    accuracy = float(jnp.mean(jnp.argmax(forward(params, query[0]), 1) == query[1]))
    print(f"{args.model}: query accuracy {accuracy:.3f}")
    masks, margins = ground_truth(args.model, args, train, query)
    losses = lambda p, x, y: cross_entropy(forward(p, x), y)
    measure = lambda p, x, y: margin(forward(p, x), y)
    layers = dense if args.model == "mlp" else (cell, dense)
    curves: dict[str, list] = {}
    print("| method | λ / mean eigenvalue | LDS | fit + scores |")
    print("|---|---|---|---|")
    for method in args.methods:
        start = time.perf_counter()
        fit = lbp.influence(losses, method=method, layers=layers, batch_size=500).fit(params, *train)
        scores = np.asarray(fit.scores(measure, params, query, train))
        seconds = time.perf_counter() - start
        if method == "identity":
            curves[method] = [lds(scores, masks, margins)] * len(args.dampings)
            print(f"| identity | — | {shown(*curves[method][0])} | {seconds:.1f} s |")
            continue
        default = fit.damping / 0.1
        curves[method] = []
        for factor in args.dampings:
            scores = np.asarray(fit.with_damping(factor * default).scores(measure, params, query, train))
            curves[method].append(lds(scores, masks, margins))
            print(f"| {method} | {factor:g} | {shown(*curves[method][-1])} | {seconds:.1f} s |")
    start = time.perf_counter()
    scores = trak(args.model, params, train, query, args.trak_dim)
    seconds = time.perf_counter() - start
    curves["TRAK-1"] = []
    for factor in args.dampings:  # TRAK's ridge, swept as ours
        curves["TRAK-1"].append(lds(scores(factor), masks, margins, sign=1.0))
        print(f"| TRAK-1 (k = {args.trak_dim}) | {factor:g} | {shown(*curves['TRAK-1'][-1])} | {seconds:.1f} s |")
    if args.out:
        draw(curves, args.dampings, f"{args.model}: {args.subsets} subsets × {args.seeds} seeds", args.out)


def draw(curves: dict, dampings: list, title: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for method, points in curves.items():
        mean, half = np.asarray(points).T
        style = {"identity": ":", "TRAK-1": "--"}.get(method, "-")
        ax.errorbar(dampings, mean, yerr=half, label=method, linestyle=style, marker="o", capsize=3)
    ax.set_xscale("log")
    ax.set_xlabel("damping λ / mean eigenvalue (TRAK: its ridge)")
    ax.set_ylabel("LDS (mean Spearman, 95 % interval)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
