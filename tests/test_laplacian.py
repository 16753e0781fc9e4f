"""The forward-Laplacian lift against plain JAX: (u, ∇u, Δu) equal jax.grad and the trace of
jax.hessian at each point; a physics-informed loss on the lifted network has the gradient of
jax.grad and the Gauss–Newton matrix JᵀJ of its residuals (jax.jacfwd); K-FAC's factors of the
first weight are the "expand" and "reduce" sums over the three uses (u, ∇u, Δu)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree
from trees import assert_bias_of, assert_trees_close

import linbackprop as lbp

close = functools.partial(assert_trees_close, rtol=1e-9, atol=1e-11)  # this file's tolerances


dense = lambda th, u: jnp.tanh(u @ th[0] + th[1])
NET = lbp.Network([lbp.Layer("h1", dense, ("x",), ("W1", "b1")),
                   lbp.Layer("h2", dense, ("h1",), ("W2", "b2")),
                   lbp.Layer("u", lambda th, h, s: h @ th[0] + s @ th[1], ("h2", "h1"), ("W3", "S"))], ["x"], "u")
LIFTED = lbp.forward_laplacian(NET)


def params(seed=0):
    rng = np.random.default_rng(seed)
    r = lambda *s: jnp.asarray(0.7 * rng.standard_normal(s))
    return {"W1": r(2, 6), "b1": r(6), "W2": r(6, 6), "b2": r(6), "W3": r(6, 1), "S": r(6, 1)}


def u_at(p, point):
    """The plain network at one point, a scalar."""
    return NET(p, point[None])[0, 0]


@functools.cache
def points():
    rng = np.random.default_rng(1)
    return jnp.asarray(rng.uniform(size=(7, 2))), jnp.asarray(rng.uniform(size=(4, 2)))


def source(x):
    return 2 * jnp.pi ** 2 * jnp.sin(jnp.pi * x[:, 0]) * jnp.sin(jnp.pi * x[:, 1])


def pinn_loss(p, inner, edge):
    _, _, lap = LIFTED(p, inner)
    return 0.5 * jnp.mean((lap[:, 0] + source(inner)) ** 2) + 0.5 * jnp.mean(NET(p, edge)[:, 0] ** 2)


def residuals(p, inner, edge):
    """The same loss as ½‖r‖², from plain jax.hessian at each point."""
    lap = jax.vmap(lambda x: jnp.trace(jax.hessian(u_at, argnums=1)(p, x)))(inner)
    edge_u = jax.vmap(lambda x: u_at(p, x))(edge)
    return jnp.concatenate([(lap + source(inner)) / jnp.sqrt(inner.shape[0]), edge_u / jnp.sqrt(edge.shape[0])])


def test_lifted_states_are_the_derivatives():
    p, (inner, _) = params(), points()
    u, grad, lap = LIFTED(p, inner)
    close(u[:, 0], jax.vmap(lambda x: u_at(p, x))(inner))
    close(grad[:, 0, :], jax.vmap(jax.grad(u_at, argnums=1), in_axes=(None, 0))(p, inner))
    close(lap[:, 0], jax.vmap(lambda x: jnp.trace(jax.hessian(u_at, argnums=1)(p, x)))(inner))
    assert LIFTED.order[0] == ("forward_laplacian", "x") and LIFTED.param_names == NET.param_names


def test_three_coordinates_and_a_constant_input_per_point():
    """d = 3, a layer with a pytree state, and a layer that also reads a per-point coefficient c
    (an input other than the coordinates: a constant of the derivatives): the states and their
    gradient against jax.grad / jax.hessian with c held fixed at each point."""
    both = lambda th, h: {"a": jnp.tanh(h @ th[0]), "b": jnp.sin(h @ th[1])}
    net = lbp.Network([lbp.Layer("h", both, ("x",), ("A", "B")),
                       lbp.Layer("g", lambda th, s, c: jnp.tanh(s["a"] * s["b"] @ th[0] + c * th[1]), ("h", "c"),
                                 ("G", "c0")),
                       lbp.Layer("u", lambda th, g, s: g @ th[0] + s["b"] @ th[1], ("g", "h"), ("H", "K"))],
                      ["x", "c"], "u")
    lifted = lbp.forward_laplacian(net)
    rng = np.random.default_rng(5)
    r = lambda *s: jnp.asarray(0.6 * rng.standard_normal(s))
    p = {"A": r(3, 4), "B": r(3, 4), "G": r(4, 4), "c0": r(4), "H": r(4, 1), "K": r(4, 1)}
    x, c = r(6, 3), r(6, 1)
    at = lambda p, point, coefficient: net(p, point[None], coefficient[None])[0, 0]
    u, grad, lap = jax.jit(lifted)(p, x, c)
    close(u[:, 0], jax.vmap(at, (None, 0, 0))(p, x, c))
    close(grad[:, 0, :], jax.vmap(jax.grad(at, argnums=1), (None, 0, 0))(p, x, c))
    laplacian = lambda p: jax.vmap(lambda a, b: jnp.trace(jax.hessian(at, argnums=1)(p, a, b)))(x, c)
    close(lap[:, 0], laplacian(p))
    loss = lambda p: 0.5 * jnp.sum(lifted(p, x, c)[2] ** 2)
    reference = lambda p: 0.5 * jnp.sum(laplacian(p) ** 2)
    close(ravel_pytree(jax.jit(lbp.grad_by_solve(loss))(p))[0], ravel_pytree(jax.jit(jax.grad(reference))(p))[0])


@pytest.mark.users_settings
@pytest.mark.parametrize("d", [1, 2, 5])
def test_chosen_second_derivatives_against_jacfwd_and_hessian(d):
    """second=(c_1 … c_d): lap is Σ_k c_k ∂²u/∂x_k² (u_xx of Burgers' (x, t): c = (1, 0)), beside
    ∇u, against jax.jacfwd and the weighted diagonal of jax.hessian in d = 1, 2, 5, on a network
    with a constant input (the vmapped directions) and without (the folded ones); and the
    gradient of a Burgers-like residual u_t + u u_x − ν u_xx by the solve against jax.grad."""
    rng = np.random.default_rng(d)
    r = lambda *s: jnp.asarray(0.6 * rng.standard_normal(s))
    net = lbp.Network([lbp.Layer("h", dense, ("x",), ("W1", "b1")),
                       lbp.Layer("u", lambda th, h: h @ th[0], ("h",), ("W2",))], ["x"], "u")
    p, x = {"W1": r(d, 5), "b1": r(5), "W2": r(5, 1)}, r(6, d)
    weights = tuple(float(c) for c in rng.uniform(-1, 2, d))
    lifted = lbp.forward_laplacian(net, second=weights)
    at = lambda p, point: net(p, point[None])[0, 0]
    u, grad, lap = jax.jit(lifted)(p, x)
    close(u[:, 0], jax.vmap(at, (None, 0))(p, x))
    close(grad[:, 0, :], jax.vmap(jax.jacfwd(at, argnums=1), (None, 0))(p, x))
    chosen = lambda p: jax.vmap(lambda a: jnp.diag(jax.hessian(at, argnums=1)(p, a)) @ jnp.asarray(weights))(x)
    close(lap[:, 0], chosen(p))
    with_constant = lbp.Network([lbp.Layer("h", lambda th, z, c: jnp.tanh(z @ th[0] + c * th[1]), ("x", "c"),
                                           ("W1", "b1")),
                                 lbp.Layer("u", lambda th, h: h @ th[0], ("h",), ("W2",))], ["x", "c"], "u")
    c = r(6, 1)
    close(lbp.forward_laplacian(with_constant, second=weights)(p, x, c)[2][:, 0],
          jax.vmap(lambda a, b: jnp.diag(jax.hessian(lambda z: with_constant(p, z[None], b[None])[0, 0])(a))
                   @ jnp.asarray(weights))(x, c))
    nu = 0.01 / jnp.pi
    burgers = lambda p: 0.5 * jnp.mean((grad_of(p)[:, -1] + lifted(p, x)[0][:, 0] * grad_of(p)[:, 0]
                                        - nu * lifted(p, x)[2][:, 0]) ** 2)
    grad_of = lambda p: lifted(p, x)[1][:, 0, :]
    reference = lambda p: 0.5 * jnp.mean((jax.vmap(jax.grad(at, argnums=1), (None, 0))(p, x)[:, -1]
                                          + jax.vmap(at, (None, 0))(p, x)
                                          * jax.vmap(jax.grad(at, argnums=1), (None, 0))(p, x)[:, 0]
                                          - nu * chosen(p)) ** 2)
    close(ravel_pytree(jax.jit(lbp.grad_by_solve(burgers))(p))[0], ravel_pytree(jax.grad(reference)(p))[0])
    with pytest.raises(ValueError, match="weights for points of"):
        lbp.forward_laplacian(net, second=(1.0,) * (d + 1))(p, x)


@pytest.mark.users_settings
def test_physics_informed_gradient_and_gauss_newton():
    p, (inner, edge) = params(), points()

    @jax.jit  # each side one program: op by op, the references took most of the time
    def ours(p, inner, edge):
        value, grad, G = lbp.gauss_newton(pinn_loss)(p, inner, edge)
        return value, grad, G.todense()

    @jax.jit
    def reference(p, inner, edge):
        r = residuals(p, inner, edge)
        return r, jax.jacfwd(lambda flat: residuals(ravel_pytree(p)[1](flat), inner, edge))(ravel_pytree(p)[0])

    value, grad, dense = ours(p, inner, edge)
    r, jac = reference(p, inner, edge)
    close(value, 0.5 * jnp.sum(r ** 2))
    close(ravel_pytree(grad)[0], jac.T @ r)  # the gradient of ½‖r‖²
    close(dense, jac.T @ jac, rtol=1e-8, atol=1e-10)
    close(ravel_pytree(lbp.grad_by_solve(pinn_loss)(p, inner, edge))[0], ravel_pytree(grad)[0])  # eager


def test_kfac_expand_and_reduce_over_the_three_uses():
    """First weight: A = (1/N) Σ over the N = B(d + 2) uses of its input rows: x_b, the unit
    vectors e_k (∇x = I) and 0 (Δx = 0)."""
    p, (inner, _) = params(), points()
    only_inner = lambda q, inner: 0.5 * jnp.sum((LIFTED(q, inner)[2][:, 0] + source(inner)) ** 2)
    factors = jax.jit(lbp.kfac_factors(only_inner))(p, inner)
    b, d = inner.shape
    # the bias in W1's block: a column of ones beside x_b (the value's use), zeros beside e_k and 0
    assert isinstance(factors["W1"], lbp.Kronecker)
    assert_bias_of(factors, "b1", "['W1']", "left")
    ones = lambda x, c: jnp.concatenate([x, jnp.full((x.shape[0], 1), c)], axis=1)
    uses = ones(inner, 1.0), ones(jnp.tile(jnp.eye(d), (b, 1)), 0.0)
    close(factors["W1"].left, sum(x.T @ x for x in uses) / (b * (d + 2)))
    # "reduce": each point's d + 2 uses summed first, x̄_b = x_b + Σ_k e_k + 0, and its one bias term
    summed = ones(inner + 1.0, 1.0)
    reduced = jax.jit(lbp.kfac_factors(only_inner, approximation="reduce"))(p, inner)
    close(reduced["W1"].left, summed.T @ summed / (b * (d + 2) ** 2))


def test_bad_coordinates_name_the_fix():
    with pytest.raises(lbp.GraphError, match="not an input"):
        lbp.forward_laplacian(NET, "y")
    with pytest.raises(ValueError, match=r"\[B, d\] batch of points"):
        LIFTED(params(), jnp.ones(3))


def test_a_loss_of_two_calls_with_their_own_points():
    """The PINN loss as written: the lifted network on the interior points and the plain one on
    the boundary (different batches), each point an example, interior first. The GGN diagonal and
    the rank-1 rows against the residuals' Jacobian (jax.jacfwd); K-FAC a Kronecker pair per term,
    each equal to that term's factors alone, the biases in their weights' blocks."""
    p, (inner, edge) = params(), points()
    flat, unravel = ravel_pytree(p)
    jac = jax.jit(jax.jacfwd(lambda f: residuals(unravel(f), inner, edge)))(flat)
    close(ravel_pytree(jax.jit(lbp.diag_ggn(pinn_loss))(p, inner, edge))[0], jnp.diag(jac.T @ jac))
    rows = jax.vmap(lambda r: ravel_pytree(r)[0])(jax.jit(lbp.ggn_factor(pinn_loss, rank=1))(p, inner, edge))
    close(jnp.abs(rows), jnp.abs(jac))  # each point's row in call order, up to eigh's sign
    factors = jax.jit(lbp.kfac_factors(pinn_loss))(p, inner, edge)
    interior = lambda q, a: 0.5 * jnp.mean((LIFTED(q, a)[2][:, 0] + source(a)) ** 2)
    boundary = lambda q, a: 0.5 * jnp.mean(NET(q, a)[:, 0] ** 2)
    alone = jax.jit(lbp.kfac_factors(interior))(p, inner), jax.jit(lbp.kfac_factors(boundary))(p, edge)
    for name in ("W1", "W2", "W3", "S"):
        assert isinstance(factors[name], tuple) and len(factors[name]) == 2
        for term, own in zip(factors[name], alone, strict=True):
            close(term.left, own[name].left)
            close(term.right, own[name].right)
    assert_bias_of(factors, "b1", "['W1']", "left")
    assert_bias_of(factors, "b2", "['W2']", "left")


def test_per_example_gradients_of_two_calls_in_call_order():
    """Per-example losses of both calls, interior then boundary (jnp.concatenate): the gradients
    and their norms are jax.jacrev's; clipping, where an example is ambiguous, names the calls."""
    p, (inner, edge) = params(), points()

    def losses(q, inner, edge):
        _, _, lap = LIFTED(q, inner)
        return jnp.concatenate([0.5 * (lap[:, 0] + source(inner)) ** 2, 0.5 * NET(q, edge)[:, 0] ** 2])

    ref = jax.jit(jax.jacrev(losses))(p, inner, edge)
    ours = jax.jit(lbp.per_example_grads(losses))(p, inner, edge)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref), strict=True):
        close(a, b)
    norms = jax.jit(lbp.per_example_grad_norms(losses, chunk=3))(p, inner, edge)
    close(norms, jnp.linalg.norm(jax.vmap(lambda g: ravel_pytree(g)[0])(ref), axis=1))
    with pytest.raises(ValueError, match=r"clipped_grad: .*different batches.*call 0: .*batch 7; call 1: .*batch 4"):
        lbp.clipped_grad(losses, 1.0)(p, inner, edge)
    with pytest.raises(ValueError, match="must return 11 losses"):
        lbp.per_example_grads(lambda q, a, b: losses(q, a, b)[:-1])(p, inner, edge)
