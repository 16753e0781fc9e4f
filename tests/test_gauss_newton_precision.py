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
    from linbackprop._optim._gauss_newton import woodbury_solve

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


@pytest.mark.users_settings
def test_probed_step_is_the_rule_applied_to_the_candidates_one_by_one():
    """step='probe': the candidates λ_c·10^t (t over [−spread, spread]), each direction by the
    stacked least-squares reference, each loss by its own call, the rule (the smallest λ that lowers
    the loss with ρ ≥ target) applied by hand; then a few steps reach the fit's round-off."""
    params, loss = _fit_problem()
    probes, spread, target = 9, 2.0, 0.1
    tx = lbp.scale_by_gauss_newton(step="probe", probes=probes, spread=spread, target=target, damping=1e-2)
    flat, unravel = ravel_pytree(params)

    @jax.jit
    def step(params, state):
        value, grad = lbp.value_and_grad_by_solve(loss)(params)
        rows, b = lbp.ggn_factor(loss, rank=1, residuals=True)(params)
        return tx.update(grad, state, params, rows=rows, residuals=b, value=value, value_fn=loss)

    state = tx.init(params)
    for _ in range(3):
        rows, b = lbp.ggn_factor(loss, rank=1, residuals=True)(params)
        k, b = np.asarray(jax.vmap(lambda r: ravel_pytree(r)[0])(rows)), np.asarray(b)
        before = float(loss(params))
        lams = float(state.damping) * 10.0 ** np.linspace(-spread, spread, probes)
        chosen = None
        for lam in lams:  # ascending: the first accepted is the longest step
            d = damped_least_squares(k, b, lam)
            after = float(loss(unravel(flat - d)))
            predicted = (k.T @ b) @ d - 0.5 * np.sum((k @ d) ** 2)
            if after < before and (before - after) / predicted >= target:
                chosen = (d, lam)
                break
        updates, state = step(params, state)
        got = ravel_pytree(updates)[0]
        assert chosen is not None
        np.testing.assert_allclose(got, chosen[0], rtol=1e-7, atol=1e-12)
        np.testing.assert_allclose(state.damping, chosen[1], rtol=1e-12)
        params = optax.apply_updates(params, optax.tree.scale(-1.0, updates))  # θ − d
        flat, unravel = ravel_pytree(params)
    first = float(loss(params))
    for _ in range(40):
        updates, state = step(params, state)
        params = optax.apply_updates(params, optax.tree.scale(-1.0, updates))
    assert float(loss(params)) < 1e-6 * first


def test_probed_step_chains_with_optax_and_takes_no_step_where_none_is_accepted():
    """optax.chain(scale_by_gauss_newton(step='probe'), scale(-1)) under jit; a loss that every
    candidate raises (value_fn lies: its value at θ is below all) gives zeros and a larger λ."""
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
    assert float(s1.damping) > 1.0
    with pytest.raises(ValueError, match="needs the rows, value_fn and params"):
        inner.update(grad, s0, params, rows=rows)


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
    in_the_loss = lbp.scale_by_gauss_newton(step=step, damping=1e-2)
    chained = optax.chain(optax.add_decayed_weights(decay), lbp.scale_by_gauss_newton(step=step, damping=1e-2))

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
