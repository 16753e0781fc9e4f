"""The optax transforms on the curvature against dense references: the Gauss–Newton direction
equals (G + λI)⁻¹ g from ``G.todense()`` by every solver (CG, Woodbury, dense), K-FAC's
direction equals the damped Kronecker solve written with ``jnp.kron``, Levenberg–Marquardt keeps
λ within its bounds and never raises the loss, and both chain with optax's line searches."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree
from trees import assert_bias_of, assert_trees_close

import linbackprop as lbp

close = functools.partial(assert_trees_close, rtol=1e-8, atol=1e-10)  # this file's tolerances


# a tanh network with a skip connection and a weight shared by two layers; batch 3, 2 outputs
dense = lambda th, u: jnp.tanh(u @ th[0] + th[1])
NET = lbp.Network([lbp.Layer("h1", dense, ("x",), ("W1", "b1")),
                   lbp.Layer("h2", dense, ("h1",), ("W2", "b2")),
                   lbp.Layer("h3", dense, ("h2",), ("W2", "b2")),
                   lbp.Layer("y", lambda th, u, s: u @ th[0] + s @ th[1], ("h3", "h1"), ("H", "S"))], ["x"], "y")


def problem(batch=3, seed=0):
    rng = np.random.default_rng(seed)
    r = lambda *s: jnp.asarray(0.6 * rng.standard_normal(s))
    params = {"W1": r(2, 4), "b1": r(4), "W2": r(4, 4), "b2": r(4), "H": r(4, 2), "S": r(4, 2)}
    x, y = r(batch, 2), r(batch, 2)
    return params, x, y


def squared(p, x, y):
    return 0.5 * jnp.sum((NET(p, x) - y) ** 2)


def xent(p, x, y):
    labels = (y[:, 0] > 0).astype(jnp.int32)
    return -jnp.sum(jnp.take_along_axis(jax.nn.log_softmax(NET(p, x)), labels[:, None], axis=-1))


@functools.cache
def gauss_newton_at(loss):
    """(value, grad, G) at problem(), computed once per loss."""
    return jax.jit(lbp.gauss_newton(loss))(*problem())


@jax.jit
def kfac_quantities(params, x, y):
    """The gradient, K-FAC factors and GGN diagonal of xent, compiled once."""
    return lbp.grad_by_solve(xent)(params, x, y), lbp.kfac_factors(xent)(params, x, y), lbp.diag_ggn(xent)(params, x, y)


@jax.jit
def dense_direction(G, grad, lam):
    flat, unravel = ravel_pytree(grad)
    return unravel(jnp.linalg.solve(G.todense() + lam * jnp.eye(flat.size), flat))


@pytest.mark.users_settings
@pytest.mark.parametrize("loss", [squared, xent], ids=["squared", "cross-entropy"])
@pytest.mark.parametrize("solver", ["cg", "woodbury", "dense"])  # "auto": the rows' test
def test_direction_is_the_damped_solve(loss, solver):
    params = problem()[0]
    lam = 0.3
    _, grad, G = gauss_newton_at(loss)
    assert (G.outputs, G.size) == (6, 48)
    tx = lbp.scale_by_gauss_newton(damping=lam, maxiter=200, tol=1e-14, solver=solver)
    direction, state = jax.jit(lambda g, s, G: tx.update(g, s, params, curvature=G))(grad, tx.init(params), G)
    close(ravel_pytree(direction)[0], ravel_pytree(dense_direction(G, grad, lam))[0], rtol=1e-7)
    assert float(state.damping) == lam  # fixed without value_fn


def test_factor_squares_to_the_matrix():
    _, _, G = gauss_newton_at(xent)
    rows = jax.vmap(lambda r: ravel_pytree(r)[0])(G.factor())
    close(rows.T @ rows, G.todense(), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("loss", [squared, xent], ids=["squared", "cross-entropy"])
def test_rows_of_every_example_square_to_the_matrix(loss):
    params, x, y = problem()
    _, grad, G = gauss_newton_at(loss)
    rows = jax.jit(lbp.ggn_factor(loss))(params, x, y)
    assert rows["W1"].shape == (3 * 2, 2, 4)  # 2 output coordinates per example, 3 examples
    flat = jax.vmap(lambda r: ravel_pytree(r)[0])(rows)
    close(flat.T @ flat, jax.jit(lambda G: G.todense())(G), rtol=1e-9, atol=1e-12)
    for solver in ("auto", "woodbury", "dense", "cg"):  # 6 rows < 48 parameters: auto is Woodbury
        tx = lbp.scale_by_gauss_newton(damping=0.3, solver=solver, maxiter=100, tol=1e-14)
        solve = jax.jit(lambda grad, rows, tx=tx: tx.update(grad, tx.init(params), params, rows=rows)[0])
        direction = solve(grad, rows)
        close(ravel_pytree(direction)[0], ravel_pytree(dense_direction(G, grad, 0.3))[0], rtol=1e-7)


def test_rank_one_rows_are_the_residual_jacobian():
    """½ Σ_b r_b² with one residual per example: rank=1 keeps it exact (the residuals' Jacobian rows)."""
    params, x, y = problem(batch=5)
    loss = lambda p, x, y: 0.5 * jnp.sum((NET(p, x)[:, 0] - y[:, 0]) ** 2)
    rows = jax.vmap(lambda r: ravel_pytree(r)[0])(lbp.ggn_factor(loss, rank=1)(params, x, y))
    jac = jax.jit(jax.jacfwd(lambda flat: NET(ravel_pytree(params)[1](flat), x)[:, 0]))(ravel_pytree(params)[0])
    close(jnp.abs(rows), jnp.abs(jac), rtol=1e-9, atol=1e-12)  # each row up to eigh's sign


def _ill_conditioned_rows(dtype=jnp.float64, rows=12, size=40, span=8):
    """K [rows, size] with singular values from 1 down to 10^-span, and its SVD."""
    rng = np.random.default_rng(3)
    u, _ = np.linalg.qr(rng.standard_normal((rows, rows)))
    v, _ = np.linalg.qr(rng.standard_normal((size, rows)))
    sigma = np.logspace(0, -span, rows)
    return jnp.asarray((u * sigma) @ v.T, dtype), sigma, v


@pytest.mark.parametrize("lam", [1e-2, 1e-8, 1e-13])
def test_woodbury_solve_is_exact_where_woodburys_formula_cancels(lam):
    """float64: the Gram form with iterative refinement against the SVD's componentwise formula
    V diag(1/(σ² + λ)) Vᵀg + (g − VVᵀg)/λ, where λ ≪ ‖KKᵀ‖ makes Woodbury's own subtraction
    lose ε‖KKᵀ‖/λ; the QR form agrees."""
    from linbackprop._optim._woodbury import _woodbury_qr, woodbury_solve

    k, sigma, v = _ill_conditioned_rows()
    g = jnp.asarray(np.random.default_rng(4).standard_normal(k.shape[1]))
    inside = v.T @ np.asarray(g)
    exact = v @ (inside / (sigma ** 2 + lam)) + (np.asarray(g) - v @ inside) / lam
    got = jax.jit(woodbury_solve)(k, g, lam)
    close(got, exact, rtol=1e-9, atol=1e-9 * np.abs(exact).max())
    close(jax.jit(_woodbury_qr)(k, g, lam), exact, rtol=1e-6, atol=1e-6 * np.abs(exact).max())


def test_woodbury_solve_takes_the_qr_where_there_is_no_cholesky_factor_and_in_float32():
    """λ below KKᵀ's round-off with K of rank 6 < 12 rows: no Cholesky factor of λI + KKᵀ, so the QR
    form (finite, the same numbers); float32 always the QR form."""
    from linbackprop._optim._woodbury import _woodbury_qr, woodbury_solve

    k, _, _ = _ill_conditioned_rows()
    k = k.at[6:].set(k[:6])  # repeated rows: KKᵀ singular
    g = jnp.asarray(np.random.default_rng(5).standard_normal(k.shape[1]))
    lam = 1e-300
    got = jax.jit(woodbury_solve)(k, g, lam)
    assert np.all(np.isfinite(np.asarray(got)))
    close(got, jax.jit(_woodbury_qr)(k, g, lam), rtol=0, atol=0)
    k32, g32 = k.astype(jnp.float32), g.astype(jnp.float32)
    close(jax.jit(woodbury_solve)(k32, g32, 1e-3), jax.jit(_woodbury_qr)(k32, g32, 1e-3), rtol=0, atol=0)


def test_woodbury_on_a_model_as_it_is():
    """A plain JAX model with ``layers=``: the rows come back on the model's own parameters."""
    @lbp.layer
    def block(p, u):
        return jnp.tanh(u @ p["w"] + p["b"])

    def model(p, x):
        return block(p["second"], block(p["first"], x)) @ p["head"]

    params, x, y = problem(batch=2)
    mine = {"first": {"w": params["W1"], "b": params["b1"]}, "second": {"w": params["W2"], "b": params["b2"]},
            "head": params["H"]}
    loss = lambda p, x, y: 0.5 * jnp.sum((model(p, x) - y) ** 2)
    _, grad, G = lbp.gauss_newton(loss, layers=[block])(mine, x, y)
    assert G.outputs < G.size
    tx = lbp.scale_by_gauss_newton(damping=1e-2, solver="auto")
    direction, _ = tx.update(grad, tx.init(mine), mine, curvature=G)
    assert jax.tree.structure(direction) == jax.tree.structure(mine)
    close(ravel_pytree(direction)[0], ravel_pytree(dense_direction(G, grad, 1e-2))[0], rtol=1e-7)


def test_levenberg_marquardt_on_the_network_never_raises_the_loss():
    params, x, y = problem(batch=6)
    tx = optax.chain(lbp.scale_by_gauss_newton(damping=1e-2, maxiter=20), optax.scale(-1.0))

    @jax.jit
    def step(p, s):
        value, grad, G = lbp.gauss_newton(squared)(p, x, y)
        updates, s = tx.update(grad, s, p, curvature=G, value=value, value_fn=lambda q: squared(q, x, y))
        return optax.apply_updates(p, updates), s, value

    state, losses = tx.init(params), []
    for _ in range(12):
        params, state, value = step(params, state)
        losses.append(float(value))
    assert all(b <= a for a, b in itertools.pairwise(losses))  # rejected steps keep the parameters
    assert losses[-1] < 0.1 * losses[0]


def test_damping_stays_within_its_floor_and_ceiling():
    """On a linear least-squares model the quadratic model is exact (ρ = 1): λ falls by 3 each
    step to its floor. A value_fn that reports every step as worse: λ doubles to its ceiling and
    every direction comes out as zeros."""
    net = lbp.Network([lbp.Layer("y", lambda th, u: u @ th[0], ("x",), ("W",))], ["x"], "y")
    x, y = jnp.asarray(np.random.default_rng(0).standard_normal((8, 3))), jnp.ones((8, 2))
    params = {"W": jnp.zeros((3, 2))}
    loss = lambda p: 0.5 * jnp.sum((net(p, x) - y) ** 2)
    tx = lbp.scale_by_gauss_newton(damping=1.0, min_damping=1e-2, max_damping=8.0, solver="dense")
    value, grad, G = lbp.gauss_newton(loss)(params)
    state, floor, ceiling = tx.init(params), [], []
    for _ in range(6):
        _, state = tx.update(grad, state, params, curvature=G, value=value, value_fn=loss)
        floor.append(float(state.damping))
    close(floor, [1 / 3, 1 / 9, 1 / 27, 1 / 81, 1e-2, 1e-2], rtol=1e-9)
    tx = lbp.scale_by_gauss_newton(damping=1.0, min_damping=1e-2, max_damping=100.0, solver="dense")
    state = tx.init(params)
    for _ in range(4):
        direction, state = tx.update(grad, state, params, curvature=G, value=value, value_fn=lambda q: value + 1.0)
        ceiling.append(float(state.damping))
        assert all(float(jnp.abs(d).max()) == 0.0 for d in jax.tree.leaves(direction))
    assert ceiling == [2.0, 8.0, 64.0, 100.0]  # Nielsen: ×ν with ν = 2, 4, 8, … doubling per failure
    # a step that lowers the loss again: λ by the gain ratio's rule, ν back to 2
    _, state = tx.update(grad, state, params, curvature=G, value=value, value_fn=loss)
    assert float(state.damping) < 100.0 and float(state.nu) == 2.0
    _, state = tx.update(grad, state, params, curvature=G, value=value, value_fn=lambda q: value + 1.0)
    assert float(state.nu) == 4.0


@pytest.mark.parametrize("given", ["rows", "operator"])
def test_first_damping_is_marquardts_scale_of_g(given):
    """damping=None: λ₀ = τ · max_i G_ii, exactly from the rows; from the operator G's largest
    eigenvalue by power iteration (between max_i G_ii and λ_max(G))."""
    params, x, y = problem(batch=6)
    _, grad, G = jax.jit(lbp.gauss_newton(squared))(params, x, y)
    dense = G.todense()
    tx = lbp.scale_by_gauss_newton(damping_scale=1e-3, solver="dense", min_damping=1e-12)
    kwargs = {"rows": lbp.ggn_factor(squared)(params, x, y)} if given == "rows" else {"curvature": G}
    direction, state = tx.update(grad, tx.init(params), params, **kwargs)
    lam = float(state.damping)
    if given == "rows":
        close(lam, 1e-3 * float(jnp.max(jnp.diag(dense))), rtol=1e-10)
    else:
        largest = float(jnp.linalg.eigvalsh(dense)[-1])
        assert 1e-3 * float(jnp.max(jnp.diag(dense))) <= lam <= 1e-3 * largest * (1 + 1e-9)
    close(ravel_pytree(direction)[0], jnp.linalg.solve(dense + lam * jnp.eye(dense.shape[0]), ravel_pytree(grad)[0]),
          rtol=1e-7)
    _, later = tx.update(grad, state, params, **kwargs)
    assert float(later.damping) == lam  # measured at the first step only (no value_fn: λ held)


@pytest.mark.parametrize("search", ["backtracking", "zoom"])
def test_chains_with_optax_line_searches(search):
    params, x, y = problem(batch=6)
    line = (optax.scale_by_backtracking_linesearch(max_backtracking_steps=20) if search == "backtracking"
            else optax.scale_by_zoom_linesearch(max_linesearch_steps=10))
    tx = optax.chain(lbp.scale_by_gauss_newton(damping=1e-2, adapt=False), optax.scale(-1.0), line)
    value_fn = lambda p, curvature=None: squared(p, x, y)  # the line search hands curvature on

    @jax.jit
    def step(p, s):
        value, grad, G = lbp.gauss_newton(squared)(p, x, y)
        updates, s = tx.update(grad, s, p, curvature=G, value=value, grad=grad, value_fn=value_fn)
        return optax.apply_updates(p, updates), s

    losses, state = [float(squared(params, x, y))], tx.init(params)
    for _ in range(5):
        params, state = step(params, state)
        losses.append(float(squared(params, x, y)))
    assert all(b < a for a, b in itertools.pairwise(losses)) and losses[-1] < 0.25 * losses[0]


def test_missing_curvature_names_the_fix():
    params = problem()[0]
    tx = lbp.scale_by_gauss_newton()
    with pytest.raises(TypeError, match="curvature=G"):
        tx.update(params, tx.init(params), params)
    with pytest.raises(ValueError, match="solver"):
        lbp.scale_by_gauss_newton(solver="qr")


# -- K-FAC --------------------------------------------------------------------------------------
def kfac_reference(factor, g, lam):
    """(A + π√λ I)⁻¹ ⊗ (Γ + √λ/π I)⁻¹ on vec(g), written with jnp.kron."""
    a, c = factor.left, factor.right
    pi = jnp.sqrt((jnp.trace(a) / a.shape[0]) / (jnp.trace(c) / c.shape[0]))
    damped = jnp.kron(a + pi * jnp.sqrt(lam) * jnp.eye(a.shape[0]), c + jnp.sqrt(lam) / pi * jnp.eye(c.shape[0]))
    return jnp.linalg.solve(damped, g.ravel()).reshape(g.shape)


def test_kfac_direction_is_the_damped_kronecker_solve_and_averages():
    params = problem()[0]
    lam, decay = 1e-2, 0.8
    tx = lbp.scale_by_kfac(damping=lam, decay=decay, update_every=2)
    state = tx.init(params)
    curv = []
    for seed in range(3):  # three batches: the factors averaged, inverses on steps 0 and 2
        _, x, y = problem(seed=seed)
        grad, factors, diagonal = kfac_quantities(params, x, y)
        factors = {**factors, "S": None}  # S preconditioned by its GGN diagonal instead
        direction, state = tx.update(grad, state, params, factors=factors, diagonal=diagonal)
        curv.append((factors, diagonal))
        if seed == 0:
            first = (factors, diagonal)
    assert all(isinstance(curv[0][0][k], lbp.Kronecker) for k in ("W1", "W2", "H"))
    assert_bias_of(curv[0][0], "b1", "['W1']", "left")  # [W1; b1]: one block
    average = lambda pick: decay * (decay * pick(first) + (1 - decay) * pick(curv[1])) + (1 - decay) * pick(curv[2])
    for k, b in (("W1", "b1"), ("W2", "b2"), ("H", None)):
        left, right = (average(lambda c, k=k, i=i: c[0][k][i]) for i in (0, 1))
        joint = grad[k] if b is None else jnp.concatenate([grad[k], grad[b][None]])
        expected = kfac_reference(lbp.Kronecker(left, right), joint, lam)
        close(direction[k], expected if b is None else expected[:-1], rtol=1e-7)
        if b is not None:
            close(direction[b], expected[-1], rtol=1e-7)
    close(direction["S"], grad["S"] / (average(lambda c: c[1]["S"]) + lam), rtol=1e-9)

    # step 1 (update_every=2) holds step 0's inverses
    tx1 = lbp.scale_by_kfac(damping=lam, decay=decay, update_every=2)
    s = tx1.update(grad, tx1.init(params), params, factors=first[0], diagonal=first[1])[1]
    direction1, _ = tx1.update(grad, s, params, factors=curv[1][0], diagonal=curv[1][1])
    joint = jnp.concatenate([grad["W2"], grad["b2"][None]])
    close(direction1["W2"], kfac_reference(first[0]["W2"], joint, lam)[:-1], rtol=1e-7)


def test_kfac_on_row_stacked_recurrent_weights_under_jit():
    """An RNN: one recurrent weight read by every step (Row("xs", t)), factors summed over time."""
    steps, width = 4, 3
    cell = lambda th, h, x: jnp.tanh(h @ th[0] + x @ th[1])
    layers = [lbp.Layer(("h", t), cell, (("h", t - 1) if t else "h0", lbp.Row("xs", t)), ("U", "V"))
              for t in range(steps)]
    net = lbp.Network(layers + [lbp.Layer("y", lambda th, h: h @ th[0], (("h", steps - 1),), ("O",))],
                      ["h0", "xs"], "y")
    rng = np.random.default_rng(1)
    params = {"U": jnp.asarray(rng.standard_normal((width, width))) / 2,
              "V": jnp.asarray(rng.standard_normal((2, width))), "O": jnp.asarray(rng.standard_normal((width, 2)))}
    h0, xs, y = jnp.zeros((5, width)), jnp.asarray(rng.standard_normal((steps, 5, 2))), jnp.ones((5, 2))
    loss = lambda p: 0.5 * jnp.sum((net(p, h0, xs) - y) ** 2)
    tx = lbp.scale_by_kfac(damping=1e-3)

    @jax.jit
    def direction(p):
        grad, factors = lbp.grad_by_solve(loss)(p), lbp.kfac_factors(loss)(p)
        return tx.update(grad, tx.init(p), p, factors=factors)[0], factors, grad

    out, factors, grad = direction(params)
    for k in ("U", "V", "O"):
        close(out[k], kfac_reference(factors[k], grad[k], 1e-3), rtol=1e-7)


def test_kfac_without_a_diagonal_names_the_leaf():
    params, x, y = problem()
    grad, factors, _ = kfac_quantities(params, x, y)
    tx = lbp.scale_by_kfac()
    with pytest.raises(ValueError, match=r"\['S'\].*diagonal=lbp.diag_ggn"):
        tx.update(grad, tx.init(params), params, factors={**factors, "S": None})
    with pytest.raises(ValueError, match=r"\['b1'\] is the bias of \['W1'\]"):
        tx.update(grad, tx.init(params), params, factors={**factors, "W1": None}, diagonal=grad)
    # a part of the factors: the marker's weight index is the whole result's, so it is refused, not
    # paired with whatever leaf sits at that index here
    part = {k: grad[k] for k in ("W2", "b2")}
    with pytest.raises(ValueError, match=r"\['b2'\] is the bias of \['W2'\] \(leaf 3 of 6\).*whole"):
        tx.update(part, tx.init(part), part, factors={k: factors[k] for k in part})
