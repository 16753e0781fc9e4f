"""K-FAC's bare preconditioned direction from Kronecker factors, as an optax transform (the whole
optimizer, with step size, momentum and damping chosen each step, is `_kfac`)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from .._curvature import GaussNewton, Kronecker
from ._blocks import CurvatureBlock, blocks_of
from ._kronecker import Diagonal
from ._preconditioner import Preconditioner, moving_average


class ScaleByKfacState(NamedTuple):
    """The moving averages of the factors (a [`Kronecker`][linbackprop.Kronecker] pair or a
    diagonal per block: a weight with its bias, or one leaf), their inverses (a pair's damped
    factors inverted; a diagonal as it is, damped when applied) and the step count; the averages
    are None until the first update."""

    count: jax.Array
    curvature: Any
    inverses: Any


def scale_by_kfac(damping: float = 1e-3, decay: float = 0.95, update_every: int = 1
                  ) -> optax.GradientTransformationExtraArgs:
    r"""K-FAC's preconditioned gradient from ``update(..., factors=lbp.kfac_factors(loss)(params,
    *batch))``: per leaf W with factors A ⊗ Γ (averaged over steps),

    $$d_W = (A + \pi\sqrt\lambda\, I)^{-1}\, \bar g_W\, (\Gamma + \tfrac{\sqrt\lambda}{\pi} I)^{-1}, \qquad
    \pi^2 = \frac{\operatorname{tr} A / \dim A}{\operatorname{tr} \Gamma / \dim \Gamma}$$

    (W read as the [dim A, dim Γ] matrix of [`Kronecker`][linbackprop.Kronecker], with its bias
    as one more row [W; b] where ``factors`` has a [`BiasOf`][linbackprop.BiasOf] at the bias;
    factored Tikhonov damping with Martens & Grosse's π), and for the leaves without factors
    (norms, lone vectors: None in ``factors``) the damped diagonal d = ḡ / (diag G + λ) from
    ``diagonal=lbp.diag_ggn(loss)(params, *batch)``. The factors are averaged with ``decay``
    ($F \leftarrow \text{decay}\, F + (1 - \text{decay})\, F_{\text{new}}$; the first step takes
    $F_{\text{new}}$); the inverses are recomputed
    every ``update_every`` steps (``eigh``-free: Cholesky of the damped factors) and held in
    between. For shared weights the factors say how
    uses count: ``lbp.kfac_factors(loss, approximation="expand")`` (every use a term, the default)
    or ``"reduce"`` (each example's uses summed first); the transform takes either.

    The state's factors are made at the first update (``init`` cannot know which leaves have
    Kronecker factors): a jitted step compiles twice, once for the first state and once for the
    rest. Returns a direction: chain with ``optax.scale(-learning_rate)``.

    Args:
        damping: λ, fixed.
        decay: the factors' moving-average decay.
        update_every: how many steps a factorisation of the damped factors is held.

    Returns:
        An ``optax.GradientTransformationExtraArgs`` whose ``update(grad, state, params, *,
            factors, diagonal=None)`` returns the preconditioned gradient.

    Raises:
        ValueError: an argument out of range, factors that do not match the gradient, a leaf
            with neither factors nor a diagonal.
        TypeError: ``factors`` missing.

    Examples:
        >>> import jax.numpy as jnp, optax, linbackprop as lbp
        >>> layer = lbp.Layer("y", lambda th, x: x @ th[0] + th[1], ("x",), ("W", "b"))
        >>> net = lbp.Network([layer], ["x"], "y")
        >>> x, y = jnp.array([[1.0, 0.0], [0.0, 2.0]]), jnp.array([[1.0], [2.0]])
        >>> loss = lambda p: 0.5 * jnp.sum((net(p, x) - y) ** 2)
        >>> params = {"W": jnp.zeros((2, 1)), "b": jnp.zeros(1)}
        >>> tx = optax.chain(lbp.scale_by_kfac(damping=1e-8), optax.scale(-1.0))
        >>> factors = lbp.kfac_factors(loss)(params)  # b: in W's block
        >>> grad = lbp.grad_by_solve(loss)(params)
        >>> updates, state = tx.update(grad, tx.init(params), params, factors=factors)
        >>> fitted = optax.apply_updates(params, updates)  # G = A ⊗ Γ: one exact step
        >>> jnp.round(net(fitted, x).ravel(), 2).tolist()  # float32: 1.001 at XLA's defaults
        [1.0, 2.0]
    """
    if not 0 <= decay < 1 or update_every < 1 or damping <= 0:
        raise ValueError(f"scale_by_kfac: needs damping > 0 ({damping}), 0 ≤ decay < 1 ({decay}) and "
                         f"update_every ≥ 1 ({update_every}).")

    preconditioner = Preconditioner(factored=True)

    def init(params: Any) -> ScaleByKfacState:
        del params
        return ScaleByKfacState(jnp.zeros((), jnp.int32), None, None)

    def update(updates: Any, state: ScaleByKfacState, params: Any = None, *, factors: Any = None,
               diagonal: Any = None, curvature: Any = None, **extra: Any) -> tuple[Any, ScaleByKfacState]:
        del params, extra
        if isinstance(curvature, GaussNewton):  # gauss_newton(factors=True): the factors from its pass
            factors = curvature.factors if factors is None else factors
            diagonal = curvature.diagonal if diagonal is None else diagonal
        if factors is None:
            raise TypeError("scale_by_kfac needs the factors: tx.update(grad, state, params, "
                            "curvature=G) with G from lbp.gauss_newton(loss, factors=True)(params, *batch), or "
                            "factors=lbp.kfac_factors(loss)(params, *batch) (and diagonal=lbp.diag_ggn(loss)(...) "
                            "where a leaf has no factors).")
        leaves, treedef = jax.tree.flatten(updates)
        blocks = blocks_of(updates, factors, diagonal, "scale_by_kfac")
        paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(updates)[0]]
        averaged = moving_average(state.curvature, [_one_term(block, paths[block.leaf]) for block in blocks], decay)
        inverses = preconditioner.refreshed(averaged, state.inverses, damping, state.count % update_every == 0)
        direction = preconditioner.direction(blocks, leaves, inverses, damping)
        return treedef.unflatten(direction), ScaleByKfacState(state.count + 1, averaged, inverses)

    return optax.GradientTransformationExtraArgs(init, update)


def _one_term(block: CurvatureBlock, where: str) -> Kronecker | Diagonal:
    if isinstance(block.curvature, Diagonal):
        return block.curvature
    if len(block.curvature) != 1:
        raise ValueError(f"scale_by_kfac: {where} has {len(block.curvature)} Kronecker terms; it takes one pair per "
                         "leaf (lbp.kfac inverts a sum of terms).")
    return block.curvature[0]

