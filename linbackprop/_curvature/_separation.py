"""The checks that per-example quantities rest on: each layer keeps the examples apart (its output
for one example is what it gives for that example alone), each per-example loss reads its own
example, and a scalar loss is a sum of per-example (or per-position) terms. Each is proved from
the program at trace time for every value of the data (`_graph.example_flow`); nothing here is
decided by a random draw. (The layers are also run on one example against the batch on drawn
values: an extra alarm for the one-example program, never the proof.)
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .._graph import FREE, MIXED, describe, example_flow, random_values, row_codes
from .._plan import Plan

_checked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def check_per_example(plan: Plan, batch: int) -> None:
    """Raise where a kind of layer mixes examples: its output for one example is not the output
    for that example alone (batch statistics, attention across the batch). Checked once per plan
    and batch size on random data, at trace time."""
    done = _checked.setdefault(plan, set())
    if batch in done:
        return
    sample = random_values()

    with jax.ensure_compile_time_eval():
        for kind in plan.kinds:
            theta_avals = tuple(plan.param_groups[g].row_avals() for g in kind.param_groups)
            input_avals = tuple(plan.state_groups[g].row_avals() for g in kind.read_groups)
            theta = jax.tree.map(sample, theta_avals)
            leaves, tree = jax.tree.flatten(jax.tree.map(sample, input_avals))
            batched = [bool(np.ndim(x)) and np.shape(x)[0] == batch for x in leaves]
            outs = jax.tree.leaves(kind.out_aval)
            anywhere = any(batch in np.shape(x) for x in leaves) or any(batch in o.shape for o in outs)
            if not any(batched) and (not leaves or not anywhere):  # no state, or no batch on any axis: from parameters
                names = [layer.name for layer in kind.layers][:4]
                captured = getattr(kind.layers[0].fn, "__linbackprop_captured__", False)
                raise ValueError(
                    f"Layer(s) {names!r} read no per-example state (their operands "
                    f"{[tuple(np.shape(x)) for x in leaves]}, none with the batch of {batch} first) and return "
                    f"{[tuple(o.shape) for o in outs]}: they compute "
                    "from the parameters or constants alone"
                    + (" (a slice Ws[i] of a stacked block taken inside lax.fori_loop, a jitted loop or other glue "
                       "between the layers)" if captured else "")
                    + ". Per-example gradients, their norms and the GGN diagonal need every layer to read the "
                    "examples and the parameter blocks as they are: "
                    + ("loop over stacked blocks with lax.scan or a Python loop (their rows become Row blocks), "
                       if captured else "make the computation part of the layer that uses it, ")
                    + "or use jax.jacrev / jax.vmap(jax.grad) of a per-example loss.")
            if not any(batched) or not all(len(o.shape) and o.shape[0] == batch for o in outs):
                names = [layer.name for layer in kind.layers][:4]
                raise ValueError(
                    f"Layer(s) {names!r}: per-example gradients, their norms and the GGN diagonal need the batch "
                    f"({batch} examples) on the leading axis of every state; these layers read "
                    f"{[tuple(np.shape(x)) for x in leaves]} and return {[tuple(o.shape) for o in outs]}. Put the "
                    "batch first, or use jax.jacrev / jax.vmap(jax.grad) of a per-example loss.")
            _prove_kind_keeps_examples_apart(kind, theta_avals, input_avals, batched)
            # an extra alarm, never the proof: the layer run on one example (the program the
            # per-example products use) against the batch, on drawn values
            whole = kind.fn(theta, *tree.unflatten(leaves))

            def alone_fn(ls, kind=kind, theta=theta, tree=tree, batched=batched):
                one = tree.unflatten([x[None] if b else x for x, b in zip(ls, batched)])
                return jax.tree.map(lambda o: o[0], kind.fn(theta, *one))

            try:
                alone = jax.vmap(alone_fn, in_axes=([0 if b else None for b in batched],))(leaves)
            except Exception as error:  # any failure on one example: say which layer and why
                names = [layer.name for layer in kind.layers][:4]
                captured = getattr(kind.layers[0].fn, "__linbackprop_captured__", False)
                why = ("they were found by layers= and traced on one example too (fun with its batched data "
                       "sliced), and that program fails on this example's operands; use jax.vmap(jax.grad) of a "
                       "per-example loss" if captured else
                       "a layer function must run on a batch of one as on the whole batch")
                raise ValueError(f"Layer(s) {names!r}: per-example gradients, their norms, clipping, the GGN "
                                 f"diagonal and K-FAC evaluate each layer on one example (a batch of 1), and "
                                 f"these fail there ({type(error).__name__}: {str(error).splitlines()[0][:200]}): "
                                 f"{why}.") from error
            for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(alone)):
                a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
                if a64.shape != b64.shape or not np.allclose(a64, b64, rtol=1e-3, atol=1e-3 * (1 + np.abs(a64).max())):
                    names = [layer.name for layer in kind.layers][:4]
                    raise ValueError(
                        f"Layer(s) {names!r} mix examples: their output for one example is not what they give for "
                        "that example alone (batch statistics, attention or normalisation across the batch, or a "
                        "leading axis that is not the batch). Per-example gradients, their norms and the GGN "
                        "diagonal assume the leading axis of every state is the batch; compute those with "
                        "jax.jacrev or jax.vmap(jax.grad) of a per-example loss instead.")
    done.add(batch)


def _prove_kind_keeps_examples_apart(kind: Any, theta_avals: tuple, input_avals: tuple, batched: list[bool]) -> None:
    """Raise unless the layers' program keeps the examples apart for every value: row b of each
    output reads row b of the batched inputs (and the parameters) alone (`example_flow`)."""
    leaves = jax.tree.leaves(input_avals)
    labels = [None] * len(jax.tree.leaves(theta_avals)) + [
        row_codes(x.shape) if b else None for x, b in zip(leaves, batched)]
    flow = example_flow(lambda t, *u: kind.fn(t, *u), (theta_avals, *input_avals), labels)
    for code in flow.codes:
        rows = row_codes(code.shape) if code.ndim else np.zeros((), np.int32)
        if np.any((code != FREE) & (code != rows)):
            names = [layer.name for layer in kind.layers][:4]
            bad = np.flatnonzero(((code != FREE) & (code != rows)).reshape(-1))[0]
            row = np.unravel_index(bad, code.shape)[0] if code.ndim else 0
            raise ValueError(
                f"Layer(s) {names!r} mix examples: row {row} of their output reads "
                f"{describe(code.reshape(-1)[bad])}{flow.where()} (batch statistics, attention or normalisation "
                "across the batch, or a leading axis that is not the batch). Per-example gradients, their norms "
                "and the GGN diagonal assume the leading axis of every state is the batch; compute those with "
                "jax.jacrev or jax.vmap(jax.grad) of a per-example loss instead.")


def check_losses_keep_examples_apart(losses: Callable, outs: tuple, axes: list[list[int]], diff: tuple,
                                     firsts: list[int]) -> None:
    """Raise where loss b reads another example's outputs (a batch mean of the outputs, a
    contrast between examples, a partner index): the per-example transforms take Λ's row b as
    example b's adjoint, which holds only where loss b sees row b alone.

    Proved from the losses' program (`example_flow`) for every value of the data: call c's
    output leaves carry their examples along their batch axes (``axes[c]``), numbered from
    ``firsts[c]`` (in call order); every loss i must read example i or none."""
    labels = [row_codes(np.shape(x), ax, first)
              for call, call_axes, first in zip(outs, axes, firsts)
              for x, ax in zip(jax.tree.leaves(call), call_axes)]
    labels += [None] * len(jax.tree.leaves(diff))
    flow = example_flow(losses, (outs, *diff), labels)
    codes = flow.codes[0].reshape(-1)
    wrong = [(i, int(c)) for i, c in enumerate(codes) if c != FREE and c != i]
    if wrong:
        i, c = wrong[0]
        raise ValueError(
            f"Per-example gradients, their norms and clipping need loss b to read example b's outputs alone; "
            f"these losses mix examples: loss {i} reads {describe(c)}"
            + (f" ({len(wrong)} losses read other examples)" if len(wrong) > 1 else "") + flow.where()
            + ". This holds for every value of the data (a partner index, a batch mean or normalisation of the "
            "outputs, a contrast between examples). Write each loss from its own example's outputs, or use "
            "jax.jacrev(losses) / jax.vmap(jax.grad) of a per-example loss.")


def check_hessian_keeps_positions_apart(loss: Callable | Any, leaves: list, n: int, axis: int) -> str | None:
    """Whether H = ∂²loss/∂(outputs)² couples positions of output leaf ``n`` (its batch on
    ``axis``, the positions on the axis after it): None where it does not, else what couples them.

    Proved from the loss's program (`example_flow`; ``loss`` may be that program, traced at
    ``leaves``): each (example, position) of that leaf is
    its own id, and the loss must be a sum of terms that each read one of them (`SUMMED`) —
    then H's block per example is block diagonal over positions, for every value."""
    labels = [row_codes(np.shape(x), axis, positions=True) if m == n else None for m, x in enumerate(leaves)]
    flow = example_flow(loss, leaves, labels)
    code = int(np.asarray(flow.codes[0]).reshape(-1)[0]) if flow.codes[0].size == 1 else MIXED
    if code != MIXED:
        return None
    return "the loss is not a sum of terms that each read one position" + flow.where(summed=False)


def check_hessian_keeps_examples_apart(loss: Callable | Any, leaves: list, axes: list[int], groups: list[int],
                                       name: str) -> None:
    """Raise where H = ∂²loss/∂(outputs)² couples examples (a function of the batch's sum, the
    outputs normalised over the batch, a contrastive loss, a partner index): the transforms
    built on H's blocks per example (``diag_ggn``, ``ggn_factor``, ``kfac_factors``) would be
    silently wrong.

    Proved from the loss's program (`example_flow`; ``loss`` may be that program, traced at
    ``leaves``) for every value of the data: output leaf
    n carries its examples along ``axes[n]``, each group's (``groups[n]``) numbered after the
    previous groups'; the loss must be a sum of terms that each read one example."""
    sizes: dict[int, int] = {}
    for x, ax, g in zip(leaves, axes, groups):
        sizes.setdefault(g, int(np.shape(x)[ax]) if np.ndim(x) > ax else 1)
    firsts = dict(zip(sorted(sizes), np.cumsum([0, *(sizes[g] for g in sorted(sizes))])[:-1].tolist()))
    labels = [row_codes(np.shape(x), ax, firsts[g]) if np.ndim(x) > ax else None
              for x, ax, g in zip(leaves, axes, groups)]
    flow = example_flow(loss, leaves, labels)
    if np.any(flow.codes[0] == MIXED):
        raise ValueError(
            f"{name} takes the loss's Hessian H in the outputs block diagonal over the examples, and this loss "
            f"couples them: it is not a sum of terms that each read one example{flow.where(summed=False)} (a "
            f"function of the batch's sum or mean of the outputs, outputs normalised over the batch, a "
            f"contrastive loss or a partner index — for any value of the data). Write the loss as a sum (or "
            f"mean) of per-example terms, or use lbp.gauss_newton's products (G.mv, G.todense()), exact for any H.")
