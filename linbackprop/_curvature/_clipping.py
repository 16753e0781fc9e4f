"""DP-SGD's clipped gradient sum at about the cost of one gradient: `clipped_grad`.

DP-SGD (Abadi et al. 2016) clips each example's gradient g_b to norm C before summing,

    Σ_b min(1, C / ‖g_b‖) g_b,

then adds Gaussian noise. Here one forward pass and one back substitution ℒ*Λ = ∇_U Σ_b ℓ_b give
every example's adjoint (row b of Λ), the norms ‖g_b‖ come from Λ without forming g_b (ghost
norms, `_ghost`), and the clipped sum Σ_b w_b g_b, w_b = min(1, C / ‖g_b‖), from the same
per-example operands: a block's Σ_b w_b Σ_t a_bt δ_btᵀ is one product (w a)ᵀ δ over the examples
and positions. Where the ghost norms do not apply, it is ℳ of Λ with example b's rows scaled by
w_b (Σ_b w_b g_b is the gradient of Σ_b w_b ℓ_b, whose adjoint is wΛ row by row). No second back
substitution and no per-example gradient of a dense layer is formed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .._capture import rewrite
from .._options import Engine
from ._examples import per_example_setup
from ._ghost import ghost_clipped
from ._per_example import direct_reads, direct_squares, ghost_norms, squared_grad_norms
from ._split import add_trees, flat_result, normalise_argnums


def clipped_grad(losses: Callable, clip: float | jax.Array, argnums: int | Sequence[int] = 0, *,
                 engine: Engine = "auto", layers: Any = None) -> Callable:
    r"""The DP-SGD sum of per-example gradients clipped to norm ``clip``, and the norms.

    ``clipped_grad(losses, clip)(params, *args)`` returns ``(clipped, norms)``: ``clipped`` =
    $\sum_b \min(1, \text{clip} / \lVert g_b \rVert)\, g_b$ (shaped like the arguments ``argnums`` names: the sum before
    noise; divide by the batch for a mean), ``norms`` = $(\lVert g_b \rVert)_b$, with $g_b$ the gradient of
    ``losses(params, *args)[b]``. ``losses`` returns per-example losses, shape (B,), and, as for
    [`per_example_grads`][linbackprop.per_example_grads], the leading axis of every network state is
    the batch (layers that mix examples — batch statistics, attention across the batch — raise).

    Cost: one forward pass, one back substitution for all examples, the norms from the adjoints
    (ghost norms $\lVert \sum_t a_t \delta_t^T \rVert^2 = \sum_{t,s} (a_t \cdot a_s)(\delta_t \cdot \delta_s)$
    where a block's per-example cotangent
    is a sum of outer products — dense layers, a weight shared along a sequence, by several
    layers or used twice in one — each such block's product formed once per example where that is
    cheaper, other blocks' cotangents formed per example and squared), each layer's operands read
    from the forward pass's stored residuals, then the weighted sum from the same per-example
    operands (one product (w a)ᵀ δ over the examples per block, or the products already formed
    summed with the weights). Where the per-example products would take much memory (an RNN's
    shared weights), all of it goes in one loop over chunks of examples. Measured against a
    gradient step in docs/performance.md (≈ 1.1–1.6× its time, < 2× its temporaries). Blocks
    shared by several layers (tied embeddings, an RNN's recurrent weight) are clipped by the norm
    of their whole per-example gradient, every use counted.

    Noise and accounting are the field's: add ``σ · clip`` Gaussian noise to ``clipped`` (e.g.
    ``optax.contrib.differentially_private_aggregate`` does both clipping and noise the slow way;
    here ``clipped + σ clip N(0, I)`` with a fresh key), and compute ε with ``dp_accounting``.

    Args:
        losses: ``losses(*args) -> (B,)`` per-example losses calling one or more Networks (or a
            model with ``layers=``).
        clip: the clipping norm C > 0.
        argnums: which arguments to differentiate (an int gives one result, a sequence a tuple).
        engine: as in [`grad_by_solve`][linbackprop.grad_by_solve].
        layers: find the network in a model as it is (see `capture`).

    Returns:
        A function of ``losses``' arguments returning ``(clipped, norms)``: the clipped sum
            shaped like the differentiated arguments, and the (B,) per-example gradient norms.

    Raises:
        ValueError: ``clip`` not a positive norm, ``losses`` returning a scalar, layers that
            mix examples, or network calls with different batches (an example is then
            ambiguous: the message names the calls).

    Examples:
        >>> import jax.numpy as jnp, linbackprop as lbp
        >>> layer = lbp.Layer("y", lambda th, x: x @ th[0], ("x",), ("w",))
        >>> net = lbp.Network([layer], ["x"], "y")
        >>> losses = lambda p, x: net(p, x)[:, 0] ** 2 / 2
        >>> x = jnp.array([[1.0, 0.0], [0.0, 2.0]])      # g_0 = (1, 0), g_1 = (0, 4)
        >>> clipped, norms = lbp.clipped_grad(losses, 2.0)({"w": jnp.ones((2, 1))}, x)
        >>> norms.tolist(), clipped["w"][:, 0].tolist()  # g_1 scaled by 2/4
        ([1.0, 4.0], [1.0, 2.0])
    """
    if not callable(losses):
        raise TypeError(f"clipped_grad takes the per-example losses function first; got {losses!r}.")
    if isinstance(clip, int | float) and not clip > 0:
        raise ValueError(f"clipped_grad: clip must be a positive norm; got {clip!r}.")
    nums, single = normalise_argnums(argnums)
    if layers is not None:
        def on_model(*args: Any) -> tuple[Any, jax.Array]:
            found = rewrite(losses, args, nums, layers, per_example="clipped_grad")
            flat = clipped_grad(flat_result(found.fun), clip, tuple(range(len(nums))), engine=engine)
            clipped, norms = flat(*found.args)
            return found.gradient(clipped, single), norms

        return on_model

    def run(*args: Any) -> tuple[Any, jax.Array]:
        split, calls, per_example, batch, lams = per_example_setup(losses, args, nums, engine)
        if calls.spans is not None:
            raise ValueError("clipped_grad: fun's network calls have different batches, so which of their examples "
                             "is one example (one privacy unit) to clip is ambiguous: "
                             f"{'; '.join(calls.call_names())}. Call the network once per example's data, or clip "
                             "the per-example gradients yourself (lbp.per_example_grads, jnp.concatenate order).")
        c = jnp.asarray(clip, jnp.result_type(float))
        direct = direct_reads(split, calls, per_example)
        ghost = ghost_norms(calls, batch, direct)
        if ghost is not None:
            extra = direct_squares(split, calls, per_example, batch, direct)
            norms, sums = ghost_clipped(ghost, lams, batch, calls.policy, lambda n: _weights(n, c), extra)
            through = calls.arguments(sums)
            weights = _weights(norms, c)
        else:
            norms = jnp.sqrt(squared_grad_norms(split, calls, per_example, batch, lams))
            weights = _weights(norms, c)
            through = calls.weighted(lams, weights)
        direct = jax.grad(lambda *d: jnp.sum(weights * per_example(calls.outs, *d)),
                          argnums=tuple(range(len(nums))))(*split.diff)
        clipped = tuple(add_trees(a, b) for a, b in zip(direct, through))
        return (clipped[0] if single else clipped), norms

    return run


def _weights(norms: jax.Array, clip: jax.Array) -> jax.Array:
    """min(1, C/‖g_b‖), without a gradient (and without dividing by a zero norm)."""
    c = clip.astype(norms.dtype)
    return jax.lax.stop_gradient(jnp.where(norms > c, c / jnp.where(norms > c, norms, 1), 1))
