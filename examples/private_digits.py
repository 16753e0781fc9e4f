"""Differentially private training on digits: DP-SGD with `clipped_grad`, ε from dp_accounting.

DP-SGD (Abadi et al. 2016): each step samples every training example with probability q
(Poisson sampling), clips each sampled example's gradient to norm C, sums, adds Gaussian noise
N(0, σ²C²) and divides by the expected batch qN. Here

- the clipped sum and the norms are one call, `lbp.clipped_grad(losses, C)` — one back
  substitution, ghost norms, ℳ with each example's weight: no per-example gradient is formed;
- the noise is optax's own `optax.add_noise` (variance σ²C², no annealing), chained before
  `optax.scale(1 / qN)` and Adam (post-processing: no privacy cost);
- ε is computed by Google's `dp_accounting` (RDP accountant of the Poisson-sampled Gaussian
  mechanism composed over the steps) for δ = 1e-5, not by hand.

Poisson batches have random sizes; they are padded to a fixed capacity with examples of zero
weight (their losses are multiplied by 0, so their gradients are 0 and they are never clipped
into the sum), so one compiled step serves every batch. The script trains the same network
without privacy (`grad_by_solve`, the same Adam) for the same epochs and prints both test
accuracies and times per epoch.

    python examples/private_digits.py [--epochs 20] [--sigma 1.0] [--clip 1.0] [--batch 64]
"""

from __future__ import annotations

import argparse
import time

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import linbackprop as lbp


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help shows the description as written and each option's default."""


def dense(theta, h):
    w, b = theta
    return jnp.tanh(h @ w + b)


def network(depth: int) -> lbp.Network:
    """x → `depth` tanh layers (rows of one stacked block after the first) → logits."""
    layers = [lbp.Layer("h0", dense, ("x",), ("W_in", "b_in"))]
    for i in range(1, depth):
        layers.append(lbp.Layer(f"h{i}", lambda th, h: h + dense(th, h), (f"h{i - 1}",),
                                (lbp.Row("W", i - 1), lbp.Row("b", i - 1))))
    layers.append(lbp.Layer("logits", lambda th, h: h @ th[0], (f"h{depth - 1}",), ("W_out",)))
    return lbp.Network(layers, inputs=["x"], outputs="logits")


def init(key: jax.Array, depth: int, hidden: int) -> dict:
    k = jax.random.split(key, 3)
    return {"W_in": jax.random.normal(k[0], (64, hidden)) / 8.0, "b_in": jnp.zeros(hidden),
            "W": jax.random.normal(k[1], (depth - 1, hidden, hidden)) * 0.5 / np.sqrt(hidden),
            "b": jnp.zeros((depth - 1, hidden)), "W_out": jax.random.normal(k[2], (hidden, 10)) / np.sqrt(hidden)}


def epsilon(q: float, sigma: float, steps: int, delta: float) -> float:
    """ε of `steps` Poisson-sampled Gaussian mechanisms (rate q, noise multiplier σ) at δ."""
    accountant = dp_accounting.rdp.RdpAccountant()
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
    accountant.compose(dp_accounting.SelfComposedDpEvent(event, steps))
    return float(accountant.get_epsilon(delta))


def poisson_batches(rng: np.random.Generator, n: int, q: float, capacity: int, steps: int):
    """Per step: indices padded to ``capacity`` and a 0/1 weight per slot (Poisson sampling)."""
    for _ in range(steps):
        chosen = np.flatnonzero(rng.random(n) < q)
        if len(chosen) > capacity:  # never silently drop a sampled example: that changes the privacy
            raise RuntimeError(f"a Poisson batch of {len(chosen)} exceeds the capacity {capacity}; raise it.")
        index = np.zeros(capacity, np.int64)
        index[:len(chosen)] = chosen
        weight = np.zeros(capacity, np.float32)
        weight[:len(chosen)] = 1.0
        yield index, weight


def main(epochs: int = 20, sigma: float = 1.0, clip: float = 1.0, batch: int = 64, lr: float = 3e-3,
         depth: int = 3, hidden: int = 64, delta: float = 1e-5, seed: int = 0) -> dict:
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split((x / 16).astype(np.float32), y, test_size=0.2,
                                                        random_state=seed, stratify=y)
    n = len(x_train)
    q, capacity = batch / n, 2 * batch
    steps = epochs * n // batch
    net = network(depth)

    def losses(params, x, y, weight):  # per-example; zero weight: a padding slot
        return weight * optax.softmax_cross_entropy_with_integer_labels(net(params, x), y)

    private = optax.chain(optax.add_noise((sigma * clip) ** 2, 0.0, seed), optax.scale(1.0 / batch),
                          optax.adam(lr))
    public = optax.adam(lr)

    @jax.jit
    def private_step(params, state, x, y, weight):
        clipped, norms = lbp.clipped_grad(losses, clip)(params, x, y, weight)
        updates, state = private.update(clipped, state, params)
        return optax.apply_updates(params, updates), state, jnp.sum(weight * (norms > clip))

    @jax.jit
    def public_step(params, state, x, y):
        grads = lbp.grad_by_solve(lambda p, x, y: jnp.mean(losses(p, x, y, jnp.ones(len(y)))))(params, x, y)
        updates, state = public.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    accuracy = lambda p: float(jnp.mean(jnp.argmax(net(p, jnp.asarray(x_test)), axis=1) == y_test))
    params0 = init(jax.random.PRNGKey(seed), depth, hidden)

    rng = np.random.default_rng(seed)
    warm = np.arange(capacity) % n  # compile both steps first: the epochs are timed without it
    jax.block_until_ready(private_step(params0, private.init(params0), x_train[warm], y_train[warm],
                                       np.ones(capacity, np.float32)))
    jax.block_until_ready(public_step(params0, public.init(params0), x_train[:batch], y_train[:batch]))
    params, state, clipped_count, sampled = params0, private.init(params0), 0, 0
    start = time.perf_counter()
    for index, weight in poisson_batches(rng, n, q, capacity, steps):
        params, state, count = private_step(params, state, x_train[index], y_train[index], weight)
        clipped_count, sampled = clipped_count + int(count), sampled + int(weight.sum())
    jax.block_until_ready(params)
    private_time = (time.perf_counter() - start) / epochs
    private_accuracy = accuracy(params)

    params, state = params0, public.init(params0)
    start = time.perf_counter()
    for _ in range(epochs):
        order = rng.permutation(n)
        for s in range(0, n - batch + 1, batch):
            idx = order[s:s + batch]
            params, state = public_step(params, state, x_train[idx], y_train[idx])
    jax.block_until_ready(params)
    public_time = (time.perf_counter() - start) / epochs
    public_accuracy = accuracy(params)

    eps = epsilon(q, sigma, steps, delta)
    print(f"DP-SGD: {steps} steps, q = {q:.4f}, σ = {sigma}, C = {clip}: (ε = {eps:.2f}, δ = {delta:g})-DP; "
          f"{clipped_count / max(sampled, 1):.0%} of the sampled gradients clipped")
    print(f"test accuracy: private {private_accuracy:.3f}, non-private {public_accuracy:.3f}")
    print(f"time per epoch: private {private_time:.2f} s (padded to {capacity} slots a step), "
          f"non-private {public_time:.2f} s")
    return {"epsilon": eps, "private_accuracy": private_accuracy, "public_accuracy": public_accuracy,
            "private_time": private_time, "public_time": public_time, "steps": steps,
            "clipped_fraction": clipped_count / max(sampled, 1)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=_Help)
    parser.add_argument("--epochs", type=int, default=20, help="passes over the training set")
    parser.add_argument("--sigma", type=float, default=1.0, help="noise multiplier (noise std = sigma · clip)")
    parser.add_argument("--clip", type=float, default=1.0, help="per-example clipping norm")
    parser.add_argument("--batch", type=int, default=64, help="examples per batch")
    parser.add_argument("--seed", type=int, default=0, help="seed of the split, the parameters and the noise")
    args = parser.parse_args()
    main(epochs=args.epochs, sigma=args.sigma, clip=args.clip, batch=args.batch, seed=args.seed)
