"""Gauss–Newton to machine precision: directions from one SVD of the rows against an independent
least-squares reference at every λ, the residuals' form keeping κ(K) rather than κ(K)², the probed
step against the same candidates computed one by one, SPRING's momentum against its dense
formula, the Woodbury solve within round-off where λ is below the Gram's, and λ repaired after a
non-finite first step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import scipy.optimize
from jax.flatten_util import ravel_pytree

import linbackprop as lbp

EPS = np.finfo(np.float64).eps


def ill_conditioned(rows, cols, top=1e3, bottom=1.0, seed=0):
    """K [rows, cols] with singular values spaced from ``top`` to ``bottom``, its SVD known."""
    rng = np.random.default_rng(seed)
    m = min(rows, cols)
    u, _ = np.linalg.qr(rng.standard_normal((rows, m)))
    v, _ = np.linalg.qr(rng.standard_normal((cols, m)))
    return (u * np.logspace(np.log10(top), np.log10(bottom), m)) @ v.T


def damped_least_squares(k, b, lam, prior=None):
    """argmin ‖K d − b‖² + λ‖d − p‖², by numpy's least squares on the stacked system
    [K; √λ I] x = [b − K p; 0] (condition ‖K‖/√λ, never KᵀK): the independent reference."""
    p = np.zeros(k.shape[1]) if prior is None else prior
    stacked = np.vstack([k, np.sqrt(lam) * np.eye(k.shape[1])])
    rhs = np.concatenate([b - k @ p, np.zeros(k.shape[1])])
    return np.linalg.lstsq(stacked, rhs, rcond=None)[0] + p


def direction(k, g, lam, residuals=None, momentum=None, previous=None):
    """scale_by_gauss_newton(solver='svd') from rows, one step at fixed λ."""
    tx = lbp.scale_by_gauss_newton(damping=lam, solver="svd", adapt=False, min_damping=1e-300, momentum=momentum)
    state = tx.init(jnp.zeros(k.shape[1]))
    if previous is not None:
        state = state._replace(direction=jnp.asarray(previous))
    out, _ = jax.jit(lambda g, k, b: tx.update(g, state, rows=k, residuals=b))(
        jnp.asarray(g), jnp.asarray(k), None if residuals is None else jnp.asarray(residuals))
    return np.asarray(out)


@pytest.mark.users_settings
@pytest.mark.parametrize("shape", [(12, 40), (40, 12)], ids=["rows < params", "rows > params"])
def test_svd_direction_is_the_damped_least_squares_at_every_lambda(shape):
    """From the residuals, within round-off of the stacked least-squares reference for λ from
    1e-16‖KKᵀ‖ to ‖KKᵀ‖ (‖KKᵀ‖ = 1e6, κ(K) = 1e3)."""
    k = ill_conditioned(*shape)
    b = np.random.default_rng(1).standard_normal(shape[0])
    g = k.T @ b
    norm = np.linalg.norm(k, 2) ** 2
    for scale in (1e-16, 1e-12, 1e-8, 1e-4, 1.0):
        lam = scale * norm
        ref = damped_least_squares(k, b, lam)
        got = direction(k, g, lam, residuals=b)
        assert np.linalg.norm(got - ref) <= 1e3 * EPS * np.linalg.norm(ref), scale  # κ(K)·ε
        if shape[0] > shape[1] or scale >= 1e-8:  # from g alone: exact wherever g has no round-off to amplify
            assert np.linalg.norm(direction(k, g, lam) - ref) <= 1e-6 * np.linalg.norm(ref), scale


def test_residuals_keep_the_digits_the_gradient_loses():
    """κ(K) = 1e8 and λ = 1e-18: from g = Kᵀb the direction carries g's round-off divided by
    σ² (κ²ε ≈ 1); from b it stays at κε."""
    k = ill_conditioned(60, 20, top=1.0, bottom=1e-8)
    b = k @ np.random.default_rng(2).standard_normal(20)  # a consistent system: the minimum is 0
    lam = 1e-18
    ref = damped_least_squares(k, b, lam)
    from_b = direction(k, k.T @ b, lam, residuals=b)
    from_g = direction(k, k.T @ b, lam)
    assert np.linalg.norm(from_b - ref) <= 1e-6 * np.linalg.norm(ref)
    assert np.linalg.norm(from_g - ref) > 10 * np.linalg.norm(from_b - ref)


def test_spring_momentum_is_the_damped_least_squares_around_the_last_step():
    """SPRING: argmin ‖Kd − b‖² + λ‖d − μ d_prev‖², by every rows solver and from the operator (CG)."""
    k = ill_conditioned(8, 30, top=10.0, bottom=0.1, seed=3)
    rng = np.random.default_rng(4)
    b, previous = rng.standard_normal(8), rng.standard_normal(30)
    mu, lam = 0.7, 1e-3
    ref = damped_least_squares(k, b, lam, prior=mu * previous)
    np.testing.assert_allclose(direction(k, k.T @ b, lam, residuals=b, momentum=mu, previous=previous), ref,
                               rtol=1e-9, atol=1e-12)
    for solver in ("woodbury", "dense"):
        tx = lbp.scale_by_gauss_newton(damping=lam, solver=solver, adapt=False, momentum=mu, min_damping=1e-12)
        state = tx.init(jnp.zeros(30))._replace(direction=jnp.asarray(previous))
        got, new = tx.update(jnp.asarray(k.T @ b), state, rows=jnp.asarray(k))
        np.testing.assert_allclose(got, ref, rtol=1e-8, atol=1e-10)
        np.testing.assert_allclose(new.direction, got)


def test_woodbury_solve_is_within_round_off_below_the_grams():
    """#63: λ = 1e-10 and 1e-13 with ‖KKᵀ‖ = 1e6 (12 rows, 40 parameters, σ from 1e3 to 1): the
    Gram form's refinements amplified its error (22–97 % off); within 10× of the floor that g's
    own round-off and κ(K)ε set, against the SVD reference."""
    from linbackprop._optim._woodbury import woodbury_solve

    k = ill_conditioned(12, 40, seed=5)
    _, s, vt = np.linalg.svd(k, full_matrices=False)
    rng = np.random.default_rng(6)
    solve = jax.jit(woodbury_solve)
    for g in (rng.standard_normal(40), k.T @ rng.standard_normal(12)):
        for lam in (1e-13, 1e-10, 1e-8, 1e-2):
            def reference(g):
                c = vt @ g
                return vt.T @ (c / (s ** 2 + lam)) + (g - vt.T @ c) / lam

            ref = reference(g)
            # the floor: the answer's spread over 16 relative perturbations of g by ε (one draw
            # put it within 10× on one LAPACK build and 12.4× on another, numpy 2.5 / JAX 0.12)
            spread = np.mean([np.linalg.norm(reference(g * (1 + EPS * rng.standard_normal(40))) - ref)
                              for _ in range(16)])
            floor = max(spread / np.linalg.norm(ref), EPS * s[0] / s[-1])
            err = np.linalg.norm(np.asarray(solve(jnp.asarray(k), jnp.asarray(g), lam)) - ref) / np.linalg.norm(ref)
            assert err <= 10 * floor, (lam, err, floor)


def test_ggn_factor_residuals_square_to_the_loss_and_give_the_gradient():
    """ggn_factor(residuals=True) of a two-term least squares: ½‖b‖² is the loss, Kᵀb the gradient."""
    net = lbp.Network([lbp.Layer("h", lambda th, x: jnp.tanh(x @ th[0] + th[1]), ("x",), ("W", "c")),
                       lbp.Layer("u", lambda th, h: h @ th[0], ("h",), ("V",))], ["x"], "u")
    rng = np.random.default_rng(7)
    params = {"W": jnp.asarray(rng.standard_normal((2, 5))), "c": jnp.asarray(rng.standard_normal(5)),
              "V": jnp.asarray(rng.standard_normal((5, 1)))}
    inner, edge = jnp.asarray(rng.standard_normal((6, 2))), jnp.asarray(rng.standard_normal((3, 2)))
    loss = lambda p, a, e: 0.5 * jnp.mean((net(p, a)[:, 0] - 1.0) ** 2) + 2.0 * jnp.mean(net(p, e) ** 2)
    rows, b = jax.jit(lbp.ggn_factor(loss, rank=1, residuals=True))(params, inner, edge)
    k = jax.vmap(lambda r: ravel_pytree(r)[0])(rows)
    assert b.shape == (9,)
    np.testing.assert_allclose(0.5 * jnp.sum(b ** 2), loss(params, inner, edge), rtol=1e-12)
    np.testing.assert_allclose(k.T @ b, ravel_pytree(jax.grad(loss)(params, inner, edge))[0], rtol=1e-10, atol=1e-13)


def _fit_problem():
    """A small nonlinear least squares: a tanh network fitted to a smooth target."""
    net = lbp.Network([lbp.Layer("h", lambda th, x: jnp.tanh(x @ th[0] + th[1]), ("x",), ("W", "c")),
                       lbp.Layer("u", lambda th, h: h @ th[0] + th[1], ("h",), ("V", "d"))], ["x"], "u")
    rng = np.random.default_rng(8)
    params = {"W": jnp.asarray(rng.standard_normal((1, 6))), "c": jnp.asarray(rng.standard_normal(6)),
              "V": jnp.asarray(rng.standard_normal((6, 1)) / 3), "d": jnp.zeros(1)}
    x = jnp.linspace(-1, 1, 25)[:, None]
    loss = lambda p: 0.5 * jnp.mean((net(p, x)[:, 0] - jnp.sin(2 * x[:, 0])) ** 2)
    return params, loss


def damping_for_radius(k, b, radius):
    """λ with ‖d(λ)‖ = radius for the stacked reference's d, by scipy's Brent on log λ (the floor
    1e-300 where even the undamped step is shorter)."""
    length = lambda log_lam: np.linalg.norm(damped_least_squares(k, b, np.exp(log_lam))) - radius
    if length(np.log(1e-300)) <= 0:
        return 1e-300
    return float(np.exp(scipy.optimize.brentq(length, np.log(1e-300), np.log(1e8), xtol=1e-14, rtol=1e-15)))


@pytest.mark.users_settings
def test_probed_step_is_the_rule_applied_to_the_candidates_one_by_one():
    """step='probe': radii Δ·spread^t (t over [−1, 1]) around the carried Δ (the first: the
    direction's length at the given λ₀), each candidate's λ from its radius by Brent's method on
    the stacked least-squares reference, each loss by its own call, the safe gain ratio (the
    running minimum over increasing radius) and its crossing of the target interpolated in
    log r, that candidate evaluated, the rule applied by hand; then the steps reach the fit's
    round-off."""
    params, loss = _fit_problem()
    probes, spread, target = 9, 2.0, 0.3
    tx = lbp.scale_by_gauss_newton(step="probe", probes=probes, spread=spread, target=target, damping=1e-2)
    flat, unravel = ravel_pytree(params)

    @jax.jit
    def step(params, state):
        value, grad = lbp.value_and_grad_by_solve(loss)(params)
        rows, b = lbp.ggn_factor(loss, rank=1, residuals=True)(params)
        return tx.update(grad, state, params, rows=rows, residuals=b, value=value, value_fn=loss)

    state = tx.init(params)
    seen = set()
    for _ in range(6):
        rows, b = lbp.ggn_factor(loss, rank=1, residuals=True)(params)
        k, b = np.asarray(jax.vmap(lambda r: ravel_pytree(r)[0])(rows)), np.asarray(b)
        before = float(loss(params))
        value_of = lambda d: float(loss(unravel(flat - d)))
        radius = float(state.radius) if np.isfinite(state.radius) else np.linalg.norm(damped_least_squares(k, b, 1e-2))
        radii = radius * spread ** np.linspace(-1, 1, probes)
        ds = [damped_least_squares(k, b, damping_for_radius(k, b, r)) for r in radii]
        rho = []
        for d in ds:
            predicted = (k.T @ b) @ d - 0.5 * np.sum((k @ d) ** 2)
            rho.append(np.clip((before - value_of(d)) / predicted, -1, 1) if predicted > 0 else -1.0)
        safe = np.minimum.accumulate(rho)
        above = int(np.sum(safe >= target))
        if above == probes:
            chosen, next_radius = ds[-1], radii[-1]
        elif above == 0:
            chosen, next_radius = np.zeros_like(flat), radii[0]
        else:
            share = (safe[above - 1] - target) / (safe[above - 1] - safe[above])
            crossing = radii[above - 1] * (radii[above] / radii[above - 1]) ** share
            d = damped_least_squares(k, b, damping_for_radius(k, b, crossing))
            lower = value_of(d) < before
            chosen, next_radius = (d, crossing) if lower else (ds[above - 1], radii[above - 1])
        seen.add("all" if above == probes else "none" if above == 0 else "between")
        updates, state = step(params, state)
        np.testing.assert_allclose(ravel_pytree(updates)[0], chosen, rtol=1e-7, atol=1e-12)
        np.testing.assert_allclose(state.radius, next_radius, rtol=1e-7)
        params = optax.apply_updates(params, optax.tree.scale(-1.0, updates))  # θ − d
        flat, unravel = ravel_pytree(params)
    assert "between" in seen  # the interpolated crossing was checked, not only the ends
    first = float(loss(params))
    for _ in range(40):
        updates, state = step(params, state)
        params = optax.apply_updates(params, optax.tree.scale(-1.0, updates))
    assert float(loss(params)) < 1e-6 * first


def test_probed_step_chains_with_optax_and_takes_no_step_where_none_is_accepted():
    """optax.chain(scale_by_gauss_newton(step='probe'), scale(-1)) under jit; a loss that every
    candidate raises (value_fn lies: its value at θ is below all) gives zeros and a trust radius
    shorter by ``spread``."""
    params, loss = _fit_problem()
    tx = optax.chain(lbp.scale_by_gauss_newton(step="probe", probes=8), optax.scale(-1.0))
    rows, b = lbp.ggn_factor(loss, rank=1, residuals=True)(params)
    grad = lbp.grad_by_solve(loss)(params)
    state = tx.init(params)
    updates, state = jax.jit(lambda s: tx.update(grad, s, params, rows=rows, residuals=b, value_fn=loss))(state)
    assert float(loss(optax.apply_updates(params, updates))) < float(loss(params))
    inner = lbp.scale_by_gauss_newton(step="probe", probes=8, damping=1.0)
    s0 = inner.init(params)
    zero, s1 = inner.update(grad, s0, params, rows=rows, residuals=b, value=-1.0, value_fn=loss)
    assert all(np.all(np.asarray(z) == 0) for z in jax.tree.leaves(zero))
    k = np.asarray(jax.vmap(lambda r: ravel_pytree(r)[0])(rows))
    first = np.linalg.norm(damped_least_squares(k, np.asarray(b), 1.0))
    np.testing.assert_allclose(s1.radius, first / 3.0, rtol=1e-10)
    with pytest.raises(ValueError, match="needs the rows, value_fn and params"):
        inner.update(grad, s0, params, rows=rows)
    with pytest.raises(ValueError, match="spread > 1"):
        lbp.scale_by_gauss_newton(step="probe", spread=1.0)


def test_a_non_finite_first_step_does_not_stop_gauss_newton():
    """#63: damping=None measures λ₀ from the first step's rows; a NaN there left λ NaN for good
    (every later direction zeros). λ₀ is measured again at the next step, and the steps go on."""
    params, loss = _fit_problem()
    tx = lbp.scale_by_gauss_newton(solver="dense")
    rows = lbp.ggn_factor(loss, rank=1)(params)
    grad = lbp.grad_by_solve(loss)(params)
    state = tx.init(params)
    bad = jax.tree.map(lambda r: r.at[0].set(jnp.nan), rows)
    _, state = tx.update(grad, state, params, rows=bad, value_fn=loss)
    for _ in range(3):
        updates, state = tx.update(grad, state, params, rows=rows, value_fn=loss)
    assert np.isfinite(float(state.damping))
    assert any(np.any(np.asarray(u) != 0) for u in jax.tree.leaves(updates))


@pytest.mark.parametrize("step", ["probe", "lm"])
def test_given_residuals_the_rest_of_the_gradient_is_used(step):
    """rows=K, residuals=b of the least-squares part, and a gradient that holds more: weight decay
    in the loss (½·5‖θ‖² in the value and the gradient, not in the rows), or added by an earlier
    transform of an optax.chain. Both reach the regularised optimum (its gradient's norm below
    1e-7; the direction from b alone stalled at the unregularised one, where it is 21)."""
    params, fit = _fit_problem()
    decay = 5.0
    total = lambda p: fit(p) + 0.5 * decay * sum(jnp.sum(x ** 2) for x in jax.tree.leaves(p))
    # the rows miss the decay's curvature 5I: the probed step's model is then short of the loss
    # by far, where a safe gain ratio of 0.075 (the default, for paths to round-off) is a step too long
    options = dict(step=step, damping=1e-2) | (dict(target=0.5) if step == "probe" else {})
    in_the_loss = lbp.scale_by_gauss_newton(**options)
    chained = optax.chain(optax.add_decayed_weights(decay), lbp.scale_by_gauss_newton(**options))

    def run(tx, gradient_of):
        @jax.jit
        def update(params, state):
            grad = jax.grad(gradient_of)(params)
            rows, b = lbp.ggn_factor(fit, rank=1, residuals=True)(params)
            return tx.update(grad, state, params, rows=rows, residuals=b, value=total(params), value_fn=total)

        p, state = params, tx.init(params)
        for _ in range(40):
            updates, state = update(p, state)
            p = optax.apply_updates(p, optax.tree.scale(-1.0, updates))
        return float(jnp.linalg.norm(ravel_pytree(jax.grad(total)(p))[0]))

    assert run(in_the_loss, total) < 1e-7
    assert run(chained, fit) < 1e-7


def _terms_problem():
    """Two terms of one network, as a PDE's interior and boundary: a fit on 25 points and a
    condition at 3 others, of different sizes (their means weigh them apart)."""
    net = lbp.Network([lbp.Layer("h", lambda th, x: jnp.tanh(x @ th[0] + th[1]), ("x",), ("W", "c")),
                       lbp.Layer("u", lambda th, h: h @ th[0] + th[1], ("h",), ("V", "d"))], ["x"], "u")
    rng = np.random.default_rng(3)
    params = {"W": jnp.asarray(rng.standard_normal((1, 6))), "c": jnp.asarray(rng.standard_normal(6)),
              "V": jnp.asarray(rng.standard_normal((6, 1)) / 3), "d": jnp.zeros(1)}
    x = jnp.concatenate([jnp.linspace(-1, 1, 25), jnp.array([-1.5, 0.3, 1.5])])[:, None]

    def terms(p):
        u = net(p, x)[:, 0]
        return {"fit": u[:25] - jnp.sin(2 * x[:25, 0]), "edge": u[25:] - 0.5}

    plain = lambda p: {"fit": jnp.tanh(x[:25] @ p["W"] + p["c"]) @ p["V"][:, 0] + p["d"][0] - jnp.sin(2 * x[:25, 0]),
                       "edge": jnp.tanh(x[25:] @ p["W"] + p["c"]) @ p["V"][:, 0] + p["d"][0] - 0.5}
    return params, terms, plain


def test_weighted_terms_give_the_rows_of_the_weighted_residuals():
    """terms= (a dict of residuals, weights in the state): the direction equals the same
    transform's from rows and residuals made by jax.jacrev of the weighted residuals √(2w_t/n_t)·r_t
    of plain JAX code (L = Σ w_t mean(r_t²) = ½‖r_w‖²), for both steps; the value_fn it makes is L."""
    params, terms, plain = _terms_problem()
    weights = {"fit": 0.3, "edge": 2.0}
    flat, unravel = ravel_pytree(params)
    scaled = lambda q: jnp.concatenate([jnp.sqrt(2 * weights[t] / r.size) * r for t, r in sorted(plain(q).items())])
    r_w = scaled(params)
    j_w = jax.jacrev(lambda f: scaled(unravel(f)))(flat)
    loss = lambda q: sum(weights[t] * jnp.mean(r ** 2) for t, r in plain(q).items())
    np.testing.assert_allclose(loss(params), 0.5 * jnp.sum(r_w ** 2), rtol=1e-13)
    for step in ("lm", "probe"):
        options = dict(step=step, damping=1e-3, solver="svd")
        with_terms = lbp.scale_by_gauss_newton(weights=weights, **options)
        got, s1 = jax.jit(lambda s: with_terms.update(params, s, params, terms=terms))(with_terms.init(params))
        reference = lbp.scale_by_gauss_newton(**options)
        rows = jax.vmap(unravel)(j_w)
        want, _ = reference.update(unravel(j_w.T @ r_w), reference.init(params), params, rows=rows,
                                    residuals=r_w, value_fn=loss)
        np.testing.assert_allclose(ravel_pytree(got)[0], ravel_pytree(want)[0], rtol=1e-9, atol=1e-13)
        assert jax.tree.map(float, s1.weights) == weights  # fixed: adapt_weights not given


def test_adapted_weights_follow_dsgnars_rule():
    """adapt_weights=rate: after a step w_t·(m/(l_t + 1e-8))^rate normalised to mean 1, with
    l_t = w_t·mean(r_t²) at θ (before the step) and m their mean — by hand, three steps."""
    params, terms, plain = _terms_problem()
    rate, weights = 0.05, {"fit": 1e-2, "edge": 1.0}
    tx = lbp.scale_by_gauss_newton(step="probe", weights=weights, adapt_weights=rate)
    update = jax.jit(lambda p, s: tx.update(p, s, p, terms=terms))
    state, w = tx.init(params), dict(weights)
    for _ in range(3):
        losses = {t: w[t] * float(jnp.mean(r ** 2)) for t, r in plain(params).items()}
        m = np.mean(list(losses.values()))
        raised = {t: w[t] * (m / (losses[t] + 1e-8)) ** rate for t in w}
        w = {t: v / np.mean(list(raised.values())) for t, v in raised.items()}
        updates, state = update(params, state)
        np.testing.assert_allclose([state.weights[t] for t in sorted(w)], [w[t] for t in sorted(w)], rtol=1e-10)
        params = optax.apply_updates(params, optax.tree.scale(-1.0, updates))


def test_terms_and_weights_refuse_what_they_would_ignore():
    """Weights with rows= (those rows are used as given), terms= beside rows=, a terms tree the
    weights do not match, and adaptation without weights: each an error naming the fix."""
    params, terms, _ = _terms_problem()
    tx = lbp.scale_by_gauss_newton(step="probe", weights={"fit": 1.0, "edge": 1.0})
    loss = lambda p: sum(jnp.mean(r ** 2) for r in terms(p).values())
    rows, b = lbp.ggn_factor(loss, rank=1, residuals=True)(params)
    with pytest.raises(ValueError, match="used as given, with no weights"):
        tx.update(params, tx.init(params), params, rows=rows, residuals=b, value_fn=loss)
    with pytest.raises(ValueError, match="give terms= alone"):
        tx.update(params, tx.init(params), params, terms=terms, rows=rows)
    odd = lbp.scale_by_gauss_newton(weights={"fit": 1.0})
    with pytest.raises(ValueError, match="one number per term"):
        odd.update(params, odd.init(params), params, terms=terms)
    with pytest.raises(ValueError, match="needs weights="):
        lbp.scale_by_gauss_newton(adapt_weights=0.05)


def test_a_row_sketch_moves_the_model_never_raises_the_loss_and_reaches_the_fit():
    """sketch=rows: a fresh count sketch every step (its key in the state, from ``seed``): the same
    seed gives the same steps and another seed others; no step raises the loss, and the fit
    reaches round-off of its first loss. Without residuals, or with step='lm', it raises."""
    params, loss = _fit_problem()

    def run(seed, steps=150):
        tx = lbp.scale_by_gauss_newton(step="probe", sketch=64, seed=seed)

        @jax.jit
        def update(p, state):
            rows, b = lbp.ggn_factor(loss, rank=1, residuals=True)(p)
            return tx.update(jax.grad(loss)(p), state, p, rows=rows, residuals=b, value_fn=loss)

        p, state, values = params, tx.init(params), [float(loss(params))]
        for _ in range(steps):
            updates, state = update(p, state)
            p = optax.apply_updates(p, optax.tree.scale(-1.0, updates))
            values.append(float(loss(p)))
        return np.array(values), ravel_pytree(p)[0]

    values, last = run(0)
    _, same = run(0)
    _, other = run(1)
    np.testing.assert_array_equal(last, same)
    assert not np.allclose(last, other)
    assert np.all(np.diff(values) <= 0)
    assert values[-1] < 1e-6 * values[0]
    tx = lbp.scale_by_gauss_newton(step="probe", sketch=64)
    rows = lbp.ggn_factor(loss, rank=1)(params)
    with pytest.raises(ValueError, match="give residuals="):
        tx.update(jax.grad(loss)(params), tx.init(params), params, rows=rows, value_fn=loss)
    with pytest.raises(ValueError, match="serves step='probe'"):
        lbp.scale_by_gauss_newton(sketch=64)
