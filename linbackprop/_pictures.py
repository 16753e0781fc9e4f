"""Optional matplotlib pictures: spy plots of ℒ and ℳ*, and the DAG of a network.

matplotlib is imported only when one of these is called (``pip install linbackprop[examples]``).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import jax
import numpy as np

from ._graph import Network, label


def _pyplot() -> Any:
    try:
        import matplotlib.pyplot as plt
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("linbackprop's plots need matplotlib: pip install 'linbackprop[examples]'") from err
    return plt


def _axes(ax: Any) -> Any:
    return ax if ax is not None else _pyplot().subplots(figsize=(5, 5))[1]


def _edges(sizes: Sequence[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(sizes)])


def spy(op: Any, ax: Any = None, dense: bool = True, title: str | None = None) -> Any:
    """Spy plot of an operator of a linearisation (``lin.L``, ``lin.L.T``, ``lin.M``, ``lin.M.T``).

    With ``dense`` (tiny networks only) every nonzero entry of ``op.todense()`` is drawn and grid
    lines separate the blocks (states and parameter blocks flattened in C order); otherwise one
    square per stored block of ``op.pattern``. Returns the matplotlib axes.

    Example:
        >>> import jax.numpy as jnp, linbackprop as lbp
        >>> net = lbp.Network([lbp.Layer(1, lambda th, x: jnp.tanh(x @ th[0]), (0,), ("W",))], [0], 1)
        >>> ax = lbp.spy(lbp.linearize(net, {"W": jnp.eye(2)}, jnp.ones((3, 2))).L)  # doctest: +SKIP
    """
    from ._operators import ParamOperator, StateOperator

    if not isinstance(op, StateOperator | ParamOperator):
        raise TypeError(f"spy draws lin.L, lin.L.T, lin.M or lin.M.T, got {type(op).__name__}.")
    ax = _axes(ax)
    lin, net = op.linearization, op.linearization.net
    state_sizes = [int(np.size(lin.states[n])) for n in net.order]
    param_sizes = [sum(int(np.size(x)) for x in jax.tree.leaves(lin.params[k])) for k in net.param_names]
    if isinstance(op, StateOperator):
        rows, cols, row_sizes, col_sizes = net.order, net.order, state_sizes, state_sizes
    elif op.adjoint:
        rows, cols, row_sizes, col_sizes = net.order, net.param_names, state_sizes, param_sizes
    else:
        rows, cols, row_sizes, col_sizes = net.param_names, net.order, param_sizes, state_sizes
    if dense:
        matrix = np.asarray(op.todense()) != 0
        r_edges, c_edges = _edges(row_sizes), _edges(col_sizes)
    else:
        matrix = op.pattern
        r_edges, c_edges = np.arange(len(rows) + 1), np.arange(len(cols) + 1)
    ax.imshow(matrix, cmap="Greys", interpolation="nearest", aspect="auto",
              extent=(0, matrix.shape[1], matrix.shape[0], 0))
    for e in r_edges[1:-1]:
        ax.axhline(e, color="tab:blue", lw=0.5)
    for e in c_edges[1:-1]:
        ax.axvline(e, color="tab:blue", lw=0.5)
    ax.set_yticks((r_edges[:-1] + r_edges[1:]) / 2, [label(r) for r in rows], fontsize=7)
    ax.set_xticks((c_edges[:-1] + c_edges[1:]) / 2, [label(c) for c in cols], fontsize=7, rotation=90)
    ax.set_title(title if title is not None else repr(op).splitlines()[0], fontsize=9)
    return ax


def plot_network(net: Network, ax: Any = None, title: str | None = None) -> Any:
    """Draw the DAG: states left to right in topological order, an arc for every read.

    Arcs above the line are skip connections (reads of a state other than the previous one);
    a layer's label lists its parameter blocks, so shared blocks are visible. Returns the axes.

    Example:
        >>> import jax.numpy as jnp, linbackprop as lbp
        >>> net = lbp.Network([lbp.Layer("h", lambda th, x: x, ("x",)),
        ...                    lbp.Layer("y", lambda th, h, x: h + x, ("h", "x"))], ["x"], "y")
        >>> ax = lbp.plot_network(net)  # doctest: +SKIP
    """
    ax = _axes(ax)
    names: list[Hashable] = [*net.inputs, *net.order]
    x = {name: n for n, name in enumerate(names)}
    blocks = {layer.name: layer.params for layer in net.layers}
    for layer in net.layers:
        for r in layer.reads:
            gap = x[layer.name] - x[r]
            rad = 0.0 if gap == 1 else -0.35
            ax.annotate("", xy=(x[layer.name], 0), xytext=(x[r], 0),
                        arrowprops={"arrowstyle": "->", "color": "tab:blue" if gap == 1 else "tab:orange",
                                    "connectionstyle": f"arc3,rad={rad}", "shrinkA": 9, "shrinkB": 9})
    for name in names:
        is_input = name in net.inputs
        text = label(name)
        ax.plot(x[name], 0, "o", ms=max(16, 4.5 * len(text)), color="tab:green" if is_input else "white", mec="black")
        ax.text(x[name], 0, text, ha="center", va="center", fontsize=7)
        if not is_input and blocks[name]:
            ax.text(x[name], -0.12, "\n".join(label(b) for b in blocks[name]), ha="center", va="top", fontsize=6)
    ax.set_xlim(-0.8, len(names) - 0.2)
    longest = max((x[layer.name] - x[r] for layer in net.layers for r in layer.reads), default=1)
    ax.set_ylim(-0.6, 0.3 + 0.2 * longest)
    ax.axis("off")
    ax.set_title(title if title is not None else f"DAG: {len(net.order)} layers, {len(net.param_names)} blocks",
                 fontsize=9)
    return ax
