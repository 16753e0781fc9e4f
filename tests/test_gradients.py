"""grad_by_solve / value_and_grad_by_solve / jvp_by_solve against jax.grad / jax.jvp of the same
plain-JAX network (outside the transforms a Network call is ordinary JAX code)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from networks import REGISTRY
from trees import assert_trees_close as shared_trees_close

import linbackprop as lbp

RTOL = 1e-9


def assert_trees_close(actual, expected, rtol=RTOL, atol=1e-12):
    shared_trees_close(actual, expected, rtol=rtol, atol=atol, dtypes=True)


@pytest.fixture(params=sorted(REGISTRY))
def case(request):
    return REGISTRY[request.param]()


def all_argnums(case):
    return tuple(range(1 + len(case.inputs)))


@pytest.mark.users_settings
def test_grad_matches_jax_grad(case):
    argnums = all_argnums(case)
    expected = jax.grad(case.loss, argnums)(case.params, *case.inputs)
    actual = lbp.grad_by_solve(case.loss, argnums)(case.params, *case.inputs)
    assert_trees_close(actual, expected)


def test_value_and_grad_matches(case):
    value, grads = lbp.value_and_grad_by_solve(case.loss)(case.params, *case.inputs)
    ref_value, ref_grads = jax.value_and_grad(case.loss)(case.params, *case.inputs)
    np.testing.assert_allclose(value, ref_value, rtol=1e-12)
    assert_trees_close(grads, ref_grads)


def test_jit_grad_matches_with_the_loop_engine(case):
    """The registry's networks are small, so "auto" unrolls them; here the fori_loop engine runs."""
    expected = jax.grad(case.loss)(case.params, *case.inputs)
    assert_trees_close(jax.jit(lbp.grad_by_solve(case.loss, engine="loop"))(case.params, *case.inputs), expected)


@pytest.mark.users_settings
def test_jvp_matches_jax_jvp(case):
    rng = np.random.default_rng(7)
    primals = (case.params, *case.inputs)
    tangents = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(np.shape(x))), primals)
    out, tan = lbp.jvp_by_solve(case.loss, primals, tangents)
    ref_out, ref_tan = jax.jvp(case.loss, primals, tangents)
    np.testing.assert_allclose(out, ref_out, rtol=1e-12)
    np.testing.assert_allclose(tan, ref_tan, rtol=RTOL)


def test_jvp_of_network_outputs(case):
    """Forward mode on the network itself: every output's tangent, not only a scalar loss."""
    rng = np.random.default_rng(8)
    f = lambda p: case.net(p, *case.inputs)
    t = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(np.shape(x))), case.params)
    expected = jax.jvp(f, (case.params,), (t,))[1]
    by_loop = jax.jit(lambda p, t: lbp.jvp_by_solve(f, (p,), (t,), engine="loop")[1])
    assert_trees_close(by_loop(case.params, t), expected)


@pytest.mark.users_settings
@pytest.mark.parametrize("name", ["seed", "lstm", "multi_input", "stacked"])  # shared blocks, pytrees, rows
def test_hessian_vector_product(name):
    case = REGISTRY[name]()
    rng = np.random.default_rng(9)
    t = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(np.shape(x))), case.params)

    def hvp(grad):
        return jax.jvp(lambda p: grad(case.loss)(p, *case.inputs), (case.params,), (t,))[1]

    expected = hvp(jax.grad)
    assert_trees_close(hvp(lbp.grad_by_solve), expected, rtol=1e-8, atol=1e-10)
    loop = lambda f: lbp.grad_by_solve(f, engine="loop")
    assert_trees_close(jax.jit(lambda: hvp(loop))(), expected, rtol=1e-8, atol=1e-10)


def test_grad_of_jitted_function_still_solves():
    """jit's cache is keyed on the mode: a plain trace is not reused inside grad_by_solve."""
    case = REGISTRY["chain"]()
    seen = []

    @jax.jit
    def loss(p, x):
        seen.append(lbp.solving())
        return case.loss(p, x)

    loss(case.params, *case.inputs)
    g = lbp.grad_by_solve(loss)(case.params, *case.inputs)
    assert seen == [False, True]
    assert_trees_close(g, jax.grad(case.loss)(case.params, *case.inputs))


def test_solve_is_used_inside_transforms():
    """The solve path is really taken: its jaxpr holds the loops and linbackprop's solve."""
    case = REGISTRY["chain"]()
    plain = str(jax.make_jaxpr(jax.grad(case.loss))(case.params, *case.inputs))
    solved = str(jax.make_jaxpr(lbp.grad_by_solve(case.loss, engine="loop"))(case.params, *case.inputs))
    unrolled = str(jax.make_jaxpr(lbp.grad_by_solve(case.loss))(case.params, *case.inputs))
    assert "linbackprop_solve" not in plain and "scan" not in plain
    assert "linbackprop_solve" in solved and "scan" in solved
    assert "linbackprop_solve" in unrolled and "scan" not in unrolled  # a 3-layer net: auto unrolls
    with pytest.raises(ValueError, match="engine must be one of"):
        lbp.grad_by_solve(case.loss, engine="fast")


def test_has_aux():
    case = REGISTRY["skips"]()

    def loss(p, x):
        v = case.loss(p, x)
        return v, {"value": v}

    (g, aux) = lbp.grad_by_solve(loss, has_aux=True)(case.params, *case.inputs)
    (rg, raux) = jax.grad(loss, has_aux=True)(case.params, *case.inputs)
    assert_trees_close(g, rg)
    np.testing.assert_allclose(aux["value"], raux["value"])
    (_, aux), g = lbp.value_and_grad_by_solve(loss, has_aux=True)(case.params, *case.inputs)
    assert_trees_close(g, rg)


def test_network_called_twice_several_networks_and_regulariser():
    a, b = REGISTRY["chain"](), REGISTRY["skips"]()
    params = {**a.params, **{f"s_{k}": v for k, v in b.params.items()}}
    renamed = lbp.Network(
        [lbp.Layer(layer.name, layer.fn, layer.reads, tuple(f"s_{p}" for p in layer.params)) for layer in b.net.layers],
        b.net.inputs, list(b.net.outputs))
    x2 = b.inputs[0]

    def loss(p, x):
        y1 = a.net(p, x)
        y2 = a.net(p, 2.0 * x + 0.1)  # the same network again, at another input
        e, d = renamed(p, x2)
        return jnp.sum(y1 * y2) + jnp.sum(e**2) + jnp.sum(d) + 0.3 * jnp.sum(p["W1"] ** 2) + jnp.sum(p["s_Wa"])

    assert_trees_close(lbp.grad_by_solve(loss, (0, 1))(params, *a.inputs), jax.grad(loss, (0, 1))(params, *a.inputs))


def test_vmap_per_example_gradients():
    case = REGISTRY["skips"]()
    xs = jnp.stack([case.inputs[0] * s for s in (1.0, -0.5, 2.0)])[:, :2]
    per_example = lambda grad: jax.vmap(grad(case.loss), in_axes=(None, 0))(case.params, xs)
    assert_trees_close(jax.jit(lambda: per_example(lbp.grad_by_solve))(), per_example(jax.grad))
    loop = lambda f: lbp.grad_by_solve(f, engine="loop")
    assert_trees_close(jax.jit(lambda: per_example(loop))(), per_example(jax.grad))


def test_extra_param_blocks_are_ignored_and_get_zero_gradient():
    case = REGISTRY["chain"]()
    params = {**case.params, "unused": jnp.ones(3)}
    g = lbp.grad_by_solve(case.loss)(params, *case.inputs)
    np.testing.assert_array_equal(g["unused"], np.zeros(3))
    assert_trees_close(g, jax.grad(case.loss)(params, *case.inputs))


def test_hessian_of_tiny_network():
    case = REGISTRY["chain"]()
    f = lambda b: case.loss({**case.params, "b1": b}, *case.inputs)
    expected = jax.hessian(f)(case.params["b1"])
    with_solve = jax.jacfwd(lbp.grad_by_solve(f))(case.params["b1"])
    np.testing.assert_allclose(with_solve, expected, rtol=1e-8, atol=1e-12)
