"""Train on digits with optax, running grad_by_solve and jax.grad side by side.

Two copies of the same parameters follow the same optax.adam updates, one driven by
grad_by_solve (the back substitution ℒ*Λ = ∇Uℓ, then ℳΛ), the other by jax.grad. After every
step the script records how far apart the two gradients and the two parameter sets are: in
float32 they agree to rounding throughout training.

    python examples/train_digits.py [--epochs 20] [--seed 0]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import linbackprop as lbp


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help shows the description as written and each option's default."""


def block(theta, h):  # a residual block: h + tanh(h W + b)
    w, b = theta
    return h + jnp.tanh(h @ w + b)


def network(depth: int) -> lbp.Network:
    """x → embed → `depth` residual blocks → logits, with a skip from the embedding to the logits."""
    layers = [lbp.Layer("embed", lambda th, x: jnp.tanh(x @ th[0]), ("x",), ("E",))]
    prev = "embed"
    for i in range(depth):
        layers.append(lbp.Layer(f"block{i}", block, (prev,), (f"W{i}", f"b{i}")))
        prev = f"block{i}"
    layers.append(lbp.Layer("logits", lambda th, h, e: (h + e) @ th[0], (prev, "embed"), ("O",)))
    return lbp.Network(layers, inputs=["x"], outputs="logits")


def init(key, depth: int, hidden: int) -> dict:
    keys = iter(jax.random.split(key, depth + 2))
    params = {"E": jax.random.normal(next(keys), (64, hidden)) / 8.0,
              "O": jax.random.normal(next(keys), (hidden, 10)) / np.sqrt(hidden)}
    for i in range(depth):
        params[f"W{i}"] = jax.random.normal(next(keys), (hidden, hidden)) * 0.5 / np.sqrt(hidden)
        params[f"b{i}"] = jnp.zeros(hidden)
    return params


def max_difference(a, b) -> float:
    return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def main(epochs: int = 20, seed: int = 0, depth: int = 3, hidden: int = 64, batch: int = 64) -> dict:
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split((x / 16).astype(np.float32), y, test_size=0.25,
                                                        random_state=seed, stratify=y)
    net = network(depth)
    loss = lambda p, x, y: optax.softmax_cross_entropy_with_integer_labels(net(p, x), y).mean()
    optimizer = optax.adam(3e-3)

    def make_step(grad):
        @jax.jit
        def step(p, s, x, y):
            g = grad(loss)(p, x, y)
            updates, s = optimizer.update(g, s, p)
            return optax.apply_updates(p, updates), s, g

        return step

    step_solve, step_jax = make_step(lbp.grad_by_solve), make_step(jax.grad)
    p_solve = p_jax = init(jax.random.PRNGKey(seed), depth, hidden)
    s_solve = s_jax = optimizer.init(p_solve)
    rng = np.random.default_rng(seed)
    worst_grad = worst_param = 0.0
    for epoch in range(epochs):
        order = rng.permutation(len(x_train))
        for b in range(0, len(order) - batch + 1, batch):
            xb, yb = x_train[order[b:b + batch]], y_train[order[b:b + batch]]
            p_solve, s_solve, g_solve = step_solve(p_solve, s_solve, xb, yb)
            p_jax, s_jax, g_jax = step_jax(p_jax, s_jax, xb, yb)
            worst_grad = max(worst_grad, max_difference(g_solve, g_jax))
            worst_param = max(worst_param, max_difference(p_solve, p_jax))
        print(f"epoch {epoch + 1:3d}: loss {float(loss(p_solve, x_train, y_train)):.4f}  "
              f"max |Δgrad| so far {worst_grad:.1e}  max |Δparams| {worst_param:.1e}")
    accuracy = float(jnp.mean(jnp.argmax(net(p_solve, x_test), -1) == y_test))
    print(f"test accuracy {accuracy:.4f}")
    return {"accuracy": accuracy, "max_grad_difference": worst_grad, "max_param_difference": worst_param}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=_Help)
    parser.add_argument("--epochs", type=int, default=20, help="passes over the training set")
    parser.add_argument("--seed", type=int, default=0, help="seed of the split and the parameters")
    args = parser.parse_args()
    main(args.epochs, args.seed)
