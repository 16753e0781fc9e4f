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
from .._graph import in_turn
from ._arguments import accepted, params_dtype, shaped_as
from ._blocks import block_matrix, blocks_of, blockwise
from ._kronecker import apply, decompose


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
    factored = inverse == "factored"
    omega = damping_decay ** damping_interval
    adaptive = learning_rate is None or momentum is None

    def init(params: Any) -> KfacState:
        dtype = params_dtype(params)
        nan = jnp.asarray(jnp.nan, dtype)
        sums = inverses = None
        if factors is not None:  # the averages' structure now, from the example factors' shapes
            example = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), factors)
            fresh = [b.curvature for b in blocks_of(params, example, optax.tree.zeros_like(params), "kfac")]
            sums = jax.tree.map(jnp.zeros_like, fresh)
            shapes = jax.eval_shape(lambda c: [decompose(x, jnp.asarray(damping, dtype), factored) for x in c], fresh)
            inverses = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)
        return KfacState(jnp.zeros((), jnp.int32), jnp.asarray(damping, dtype), sums, jnp.zeros((), dtype),
                         inverses, optax.tree.zeros_like(params), nan, nan, nan)

    def update(updates: Any, state: KfacState, params: Any = None, *, factors: Any = None,
               curvature: GaussNewton | None = None, value: Any = None, value_fn: Callable | None = None,
               diagonal: Any = None, **extra: Any) -> tuple[Any, KfacState]:
        grad = updates
        if isinstance(curvature, GaussNewton):  # what G's pass holds: factors, value, the loss function
            factors = curvature.factors if factors is None else factors
            if value_fn is None:  # the loss and its value on G's batch (a value_fn given: measured as before)
                value_fn, value = curvature.value_at, curvature.value if value is None else value
        if factors is None:
            raise TypeError("kfac needs the factors: opt.update(grad, state, params, curvature=G) with "
                            "value, grad, G = lbp.gauss_newton(loss, factors=True, samples=1, key=key)(params, *batch) "
                            "(one pass), or factors=lbp.kfac_factors(loss)(params, *batch).")
        needs_g = adaptive or adapt_damping
        if needs_g and not isinstance(curvature, GaussNewton):
            raise TypeError("kfac needs the Gauss–Newton matrix for its step size, momentum and damping: "
                            "value, grad, G = lbp.gauss_newton(loss)(params, *batch); opt.update(..., curvature=G) "
                            "(or fix learning_rate= and momentum= and pass adapt_damping=False)"
                            + ("" if curvature is None else f"; got curvature of type {type(curvature).__name__}."))
        measures = adapt_damping or reject
        if measures and value_fn is None:
            raise TypeError("kfac with adapt_damping or reject needs value_fn, the loss on the same batch: "
                            "opt.update(..., value_fn=G.value_at) (the loss G was made from), or "
                            "value_fn=lambda p, **_: loss(p, *batch) (or adapt_damping=False).")
        if measures and params is None:
            raise ValueError("kfac with value_fn needs params: opt.update(grad, state, params, ...).")

        leaves, treedef = jax.tree.flatten(grad)
        blocks = blocks_of(grad, factors, diagonal, "kfac")
        fresh = [block.curvature for block in blocks]
        dtype = state.damping.dtype
        if state.sums is None:  # the first update: zero sums and placeholder decompositions of their shapes
            sums = jax.tree.map(jnp.zeros_like, fresh)
            shapes = jax.eval_shape(lambda c: [decompose(x, state.damping, factored) for x in c], fresh)
            held = jax.tree.map(jnp.zeros_like, shapes)
        else:
            sums, held = state.sums, state.inverses
        # a batch whose factors are not finite is left out of the average (and eigh never sees a
        # NaN: LAPACK's iterations need not end on one)
        finite = _all_finite(fresh)
        sums = jax.tree.map(lambda s, f: jnp.where(finite, decay * s + f, s), sums, fresh)
        weight = jnp.where(finite, decay * state.weight + 1, state.weight)
        averaged = jax.tree.map(lambda s: s / jnp.maximum(weight, 1e-30).astype(s.dtype), sums)
        lam = state.damping
        recompute = ((state.count < update_every) | (state.count % update_every == 0)) & (weight > 0)

        def fresh_or_held() -> list:
            # a decomposition of non-finite averages (an overflow) or with non-finite results is not
            # taken: the held one serves (eigh sees the non-finite entries zeroed, never the NaN)
            new = in_turn(lambda c: decompose(c, lam, factored), averaged)  # LAPACK's calls in turn
            ok = _all_finite(averaged) & _all_finite(new)
            return jax.tree.map(lambda n, h: jnp.where(ok, n, h), new, held)

        inverses = jax.lax.cond(recompute, fresh_or_held, lambda: held)

        direction = treedef.unflatten(blockwise(blocks, leaves, [-apply(inv, block_matrix(block, leaves), lam)
                                                                 for inv, block in zip(inverses, blocks)]))
        # no finite factors yet (every batch so far non-finite): no curvature, no step, for every
        # leaf alike (the placeholder decompositions gave Kronecker leaves 0 and diagonal ones g/λ)
        direction = jax.tree.map(lambda d: jnp.where(weight > 0, d, jnp.zeros_like(d)), direction)
        previous = shaped_as(state.previous, grad)
        vdot = optax.tree.vdot
        b = jnp.stack([vdot(grad, direction), vdot(grad, previous)]).astype(dtype)
        if not needs_g:
            gram = jnp.zeros((2, 2), dtype)
        elif momentum is not None and momentum == 0:  # δ's products would be multiplied by μ = 0
            gram = jnp.zeros((2, 2), dtype).at[0, 0].set(curvature.gram([direction])[0, 0].astype(dtype))
        else:
            gram = curvature.gram([direction, previous]).astype(dtype)
        norms = jnp.array([[vdot(direction, direction), vdot(direction, previous)],
                           [vdot(direction, previous), vdot(previous, previous)]], dtype)
        alpha, mu = _coefficients(gram + lam * norms, b, learning_rate, momentum, dtype)
        step = optax.tree.add(optax.tree.scale(alpha, direction), optax.tree.scale(mu, previous))
        # a non-finite step (a singular model, an overflow) comes out as zeros and raises λ
        broken = ~_all_finite(step)
        step = jax.tree.map(lambda u: jnp.where(broken, jnp.zeros_like(u), u), step)
        lam = jnp.where(broken, jnp.clip(lam / omega, min_damping, max_damping), lam).astype(dtype)

        rho = state.rho
        if measures:
            kwargs = accepted(value_fn, extra)
            before = value_fn(params, **kwargs) if value is None else value
            w = jnp.stack([alpha, mu])
            predicted = w @ b + 0.5 * w @ gram @ w  # the model's change without λ, as kfac-jax
            measure_now = (state.count % damping_interval == 0) if not reject else jnp.asarray(True)
            after = jax.lax.cond(measure_now, lambda: jnp.asarray(value_fn(optax.tree.add(params, step), **kwargs),
                                                                  dtype),
                                 lambda: jnp.asarray(jnp.nan, dtype))
            measured_rho = (after - before) / predicted
            # a model that predicts no decrease (fixed coefficients along an ascent) has no ratio to
            # trust: counted as a failure, so that a loss increase never lowers λ through ρ's sign
            measured_rho = jnp.where(jnp.isfinite(after) & (predicted < 0),
                                     jnp.nan_to_num(measured_rho, nan=-jnp.inf), -jnp.inf)
            if adapt_damping:
                adapt_now = (state.count % damping_interval == 0) & ~broken  # a broken step raised λ already
                rho = jnp.where(adapt_now, measured_rho, rho).astype(dtype)
                factor = jnp.where(rho < 0.25, 1 / omega, jnp.where(rho > 0.75, omega, 1.0))
                lam = jnp.where(adapt_now, jnp.clip(lam * factor, min_damping, max_damping), lam).astype(dtype)
            if reject:
                failed = ~(jnp.isfinite(after) & (after < before))
                step = jax.tree.map(lambda u: jnp.where(failed, jnp.zeros_like(u), u), step)
                if not adapt_damping:
                    rho = measured_rho.astype(dtype)
                raise_now = failed & ~broken  # a broken step raised λ once already
                lam = jnp.where(raise_now, jnp.clip(lam / omega, min_damping, max_damping), lam).astype(dtype)
        new_state = KfacState(state.count + 1, lam, sums, weight, inverses, step, alpha, mu, rho)
        return step, new_state

    return optax.GradientTransformationExtraArgs(init, update)


def _all_finite(tree: Any) -> jax.Array:
    leaves = jax.tree.leaves(tree)
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])) if leaves else jnp.asarray(True)


def _coefficients(m: jax.Array, b: jax.Array, learning_rate: float | None, momentum: float | None,
                  dtype: Any) -> tuple[jax.Array, jax.Array]:
    """(α, μ) minimising bᵀw + ½ wᵀ M w over the coefficients not fixed; the momentum's row and
    column vanish on the first step (δ = 0), where μ is 0 and α is the 1-D minimiser."""
    tiny = jnp.finfo(dtype).tiny
    if learning_rate is not None and momentum is not None:
        return jnp.asarray(learning_rate, dtype), jnp.asarray(momentum, dtype)
    if momentum is not None:  # α alone: −(b₀ + μ M₀₁) / M₀₀
        mu = jnp.asarray(momentum, dtype)
        return -(b[0] + mu * m[0, 1]) / jnp.maximum(m[0, 0], tiny), mu
    if learning_rate is not None:  # μ alone
        alpha = jnp.asarray(learning_rate, dtype)
        mu = jnp.where(m[1, 1] > 0, -(b[1] + alpha * m[0, 1]) / jnp.where(m[1, 1] > 0, m[1, 1], 1), 0)
        return alpha, mu.astype(dtype)
    det = m[0, 0] * m[1, 1] - m[0, 1] ** 2
    # δ = 0 (the first step, a rejected one) or Δ ∥ δ: the plane is a line, α alone
    degenerate = det <= 64 * jnp.finfo(dtype).eps * m[0, 0] * m[1, 1]
    safe_det = jnp.where(degenerate, 1, det)
    alpha2 = (-b[0] * m[1, 1] + b[1] * m[0, 1]) / safe_det
    mu2 = (-b[1] * m[0, 0] + b[0] * m[0, 1]) / safe_det
    alpha1 = -b[0] / jnp.maximum(m[0, 0], tiny)
    return jnp.where(degenerate, alpha1, alpha2).astype(dtype), jnp.where(degenerate, 0, mu2).astype(dtype)
