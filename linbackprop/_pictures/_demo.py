"""The demo's second half: a DAG network with skip connections and a shared block learns the
digits data set that ships inside scikit-learn, trained with optax on ``grad_by_solve``.

The network (64 pixels → 10 classes):

    h1 = tanh(x W1 + b1)
    h2 = h1 + tanh(h1 R + c)         ┐ one shared block pair (R, c):
    h3 = h2 + tanh(h2 R + c)         ┘ its gradient sums ℳ over both layers
    h4 = tanh(h3 W4 + h1 S4 + b4)    skip from h1
    logits = h4 Wo + h1 So + bo      skip from h1
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .._graph import Layer, Network
from .._solve import value_and_grad_by_solve


def dense(theta: tuple, x: jax.Array) -> jax.Array:
    w, b = theta
    return jnp.tanh(x @ w + b)


def residual(theta: tuple, h: jax.Array) -> jax.Array:
    r, c = theta
    return h + jnp.tanh(h @ r + c)


def merge(theta: tuple, h: jax.Array, skip: jax.Array) -> jax.Array:
    w, s, b = theta
    return jnp.tanh(h @ w + skip @ s + b)


def readout(theta: tuple, h: jax.Array, skip: jax.Array) -> jax.Array:
    w, s, b = theta
    return h @ w + skip @ s + b


def digits_network() -> Network:
    return Network(
        [
            Layer("h1", dense, ("x",), ("W1", "b1")),
            Layer("h2", residual, ("h1",), ("R", "c")),
            Layer("h3", residual, ("h2",), ("R", "c")),
            Layer("h4", merge, ("h3", "h1"), ("W4", "S4", "b4")),
            Layer("logits", readout, ("h4", "h1"), ("Wo", "So", "bo")),
        ],
        inputs=["x"],
        outputs="logits",
    )


def init_params(key: jax.Array, n_in: int = 64, hidden: int = 64, n_out: int = 10) -> dict[str, jax.Array]:
    shapes = {"W1": (n_in, hidden), "b1": (hidden,), "R": (hidden, hidden), "c": (hidden,),
              "W4": (hidden, hidden), "S4": (hidden, hidden), "b4": (hidden,),
              "Wo": (hidden, n_out), "So": (hidden, n_out), "bo": (n_out,)}
    keys = dict(zip(shapes, jax.random.split(key, len(shapes))))
    return {name: (jax.random.normal(keys[name], shape) / np.sqrt(shape[0]) if len(shape) == 2
                   else jnp.zeros(shape)) for name, shape in shapes.items()}


def load_digits_split(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Digits (8×8 images, 1797 samples) scaled to [0, 1], split 75/25 stratified."""
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as err:
        raise ImportError("The digits demo needs scikit-learn: pip install 'linbackprop[examples]'") from err
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    return tuple(train_test_split(x, y, test_size=0.25, random_state=seed, stratify=y))


def train_digits(epochs: int = 30, seed: int = 0, batch: int = 64, learning_rate: float = 3e-3,
                 progress: bool = True) -> dict[str, Any]:
    """Train the digits network with optax.adam on grad_by_solve; returns losses and accuracy."""
    x_train, x_test, y_train, y_test = load_digits_split(seed)
    net = digits_network()
    params = init_params(jax.random.PRNGKey(seed))
    optimizer = optax.adam(learning_rate)
    opt_state = optimizer.init(params)

    def loss(p, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(net(p, x), y).mean()

    @jax.jit
    def step(p, s, x, y):
        value, grads = value_and_grad_by_solve(loss)(p, x, y)
        updates, s = optimizer.update(grads, s, p)
        return optax.apply_updates(p, updates), s, value

    bar = _progress(range(epochs), progress)
    rng = np.random.default_rng(seed)
    losses: list[float] = []
    start = time.perf_counter()
    for _ in bar:
        order = rng.permutation(len(x_train))
        epoch = []
        for b in range(0, len(order) - batch + 1, batch):
            idx = order[b:b + batch]
            params, opt_state, value = step(params, opt_state, x_train[idx], y_train[idx])
            epoch.append(value)
        losses.append(float(jnp.mean(jnp.stack(epoch))))
        if hasattr(bar, "set_postfix"):
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
    seconds = time.perf_counter() - start
    accuracy = float(jnp.mean(jnp.argmax(net(params, x_test), axis=-1) == y_test))
    return {"net": net, "params": params, "losses": losses, "test_accuracy": accuracy, "seconds": seconds}


def _progress(it: Any, on: bool) -> Any:
    if not on:
        return it
    try:
        from tqdm import tqdm
    except ImportError:  # the bar is a nicety; training does not need it
        return it
    return tqdm(it, desc="training (grad_by_solve + optax.adam)", unit="epoch")


def figure(path: str, seed_lin: Any, net: Network, losses: list[float]) -> None:
    """PNG: spy plots of the seed's ℒ and ℳ*, the digits network's DAG, the loss curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = demo_figure(seed_lin, net, losses)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def demo_figure(seed_lin: Any, net: Network, losses: list[float]) -> Any:
    """The demo's matplotlib figure (see `figure`)."""
    import matplotlib.pyplot as plt

    from ._plots import plot_network, spy

    fig = plt.figure(figsize=(11, 8.6))
    grid = fig.add_gridspec(2, 2, height_ratios=[5, 2.6])
    bottom = grid[1, :].subgridspec(1, 2, width_ratios=[1.5, 1], wspace=0.15)
    spy(seed_lin.L, fig.add_subplot(grid[0, 0]), title="ℒ of the seed network (entries; blue lines: blocks)")
    m_star = spy(seed_lin.M.T, fig.add_subplot(grid[0, 1]), title="ℳ* of the seed network (entries)")
    m_star.set_xticks(m_star.get_xticks(), [f"θ{k}" for k in seed_lin.net.param_names], fontsize=7, rotation=90)
    m_star.set_xlabel("columns: blocks θₖ in order of first use along the layers\n"
                      "(weights θ1–θ8, biases θ9–θ13, numbered as in the seed)", fontsize=8)
    dag = plot_network(net, fig.add_subplot(bottom[0]), title="digits network: skips (orange), shared block R, c")
    dag.set_ylim(-0.75, dag.get_ylim()[1])  # the blocks listed under each layer, and no more
    curve = fig.add_subplot(bottom[1])
    curve.plot(np.arange(1, len(losses) + 1), losses, marker=".")
    curve.set(xlabel="epoch", ylabel="training loss (cross entropy)", yscale="log",
              title="training with optax.adam on grad_by_solve")
    fig.tight_layout()
    return fig
