"""K-FAC as a whole optimizer (KFAC*): the preconditioned gradient from averaged Kronecker factors,
its step size and momentum from the exact quadratic model, the damping by Levenberg–Marquardt.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax

from .._curvature import GaussNewton
from ._arguments import accepted, params_dtype, shaped_as
from ._blocks import blocks_of
from ._damping import DampingBounds, gain_ratio, martens_grosse, raised
from ._kfac_star import KfacStarStep, kfac_star
from ._preconditioner import FactorAverage, Preconditioner


class KfacState(NamedTuple):
    r"""The state of [`kfac`][linbackprop.kfac].

    Attributes:
        count: the steps taken.
        damping: λ of the next step.
        sums: per block (a weight with its bias where ``factors`` joined them, or one leaf),
            the decayed sums $\sum_k \text{decay}^k F_{t-k}$ of its fresh curvature (a tuple of
            [`Kronecker`][linbackprop.Kronecker] terms, or a diagonal); None before the first
            update.
        weight: $\sum_k \text{decay}^k$, so that ``sums / weight`` is the bias-corrected average (the
            first step's average is the first step's factors exactly).
        inverses: per block, the decomposition of the averaged curvature that the steps apply
            (recomputed every ``update_every`` steps); None before the first update.
        previous: the last update u (momentum's direction); zeros before the first.
        learning_rate: α of the last step (the coefficient of the preconditioned gradient).
        momentum: μ of the last step (the coefficient of the previous update).
        rho: the last reduction ratio (actual / predicted change of the loss); NaN until
            measured.

    Examples:
        >>> import jax.numpy as jnp, linbackprop as lbp
        >>> state = lbp.kfac(damping=1e-3).init({"W": jnp.zeros((2, 1))})
        >>> int(state.count), round(float(state.damping), 6), state.sums is None
        (0, 0.001, True)
    """

    count: jax.Array
    damping: jax.Array
    sums: Any
    weight: jax.Array
    inverses: Any
    previous: Any
    learning_rate: jax.Array
    momentum: jax.Array
    rho: jax.Array


def kfac(damping: float = 1e-3, decay: float = 0.95, update_every: int = 5, *, learning_rate: float | None = None,
         momentum: float | None = None, adapt_damping: bool = True, damping_interval: int = 5,
         damping_decay: float = 0.95, min_damping: float = 1e-8, max_damping: float = 1e8,
         reject: bool = False, factors: Any = None,
         inverse: Literal["exact", "factored"] = "exact") -> optax.GradientTransformationExtraArgs:
    r"""K-FAC, the whole optimizer: its updates go to ``optax.apply_updates`` (as ``optax.adam``'s
    do; [`scale_by_kfac`][linbackprop.scale_by_kfac] is the bare direction).

    Each ``update(grad, state, params, curvature=G)`` (G from ``lbp.gauss_newton(loss,
    factors=True, samples=1, key=key)``: the factors, the value and ``value_fn=G.value_at`` from
    its one pass; or ``factors=``, ``value=``, ``value_fn=`` given apart):

    1. **Factors averaged.** F ≈ Σ_terms A ⊗ Γ per leaf, from
       [`kfac_factors`][linbackprop.kfac_factors] (a leaf's factors a
       [`Kronecker`][linbackprop.Kronecker] pair, or a tuple of pairs for a loss of several
       terms), averaged over the steps with ``decay`` and bias-corrected as kfac-jax's weighted
       average \(\bar F_t = \sum_k \mathrm{decay}^k F_{t-k} / \sum_k \mathrm{decay}^k\) (the
       first step uses its own factors exactly). A bias marked [`BiasOf`][linbackprop.BiasOf]
       is preconditioned with its weight, as one block [W; b]. Other leaves without factors take
       a diagonal from ``diagonal=`` (``lbp.diag_ggn``).
    2. **Direction.** Δ = −(F̄ + λI)⁻¹ g with λ added exactly (eigendecompositions of the
       factors, recomputed every ``update_every`` steps and at every one of the first
       ``update_every``, so that no early single-batch estimate is held; between, the held
       decomposition is applied with the current λ). Two terms are inverted exactly as their
       damped sum (simultaneous diagonalisation), more by merging all but the first (see
       ``linbackprop._optim._kronecker``); there λ enters each factor as √(λ/2) (π-scaled), so
       the curvature is damped by about √λ times its scale, not λ: a problem that needs little
       damping (a PINN near 10⁻⁷) lowers ``min_damping`` (10⁻²⁰ puts ≈ 10⁻¹⁰ on a factor).
       ``inverse="factored"`` damps one term's factors apart in the same way, (A + π√λ I)⁻¹ and
       (Γ + √λ/π I)⁻¹ by Cholesky (kfac-jax's default; `scale_by_kfac`'s): far cheaper than
       ``eigh`` on a large factor (a dense layer of 2,048 inputs), with the λ of the step that
       decomposed held until the next decomposition.
    3. **Step size and momentum (KFAC\*).** u = α Δ + μ δ, δ the previous update, with (α, μ)
       minimising the quadratic model m(u) = gᵀu + ½ uᵀ(G + λI)u over that plane: with
       C = G + λI, (α, μ) solves M (α, μ)ᵀ = −(gᵀΔ, gᵀδ)ᵀ, M = ((ΔᵀCΔ, ΔᵀCδ), (δᵀCΔ, δᵀCδ)),
       with the exact G products [`G.gram`][linbackprop.GaussNewton.gram]([Δ, δ]) (forward
       substitutions only, no back substitution). The first step (no δ) takes
       α = −gᵀΔ / ΔᵀCΔ, μ = 0. A float ``learning_rate`` or ``momentum`` fixes that coefficient
       (the other, if adaptive, minimises the model with it fixed); ``learning_rate=1.0,
       momentum=0.0`` is exactly u = −(F̄ + λI)⁻¹ g.
    4. **Damping (Levenberg–Marquardt).** With ``adapt_damping``, every ``damping_interval``
       steps the reduction ratio ρ = (f(θ + u) − f(θ)) / (gᵀu + ½ uᵀGu) (``value_fn``; the
       model without λ, as kfac-jax) sets λ: λ / ω where ρ < 1/4, λ · ω where ρ > 3/4,
       ω = ``damping_decay`` ** ``damping_interval``, kept in [``min_damping``,
       ``max_damping``]. With ``reject``, f(θ + u) is measured every step and a step that does
       not lower the loss comes out as zeros (and λ grows).

    Under one ``jax.jit`` (the factors, G and the loss inside the step): without ``factors=``
    the state's averages are made at the first update (``init`` cannot know the factors'
    shapes), so a jitted step compiles twice, for the first state and for the rest. Given
    ``factors=`` (the factors at any parameters, or their ``jax.eval_shape``), ``init`` makes
    them, and the state keeps one structure from the start — what ``nnx.Optimizer`` needs (it
    writes the new state into the old one's structure).

    The loss after the step, f(θ + u), is ``value_fn(θ + u)``; ``value_fn=G.value_at``
    ([`GaussNewton.value_at`][linbackprop.GaussNewton.value_at]: the loss G was made from, on
    its batch, at parameters shaped as the gradient) needs no split and merge of a ``layers=``
    model.

    Args:
        damping: λ of the first step (and for good, without ``adapt_damping``).
        decay: the factors' moving-average decay (kfac-jax's default 0.95).
        update_every: how many steps a decomposition of the factors is held.
        learning_rate: None (α chosen each step) or a fixed α.
        momentum: None (μ chosen each step) or a fixed μ.
        adapt_damping: adapt λ by Levenberg–Marquardt (needs ``value_fn``).
        damping_interval: the steps between two adaptations of λ.
        damping_decay: ω = damping_decay ** damping_interval is λ's factor per adaptation.
        min_damping: λ's floor.
        max_damping: λ's ceiling.
        reject: measure every step and zero the ones that do not lower the loss.
        factors: an example of ``kfac_factors``' result (any parameters, the same model; or its
            ``jax.eval_shape``) for ``init`` to make the averages with (``nnx.Optimizer``).
        inverse: ``"exact"`` (λ added exactly to the eigendecomposed factors) or ``"factored"``
            (one term's factors damped apart and inverted by Cholesky).

    Returns:
        An ``optax.GradientTransformationExtraArgs``. Its ``update(grad, state, params, *,
            factors=None, curvature=None, value=None, value_fn=None, diagonal=None, **extra)``
            needs ``curvature=G`` ([`gauss_newton`][linbackprop.gauss_newton]) unless both
            coefficients are fixed and λ is not adapted, the factors (``G.factors`` where G was
            made with ``factors=True``, else ``factors=``), and with ``adapt_damping`` or
            ``reject`` ``value_fn(params, **extra)`` (the loss on the same batch, called with the
            extra arguments it accepts; ``G.value_at`` where none is given, with ``G.value``);
            ``value`` (the loss at ``params``) saves one call of it.

    Raises:
        ValueError: an argument out of range, factors that do not match the gradient, a leaf
            with neither factors nor a diagonal.
        TypeError: ``curvature`` or ``value_fn`` missing where they are needed.

    Examples:
        >>> import jax, jax.numpy as jnp, optax, linbackprop as lbp
        >>> layer = lbp.Layer("y", lambda th, x: jnp.tanh(x @ th[0]), ("x",), ("W",))
        >>> net = lbp.Network([layer], ["x"], "y")
        >>> x = jax.random.normal(jax.random.key(0), (16, 3))
        >>> y = jnp.tanh(x @ jnp.array([[0.5], [-1.0], [0.25]]))
        >>> loss = lambda p: 0.5 * jnp.mean((net(p, x) - y) ** 2)
        >>> opt = lbp.kfac(damping=1e-3)
        >>> params = {"W": jnp.zeros((3, 1))}
        >>> state = opt.init(params)
        >>> @jax.jit
        ... def step(params, state):  # value, gradient, G and the factors from one pass
        ...     value, grad, G = lbp.gauss_newton(loss, factors=True)(params)
        ...     updates, state = opt.update(grad, state, params, curvature=G)
        ...     return optax.apply_updates(params, updates), state
        >>> for _ in range(8):
        ...     params, state = step(params, state)
        >>> bool(loss(params) < 1e-10)
        True
    """
    _check_options(damping, decay, update_every, damping_interval, damping_decay, min_damping, max_damping,
                   inverse)
    preconditioner = Preconditioner(inverse == "factored")
    omega = damping_decay ** damping_interval
    bounds = DampingBounds(min_damping, max_damping)
    adaptive = learning_rate is None or momentum is None
    measures = adapt_damping or reject
    rule = _Rule(adapt_damping, reject, damping_interval, omega, bounds)

    def init(params: Any) -> KfacState:
        dtype = params_dtype(params)
        nan, lam = jnp.asarray(jnp.nan, dtype), jnp.asarray(damping, dtype)
        sums, weight, inverses = None, jnp.zeros((), dtype), None
        if factors is not None:  # the averages' structure now, from the example factors' shapes
            example = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), factors)
            fresh = [b.curvature for b in blocks_of(params, example, optax.tree.zeros_like(params), "kfac")]
            sums, inverses = FactorAverage.zeros(fresh, dtype).sums, preconditioner.placeholders(fresh, lam)
        return KfacState(jnp.zeros((), jnp.int32), lam, sums, weight, inverses, optax.tree.zeros_like(params),
                         nan, nan, nan)

    def update(updates: Any, state: KfacState, params: Any = None, *, factors: Any = None,
               curvature: GaussNewton | None = None, value: Any = None, value_fn: Callable | None = None,
               diagonal: Any = None, **extra: Any) -> tuple[Any, KfacState]:
        grad, lam = updates, state.damping
        factors, value, value_fn = _from_curvature(curvature, factors, value, value_fn)
        _check_arguments(factors, curvature, value_fn, params, adaptive or adapt_damping, measures)
        leaves, treedef = jax.tree.flatten(grad)
        blocks = blocks_of(grad, factors, diagonal, "kfac")
        fresh = [block.curvature for block in blocks]
        if state.sums is None:  # the first update: zero sums and placeholder decompositions of their shapes
            sums, held = FactorAverage.zeros(fresh, lam.dtype), preconditioner.placeholders(fresh, lam)
        else:
            sums, held = FactorAverage(state.sums, state.weight), state.inverses
        sums = sums.add(fresh, decay)
        # decomposed at every one of the first update_every steps (no early single-batch estimate held)
        now = ((state.count < update_every) | (state.count % update_every == 0)) & (sums.weight > 0)
        inverses = preconditioner.refreshed(sums.average(), held, lam, now)
        direction = treedef.unflatten([-d for d in preconditioner.direction(blocks, leaves, inverses, lam)])
        # no finite factors yet (every batch so far non-finite): no curvature, no step, for every
        # leaf alike (the placeholder decompositions gave Kronecker leaves 0 and diagonal ones g/λ)
        direction = jax.tree.map(lambda d: jnp.where(sums.weight > 0, d, jnp.zeros_like(d)), direction)
        step = kfac_star(grad, direction, shaped_as(state.previous, grad),
                         curvature if adaptive or adapt_damping else None, lam, learning_rate, momentum)
        lam = jnp.where(step.broken, raised(lam, omega, bounds), lam)  # a step that is not finite: more damping
        update, rho = step.update, state.rho
        if measures:
            update, lam, rho = _levenberg_marquardt(step, state, lam, params, value, value_fn,
                                                    accepted(value_fn, extra), rule)
        return update, KfacState(state.count + 1, lam, sums.sums, sums.weight, inverses, update, step.alpha,
                                 step.mu, rho)

    return optax.GradientTransformationExtraArgs(init, update)


def _check_options(damping: float, decay: float, update_every: int, damping_interval: int,
                   damping_decay: float, min_damping: float, max_damping: float, inverse: str) -> None:
    if damping <= 0 or not min_damping <= damping <= max_damping or min_damping <= 0:
        raise ValueError(f"kfac: needs 0 < min_damping ({min_damping}) ≤ damping ({damping}) ≤ max_damping "
                         f"({max_damping}).")
    if not 0 <= decay < 1:
        raise ValueError(f"kfac(decay={decay}): the factors' moving average needs 0 ≤ decay < 1.")
    for name, n in (("update_every", update_every), ("damping_interval", damping_interval)):
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"kfac({name}={n!r}): a positive int (steps).")
    if not 0 < damping_decay < 1:
        raise ValueError(f"kfac(damping_decay={damping_decay}): needs 0 < damping_decay < 1.")
    if inverse not in ("exact", "factored"):
        raise ValueError(f"kfac(inverse={inverse!r}): use 'exact' (λ added exactly, eigendecompositions) or "
                         "'factored' (the factors damped apart, Cholesky).")


class _Rule(NamedTuple):
    """When and how `kfac` measures its steps and moves λ."""

    adapt: bool
    reject: bool
    interval: int
    omega: float
    bounds: DampingBounds


def _levenberg_marquardt(step: KfacStarStep, state: KfacState, lam: jax.Array, params: Any, value: Any,
                         value_fn: Callable, kwargs: dict, rule: _Rule) -> tuple[Any, jax.Array, jax.Array]:
    """(update, λ, ρ): Martens & Grosse's rule (`_damping.martens_grosse`) from f(θ + u), measured
    every ``interval`` steps (every step with ``reject``, which zeroes a step that did not lower
    the loss and raises λ)."""
    dtype = lam.dtype
    before = value_fn(params, **kwargs) if value is None else value
    measure_now = (state.count % rule.interval == 0) if not rule.reject else jnp.asarray(True)
    after = jax.lax.cond(measure_now,
                         lambda: jnp.asarray(value_fn(optax.tree.add(params, step.update), **kwargs), dtype),
                         lambda: jnp.asarray(jnp.nan, dtype))
    measured_rho = gain_ratio(before, after, step.predicted_change())
    update, rho = step.update, state.rho
    if rule.adapt:
        adapt_now = (state.count % rule.interval == 0) & ~step.broken  # a broken step raised λ already
        rho = jnp.where(adapt_now, measured_rho, rho).astype(dtype)
        lam = jnp.where(adapt_now, martens_grosse(lam, rho, rule.omega, rule.bounds), lam)
    if rule.reject:
        failed = ~(jnp.isfinite(after) & (after < before))
        update = jax.tree.map(lambda u: jnp.where(failed, jnp.zeros_like(u), u), update)
        if not rule.adapt:
            rho = measured_rho.astype(dtype)
        lam = jnp.where(failed & ~step.broken, raised(lam, rule.omega, rule.bounds), lam)  # broken: raised once
    return update, lam, rho


def _from_curvature(curvature: Any, factors: Any, value: Any, value_fn: Callable | None) -> tuple:
    """What G's pass holds: the factors, and the loss on G's batch with its value (a ``value_fn``
    given is measured as before)."""
    if isinstance(curvature, GaussNewton):
        factors = curvature.factors if factors is None else factors
        if value_fn is None:
            value_fn, value = curvature.value_at, curvature.value if value is None else value
    return factors, value, value_fn


def _check_arguments(factors: Any, curvature: Any, value_fn: Callable | None, params: Any, needs_g: bool,
                     measures: bool) -> None:
    if factors is None:
        raise TypeError("kfac needs the factors: opt.update(grad, state, params, curvature=G) with "
                        "value, grad, G = lbp.gauss_newton(loss, factors=True, samples=1, key=key)(params, *batch) "
                        "(one pass), or factors=lbp.kfac_factors(loss)(params, *batch).")
    if needs_g and not isinstance(curvature, GaussNewton):
        raise TypeError("kfac needs the Gauss–Newton matrix for its step size, momentum and damping: "
                        "value, grad, G = lbp.gauss_newton(loss)(params, *batch); opt.update(..., curvature=G) "
                        "(or fix learning_rate= and momentum= and pass adapt_damping=False)"
                        + ("" if curvature is None else f"; got curvature of type {type(curvature).__name__}."))
    if measures and value_fn is None:
        raise TypeError("kfac with adapt_damping or reject needs value_fn, the loss on the same batch: "
                        "opt.update(..., value_fn=G.value_at) (the loss G was made from), or "
                        "value_fn=lambda p, **_: loss(p, *batch) (or adapt_damping=False).")
    if measures and params is None:
        raise ValueError("kfac with value_fn needs params: opt.update(grad, state, params, ...).")
