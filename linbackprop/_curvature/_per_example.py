"""Per-example gradients and their norms: one forward pass and one back substitution serve every
example (the leading axis of every state is the batch; the set-up: `_examples`), then ℳ is
applied to each example's rows alone (`_calls`), or only its norms are formed (ghost norms where
the shapes allow: `_ghost`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal

from .._engine import depending
from .._options import Engine
from ._calls import Calls
from ._examples import per_example_setup
from ._ghost import ParamNorms, ghost_squares
from ._one_example import check_one_example, one_example_losses
from ._split import Split, add_trees, normalise_argnums, on_model


def per_example_grads(fun: Callable, argnums: int | Sequence[int] = 0, *, engine: Engine = "auto",
                      layers: Any = None) -> Callable:
    r"""The gradient of each example's loss, stacked on a leading axis — ``jax.jacrev(fun)``.

    ``fun`` returns per-example losses, shape (B,), and the leading axis of every network state
    (and of every row read of a stacked input) is the batch. One forward pass and ONE back
    substitution $ℒ^*Λ = \nabla_U \sum_b \ell_b$ serve every example (row b of Λ is example b's adjoint,
    since $\ell_b$ sees only row b of the outputs); then ℳ is applied to each example's rows alone,
    $(\partial\Phi_i/\partial\theta)^* \Lambda_i[b]$ — the layer's VJP on one example — and shared and ``Row``
    blocks sum the
    contributions of every layer that uses them. Terms of ``fun`` that use the arguments
    directly are added per example (``jax.jacrev`` of them). Network calls with different
    batches (a PINN's interior and boundary points) each bring their own examples: ``fun``
    returns the losses of all of them, each call's in call order (``jnp.concatenate``), and
    each loss reads one example of one call. Layers that mix examples (batch
    statistics, attention across the batch) raise a ``ValueError``; networks whose inputs depend
    on the differentiated arguments raise ``NotImplementedError``.

    Args:
        fun: the per-example losses, shape (B,), of the arguments.
        argnums: the argument(s) to differentiate.
        engine: ``"loop"``, ``"unrolled"`` or ``"auto"``.
        layers: the classes or ``@lbp.layer`` functions whose calls are the layers of a model
            written as it is; the gradients come back in the argument's own type.

    Returns:
        A function of ``fun``'s arguments returning, per differentiated argument, its per-example
            gradients: each leaf with a leading axis of B.

    Raises:
        ValueError: layers that mix examples, a state without the batch on its leading axis,
            or ``fun`` returning a number of losses other than the calls' examples.
        NotImplementedError: a network input that depends on the differentiated arguments.

    Examples:
        >>> import jax.numpy as jnp, linbackprop as lbp
        >>> layer = lbp.Layer("y", lambda th, x: x @ th[0], ("x",), ("w",))
        >>> net = lbp.Network([layer], ["x"], "y")
        >>> losses = lambda p, x: net(p, x)[:, 0] ** 2 / 2
        >>> x = jnp.array([[1.0, 0.0], [0.0, 2.0]])
        >>> g = lbp.per_example_grads(losses)({"w": jnp.ones((2, 1))}, x)
        >>> g["w"].squeeze(-1).tolist()    # example b: (x_b·w) x_b
        [[1.0, 0.0], [0.0, 4.0]]
    """
    if layers is not None:
        return on_model(lambda f, a: per_example_grads(f, a, engine=engine), fun, argnums, layers,
                        name="per_example_grads")
    nums, single = normalise_argnums(argnums)

    def run(*args: Any) -> Any:
        split, calls, losses, batch, lams = per_example_setup(fun, args, nums, engine)
        if calls.spans is None:
            through_networks = calls.per_example(lams, batch)
        else:  # each call's examples in turn
            through_networks = jax.tree.map(lambda *parts: jnp.concatenate(parts), *[
                calls.per_example(lams, size, only=[call]) for call, _, size in calls.spans])
        direct = jax.jacrev(lambda *d: losses(calls.outs, *d), argnums=tuple(range(len(nums))))(*split.diff)
        grads = tuple(add_trees(a, b) for a, b in zip(direct, through_networks))
        return grads[0] if single else grads

    return run


def per_example_grad_norms(fun: Callable, argnums: int | Sequence[int] = 0, *, engine: Engine = "auto",
                           chunk: int = 16, layers: Any = None) -> Callable:
    r"""The (B,) Euclidean norms of the per-example gradients (over every argument ``argnums``
    names), as ``jnp.linalg.norm`` of [`per_example_grads`][linbackprop.per_example_grads]
    flattened — without forming the per-example gradients. After the one back substitution, a
    block whose per-example cotangent is a sum of outer products $\sum_t a_t \delta_t^T$ (dense layers, a
    weight shared along a sequence or by several layers) gets its squared norm as the ghost norm
    $\sum_{t,s} (a_t \cdot a_s)(\delta_t \cdot \delta_s)$ (or the product formed once per example, whichever the
    shapes make
    cheaper); other blocks' cotangents are formed per example and squared. Where ``fun`` uses the
    arguments outside its networks too, or an argument leaf is more than one block, the
    per-example gradients are formed ``chunk`` examples at a time (``lax.map``), keeping only
    their norms. For DP-SGD clipping: [`clipped_grad`][linbackprop.clipped_grad].

    Args:
        fun: the per-example losses, shape (B,), of the arguments.
        argnums: the argument(s) whose gradients the norms are over (together).
        engine: ``"loop"``, ``"unrolled"`` or ``"auto"``.
        chunk: the examples per chunk where per-example gradients are formed.
        layers: the classes or ``@lbp.layer`` functions whose calls are the layers of a model
            written as it is.

    Returns:
        A function of ``fun``'s arguments returning the (B,) norms.

    Raises:
        ValueError: as [`per_example_grads`][linbackprop.per_example_grads].

    Examples:
        >>> import jax.numpy as jnp, linbackprop as lbp
        >>> layer = lbp.Layer("y", lambda th, x: x @ th[0], ("x",), ("w",))
        >>> net = lbp.Network([layer], ["x"], "y")
        >>> losses = lambda p, x: net(p, x)[:, 0] ** 2 / 2
        >>> x = jnp.array([[1.0, 0.0], [0.0, 2.0]])
        >>> lbp.per_example_grad_norms(losses)({"w": jnp.ones((2, 1))}, x).tolist()
        [1.0, 4.0]
    """
    if layers is not None:
        return on_model(lambda f, a: per_example_grad_norms(f, a, engine=engine, chunk=chunk), fun, argnums, layers,
                        to_arguments=False, name="per_example_grad_norms")
    nums, _ = normalise_argnums(argnums)

    def run(*args: Any) -> jax.Array:
        split, calls, losses, batch, lams = per_example_setup(fun, args, nums, engine)
        return jnp.sqrt(squared_grad_norms(split, calls, losses, batch, lams, chunk))

    return run


def squared_grad_norms(split: Split, calls: Calls, losses: Callable, batch: int, lams: list,
                       chunk: int = 16) -> jax.Array:
    """(B,) squared per-example gradient norms after the one back substitution: ghost norms
    (`ghost_norms`) where they apply, plus the squares of what the loss reads of the arguments
    itself (a head outside ``layers=``: `direct_squares`); otherwise the per-example gradients
    formed ``chunk`` examples at a time (``lax.map``), keeping only their norms."""
    direct = direct_reads(split, calls, losses)
    ghost = ghost_norms(calls, batch, direct)
    if ghost is not None:
        return ghost_squares(ghost, lams, batch, calls.policy) + direct_squares(split, calls, losses, batch, direct)
    size = min(chunk, batch)
    starts = np.arange(0, batch, size)
    argnums = tuple(range(len(split.diff)))

    def chunk_squares(start):
        examples = jnp.minimum(start + jnp.arange(size), batch - 1)
        if calls.spans is None:
            through = calls.per_example(lams, batch, examples)
        else:  # each example from its call: the others' rows masked out
            through = None
            for call, first, n in calls.spans:
                local = examples - first
                inside = (local >= 0) & (local < n)
                mask = lambda x, inside=inside: jnp.where(inside.reshape((-1,) + (1,) * (x.ndim - 1)), x, 0)
                part = jax.tree.map(mask, calls.per_example(lams, n, jnp.clip(local, 0, n - 1), only=[call]))
                through = part if through is None else add_trees(through, part)
        direct = jax.vmap(lambda b: jax.grad(lambda *d: losses(calls.outs, *d)[b], argnums=argnums)(*split.diff))(
            examples)
        total = add_trees(direct, through)
        return sum(jnp.sum(jnp.reshape(x, (size, -1)).astype(jnp.result_type(float)) ** 2, axis=1)
                   for x in jax.tree.leaves(total))

    return jax.lax.map(chunk_squares, jnp.asarray(starts)).reshape(-1)[:batch]


def ghost_norms(calls: Calls, batch: int, direct: list[bool]) -> list[ParamNorms] | None:
    """The calls' `ParamNorms` where each argument leaf is one block of one call (`Calls.ghost`)
    and the leaves ``fun`` reads outside its networks (``direct``, from `direct_reads`: a head
    applied after the last layer named in ``layers=``) are none of them — per-example gradients
    of the two parts then touch different leaves, and their squared norms add; else None."""
    if calls.spans is not None:
        return None  # (calls of different batches: the per-example gradients, chunk by chunk)
    used = {n for call in calls.placement for n in call} - {None}
    if not used or any(d and n in used for n, d in enumerate(direct)):
        return None  # (no network reads an argument: the loss's own per-example gradients)
    return calls.ghost(batch)


def direct_reads(split: Split, calls: Calls, losses: Callable) -> list[bool]:
    """Per leaf of the differentiated arguments (flat), whether the losses read it besides
    through the networks' outputs (an equation counted as reading all its operands)."""
    jaxpr = jax.make_jaxpr(lambda *d: losses(calls.outs, *d))(*split.diff).jaxpr
    reads = []
    for n in range(len(jaxpr.invars)):
        live = depending(jaxpr, [m == n for m in range(len(jaxpr.invars))])
        reads.append(any(not isinstance(v, Literal) and v in live for v in jaxpr.outvars))
    return reads


def direct_squares(split: Split, calls: Calls, losses: Callable, batch: int, direct: list[bool]) -> jax.Array:
    """(B,) squared norms of the per-example gradients of what the losses read of the arguments
    outside the networks (their outputs held; ``direct``: those leaves, `direct_reads`): each
    example's gradient from its own rows (`one_example_losses`: one batched backward pass of
    what follows the networks), or where the losses cannot be run one example at a time, the
    Jacobian of the (B,) losses in those leaves by reverse mode (B backward passes of the
    batch's head). 0 where they read none."""
    if not any(direct):
        return jnp.zeros((batch,), jnp.result_type(float))
    leaves, treedef = jax.tree.flatten(split.diff)
    picked = [x for x, d in zip(leaves, direct) if d]

    def with_picked(picked: list) -> tuple:
        values = iter(picked)
        full = [next(values) if d else jax.lax.stop_gradient(x) for x, d in zip(leaves, direct)]
        return jax.tree.unflatten(treedef, full)

    each = one_example_losses(split, calls, batch)
    if each is not None:  # each example's loss differentiated inside the map over the examples
        jacobian = each(calls.outs, lambda loss_b: jax.grad(lambda p: loss_b(*with_picked(p)))(picked))
        jacobian = check_one_example(jacobian, lambda p: losses(calls.outs, *with_picked(p)), picked)
    else:
        jacobian = jax.jacrev(lambda picked: losses(calls.outs, *with_picked(picked)))(picked)
    return sum(jnp.sum(jnp.reshape(j, (batch, -1)).astype(jnp.result_type(float)) ** 2, axis=1) for j in jacobian)
