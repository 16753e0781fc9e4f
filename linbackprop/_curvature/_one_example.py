"""The per-example gradients of what a loss reads of its arguments beside its networks (a head
applied after the last layer named in ``layers=``), each from that example's rows alone.

The Jacobian of the (B,) losses in such leaves by reverse mode is B backward passes of the whole
batch's head: for a dense head each pass is a [width × B] · [B × classes] product of which one
row counts, B² work for B outer products. Where every loss reads only its own example — which
the per-example transforms check before they get here — the loss of example b is the loss of a
batch of one: example b's rows of the networks' outputs and of the data arguments. Then
``jax.vmap`` over the examples of ``jax.grad`` of that one-example loss gives every per-example
gradient in one batched backward pass of the head.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._graph import agree_at_random, at_random
from ._calls import Calls
from ._examples import per_example_losses
from ._split import Split


def one_example_losses(split: Split, calls: Calls, batch: int) -> Callable | None:
    """``each(outs, g)``: ``g(loss_b)`` for every example b at once (``jax.vmap``), ``loss_b(*diff)``
    the loss of example b computed from its rows alone — example b's rows of the calls' outputs
    ``outs`` and of the arguments not differentiated whose leading axis is the batch, the rest
    whole; or None where that does not give ``fun``'s losses.

    Which arguments are data is read off their shapes, so the result is checked once at trace
    time against the losses of the whole batch, on random values of the outputs and of the
    differentiated arguments (`at_random`): a frozen argument whose leading axis happens to equal
    the batch, or a loss that cannot run on one example (a reshape to the batch written into
    it), gives None, and the caller keeps the batch's Jacobian (exact, B backward passes)."""
    axes = calls.batch_axes()
    if calls.spans is not None or any(not np.ndim(x) or np.shape(x)[a] != batch
                                      for call, call_axes in zip(calls.outs, axes)
                                      for x, a in zip(jax.tree.leaves(call), call_axes)):
        return None
    rest = [n for n in range(len(split.args)) if n not in split.argnums]
    flat = [jax.tree.flatten(split.args[n]) for n in rest]
    rest_leaves, rest_defs = [leaves for leaves, _ in flat], [treedef for _, treedef in flat]
    is_data = [[_rows_of_examples(x, batch) for x in leaves] for leaves in rest_leaves]
    out_defs = [jax.tree.structure(call) for call in calls.outs]
    # a captured model's program was traced at the batch: its own trace on one example runs there
    on_one_example = getattr(split.fun, "__linbackprop_one_example__", split.fun)

    def each(outs: tuple, g: Callable[[Callable], Any]) -> Any:
        # each sliced leaf keeps its batch axis with one entry (x[..., b:b+1, ...] under the vmap)
        split_outs = [[jnp.expand_dims(x, a + 1) for x, a in zip(jax.tree.leaves(call), call_axes)]
                      for call, call_axes in zip(outs, axes)]
        data = [[jnp.expand_dims(x, 1) for x, d in zip(leaves, flags) if d]
                for leaves, flags in zip(rest_leaves, is_data)]

        def of_one(example_outs: list, example_data: list) -> Any:
            args = list(split.args)
            for n, treedef, leaves, flags, rows in zip(rest, rest_defs, rest_leaves, is_data, example_data):
                rows = iter(rows)
                args[n] = jax.tree.unflatten(treedef, [next(rows) if f else x for x, f in zip(leaves, flags)])
            one = Split(on_one_example, tuple(args), split.argnums, False)
            outs_of_one = tuple(jax.tree.unflatten(t, leaves) for t, leaves in zip(out_defs, example_outs))
            return g(lambda *d: per_example_losses(one, outs_of_one, d)[0])

        return jax.vmap(of_one, in_axes=([list(a) for a in axes], 0))(split_outs, data)

    def both(outs: tuple, *diff: Any) -> tuple[jax.Array, jax.Array]:
        return per_example_losses(split, outs, diff), each(outs, lambda loss_b: loss_b(*diff))

    aval = lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x))
    try:
        evaluate, values, _ = at_random(both, jax.tree.map(aval, calls.outs), *jax.tree.map(aval, split.diff))
        with jax.ensure_compile_time_eval():
            full, one_by_one = evaluate(*values)
    except Exception:  # whatever stops a loss running on one example: the batch's Jacobian instead
        return None
    return each if agree_at_random(full, one_by_one, low_precision_tol=1e-4) else None


def _rows_of_examples(x: Any, batch: int) -> bool:
    """Whether a leaf of an argument not differentiated is read as the examples' rows: an array
    whose leading axis is the batch (a raw PRNG key, uint32 [2], has none)."""
    return hasattr(x, "shape") and np.ndim(x) >= 1 and np.shape(x)[0] == batch
