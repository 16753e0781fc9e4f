"""ℳΛ's short contractions with the contracted axes moved last first (`_contractions`): the same
values as the products JAX wrote, on the products it is meant for and untouched elsewhere; and
the gradient's solve uses it on CPU (`Policy.contract_first_rows`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from networks import equations, residual

import linbackprop as lbp
from linbackprop._engine._contractions import contracted_last
from linbackprop._options._policy import Policy
from linbackprop._options._settings import Settings, using
from linbackprop._solve._params_after import ParamsAfter


def _barriers(fn, *args):
    return sum(eqn.primitive.name == "optimization_barrier" for eqn in equations(jax.make_jaxpr(fn)(*args)))


def _layer_weight_cotangents(us, cts, ws):
    """Per layer, the weight cotangent of tanh(u W) (a VJP vmapped over layers: Σ_b outer products)."""
    def one(u, ct, w):
        return jax.vjp(lambda w: jnp.tanh(u @ w), w)[1](ct)[0]

    return jax.vmap(one)(us, cts, ws)


@pytest.mark.parametrize("rows", [1, 3, 8])  # 1: below the bound, left as it is
def test_batched_outer_products_equal_jaxs(rows):
    rng = np.random.default_rng(0)
    us = rng.standard_normal((5, rows, 4))
    ws = rng.standard_normal((5, 4, 6))
    cts = rng.standard_normal((5, rows, 6))
    fast = contracted_last(_layer_weight_cotangents, 2, 8)
    # atol: round-off of the O(1) terms (an entry of 1.5e-4 from them differed by 6.7e-16 between XLA's levels)
    np.testing.assert_allclose(jax.jit(fast)(us, cts, ws), _layer_weight_cotangents(us, cts, ws), rtol=1e-12,
                               atol=1e-14)
    assert _barriers(fast, us, cts, ws) == (rows >= 2)


def test_other_products_are_left_as_they_are():
    """Unbatched products, contractions longer than the bound, and a product inside a nested jit
    (inlined: still rewritten), each with JAX's values."""
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((2, 3, 16, 4))
    plain = lambda a, b: jnp.einsum("bi,bj->ij", a[0], b[0])
    long = lambda a, b: jnp.einsum("lbi,lbj->lij", a, b)
    nested = jax.jit(lambda a, b: jnp.einsum("lbi,lbj->lij", a[:, :2], b[:, :2]))
    for fn, barriers in ((plain, 0), (long, 0), (nested, 1)):
        fast = contracted_last(fn, 2, 8)
        np.testing.assert_allclose(fast(a, b), fn(a, b), rtol=1e-12)
        assert _barriers(fast, a, b) == barriers


def test_the_gradient_solve_moves_short_contractions_on_cpu_only():
    depth, rows = 12, 4
    rng = np.random.default_rng(2)
    net = lbp.Network([lbp.Layer(i, residual, (i - 1,), (lbp.Row("W", i - 1), lbp.Row("b", i - 1)))
                       for i in range(1, depth + 1)], [0], depth)
    params = {"W": 0.3 * rng.standard_normal((depth, 4, 4)), "b": 0.1 * rng.standard_normal((depth, 4))}
    x = rng.standard_normal((rows, 4))
    loss = lambda p, x: jnp.sum(jnp.sin(net(p, x)))
    expected = jax.grad(loss)(params, x)
    for bound in (16, 0):
        with using(Settings(policy=Policy(contract_first_max_cpu=bound))):
            grad = lbp.grad_by_solve(loss, param_products="after", engine="loop")
            found = [eqn.params["variant"] for eqn in equations(jax.make_jaxpr(grad)(params, x))
                     if eqn.primitive.name == "linbackprop_solve" and eqn.params["transposed"]]
            assert found and all(isinstance(s, ParamsAfter) for s in found)
            assert {s.contract_first for s in found} == {(4, bound) if jax.default_backend() == "cpu" else None}
            for a, e in zip(jax.tree.leaves(jax.jit(grad)(params, x)), jax.tree.leaves(expected), strict=True):
                np.testing.assert_allclose(a, e, rtol=1e-10)
