"""What a checkpointed network call keeps: its memory model (whether checkpointing keeps less, and
the levels of the nested schedule), counting what the call's `SolveVariant` keeps
(`SolveVariant.least_kept`). The thresholds are the settings' `Policy`.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import jax
import numpy as np

from .._graph import under_vmap
from .._options import Settings
from .._plan import Plan
from ._choice import solve_variant
from ._segments import rows_cut, segment_length, split


def nbytes(tree: Any) -> int:
    """Bytes of the leaves of ``tree`` (arrays or abstract values)."""
    return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


def checkpoint_levels(plan: Plan, theta: dict, inputs: tuple, settings: Settings) -> tuple[int, ...] | None:
    """The checkpoints of each level (one level: evenly spaced) for a call of ``plan.net`` with
    ``settings.checkpoints``, or None where the call runs without checkpoints: none asked for,
    too few layers, forward mode, or not predicted to keep less (`checkpoint_memory_ratio`,
    `Policy.checkpoints_pay`)."""
    net, k = plan.net, settings.checkpoints
    if not k or settings.forward_only or k >= len(net.layers) - 1:
        return None
    levels = (k,)
    if settings.schedule == "nested":
        state = _state_bytes(plan)
        level_cost = nbytes(theta) / max(sum(state.values()) / len(state), 1)
        levels = settings.policy.nested_levels(len(net.layers), k, level_cost)
    if settings.policy.checkpoints_pay(*checkpoint_memory_ratio(plan, theta, inputs, levels, settings)):
        return levels
    return None


def _state_bytes(plan: Plan) -> dict[Hashable, int]:
    """Bytes of one row of each state (by name)."""
    return {name: nbytes(plan.state_groups[g].row_avals()) for name, (g, _) in plan.state_loc.items()}


def checkpoint_memory_ratio(plan: Plan, theta: dict, inputs: tuple, levels: tuple[int, ...],
                            settings: Settings) -> tuple[float, float]:
    """What checkpointing with ``levels`` (states per level, `Policy.nested_levels`) is predicted
    to keep, as a fraction of the same call without (by the shapes alone): an estimate and a
    pessimistic bound.

    The estimate. Without: every state, every stored residual and Λ. With: the states the top
    level's segments return (outputs, and states later segments read), twice (kept, then stacked
    or concatenated into the outputs), twice the states each level below keeps, twice a leaf
    segment's share of the above (its recomputation and its back substitution), and the rows of
    stacked blocks and inputs cut out for segments that run on their own, with their gradients.
    Where every state is an output (a ``Stack`` of them), or with one checkpoint (two halves),
    checkpointing keeps no less; the call then runs without it.

    A leaf segment that loops over kinds (not unrolled) gathers the blocks of each parameter
    group that has several named members into one stacked buffer and scatters into its
    cotangent, in its recomputation and in its back substitution: twice two copies of those
    blocks (`_looped_block_copies`). The plain call's one loop does so too, but the states it
    keeps hold those buffers' space in XLA's assignment where they are large, and where they are
    small (one example) counting it there would predict a saving that segments do not make. Not
    counted under vmap, where the states counted are one example's.

    Products with the Jacobians of a checkpointed call (``settings.products``: gauss_newton)
    transpose the scan over its segments once per product, each into a parameter-sized cotangent
    stack that XLA allocates before the first; under vmap the scan's parameter cotangents are
    stacked per example: both counted as two copies of the parameters.

    The bound adds what a leaf segment may copy — the rows of stacked blocks its layers have to
    themselves, and its products with them — and counts the plain call at its least: with ℳΛ
    formed in the back substitution it carries Λ from step to step instead of keeping every Λ.
    Both are rough — XLA's buffer assignment decides — and were checked against
    ``memory_analysis()`` over random networks (``benchmarks/profile.py checkpoint-memory
    --sweep``; the numbers are in docs/performance.md)."""
    net, state = plan.net, _state_bytes(plan)
    param_cotangents = 2 * nbytes(theta) if settings.products or under_vmap() else 0
    residuals = 0 if settings.remat else sum(nbytes(a) * (n + 1) for a, n in zip(plan.res_avals, plan.res_rows))
    layers = [layer.name for layer in net.layers]
    states = sum(state[name] for name in layers)
    block_copies = _looped_block_copies(plan)
    plain = 2 * states + residuals
    segments = split(net, levels[0], settings.policy.longest_checkpoint_period)
    kept = sum(state[layers[sg.start + j]] for sg in segments for j in sg.returns)
    leaf, below = max(len(sg.net.layers) for sg in segments), 0
    for k in levels[1:]:
        if k < leaf - 1:
            leaf, below = segment_length(leaf, k), below + 2 * k * states / len(layers)
    given = dict(zip(net.inputs, inputs))
    cut = 0
    for (kind, name), rows in rows_cut(net, levels[0], settings.policy.longest_checkpoint_period).items():
        source = theta[name] if kind == "block" else given[name]
        cut += 2 * nbytes(source) * rows // max(jax.tree.leaves(source)[0].shape[0], 1)
    # under vmap the states here are one example's (the vmapped size is not known) and the blocks
    # are not batched: their copies would outweigh states that are in fact many times larger
    leaf_loops = not plan.unrolled and not under_vmap() and (settings.engine == "loop"
                                                             or settings.policy.loop_pays(leaf, len(plan.kinds)))
    checkpointed = (2 * kept + below + 2 * leaf * plain / len(layers) + cut + param_cotangents
                    + (2 * block_copies if leaf_loops else 0))
    segment_rows = 2 * leaf * _own_param_row_bytes(plan) / len(layers)
    least = solve_variant(plan, settings, True).least_kept(states, residuals)
    return checkpointed / plain, (checkpointed + segment_rows) / least


def _looped_block_copies(plan: Plan) -> int:
    """Bytes a loop over kinds copies of the blocks: each parameter group of several named
    blocks (not one stacked block read by rows) stacked once and its cotangent scattered into."""
    return sum(2 * nbytes(g.row_avals()) * g.rows for g in plan.param_groups
               if g.stacked_rows is None and len(g.names) > 1)


def _own_param_row_bytes(plan: Plan) -> int:
    """Bytes of the parameter rows the layers do not share with the other members of their kind
    (a chain's stacked weights; nothing of an RNN's A, B, c), summed over the layers."""
    return sum(kind.size * nbytes(plan.param_groups[g].row_avals()) for kind in plan.kinds
               for g, row in zip(kind.param_groups, kind.shared_rows) if row is None)
