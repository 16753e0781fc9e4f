"""The loop over the topologically ordered layers: `run_loop` drives a body through the plan's
segments (a `lax.fori_loop` switching over kinds, or straight-line steps), and a step's layer
arguments are read from the buffers (`layer_arguments`, `own_residuals`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
from jax import lax

from .._plan import Kind, Plan
from ._rows import Index, Primal, index_at, read_row, read_rows


class Step(NamedTuple):
    """A step of a substitution: its index (an int when unrolled, else an `Index`) and its
    kind when known at trace time (unrolled, one kind, or inside a periodic segment)."""

    index: Any
    kind: int | None
    segment: tuple[int, int] | None = None  # (start, stop) of the loop segment, when looping


def run_loop(plan: Plan, body: Callable[[Step, Any], Any], init: Any, reverse: bool = False,
          enter: Callable[[int, int, Any], Any] | None = None,
          leave: Callable[[int, int, Any], Any] | None = None) -> Any:
    """Run ``body`` over the steps, first to last (or last to first): straight-line code when the
    plan is unrolled, else ``lax.fori_loop``s over its segments (``Plan.segments``), each entered
    with ``enter(start, stop, carry)`` and left with ``leave(start, stop, carry)`` where given."""
    carry = init
    if plan.unrolled:
        steps = range(plan.depth)
        for i in reversed(steps) if reverse else steps:
            carry = body(Step(i, int(plan.step_kind[i])), carry)
        return carry
    for start, stop, period in reversed(plan.segments) if reverse else plan.segments:
        if enter is not None:
            carry = enter(start, stop, carry)
        carry = _segment(plan, body, carry, start, stop, period, reverse)
        if leave is not None:
            carry = leave(start, stop, carry)
    return carry


def _segment(plan: Plan, body: Callable, carry: Any, start: int, stop: int, period: int, reverse: bool) -> Any:
    if period == 0 and stop - start < len(plan.kinds):
        # Fewer steps than kinds (a transformer's embedding or head): straight-line steps of known
        # kinds. A loop of one step would compile a switch over every kind, and write every
        # kind's slots, for each such step (a 12-block GPT: 120 → 64 kernels outside its loops).
        for i in range(stop - 1, start - 1, -1) if reverse else range(start, stop):
            carry = body(Step(i, int(plan.step_kind[i]), (start, stop)), carry)
        return carry
    if period == 0:  # kinds in no pattern: one step per iteration, a switch over kinds
        single = 0 if len(plan.kinds) == 1 else None

        steps = np.arange(start, stop)[::-1] if reverse else np.arange(start, stop)

        def one(t, c):
            return body(Step(Index(t, steps), single, (start, stop)), c)

        return lax.fori_loop(0, stop - start, one, carry)
    # Kinds repeat with this period: one iteration runs `period` steps of known kinds, no switch.
    blocks = (stop - start) // period

    firsts = start + period * (np.arange(blocks)[::-1] if reverse else np.arange(blocks))

    def block(t, c):
        for j in reversed(range(period)) if reverse else range(period):
            c = body(Step(Index(t, firsts + j), int(plan.step_kind[start + j]), (start, stop)), c)
        return c

    return lax.fori_loop(0, blocks, block, carry)


def layer_arguments(plan: Plan, kind: Kind, prim: Primal, pos: Any, written: bool = False,
               shared_once: bool = False) -> tuple[tuple, tuple]:
    """θ and input states of the kind's member ``pos`` (an index or an array of indices);
    ``written``: the loop writes the states; ``shared_once``: a block all members use is read
    once (one row, not a row per member)."""
    if isinstance(pos, np.ndarray):  # all members at once: static tables
        theta = tuple(read_row(prim.params[g], row) if shared_once and row is not None
                      else read_rows(prim.params[g], kind.by_member.params[pos, p])
                      for p, (g, row) in enumerate(zip(kind.param_groups, kind.shared_rows)))
        inputs = tuple(read_rows(prim.states[g], kind.by_member.reads[pos, r]) for r, g in enumerate(kind.read_groups))
    else:
        pslots, rslots = index_at(kind.by_member.params, pos), index_at(kind.by_member.reads, pos)
        theta = tuple(read_row(prim.params[g], pslots[..., p]) for p, g in enumerate(kind.param_groups))
        inputs = tuple(read_row(prim.states[g], rslots[..., r], written) for r, g in enumerate(kind.read_groups))
    theta = tuple(plan.param_groups[g].typed(t) for t, g in zip(theta, kind.param_groups))
    inputs = tuple(plan.state_groups[g].typed(u) for u, g in zip(inputs, kind.read_groups))
    return theta, inputs


def own_residuals(prim: Primal, kind: Kind, pos: Any) -> tuple:
    """The stored residuals of the kind's member ``pos`` (an index or an array of indices)."""
    take = read_rows if isinstance(pos, np.ndarray) else read_row
    return tuple(take(prim.residuals[r], off + pos) for r, off in zip(kind.own_groups, kind.own_offsets))
