"""What an example is, in one room: the set-up every per-example transform starts from.

Per-example losses (`per_example_setup`: per-example gradients, their norms, the clipped sum):
the calls' forward pass, the losses as a function of the outputs, the batch — one shared by every
call, or each call's own examples in call order — and Λ of every example from one back
substitution per call. A scalar loss (`hessian_blocks`: the GGN diagonal, its factor, K-FAC's
factors): the same calls, their examples in the same two ways, and each example's block of
H = ∂²ℓ/∂(outputs)², factored (exactly, or as square roots for sampling), and the sum over H's
columns those transforms share.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._engine import weighted_square_sum
from .._graph import Stack, in_turn, sharded_as
from ._calls import Calls
from ._sampling import block_sampler
from ._separation import (
    check_hessian_keeps_examples_apart,
    check_hessian_keeps_positions_apart,
    check_losses_keep_examples_apart,
)
from ._split import Split


def per_example_setup(fun: Callable, args: tuple, nums: tuple[int, ...], engine: str) -> tuple:
    """For per-example losses ``fun``: the split, the calls' forward pass, the losses as a function
    of (outputs, *arguments), the batch size and the calls' adjoints Λ (one back substitution each)."""
    split = Split(fun, args, nums, False)
    calls = Calls(split, engine)
    losses = lambda outs, *d: per_example_losses(split, outs, d)
    batch = jnp.shape(losses(calls.outs, *split.diff))[0]
    g_outs = jax.grad(lambda o: jnp.sum(losses(o, *split.diff)))(calls.outs)
    sizes = calls.batches()
    # one batch, row b of every call example b — unless the losses count each call's examples
    # (two calls of 4 giving 8 losses: each call's own examples, as with batches of 4 and 3)
    if len(set(sizes)) <= 1 and not (len(sizes) > 1 and batch == sum(sizes)):
        lams = calls.adjoints(g_outs, batch)  # checks the layers first
        check_losses_keep_examples_apart(losses, calls.outs, calls.batch_axes(), split.diff, [0] * len(sizes))
        return split, calls, losses, batch, lams
    if sum(sizes) != batch:
        raise ValueError(f"Per-example quantities of network calls with different batches take each call's "
                         f"examples as examples, in call order: fun must return {sum(sizes)} losses "
                         f"(jnp.concatenate of each call's), it returned {batch}; the calls: "
                         f"{'; '.join(calls.call_names())}.")
    starts = np.cumsum([0, *sizes])[:-1]
    calls.spans = [(c, int(start), size) for c, (start, size) in enumerate(zip(starts, sizes))]
    lams = calls.adjoints(g_outs, sizes)  # checks the layers first
    check_losses_keep_examples_apart(losses, calls.outs, calls.batch_axes(), split.diff,
                                     [int(start) for start in starts])
    return split, calls, losses, batch, lams


def per_example_losses(split: Split, outs: tuple, diff: tuple) -> jax.Array:
    losses = split.loss(outs, *diff)[0]
    if jnp.ndim(losses) != 1:
        raise ValueError(f"Per-example gradients need fun to return one loss per example, shape (B,); it returned "
                         f"shape {jnp.shape(losses)}.")
    return losses


class Examples(NamedTuple):
    """The examples of ``fun``'s network calls and each one's block of H, factored. Calls whose
    outputs all have the same batch size share their examples (row b of every call is example
    b: one group); calls of different batch sizes (a PINN's interior and boundary points) each
    have their own examples, the groups' in call order. Per group: its calls (positions among
    all calls), B_g, and each example's C_g × C_g block of H [B_g, C_g, C_g]; ``unflatten``
    maps one [B_g, C_g] matrix per group to cotangents of all the calls' outputs; ``gradients``
    the loss's gradient in the outputs, ∂ℓ/∂(outputs), per group [B_g, C_g] (what a least-squares
    loss's residuals are made from)."""

    groups: list[list[int]]
    batches: list[int]
    blocks: list[jax.Array]
    unflatten: Callable
    gradients: list[jax.Array]
    hvp: Callable | None = None

    def eigen(self) -> tuple[list[jax.Array], list[jax.Array]]:
        """Per group, H_b = Σ_k λ_bk s_bk s_bkᵀ: eigenvalues [B_g, C_g] and eigenvectors
        [B_g, C_g, C_g] (``eigh``: exact for indefinite H); for blocks per position
        ([B_g, P, D, D], see `hessian_blocks`) each position's: [B_g, P, D] and [B_g, P, D, D]."""
        pairs = in_turn(jnp.linalg.eigh, self.blocks)  # LAPACK's calls in turn (`_graph._in_turn`)
        return [lam for lam, _ in pairs], [vecs for _, vecs in pairs]

    def draws(self) -> Callable[[jax.Array], list[jax.Array]]:
        """``draw(key)``: per group one sample s_b of every example with E[s_b s_bᵀ] = H_b,
        [B_g, C_g] (`block_sampler`; blocks per position: each position's, drawn independently,
        flattened)."""
        groups = in_turn(block_sampler, self.blocks, waits_on=lambda draw: draw.roots)  # Cholesky's calls in turn
        return lambda key: [draw(k) for draw, k in zip(groups, jax.random.split(key, len(groups)))]

    def of_call(self, call: int) -> int:
        """The group of a call (its position among all calls)."""
        return next(g for g, members in enumerate(self.groups) if call in members)

    def by_call(self, per_group: list) -> list:
        """A per-group list as one entry per call (position among all calls)."""
        return [per_group[self.of_call(c)] for c in range(sum(len(g) for g in self.groups))]


def hessian_blocks(split: Split, engine: str, name: str, per_position: bool = True) -> tuple[Calls, Examples]:
    """The forward pass of the split function's network calls with residuals (`Calls`) and their examples
    with H's blocks factored (`Examples`). H is taken block diagonal over the examples: ``fun``
    is a sum (or mean) of terms that each read one example of one call — what the transforms
    built on this assume.

    With ``per_position`` (the transforms that sum over H's columns, `over_columns`), each
    example's block is taken one block per position, [B, P, D, D], where the loss reads one
    output of the group, [B, P, ...] with the batch first, and H does not couple positions (a sum
    or mean of per-position losses, proved from the program: `_positions`) — a sequence model's
    example is a whole sequence, positions × vocabulary, whose whole blocks took GiBs. Blocks
    over `MAX_HESSIAN_BLOCK_BYTES` are refused, naming their size."""
    calls = Calls(split, engine)
    loss = lambda o: split.loss(o, *split.diff)[0]
    if jnp.ndim(loss(calls.outs)) != 0:
        raise ValueError(f"{name} needs fun to return a scalar loss (a sum or mean over examples).")
    sizes = calls.batches()
    if not sizes:
        raise ValueError(f"{name}: fun calls no network, so there are no outputs to take the loss's Hessian H of. "
                         f"A model as written needs layers= naming its layers (for example {name}(loss, "
                         "layers=nnx.Linear), or the functions marked @lbp.layer); or call an lbp.Network.")
    if 0 in sizes:
        raise ValueError(f"{name} needs every network call to have an output with the batch on its leading axis.")
    groups = [list(range(len(sizes)))] if len(set(sizes)) == 1 else [[c] for c in range(len(sizes))]
    batches = [sizes[g[0]] for g in groups]
    leaves, treedef = jax.tree.flatten(calls.outs)
    program = jax.make_jaxpr(lambda *xs: loss(treedef.unflatten(list(xs))))(*leaves)  # read, proved: one trace
    read = _read_by(program)
    leaf_axes, leaf_groups = [0] * len(leaves), [0] * len(leaves)
    for g, (group, batch) in enumerate(zip(groups, batches)):
        for n, ax in zip(_leaf_indices(calls.outs, group), _batch_axes(calls, batch, name, group)):
            leaf_axes[n], leaf_groups[n] = ax, g
    check_hessian_keeps_examples_apart(program, leaves, leaf_axes, leaf_groups, name)
    flats = [_by_example(calls, b, name, only=g, read=read) for g, b in zip(groups, batches)]
    owner = [c for c, out in enumerate(calls.outs) for _ in jax.tree.leaves(out)]  # each leaf's call

    def unflatten(per_group: list) -> Any:
        out = [jnp.zeros(np.shape(x), jnp.result_type(x)) for x in leaves]
        for (_, back), group, flat in zip(flats, groups, per_group):
            part = jax.tree.leaves(back(flat))
            at = iter(part)
            for n, c in enumerate(owner):
                if c in group:
                    out[n] = next(at)
        return treedef.unflatten([sharded_as(o, x) for o, x in zip(out, leaves)])

    g_outs, hvp = jax.linearize(jax.grad(loss), calls.outs)
    gradients = [_by_example(calls, batch, name, g_outs, only=group, read=read)[0]
                 for group, batch in zip(groups, batches)]
    blocks = []
    for g, (group, batch, (flat, _)) in enumerate(zip(groups, batches, flats)):
        coords = flat.shape[1]
        zeros = [jnp.zeros((b, f.shape[1]), f.dtype) for b, (f, _) in zip(batches, flats)]

        def column(e, g=g, group=group, batch=batch, zeros=zeros):
            return _by_example(calls, batch, name, hvp(unflatten([e if i == g else z for i, z in enumerate(zeros)])),
                               only=group, read=read)[0]

        layout = _positions(calls, batch, group, read, leaves, program, name) if per_position else (
            f"{name} needs each example's whole block")
        if isinstance(layout, tuple):  # one block per position: D columns, e_j at every position at once
            positions, coords = layout
            _check_block_size(name, batch, coords, flat.dtype, positions)
            basis = jnp.broadcast_to(jnp.eye(coords, dtype=flat.dtype)[:, None, None, :],
                                     (coords, batch, positions, coords)).reshape(coords, batch, -1)
            h = jnp.moveaxis(jax.vmap(column)(basis).reshape(coords, batch, positions, coords), 0, -1)
        else:
            _check_block_size(name, batch, coords, flat.dtype, why=layout)
            basis = jnp.broadcast_to(jnp.eye(coords, dtype=flat.dtype)[:, None, :], (coords, batch, coords))
            h = jnp.moveaxis(jax.vmap(column)(basis), 0, 2)  # [C(j), B, C(i)] → [B, i, j]
        blocks.append((h + jnp.swapaxes(h, -1, -2)) / 2)
    return calls, Examples(groups, batches, blocks, unflatten, gradients, hvp)


# H's blocks are dense per example, [B, C, C] with C every output coordinate of one example: a
# sequence model's example is a whole sequence (C = positions × vocabulary: the transformer LM
# example's 64 × 98 gave 32 blocks of 6,272², 4.7 GiB, and the process was killed). Above this the
# blocks are taken per position where H allows it (79 MB there), else the transforms refuse.
MAX_HESSIAN_BLOCK_BYTES = 2**30


def _block_bytes(batch: int, coords: int, positions: int, dtype: Any) -> int:
    return batch * positions * coords * coords * np.dtype(dtype).itemsize


def _check_block_size(name: str, batch: int, coords: int, dtype: Any, positions: int = 1, why: str = "") -> None:
    size = _block_bytes(batch, coords, positions, dtype)
    if size > MAX_HESSIAN_BLOCK_BYTES:
        what = f"{positions} blocks of {coords} × {coords} per example (one per position)" if positions > 1 else (
            f"one dense {coords} × {coords} block per example")
        raise ValueError(
            f"{name}: the loss's Hessian H is taken as {what} ({batch} examples: {size / 2**30:.1f} GiB, over the "
            f"{MAX_HESSIAN_BLOCK_BYTES / 2**30:g} GiB this transform builds)" + (f", and {why}" if why else "")
            + "; use lbp.gauss_newton's products (G.mv, G.gram), fewer output coordinates per example or position, "
            "or a smaller batch per call.")


def _positions(calls: Calls, batch: int, group: list[int], read: list[bool], leaves: list, program: Any,
               name: str) -> tuple[int, int] | str:
    """(P, D) of blocks per position for a group, where they apply: the loss reads one output of
    the group, [B, P, ...] with the batch first and P > 1, and H does not couple its positions
    (a sum or mean of per-position terms); else why not. Each example's P blocks of D × D then
    hold all of its whole C × C block but zeros (C = P · D), from D products with H instead of C:
    a sequence model's example (positions × vocabulary) or a loss elementwise in the outputs.
    ``program``: the loss's jaxpr at the output leaves ``leaves``."""
    kept = [(n, ax) for n, ax in zip(_leaf_indices(calls.outs, group), _batch_axes(calls, batch, name, group))
            if read[n]]
    if len(kept) != 1:
        return ("blocks per position need the loss to read one output of these calls, with the positions on the "
                f"axis after the batch (it reads {len(kept)})")
    n, axis = kept[0]
    shape = np.shape(jnp.moveaxis(leaves[n], axis, 0))
    if len(shape) < 2 or shape[1] < 2:
        return f"the output it reads, {shape} with the batch first, has no positions"
    coupled = check_hessian_keeps_positions_apart(program, leaves, n, axis)
    if coupled is not None:
        return f"H couples positions of the output {shape} ({coupled}), so blocks per position do not apply"
    return shape[1], int(np.prod(shape[2:], dtype=np.int64))


def over_columns(share: Callable, examples: Examples, samples: int | None, key: Any, name: str) -> Any:
    """Σ_k share(s_k, w_k) over H's factor, s_k and w_k one [B_g, C_g] matrix and one [B_g]
    vector per group of examples: the eigenvectors s_k with weights λ_k (exact; a group with
    fewer coordinates than k gives zeros), or with ``samples=M`` the mean over M samples
    s_b with E[s_b s_bᵀ] = H_b (`Examples.draws`: a rank-one term of a diagonally dominant
    H_b, else R_b z with R_b its Cholesky root; up to round-off where H_b is positive semi-definite, unbiased there),
    weights 1. One column (or sample) after another: a vmapped solve over the C columns has
    buffers C times as large, which outgrow the caches (slower: docs/performance.md).
    `all_columns` gives the same columns at once."""
    column, ks, scale = _columns(examples, samples, key, name)

    def one(k: jax.Array) -> Any:
        return share(*column(k))

    if ks.shape[0] == 1:  # one column (the usual K-FAC sample): no loop (XLA:CPU's convolutions are
        summed = one(ks[0])  # several times slower inside a loop's body than outside it)
    else:
        init = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(one, ks[0]))
        summed = jax.lax.scan(lambda acc, k: (jax.tree.map(jnp.add, acc, one(k)), None), init, ks)[0]
    return summed if scale is None else jax.tree.map(lambda d: d / scale, summed)


def all_columns(examples: Examples, samples: int | None, key: Any, name: str) -> tuple[list, list, float | None]:
    """The columns `over_columns` takes one after another, all at once: per group s [K, B_g, C_g]
    and w [K, B_g] (K = C exact columns, or M samples: the same draws for the same key), and
    what their sum is divided by (M for samples, None for exact columns)."""
    column, ks, scale = _columns(examples, samples, key, name)
    s, w = jax.vmap(column)(ks)
    return s, w, scale


def _columns(examples: Examples, samples: int | None, key: Any, name: str) -> tuple[Callable, jax.Array, Any]:
    """``(column, ks, scale)``: ``column(k)`` is (s, w) of column k, ``ks`` the columns'
    indices (or sample keys), ``scale`` what their sum is divided by (None: 1)."""
    coords = max(int(np.prod(h.shape[1:-1])) for h in examples.blocks)  # C, or P · D per position
    if samples is None and key is not None:
        raise ValueError(f"{name}(key=...) without samples=: with no samples= every exact column of H is taken (one "
                         f"back substitution per output coordinate) and the key draws nothing. Pass samples=1 for "
                         f"one sampled column per example, or drop key= for the exact columns.")
    if samples is None:
        lam, vecs = examples.eigen()

        def column(k: jax.Array) -> tuple[list, list]:
            s, w = [], []
            for x, v in zip(lam, vecs):
                count = int(np.prod(x.shape[1:]))
                at = jnp.minimum(k, count - 1)
                if x.ndim == 2:
                    s.append(jnp.where(k < count, v[:, :, at], 0))
                    w.append(jnp.where(k < count, x[:, at], 0))
                else:  # blocks per position: column (p, j) is position p's j-th eigenvector, zeros elsewhere
                    p, j = at // x.shape[2], at % x.shape[2]
                    here = (jnp.arange(x.shape[1]) == p)[None, :, None]
                    s.append(jnp.where((k < count) & here, v[:, p, :, j][:, None, :], 0).reshape(x.shape[0], -1))
                    w.append(jnp.where(k < count, x[:, p, j], 0))
            return s, w

        return column, jnp.arange(coords), None
    if key is None:
        raise ValueError(f"{name}(samples=M) needs a PRNG key: {name}(fun, samples=M, key=jax.random.key(0)).")
    if not isinstance(samples, int) or samples < 1:
        raise ValueError(f"{name}(samples={samples!r}): a positive int (sampled columns per example), or None.")
    draw = examples.draws()
    ones = [jnp.ones((b,), h.dtype) for b, h in zip(examples.batches, examples.blocks)]
    return (lambda k: (draw(k), ones)), jax.random.split(key, samples), samples


def _read_by(program: Any) -> list[bool]:
    """Per output leaf, whether the loss (``program``: its jaxpr at the output leaves) reads it
    (an equation of its jaxpr, or its result): a
    leaf it never reads has zero rows and columns in H, and each of its coordinates would cost
    a back substitution for nothing (a physics-informed loss reads the lifted network's Δu, not
    its u and ∇u: one column per point instead of d + 2)."""
    jaxpr = program.jaxpr
    read = {id(v) for eqn in jaxpr.eqns for v in eqn.invars} | {id(v) for v in jaxpr.outvars}
    return [id(v) in read for v in jaxpr.invars]


def _by_example(calls: Calls, batch: int, name: str, outs: Any = None, only: list[int] | None = None,
                read: list[bool] | None = None) -> tuple[jax.Array, Callable]:
    """The outputs of the calls ``only`` names (all by default) as [B, C] (each leaf's batch axis
    first: axis 0 of a state, axis 1 of a Stack), and the map back from such a matrix to those
    calls' output leaves (a flat list, in order). With ``read`` (per leaf of all the calls'
    outputs), the leaves the loss does not read are left out of the matrix and come back as
    zeros (unless it reads none of these calls' leaves: then all are kept)."""
    outs = calls.outs if outs is None else outs
    members = range(len(calls.nets)) if only is None else only
    leaves = [x for c in members for x in jax.tree.leaves(outs[c])]
    kept = [True] * len(leaves) if read is None else [read[n] for n in _leaf_indices(outs, members)]
    if not any(kept):
        kept = [True] * len(leaves)
    axes = _batch_axes(calls, batch, name, members)
    moved = [jnp.moveaxis(x, ax, 0).reshape(batch, -1) for x, ax, k in zip(leaves, axes, kept) if k]
    sizes = np.cumsum([m.shape[1] for m in moved])[:-1]
    shapes = [jnp.moveaxis(x, ax, 0).shape for x, ax in zip(leaves, axes)]

    def unflatten(flat):
        parts = iter(jnp.split(flat, sizes, axis=1))
        return [jnp.moveaxis(next(parts).reshape(s), 0, ax) if k else jnp.zeros(np.shape(x), jnp.result_type(x))
                for x, s, ax, k in zip(leaves, shapes, axes, kept)]

    return jnp.concatenate(moved, axis=1), unflatten


def _leaf_indices(outs: tuple, members: Any) -> list[int]:
    """The positions, among the leaves of all the calls' outputs, of the calls ``members``' leaves."""
    starts = np.cumsum([0, *(len(jax.tree.leaves(out)) for out in outs)])
    return [n for c in members for n in range(starts[c], starts[c + 1])]


def _batch_axes(calls: Calls, batch: int, name: str, members: Any = None) -> list[int]:
    axes = []
    for c, (net, outs) in enumerate(zip(calls.nets, calls.outs)):
        if members is not None and c not in members:
            continue
        items = (outs,) if net.single_output else outs
        for item, value in zip(net.output_spec, items):
            ax = 1 if isinstance(item, Stack) else 0
            for leaf in jax.tree.leaves(value):
                if np.ndim(leaf) <= ax or np.shape(leaf)[ax] != batch:
                    raise ValueError(f"{name}: an output of {net!r} has shape {np.shape(leaf)}, without the "
                                     f"batch ({batch}) on axis {ax}; every state's leading axis must be the batch.")
                axes.append(ax)
    return axes


def ggn_squares(calls: Calls, examples: Examples) -> tuple[Callable, Callable]:
    """The GGN diagonal's share of one column of H's factor and its total:
    ``share(s, weights[, lams])`` (per group; ``lams`` the calls' adjoints of s, computed where
    not given) and ``total``. As matrix products where each argument leaf is a parameter block
    of the calls as it is and the calls that share one have different examples (`ParamSquares`:
    the calls' squares add up); else from the per-example gradients, squared, group by group."""
    batches = examples.by_call(examples.batches)
    groups_of: dict[int, list[int]] = {}
    for call, place in zip(calls.solved, calls.placement):
        for at in place:
            groups_of.setdefault(at, []).append(examples.of_call(call))
    separable = (all(None not in place for place in calls.placement)
                 and all(len(set(gs)) == len(gs) for gs in groups_of.values()))
    adjoints = lambda s, lams: calls.adjoints(examples.unflatten(s), batches) if lams is None else lams
    if separable:
        parts, total = calls.squares(batches)
        return (lambda s, weights, lams=None: parts(adjoints(s, lams), examples.by_call(weights))), total

    def share(s: list, weights: list, lams: list | None = None) -> Any:
        lams = adjoints(s, lams)
        out = None
        for group, batch, w in zip(examples.groups, examples.batches, weights):
            part = jax.tree.map(lambda g, w=w: weighted_square_sum(g, w), calls.per_example(lams, batch, only=group))
            out = part if out is None else jax.tree.map(jnp.add, out, part)
        return out

    return share, lambda acc: acc
