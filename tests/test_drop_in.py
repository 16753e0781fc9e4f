"""Regression tests for programs users wrote where grad_by_solve was not a drop-in for jax.grad:
a different gradient without an error, or a crash where jax.grad works."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads
from networks import REGISTRY
from trees import assert_trees_close as shared_trees_close

import linbackprop as lbp
from linbackprop._options import _settings
from linbackprop._solve import prepare

SETTINGS = [dict(engine="unrolled"), dict(engine="loop"), dict(engine="unrolled", param_products="after"),
            dict(engine="loop", param_products="in_loop"), dict(engine="loop", remat=True),
            dict(engine="unrolled", remat=True)]


def assert_trees_close(actual, expected, rtol=1e-9, atol=1e-11):
    shared_trees_close(actual, expected, rtol=rtol, atol=atol, dtypes=True)


# -- 1. layers merged into one kind because their functions compared equal ---------------------------
def test_lambdas_whose_defaults_differ_only_in_the_sign_of_zero_run_their_own_code():
    fns = [lambda th, u, c=c: u @ th[0] + jnp.copysign(1.0, c) for c in (0.0, -0.0)]
    net = lbp.Network([lbp.Layer(1, fns[0], (0,), ("W",)), lbp.Layer(2, fns[1], (1,), ("W",))], [0], 2)
    loss = lambda p, x: jnp.sum(net(p, x) ** 2)
    p, x = {"W": jnp.eye(2)}, jnp.ones((1, 2))
    for settings in SETTINGS:
        value, grads = lbp.value_and_grad_by_solve(loss, **settings)(p, x)
        ref_value, ref_grads = jax.value_and_grad(loss)(p, x)
        assert float(value) == float(ref_value) == 2.0
        assert_trees_close(grads, ref_grads)


@dataclasses.dataclass(frozen=True)
class Scale:
    """A layer as a frozen dataclass whose factor is left out of ==."""

    factor: float = dataclasses.field(compare=False)

    def __call__(self, theta, u):
        return u * self.factor * theta[0]


def test_frozen_dataclass_layers_with_a_field_left_out_of_eq_are_not_merged():
    net = lbp.Network([lbp.Layer(1, Scale(2.0), (0,), ("w",)), lbp.Layer(2, Scale(5.0), (1,), ("w",))], [0], 2)
    loss = lambda p, x: jnp.sum(net(p, x) ** 2)
    p, x = {"w": jnp.array(1.5)}, jnp.ones((1, 2))
    for settings in SETTINGS:
        assert_trees_close(lbp.value_and_grad_by_solve(loss, **settings)(p, x), jax.value_and_grad(loss)(p, x))


def test_two_networks_of_equal_but_different_functions_do_not_share_a_trace():
    def make(a, b):
        return lbp.Network([lbp.Layer(1, Scale(a), (0,), ("w",)), lbp.Layer(2, Scale(b), (1,), ("w",))], [0], 2)

    first, second = make(2.0, 5.0), make(3.0, 7.0)
    assert first != second  # the functions are equal by ==, not the same objects
    p, x = {"w": jnp.array(1.0)}, jnp.ones((1, 2))
    for net in (first, second, first):
        loss = lambda p, x, net=net: jnp.sum(net(p, x) ** 2)
        assert_trees_close(jax.jit(lbp.value_and_grad_by_solve(loss))(p, x), jax.value_and_grad(loss)(p, x))


def test_layers_made_by_one_factory_still_share_a_kind():
    def make(act):
        return lambda th, u: act(u @ th[0])

    net = lbp.Network([lbp.Layer(i, make(jnp.tanh), (i - 1,), (lbp.Row("W", i - 1),)) for i in range(1, 33)], [0], 32)
    loss = lambda p, x: jnp.sum(net(p, x) ** 2)
    p, x = {"W": 0.3 * jnp.ones((32, 2, 2))}, jnp.ones((1, 2))
    plan = lbp._plan.plan_for(net, net.select_params(p), (x,))
    assert len(plan.kinds) == 1 and not plan.unrolled
    assert_trees_close(lbp.grad_by_solve(loss)(p, x), jax.grad(loss)(p, x))


def test_a_row_and_a_tuple_block_name_are_different_networks():
    f = lambda th, u: u * th[0]
    by_row = lbp.Network([lbp.Layer(1, f, (0,), (lbp.Row("W", 1),))], [0], 1)
    by_name = lbp.Network([lbp.Layer(1, f, (0,), (("W", 1),))], [0], 1)
    assert by_row != by_name


# -- 2. reverse over reverse ----------------------------------------------------------------------------
@pytest.mark.parametrize("settings", SETTINGS[::2], ids=str)
def test_gradient_penalty_through_grad_by_solve_on_a_shallow_network(settings):
    case = REGISTRY["skips"]()
    x = case.inputs[0]
    penalty = lambda g: sum(jnp.sum(leaf**2) for leaf in jax.tree.leaves(g))  # WGAN-GP, sharpness terms
    ours = jax.jit(jax.grad(lambda p: penalty(lbp.grad_by_solve(case.loss, **settings)(p, x))))(case.params)
    ref = jax.jit(jax.grad(lambda p: penalty(jax.grad(case.loss)(p, x))))(case.params)
    assert_trees_close(ours, ref, rtol=1e-8)
    twice = lbp.grad_by_solve(lambda p: penalty(lbp.grad_by_solve(case.loss, **settings)(p, x)), **settings)
    assert_trees_close(jax.jit(twice)(case.params), ref, rtol=1e-8)


def test_input_gradient_penalty_with_jacrev():
    case = REGISTRY["seed"]()
    x = case.inputs[0]
    r1 = lambda p, x: jnp.sum(lbp.grad_by_solve(case.loss, argnums=1)(p, x) ** 2)  # R1 penalty
    ref = lambda p, x: jnp.sum(jax.grad(case.loss, argnums=1)(p, x) ** 2)
    assert_trees_close(jax.jit(jax.jacrev(r1))(case.params, x), jax.jit(jax.jacrev(ref))(case.params, x), rtol=1e-8)


def test_maml_inner_step():
    case = REGISTRY["chain"]()
    x = case.inputs[0]

    def adapted_loss(grad, p):
        inner = grad(case.loss)(p, x)
        return case.loss(jax.tree.map(lambda a, g: a - 0.1 * g, p, inner), 0.5 * x)

    ours = jax.grad(functools.partial(adapted_loss, lbp.grad_by_solve))(case.params)
    assert_trees_close(ours, jax.grad(functools.partial(adapted_loss, jax.grad))(case.params), rtol=1e-8)


@pytest.mark.parametrize("settings", [dict(engine="unrolled"), dict(engine="loop", param_products="after")], ids=str)
def test_check_grads_of_grad_by_solve_to_second_order(settings):
    case = REGISTRY["chain"]()
    x = case.inputs[0]
    grad = jax.jit(lbp.grad_by_solve(lambda p: case.loss(p, x), **settings))
    check_grads(grad, (case.params,), order=2, modes=("fwd", "rev"), eps=1e-6, atol=1e-5, rtol=1e-5)


# -- 3. keys, bools and integers in inputs and states ------------------------------------------------------
def dropout_network(depth: int) -> lbp.Network:
    """Dropout that threads its PRNG key through the layers inside a pytree state."""

    def first(th, x, key):
        h = x @ th[0]
        return {"h": h, "key": key, "step": jnp.int32(0), "alive": jnp.ones(h.shape, bool)}

    def drop(th, s):
        key, sub = jax.random.split(s["key"])
        keep = jax.random.bernoulli(sub, 0.8, s["h"].shape)
        h = jnp.where(keep, jnp.tanh(s["h"] @ th[0] + th[1]) / 0.8, 0.0)
        return {"h": h, "key": key, "step": s["step"] + 1, "alive": s["alive"] & keep}

    def head(th, s):
        return (s["h"] * s["alive"]) @ th[0] * s["step"]

    layers = [lbp.Layer(0, first, ("x", "key"), ("Win",))]
    layers += [lbp.Layer(i, drop, (i - 1,), (lbp.Row("W", i - 1), lbp.Row("b", i - 1))) for i in range(1, depth)]
    layers += [lbp.Layer("y", head, (depth - 1,), ("Wout",))]
    return lbp.Network(layers, ["x", "key"], "y")


@pytest.mark.parametrize("depth", [3, 20])
def test_dropout_threading_a_typed_prng_key_through_pytree_states(depth):
    net = dropout_network(depth)
    k = jax.random.split(jax.random.key(0), 4)
    p = {"Win": jax.random.normal(k[0], (3, 4), jnp.float64), "W": 0.5 * jax.random.normal(k[1], (depth, 4, 4)),
         "b": jnp.zeros((depth, 4)), "Wout": jax.random.normal(k[2], (4, 1), jnp.float64)}
    x, key = jax.random.normal(k[3], (5, 3), jnp.float64), jax.random.key(1)
    loss = lambda p, x, key: jnp.sum(net(p, x, key) ** 2)
    for settings in SETTINGS[:3]:
        grads = jax.jit(lbp.grad_by_solve(loss, (0, 1, 2), allow_int=True, **settings))(p, x, key)
        ref = jax.grad(loss, (0, 1, 2), allow_int=True)(p, x, key)
        assert grads[2].dtype == ref[2].dtype == jax.dtypes.float0
        assert_trees_close(grads[:2], ref[:2])
    primals, tangents = (p, x), jax.tree.map(jnp.ones_like, (p, x))
    ours = lbp.jvp_by_solve(lambda p, x: loss(p, x, key), primals, tangents)
    assert_trees_close(ours, jax.jvp(lambda p, x: loss(p, x, key), primals, tangents))
    lin = lbp.linearize(net, p, x, key)
    lam = lin.L.T.solve({name: jax.tree.map(jnp.zeros_like, s) if name != "y" else jnp.ones_like(s)
                         for name, s in lin.layer_states.items()})
    assert lam[0]["key"].dtype == jax.dtypes.float0
    assert_trees_close(lin.M.mv(lam), jax.grad(lambda p: jnp.sum(net(p, x, key)))(p))


def test_an_integer_leaf_beside_floats_in_a_state_does_not_stop_the_gradient():
    step = lambda th, s: {"h": jnp.tanh(s["h"] @ th[0]), "n": s["n"] + 1}
    layers = [lbp.Layer(0, lambda th, x: {"h": x @ th[0], "n": jnp.int32(0)}, ("x",), ("Win",))]
    layers += [lbp.Layer(i, step, (i - 1,), (lbp.Row("W", i - 1),)) for i in range(1, 20)]
    layers += [lbp.Layer("y", lambda th, s: s["h"] @ th[0] * s["n"], (19,), ("Wout",))]
    net = lbp.Network(layers, ["x"], "y")
    rng = np.random.default_rng(0)
    p = {"Win": rng.standard_normal((3, 4)), "W": 0.5 * rng.standard_normal((20, 4, 4)),
         "Wout": rng.standard_normal((4, 1))}
    x = rng.standard_normal((5, 3))
    loss = lambda p, x: jnp.sum(net(p, x) ** 2)
    for settings in SETTINGS:
        assert_trees_close(lbp.grad_by_solve(loss, **settings)(p, x), jax.grad(loss)(p, x))


# -- 4. layers that reach no output, NaN and inf -----------------------------------------------------------
def test_nan_input_read_only_by_a_metrics_branch_leaves_the_gradient_finite():
    dense = lambda th, x: jnp.tanh(x @ th[0])
    net = lbp.Network([lbp.Layer("a", dense, ("x",), ("W1",)), lbp.Layer("logits", dense, ("a",), ("W2",)),
                       lbp.Layer("probe", dense, ("m",), ("W3",)), lbp.Layer("probe2", dense, ("probe",), ("W2",))],
                      ["x", "m"], "logits")
    p = {"W1": jnp.ones((3, 3)), "W2": 0.1 * jnp.ones((3, 3)), "W3": jnp.ones((3, 3))}
    x, m = jnp.ones((2, 3)), jnp.array([[jnp.nan, jnp.inf, 1.0]] * 2)
    loss = lambda p, x, m: jnp.sum(net(p, x, m))
    ref = jax.grad(loss, (0, 1, 2))(p, x, m)
    for settings in SETTINGS:
        ours = lbp.grad_by_solve(loss, (0, 1, 2), **settings)(p, x, m)
        assert_trees_close(ours, ref)
        assert np.all(np.asarray(ours[0]["W3"]) == 0.0)
    assert net.live.order == ("a", "logits")


def test_inf_in_a_live_layer_gives_nan_where_jax_grad_does():
    net = lbp.Network([lbp.Layer("a", lambda th, x: jnp.exp(x * th[0]), ("x",), ("w",)),
                       lbp.Layer("b", lambda th, u: u * th[0], ("a",), ("v",))], ["x"], "b")
    p, x = {"w": jnp.array(1.0), "v": jnp.array(2.0)}, jnp.array([1.0, 1000.0, jnp.nan])
    loss = lambda p, x: jnp.sum(net(p, x))
    ref = jax.grad(loss)(p, x)
    for settings in SETTINGS:
        ours = lbp.grad_by_solve(loss, **settings)(p, x)
        for a, e in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
            np.testing.assert_array_equal(np.isnan(a), np.isnan(e))
            np.testing.assert_array_equal(np.isinf(a), np.isinf(e))


@pytest.mark.parametrize("engine", ["loop", "unrolled"])
def test_weakly_typed_and_repeated_arguments_still_reuse_the_forward_linearisation(engine):
    """The forward pass stores residuals (it replays the analysed linearisation, whatever the
    arguments: a weakly typed float, a state passed twice) and the gradient is exact."""
    layers = [lbp.Layer(i, lambda th, u, v: jnp.tanh(u @ th[0]) * v * th[1], (i - 1, i - 1), (lbp.Row("W", i - 1), "s"))
              for i in range(1, 17)]
    net = lbp.Network(layers, [0], 16)
    p, x = {"W": 0.3 * jnp.ones((16, 2, 2)), "s": 1.0}, jnp.ones((1, 2))  # "s": a weakly typed Python float
    seen = []

    def traced(p, x):
        theta = net.select_params(p)
        with _settings.using(_settings.Settings(engine=engine)):
            prim = prepare(net, theta, (x,), _settings.Settings())[1]
        seen.append(prim.residuals is not None)
        return prim.states

    jax.jit(traced)(p, x)
    assert seen == [True]
    loss = lambda p, x: jnp.sum(net(p, x) ** 2)
    assert_trees_close(lbp.grad_by_solve(loss, engine=engine)(p, x), jax.grad(loss)(p, x))


@pytest.mark.parametrize("engine", ["loop", "unrolled"])
def test_python_float_scale_keeps_bfloat16_activations_narrow(engine):
    """A weakly typed parameter (a Python float, jnp.array(1.0)) does not widen the activations it
    multiplies, in the solve as in the plain call."""
    scale = lambda th, u: jnp.tanh(u @ th[0]) * th[1]
    net = lbp.Network([lbp.Layer(i, scale, (i - 1,), (lbp.Row("W", i - 1), "s")) for i in range(1, 17)], [0], 16)
    rng = np.random.default_rng(0)
    p = {"W": jnp.asarray(0.5 * rng.standard_normal((16, 4, 4)), jnp.bfloat16), "s": 1.5}
    x = jnp.asarray(rng.standard_normal((3, 4)), jnp.bfloat16)
    loss = lambda p, x: jnp.sum(net(p, x).astype(jnp.float32) ** 2)
    value, grads = lbp.value_and_grad_by_solve(loss, engine=engine)(p, x)
    ref_value, ref = jax.value_and_grad(loss)(p, x)
    assert grads["W"].dtype == ref["W"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(value, ref_value)
    np.testing.assert_allclose(np.asarray(grads["W"], np.float32), np.asarray(ref["W"], np.float32), rtol=2e-2)
    np.testing.assert_allclose(grads["s"], ref["s"], rtol=2e-2)


def test_a_layer_with_a_nonlinear_custom_vjp_backward_gets_a_clear_error():
    """JAX's clip_gradient example inside a layer: jax.grad calls its backward. The back
    substitution with ℳΛ in the loop calls only that backward too, and gives jax.grad's gradient;
    where the solve needs the layer's forward derivative (ℳ after the loop, forward mode), the
    transpose of that backward, which does not exist, it raises, naming the layer — never a
    wrong gradient."""

    @jax.custom_vjp
    def clip_gradient(x):
        return x

    clip_gradient.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -0.1, 0.1),))
    net = lbp.Network([lbp.Layer("clipped", lambda th, u: clip_gradient(jnp.tanh(u @ th[0])), ("x",), ("W",))],
                      ["x"], "clipped")
    loss = lambda p, x: jnp.sum(net(p, x) ** 2)
    p, x = {"W": jnp.ones((2, 2))}, jnp.ones((1, 2))
    expected = jax.grad(loss)(p, x)
    for a, e in zip(jax.tree.leaves(lbp.grad_by_solve(loss, param_products="in_loop")(p, x)),
                    jax.tree.leaves(expected)):
        np.testing.assert_allclose(a, e, rtol=1e-12)
    with pytest.raises(NotImplementedError, match=r"Layer\(s\) \['clipped'\].*custom_vjp"):
        lbp.grad_by_solve(loss, param_products="after")(p, x)


def test_straight_through_rounding_and_gradient_reversal_layers():
    """custom_vjp functions whose backward is linear in the cotangent work in both engines."""

    @jax.custom_vjp
    def reverse_gradient(x):
        return x

    reverse_gradient.defvjp(lambda x: (x, None), lambda _, g: (-0.5 * g,))

    @jax.custom_vjp
    def straight_through_round(x):
        return jnp.round(x)

    straight_through_round.defvjp(lambda x: (jnp.round(x), None), lambda _, g: (g,))
    layer = lambda th, u: reverse_gradient(jnp.tanh(straight_through_round(4 * u) / 4 @ th[0]))
    net = lbp.Network([lbp.Layer(i, layer, (i - 1,), (lbp.Row("W", i - 1),)) for i in range(1, 21)], [0], 20)
    rng = np.random.default_rng(0)
    p, x = {"W": rng.standard_normal((20, 4, 4))}, rng.standard_normal((3, 4))
    loss = lambda p, x: jnp.sum(net(p, x) ** 2)
    for settings in SETTINGS[:3]:
        assert_trees_close(lbp.grad_by_solve(loss, **settings)(p, x), jax.grad(loss)(p, x))


# -- 2. a layer whose computation changed between calls (a Python global it reads) ----------------
SCALE = [3.0]  # read by the layers below; changed between calls
TABLE = [np.ones(3)]  # a closed-over array constant, replaced between calls


def _scaled(th, x):
    return jnp.tanh(SCALE[0] * th[0] * x + jnp.asarray(TABLE[0]) @ th[1])


def _global_network(depth):
    layers = [lbp.Layer(i, _scaled, (i - 1,), (lbp.Row("w", i - 1), "v")) for i in range(1, depth + 1)]
    return lbp.Network(layers, [0], depth)


def test_a_changed_global_is_seen_by_every_transform_outside_jit(depth=3):
    """Outside the user's jit the result is what jax.grad gives now: a layer reading a global
    that changed is planned and compiled again (value_and_grad_by_solve returned the old value and
    gradient, silently). Every entry point: the transforms, checkpoints, the curvature transforms
    and linearize."""
    net = _global_network(depth)
    p = {"w": 0.3 * jnp.ones((depth, 4)), "v": 0.1 * jnp.ones((3, 4))}
    x = jnp.ones((2, 4))
    loss = lambda p, x: jnp.sum(net(p, x) ** 2)
    losses = lambda p, x: jnp.sum(net(p, x) ** 2, axis=1)
    saved = SCALE[0], TABLE[0]
    try:
        # a Python scalar (a literal of the jaxpr) and a closed-over array (a constant) change
        for scale, table in ((3.0, np.ones(3)), (15.0, np.arange(3.0))):
            SCALE[0], TABLE[0] = scale, table
            value, grads = lbp.value_and_grad_by_solve(loss)(p, x)
            ref_value, ref_grads = jax.value_and_grad(loss)(p, x)
            np.testing.assert_allclose(value, ref_value, rtol=1e-12)
            assert_trees_close(grads, ref_grads)
            assert_trees_close(lbp.grad_by_solve(loss, checkpoints=2)(p, x), ref_grads)
            tangent = jax.tree.map(jnp.ones_like, p)
            assert_trees_close(lbp.jvp_by_solve(loss, (p, x), (tangent, jnp.zeros_like(x))),
                               jax.jvp(loss, (p, x), (tangent, jnp.zeros_like(x))))
            _, g, G = lbp.gauss_newton(loss)(p, x)
            assert_trees_close(g, ref_grads)
            _, jv = jax.jvp(lambda q: net(q, x), (p,), (tangent,))
            assert_trees_close(G.mv(tangent), jax.vjp(lambda q: net(q, x), p)[1](2 * jv)[0])  # H = 2 I
            assert_trees_close(lbp.per_example_grads(losses)(p, x),
                               jax.vmap(jax.grad(lambda p, xb: losses(p, xb[None])[0]), (None, 0))(p, x))
            lin = lbp.linearize(net, p, x)
            assert_trees_close(lin.states[depth], net.states(p, x)[depth])
    finally:
        SCALE[0], TABLE[0] = saved


def test_under_the_users_jit_a_changed_global_is_jaxs_semantics():
    """Inside the user's jit, JAX's caching holds: a compiled step keeps the value it was traced
    with, for jax.grad and for grad_by_solve alike; a new trace sees the new value."""
    net = _global_network(3)
    p, x = {"w": 0.3 * jnp.ones((3, 4)), "v": 0.1 * jnp.ones((3, 4))}, jnp.ones((2, 4))
    loss = lambda p, x: jnp.sum(net(p, x) ** 2)
    saved = SCALE[0]
    try:
        SCALE[0] = 3.0
        ours, theirs = jax.jit(lbp.grad_by_solve(loss)), jax.jit(jax.grad(loss))
        first = ours(p, x)
        assert_trees_close(first, theirs(p, x))
        SCALE[0] = 15.0
        assert_trees_close(ours(p, x), first)  # compiled: as jax.jit(jax.grad) keeps it
        assert_trees_close(theirs(p, x), first)
        assert_trees_close(jax.jit(lbp.grad_by_solve(loss))(p, x), jax.grad(loss)(p, x))  # traced now
    finally:
        SCALE[0] = saved
