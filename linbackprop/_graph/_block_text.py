"""Text pictures of block patterns (ℒ, ℳ and their adjoints), in the spirit of the seed's Julia
display."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from ._layer import label


def block_matrix_text(pattern: np.ndarray, rows: Sequence[Hashable], cols: Sequence[Hashable],
                      symbol: str, title: str, diagonal: str | None = None) -> str:
    """A block pattern as text: ``symbol`` where a block is stored, ``⋅`` where it is zero."""
    row_labels = [label(r) for r in rows]
    col_labels = [label(c) for c in cols]
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
