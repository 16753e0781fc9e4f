"""Curvature in one pass: ``gauss_newton(factors=True, diagonal=True, samples=, key=)`` gives value,
gradient, G, K-FAC's factors and the GGN diagonal from one forward pass and one back substitution
batched over [the gradient's cotangent, H's columns]. References: the separate transforms with
the same key (``gauss_newton``, ``kfac_factors``, ``diag_ggn``), ``jax.grad``, ``nnx.grad``, the
dense G; the K-FAC step's program counted for its forward passes; a 20-step trajectory of
``lbp.kfac`` against today's two-pass step."""

from __future__ import annotations

import collections
import itertools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax._src import core as jax_core
from test_kfac_models import EqxDense, EqxMlp, NnxDense, NnxMlp, data, xent
from test_laplacian import params as pinn_params
from test_laplacian import pinn_loss, points
from trees import assert_bias_of, assert_trees_close

import linbackprop as lbp

dense = lambda th, x: jnp.tanh(x @ th[0] + th[1])
linear = lambda th, x: x @ th[0] + th[1]
MLP = lbp.Network([lbp.Layer("h", dense, ("x",), ("W1", "b1")), lbp.Layer("y", linear, ("h",), ("W2", "b2"))],
                  ["x"], "y")
is_factor = lambda f: isinstance(f, (lbp.Kronecker, lbp.BiasOf))


def mlp_problem(dtype=jnp.float64):
    keys = jax.random.split(jax.random.key(0), 4)
    p = {"W1": jax.random.normal(keys[0], (5, 7), dtype), "b1": jnp.full(7, 0.1, dtype),
         "W2": jax.random.normal(keys[1], (7, 3), dtype), "b2": jnp.zeros(3, dtype)}
    x = jax.random.normal(keys[2], (16, 5), dtype)
    labels = jax.random.randint(keys[3], (16,), 0, 3)
    return p, x, labels


def mlp_loss(p, x, labels):  # a weight decay term: in the value and gradient, not in G
    return optax.softmax_cross_entropy_with_integer_labels(MLP(p, x), labels).mean() + 1e-3 * jnp.sum(p["W1"] ** 2)


def separate(loss, samples, key, args, approximation="expand", **kw):
    """The three transforms apart, each from its own pass."""
    value, grad, G = lbp.gauss_newton(loss, **kw)(*args)
    factors = lbp.kfac_factors(loss, samples=samples, key=key, approximation=approximation, **kw)(*args)
    diagonal = lbp.diag_ggn(loss, samples=samples, key=key, **kw)(*args)
    return value, grad, G, factors, diagonal


def assert_one_pass_is_the_separate_transforms(loss, args, samples, seed=3, rtol=1e-9, **kw):
    key = None if samples is None else jax.random.key(seed)  # exact columns take no key
    value, grad, G = jax.jit(lambda *a: lbp.gauss_newton(loss, factors=True, diagonal=True, samples=samples, key=key,
                                                         **kw)(*a))(*args)
    value0, grad0, G0, factors0, diagonal0 = jax.jit(lambda *a: separate(loss, samples, key, a, **kw))(*args)
    assert_trees_close(value, value0, rtol=rtol, atol=1e-14)
    assert_trees_close(G.value, value0, rtol=rtol, atol=1e-14)
    assert_trees_close(grad, grad0, rtol=rtol, atol=1e-12)
    assert_trees_close(G.factors, factors0, rtol=rtol, atol=1e-12)
    assert_trees_close(G.diagonal, diagonal0, rtol=rtol, atol=1e-12)
    np.testing.assert_allclose(G.todense(), G0.todense(), rtol=rtol, atol=1e-12)
    return value, grad, G


@pytest.mark.parametrize("samples", [None, 1, 3])
def test_an_mlp_in_one_pass_is_the_separate_transforms(samples):
    p, x, labels = mlp_problem()
    _, grad, G = assert_one_pass_is_the_separate_transforms(mlp_loss, (p, x, labels), samples)
    assert_trees_close(grad, jax.grad(mlp_loss)(p, x, labels), rtol=1e-9, atol=1e-12)
    assert_bias_of(G.factors, "b1", "['W1']", "left")
    u = jax.tree.map(jnp.ones_like, p)
    np.testing.assert_allclose(G.gram([u, grad]), lbp.gauss_newton(mlp_loss)(p, x, labels)[2].gram([u, grad]),
                               rtol=1e-10)


def test_a_pinn_loss_of_two_calls_in_one_pass():
    """Interior (the lifted network, its Laplacian) and boundary points, each call its own examples."""
    inner, edge = points()  # exact columns: the MLP's test; here two samples and "reduce"
    assert_one_pass_is_the_separate_transforms(pinn_loss, (pinn_params(), inner, edge), 2, approximation="reduce")


def test_an_rnn_with_a_shared_weight_in_one_pass():
    """A, B shared by every step (a Kronecker term per use), c and the norm's γ their diagonal."""
    T, B, D, W = 5, 8, 3, 6
    norm = lambda z: (z - z.mean(-1, keepdims=True)) / jnp.sqrt(z.var(-1, keepdims=True) + 1e-3)
    cell = lambda th, h, x: jnp.tanh(norm(h @ th[0] + x @ th[1] + th[2]) * th[3])
    net = lbp.Network([lbp.Layer(t, cell, (t - 1, lbp.Row("xs", t - 1)), ("A", "B", "c", "g"))
                       for t in range(1, T + 1)] + [lbp.Layer("y", lambda th, h: h @ th[0], (T,), ("V",))],
                      [0, "xs"], "y")
    rng = np.random.default_rng(8)
    r = lambda *s: jnp.asarray(0.5 * rng.standard_normal(s))
    params = {"A": r(W, W), "B": r(D, W), "c": r(W), "g": 1.0 + r(W), "V": r(W, 2)}
    h0, xs = jnp.zeros((B, W)), r(T, B, D)
    loss = lambda p, xs, y: 0.5 * jnp.mean((net(p, h0, xs) - y) ** 2)
    args = (params, xs, jnp.sin(xs.sum(0)[:, :2]))
    _, _, G = assert_one_pass_is_the_separate_transforms(loss, args, 1)  # "reduce": the PINN's test
    assert isinstance(G.factors["A"], lbp.Kronecker) and G.factors["c"].shape == (W,)


def test_an_nnx_layers_model_in_one_pass():
    model, (x, y) = NnxMlp(nnx.Rngs(0)), data()
    _, grad, G = assert_one_pass_is_the_separate_transforms(xent, (model, x, y), 1, layers=NnxDense)
    assert_trees_close(grad, nnx.grad(xent)(model, x, y), rtol=1e-9, atol=1e-12)
    paths = dict((jax.tree_util.keystr(p), f) for p, f in
                 jax.tree_util.tree_flatten_with_path(G.factors, is_leaf=is_factor)[0])
    biases = [f for f in paths.values() if isinstance(f, lbp.BiasOf)]
    assert len(biases) == 2 and all(isinstance(paths[b.weight], lbp.Kronecker) for b in biases)


def test_kfac_inside_nnx_optimizer_takes_everything_from_g():
    """``optimizer.update(model, grad, curvature=G)`` under ``nnx.jit``, G from the one pass: the
    same parameters as the step given the factors, value and value_fn apart."""
    x, y = data(1)
    runs = []
    for one_pass in (True, False):
        model = NnxMlp(nnx.Rngs(1))
        example = lbp.gauss_newton(xent, layers=NnxDense, factors=True)(model, x, y)[2].factors
        optimizer = nnx.Optimizer(model, lbp.kfac(damping=1e-2, damping_interval=1, update_every=2,
                                                  factors=example), wrt=nnx.Param)

        @nnx.jit
        def step(model, optimizer, one_pass=one_pass):
            if one_pass:
                value, grad, G = lbp.gauss_newton(xent, layers=NnxDense, factors=True)(model, x, y)
                optimizer.update(model, grad, curvature=G)
            else:
                value, grad, G = lbp.gauss_newton(xent, layers=NnxDense)(model, x, y)
                optimizer.update(model, grad, factors=lbp.kfac_factors(xent, layers=NnxDense)(model, x, y),
                                 curvature=G, value=value, value_fn=G.value_at)
            return value

        values = [float(step(model, optimizer)) for _ in range(4)]
        runs.append((values, nnx.state(model, nnx.Param)))
    assert runs[0][0][-1] < runs[0][0][0]
    np.testing.assert_allclose(runs[0][0], runs[1][0], rtol=1e-9)
    assert_trees_close(runs[0][1], runs[1][1], rtol=1e-7, atol=1e-10)


@pytest.mark.slow  # the nnx model's equality is the default tier's; this one also trains
def test_an_equinox_layers_model_in_one_pass_trains_with_kfac():
    """The weight-first product (W x: the bias on the right factor's side) and eqx.filter_jit."""
    x, y = data(3)
    rng = np.random.default_rng(3)
    model = EqxMlp([EqxDense(jnp.asarray(rng.standard_normal((o, i)) / np.sqrt(i)),
                             jnp.asarray(0.1 * rng.standard_normal(o)), k == 0)
                    for k, (i, o) in enumerate(itertools.pairwise((3, 5, 4)))])
    _, grad, G = assert_one_pass_is_the_separate_transforms(xent, (model, x, y), 1, layers=EqxDense)
    assert_trees_close(grad, eqx.filter_grad(xent)(model, x, y), rtol=1e-9, atol=1e-12)
    opt = lbp.kfac(factors=G.factors)

    @eqx.filter_jit
    def step(model, state, i):
        value, grad, G = lbp.gauss_newton(xent, layers=EqxDense, factors=True, samples=1,
                                          key=jax.random.fold_in(jax.random.key(0), i))(model, x, y)
        updates, state = opt.update(grad, state, eqx.filter(model, eqx.is_inexact_array), curvature=G)
        return eqx.apply_updates(model, updates), state, value

    state, values = opt.init(eqx.filter(model, eqx.is_inexact_array)), []
    for i in range(10):
        model, state, value = step(model, state, i)
        values.append(float(value))
    assert values[-1] < 0.5 * values[0], values


def test_the_one_pass_operator_is_the_two_pass_one():
    """G's factor K (KᵀK = G), its Hessian on the outputs and value_at: as gauss_newton's."""
    p, x, labels = mlp_problem()
    G = lbp.gauss_newton(mlp_loss, factors=True)(p, x, labels)[2]
    G0 = lbp.gauss_newton(mlp_loss)(p, x, labels)[2]
    rows = jax.vmap(lambda r: jax.flatten_util.ravel_pytree(r)[0])(G.factor())
    np.testing.assert_allclose(rows.T @ rows, G0.todense(), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(G.hessian(), G0.hessian(), rtol=1e-12, atol=1e-14)
    q = jax.tree.map(lambda a: a + 0.1, p)
    np.testing.assert_allclose(G.value_at(q), mlp_loss(q, x, labels), rtol=1e-12)
    assert G.size == G0.size and G.outputs == G0.outputs


def test_has_aux_and_float32_in_one_pass():
    p, x, labels = mlp_problem(jnp.float32)
    with_aux = lambda p, x, labels: (mlp_loss(p, x, labels), {"norm": jnp.sum(p["W2"] ** 2)})
    key = jax.random.key(5)
    (value, aux), grad, G = jax.jit(lambda *a: lbp.gauss_newton(with_aux, has_aux=True, factors=True, samples=1,
                                                                key=key)(*a))(p, x, labels)
    assert value.dtype == jnp.float32 and G.factors["W1"].left.dtype == jnp.float32
    np.testing.assert_allclose(aux["norm"], jnp.sum(p["W2"] ** 2), rtol=1e-6)
    assert_trees_close(grad, jax.grad(mlp_loss)(p, x, labels), rtol=1e-5, atol=1e-6)
    assert_trees_close(G.factors, lbp.kfac_factors(mlp_loss, samples=1, key=key)(p, x, labels), rtol=1e-5, atol=1e-6)


def kfac_steps(one_pass, steps=20):
    p, x, labels = mlp_problem()
    loss = lambda q: optax.softmax_cross_entropy_with_integer_labels(MLP(q, x), labels).mean()
    opt = lbp.kfac()

    def step(params, state, i):
        key = jax.random.fold_in(jax.random.key(1), i)
        if one_pass:
            value, grad, G = lbp.gauss_newton(loss, factors=True, samples=1, key=key)(params)
            updates, state = opt.update(grad, state, params, curvature=G)
        else:
            value, grad, G = lbp.gauss_newton(loss)(params)
            factors = lbp.kfac_factors(loss, samples=1, key=key)(params)
            updates, state = opt.update(grad, state, params, factors=factors, curvature=G, value=value,
                                        value_fn=lambda q, **_: loss(q))
        return optax.apply_updates(params, updates), state, value

    jitted, state, values = jax.jit(step), opt.init(p), []
    for i in range(steps):
        p, state, value = jitted(p, state, i)
        values.append(float(value))
    return p, values, jax.make_jaxpr(step)(p, state, 0).jaxpr


def primitives(jaxpr, counts=None):
    counts = collections.Counter() if counts is None else counts
    for eqn in jaxpr.eqns:
        counts[eqn.primitive.name] += 1
        for inner in jax_core.jaxprs_in_params(eqn.params):
            primitives(inner, counts)
    return counts


def test_a_kfac_step_in_one_pass_makes_one_forward_pass_and_keeps_the_trajectory():
    """The MLP's one tanh layer: one forward pass (a tanh) and the loss at θ + u on damping steps
    (a tanh in a cond), where the two-pass step made two forward passes; the same 20 steps."""
    p, values, program = kfac_steps(True)
    p0, values0, program0 = kfac_steps(False)
    assert primitives(program)["tanh"] == 2 and primitives(program0)["tanh"] == 3
    np.testing.assert_allclose(values, values0, rtol=1e-7)
    assert values[-1] < 1e-2 * values[0]
    assert_trees_close(p, p0, rtol=1e-6, atol=1e-8)


def test_scale_by_kfac_takes_the_factors_from_g():
    p, x, labels = mlp_problem()
    _, grad, G = lbp.gauss_newton(mlp_loss, factors=True)(p, x, labels)
    tx = lbp.scale_by_kfac(damping=1e-2)
    ours = tx.update(grad, tx.init(p), p, curvature=G)[0]
    theirs = tx.update(grad, tx.init(p), p, factors=lbp.kfac_factors(mlp_loss)(p, x, labels))[0]
    assert_trees_close(ours, theirs, rtol=1e-9, atol=1e-12)


def test_one_pass_arguments_that_do_not_fit_name_the_fix():
    p, x, labels = mlp_problem()
    with pytest.raises(ValueError, match="pass factors=True"):
        lbp.gauss_newton(mlp_loss, samples=1, key=jax.random.key(0))
    with pytest.raises(ValueError, match="drop remat= and checkpoints="):
        lbp.gauss_newton(mlp_loss, factors=True, remat=True)
    with pytest.raises(ValueError, match="approximation='both'"):
        lbp.gauss_newton(mlp_loss, factors=True, approximation="both")
    with pytest.raises(ValueError, match="needs a PRNG key"):
        lbp.gauss_newton(mlp_loss, factors=True, samples=1)(p, x, labels)
    with pytest.raises(TypeError, match="factors=True"):
        opt = lbp.kfac()
        _, grad, G = lbp.gauss_newton(mlp_loss)(p, x, labels)
        opt.update(grad, opt.init(p), p, curvature=G)
