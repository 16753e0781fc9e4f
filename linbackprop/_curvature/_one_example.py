"""The per-example gradients of what a loss reads of its arguments beside its networks (a head
applied after the last layer named in ``layers=``), each from that example's rows alone.

The Jacobian of the (B,) losses in such leaves by reverse mode is B backward passes of the whole
batch's head: for a dense head each pass is a [width × B] · [B × classes] product of which one
row counts, B² work for B outer products. Where every loss reads only its own example — which
the per-example transforms prove before they get here — the loss of example b is the loss of a
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

from .._graph import FREE, example_flow, row_codes
from ._calls import Calls
from ._examples import per_example_losses
from ._split import Split


def one_example_losses(split: Split, calls: Calls, batch: int) -> Callable | None:
    """``each(outs, g)``: ``g(loss_b)`` for every example b at once (``jax.vmap``), ``loss_b(*diff)``
    the loss of example b computed from its rows alone — example b's rows of the calls' outputs
    ``outs`` and of the data arguments, the rest whole; or None where the losses cannot run so.

    Which arguments are data is proved from the losses' program (`data_read_by_row`), for every
    value: a leaf whose rows loss b reads at row b alone; a frozen argument whose leading axis
    happens to equal the batch (class weights indexed by the labels) is read as a table, whole.
    That the losses traced again on one example compute what the batch's do is checked where
    the result is used, on the real values (`check_one_example`)."""
    axes = calls.batch_axes()
    if calls.spans is not None or any(not np.ndim(x) or np.shape(x)[a] != batch
                                      for call, call_axes in zip(calls.outs, axes)
                                      for x, a in zip(jax.tree.leaves(call), call_axes)):
        return None
    rest = [n for n in range(len(split.args)) if n not in split.argnums]
    flat = [jax.tree.flatten(split.args[n]) for n in rest]
    rest_leaves, rest_defs = [leaves for leaves, _ in flat], [treedef for _, treedef in flat]
    is_data = data_read_by_row(split, calls, batch, rest, rest_leaves, rest_defs)
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

    try:  # the losses must run on one example (a reshape to the batch written into them does not)
        jax.eval_shape(lambda outs, diff: each(outs, lambda loss_b: loss_b(*diff)), calls.outs, split.diff)
    except Exception:  # whatever stops a loss running on one example: the batch's Jacobian instead
        return None
    return each


def data_read_by_row(split: Split, calls: Calls, batch: int, rest: list[int], rest_leaves: list[list],
                     rest_defs: list) -> list[list[bool]]:
    """Per leaf of the arguments not differentiated (``rest``), whether it is data read by row:
    its leading axis is the batch and, its rows numbered as the examples (`example_flow`),
    every loss i reads row i of it or none of it, for every value (a network's input, which the
    losses of the outputs do not read, is sliced too: the model traced on one example takes it
    so). A leaf read as a table (indexed by labels, or by every example) is passed whole."""
    n_outs = len(jax.tree.leaves(calls.outs))  # free here: that the losses keep them apart is proved apart

    def losses_of(outs: tuple, leaves: list, *diff: Any) -> jax.Array:
        args = list(split.args)
        for n, treedef, part in zip(rest, rest_defs, leaves):
            args[n] = jax.tree.unflatten(treedef, part)
        return per_example_losses(Split(split.fun, tuple(args), split.argnums, False), outs, diff)

    aval = lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x))
    leaves_avals = [[aval(x) for x in leaves] for leaves in rest_leaves]
    n_diff = len(jax.tree.leaves(split.diff))
    program = None  # traced once, labelled in turn
    flags = []
    for g, leaves in enumerate(rest_leaves):
        group = []
        for k, x in enumerate(leaves):
            if not _rows_of_examples(x, batch):
                group.append(False)
                continue
            labels = [None] * n_outs + [
                row_codes(np.shape(y)) if (h, j) == (g, k) else None
                for h, ys in enumerate(rest_leaves) for j, y in enumerate(ys)] + [None] * n_diff
            if program is None:
                program = jax.make_jaxpr(losses_of)(calls.outs, leaves_avals, *split.diff)
            codes = example_flow(program, (), labels).codes[0].reshape(-1)
            group.append(bool(np.all((codes == FREE) | (codes == np.arange(codes.size)))))
        flags.append(group)
    return flags


def check_one_example(per_example: list, losses: Callable, picked: list) -> list:
    """``per_example`` (each example's gradient g_b in ``picked``, from `one_example_losses`) with
    a check on the real values inside the program: for a fixed direction v, g_b · v must equal
    the batch's directional derivative (∂loss_b/∂picked) v for every example b (one forward-mode
    pass of ``losses(picked)``, the batch's losses). Where an example's differ the losses traced
    on one example do not compute what the batch's compute: eagerly a ValueError, under a jit
    every result NaN. (A non-finite loss leaves nothing to compare: no check at that example.)"""
    rng = np.random.default_rng(0)
    direction = [jnp.asarray(rng.standard_normal(np.shape(p)), jnp.result_type(p)) for p in picked]
    expected = jax.jvp(losses, (picked,), (direction,))[1]
    found = sum(jnp.einsum("b...,...->b", j, v) for j, v in zip(per_example, direction))
    dtype = jnp.result_type(expected)
    tol = 1e-6 if jnp.finfo(dtype).bits >= 64 else 1e-3
    scale = 1 + jnp.max(jnp.where(jnp.isfinite(expected), jnp.abs(expected), 0), initial=0.0)
    bad = jnp.any(jnp.isfinite(expected) & jnp.isfinite(found) & (jnp.abs(expected - found) > tol * scale))
    if not isinstance(bad, jax.core.Tracer) and bool(bad):  # eagerly: the error itself
        _raise()
    # under a jit, NaN: a host callback to raise cost 0.15 of a gradient step even when not taken
    # (docs/guides/curvature.md, "What an example is")
    return [jnp.where(bad, jnp.nan, j) for j in per_example]


def _raise() -> None:
    raise ValueError(
        "The per-example gradients of what the losses read outside the networks (a head after the last "
        "layer) were formed from each example's rows alone, and they differ from the batch's for some "
        "example: the losses traced on one example do not compute what the batch's compute (a loss that uses "
        "the batch size or the example's position as a number). Under a jit the results are NaN; use "
        "jax.jacrev(losses) / jax.vmap(jax.grad) of a per-example loss.")


def _rows_of_examples(x: Any, batch: int) -> bool:
    """Whether a leaf of an argument not differentiated is read as the examples' rows: an array
    whose leading axis is the batch (a raw PRNG key, uint32 [2], has none)."""
    return hasattr(x, "shape") and np.ndim(x) >= 1 and np.shape(x)[0] == batch
