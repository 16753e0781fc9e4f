"""The checks that per-example quantities rest on: each layer keeps the examples apart (its output
for one example is what it gives for that example alone), and so does each per-example loss.
Both run once per trace, at trace time, on values drawn at random for what they read.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from .._graph import at_random, on_host, random_values, sharded_as
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
            if not any(batched) and leaves and not anywhere:  # no batch on any axis: computed from parameters
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


def check_losses_keep_examples_apart(losses: Callable, outs: tuple, axes: list[list[int]], diff: tuple,
                                     firsts: list[int]) -> None:
    """Raise where loss b reads another example's outputs (a batch mean of the outputs, a
    contrast between examples): the per-example transforms take Λ's row b as example b's
    adjoint, which holds only where loss b sees row b alone.

    Checked on values drawn at random for the outputs, the arguments and everything the losses
    close over (labels under ``jax.jit`` are tracers: only their shapes are known here): call c's
    first example perturbed along each output leaf's batch axis (``axes[c]``), no loss but that
    example's (``firsts[c]``, in call order) may change."""
    evaluate, args, _ = at_random(losses, outs, *diff)
    with jax.ensure_compile_time_eval():
        run = lambda a: on_host(evaluate.run(lambda ev, a: ev(*a)[0], a)).astype(np.float64)
        base = run(args)
        start = 0
        for call, (leaf_axes, first) in enumerate(zip(axes, firsts)):
            moved = list(args)
            for n, axis in zip(range(start, start + len(leaf_axes)), leaf_axes):
                x = args[n]
                if x.ndim > axis and np.issubdtype(x.dtype, np.inexact):  # example 0 moved
                    moved[n] = _first_moved(x, axis)
            start += len(leaf_axes)
            changed = np.abs(run(moved) - base) > 1e-6 * (1 + np.abs(base))
            changed[first] = False
            if np.any(changed & np.isfinite(base)):
                raise ValueError(
                    f"Per-example gradients, their norms and clipping need loss b to read example b's "
                    f"outputs alone; these losses mix examples: changing example {first}'s outputs "
                    f"of call {call} changes loss(es) {np.flatnonzero(changed)[:5].tolist()} too (a batch mean or "
                    f"normalisation of the outputs, a contrast between examples, or a loss that is not one per "
                    f"example). Write each loss from its own "
                    f"example's outputs, or use jax.jacrev(losses) / jax.vmap(jax.grad) of a per-example loss.")


def check_hessian_keeps_positions_apart(loss: Callable, leaves: list, n: int, axis: int) -> str | None:
    """Whether H = ∂²loss/∂(outputs)² couples positions of output leaf ``n`` (its batch on
    ``axis``, the positions on the axis after it): None where it does not, else what was seen.

    Checked on values drawn at random for the outputs and whatever the loss closes over: H r for
    a random r on that leaf against the product with H's blocks per (example, position), found
    from D products of the basis vectors e_j set at every position at once (what the blocks per
    position are made of). They agree only where the loss is a sum of per-position terms."""
    evaluate, point, _ = at_random(loss, *leaves)
    with jax.ensure_compile_time_eval():
        moved = jnp.moveaxis(point[n], axis, 0)
        coords = int(np.prod(moved.shape[2:], dtype=np.int64))
        seq = moved.reshape(*moved.shape[:2], coords)
        back = lambda m: jnp.moveaxis(m.reshape(moved.shape), 0, axis)
        flat = lambda m: jnp.moveaxis(m, axis, 0).reshape(seq.shape)
        r = sharded_as(jnp.asarray(np.random.default_rng(1).standard_normal(seq.shape), seq.dtype), seq)

        def products(ev: Callable, point: list, r: jax.Array) -> tuple[jax.Array, jax.Array]:
            grad = jax.grad(lambda xs: ev(*xs)[0])

            def hvp(t: jax.Array) -> jax.Array:  # H's product with t on leaf n (zeros elsewhere), leaf n's part
                tangents = [t if m == n else jnp.zeros_like(x) for m, x in enumerate(point)]
                return jax.jvp(grad, (point,), (tangents,))[1][n]

            basis = jnp.broadcast_to(jnp.eye(coords, dtype=seq.dtype)[:, None, None, :], (coords, *seq.shape))
            blocks = jax.vmap(lambda e: flat(hvp(back(e))))(basis)  # [j, B, P, i]
            return jnp.einsum("jbpi,bpj->bpi", blocks, r), flat(hvp(back(r)))

        expected, found = (on_host(x).astype(np.float64) for x in evaluate.run(products, point, r))
    scale = 1 + np.abs(expected).max()
    tolerance = 1e-4 if np.finfo(seq.dtype).eps > 1e-10 else 1e-9
    if np.allclose(found, expected, rtol=tolerance, atol=tolerance * scale):
        return None
    off = np.abs(found - expected).max(axis=2)
    b, p = np.unravel_index(np.argmax(off), off.shape)
    return f"at example {b}, position {p} H r differs from the per-position blocks' product by {off[b, p]:.2g}"


def check_hessian_keeps_examples_apart(loss: Callable, leaves: list, axes: list[int], groups: list[int],
                                       name: str) -> None:
    """Raise where H = ∂²loss/∂(outputs)² couples examples (a function of the batch's sum, the
    outputs normalised over the batch, a contrastive loss): the transforms built on H's blocks
    per example (``diag_ggn``, ``ggn_factor``, ``kfac_factors``) would be silently wrong.

    Checked on values drawn at random for the outputs and whatever the loss closes over: the
    first example of each group of calls moved (output leaf n's batch on ``axes[n]``, its group
    ``groups[n]``), no other example's part of ∂loss/∂(outputs) may change — it does not where
    the loss is a sum of per-example terms, whatever those are."""
    evaluate, point, _ = at_random(loss, *leaves)
    with jax.ensure_compile_time_eval():
        grad = lambda xs: evaluate.run(lambda ev, xs: jax.grad(lambda xs: ev(*xs)[0])(xs), xs)
        base = [on_host(x).astype(np.float64) for x in grad(point)]
        for group in sorted(set(groups)):
            moved = [_first_moved(x, ax)
                     if groups[n] == group and np.issubdtype(x.dtype, np.inexact) and x.ndim > ax else x
                     for n, (x, ax) in enumerate(zip(point, axes))]
            for n, (after, before) in enumerate(zip(grad(moved), base)):
                after = on_host(after).astype(np.float64)
                tolerance = 1e-4 if np.finfo(point[n].dtype).eps > 1e-10 else 1e-9
                changed = np.abs(after - before) > tolerance * (1 + np.abs(before).max(initial=0.0))
                if groups[n] == group and changed.ndim > axes[n]:
                    changed[(slice(None),) * axes[n] + (0,)] = False  # example 0's own part may change
                if np.any(changed):
                    raise ValueError(
                        f"{name} takes the loss's Hessian H in the outputs block diagonal over the examples, and "
                        f"this loss couples them: moving example 0's outputs changes ∂loss/∂(outputs) of other "
                        f"examples (a function of the batch's sum or mean of the outputs, outputs normalised over "
                        f"the batch, a contrastive loss). Write the loss as a sum (or mean) of per-example terms, "
                        f"or use lbp.gauss_newton's products (G.mv, G.todense()), exact for any H.")


def _first_moved(x: jax.Array, axis: int) -> jax.Array:
    """``x`` with 1 added to its first example (index 0 on ``axis``), as a broadcast sum: a scatter
    into a batch sharded over a mesh with Explicit axes needs its output's sharding named."""
    first = (jnp.arange(x.shape[axis]) == 0).astype(x.dtype).reshape((-1,) + (1,) * (x.ndim - axis - 1))
    return x + first
