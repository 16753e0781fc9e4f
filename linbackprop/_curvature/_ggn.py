"""The exact diagonal of the generalised Gauss–Newton matrix and its factor G = KᵀK: each
example's block of H factored (`_examples`), its columns back-substituted for all examples at
once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .._options import Engine
from ._examples import ggn_squares, hessian_blocks, over_columns
from ._split import Split, normalise_argnums, on_model


def diag_ggn(fun: Callable, argnums: int | Sequence[int] = 0, *, engine: Engine = "auto", samples: int | None = None,
             key: jax.Array | None = None, layers: Any = None) -> Callable:
    r"""The exact diagonal of G = J* H J, shaped like the arguments ``argnums`` names (or, with
    ``samples=M`` and a PRNG ``key``, a Monte Carlo estimate from M back substitutions instead of C).

    ``fun`` returns a scalar loss that is a sum (or mean) of per-example terms, so that H is block
    diagonal over the examples (the leading axis of every state is the batch). Each example's
    block $H_b$ (C × C over its C output coordinates: C products with H, all examples at once) is
    factored $H_b = \sum_k \lambda_{bk} s_{bk} s_{bk}^T$ (``eigh``: exact for indefinite H too), and

    $$\operatorname{diag} G = \sum_b \sum_k \lambda_{bk} (J_b^* s_{bk})^2$$

    where $J_b^* s$ is ℳ on example b's rows of Λ = ℒ⁻* E* s: one back substitution for all examples
    per k (C in all, one after another: measured faster than one vmapped solve), then ℳ per
    example. Where a layer's per-example parameter cotangent is an outer product (dense layers:
    $\bar W_{bk} = a_b^T \delta_{bk}$), $\sum_k \sum_b \lambda_{bk} \bar W_{bk}^2$ is one matrix product
    $(a^2)^T(\sum_k \lambda_k \delta_k^2)$ after the
    C substitutions (BackPACK forms one per k); other cotangents are formed per example and
    squared. About C/3 + 2 gradients for dense layers (C back substitutions and one forward pass).
    Layers that mix examples raise a ``ValueError``.

    The estimate (``samples=M``) draws M samples s per example with $E[s s^T] = H_b$ and
    back-substitutes them: $\operatorname{diag} G \approx \frac1M \sum_m \sum_b (J_b^* s_{bm})^2$.
    Where the blocks are diagonally dominant (softmax cross-entropy, squared error, one output)
    a sample is one rank-one term of $H_b$ read off its entries, drawn with probability by its
    weight and a random sign (no factorisation; unbiased); elsewhere $s = R_b z$, z ~ N(0, I),
    with $R_b R_b^T = H_b$ + round-off (Cholesky; unbiased up to that shift where H is positive
    semi-definite; an indefinite block takes a positive semi-definite surrogate above it).
    Cheaper than the exact
    diagonal when the outputs have many coordinates (a language model's vocabulary).

    Args:
        fun: the scalar loss, a sum or mean over examples, of the arguments.
        argnums: the argument(s) whose diagonal is formed.
        engine: ``"loop"``, ``"unrolled"`` or ``"auto"``.
        samples: None (the exact diagonal) or M, the sampled columns per example.
        key: the PRNG key of the samples (needed with ``samples``).
        layers: the classes or ``@lbp.layer`` functions whose calls are the layers of a model
            written as it is.

    Returns:
        A function of ``fun``'s arguments returning diag G shaped like the arguments.

    Raises:
        ValueError: layers that mix examples, a state without the batch first, a loss that
            calls no network, ``samples`` without ``key``, or ``key`` without ``samples``.

    Examples:
        >>> import jax.numpy as jnp, linbackprop as lbp
        >>> layer = lbp.Layer("y", lambda th, x: x @ th[0], ("x",), ("W",))
        >>> net = lbp.Network([layer], ["x"], "y")
        >>> loss = lambda p, x: 0.5 * jnp.sum(net(p, x) ** 2)
        >>> x = jnp.array([[1.0, 0.0], [0.0, 2.0]])
        >>> lbp.diag_ggn(loss)({"W": jnp.ones((2, 1))}, x)["W"].tolist()
        [[1.0], [4.0]]
    """
    if layers is not None:
        return on_model(lambda f, a: diag_ggn(f, a, engine=engine, samples=samples, key=key), fun, argnums, layers,
                        name="diag_ggn")
    nums, single = normalise_argnums(argnums)

    def run(*args: Any) -> Any:
        calls, examples = hessian_blocks(Split(fun, args, nums, False), engine, "diag_ggn")
        parts, total = ggn_squares(calls, examples)
        diag = total(over_columns(parts, examples, samples, key, "diag_ggn"))
        return diag[0] if single else diag

    return run


def ggn_factor(fun: Callable, argnums: int | Sequence[int] = 0, *, rank: int | None = None, engine: Engine = "auto",
               layers: Any = None, residuals: bool = False) -> Callable:
    r"""K with G = Kᵀ K from per-example Jacobian rows, shaped like the arguments ``argnums``
    names with a leading axis of r·B rows (r per example, B examples):

    $$G = \sum_b J_b^* H_b J_b = \sum_b \sum_k (J_b^* \sqrt{\lambda_{bk}} s_{bk})(J_b^* \sqrt{\lambda_{bk}} s_{bk})^T,
    \qquad H_b = \sum_k \lambda_{bk} s_{bk} s_{bk}^T$$

    ``fun`` returns a scalar loss that is a sum (or mean) over examples, so that H is block
    diagonal (each example's C × C block factored by ``eigh``, as in [`diag_ggn`][linbackprop.diag_ggn]; C
    counts the output coordinates the loss reads: an output it never reads has no rows); row
    (k, b) is example b's gradient of the k-th column of its factor: one back substitution for
    all examples per k, then ℳ per example. ``rank=r`` keeps each example's r largest
    eigenvalues: exact where each example has at most r residuals — a least-squares loss
    $\frac12 \sum_b \lVert r_b \rVert^2$ with one residual per example (a physics-informed network's ½ (Δu + f)² at each
    point) has rank 1, and its rows are then the residuals' Jacobian rows. H's negative part is
    dropped (exact for squared error and softmax cross-entropy).

    With R = r·B rows, (G + λI)⁻¹ g is a P × P solve from KᵀK or, where R < P, the R × R
    Woodbury solve (g − Kᵀ(λI + KKᵀ)⁻¹K g)/λ: [`scale_by_gauss_newton`][linbackprop.scale_by_gauss_newton] takes the
    rows as ``update(..., rows=K)`` (exact energy natural gradient, ENGD). About r + 1 gradients.
    Layers that mix examples raise a ``ValueError``.

    Args:
        fun: the scalar loss, a sum or mean over examples, of the arguments.
        argnums: the argument(s) the rows are over.
        rank: None (a row per output coordinate the loss reads) or r, each example's r
            largest eigenvalues of $H_b$.
        engine: ``"loop"``, ``"unrolled"`` or ``"auto"``.
        layers: the classes or ``@lbp.layer`` functions whose calls are the layers of a model
            written as it is.
        residuals: also return the residuals b, one per row, with g = Kᵀb where each example's
            ∂ℓ/∂(outputs) lies in the kept eigenvectors' span (exact for a least-squares loss
            $\frac12 \lVert r \rVert^2$ of rank-r examples, whose b is then r, scaled as the rows are):
            $b_{bk} = s_{bk}^T \partial \ell_b / \sqrt{\lambda_{bk}}$ (0 where λ ≤ 0).
            [`scale_by_gauss_newton`][linbackprop.scale_by_gauss_newton]'s ``update(...,
            residuals=b)`` then forms its directions from b, never from g = Kᵀb, which keeps
            the digits that the product Kᵀb loses along K's small singular values.

    Returns:
        A function of ``fun``'s arguments returning K: the arguments' pytree with a leading
            axis of r·B rows on every leaf; with ``residuals``, the pair (K, b), b of shape [r·B].

    Raises:
        ValueError: layers that mix examples, a state without the batch first, or a loss that
            calls no network.

    Examples:
        >>> import jax.numpy as jnp, linbackprop as lbp
        >>> layer = lbp.Layer("y", lambda th, x: x @ th[0], ("x",), ("W",))
        >>> net = lbp.Network([layer], ["x"], "y")
        >>> loss = lambda p, x: 0.5 * jnp.sum(net(p, x) ** 2)
        >>> x = jnp.array([[1.0, 0.0], [0.0, 2.0]])
        >>> K = lbp.ggn_factor(loss, rank=1)({"W": jnp.ones((2, 1))}, x)["W"]
        >>> K.shape, K[:, :, 0].tolist()  # the examples' Jacobian rows: x_b
        ((2, 2, 1), [[1.0, 0.0], [0.0, 2.0]])
    """
    if layers is not None:
        return on_model(lambda f, a: ggn_factor(f, a, rank=rank, engine=engine, residuals=residuals), fun, argnums,
                        layers, with_extra=residuals, name="ggn_factor")
    nums, single = normalise_argnums(argnums)
    if rank is not None and (not isinstance(rank, int) or rank < 1):
        raise ValueError(f"ggn_factor(rank={rank!r}): a positive int (the residuals per example), or None for all.")

    def run(*args: Any) -> Any:
        calls, examples = hessian_blocks(Split(fun, args, nums, False), engine, "ggn_factor",
                                         per_position=False)
        batches = examples.by_call(examples.batches)
        rows, bs = [], []
        lams, vecses = examples.eigen()
        for g, (group, lam, vecs) in enumerate(zip(examples.groups, lams, vecses)):
            coords = lam.shape[1]
            keep = coords if rank is None else min(rank, coords)
            for k in range(coords - keep, coords):  # eigh's order is ascending: the largest last
                positive = lam[:, k] > 0
                root = jnp.sqrt(jnp.where(positive, lam[:, k], 1.0))
                bs.append(jnp.where(positive, jnp.sum(vecs[:, :, k] * examples.gradients[g], axis=1) / root, 0.0))
                s = [vecs[:, :, k] * jnp.sqrt(jnp.maximum(lam[:, k], 0.0))[:, None] if h == g
                     else jnp.zeros(x.shape, x.dtype) for h, x in enumerate(lams)]
                adjoints = calls.adjoints(examples.unflatten(s), batches)
                rows.append(calls.per_example(adjoints, examples.batches[g], only=group))
        out = jax.tree.map(lambda *r: jnp.concatenate(r, axis=0), *rows)
        out = out[0] if single else out
        return (out, jnp.concatenate(bs)) if residuals else out

    return run
