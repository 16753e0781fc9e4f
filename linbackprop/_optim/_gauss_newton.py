"""The damped Gauss–Newton direction (G + λI)⁻¹ g with Levenberg–Marquardt damping, as an optax
transform: by conjugate gradients on G's products, or exactly from its rows (Woodbury, dense).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.flatten_util import ravel_pytree

from .._curvature import GaussNewton
from ._arguments import accepted, params_dtype, shaped_as
from ._damping import DampingBounds, nielsen
from ._probed import count_sketch, first_radius, probed
from ._spectral import directions, spectral
from ._terms import adapted, from_terms
from ._woodbury import woodbury_solve

Solver = Literal["auto", "cg", "woodbury", "dense", "svd"]
Step = Literal["lm", "probe"]


class ScaleByGaussNewtonState(NamedTuple):
    """The state of [`scale_by_gauss_newton`][linbackprop.scale_by_gauss_newton].

    Attributes:
        damping: λ of the next step (NaN before the first where λ₀ comes from G's scale).
        direction: the last direction (the conjugate gradients' warm start).
        count: the steps taken.
        nu: ν, λ's factor at the next step that fails to lower the loss (2, doubled by each
            failure in a row: Nielsen's rule).
        radius: the probed step's trust radius Δ (NaN before its first step, where Δ₀ is the
            length of the direction at λ₀; unused by ``step="lm"``).
        weights: the terms' weights w_t (``update(..., terms=)``), or None (every weight 1).
        key: the probed step's PRNG key for its row sketches (``sketch=``), or None.
    """

    damping: jax.Array
    direction: Any
    count: jax.Array
    nu: jax.Array
    radius: jax.Array
    weights: Any = None
    key: Any = None


def scale_by_gauss_newton(damping: float | None = None, maxiter: int = 50, *, tol: float = 1e-5,
                          solver: Solver = "auto", adapt: bool = True, min_damping: float | None = None,
                          max_damping: float = 1e8, reject: bool = True, warm_start: bool = True,
                          damping_scale: float = 1e-3, step: Step = "lm", probes: int = 24, spread: float = 3.0,
                          target: float = 0.075, momentum: float | None = None,
                          probe_batch: int | None = 8, weights: Any = None,
                          adapt_weights: float | None = None, sketch: int | None = None,
                          seed: int = 0) -> optax.GradientTransformationExtraArgs:
    r"""The damped Gauss–Newton direction d = (G + λI)⁻¹ g, with G from ``update(...,
    curvature=G)`` ([`gauss_newton`][linbackprop.gauss_newton]) or from its rows, ``update(..., rows=K)`` with
    G = KᵀK ([`ggn_factor`][linbackprop.ggn_factor]: the examples' Jacobian rows), and g the incoming updates
    (the gradient).

    Solvers (``solver``):

    - ``"cg"``: conjugate gradients on v ↦ G v + λ v (``jax.scipy.sparse.linalg.cg``, at most
      ``maxiter`` products, relative tolerance ``tol``), started from the last direction
      (``warm_start``: consecutive directions are close, as in Hessian-free optimisation).
    - ``"woodbury"``: exact from R rows K (``rows=``, or [`GaussNewton.factor`][linbackprop.GaussNewton.factor] with
      R the network's output coordinates), Woodbury's identity with an R × R Cholesky solve
      (`woodbury_solve`: in float64 from the Gram KKᵀ with iterative refinement, in float32
      from the thin QR of Kᵀ). Exact energy natural gradient (ENGD) where the residuals are
      fewer than the parameters.
    - ``"dense"``: exact from KᵀK (``rows=``) or ``G.todense()`` (one product per parameter).
    - ``"svd"``: exact to round-off at every λ from the thin SVD of the rows K = U diag(s) Vᵀ
      (`_spectral`): d = V (c / (s² + λ)) + g_⊥/λ, c = Vᵀg — or, given the residuals
      (``update(..., rows=K, residuals=b)``, g = Kᵀb: ``lbp.ggn_factor(loss, rank=1,
      residuals=True)``), c = s ⊙ Uᵀb, which never multiplies by K twice: the error is
      κ(K)·ε, not the κ(K)²·ε of any form built on KᵀK or KKᵀ. Given residuals, every
      rows solver takes this form; what the gradient holds besides Kᵀb (weight decay, an
      earlier transform of an ``optax.chain``) enters as any gradient does, c += Vᵀ(g − Kᵀb).
    - ``"auto"`` (default): ``"woodbury"`` where the rows are fewer than the parameters, else
      ``"dense"`` from rows and ``"cg"`` from the operator (chosen from the shapes at trace time).

    The first λ (``damping=None``, the default) comes from G's scale, as Marquardt's
    $\lambda_0 = \tau \max_i G_{ii}$ with τ = ``damping_scale``: from ``rows=`` the largest diagonal
    entry exactly (the largest column norm² of K); from the operator its largest eigenvalue
    ($\ge \max_i G_{ii}$, the same scale), estimated from below by 5 power iterations from g (5 products with
    G, at the first step only). A float ``damping`` is λ₀ as given.

    Levenberg–Marquardt (``adapt``, where ``update`` is given ``value_fn``, called as
    ``value_fn(params, **extra)`` with the extra arguments it accepts; ``value_fn=G.value_at``
    ([`GaussNewton.value_at`][linbackprop.GaussNewton.value_at]) is the loss G was made from, on
    its batch, with no split and merge of a ``layers=`` model): the gain ratio

        ρ = (f(θ) − f(θ − d)) / (gᵀd − ½ dᵀG d)

    of the actual to the decrease the quadratic model predicts sets the next λ (Nielsen's rule,
    as Madsen, Nielsen and Tingleff's): where the loss decreased, λ·max(1/3, 1 − (2ρ − 1)³) and
    ν = 2; where it did not, λ·ν and ν doubles — λ rises geometrically faster with each failure
    in a row (×2, ×4, ×8, …). λ is always kept within [``min_damping``, ``max_damping``]
    (without a floor λ can fall to 1e-26 and the steps blow up in float64 round-off). With
    ``reject``, a step that does not lower the loss comes out as zeros (the parameters stay; the
    next step is more damped). ``value=`` saves one call of ``value_fn`` at θ. Without
    ``value_fn`` λ stays fixed.

    The probed step (``step="probe"``; needs ``rows=``, ``value_fn`` and ``params``): a trust
    radius Δ carried in the state (the first: the direction's length at λ₀), ``probes`` radii
    $\Delta \cdot \text{spread}^t$, t evenly spaced in [−1, 1], each candidate from one SVD of the
    rows at the λ whose step has that length (the secular equation, solved to round-off), the
    loss at every candidate from ``value_fn`` batched over them (``jax.lax.map`` in batches of
    ``probe_batch``) and with the exact predicted decreases the gain ratios $\rho_j$. The radius
    taken is where the *safe* ratio — $\rho_j$'s running minimum over increasing radius —
    crosses ``target`` (interpolated in log r, that candidate evaluated once more; DSGNAR's rule),
    and it is the next Δ; where every probe is above, the largest, and Δ grows by ``spread``;
    where none, no step (zeros) and Δ shrinks by ``spread``. A step never raises the loss. Its λ
    has no floor beyond round-off by default (``min_damping=None``): the directions are exact at
    any λ. Give it the residuals: from g alone the directions along K's small singular values
    carry g's round-off divided by s², and the steps stall orders of magnitude above the fit's
    round-off (docs/guides/training.md, "Gauss–Newton to machine precision", with the rule's
    ablation from 16 starts).

    The loss's terms (``update(..., terms=fn)``, ``fn(params, **extra)`` returning the residuals
    as a pytree of terms, one leaf a term — a PDE's interior, its boundary): the step is for the
    weighted least squares $L = \sum_t w_t \operatorname{mean}(r_t^2)$, its rows, residuals, value
    and ``value_fn`` made from ``fn`` by the library's own solve (``lbp.ggn_factor(L, rank=1,
    residuals=True)``, ``fn`` calling the network); the incoming updates are replaced by ∇L
    (their values are not read: the weights live in the state, so no gradient computed outside
    can be L's). ``weights`` (one number per term, the terms' tree; None: every weight 1) start
    in the state, and with ``adapt_weights=rate`` move every step by DSGNAR's rule
    $w_t \leftarrow w_t (m / (l_t + 10^{-8}))^{\text{rate}}$, $w \leftarrow w/\operatorname{mean}(w)$,
    $l_t = w_t \operatorname{mean}(r_t^2)$, m their mean. Weights with ``rows=``
    instead raise: those rows are used as given.

    A row sketch (``sketch=rows``) makes each probed step's model that of a fresh random count
    sketch of the rows: the model moves from step to step, and on the 2-64-1 Poisson PINN every
    measured start reached round-off with it, where without it some ended in minima of the fitted
    points' loss at 10⁻¹³–10⁻¹² (docs/guides/training.md, the ablation).

    ``momentum=μ`` (SPRING, Goldshlager, Abrahamsen & Lin): the direction minimises
    ‖Kd − b‖² + λ‖d − μ d_prev‖², i.e. d = μ d_prev + (G + λI)⁻¹(g − μ G d_prev), with d_prev
    the last direction (in the state); for every solver and both steps.

    Chain it with ``optax.scale(-1.0)`` (a step θ − d) or a line search; optax's line searches hand
    every extra argument on to ``value_fn``, so give it a ``curvature=None`` parameter.

    Args:
        damping: λ of the first step (for good without ``adapt``); None: τ · G's scale.
        maxiter: the most conjugate-gradient products per step (``"cg"``).
        tol: the conjugate gradients' relative tolerance.
        solver: ``"cg"``, ``"woodbury"``, ``"dense"``, ``"svd"`` or ``"auto"``.
        adapt: adapt λ by Levenberg–Marquardt where ``value_fn`` is given.
        min_damping: λ's floor; None: 1e-8 for ``step="lm"``, round-off (1e-300) for ``"probe"``.
        max_damping: λ's ceiling.
        reject: zero a step that does not lower the loss.
        warm_start: start the conjugate gradients from the last direction.
        damping_scale: τ of $\lambda_0 = \tau \max_i G_{ii}$ where ``damping`` is None (Marquardt's; 1e-3
            where the start is far from a minimum, 1e-6 near one).
        step: ``"lm"`` (Levenberg–Marquardt, as before) or ``"probe"`` (the probed step).
        probes: how many trust radii the probed step tries at once.
        spread: the probes span radii Δ / ``spread`` … Δ · ``spread`` (> 1), and Δ grows or
            shrinks by it where every probe or none meets the target.
        target: the safe gain ratio at the probed step's radius.
        momentum: SPRING's μ in [0, 1), or None (no momentum).
        probe_batch: the probes' losses are computed this many at a time (``jax.lax.map``'s
            ``batch_size``; None: one at a time).
        weights: the terms' starting weights (``update(..., terms=)``), or None (every weight 1).
        adapt_weights: the weights' adaptation rate in (0, 1] (DSGNAR's 0.05), or None (fixed).
        sketch: the probed step's row sketch: that many rows of a fresh count sketch S of the rows
            and residuals every step (each row into 4 buckets, signs ±½; DSGNAR's 2000), the
            candidates those of min ‖S(Kd − b)‖² + λ‖d‖², their gain ratios of the true loss;
            None: no sketch. Needs the residuals (``residuals=`` or ``terms=``).
        seed: the sketches' PRNG seed (the key lives in the state).

    Returns:
        An ``optax.GradientTransformationExtraArgs`` whose ``update(grad, state, params, *,
            curvature=None, rows=None, residuals=None, value=None, value_fn=None, terms=None,
            **extra)`` returns the direction d (not −d).

    Raises:
        ValueError: an argument out of range, or a solver the given curvature cannot serve.
        TypeError: neither ``curvature=`` nor ``rows=`` given to ``update``.

    Examples:
        >>> import jax, jax.numpy as jnp, optax, linbackprop as lbp
        >>> layer = lbp.Layer("y", lambda th, x: x @ th[0], ("x",), ("W",))
        >>> net = lbp.Network([layer], ["x"], "y")
        >>> x = jnp.array([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
        >>> y = jnp.array([[1.0], [2.0], [0.0]])
        >>> loss = lambda p: 0.5 * jnp.sum((net(p, x) - y) ** 2)
        >>> direction = lbp.scale_by_gauss_newton(damping=1e-8, solver="dense")
        >>> tx = optax.chain(direction, optax.scale(-1.0))
        >>> params = {"W": jnp.zeros((2, 1))}
        >>> value, grad, G = lbp.gauss_newton(loss)(params)
        >>> updates, _ = tx.update(grad, tx.init(params), params, curvature=G)
        >>> fitted = optax.apply_updates(params, updates)["W"]  # least squares: one step
        >>> [round(float(w), 4) for w in fitted.ravel()]
        [0.1111, 0.7778]
    """
    o = _options(damping, maxiter, tol, solver, adapt, min_damping, max_damping, reject, warm_start, damping_scale,
                 step, probes, spread, target, momentum, probe_batch, sketch)
    if sketch is not None and (step != "probe" or not isinstance(sketch, int) or sketch < 1):
        raise ValueError(f"scale_by_gauss_newton(sketch={sketch!r}): a row sketch serves step='probe', with "
                         "a positive number of rows (DSGNAR's: 2000).")
    if adapt_weights is not None and (weights is None or not 0 < adapt_weights <= 1):
        raise ValueError(f"scale_by_gauss_newton(adapt_weights={adapt_weights!r}): the adaptation's rate is in "
                         "(0, 1] (DSGNAR's: 0.05) and needs weights= to start from, one per term of "
                         "update(..., terms=fn): e.g. weights={'pde': 1e-2, 'bc': 1.0}.")

    def init(params: Any) -> ScaleByGaussNewtonState:
        zeros = optax.tree.zeros_like(params)
        dtype = params_dtype(params)
        first = jnp.nan if damping is None else damping
        ws = None if weights is None else jax.tree.map(lambda w: jnp.asarray(w, dtype), weights)
        key = None if sketch is None else jax.random.key(seed)
        return ScaleByGaussNewtonState(jnp.asarray(first, dtype), zeros, jnp.zeros((), jnp.int32),
                                       jnp.asarray(2, dtype), jnp.asarray(jnp.nan, dtype), ws, key)

    def update(updates: Any, state: ScaleByGaussNewtonState, params: Any = None, *,
               curvature: GaussNewton | None = None, rows: Any = None, residuals: Any = None, value: Any = None,
               value_fn: Callable | None = None, terms: Callable | None = None,
               **extra: Any) -> tuple[Any, ScaleByGaussNewtonState]:
        made = None
        if terms is not None:
            if rows is not None or curvature is not None or residuals is not None:
                raise ValueError("scale_by_gauss_newton: terms= makes the rows, residuals and loss itself; "
                                 "give terms= alone, or rows=/residuals=/curvature= without it.")
            made = from_terms(functools.partial(terms, **accepted(terms, extra)), state.weights, params)
            rows, residuals, value, value_fn = made.rows, made.residuals, made.value, made.value_fn
            updates = shaped_as(made.gradient, updates)
        elif state.weights is not None:
            raise ValueError("scale_by_gauss_newton(weights=...): the weights apply to the terms' residuals "
                             "(update(..., terms=fn), fn(params) -> {term: residuals}); rows= and residuals= "
                             "are used as given, with no weights: drop weights= or pass terms=.")
        if rows is None and not isinstance(curvature, GaussNewton):
            raise TypeError("scale_by_gauss_newton needs the Gauss–Newton matrix: "
                            "value, grad, G = lbp.gauss_newton(loss)(params, *batch); "
                            "tx.update(grad, state, params, curvature=G), or its rows: rows=lbp.ggn_factor(loss)(...)"
                            + ("" if curvature is None else f" (got curvature of type {type(curvature).__name__})."))
        matrix = _Curvature(curvature, rows, updates)
        if residuals is not None and (rows is None or jnp.shape(residuals) != (matrix.rows_count,)):
            raise ValueError(f"scale_by_gauss_newton: residuals= needs rows= and one residual per row "
                             f"({matrix.rows_count}), got shape {jnp.shape(residuals)}: "
                             "rows, residuals = lbp.ggn_factor(loss, rank=1, residuals=True)(params, *batch).")
        lam = state.damping
        if damping is None:  # λ₀ = τ · G's scale, measured at the first step whose λ is not finite (a NaN row)
            first = lambda: o.bounds.clip(damping_scale * matrix.scale(updates)).astype(lam.dtype)
            lam = jax.lax.cond(~jnp.isfinite(lam), first, lambda: lam)
        take = _probed_step if step == "probe" else _levenberg_marquardt_step
        direction, new = take(o, matrix, updates, state, lam, params, residuals, value, value_fn, extra)
        if adapt_weights is not None:
            new = new._replace(weights=adapted(state.weights, made.mean_squares, adapt_weights))
        return direction, new

    return optax.GradientTransformationExtraArgs(init, update)


class _Options(NamedTuple):
    """`scale_by_gauss_newton`'s settings, checked."""

    maxiter: int
    tol: float
    solver: Solver
    adapt: bool
    bounds: DampingBounds
    reject: bool
    warm_start: bool
    probes: int
    spread: float
    target: float
    momentum: float | None
    probe_batch: int | None
    sketch: int | None


def _options(damping: float | None, maxiter: int, tol: float, solver: Solver, adapt: bool,
             min_damping: float | None, max_damping: float, reject: bool, warm_start: bool, damping_scale: float,
             step: Step, probes: int, spread: float, target: float, momentum: float | None,
             probe_batch: int | None, sketch: int | None) -> _Options:
    if solver not in ("auto", "cg", "woodbury", "dense", "svd"):
        raise ValueError(f"scale_by_gauss_newton(solver={solver!r}): use 'auto', 'cg', 'woodbury', 'dense' or 'svd'.")
    if step not in ("lm", "probe"):
        raise ValueError(f"scale_by_gauss_newton(step={step!r}): use 'lm' (Levenberg–Marquardt) or 'probe'.")
    if step == "probe" and (not isinstance(probes, int) or probes < 2 or not spread > 1 or not 0 <= target < 1):
        raise ValueError(f"scale_by_gauss_newton(step='probe'): needs probes ≥ 2 (got {probes!r}), spread > 1 "
                         f"(got {spread!r}) and 0 ≤ target < 1 (got {target!r}).")
    if momentum is not None and not 0 <= momentum < 1:
        raise ValueError(f"scale_by_gauss_newton(momentum={momentum!r}): SPRING's μ is in [0, 1), or None.")
    if min_damping is None:  # the probed step's directions are exact at any λ: no floor beyond round-off
        min_damping = 1e-300 if step == "probe" else 1e-8
    if not 0 < min_damping <= max_damping or (damping is not None and not min_damping <= damping <= max_damping):
        raise ValueError(f"scale_by_gauss_newton: needs 0 < min_damping ({min_damping}) ≤ damping ({damping}) "
                         f"≤ max_damping ({max_damping}).")
    if not damping_scale > 0:
        raise ValueError(f"scale_by_gauss_newton(damping_scale={damping_scale}): τ of λ₀ = τ · max diag G must "
                         "be positive.")
    return _Options(maxiter, tol, solver, adapt, DampingBounds(min_damping, max_damping), reject, warm_start,
                    probes, spread, target, momentum, probe_batch, sketch)


def _levenberg_marquardt_step(o: _Options, matrix: _Curvature, g: Any, state: ScaleByGaussNewtonState,
                              lam: jax.Array, params: Any, residuals: Any, value: Any, value_fn: Callable | None,
                              extra: dict) -> tuple[Any, ScaleByGaussNewtonState]:
    """The direction (G + λI)⁻¹ g by the chosen solver, then λ by Nielsen's rule where the loss
    after the step is measured (`_damping.nielsen`)."""
    prior = None if o.momentum is None else optax.tree.scale(o.momentum, shaped_as(state.direction, g))
    start = shaped_as(state.direction, g) if o.warm_start else None
    direction = matrix.solve(_chosen(o.solver, matrix), g, lam, start, o.maxiter, o.tol, residuals, prior)
    if value_fn is None or not o.adapt:
        return direction, state._replace(damping=lam, direction=direction, count=state.count + 1)
    if params is None:
        raise ValueError("scale_by_gauss_newton with value_fn needs params: tx.update(grad, state, params, ...).")
    kwargs = accepted(value_fn, extra)
    before = value_fn(params, **kwargs) if value is None else value
    after = value_fn(optax.tree.sub(params, direction), **kwargs)
    predicted = optax.tree.vdot(g, direction) - 0.5 * matrix.quadratic(direction)
    lam, nu, decreased = nielsen(lam, state.nu, before, after, predicted, o.bounds)
    if o.reject:
        direction = jax.tree.map(lambda d: jnp.where(decreased, d, jnp.zeros_like(d)), direction)
    return direction, state._replace(damping=lam, direction=direction, count=state.count + 1, nu=nu)


def _probed_step(o: _Options, matrix: _Curvature, g: Any, state: ScaleByGaussNewtonState, lam: jax.Array,
                 params: Any, residuals: Any, value: Any, value_fn: Callable | None,
                 extra: dict) -> tuple[Any, ScaleByGaussNewtonState]:
    """The probed step (`_probed.probed`): candidates from one SVD of the rows at radii around the
    carried one, their losses measured, the radius where the safe gain ratio meets the target."""
    if matrix.flat is None or value_fn is None or params is None:
        raise ValueError("scale_by_gauss_newton(step='probe') needs the rows, value_fn and params: "
                         "tx.update(grad, state, params, rows=K, residuals=b, value_fn=lambda p: loss(p, *batch)) "
                         "with K, b = lbp.ggn_factor(loss, rank=1, residuals=True)(params, *batch).")
    g_flat, unravel = ravel_pytree(g)
    prior = None if o.momentum is None else o.momentum * ravel_pytree(shaped_as(state.direction, g))[0]
    kwargs = accepted(value_fn, extra)
    before = value_fn(params, **kwargs) if value is None else value
    value_of = lambda d: value_fn(optax.tree.sub(params, unravel(d)), **kwargs)
    k, key = matrix.flat, state.key
    if o.sketch is not None:
        if residuals is None:
            raise ValueError("scale_by_gauss_newton(sketch=...) sketches the residuals with the rows: give "
                             "residuals= (lbp.ggn_factor(loss, rank=1, residuals=True)) or terms=.")
        key, fresh = jax.random.split(key)
        k, sketched = count_sketch(fresh, k, residuals, o.sketch)
        # what g holds besides Kᵀb stays as it is; Kᵀb's part becomes the sketch's (SK)ᵀ(Sb)
        g_flat = g_flat - matrix.flat.T @ residuals + k.T @ sketched
        residuals = sketched
    sp = spectral(k, g_flat, residuals)
    radius = jnp.where(jnp.isfinite(state.radius), state.radius, first_radius(sp, lam, prior))
    # the candidates' losses by lax.map in batches of probe_batch: a vmap over all of them ran
    # the PINN's lifted network 3–4× slower on the CPU (batched products of batched weights)
    taken = probed(sp, radius, before, value_of, o.probes, o.spread, o.target, o.bounds.min_damping,
                   o.bounds.max_damping, prior, o.probe_batch)
    direction = unravel(taken.direction)
    # Δ no shorter than a step that can still move θ in floating point (ε‖θ‖): converged, it
    # rests there instead of underflowing to 0, from where growing by `spread` could never return
    least = jnp.finfo(g_flat.dtype).eps * jnp.maximum(jnp.linalg.norm(ravel_pytree(params)[0]), 1.0)
    return direction, state._replace(damping=taken.damping, direction=direction, count=state.count + 1,
                                     radius=jnp.maximum(taken.radius, least), key=key)


class _Curvature:
    """G given as the operator (``curvature=``, products ``G.mv``) or as rows K with G = KᵀK
    (``rows=``, flattened to [R, P] once)."""

    def __init__(self, G: GaussNewton | None, rows: Any, like: Any):
        self.G = G
        self.flat = None if rows is None else _flat_rows(rows)
        self.size = ravel_pytree(like)[0].size
        if self.flat is not None and self.flat.shape[1] != self.size:
            raise ValueError(f"scale_by_gauss_newton: rows= has {self.flat.shape[1]} entries per row, the gradient "
                             f"{self.size}; pass rows=lbp.ggn_factor(loss)(params, *batch).")
        self.rows_count = self.G.outputs if self.flat is None else self.flat.shape[0]

    def mv(self, v: Any) -> Any:
        if self.flat is None:  # G gives the gradient's type (nnx Variables); v may be pure arrays
            return shaped_as(self.G.mv(v), v)
        flat, unravel = ravel_pytree(v)
        return unravel(self.flat.T @ (self.flat @ flat))

    def scale(self, g: Any, iterations: int = 5) -> jax.Array:
        """G's scale for λ₀: max_i G_ii from the rows; from the operator the Rayleigh quotient
        after ``iterations`` power iterations started at g (G's largest eigenvalue, from below)."""
        if self.flat is not None:
            return jnp.max(jnp.sum(self.flat ** 2, axis=0))
        flat, unravel = ravel_pytree(g)
        tiny = jnp.finfo(flat.dtype).tiny
        unit = lambda v: v / jnp.maximum(jnp.linalg.norm(v), tiny)
        step = lambda _, v: unit(ravel_pytree(self.mv(unravel(v)))[0])
        v = jax.lax.fori_loop(0, iterations - 1, step, unit(flat))
        return jnp.maximum(jnp.vdot(v, ravel_pytree(self.mv(unravel(v)))[0]), 0)

    def quadratic(self, v: Any) -> jax.Array:
        """vᵀ G v."""
        if self.flat is None:
            return optax.tree.vdot(v, self.G.mv(v))
        return jnp.sum((self.flat @ ravel_pytree(v)[0]) ** 2)

    def solve(self, method: str, g: Any, lam: jax.Array, start: Any, maxiter: int, tol: float,
              residuals: jax.Array | None = None, prior: Any = None) -> Any:
        """(G + λI)⁻¹ g by ``method``; with a ``prior`` p (SPRING's momentum), the minimiser of
        ‖Kd − b‖² + λ‖d − p‖²: p + (G + λI)⁻¹(g − G p)."""
        g_flat, unravel = ravel_pytree(g)
        if method == "svd" or residuals is not None:
            k = self.flat if self.flat is not None else _flat_rows(self.G.factor())
            p = None if prior is None else ravel_pytree(prior)[0]
            return unravel(directions(spectral(k, g_flat, residuals), lam[None], p)[0][0])
        if prior is not None:
            return optax.tree.add(prior, self.solve(method, optax.tree.sub(g, shaped_as(self.mv(prior), g)), lam,
                                                    start, maxiter, tol))
        if method == "cg":
            damped = lambda v: optax.tree.add_scale(self.mv(v), lam, v)
            return jax.scipy.sparse.linalg.cg(damped, g, x0=start, maxiter=maxiter, tol=tol)[0]
        if method == "woodbury":
            k = self.flat if self.flat is not None else _flat_rows(self.G.factor())
            return unravel(woodbury_solve(k, g_flat, lam))
        dense = self.G.todense() if self.flat is None else self.flat.T @ self.flat
        matrix = dense + lam * jnp.eye(g_flat.size, dtype=g_flat.dtype)
        return unravel(jax.scipy.linalg.cho_solve(jax.scipy.linalg.cho_factor(matrix), g_flat))


def _flat_rows(rows: Any) -> jax.Array:
    """Rows stacked on a leading axis of a parameter-shaped pytree, as an [R, P] matrix."""
    return jax.vmap(lambda row: ravel_pytree(row)[0])(rows)


def _chosen(solver: Solver, matrix: _Curvature) -> str:
    """"auto": Woodbury where the rows (G's rank bound) are fewer than the parameters; else CG on
    the operator, or the dense P × P solve from rows."""
    if solver != "auto":
        return solver
    if matrix.rows_count < matrix.size:
        return "woodbury"
    return "cg" if matrix.flat is None else "dense"
