"""The loop is real: the program of grad_by_solve does not grow with depth."""

import collections
import re

import jax
import jax.numpy as jnp
import pytest

import linbackprop as lbp


def residual(th, u):
    return u + jnp.tanh(u @ th[0] + th[1])


def gated(th, u):
    return u * jax.nn.sigmoid(u @ th[0])


def skip(th, u, s):
    return u + jnp.tanh(s @ th[0])


def network(depth, kinds):
    layers, params = [], {}
    for i in range(1, depth + 1):
        k = i % kinds
        if k == 2 and i > 8:
            layers.append(lbp.Layer(i, skip, (i - 1, i - 8), (("S", i),)))
            params[("S", i)] = jnp.eye(4) * 0.1
        elif k == 1:
            layers.append(lbp.Layer(i, gated, (i - 1,), (("G", i),)))
            params[("G", i)] = jnp.eye(4) * 0.1
        else:
            layers.append(lbp.Layer(i, residual, (i - 1,), (("W", i), ("b", i))))
            params[("W", i)], params[("b", i)] = jnp.eye(4) * 0.1, jnp.zeros(4)
    return lbp.Network(layers, [0], depth), params


def primitive_counts(depth, kinds):
    net, params = network(depth, kinds)
    loss = lambda p, x: jnp.sum(net(p, x) ** 2)
    jaxpr = jax.make_jaxpr(lbp.grad_by_solve(loss))(params, jnp.ones((2, 4)))
    counts = collections.Counter()

    def walk(jx):
        for eqn in jx.eqns:
            counts[eqn.primitive.name] += 1
            for value in eqn.params.values():
                for sub in value if isinstance(value, (list, tuple)) else (value,):
                    sub = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
                    if hasattr(sub, "eqns"):
                        walk(sub)

    walk(jaxpr.jaxpr)
    return counts


@pytest.mark.parametrize("kinds", [1, 3])
def test_program_size_independent_of_depth(kinds):
    shallow, deep = primitive_counts(32, kinds), primitive_counts(128, kinds)
    assert shallow["dot_general"] > 0
    assert shallow["dot_general"] == deep["dot_general"]
    assert shallow["tanh"] == deep["tanh"]
    assert (shallow["cond"] > 0) == (kinds > 1)  # a switch over kinds only when there are several


def test_plain_network_is_unrolled():
    """The reference path really is plain JAX: its program grows with depth."""
    net, params = network(16, 1)
    loss = lambda p, x: jnp.sum(net(p, x) ** 2)
    text = str(jax.make_jaxpr(jax.grad(loss))(params, jnp.ones((2, 4))))
    assert text.count("tanh") >= 16


def lowered_counts(depth):
    """Ops of the lowered program of grad_by_solve for a chain with one block per layer."""
    net, params = network(depth, 1)
    loss = lambda p, x: jnp.sum(net(p, x) ** 2)
    text = jax.jit(lbp.grad_by_solve(loss)).lower(params, jnp.ones((2, 4))).as_text()
    return collections.Counter(re.findall(r"stablehlo\.(\w+)", text))


def test_packing_has_no_per_block_static_slices():
    """Each static slice of a per-block gradient would be an XLA kernel of its own (compile time
    linear in depth); packing and unpacking index rows through operands instead."""
    shallow, deep = lowered_counts(16), lowered_counts(64)
    assert shallow["while"] > 0
    for op in ("slice", "dot_general", "while", "tanh"):
        assert shallow[op] == deep[op], op
