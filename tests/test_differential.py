"""Differential harness: random DAGs under random stacks of JAX transformations, every engine and
setting, against the same program written with plain JAX (jax.grad / jax.value_and_grad / jax.jvp).

A drawn case is a network (tests/test_random_dags.py's strategy: 1–3 inputs, 2–12 layers, skips,
shared and stacked blocks, pytree blocks, random outputs — so some layers reach no output), a
dtype, an engine, ``param_products``, ``remat``, a program (below) and whether it is jitted. The
program is written once against a (grad, value_and_grad, jvp) triple and run twice: with
linbackprop's transforms and with JAX's. Both must agree, leaf by leaf, in structure, dtype and
value.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from test_random_dags import dags

import linbackprop as lbp


def loss_of(net: lbp.Network) -> Callable:
    def loss(params, *inputs):
        outs = net(params, *inputs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        return sum(jnp.sum(jnp.sin(o.astype(jnp.float32 if o.dtype == jnp.bfloat16 else o.dtype)) + 0.5 * o**2)
                   for o in outs)

    return loss


def penalty(tree: Any) -> Any:
    """A scalar of a gradient (gradient penalties, MAML-style outer losses)."""
    return sum(jnp.sum(leaf.astype(jnp.float32 if leaf.dtype == jnp.bfloat16 else leaf.dtype) ** 2)
               for leaf in jax.tree.leaves(tree))


def tangents_like(tree: Any, seed: int = 0) -> Any:
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(np.shape(x)), x.dtype), tree)


# A program takes (grad, value_and_grad, jvp) and the loss, and returns a function of (params, *inputs).
def grad_all(G, VG, J, loss, n):
    return lambda p, *xs: G(loss, tuple(range(1 + n)))(p, *xs)


def value_and_grad(G, VG, J, loss, n):
    return lambda p, *xs: VG(loss)(p, *xs)


def forward_mode(G, VG, J, loss, n):
    return lambda p, *xs: J(loss, (p, *xs), tangents_like((p, *xs)))


def hvp(G, VG, J, loss, n):  # jvp of grad: Hessian-vector products
    return lambda p, *xs: jax.jvp(lambda q: G(loss)(q, *xs), (p,), (tangents_like(p, 1),))


def per_example(G, VG, J, loss, n):  # vmap of grad over the batch rows
    return lambda p, *xs: jax.vmap(lambda *rows: G(loss)(p, *rows))(*xs)


def grad_of_grad(G, VG, J, loss, n):  # jax.grad of a gradient penalty
    return lambda p, *xs: jax.grad(lambda q: penalty(G(loss)(q, *xs)))(p)


def solve_of_grad(G, VG, J, loss, n):  # the transform itself over a gradient penalty
    return lambda p, *xs: G(lambda q: penalty(G(loss)(q, *xs)))(p)


def jacfwd_of_grad(G, VG, J, loss, n):  # the Hessian, forward over reverse
    return lambda p, *xs: jax.jacfwd(lambda q: G(loss)(q, *xs))(p)


def jacrev_of_grad(G, VG, J, loss, n):  # the Hessian, reverse over reverse
    return lambda p, *xs: jax.jacrev(lambda q: G(loss)(q, *xs))(p)


FIRST_ORDER = [grad_all, value_and_grad, forward_mode, per_example]
SECOND_ORDER = [hvp, grad_of_grad, solve_of_grad, jacfwd_of_grad, jacrev_of_grad]
TOLERANCE = {jnp.float64: (1e-8, 1e-10), jnp.float32: (2e-3, 2e-4), jnp.bfloat16: (1e-1, 1e-1)}


def run(program: Callable, loss: Callable, n_inputs: int, jit: bool, settings_: dict, ours: bool) -> Any:
    if ours:
        G = functools.partial(lbp.grad_by_solve, **settings_)
        VG = functools.partial(lbp.value_and_grad_by_solve, **settings_)
        J = functools.partial(lbp.jvp_by_solve, engine=settings_["engine"])
    else:
        G, VG, J = jax.grad, jax.value_and_grad, jax.jvp
    fn = program(G, VG, J, loss, n_inputs)
    return jax.jit(fn) if jit else fn


def assert_same(actual: Any, expected: Any, dtype: Any) -> None:
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    rtol, atol = TOLERANCE[dtype]
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        assert a.dtype == e.dtype and a.shape == e.shape, (a.dtype, e.dtype, a.shape, e.shape)
        a64, e64 = np.asarray(a, np.float64), np.asarray(e, np.float64)
        scale = max(1.0, float(np.max(np.abs(e64)))) if e64.size else 1.0
        np.testing.assert_allclose(a64, e64, rtol=rtol, atol=atol * scale)


@st.composite
def cases(draw):
    dtype = draw(st.sampled_from([jnp.float64, jnp.float64, jnp.float32, jnp.bfloat16]))
    programs = FIRST_ORDER if dtype == jnp.bfloat16 else FIRST_ORDER + SECOND_ORDER
    return dict(
        dag=draw(dags()),
        dtype=dtype,
        program=draw(st.sampled_from(programs)),
        jit=draw(st.booleans()),
        settings=dict(engine=draw(st.sampled_from(["loop", "unrolled"])),
                      param_products=draw(st.sampled_from(["auto", "after", "in_loop"])),
                      remat=draw(st.booleans())),
    )


@given(cases())
def test_transformations_of_random_dags_match_plain_jax(case):
    net, params, inputs = case["dag"]
    dtype = case["dtype"]
    params, inputs = jax.tree.map(lambda x: x.astype(dtype), (params, inputs))
    loss = loss_of(net)
    args = (params, *inputs)
    ours = run(case["program"], loss, len(inputs), case["jit"], case["settings"], ours=True)(*args)
    ref = run(case["program"], loss, len(inputs), True, case["settings"], ours=False)(*args)  # compiled: faster
    assert_same(ours, ref, dtype)


# -- the same random DAGs as plain JAX models: found by layers= --------------------------------------
def as_model(net: lbp.Network) -> tuple[Callable, tuple]:
    """``net`` written as a user would write it in plain JAX: each layer a call of its function
    decorated with ``@lbp.layer`` in topological order, rows of stacked blocks indexed in Python,
    the same loss. Returns the loss and the ``layers=`` to find the network by."""
    marked = {fn: lbp.layer(fn) for fn in {layer.fn for layer in net.layers}}
    by_name = {layer.name: layer for layer in net.layers}

    def loss(params, *inputs):
        env = dict(zip(net.inputs, inputs))
        for name in net.order:
            layer = by_name[name]
            theta = tuple(params[b.block][b.index] if isinstance(b, lbp.Row) else params[b] for b in layer.params)
            env[name] = marked[layer.fn](theta, *(env[r] for r in layer.reads))
        outs = [env[o] for o in (net.outputs if isinstance(net.outputs, list | tuple) else [net.outputs])]
        return sum(jnp.sum(jnp.sin(o.astype(jnp.float32 if o.dtype == jnp.bfloat16 else o.dtype)) + 0.5 * o**2)
                   for o in outs)

    return loss, tuple(marked.values())


@st.composite
def captured_cases(draw):
    dtype = draw(st.sampled_from([jnp.float64, jnp.float64, jnp.float32]))
    return dict(dag=draw(dags()), dtype=dtype,
                program=draw(st.sampled_from(FIRST_ORDER + [hvp, grad_of_grad])), jit=draw(st.booleans()),
                engine=draw(st.sampled_from(["loop", "unrolled"])))


@given(captured_cases())
def test_random_dags_written_as_plain_jax_and_found_by_layers_match_jax(case):
    """The harness's networks as plain JAX models: ``layers=`` finds them (every layer a call, the
    shared blocks shared, the stacked rows Row blocks or glue), and every program agrees with JAX."""
    net, params, inputs = case["dag"]
    params, inputs = jax.tree.map(lambda x: x.astype(case["dtype"]), (params, inputs))
    loss, layers = as_model(net)
    args = (params, *inputs)
    cap = lbp.capture(loss, *args, layers=layers)
    assert sorted(layer.name for layer in cap.net.layers if not layer.name.startswith("glue")) == sorted(
        f"{getattr(fn, '__name__', 'layer')}{k}" for fn, k in _numbered(net))
    settings_ = dict(engine=case["engine"], layers=layers)
    ours_fns = (functools.partial(lbp.grad_by_solve, **settings_), functools.partial(lbp.value_and_grad_by_solve,
                **settings_), functools.partial(lbp.jvp_by_solve, **settings_))
    fn = case["program"](*ours_fns, loss, len(inputs))
    ours = (jax.jit(fn) if case["jit"] else fn)(*args)
    ref = run(case["program"], loss, len(inputs), True, {}, ours=False)(*args)
    assert_same(ours, ref, case["dtype"])


def _numbered(net: lbp.Network) -> list[tuple[Callable, int]]:
    """Each layer's (function, index among the calls of that function's name), in call order."""
    by_name = {layer.name: layer for layer in net.layers}
    seen: dict = {}
    out = []
    for name in net.order:
        fn = by_name[name].fn
        key = getattr(fn, "__name__", "layer")
        out.append((fn, seen.get(key, 0)))
        seen[key] = seen.get(key, 0) + 1
    return out
