"""lbp.influence against dense references on small models: the training and query gradients from
``jax.vmap(jax.grad)`` of the same model called one example at a time, G = (1/N) Σ J_nᵀ H_n J_n
from ``jax.jacobian`` and ``jax.hessian``, the damped solves dense. K-FAC's blocks are built
from ``lbp.kfac_factors`` (checked against its own references in test_kfac.py) as dense
Kronecker products; EK-FAC's from their eigenbases and the dense G."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

import linbackprop as lbp


def cross_entropy(z, y):
    return -jnp.take_along_axis(jax.nn.log_softmax(z), y[:, None], axis=1)[:, 0]


def dense(th, x):
    return jnp.tanh(x @ th[0] + th[1])


def head(th, x):
    return x @ th[0] + th[1]


def mlp_case(n=13, q=4):
    k = jax.random.split(jax.random.key(0), 6)
    net = lbp.Network([lbp.Layer("h", dense, ("x",), ("W1", "b1")), lbp.Layer("y", head, ("h",), ("W2", "b2"))],
                      ["x"], "y")
    params = {"W1": jax.random.normal(k[0], (4, 5)), "b1": 0.1 * jax.random.normal(k[4], (5,)),
              "W2": jax.random.normal(k[1], (5, 3)), "b2": jnp.zeros(3)}
    train = (jax.random.normal(k[2], (n, 4)), jax.random.randint(k[3], (n,), 0, 3))
    query = (jax.random.normal(k[5], (q, 4)), jnp.arange(q) % 3)
    return net, params, train, query


def rnn_case(n=11, q=3, steps=3):
    """An Elman RNN: the same Wh, Wx, b at every step, a head on the last state."""
    k = jax.random.split(jax.random.key(1), 7)
    cell = lambda th, h, x: jnp.tanh(h @ th[0] + x @ th[1] + th[2])
    layers = [lbp.Layer(("h", t), cell, (("h", t - 1) if t > 1 else "h0", ("x", t)), ("Wh", "Wx", "b"))
              for t in range(1, steps + 1)]
    layers.append(lbp.Layer("y", head, (("h", steps),), ("Wy", "by")))
    net = lbp.Network(layers, ["h0", *[("x", t) for t in range(1, steps + 1)]], "y")
    params = {"Wh": 0.5 * jax.random.normal(k[0], (3, 3)), "Wx": jax.random.normal(k[1], (2, 3)),
              "b": 0.1 * jax.random.normal(k[2], (3,)), "Wy": jax.random.normal(k[3], (3, 2)), "by": jnp.zeros(2)}
    xs = jax.random.normal(k[4], (n + q, steps, 2))
    ys = jax.random.randint(k[5], (n + q,), 0, 2)
    call = lambda p, x: net(p, jnp.zeros((x.shape[0], 3)), *[x[:, t] for t in range(steps)])
    return call, params, (xs[:n], ys[:n]), (xs[n:], ys[n:])


def reference(outputs, params, train, query):
    """Flat per-example gradients of the training and query losses, G of the mean training loss
    (one compiled program)."""
    flat, unravel = ravel_pytree(params)

    @jax.jit
    def dense(flat, train, query):
        def one(data):
            return jax.vmap(lambda x, y: jax.grad(
                lambda f: cross_entropy(outputs(unravel(f), x[None]), y[None])[0])(flat))(*data)

        x = train[0]
        jac = jax.vmap(lambda x: jax.jacobian(lambda f: outputs(unravel(f), x[None])[0])(flat))(x)
        hess = jax.vmap(lambda x: jax.hessian(jax.nn.logsumexp)(outputs(unravel(flat), x[None])[0]))(x)
        return one(train), one(query), jnp.einsum("ncp,ncd,ndq->pq", jac, hess, jac) / x.shape[0]

    return dense(flat, train, query)


def kronecker_reference(factors, params, ggn, refit):
    """The dense block-diagonal approximation: A ⊗ Γ per weight (with its bias), or EK-FAC's
    Q diag(diag(Qᵀ G Q)) Qᵀ; other leaves G's diagonal."""
    leaves = jax.tree.leaves(params)
    sizes = np.cumsum([0] + [x.size for x in leaves])
    index = [np.arange(sizes[n], sizes[n + 1]).reshape(x.shape) for n, x in enumerate(leaves)]
    flat = jax.tree.leaves(factors, is_leaf=lambda x: x is None or isinstance(x, (lbp.Kronecker, lbp.BiasOf)))
    bias_of = {f.leaf: (n, f.side) for n, f in enumerate(flat) if isinstance(f, lbp.BiasOf)}
    ggn = np.asarray(ggn)
    out = np.zeros_like(ggn)
    for n, f in enumerate(flat):
        if isinstance(f, lbp.BiasOf):
            continue
        if not isinstance(f, lbp.Kronecker):
            out[index[n].ravel(), index[n].ravel()] = np.diag(ggn)[index[n].ravel()]
            continue
        left, right = np.asarray(f.left), np.asarray(f.right)
        ids = index[n].reshape(-1, right.shape[0]) if left.shape[0] * right.shape[0] == index[n].size else None
        if n in bias_of:
            b, side = bias_of[n]
            ids = (np.concatenate([index[n].reshape(-1, right.shape[0]), index[b].reshape(1, -1)], 0) if side == "left"
                   else np.concatenate([index[n].reshape(left.shape[0], -1), index[b].reshape(-1, 1)], 1))
        ids = ids.ravel()
        block = np.kron(left, right)
        if refit:
            basis = np.kron(np.linalg.eigh(left)[1], np.linalg.eigh(right)[1])
            block = basis @ np.diag(np.diag(basis.T @ ggn[np.ix_(ids, ids)] @ basis)) @ basis.T
        out[np.ix_(ids, ids)] = block
    return out


def damped_scores(gq, gi, curvature, damping):
    return gq @ np.linalg.solve(curvature + damping * np.eye(len(curvature)), gi.T)


def losses_of(outputs):
    return lambda p, x, y: cross_entropy(outputs(p, x), y)


@pytest.fixture(scope="module")
def mlp():
    """The MLP case and its references, computed once for the tests that share them."""
    net, params, train, query = mlp_case()
    return (net, params, train, query, *reference(net, params, train, query))


def test_every_method_matches_its_dense_reference_on_an_mlp(mlp):
    """Dense weights with their biases; K-FAC's and EK-FAC's fits (their factors combined over
    chunks) in chunks of 5 of the 13 examples: two in one map, three after."""
    net, params, train, query, gi, gq, ggn = mlp
    losses = losses_of(net)
    factors = lbp.kfac_factors(lambda p, x, y: jnp.mean(losses(p, x, y)))(params, *train)
    curvatures = {"exact": np.asarray(ggn), "diagonal": np.diag(np.diag(ggn)),
                  "kfac": kronecker_reference(factors, params, ggn, refit=False),
                  "ekfac": kronecker_reference(factors, params, ggn, refit=True)}
    for method, curvature in curvatures.items():
        chunks = 5 if method in ("kfac", "ekfac") else None
        fit = lbp.influence(losses, method=method, batch_size=chunks).fit(params, *train)
        damping = 0.1 * np.trace(curvature) / len(curvature)  # the documented default
        np.testing.assert_allclose(fit.damping, damping, rtol=1e-10, err_msg=method)
        expected = damped_scores(gq, gi, curvature, damping)
        np.testing.assert_allclose(fit.scores(losses, params, query, train), expected, rtol=1e-9,
                                   atol=1e-12 * np.abs(expected).max(), err_msg=method)
        if method in ("exact", "ekfac"):
            own = np.einsum("np,np->n", gi, np.linalg.solve(curvature + damping * np.eye(len(curvature)), gi.T).T)
            np.testing.assert_allclose(fit.self_scores(params, *train), own, rtol=1e-9, err_msg=method)
    for by in ("ghost", "forward"):  # no training gradient formed
        np.testing.assert_allclose(fit.scores(losses, params, query, train, by=by), expected, rtol=1e-9,
                                   atol=1e-12 * np.abs(expected).max(), err_msg=by)
    swept = fit.with_damping(3 * damping)  # the exact G's: a sweep without fitting again
    np.testing.assert_allclose(swept.scores(losses, params, query, train),
                               damped_scores(gq, gi, curvature, 3 * damping), rtol=1e-9,
                               atol=1e-12 * np.abs(expected).max())
    fit = lbp.influence(losses, method="identity").fit(params, *train)
    np.testing.assert_allclose(fit.scores(losses, params, query, train), gq @ gi.T, rtol=1e-10)
    np.testing.assert_allclose(fit.self_scores(params, *train), np.sum(gi ** 2, axis=1), rtol=1e-10)


@pytest.mark.slow
def test_rnn_weights_shared_along_the_sequence():
    """Wh, Wx and b at every step: each example's gradient summed over the steps before any
    square (EK-FAC's refit), K-FAC's factors over every use."""
    call, params, train, query = rnn_case()
    losses = losses_of(call)
    gi, gq, ggn = reference(call, params, train, query)
    factors = lbp.kfac_factors(lambda p, x, y: jnp.mean(losses(p, x, y)))(params, *train)
    curvature = kronecker_reference(factors, params, ggn, refit=True)
    fit = lbp.influence(losses, method="ekfac", damping=1e-3).fit(params, *train)
    expected = damped_scores(gq, gi, curvature, 1e-3)
    for by in ("gradients", "ghost"):  # the ghost products sum the steps' uses too
        np.testing.assert_allclose(fit.scores(losses, params, query, train, by=by), expected, rtol=1e-8,
                                   atol=1e-11 * np.abs(expected).max(), err_msg=by)


@pytest.mark.slow
def test_a_tied_weight_read_transposed_by_the_decoder():
    """W encodes (x W) and decodes (h Wᵀ): its gradient sums both uses; K-FAC gives it its
    diagonal (no one Kronecker pair covers both orientations), the biases theirs."""
    k = jax.random.split(jax.random.key(4), 3)
    enc = lambda th, x: jnp.tanh(x @ th[0] + th[1])
    dec = lambda th, h: h @ th[0].T + th[1]
    net = lbp.Network([lbp.Layer("h", enc, ("x",), ("W", "b")), lbp.Layer("y", dec, ("h",), ("W", "c"))],
                      ["x"], "y")
    params = {"W": 0.5 * jax.random.normal(k[0], (4, 3)), "b": jnp.zeros(3), "c": jnp.zeros(4)}
    x, y = jax.random.normal(k[1], (14, 4)), jax.random.randint(k[2], (14,), 0, 4)
    train, query = (x[:11], y[:11]), (x[11:], y[11:])
    losses = losses_of(net)
    gi, gq, ggn = reference(net, params, train, query)
    factors = lbp.kfac_factors(lambda p, x, y: jnp.mean(losses(p, x, y)))(params, *train)
    for method, curvature in [("exact", np.asarray(ggn)),
                              ("ekfac", kronecker_reference(factors, params, ggn, refit=True))]:
        fit = lbp.influence(losses, method=method, damping=1e-2).fit(params, *train)
        expected = damped_scores(gq, gi, curvature, 1e-2)
        np.testing.assert_allclose(fit.scores(losses, params, query, train), expected, rtol=1e-9,
                                   atol=1e-12 * np.abs(expected).max(), err_msg=method)


@pytest.mark.slow
def test_convolution_with_its_bias_and_a_dense_head():
    k = jax.random.split(jax.random.key(2), 5)

    def conv(th, x):
        y = jax.lax.conv_general_dilated(x, th[0], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jnp.tanh(y + th[1])

    flat_head = lambda th, x: x.reshape(x.shape[0], -1) @ th[0] + th[1]
    net = lbp.Network([lbp.Layer("c", conv, ("img",), ("K", "k")), lbp.Layer("y", flat_head, ("c",), ("H", "h"))],
                      ["img"], "y")
    params = {"K": 0.5 * jax.random.normal(k[0], (2, 2, 1, 2)), "k": jnp.zeros(2),
              "H": 0.3 * jax.random.normal(k[1], (18, 3)), "h": jnp.zeros(3)}
    images = jax.random.normal(k[2], (12, 3, 3, 1))
    labels = jax.random.randint(k[3], (12,), 0, 3)
    train, query = (images[:9], labels[:9]), (images[9:], labels[9:])
    losses = losses_of(net)
    gi, gq, ggn = reference(net, params, train, query)
    factors = lbp.kfac_factors(lambda p, x, y: jnp.mean(losses(p, x, y)))(params, *train)
    assert isinstance(factors["K"], lbp.Kronecker) and isinstance(factors["k"], lbp.BiasOf)
    for method in ["kfac", "ekfac"]:
        curvature = kronecker_reference(factors, params, ggn, refit=method == "ekfac")
        fit = lbp.influence(losses, method=method, damping=1e-2).fit(params, *train)
        expected = damped_scores(gq, gi, curvature, 1e-2)
        for by in ("gradients", "ghost"):  # the ghost products over the kernel's patches
            np.testing.assert_allclose(fit.scores(losses, params, query, train, by=by), expected, rtol=1e-8,
                                       atol=1e-11 * np.abs(expected).max(), err_msg=f"{method}, {by}")


@pytest.mark.users_settings
def test_the_default_method_at_the_settings_users_run(mlp):
    """EK-FAC at its default damping (the defaults) against its dense reference: in the slow tier
    also compiled at XLA's defaults (tests/test_users_settings.py)."""
    net, params, train, query, gi, gq, ggn = mlp
    losses = losses_of(net)
    factors = lbp.kfac_factors(lambda p, x, y: jnp.mean(losses(p, x, y)))(params, *train)
    curvature = kronecker_reference(factors, params, ggn, refit=True)
    fit = lbp.influence(losses).fit(params, *train)
    expected = damped_scores(gq, gi, curvature, 0.1 * np.trace(curvature) / len(curvature))
    np.testing.assert_allclose(fit.scores(losses, params, query, train), expected, rtol=1e-9,
                               atol=1e-12 * np.abs(expected).max())


def test_under_jit_and_in_float32(mlp):
    net, params, train, query, gi, gq, ggn = mlp
    losses = losses_of(net)
    attr = lbp.influence(losses, method="exact", batch_size=5)
    fit = jax.jit(attr.fit)(params, *train)
    scores = jax.jit(lambda p, q, t: fit.scores(losses, p, q, t))(params, query, train)
    np.testing.assert_allclose(scores, damped_scores(gq, gi, np.asarray(ggn), fit.damping), rtol=1e-9,
                               atol=1e-12 * np.abs(scores).max())
    d = np.diag(ggn)
    expected = (np.asarray(gq) / (d + 0.1 * d.mean())) @ np.asarray(gi).T
    with jax.enable_x64(False):
        single = jax.tree.map(lambda x: x.astype(jnp.float32) if x.dtype == jnp.float64 else x.astype(jnp.int32),
                              (params, train, query))
        fit32 = lbp.influence(losses, method="diagonal").fit(single[0], *single[1])
        scores32 = fit32.scores(losses, single[0], single[2], single[1])
        assert scores32.dtype == jnp.float32
        np.testing.assert_allclose(scores32, expected, rtol=2e-3, atol=2e-4 * np.abs(expected).max())


@pytest.mark.slow
def test_nnx_model_through_layers():
    nnx = pytest.importorskip("flax.nnx")

    class Mlp(nnx.Module):
        def __init__(self, rngs):
            linear = lambda i, o: nnx.Linear(i, o, param_dtype=jnp.float64, rngs=rngs)
            self.hidden, self.out = linear(4, 5), linear(5, 3)

        def __call__(self, x):
            return self.out(jnp.tanh(self.hidden(x)))

    model = Mlp(nnx.Rngs(0))
    _, train, query = mlp_case()[1:]
    losses = lambda m, x, y: cross_entropy(m(x), y)
    graph, state = nnx.split(model)
    outputs = lambda s, x: nnx.merge(graph, s)(x)
    gi, gq, ggn = reference(outputs, state, train, query)
    fit = lbp.influence(losses, method="exact", layers=nnx.Linear, batch_size=5).fit(model, *train)
    damping = 0.1 * np.trace(ggn) / len(ggn)
    expected = damped_scores(gq, gi, np.asarray(ggn), damping)
    np.testing.assert_allclose(fit.scores(losses, model, query, train), expected, rtol=1e-9,
                               atol=1e-12 * np.abs(expected).max())
    factors = lbp.kfac_factors(lambda m, x, y: jnp.mean(losses(m, x, y)), layers=nnx.Linear)(model, *train)
    curvature = kronecker_reference(factors, state, ggn, refit=True)
    fit = lbp.influence(losses, method="ekfac", damping=1e-2, layers=nnx.Linear).fit(model, *train)
    expected = damped_scores(gq, gi, curvature, 1e-2)
    for by in ("gradients", "ghost", "forward"):
        np.testing.assert_allclose(fit.scores(losses, model, query, train, by=by), expected, rtol=1e-9,
                                   atol=1e-12 * np.abs(expected).max(), err_msg=by)


@pytest.mark.slow
def test_sampled_columns_of_h():
    """``samples=``: a scalar output's H is rank one, so one sampled column per example is exact
    (each chunk's key folded in); softmax cross-entropy's sampled factors approach the exact."""
    net, params, train, query = mlp_case()
    train, query = [(x, y.astype(jnp.float64)) for x, y in (train, query)]
    losses = lambda p, x, y: 0.5 * (net(p, x)[:, 0] - y) ** 2
    for method in ["diagonal", "kfac"]:
        exact = lbp.influence(losses, method=method).fit(params, *train).scores(losses, params, query, train)
        sampled = lbp.influence(losses, method=method, samples=1, key=jax.random.key(0), batch_size=5)
        np.testing.assert_allclose(sampled.fit(params, *train).scores(losses, params, query, train), exact,
                                   rtol=1e-9, atol=1e-12 * np.abs(exact).max(), err_msg=method)
    _, _, train, _ = mlp_case()
    losses = losses_of(net)
    exact = lbp.influence(losses, method="kfac").fit(params, *train).damping
    sampled = lbp.influence(losses, method="kfac", samples=100, key=jax.random.key(1)).fit(params, *train).damping
    np.testing.assert_allclose(sampled, exact, rtol=0.01)


def test_refusals_name_the_fix():
    net, params, train, query = mlp_case()
    losses = losses_of(net)
    with pytest.raises(ValueError, match="method='bogus'"):
        lbp.influence(losses, method="bogus")
    with pytest.raises(ValueError, match="drop damping"):
        lbp.influence(losses, method="identity", damping=1.0)
    with pytest.raises(ValueError, match="key="):
        lbp.influence(losses, method="kfac", samples=2)
    with pytest.raises(ValueError, match="exact columns"):
        lbp.influence(losses, method="exact", samples=2, key=jax.random.key(0))
    with pytest.raises(ValueError, match="positive"):
        lbp.influence(losses, batch_size=0)
    with pytest.raises(TypeError, match="one pytree|in one"):
        lbp.influence(losses, argnums=(0,))
    fit = lbp.influence(losses, method="diagonal").fit(params, *train)
    with pytest.raises(TypeError, match="tuple of arrays"):
        fit.scores(losses, params, query[0], train)
    with pytest.raises(ValueError, match="by='backward'"):
        fit.scores(losses, params, query, train, by="backward")
    with pytest.raises(ValueError, match="4 examples, the fit 13"):
        fit.scores(losses, params, query, query)
    twice = lambda p, x, y: cross_entropy(net(p, x), y) + cross_entropy(net(p, 2 * x), y)  # two calls: two terms
    with pytest.raises(NotImplementedError, match=r"the weight \['W1'\] has 2 Kronecker terms"):
        lbp.influence(twice, method="kfac").fit(params, *train)
    pairing = lambda p, x, y: cross_entropy(net(p, x), y) + cross_entropy(jnp.roll(net(p, x), 1, axis=0), y)
    with pytest.raises(ValueError, match="example"):  # loss i reads examples i and i - 1: no influence of one
        lbp.influence(pairing, method="identity").fit(params, *train).self_scores(params, *train)


@pytest.mark.slow
def test_equinox_and_linen_models_through_layers():
    eqx = pytest.importorskip("equinox")
    linen = pytest.importorskip("flax.linen")
    _, _, train, query = mlp_case()
    key = jax.random.key(3)
    model = eqx.nn.Sequential([eqx.nn.Linear(4, 5, key=key), eqx.nn.Lambda(jnp.tanh),
                               eqx.nn.Linear(5, 3, key=jax.random.fold_in(key, 1))])
    model = jax.tree.map(lambda x: x.astype(jnp.float64) if eqx.is_inexact_array(x) else x, model)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    outputs = lambda p, x: jax.vmap(eqx.combine(p, static))(x)
    losses = lambda m, x, y: cross_entropy(jax.vmap(m)(x), y)
    gi, gq, ggn = reference(outputs, params, train, query)
    fit = lbp.influence(losses, method="exact", layers=eqx.nn.Linear).fit(model, *train)
    expected = damped_scores(gq, gi, np.asarray(ggn), fit.damping)
    np.testing.assert_allclose(fit.scores(losses, model, query, train), expected, rtol=1e-9,
                               atol=1e-12 * np.abs(expected).max())

    class Mlp(linen.Module):
        @linen.compact
        def __call__(self, x):
            return linen.Dense(3, param_dtype=jnp.float64)(jnp.tanh(linen.Dense(5, param_dtype=jnp.float64)(x)))

    mlp = Mlp()
    variables = mlp.init(key, train[0][:1])
    losses = lambda v, x, y: cross_entropy(mlp.apply(v, x), y)
    gi, gq, ggn = reference(lambda v, x: mlp.apply(v, x), variables, train, query)
    fit = lbp.influence(losses, method="exact", layers=linen.Dense).fit(variables, *train)
    expected = damped_scores(gq, gi, np.asarray(ggn), fit.damping)
    np.testing.assert_allclose(fit.scores(losses, variables, query, train), expected, rtol=1e-9,
                               atol=1e-12 * np.abs(expected).max())
