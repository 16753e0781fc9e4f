"""``lbp.kfac`` and ``scale_by_gauss_newton`` on models as written (``layers=``): inside
``nnx.Optimizer`` under ``nnx.jit`` and on an equinox module under ``eqx.filter_jit``, with the
loss after the step from ``value_fn=G.value_at`` (no split and merge by hand). References: the same step
with a hand-written ``value_fn`` that merges (nnx), the same model written as a ``Network``
(equinox), ``value_at`` against the loss of the merged model."""

from __future__ import annotations

import itertools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from trees import assert_trees_close

import linbackprop as lbp

BATCH, SIZES = 12, (3, 5, 4)
pure = getattr(nnx, "as_pure", None) or nnx.pure  # flax renamed it (0.12.x)


def same_trees(actual, expected, rtol=1e-9, atol=1e-12):
    assert_trees_close(actual, expected, rtol=rtol, atol=atol)


def data(seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((BATCH, SIZES[0])))
    return x, jnp.asarray(rng.integers(0, SIZES[-1], BATCH))


class NnxDense(nnx.Module):
    def __init__(self, i, o, rngs, act=True):
        self.linear = nnx.Linear(i, o, rngs=rngs, param_dtype=jnp.float64)
        self.act = act

    def __call__(self, x):
        h = self.linear(x)
        return jnp.tanh(h) if self.act else h


class NnxMlp(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([NnxDense(SIZES[0], SIZES[1], rngs), NnxDense(SIZES[1], SIZES[2], rngs, act=False)])

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def xent(model, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def test_kfac_factors_of_a_layers_model_name_each_bias_by_its_weights_path():
    x, y = data()
    factors = lbp.kfac_factors(xent, layers=NnxDense)(NnxMlp(nnx.Rngs(0)), x, y)
    paths = {jax.tree_util.keystr(p): f for p, f in jax.tree_util.tree_flatten_with_path(
        factors, is_leaf=lambda f: isinstance(f, (lbp.Kronecker, lbp.BiasOf)))[0]}
    biases = {k: f for k, f in paths.items() if isinstance(f, lbp.BiasOf)}
    assert len(biases) == 2
    for key, bias in biases.items():
        assert isinstance(paths[bias.weight], lbp.Kronecker)  # a path of this very tree
        assert bias.weight == key.replace("bias", "kernel")


def test_value_at_is_the_loss_of_the_merged_model():
    model, (x, y) = NnxMlp(nnx.Rngs(0)), data(0)
    _, grad, G = jax.jit(lambda m, x, y: lbp.gauss_newton(xent, layers=NnxDense)(m, x, y))(model, x, y)
    graphdef, params = nnx.split(model, nnx.Param)
    other = jax.tree.map(lambda p: p + 0.3, pure(params))
    expected = xent(nnx.merge(graphdef, other), x, y)
    np.testing.assert_allclose(float(G.value_at(other)), float(expected), rtol=1e-12)
    np.testing.assert_allclose(float(G.value_at(params)), float(xent(model, x, y)), rtol=1e-12)  # with Variables
    with pytest.raises(ValueError, match="value_at: params has leaves of shapes"):
        G.value_at({"W": jnp.zeros(3)})
    assert jax.tree.structure(grad) == jax.tree.structure(params)


def test_kfac_inside_nnx_optimizer_equals_the_step_with_a_merging_value_fn():
    """Three steps of ``nnx.Optimizer(model, lbp.kfac(factors=...))`` under ``nnx.jit`` with
    ``value_fn=G.value_at``: the parameters equal three steps of the bare transform with a
    hand-written ``value_fn`` that merges; the state keeps its structure."""
    x, y = data(1)
    model = NnxMlp(nnx.Rngs(1))
    graphdef, start, rest = nnx.split(model, nnx.Param, ...)
    start = pure(start)  # the arrays now: the State's Variables are the model's, updated in place
    factors = lbp.kfac_factors(xent, layers=NnxDense)(model, x, y)
    optimizer = nnx.Optimizer(model, lbp.kfac(damping=1e-2, damping_interval=1, update_every=2, factors=factors),
                              wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer):
        value, grad, G = lbp.gauss_newton(xent, layers=NnxDense)(model, x, y)
        optimizer.update(model, grad, factors=lbp.kfac_factors(xent, layers=NnxDense)(model, x, y), curvature=G,
                         value=value, value_fn=G.value_at)
        return value

    values = [float(step(model, optimizer)) for _ in range(3)]
    assert values[-1] < values[0]
    # (a state whose structure changed would not go back into nnx.Optimizer: factors= made it whole)

    opt = lbp.kfac(damping=1e-2, damping_interval=1, update_every=2)
    params = start

    @jax.jit
    def reference(params, state):
        m = nnx.merge(graphdef, params, rest)
        value, grad, G = lbp.gauss_newton(xent, layers=NnxDense)(m, x, y)
        f = lbp.kfac_factors(xent, layers=NnxDense)(m, x, y)
        updates, state = opt.update(pure(grad), state, params, factors=pure(f), curvature=G, value=value,
                                    value_fn=lambda q: xent(nnx.merge(graphdef, q, rest), x, y))
        return optax.apply_updates(params, updates), state

    state = opt.init(params)
    for _ in range(3):
        params, state = reference(params, state)
    same_trees(pure(nnx.state(model, nnx.Param)), params, rtol=1e-8, atol=1e-11)


def test_scale_by_gauss_newton_inside_nnx_optimizer_with_value_at():
    x, y = data(2)
    model = NnxMlp(nnx.Rngs(2))
    optimizer = nnx.Optimizer(model, optax.chain(lbp.scale_by_gauss_newton(solver="cg", maxiter=20),
                                                 optax.scale(-1.0)), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer):
        value, grad, G = lbp.gauss_newton(xent, layers=NnxDense)(model, x, y)
        optimizer.update(model, grad, curvature=G, value=value, value_fn=G.value_at)
        return value

    values = [float(step(model, optimizer)) for _ in range(6)]
    assert all(b <= a for a, b in itertools.pairwise(values))  # rejected steps keep the parameters
    assert values[-1] < 0.5 * values[0]


class EqxDense(eqx.Module):
    weight: jax.Array
    bias: jax.Array
    act: bool = eqx.field(static=True)

    def __call__(self, x):
        h = x @ self.weight.T + self.bias
        return jnp.tanh(h) if self.act else h


class EqxMlp(eqx.Module):
    layers: list

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_kfac_on_an_equinox_model_equals_the_same_network_written_by_hand():
    x, y = data(3)
    rng = np.random.default_rng(3)
    weights = [(jnp.asarray(rng.standard_normal((o, i)) / np.sqrt(i)), jnp.asarray(0.1 * rng.standard_normal(o)))
               for i, o in itertools.pairwise(SIZES)]
    model = EqxMlp([EqxDense(w, b, k == 0) for k, (w, b) in enumerate(weights)])
    dense = lambda th, u: jnp.tanh(u @ th[0].T + th[1])
    head = lambda th, u: u @ th[0].T + th[1]
    net = lbp.Network([lbp.Layer(1, dense, (0,), ("w0", "b0")), lbp.Layer(2, head, (1,), ("w1", "b1"))], [0], 2)
    params = {f"{n}{k}": a for k, (w, b) in enumerate(weights) for n, a in (("w", w), ("b", b))}
    net_loss = lambda p, x, y: optax.softmax_cross_entropy_with_integer_labels(net(p, x), y).mean()
    make = lambda f: lbp.kfac(damping=1e-2, damping_interval=1, factors=f)
    opt = make(lbp.kfac_factors(xent, layers=EqxDense)(model, x, y))
    ref = make(lbp.kfac_factors(net_loss)(params, x, y))

    @eqx.filter_jit
    def step(model, state):
        value, grad, G = lbp.gauss_newton(xent, layers=EqxDense)(model, x, y)
        factors = lbp.kfac_factors(xent, layers=EqxDense)(model, x, y)
        updates, state = opt.update(grad, state, eqx.filter(model, eqx.is_inexact_array), factors=factors,
                                    curvature=G, value=value, value_fn=G.value_at)
        return eqx.apply_updates(model, updates), state

    @jax.jit
    def ref_step(p, state):
        value, grad, G = lbp.gauss_newton(net_loss)(p, x, y)
        updates, state = ref.update(grad, state, p, factors=lbp.kfac_factors(net_loss)(p, x, y), curvature=G,
                                    value=value, value_fn=lambda q: net_loss(q, x, y))
        return optax.apply_updates(p, updates), state

    state, ref_state = opt.init(eqx.filter(model, eqx.is_inexact_array)), ref.init(params)
    for _ in range(3):
        model, state = step(model, state)
        params, ref_state = ref_step(params, ref_state)
    got = {f"{n}{k}": getattr(layer, name) for k, layer in enumerate(model.layers)
           for n, name in (("w", "weight"), ("b", "bias"))}
    same_trees(got, params, rtol=1e-8, atol=1e-11)
    np.testing.assert_allclose(float(state.damping), float(ref_state.damping), rtol=1e-12)
