"""linbackprop leaves JAX as it found it, and each use of JAX's private internals has a fallback
that still gives jax.grad's gradient (docs/architecture.md, "Private JAX internals")."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import linbackprop as lbp
from linbackprop import _plan
from linbackprop._graph import _buffers as _stacking

UNCHANGED = """
import jax
from jax._src.interpreters import ad, batching, mlir
from jax._src.interpreters import partial_eval as pe

tables = {"jvps": ad.primitive_jvps, "transposes": ad.primitive_transposes,
          "batchers": batching.fancy_primitive_batchers,
          "lowerings": mlir._lowerings, "partial eval": pe.custom_partial_eval_rules}
before = {name: dict(table) for name, table in tables.items()}
import linbackprop
import jax.numpy as jnp
net = linbackprop.Network([linbackprop.Layer("y", lambda th, x: jnp.tanh(x * th[0]), ("x",), ("w",))], ["x"], "y")
linbackprop.grad_by_solve(lambda p: jnp.sum(net(p, jnp.ones(3))))({"w": 1.0})
for name, table in tables.items():
    changed = [p for p, rule in before[name].items() if table.get(p) is not rule]
    assert not changed, (name, changed)
    # Rules added since: JAX's own modules imported on the way (chex imports some), and
    # linbackprop's primitives; no rule of linbackprop's for a primitive not its own.
    ours = [str(p) for p, rule in table.items() if p not in before[name]
            and "linbackprop" in getattr(rule, "__module__", "") + getattr(rule, "__qualname__", "")]
    assert all(p.startswith("linbackprop_") for p in ours), (name, ours)
print("unchanged")
"""


def test_importing_and_using_linbackprop_changes_no_rule_of_jax():
    """Every JVP, transpose, batching, lowering and partial-eval rule JAX had is the same object
    after ``import linbackprop`` and a gradient; the only additions are linbackprop's own
    primitives. (``custom_linear_solve`` users such as ``jax.scipy.sparse.linalg.cg`` are untouched.)"""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", UNCHANGED], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "unchanged" in done.stdout


def test_custom_linear_solve_of_jax_still_rejects_what_it_rejected():
    """JAX's own linear solve keeps its own transpose rule (linbackprop used to relax it)."""
    from jax._src.interpreters import ad as ad_internal
    from jax._src.lax.control_flow.solves import linear_solve_p

    assert not getattr(ad_internal.primitive_transposes[linear_solve_p], "_linbackprop_relaxed", False)
    a = jnp.array([[3.0, 1.0], [1.0, 2.0]])
    b = jnp.array([1.0, -1.0])
    x = jax.scipy.sparse.linalg.cg(lambda v: a @ v, b)[0]
    np.testing.assert_allclose(x, np.linalg.solve(a, b), rtol=1e-6)


def _scalar_network():
    layers = [lbp.Layer(i, lambda th, u: jnp.tanh(u * th[0]) * th[1], (i - 1,), (lbp.Row("W", i - 1), "s"))
              for i in range(1, 5)]
    return lbp.Network(layers, [0], 4)


def test_without_the_private_weak_type_conversion_gradients_are_unchanged(monkeypatch):
    """A Python scalar block is then seen as a strongly typed array by the layers: same values."""
    monkeypatch.setattr(_plan._groups, "_TO_WEAK", None)  # the module that converts
    net = _scalar_network()
    loss = lambda p, x: jnp.sum(net(p, x) ** 2)
    p, x = {"W": 0.5 * jnp.ones((4, 3)), "s": 1.5}, jnp.ones(3)
    ours = lbp.grad_by_solve(loss, engine="loop")(p, x)
    ref = jax.grad(loss)(p, x)
    for a, e in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, e, rtol=1e-12)


@pytest.mark.parametrize("engine", ["loop", "unrolled"])
def test_without_the_jaxpr_analysis_every_residual_is_stored(monkeypatch, engine):
    """If JAX's jaxpr internals change, the residual analysis stores every residual instead of
    recomputing cheap ones: gradients unchanged."""
    def broken(*_):
        raise AttributeError("jaxpr layout changed")

    monkeypatch.setattr(_plan._residuals, "_recipes", broken)  # the module that analyses
    net = lbp.Network([lbp.Layer(i, lambda th, u: jnp.tanh(u @ th[0]), (i - 1,), (lbp.Row("W", i - 1),))
                       for i in range(1, 7)], [0], 6)
    p, x = {"W": 0.4 * jnp.ones((6, 3, 3))}, jnp.ones((2, 3))  # shapes no other test uses: a new plan
    plan = _plan.plan_for(net, net.select_params(p), (x,), engine)
    assert not plan.kinds[0].recipes
    loss = lambda p, x: jnp.sum(net(p, x) ** 2)
    for a, e in zip(jax.tree.leaves(lbp.grad_by_solve(loss, engine=engine)(p, x)),
                    jax.tree.leaves(jax.grad(loss)(p, x))):
        np.testing.assert_allclose(a, e, rtol=1e-12)


def test_the_forward_pass_replays_the_analysed_linearisation():
    """Residuals are rebuilt into the VJP the plan analysed: the forward pass replays that
    analysis's jaxpr (so the residuals always fit), and a layer's Python runs per kind, not per
    step: the analysis and the trace of what it computes when the plan is made, then once per
    call that enters the solve (the check that the plan is not stale)."""
    calls = []

    def layer(th, u):
        calls.append(1)
        return jnp.sin(u @ th[0])

    net = lbp.Network([lbp.Layer(i, layer, (i - 1,), (lbp.Row("W", i - 1),)) for i in range(1, 6)], [0], 5)
    p, x = {"W": 0.4 * jnp.ones((5, 2, 2))}, jnp.ones((3, 2))
    loss = lambda p, x: jnp.sum(net(p, x) ** 2)
    got = lbp.grad_by_solve(loss, engine="unrolled")(p, x)
    assert len(calls) == 2  # five layers of one kind, unrolled: the analysis and computation_of
    again = lbp.grad_by_solve(loss, engine="unrolled")(p, x)
    assert len(calls) == 3  # the plan's computation compared, nothing traced per step
    for a, e in zip(jax.tree.leaves(got), jax.tree.leaves(jax.grad(loss)(p, x))):
        np.testing.assert_allclose(a, e, rtol=1e-12)
    for a, e in zip(jax.tree.leaves(again), jax.tree.leaves(got)):
        np.testing.assert_array_equal(a, e)


def test_without_the_jaxpr_evaluation_the_ggn_diagonal_forms_every_cotangent(monkeypatch):
    """The GGN diagonal's outer-product rule reads the per-example VJP's jaxpr; if that fails, each
    example's cotangents are formed and squared: the same diagonal."""
    from linbackprop._engine import _outer_products as _outer
    net = lbp.Network([lbp.Layer(i, lambda th, u: jnp.tanh(u @ th[0]), (i - 1,), (lbp.Row("W", i - 1),))
                       for i in range(1, 4)], [0], 3)
    p, x = {"W": 0.5 * jnp.ones((3, 3, 3)) + jnp.eye(3)}, jnp.linspace(-1.0, 1.0, 15).reshape(5, 3)
    loss = lambda p, x: jnp.sum(jnp.sin(net(p, x)))
    expected = lbp.diag_ggn(loss)(p, x)

    def broken(*_):
        raise AttributeError("jaxpr layout changed")

    monkeypatch.setattr(_outer, "bind_equation", broken)
    monkeypatch.setattr(_outer, "evaluate", broken)  # the package's jaxpr evaluator, as the rule calls it
    np.testing.assert_allclose(lbp.diag_ggn(loss)(p, x)["W"], expected["W"], rtol=1e-10, atol=1e-14)


def test_without_jaxs_vmap_test_checkpointed_gradients_under_vmap_are_unchanged(monkeypatch):
    """If JAX's ``unsafe_am_i_under_a_vmap`` goes, a call is taken to be traced without vmap: the
    memory rule leaves out its vmap terms and segments scan over their inputs' rows (a copy under
    vmap): gradients unchanged."""
    from jax._src import core

    seen = []
    jax.vmap(lambda x: seen.append(_stacking.under_vmap()) or x)(jnp.ones(2))
    monkeypatch.delattr(core, "unsafe_am_i_under_a_vmap")
    jax.vmap(lambda x: seen.append(_stacking.under_vmap()) or x)(jnp.ones(2))
    assert seen == [True, False]
    cell = lambda th, h, x: jnp.tanh(h @ th[0] + x @ th[1])
    net = lbp.Network([lbp.Layer(t, cell, (t - 1, lbp.Row("xs", t - 1)), ("A", "B")) for t in range(1, 13)],
                      [0, "xs"], 12)
    loss = lambda p, h0, xs: jnp.sum(net(p, h0, xs) ** 2)
    p = {"A": 0.3 * jnp.eye(3), "B": 0.2 * jnp.ones((3, 3))}
    h0, xs = jnp.ones((4, 2, 3)), jnp.linspace(-1, 1, 4 * 12 * 2 * 3).reshape(4, 12, 2, 3)
    batched = lambda grad: jax.vmap(grad, in_axes=(None, 0, 0))(p, h0, xs)
    ours = batched(lbp.grad_by_solve(loss, checkpoints=3))
    for a, e in zip(jax.tree.leaves(ours), jax.tree.leaves(batched(jax.grad(loss)))):
        np.testing.assert_allclose(a, e, rtol=1e-12)
