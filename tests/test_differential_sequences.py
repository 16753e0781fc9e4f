"""Differential harness for the sequence paths: ``checkpoints`` for every k, several network inputs,
``Row("xs", t)`` reads (repeated, out of order, pytree ``xs``), ``Stack`` outputs (non-consecutive,
repeated, network inputs among them), array / tuple / dict states with a differently typed state
before the scanned run (an unbatched h0, float32 under x64, a state made by another layer), a
first step that reads two inputs where later steps read one state twice, a network call without
tangents inside the transform, and Hessian-vector products — each against the same program
differentiated by JAX (float64).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import linbackprop as lbp

pytestmark = pytest.mark.usefixtures("always_checkpoint")  # the segments are under test

B, W = 2, 3  # batch and width of every state leaf


def _leaves_op(state, fn):
    return jax.tree.map(fn, state)


def cell(th, h, x):
    """One step: the previous state (array, tuple or dict) and a row of xs (array or dict)."""
    xin = x if not isinstance(x, dict) else x["a"] + jnp.sin(x["b"])
    return _leaves_op(h, lambda leaf: jnp.tanh(leaf @ th[0] + xin @ th[1]))


def twice_first(th, a, b):
    return jax.tree.map(lambda u, v: jnp.tanh(u @ th[0] + jnp.cos(v) @ th[1]), a, b)


def prepare(th, h0):
    """A layer before the run whose state has another structure or shape than the run's."""
    return jax.tree.map(lambda leaf: jnp.broadcast_to(jnp.sin(leaf) * th[0], (B, W)), h0)


def structured(kind: str, leaf):
    if kind == "tuple":
        return (leaf, 0.5 * leaf)
    if kind == "dict":
        return {"h": leaf, "c": -leaf}
    return leaf


@st.composite
def sequence_networks(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    rand = lambda *shape: jnp.asarray(0.6 * rng.standard_normal(shape))
    steps = draw(st.integers(1, 12))
    kind = draw(st.sampled_from(["array", "tuple", "dict"]))
    h0_form = draw(st.sampled_from(["batched", "unbatched", "float32", "layer"]))
    pattern = draw(st.sampled_from(["cell", "twice"]))
    stacked_weights = draw(st.booleans())
    pytree_xs = draw(st.booleans())
    n_xs = draw(st.integers(1, steps + 1))
    rows = draw(st.lists(st.integers(0, n_xs - 1), min_size=steps, max_size=steps))  # repeats, any order
    if draw(st.booleans()):
        rows = [t % n_xs for t in range(steps)]

    h0_leaf = rand(W) if h0_form == "unbatched" else rand(B, W)
    if h0_form == "float32":
        h0_leaf = h0_leaf.astype(jnp.float32)
    h0 = structured(kind, h0_leaf)
    xs = {"a": rand(n_xs, B, W), "b": rand(n_xs, B, W)} if pytree_xs else rand(n_xs, B, W)
    params = {"U": rand(W, W), "V": rand(W, W), "s": rand(W)}
    if stacked_weights:
        params["Us"] = rand(steps, W, W)
    layers, first = [], "h0"
    if h0_form == "layer":
        layers.append(lbp.Layer("pre", prepare, ("h0",), ("s",)))
        first = "pre"
    inputs = ["h0", "xs"]
    for t in range(steps):
        prev = first if t == 0 else t - 1
        weight = lbp.Row("Us", t) if stacked_weights else "U"
        if pattern == "cell":
            layers.append(lbp.Layer(t, cell, (prev, lbp.Row("xs", rows[t])), (weight, "V")))
        elif t == 0:
            layers.append(lbp.Layer(t, twice_first, (first, "y"), (weight, "V")))
        else:
            layers.append(lbp.Layer(t, twice_first, (prev, prev), (weight, "V")))
    args = [h0, xs]
    if pattern == "twice":
        inputs.append("y")
        args.append(structured(kind, rand(B, W)))
    # Outputs: the last state, or a Stack of several states (repeated, out of order, inputs of the
    # same type among them), possibly beside a single state.
    names = list(range(steps)) + (["pre"] if h0_form == "layer" else [])
    same_type = names + (["y"] if pattern == "twice" else []) + (["h0"] if h0_form == "batched" else [])
    if draw(st.booleans()):
        outputs = steps - 1
    else:
        stacked = draw(st.lists(st.sampled_from(same_type), min_size=1, max_size=6))
        extra = draw(st.lists(st.sampled_from(names), max_size=2, unique=True))
        outputs = [lbp.Stack(stacked), *extra]
    net = lbp.Network(layers, inputs, outputs)
    # checkpoints=k cuts the network only for k < N − 1: mostly such k, sometimes None or larger.
    checkpoints = draw(st.one_of(st.integers(1, max(1, len(layers) - 2)), st.none(), st.integers(1, 12)))
    return net, params, tuple(args), checkpoints


def loss_of(net):
    def loss(params, *inputs):
        outs = net(params, *inputs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        return sum(jnp.sum(jnp.sin(o) + 0.5 * o**2) for o in jax.tree.leaves(outs))

    return loss


def tangents_like(tree, seed=0):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(np.shape(x)), x.dtype), tree)


# Programs, written once against (grad, value_and_grad, jvp).
def grad_all(G, VG, J, loss, net, n):
    return lambda p, *xs: G(loss, tuple(range(1 + n)))(p, *xs)


def value_and_grad(G, VG, J, loss, net, n):
    return lambda p, *xs: VG(loss)(p, *xs)


def forward_mode(G, VG, J, loss, net, n):
    return lambda p, *xs: J(loss, (p, *xs), tangents_like((p, *xs)))


def hvp(G, VG, J, loss, net, n):
    return lambda p, *xs: jax.jvp(lambda q: G(loss)(q, *xs), (p,), (tangents_like(p, 1),))


def tangentless_call(G, VG, J, loss, net, n):
    """A second call of the network whose arguments carry no tangent, inside the transform."""
    def outer(p, *xs):
        fixed = loss(jax.lax.stop_gradient(p), *jax.lax.stop_gradient(xs))
        return loss(p, *xs) * jnp.cos(fixed)

    return lambda p, *xs: VG(outer)(p, *xs)


PROGRAMS = [grad_all, value_and_grad, forward_mode, hvp, tangentless_call]


def assert_same(actual, expected):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        assert a.dtype == e.dtype and a.shape == e.shape, (a.dtype, e.dtype, a.shape, e.shape)
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(e, np.float64), rtol=1e-8, atol=1e-10)


@given(sequence_networks(), st.sampled_from(PROGRAMS), st.booleans())
def test_sequence_paths_match_plain_jax(case, program, jit):
    net, params, args, k = case
    loss = loss_of(net)
    ours = program(lambda f, *a, **kw: lbp.grad_by_solve(f, *a, checkpoints=k, **kw),
                   lambda f, *a, **kw: lbp.value_and_grad_by_solve(f, *a, checkpoints=k, **kw),
                   lbp.jvp_by_solve, loss, net, len(args))
    ref = program(jax.grad, jax.value_and_grad, jax.jvp, loss, net, len(args))
    if jit:
        ours, ref = jax.jit(ours), jax.jit(ref)
    assert_same(ours(params, *args), ref(params, *args))


# -- the cases found by the harness's first run, as plain tests ---------------------------------
def _two_inputs_then_one_state_twice(segments: int = 3):
    f = lambda th, a, b: jnp.tanh(a * th[0] + b)
    g = lambda th, a: jnp.sin(a) + th[0]
    layers = []
    for s in range(segments):
        reads = ("x", "y") if s == 0 else (f"b{s - 1}", f"b{s - 1}")
        layers += [lbp.Layer(f"a{s}", f, reads, ("w",)), lbp.Layer(f"b{s}", g, (f"a{s}",), ("c",))]
    return lbp.Network(layers, ["x", "y"], f"b{segments - 1}")


@pytest.mark.parametrize("checkpoints", [None, 1, 2, 3, 4])
def test_first_segment_reading_two_inputs_is_not_merged_into_one(checkpoints):
    """a_0 = f(x, y), a_s = f(b_{s−1}, b_{s−1}): the first segment is no translate of the others
    (both inputs would map to one state); value and gradient as jax.value_and_grad's, and the
    value of a call without tangents too."""
    net = _two_inputs_then_one_state_twice()
    p = {"w": jnp.array([0.3, 0.7]), "c": jnp.array([0.1, -0.2])}
    x, y = jnp.array([1.0, 2.0]), jnp.array([-0.5, 0.4])
    loss = lambda p, x, y: jnp.sum(net(p, x, y) ** 2)
    assert_same(lbp.value_and_grad_by_solve(loss, (0, 1, 2), checkpoints=checkpoints)(p, x, y),
                jax.jit(jax.value_and_grad(loss, (0, 1, 2)))(p, x, y))
    outer = lambda p: loss(jax.lax.stop_gradient(p), x, y) + jnp.sum(p["w"])
    assert_same(lbp.value_and_grad_by_solve(outer, checkpoints=checkpoints)(p), jax.jit(jax.value_and_grad(outer))(p))


@pytest.mark.parametrize("h0", [jnp.zeros(4), jnp.zeros((5, 4), jnp.float32), (jnp.zeros((5, 4)), jnp.ones(4))])
def test_checkpointed_rnn_whose_initial_state_has_another_type(h0):
    """h0 unbatched and broadcast by the cell, float32 under x64, or a tuple with an unbatched
    part: the scanned segments carry the cell's type; the first runs on its own."""
    T = 12

    def step(th, h, x):
        h = h if isinstance(h, tuple) else (h, h)
        return jnp.tanh(x @ th[0] + (h[0] + h[1]) @ th[1])

    layers = [lbp.Layer(t, step, (t - 1 if t else "h0", lbp.Row("xs", t)), ("Wx", "Wh")) for t in range(T)]
    net = lbp.Network(layers, ["h0", "xs"], T - 1)
    p = {"Wx": 0.3 * jnp.ones((3, 4)), "Wh": 0.5 * jnp.eye(4)}
    xs = jnp.asarray(np.random.default_rng(0).standard_normal((T, 5, 3)))
    loss = lambda p, h0, xs: jnp.sum(net(p, h0, xs) ** 2)
    for k in (2, 3, 5):
        assert_same(lbp.grad_by_solve(loss, (0, 1, 2), checkpoints=k)(p, h0, xs),
                    jax.jit(jax.grad(loss, (0, 1, 2)))(p, h0, xs))


@pytest.mark.parametrize("param_products", ["auto", "after", "in_loop"])
@pytest.mark.parametrize("engine", ["loop", "unrolled"])
def test_hessian_vector_products_of_one_layer_networks(param_products, engine):
    """jax.jvp of grad_by_solve on a one-layer network, array and tuple states."""
    x = jnp.arange(3.0)
    for fn in (lambda th, x: jnp.tanh(x * th[0]) * th[1],
               lambda th, x: (jnp.tanh(x * th[0]), x * th[1])):
        net = lbp.Network([lbp.Layer("h", fn, ("x",), ("w", "v"))], ["x"], "h")
        loss = lambda p, x: sum(jnp.sum(jnp.sin(o) + o**2) for o in jax.tree.leaves(net(p, x)))
        p = {"w": jnp.array(0.5), "v": jnp.array(1.5)}
        t = {"w": jnp.array(0.3), "v": jnp.array(-1.0)}
        G = lbp.grad_by_solve(loss, param_products=param_products, engine=engine)
        assert_same(jax.jvp(lambda q: G(q, x), (p,), (t,)),
                    jax.jit(lambda: jax.jvp(lambda q: jax.grad(loss)(q, x), (p,), (t,)))())


def test_network_whose_outputs_are_inputs_only():
    """Every layer dead: the outputs are the inputs, as in the plain call."""
    net = lbp.Network([lbp.Layer("h", lambda th, x: x * th[0], ("x",), ("w",))], ["x"], ["x", lbp.Stack(["x", "x"])])
    loss = lambda p, x: jnp.sum(net(p, x)[0] ** 2) + jnp.sum(jnp.sin(net(p, x)[1]))
    p, x = {"w": jnp.array(2.0)}, jnp.arange(3.0)
    assert_same(lbp.grad_by_solve(loss, (0, 1))(p, x), jax.jit(jax.grad(loss, (0, 1)))(p, x))
    assert_same(lbp.jvp_by_solve(loss, (p, x), (p, x)), jax.jit(lambda: jax.jvp(loss, (p, x), (p, x)))())


def test_stack_of_a_python_scalar_input_and_a_state():
    """A weakly typed input beside a strongly typed state of the same shape: stacked as jnp.stack
    stacks them."""
    net = lbp.Network([lbp.Layer("h", lambda th, x: jnp.sin(x) * th[0], ("x",), ("w",))], ["x"], lbp.Stack(["x", "h"]))
    loss = lambda p, x: jnp.sum(net(p, x) ** 2)
    p = {"w": jnp.array(1.3)}
    assert_same(lbp.value_and_grad_by_solve(loss, (0, 1))(p, 0.7), jax.value_and_grad(loss, (0, 1))(p, 0.7))
    assert_same(lbp.jvp_by_solve(lambda p: net(p, 0.7), (p,), (p,)), jax.jvp(lambda p: net(p, 0.7), (p,), (p,)))
