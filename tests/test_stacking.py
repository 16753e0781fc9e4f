"""Packing blocks into buffers and back (place / take) at sizes where the primitives are used:
values, transposes, batching, and gradients of a network with many blocks per group."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from trees import assert_trees_close

import linbackprop as lbp
from linbackprop._graph._buffers import MANY, place, take

N = MANY + 4


def blocks(n, shape=(3, 2), seed=0):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal(shape)) for _ in range(n)]


@pytest.mark.parametrize("slots,rows", [(tuple(range(N)), N), (tuple(range(N)), N + 1),
                                        (tuple(range(N, 0, -1)), N + 2)])
def test_place_and_take_values(slots, rows):
    xs = blocks(N)
    buf = place(xs, slots, rows)
    expected = np.zeros((rows, 3, 2))
    for s, x in zip(slots, xs):
        expected[s] += np.asarray(x)
    np.testing.assert_array_equal(buf, expected)
    for got, want in zip(jax.jit(lambda b: take(b, list(slots)))(buf), xs):
        np.testing.assert_array_equal(got, want)


def test_place_and_take_are_transposes():
    xs, slots, rows = blocks(N), tuple(range(1, N + 1)), N + 2
    buf = jnp.asarray(np.random.default_rng(1).standard_normal((rows, 3, 2)))
    (t_place,) = jax.linear_transpose(lambda b: take(b, list(slots)), buf)(xs)
    np.testing.assert_allclose(t_place, place(xs, slots, rows), rtol=1e-15)
    (t_take,) = jax.linear_transpose(lambda x: place(x, slots, rows), xs)(buf)
    for got, want in zip(t_take, take(buf, list(slots))):
        np.testing.assert_allclose(got, want, rtol=1e-15)


def test_place_and_take_under_vmap():
    xs = blocks(N)
    batched = jnp.stack([jnp.stack(xs) * (k + 1) for k in range(3)], axis=2)  # (N, 3, batch, 2)
    out = jax.vmap(lambda b: take(b, list(range(N))), in_axes=2)(batched)
    for n, x in enumerate(xs):
        np.testing.assert_allclose(out[n], jnp.stack([x[:, :] * (k + 1) for k in range(3)]))
    mixed = jax.vmap(lambda a: place([a, *xs[1:]], tuple(range(N)), N + 1))(jnp.stack([xs[0], -xs[0]]))
    np.testing.assert_allclose(mixed[1, 0], -xs[0])
    np.testing.assert_allclose(mixed[:, 1:N], jnp.broadcast_to(jnp.stack(xs[1:]), (2, N - 1, 3, 2)))


def chain_case(depth=N):
    def layer(th, u):
        return u + jnp.tanh(u @ th[0] + th[1])

    net = lbp.Network([lbp.Layer(i, layer, (i - 1,), (("W", i), ("b", i))) for i in range(1, depth + 1)], [0], depth)
    rng = np.random.default_rng(3)
    params = {}
    for i in range(1, depth + 1):
        params[("W", i)] = jnp.asarray(0.4 * rng.standard_normal((4, 4)))
        params[("b", i)] = jnp.asarray(0.1 * rng.standard_normal(4))
    x = jnp.asarray(rng.standard_normal((5, 4)))
    return net, params, x, lambda p, x: jnp.sum(jnp.sin(net(p, x)))


def assert_close(a, b, rtol=1e-9):
    assert_trees_close(a, b, rtol=rtol, atol=1e-12)


def test_many_blocks_grad_jvp_vmap_and_hvp():
    _, params, x, loss = chain_case()
    solve = lambda f, *a: lbp.grad_by_solve(f, *a, engine="loop")
    assert_close(jax.jit(solve(loss, (0, 1)))(params, x), jax.grad(loss, (0, 1))(params, x))
    t = jax.tree.map(jnp.ones_like, (params, x))
    assert_close(lbp.jvp_by_solve(loss, (params, x), t, engine="loop"), jax.jvp(loss, (params, x), t))
    per_example = lambda g: jax.vmap(g(lambda p, xi: loss(p, xi[None])), (None, 0))(params, x)
    assert_close(jax.jit(lambda: per_example(solve))(), per_example(jax.grad))
    hvp = lambda g: jax.jit(lambda p, v: jax.jvp(g(loss), (p, x), (v, jnp.zeros_like(x)))[1])(params, t[0])
    assert_close(hvp(solve), hvp(lambda f: jax.grad(f)))
