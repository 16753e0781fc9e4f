"""Composition: NaN and inf propagate as in jax.grad, no retracing, optax steps equal jax.grad's."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from networks import REGISTRY

import linbackprop as lbp


def assert_same_with_nonfinite(actual, expected):
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        a, e = np.asarray(a), np.asarray(e)
        np.testing.assert_array_equal(np.isnan(a), np.isnan(e))
        np.testing.assert_array_equal(np.isposinf(a), np.isposinf(e))
        np.testing.assert_array_equal(np.isneginf(a), np.isneginf(e))
        finite = np.isfinite(e)
        np.testing.assert_allclose(a[finite], e[finite], rtol=1e-9, atol=1e-12)


def test_nan_and_inf_propagate_like_jax_grad():
    case = REGISTRY["skips"]()
    params = dict(case.params)
    params["Wb"] = params["Wb"].at[0, 1].set(jnp.nan)
    x = case.inputs[0].at[2, 0].set(jnp.inf).at[3, 1].set(-jnp.inf)
    for p, xx in ((params, case.inputs[0]), (case.params, x), (params, x)):
        ours = jax.jit(lbp.grad_by_solve(case.loss, (0, 1)))(p, xx)
        ref = jax.jit(jax.grad(case.loss, (0, 1)))(p, xx)
        assert_same_with_nonfinite(ours, ref)
        assert any(not np.all(np.isfinite(leaf)) for leaf in jax.tree.leaves(ours))
    t = jax.tree.map(jnp.ones_like, (params, x))
    assert_same_with_nonfinite(lbp.jvp_by_solve(case.loss, (params, x), t),
                               jax.jit(lambda: jax.jvp(case.loss, (params, x), t))())


def test_second_call_with_same_shapes_does_not_retrace():
    case = REGISTRY["densenet"]()
    traces = []

    def loss(p, x):
        traces.append(None)
        return case.loss(p, x)

    step = jax.jit(lbp.grad_by_solve(loss))
    first = step(case.params, *case.inputs)
    again = step(jax.tree.map(lambda v: v * 1.5, case.params), case.inputs[0] + 1.0)
    assert len(traces) == 1
    assert jax.tree.structure(first) == jax.tree.structure(again)
    step(case.params, jnp.concatenate([case.inputs[0]] * 2))  # a new batch size traces again
    assert len(traces) == 2


@pytest.mark.users_settings
def test_optax_training_steps_equal_those_with_jax_grad():
    case = REGISTRY["stacked"]()
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=1e-3))

    def train(grad):
        @jax.jit
        def step(p, s, x):
            updates, s = optimizer.update(grad(case.loss)(p, x), s, p)
            return optax.apply_updates(p, updates), s

        p, s = case.params, optimizer.init(case.params)
        for n in range(4):
            p, s = step(p, s, case.inputs[0] * (1 + 0.1 * n))
        return p

    ours, ref = train(lbp.grad_by_solve), train(jax.grad)
    for a, e in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, e, rtol=1e-9, atol=1e-12)
    assert not np.allclose(jax.tree.leaves(ours)[0], jax.tree.leaves(case.params)[0])


@pytest.mark.parametrize("engine", ["loop", "unrolled"])
def test_forward_mode_nests_with_reverse_mode_both_ways(engine):
    """jvp_by_solve runs its substitution inside the forward sweep (its tangents are never
    transposed by the solve): jax.grad of it differentiates that sweep, and jvp_by_solve of
    grad_by_solve (a Hessian-vector product) still transposes the solve."""
    case = REGISTRY["lstm"]()
    f = lambda q: case.loss(q, *case.inputs)
    t = jax.tree.map(lambda a: jnp.full_like(a, 0.3), case.params)
    expected = jax.jit(jax.grad(lambda q: jax.jvp(f, (q,), (t,))[1]))(case.params)  # = the HVP too
    checks = {
        "grad of jvp_by_solve": jax.grad(lambda q: lbp.jvp_by_solve(f, (q,), (t,), engine=engine)[1])(case.params),
        "grad_by_solve of jvp_by_solve": lbp.grad_by_solve(
            lambda q: lbp.jvp_by_solve(f, (q,), (t,), engine=engine)[1], engine=engine)(case.params),
        "jvp_by_solve of grad_by_solve": lbp.jvp_by_solve(lbp.grad_by_solve(f, engine=engine), (case.params,), (t,),
                                                          engine=engine)[1],
    }
    for what, got in checks.items():
        for a, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
            np.testing.assert_allclose(a, e, rtol=1e-9, atol=1e-12, err_msg=what)
