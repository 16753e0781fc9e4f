"""dtypes: float64 / float32 / bfloat16 keep each parameter's dtype and match jax.grad; complex
parameters follow JAX's convention; integer inputs and integer states carry no gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import linbackprop as lbp


def dense(th, x):
    return jnp.tanh(x @ th[0] + th[1])


def skip(th, x, s):
    return jnp.tanh(x @ th[0] + s @ th[1])


NET = lbp.Network([lbp.Layer("h", dense, ("x",), ("W1", "b1")), lbp.Layer("g", dense, ("h",), ("W2", "b2")),
                   lbp.Layer("y", skip, ("g", "x"), ("W3", "S"))], ["x"], "y")
SHAPES = {"W1": (3, 4), "b1": (4,), "W2": (4, 4), "b2": (4,), "W3": (4, 2), "S": (3, 2)}


def problem(dtypes, seed=0):
    rng = np.random.default_rng(seed)
    params = {k: jnp.asarray(0.5 * rng.standard_normal(s), dtypes.get(k, dtypes["x"])) for k, s in SHAPES.items()}
    return params, jnp.asarray(rng.standard_normal((5, 3)), dtypes["x"])


def loss(p, x):
    return jnp.sum(NET(p, x).astype(jnp.float32) ** 2)


@pytest.mark.parametrize("dtype,rtol", [(jnp.float64, 1e-12), (jnp.float32, 1e-5), (jnp.bfloat16, None)])
def test_floating_dtypes_keep_dtype_and_match(dtype, rtol):
    params, x = problem({"x": dtype})
    ours = jax.jit(lbp.grad_by_solve(loss, (0, 1)))(params, x)
    ref = jax.grad(loss, (0, 1))(params, x)
    for a, e in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
        assert a.dtype == e.dtype == dtype
        if rtol is not None:
            np.testing.assert_allclose(a, e, rtol=rtol, atol=rtol)
    if dtype == jnp.bfloat16:  # rounding differs: compare both with the float64 truth instead
        truth = jax.grad(loss, (0, 1))(*jax.tree.map(lambda v: v.astype(jnp.float64), (params, x)))
        for a, e, t in zip(jax.tree.leaves(ours), jax.tree.leaves(ref), jax.tree.leaves(truth)):
            scale = float(jnp.max(jnp.abs(t))) + 1e-3
            ours_err = float(jnp.max(jnp.abs(a.astype(jnp.float64) - t))) / scale
            ref_err = float(jnp.max(jnp.abs(e.astype(jnp.float64) - t))) / scale
            assert ours_err <= max(4 * ref_err, 0.05), (ours_err, ref_err)


def test_mixed_dtypes_each_gradient_keeps_its_blocks_dtype():
    params, x = problem({"x": jnp.float32, "W1": jnp.float64, "b1": jnp.bfloat16, "S": jnp.float16})
    ours = lbp.grad_by_solve(loss)(params, x)
    ref = jax.grad(loss)(params, x)
    for k in SHAPES:
        assert ours[k].dtype == ref[k].dtype == params[k].dtype
        np.testing.assert_allclose(ours[k].astype(float), ref[k].astype(float), rtol=1e-2, atol=1e-2)


def test_complex_parameters_follow_jax_convention():
    rng = np.random.default_rng(1)
    params = {k: jnp.asarray(rng.standard_normal(s) + 1j * rng.standard_normal(s)) for k, s in SHAPES.items()}
    x = jnp.asarray(rng.standard_normal((5, 3)))
    real_loss = lambda p, x: jnp.sum(jnp.abs(NET(p, x)) ** 2)
    ours, ref = lbp.grad_by_solve(real_loss)(params, x), jax.grad(real_loss)(params, x)
    for k in SHAPES:
        assert ours[k].dtype == jnp.complex128
        np.testing.assert_allclose(ours[k], ref[k], rtol=1e-10)
    h = jax.tree.map(jnp.ones_like, params)
    np.testing.assert_allclose(lbp.jvp_by_solve(real_loss, (params, x), (h, jnp.zeros_like(x)))[1],
                               jax.jvp(real_loss, (params, x), (h, jnp.zeros_like(x)))[1], rtol=1e-10)


EMBED = lbp.Network([lbp.Layer("e", lambda th, ids: th[0][ids], ("ids",), ("E",)),
                     lbp.Layer("y", dense, ("e",), ("W", "b"))], ["ids"], "y")


def embed_problem():
    rng = np.random.default_rng(2)
    params = {"E": jnp.asarray(rng.standard_normal((10, 4))), "W": jnp.asarray(rng.standard_normal((4, 2))),
              "b": jnp.zeros(2)}
    return params, jnp.array([1, 3, 3, 7])


@pytest.mark.parametrize("engine", ["auto", "loop"])
def test_integer_inputs_have_no_gradient(engine):
    params, ids = embed_problem()
    embed_loss = lambda p, ids: jnp.sum(EMBED(p, ids) ** 2)
    ours, ref = jax.jit(lbp.grad_by_solve(embed_loss, engine=engine))(params, ids), jax.grad(embed_loss)(params, ids)
    for k in params:
        np.testing.assert_allclose(ours[k], ref[k], rtol=1e-12)
    with pytest.raises(TypeError, match="int"):  # exactly as jax.grad
        lbp.grad_by_solve(embed_loss, (0, 1))(params, ids)
    float0 = np.zeros(ids.shape, jax.dtypes.float0)
    h = jax.tree.map(jnp.ones_like, params)
    np.testing.assert_allclose(lbp.jvp_by_solve(embed_loss, (params, ids), (h, float0), engine=engine)[1],
                               jax.jvp(embed_loss, (params, ids), (h, float0))[1], rtol=1e-12)


@pytest.mark.parametrize("engine", ["auto", "loop"])
def test_integer_states_inside_the_network(engine):
    net = lbp.Network([lbp.Layer("h", dense, ("x",), ("W1", "b1")),
                       lbp.Layer("k", lambda th, h: jnp.argmax(h, -1), ("h",)),
                       lbp.Layer("y", lambda th, h, k: h * k[:, None] @ th[0], ("h", "k"), ("W2",))], ["x"], ["y", "k"])
    params, x = problem({"x": jnp.float64})
    int_loss = lambda p, x: jnp.sum(net(p, x)[0] ** 2)
    ours, ref = lbp.grad_by_solve(int_loss, (0, 1), engine=engine)(params, x), jax.grad(int_loss, (0, 1))(params, x)
    for a, e in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, e, rtol=1e-12)
    h = (jax.tree.map(jnp.ones_like, params), jnp.ones_like(x))
    np.testing.assert_allclose(lbp.jvp_by_solve(int_loss, (params, x), h, engine=engine)[1],
                               jax.jvp(int_loss, (params, x), h)[1], rtol=1e-12)
