"""Text pictures: block patterns of ℒ and ℳ* (in the spirit of the seed's Julia display) and a
compact view of a network's DAG."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np


def _label(name: Hashable) -> str:
    from ._network import Row

    if isinstance(name, Row):
        return f"{_label(name.block)}[{name.index}]"
    return name if isinstance(name, str) else repr(name)


def block_matrix_text(pattern: np.ndarray, rows: Sequence[Hashable], cols: Sequence[Hashable],
                      symbol: str, title: str, diagonal: str | None = None) -> str:
    """A block pattern as text: ``symbol`` where a block is stored, ``⋅`` where it is zero."""
    row_labels = [_label(r) for r in rows]
    col_labels = [_label(c) for c in cols]
    width = max([len(symbol) + 1, *(len(c) for c in col_labels), len(diagonal or "")]) + 1
    head = max((len(r) for r in row_labels), default=0)
    lines = [title, " " * (head + 2) + "".join(c.rjust(width) for c in col_labels)]
    for i, r in enumerate(row_labels):
        cells = []
        for j in range(len(col_labels)):
            if not pattern[i, j]:
                cells.append("⋅")
            elif diagonal is not None and i == j:
                cells.append(diagonal)
            else:
                cells.append(symbol)
        lines.append(r.rjust(head) + " [" + "".join(c.rjust(width) for c in cells) + " ]")
    return "\n".join(lines)


def pattern_text(op: Any) -> str:
    """The pattern of an operator of a linearisation (ℒ, ℒ*, ℳ or ℳ*)."""
    from ._operators import StateOperator

    net = op._plan.net
    p = op.pattern
    if isinstance(op, StateOperator):
        symbol = "ℒ′" if op._adjoint else "ℒ"
        title = f"{p.shape[0]}×{p.shape[1]} {symbol} over layers {list(net.order)!r}: {int(p.sum())} stored blocks"
        return block_matrix_text(p, net.order, net.order, symbol, title, diagonal="ℐ")
    if op._adjoint:
        title = f"{p.shape[0]}×{p.shape[1]} ℳ* (layers × parameter blocks): {int(p.sum())} stored blocks"
        return block_matrix_text(p, net.order, net.param_names, "ℳ′", title)
    title = f"{p.shape[0]}×{p.shape[1]} ℳ (parameter blocks × layers): {int(p.sum())} stored blocks"
    return block_matrix_text(p, net.param_names, net.order, "ℳ", title)


def _fn_name(fn: Any) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def network_repr(net: Any) -> str:
    """One line per layer in topological order: ``name = fn(reads; params)``."""
    outs = net.outputs[0] if net.single_output else list(net.outputs)
    lines = [f"Network(inputs={list(net.inputs)!r}, outputs={outs!r}, "
             f"{len(net.order)} layers, {len(net.param_names)} parameter blocks)"]
    for layer in net.layers:
        reads = ", ".join(_label(r) for r in layer.reads)
        params = ", ".join(_label(p) for p in layer.params)
        lines.append(f"  {_label(layer.name)} = {_fn_name(layer.fn)}({reads}" + (f"; {params})" if params else ")"))
    return "\n".join(lines)
