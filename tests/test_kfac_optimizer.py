"""``lbp.kfac`` against dense references: the fixed step is −(F + λI)⁻¹ g with F written with
``jnp.kron`` (one term, Row-stacked rows, a diagonal leaf, two terms as their damped sum), the
adaptive step and momentum minimise the quadratic model with ``G.todense()``, the factors are
kfac-jax's bias-corrected average, λ follows the Levenberg–Marquardt rule from the measured ρ,
and training under one ``jax.jit`` lowers the loss in float32 and float64 for every
``update_every``."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree
from trees import assert_trees_close

import linbackprop as lbp
from linbackprop._optim._kronecker import Diagonal, decompose, dense

close = functools.partial(assert_trees_close, rtol=1e-8, atol=1e-10)  # this file's tolerances


# two Row-stacked tanh layers with biases and a linear head; batch 6
DEPTH, WIDTH, OUT = 2, 3, 2
NET = lbp.Network([lbp.Layer(i, lambda th, u: jnp.tanh(u @ th[0] + th[1]), (i - 1,), (lbp.Row("W", i - 1),
                                                                                       lbp.Row("b", i - 1)))
                   for i in range(1, DEPTH + 1)] + [lbp.Layer("y", lambda th, u: u @ th[0], (DEPTH,), ("H",))],
                  [0], "y")


def problem(seed=0, batch=6, dtype=jnp.float64):
    rng = np.random.default_rng(seed)
    r = lambda *s: jnp.asarray(0.8 * rng.standard_normal(s), dtype)
    params = {"W": r(DEPTH, WIDTH, WIDTH), "b": r(DEPTH, WIDTH), "H": r(WIDTH, OUT)}
    return params, r(batch, WIDTH), r(batch, OUT)


def loss(p, x, y):
    return 0.5 * jnp.mean((NET(p, x) - y) ** 2)


@jax.jit
def quantities(params, x, y):
    value, grad, G = lbp.gauss_newton(loss)(params, x, y)
    return value, grad, G, lbp.kfac_factors(loss)(params, x, y), lbp.diag_ggn(loss)(params, x, y)


@functools.cache
def at_problem(seed=0):
    params, x, y = problem(seed)
    return (params, x, y, *quantities(params, x, y))


def dense_curvature(factors, diagonal, params):
    """F as a dense matrix in ravel_pytree's order (sorted keys): a block per leaf, or per weight
    and its bias ([W_r; b_r] row by row, the bias's entries last) where ``factors`` joins them."""
    sizes = {name: params[name].size for name in sorted(params)}
    start = dict(zip(sizes, np.cumsum([0, *sizes.values()])[:-1]))
    index = {name: start[name] + np.arange(n).reshape(params[name].shape) for name, n in sizes.items()}
    out = np.zeros((sum(sizes.values()),) * 2)
    for name in sorted(params):
        f = factors[name]
        if isinstance(f, lbp.BiasOf):
            continue
        at = index[name]
        biased = [b for b in params if isinstance(factors[b], lbp.BiasOf) and factors[b].weight == f"['{name}']"]
        if biased:  # rows [W_r; b_r]: the weight's entries, then its bias's
            rows = f.left.shape[:-2]
            at = np.concatenate([at.reshape(*rows, -1, f.right.shape[-1]),
                                 index[biased[0]].reshape(*rows, 1, f.right.shape[-1])], axis=-2)
        curvature = Diagonal(diagonal[name]) if f is None else ((f,) if isinstance(f, lbp.Kronecker) else f)
        out[np.ix_(at.ravel(), at.ravel())] = dense(curvature)
    return jnp.asarray(out)


@pytest.mark.users_settings
def test_fixed_step_is_the_exactly_damped_kronecker_solve():
    """learning_rate=1, momentum=0: u = −(F + λI)⁻¹ g, λ added exactly (not factored)."""
    params, _x, _y, _value, grad, _G, factors, diagonal = at_problem()
    lam = 0.05
    opt = lbp.kfac(damping=lam, learning_rate=1.0, momentum=0.0, adapt_damping=False)
    update, state = opt.update(grad, opt.init(params), params, factors=factors, diagonal=diagonal)
    flat, _ = ravel_pytree(grad)
    f = dense_curvature(factors, diagonal, params)
    close(ravel_pytree(update)[0], -jnp.linalg.solve(f + lam * jnp.eye(flat.size), flat), rtol=1e-9)
    assert int(state.count) == 1 and float(state.learning_rate) == 1.0 and float(state.momentum) == 0.0


@pytest.mark.users_settings
def test_the_factored_inverse_is_the_factored_tikhonov_solve_and_scale_by_kfac_s_direction():
    """inverse="factored": u = −((A + π√λ I) ⊗ (Γ + √λ/π I))⁻¹ g per Kronecker block (per row of
    a Row-stacked one, π² the ratio of the factors' mean traces), the diagonal leaves damped
    exactly; the same direction as ``scale_by_kfac``'s first step. The λ of the decomposing step
    is held until the next decomposition."""
    params, _x, _y, _value, grad, _G, factors, diagonal = at_problem()
    lam = 0.05
    opt = lbp.kfac(damping=lam, learning_rate=1.0, momentum=0.0, adapt_damping=False, inverse="factored",
                   update_every=2)
    update, state = opt.update(grad, opt.init(params), params, factors=factors, diagonal=diagonal)

    def damped(f):
        if not isinstance(f, lbp.Kronecker):
            return f
        mean_trace = lambda m: jnp.trace(m, axis1=-2, axis2=-1)[..., None, None] / m.shape[-1]
        pi = jnp.sqrt(mean_trace(f.left) / mean_trace(f.right))
        eye = lambda m: jnp.eye(m.shape[-1])
        return lbp.Kronecker(f.left + pi * np.sqrt(lam) * eye(f.left), f.right + np.sqrt(lam) / pi * eye(f.right))

    is_factor = lambda f: isinstance(f, (lbp.Kronecker, lbp.BiasOf)) or f is None
    f = dense_curvature(jax.tree.map(damped, factors, is_leaf=is_factor), jax.tree.map(lambda d: d + lam, diagonal),
                        params)
    flat = ravel_pytree(grad)[0]
    close(ravel_pytree(update)[0], -jnp.linalg.solve(f, flat), rtol=1e-9)
    tx = lbp.scale_by_kfac(damping=lam)
    direction, _ = tx.update(grad, tx.init(params), params, factors=factors, diagonal=diagonal)
    close(ravel_pytree(update)[0], -ravel_pytree(direction)[0], rtol=1e-10)
    # the next step holds the decomposition made with λ = 0.05, whatever λ is now (every leaf here
    # is in a Kronecker block: the step is unchanged)
    assert all(isinstance(x, (lbp.Kronecker, lbp.BiasOf)) for x in jax.tree.leaves(factors, is_leaf=is_factor))
    holding = state._replace(damping=jnp.asarray(1.0), count=jnp.asarray(3, jnp.int32))  # 3: past the first
    again, _ = opt.update(grad, holding, params, factors=factors, diagonal=diagonal)  # steps, not a 2nd
    close(ravel_pytree(again)[0], ravel_pytree(update)[0], rtol=1e-10)
    with pytest.raises(ValueError, match="inverse"):
        lbp.kfac(inverse="cholesky")


def test_two_terms_are_inverted_as_their_damped_sum():
    """A leaf with two Kronecker terms: u = −(A'⊗B' + C'⊗D')⁻¹ g, the damped factors π-scaled
    with λ/2 each, and that sum bounds F + λI from above."""
    rng = np.random.default_rng(4)
    spd = lambda n: (lambda m: m @ m.T / n)(jnp.asarray(rng.standard_normal((n, n + 2))))
    terms = (lbp.Kronecker(spd(3), spd(2)), lbp.Kronecker(spd(3), 1e-3 * spd(2)))
    g = jnp.asarray(rng.standard_normal((3, 2)))
    lam = 0.2
    opt = lbp.kfac(damping=lam, learning_rate=1.0, momentum=0.0, adapt_damping=False)
    update, _ = opt.update({"W": g}, opt.init({"W": g}), factors={"W": terms})
    damped = []
    for a, b in terms:
        pi = jnp.sqrt((jnp.trace(a) / 3) / (jnp.trace(b) / 2))
        damped.append(jnp.kron(a + pi * jnp.sqrt(lam / 2) * jnp.eye(3), b + jnp.sqrt(lam / 2) / pi * jnp.eye(2)))
    close(update["W"].ravel(), -jnp.linalg.solve(damped[0] + damped[1], g.ravel()), rtol=1e-9)
    exact = sum(jnp.kron(a, b) for a, b in terms) + lam * jnp.eye(6)
    assert float(jnp.linalg.eigvalsh(damped[0] + damped[1] - exact).min()) > -1e-12


def test_three_terms_merge_the_later_ones():
    """More than two terms: the second and later merged as (mean of A) ⊗ (sum of Γ) — exact
    where they share A."""
    rng = np.random.default_rng(5)
    spd = lambda n: (lambda m: m @ m.T / n)(jnp.asarray(rng.standard_normal((n, n + 2))))
    shared = spd(3)
    three = (lbp.Kronecker(spd(3), spd(2)), lbp.Kronecker(shared, spd(2)), lbp.Kronecker(shared, spd(2)))
    two = (three[0], lbp.Kronecker(shared, three[1].right + three[2].right))
    lam = jnp.asarray(0.1)
    for a, b in zip(jax.tree.leaves(decompose(three, lam)), jax.tree.leaves(decompose(two, lam))):
        close(a, b, rtol=1e-10)


@pytest.mark.parametrize("fixed", ["none", "learning_rate", "momentum", "momentum zero"])
def test_coefficients_minimise_the_quadratic_model(fixed):
    """Two steps: the second's (α, μ) minimise gᵀu + ½ uᵀ(G + λI)u over u = αΔ + μδ with the
    dense G (the coefficient a float fixes held, the other minimising); the first step has
    μ = 0 and α = −gᵀΔ / Δᵀ(G + λI)Δ."""
    kwargs = {"none": {}, "learning_rate": {"learning_rate": 0.7}, "momentum": {"momentum": 0.3},
              "momentum zero": {"momentum": 0.0}}[fixed]  # zero: G's products of Δ alone
    params, _x, _y, _value, grad, G, factors, diagonal = at_problem()
    lam = 0.02
    opt = lbp.kfac(damping=lam, adapt_damping=False, **kwargs)
    first, state = opt.update(grad, opt.init(params), params, factors=factors, diagonal=diagonal, curvature=G)
    params2, _x2, _y2, _, grad2, G2, factors2, diagonal2 = at_problem(1)
    second, state2 = opt.update(grad2, state, params2, factors=factors2, diagonal=diagonal2, curvature=G2)
    for g_, G_, u, st, prev in ((grad, G, first, state, None), (grad2, G2, second, state2, first)):
        gf = ravel_pytree(g_)[0]
        c = G_.todense() + lam * jnp.eye(gf.size)
        uf = ravel_pytree(u)[0]
        alpha, mu = float(st.learning_rate), float(st.momentum)
        delta = (uf if prev is None else uf - mu * ravel_pytree(prev)[0]) / alpha  # the preconditioned direction
        if prev is None:
            if fixed == "learning_rate":
                assert alpha == 0.7
            else:
                close(alpha, -(gf @ delta) / (delta @ c @ delta), rtol=1e-9)
            assert mu == kwargs.get("momentum", 0.0)
            continue
        basis = jnp.stack([delta, ravel_pytree(prev)[0]], axis=1)
        m, b = basis.T @ c @ basis, basis.T @ gf
        if fixed == "none":
            close(jnp.array([alpha, mu]), -jnp.linalg.solve(m, b), rtol=1e-8)
        elif fixed == "learning_rate":
            assert alpha == 0.7
            close(mu, -(b[1] + alpha * m[0, 1]) / m[1, 1], rtol=1e-8)
        else:
            assert mu == kwargs["momentum"]
            close(alpha, -(b[0] + mu * m[0, 1]) / m[0, 0], rtol=1e-8)


def test_factors_are_the_bias_corrected_average_and_held_between_decompositions():
    """Step 2's curvature is (decay F₁ + F₂) / (decay + 1); with update_every=3 the first three
    steps decompose (burn-in), then every third, the others hold the last decomposition."""
    decay, lam = 0.6, 0.1
    opt = lbp.kfac(damping=lam, decay=decay, update_every=3, learning_rate=1.0, momentum=0.0, adapt_damping=False)
    params, *_ = at_problem()
    state = opt.init(params)
    seen = []
    for seed in (0, 1, 2, 3):
        p, _x, _y, _value, grad, _G, factors, diagonal = at_problem(seed)
        update, state = opt.update(grad, state, p, factors=factors, diagonal=diagonal)
        seen.append((grad, factors, diagonal, update))
    weights = [decay, 1.0]
    mixed = lambda a, b: (weights[0] * a + weights[1] * b) / sum(weights)
    f2 = jax.tree.map(mixed, seen[0][1], seen[1][1])
    d2 = jax.tree.map(mixed, seen[0][2], seen[1][2])
    gf = ravel_pytree(seen[1][0])[0]
    close(ravel_pytree(seen[1][3])[0],
          -jnp.linalg.solve(dense_curvature(f2, d2, params) + lam * jnp.eye(gf.size), gf), rtol=1e-9)
    counts = []
    state = opt.init(params)
    for step in range(7):
        p, _x, _y, _value, grad, _G, factors, diagonal = at_problem(step % 4)
        before = state.inverses
        _, state = opt.update(grad, state, p, factors=factors, diagonal=diagonal)
        if before is not None:
            kept = all(bool(jnp.array_equal(a, b)) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(
                state.inverses)))
            counts.append(kept)
    # steps with count 1, 2 (burn-in), 3 (3 % 3), 4, 5 (held), 6 (6 % 3)
    assert counts == [False, False, False, True, True, False]


def test_damping_follows_levenberg_marquardt():
    """ρ = (f(θ + u) − f(θ)) / (gᵀu + ½ uᵀGu) from the dense G; λ / ω below 1/4, λ ω above 3/4."""
    params, x, y, value, grad, G, factors, diagonal = at_problem()
    value_fn = lambda p, **_: loss(p, x, y)
    for lam in (1e-4, 1e3):
        opt = lbp.kfac(damping=lam, damping_interval=1, damping_decay=0.5, min_damping=1e-9, max_damping=1e9)
        u, state = opt.update(grad, opt.init(params), params, factors=factors, diagonal=diagonal, curvature=G,
                              value=value, value_fn=value_fn)
        uf, gf = ravel_pytree(u)[0], ravel_pytree(grad)[0]
        rho = (value_fn(optax.apply_updates(params, u)) - value) / (gf @ uf + 0.5 * uf @ G.todense() @ uf)
        close(state.rho, rho, rtol=1e-7)
        factor = 2.0 if rho < 0.25 else (0.5 if rho > 0.75 else 1.0)
        close(state.damping, lam * factor, rtol=1e-12)


def test_rejected_steps_are_zero_and_raise_the_damping():
    params, _x, _y, value, grad, G, factors, diagonal = at_problem()
    # a value_fn that always says the loss went up: every step rejected
    opt = lbp.kfac(damping=1e-2, reject=True, adapt_damping=False, learning_rate=1.0, momentum=0.0)
    u, state = opt.update(grad, opt.init(params), params, factors=factors, diagonal=diagonal, curvature=G,
                          value=value, value_fn=lambda p: value + 1.0)
    assert all(float(jnp.abs(leaf).max()) == 0.0 for leaf in jax.tree.leaves(u))
    assert float(state.damping) > 1e-2


def test_non_finite_steps_leave_the_parameters_and_raise_the_damping():
    """A gradient with an infinity (an overflow), or a loss that is NaN after the step: the update
    is zeros (the parameters stay as they are, never NaN), λ grows; factors that are not finite
    stay out of the average."""
    params, x, y, value, grad, G, factors, diagonal = at_problem()
    value_fn = lambda p, **_: loss(p, x, y)
    opt = lbp.kfac(damping=1e-2, damping_interval=1)
    state = opt.init(params)
    u, state = opt.update(grad, state, params, factors=factors, diagonal=diagonal, curvature=G, value=value,
                          value_fn=value_fn)
    overflowed = jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(jnp.inf), grad)
    u, after = opt.update(overflowed, state, params, factors=factors, diagonal=diagonal, curvature=G, value=value,
                          value_fn=value_fn)
    assert all(float(jnp.abs(leaf).max()) == 0.0 for leaf in jax.tree.leaves(u))
    assert float(after.damping) > float(state.damping)
    rejecting = lbp.kfac(damping=1e-2, reject=True)
    u, after = rejecting.update(grad, rejecting.init(params), params, factors=factors, diagonal=diagonal,
                                curvature=G, value=value, value_fn=lambda p, **_: jnp.nan)
    assert all(float(jnp.abs(leaf).max()) == 0.0 for leaf in jax.tree.leaves(u))
    assert float(after.damping) > 1e-2
    poisoned = jax.tree.map(lambda f: f * jnp.nan if isinstance(f, jax.Array) else f, factors)
    u, after = opt.update(grad, state, params, factors=poisoned, diagonal=diagonal, curvature=G, value=value,
                          value_fn=value_fn)
    assert all(bool(jnp.all(jnp.isfinite(leaf))) for leaf in jax.tree.leaves((u, after.sums, after.inverses)))
    close(after.weight, state.weight)  # the NaN batch left out of the average


def test_the_odd_corners_of_damping_and_non_finite_factors():
    """#63: a non-finite step raises λ once (it raised it three times: the guard, ρ, the
    rejection); after a non-finite first batch every leaf's update is zero (the diagonal leaves got
    g/λ, the Kronecker ones 0); with fixed coefficients along an ascent (predicted increase) a loss
    increase never lowers λ; a decomposition of non-finite averages keeps the held one."""
    params, x, y, value, grad, G, factors, diagonal = at_problem()
    value_fn = lambda p, **_: loss(p, x, y)
    omega = 0.5
    opt = lbp.kfac(damping=1e-2, damping_interval=1, damping_decay=omega, reject=True)
    state = opt.init(params)
    _, state = opt.update(grad, state, params, factors=factors, diagonal=diagonal, curvature=G, value=value,
                          value_fn=value_fn)
    overflowed = jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(jnp.inf), grad)
    _, after = opt.update(overflowed, state, params, factors=factors, diagonal=diagonal, curvature=G, value=value,
                          value_fn=value_fn)
    close(after.damping, state.damping / omega, rtol=1e-12)

    poisoned = jax.tree.map(lambda f: f * jnp.nan if isinstance(f, jax.Array) else f, factors)
    fresh = lbp.kfac(damping=1e-2, adapt_damping=False, learning_rate=1.0, momentum=0.0)
    u, _ = fresh.update(grad, fresh.init(params), params, factors=poisoned, diagonal=diagonal, curvature=G)
    assert all(float(jnp.abs(leaf).max()) == 0.0 for leaf in jax.tree.leaves(u))

    ascent = lbp.kfac(damping=1e-2, learning_rate=-1.0, momentum=0.0, damping_interval=1, damping_decay=omega)
    u, after = ascent.update(grad, ascent.init(params), params, factors=factors, diagonal=diagonal, curvature=G,
                             value=value, value_fn=value_fn)
    assert float(value_fn(optax.apply_updates(params, u))) > float(value)  # the loss went up
    assert float(after.damping) > 1e-2 and float(after.rho) < 0

    held = lbp.kfac(damping=1e-2, update_every=1, adapt_damping=False, learning_rate=1.0, momentum=0.0)
    _, first = held.update(grad, held.init(params), params, factors=factors, diagonal=diagonal, curvature=G)
    # each batch finite, their running sum not (an overflow): the held decompositions stay
    huge = jax.tree.map(lambda f: f / jnp.max(jnp.abs(f)) * 1e308 if isinstance(f, jax.Array) else f, factors)
    huge_diagonal = jax.tree.map(lambda d: d / jnp.max(jnp.abs(d)) * 1e308, diagonal)
    _, second = held.update(grad, first, params, factors=huge, diagonal=huge_diagonal, curvature=G)
    _, third = held.update(grad, second, params, factors=huge, diagonal=huge_diagonal, curvature=G)
    assert not all(bool(jnp.all(jnp.isfinite(leaf))) for leaf in jax.tree.leaves(third.sums))
    assert all(bool(jnp.all(jnp.isfinite(leaf))) for leaf in jax.tree.leaves(third.inverses))
    close(ravel_pytree(third.inverses)[0], ravel_pytree(second.inverses)[0], rtol=0, atol=0)


@pytest.mark.users_settings
@pytest.mark.parametrize("dtype, update_every, inverse", [(jnp.float32, 1, "exact"), (jnp.float32, 5, "exact"),
                                                          (jnp.float64, 1, "exact"), (jnp.float64, 5, "exact"),
                                                          (jnp.float32, 5, "factored")],
                         ids=["float32-1", "float32-5", "float64-1", "float64-5", "float32-5-factored"])
def test_trains_under_one_jit(dtype, update_every, inverse):
    """A jitted step (factors, G, the update inside) lowers the loss from the first steps on, for
    every update_every (no early estimate held into a blow-up), with either inverse."""
    params, x, _ = problem(7, batch=32, dtype=dtype)
    y = NET(problem(8, dtype=dtype)[0], x)  # a teacher of the same shape: the loss can reach 0
    opt = lbp.kfac(damping=1e-3, update_every=update_every, inverse=inverse)

    @jax.jit
    def step(params, state):
        value, grad, G = lbp.gauss_newton(loss)(params, x, y)
        factors, diagonal = lbp.kfac_factors(loss)(params, x, y), lbp.diag_ggn(loss)(params, x, y)
        updates, state = opt.update(grad, state, params, factors=factors, diagonal=diagonal, curvature=G,
                                    value=value, value_fn=lambda p, **_: loss(p, x, y))
        return optax.apply_updates(params, updates), state, value

    state = opt.init(params)
    values = []
    for _ in range(15):
        params, state, value = step(params, state)
        values.append(float(value))
    assert all(np.isfinite(values)) and state.damping.dtype == dtype
    assert values[-1] < 0.05 * values[0], values
    assert max(values[1:]) <= values[0] * (1 + 1e-6), values  # the model's step never overshoots


def test_clear_errors():
    params, _x, _y, _value, grad, G, factors, diagonal = at_problem()
    opt = lbp.kfac()
    with pytest.raises(TypeError, match="kfac_factors"):
        opt.update(grad, opt.init(params), params)
    with pytest.raises(TypeError, match="gauss_newton"):
        opt.update(grad, opt.init(params), params, factors=factors, diagonal=diagonal)
    rejecting = lbp.kfac(adapt_damping=False, learning_rate=1.0, momentum=0.0, reject=True)
    with pytest.raises(TypeError, match="value_fn"):  # no G to take the loss from
        rejecting.update(grad, rejecting.init(params), params, factors=factors, diagonal=diagonal)
    # with G and no value_fn, the loss after the step is G.value_at's (no error)
    opt.update(grad, opt.init(params), params, factors=factors, diagonal=diagonal, curvature=G)
    fixed = lbp.kfac(adapt_damping=False, learning_rate=1.0, momentum=0.0)
    with pytest.raises(ValueError, match=r"\['H'\] has no Kronecker factors"):
        fixed.update(grad, opt.init(params), params, factors={**factors, "H": None})
    with pytest.raises(ValueError, match=r"\['b'\] is the bias of \['W'\] \(leaf 1 of 3\), which has no Kronecker"):
        fixed.update(grad, opt.init(params), params, factors={**factors, "W": None}, diagonal=diagonal)
    with pytest.raises(ValueError, match="do not match"):
        bad = {**factors, "H": lbp.Kronecker(jnp.eye(2), jnp.eye(2))}
        lbp.kfac(adapt_damping=False, learning_rate=1.0, momentum=0.0).update(grad, opt.init(params), params,
                                                                              factors=bad, diagonal=diagonal)
    for kwargs in ({"damping": 0.0}, {"decay": 1.0}, {"update_every": 0}, {"damping_decay": 1.5}):
        with pytest.raises(ValueError, match="kfac"):
            lbp.kfac(**kwargs)


def test_an_rnn_with_a_shared_weight_and_a_norm_trains_with_the_factors_alone():
    """h_t = tanh(LN(h A + x_t B + c) γ), the weights shared by every step: A and B get Kronecker
    pairs (every step a term), c (added after two products) and the norm's γ their GGN diagonal
    from the same kfac_factors pass — no diag_ggn — and lbp.kfac trains it under one jit."""
    T, B, D, W = 5, 16, 3, 6
    norm = lambda z: (z - z.mean(-1, keepdims=True)) / jnp.sqrt(z.var(-1, keepdims=True) + 1e-3)
    cell = lambda th, h, x: jnp.tanh(norm(h @ th[0] + x @ th[1] + th[2]) * th[3])
    net = lbp.Network([lbp.Layer(t, cell, (t - 1, lbp.Row("xs", t - 1)), ("A", "B", "c", "g")) for t in range(1, T + 1)]
                      + [lbp.Layer("y", lambda th, h: h @ th[0], (T,), ("V",))], [0, "xs"], "y")
    rng = np.random.default_rng(8)
    r = lambda *s: jnp.asarray(0.5 * rng.standard_normal(s))
    params = {"A": r(W, W), "B": r(D, W), "c": r(W), "g": 1.0 + r(W), "V": r(W, 2)}
    h0, xs = jnp.zeros((B, W)), r(T, B, D)
    y = jnp.sin(xs.sum(0)[:, :2])
    loss = lambda p: 0.5 * jnp.mean((net(p, h0, xs) - y) ** 2)
    factors = jax.jit(lbp.kfac_factors(loss))(params)
    assert all(isinstance(factors[k], lbp.Kronecker) for k in ("A", "B", "V"))
    diagonal = jax.jit(lbp.diag_ggn(loss))(params)
    for k in ("c", "g"):  # the same pass's diagonal is diag_ggn's
        close(factors[k], diagonal[k])
    opt = lbp.kfac(damping=1e-3)

    @jax.jit
    def step(params, state):
        value, grad, G = lbp.gauss_newton(loss)(params)
        updates, state = opt.update(grad, state, params, factors=lbp.kfac_factors(loss)(params), curvature=G,
                                    value=value, value_fn=lambda p, **_: loss(p))
        return optax.apply_updates(params, updates), state, value

    state, values = opt.init(params), []
    for _ in range(20):
        params, state, value = step(params, state)
        values.append(float(value))
    assert all(np.isfinite(values)) and values[-1] < 0.02 * values[0], values  # 0.33 → 0.0034 measured
