"""Optional matplotlib pictures: spy plots of ℒ and ℳ*, and the DAG of a network.

matplotlib is imported only when one of these is called (``pip install linbackprop[examples]``).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Hashable, Sequence
from typing import Any

import jax
import numpy as np

from .._graph import Layer, Network, Row, label
from .._plan import function_key


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
    square per stored block of ``op.pattern``.

    Args:
        op: ``lin.L``, ``lin.L.T``, ``lin.M`` or ``lin.M.T`` of a [`linearize`][linbackprop.linearize].
        ax: the matplotlib axes to draw on (a new figure's if None).
        dense: draw every nonzero entry (tiny networks) instead of one square per block.
        title: the axes' title (the operator's name if None).

    Returns:
        The matplotlib axes.

    Raises:
        TypeError: ``op`` not an operator of a linearisation.

    Examples:
        >>> import jax.numpy as jnp, linbackprop as lbp
        >>> layer = lbp.Layer(1, lambda th, x: jnp.tanh(x @ th[0]), (0,), ("W",))
        >>> net = lbp.Network([layer], [0], 1)
        >>> lin = lbp.linearize(net, {"W": jnp.eye(2)}, jnp.ones((3, 2)))
        >>> ax = lbp.spy(lin.L)  # doctest: +SKIP
    """
    from .._operators import ParamOperator, StateOperator

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


def layout(net: Network) -> dict[Hashable, tuple[int, int]]:
    """Where ``plot_network`` draws each state: x its place in topological order (inputs first),
    y its lane. Where two or more kinds of layer repeat (one function for several layers: a
    transformer's attention and MLP blocks; kinds as the plan finds them, by ``function_key``),
    each such kind gets a lane of its own, 0, −1, −2, …
    in order of first appearance, so that layers of a kind line up; inputs and everything else
    stay on lane 0. With fewer repeating kinds every state is on lane 0."""
    repeated = [members for members in _kinds(net).values() if len(members) > 1]
    lane = {layer.name: -j for j, members in enumerate(repeated) for layer in members} if len(repeated) > 1 else {}
    return {name: (n, lane.get(name, 0)) for n, name in enumerate([*net.inputs, *net.order])}


def _kinds(net: Network) -> dict[Any, list[Layer]]:
    """The layers grouped by kind (``function_key`` of their function), in order of first use."""
    members: dict[Any, list[Layer]] = {}
    for layer in net.layers:
        members.setdefault(function_key(layer.fn), []).append(layer)
    return members


NAME_POINTS = 9  # the compact drawing's node names and legend: readable in a page at 1280 px


def plot_network(net: Network, ax: Any = None, title: str | None = None) -> Any:
    """Draw the DAG: states left to right in topological order, an arc for every read.

    Blue arrows read the state just before, orange arcs above are skip connections (reads of any
    other state). Small networks list each layer's parameter blocks under it, so shared blocks
    are visible. Networks with more than 12 states or with two or more repeating kinds of layer
    (see `layout`: a transformer's attention and MLP layers on lanes of their own) are
    drawn compactly: one colour per repeating kind with its blocks in the legend, names under
    the nodes, and a dashed purple arc below for each block shared across kinds (tied
    embeddings).

    Args:
        net: the network.
        ax: the matplotlib axes to draw on (a new figure's if None).
        title: the axes' title.

    Returns:
        The matplotlib axes.

    Examples:
        >>> import jax.numpy as jnp, linbackprop as lbp
        >>> net = lbp.Network([lbp.Layer("h", lambda th, x: x, ("x",)),
        ...                    lbp.Layer("y", lambda th, h, x: h + x, ("h", "x"))], ["x"], "y")
        >>> ax = lbp.plot_network(net)  # doctest: +SKIP
    """
    names: list[Hashable] = [*net.inputs, *net.order]
    places = layout(net)
    lanes = {y for _, y in places.values()}
    compact = len(names) > 12 or len(lanes) > 1
    if ax is None:
        size = (min(30.0, max(5.0, 0.42 * len(names))), 3.0 + 0.5 * len(lanes)) if compact else (5, 5)
        ax = _pyplot().subplots(figsize=size)[1]
    if compact:
        top, bottom = _draw_compact(net, ax, names, {name: (x, 0.6 * y) for name, (x, y) in places.items()})
    else:
        top, bottom = _draw_line(net, ax, names), -0.6
    ax.set_xlim(-0.8, len(names) - 0.2)
    ax.set_ylim(bottom, top)
    ax.axis("off")
    ax.set_title(title if title is not None else f"DAG: {len(net.order)} layers, {len(net.param_names)} blocks",
                 fontsize=9)
    return ax


def _draw_line(net: Network, ax: Any, names: list[Hashable]) -> float:
    """A small network on one line, each layer's blocks listed under it. Returns the top y."""
    x = {name: n for n, name in enumerate(names)}
    for layer in net.layers:
        for r in _state_reads(layer):
            gap = x[layer.name] - x[r]
            ax.annotate("", xy=(x[layer.name], 0), xytext=(x[r], 0),
                        arrowprops={"arrowstyle": "->", "color": "tab:blue" if gap == 1 else "tab:orange",
                                    "connectionstyle": f"arc3,rad={0.0 if gap == 1 else -0.35}",
                                    "shrinkA": 12, "shrinkB": 12})
    blocks = {layer.name: (*layer.params, *_row_reads(layer)) for layer in net.layers}
    for name in names:
        is_input = name in net.inputs
        text = label(name)
        # the node is the label's own box: a long name widens it instead of overflowing a circle
        ax.text(x[name], 0, text, ha="center", va="center", fontsize=9, zorder=3,
                bbox={"boxstyle": "circle,pad=0.35" if len(text) <= 2 else "round,pad=0.45",
                      "fc": "tab:green" if is_input else "white", "ec": "black"})
        if not is_input and blocks[name]:
            ax.text(x[name], -0.14, "\n".join(label(b) for b in blocks[name]), ha="center", va="top", fontsize=8)
    longest = max((x[layer.name] - x[r] for layer in net.layers for r in _state_reads(layer)), default=1)
    return 0.3 + 0.2 * longest


def _arc(ax: Any, a: tuple[float, float], b: tuple[float, float], peak: float, **style: Any) -> None:
    """An arc from a to b in data coordinates through y = ``peak`` halfway, with an arrow head
    at b when ``arrow``."""
    arrow = style.pop("arrow", False)
    t = np.linspace(0.0, 1.0, 60)
    xs = a[0] + (b[0] - a[0]) * t
    line = a[1] + (b[1] - a[1]) * t
    ys = line + (peak - line) * np.sin(np.pi * t) ** 0.6
    ax.plot(xs, ys, **style)
    if arrow:
        ax.annotate("", xy=(xs[-1], ys[-1]), xytext=(xs[-4], ys[-4]),
                    arrowprops={"arrowstyle": "->", "color": style.get("color"), "shrinkB": 5})


def _draw_compact(net: Network, ax: Any, names: list[Hashable], position: dict) -> tuple[float, float]:
    """Nodes coloured by repeating kind (legend: the kind's function and blocks), names rotated
    under the lowest lane, skip arcs above, dashed arcs below for blocks shared by layers of
    different kinds. Returns the (top, bottom) y used."""
    from matplotlib.lines import Line2D

    high = max(y for _, y in position.values())
    low = min(y for _, y in position.values())
    top = high + 0.4
    for layer in net.layers:
        for r in _state_reads(layer):
            gap = position[layer.name][0] - position[r][0]
            if gap == 1:
                ax.annotate("", xy=position[layer.name], xytext=position[r],
                            arrowprops={"arrowstyle": "->", "color": "tab:blue", "shrinkA": 5, "shrinkB": 5})
            else:
                peak = high + 0.25 + 0.2 * np.log2(gap)  # above every lane: never hidden by nodes
                _arc(ax, position[r], position[layer.name], peak, color="tab:orange", lw=0.9, arrow=True)
                top = max(top, peak + 0.1)
    members = _kinds(net)
    repeated = [fn for fn, ls in members.items() if len(ls) > 1]
    palette = ["C0", "C1", "C3", "C5", "C6", "C7", "C8", "C9"]  # not green (inputs), not purple (shared)
    colours = {fn: palette[j % len(palette)] for j, fn in enumerate(repeated)}
    kind_of = {layer.name: fn for fn, ls in members.items() for layer in ls}
    every = -(-len(names) // 72)  # names under at most 72 nodes: a wide network's every k-th
    # Names at a readable size: level where each fits between its neighbours, else upright.
    width = ax.figure.get_size_inches()[0] * ax.get_position().width
    room = width * every / max(len(names), 1)  # inches between named nodes
    level = max(len(label(name)) for name in names) * NAME_POINTS * 0.6 / 72 < 0.9 * room
    for n, name in enumerate(names):
        fn = kind_of.get(name)
        face = "tab:green" if fn is None else colours.get(fn, "white")
        ax.plot(*position[name], "o", ms=10 if every == 1 else 5, color=face, mec="black", zorder=3)
        if n % every == 0:
            ax.text(position[name][0], low - 0.2, label(name), rotation=0 if level else 90, ha="center", va="top",
                    fontsize=NAME_POINTS)
    handles = []
    for fn in repeated:
        blocks = _listed(_kind_patterns([[_pattern(p) for p in m.params] for m in members[fn]]))
        rows = ", ".join(dict.fromkeys(_pattern(r) for m in members[fn] for r in _row_reads(m)))
        text = f"{getattr(members[fn][0].fn, '__name__', 'layer')} ×{len(members[fn])}: {blocks}"
        handles.append(Line2D([], [], marker="o", ls="", color=colours[fn], mec="black",
                              label=text + (f"; reads {rows}" if rows else "")))
    users: dict[Hashable, list[Hashable]] = {}
    for layer in net.layers:
        for p in layer.params:
            if not isinstance(p, Row):
                users.setdefault(p, []).append(layer.name)
    bottom = low - 0.9
    for p, us in users.items():
        if len({kind_of[u] for u in us}) > 1:  # shared across kinds: invisible in the legend
            for a, b in itertools.pairwise(us):
                _arc(ax, (position[a][0], low - 1.0), (position[b][0], low - 1.0), low - 1.3, color="tab:purple",
                     ls="--", lw=0.9)
            handles.append(Line2D([], [], color="tab:purple", ls="--",
                                  label=f"{label(p)}: shared by {', '.join(map(label, us))}"))
            bottom = low - 1.4
    if handles:  # under the drawing, where no node or arc is
        wide = max(len(h.get_label()) for h in handles) > 60  # one entry a line where they are long
        ax.legend(handles=handles, loc="upper left", fontsize=NAME_POINTS, frameon=False, bbox_to_anchor=(0.0, 0.0),
                  ncol=1 if wide else min(3, len(handles)))
    return top, bottom


def _state_reads(layer: Layer) -> list[Hashable]:
    """The states and inputs a layer reads whole: an arc each."""
    return [r for r in layer.reads if not isinstance(r, Row)]


def _row_reads(layer: Layer) -> list[Row]:
    """Rows of stacked inputs a layer reads (an RNN's x_t): listed, not drawn as arcs."""
    return [r for r in layer.reads if isinstance(r, Row)]


def _kind_patterns(names: list[list[str]]) -> list[str]:
    """The blocks of one kind's layers as the legend lists them: where every layer has as many
    blocks and the j-th ones differ only in their numbers (``['blocks'][0]['W']``,
    ``['blocks'][1]['W']``: the blocks of a captured loop), one pattern per j with ``i`` for the
    numbers that vary; otherwise every distinct name."""
    if len({len(ns) for ns in names}) == 1:
        patterns = []
        for column in zip(*names):
            parts = [re.split(r"(\d+)", name) for name in column]
            texts_differ = any(len({p[k] for p in parts}) > 1 for k in range(0, len(parts[0]), 2))
            if len({len(p) for p in parts}) != 1 or texts_differ:  # more than the numbers differ
                break
            patterns.append("".join(tokens[0] if len(set(tokens)) == 1 else "i" for tokens in zip(*parts)))
        else:
            return list(dict.fromkeys(patterns))
    return list(dict.fromkeys(name for ns in names for name in ns))


def _listed(patterns: list[str], at_most: int = 3) -> str:
    """At most ``at_most`` patterns, then how many more; a prefix they all share (up to a ``]``
    or a ``.``: a captured module's path) is written once."""
    if not patterns:
        return "—"
    prefix = next((patterns[0][:n] for n in range(min(map(len, patterns)), 0, -1)
                   if all(p.startswith(patterns[0][:n]) for p in patterns)), "") if len(patterns) > 1 else ""
    prefix = prefix[: max(prefix.rfind("]"), prefix.rfind(".")) + 1]
    rest = [p[len(prefix):] for p in patterns]
    shown = ", ".join(rest[:at_most]) + ("" if len(rest) <= at_most else f", … ({len(rest)} in all)")
    return f"{prefix} {{{shown}}}" if prefix else shown


def _pattern(block: Hashable) -> str:
    """A block as the legend names it: ``attn[i]`` for rows of a stacked block."""
    return f"{label(block.block)}[i]" if isinstance(block, Row) else label(block)
