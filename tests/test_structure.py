"""The loop is real: the program of grad_by_solve does not grow with depth."""

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from networks import equations, gated, residual, skip

import linbackprop as lbp


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
    return counted(jax.make_jaxpr(lbp.grad_by_solve(loss))(params, jnp.ones((2, 4))))


def counted(jaxpr):
    """Primitives of a closed jaxpr and of every jaxpr nested in it."""
    return collections.Counter(eqn.primitive.name for eqn in equations(jaxpr))


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


def test_plain_call_reads_rows_without_per_row_slices():
    """net(params, x) outside the solve (and jax.grad of it) reads the rows of a stacked block with
    one operand-indexed kernel: static slices would compile one XLA kernel per row."""
    def lowered(depth):
        layers = [lbp.Layer(i, residual, (i - 1,), (lbp.Row("W", i - 1), lbp.Row("b", i - 1)))
                  for i in range(1, depth + 1)]
        net = lbp.Network(layers, [0], depth)
        params = {"W": jnp.zeros((depth, 4, 4)), "b": jnp.zeros((depth, 4))}
        loss = lambda p, x: jnp.sum(net(p, x) ** 2)
        text = jax.jit(jax.grad(loss)).lower(params, jnp.ones((2, 4))).as_text()
        return collections.Counter(re.findall(r"stablehlo\.(\w+)", text))

    shallow, deep = lowered(16), lowered(64)
    assert deep["tanh"] == 4 * shallow["tanh"] > 0  # unrolled, as plain JAX is
    assert deep["slice"] == shallow["slice"]


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


def assert_loop_exact(loss, params, x):
    """grad_by_solve with the loop engine (ℳΛ after and in the loop) and jvp_by_solve against jax."""
    expected = jax.grad(loss, (0, 1))(params, x)
    for mode in ({}, {"param_products": "in_loop"}):
        got = jax.jit(lbp.grad_by_solve(loss, (0, 1), engine="loop", **mode))(params, x)
        for a, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
            np.testing.assert_allclose(a, e, rtol=1e-9, atol=1e-12)
    t = jax.tree.map(jnp.ones_like, (params, x))
    np.testing.assert_allclose(lbp.jvp_by_solve(loss, (params, x), t, engine="loop")[1],
                               jax.jvp(loss, (params, x), t)[1], rtol=1e-9)


def test_periodic_kinds_run_without_a_switch_and_stay_exact():
    """Three kinds in a repeating pattern after an irregular prefix: the loop runs the prefix step
    by step (a switch over kinds) and the pattern a period per iteration (kinds known, no switch)."""
    from linbackprop._plan import plan_for

    net, params = network(26, 3)
    params = jax.tree.map(lambda v: v.astype(jnp.float64), params)
    x = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float64).reshape(2, 4)
    plan = plan_for(net, net.select_params(params), (x,), "loop")
    periods = [period for _, _, period in plan.segments]
    assert 0 in periods and 3 in periods
    assert_loop_exact(lambda p, x: jnp.sum(jnp.sin(net(p, x))), params, x)


def test_one_off_kinds_run_straight_line_without_a_switch():
    """A first and a last layer of kinds of their own around a repeating pattern (a transformer's
    embedding and head): those steps run as straight-line code of known kind — no switch over
    every kind for them (it compiled each kind again per such step), their residuals kept as
    plain values — and stay exact."""
    from linbackprop._plan import plan_for

    first = lambda th, u: jnp.sin(u @ th[0]) * jnp.cos(u @ th[0])  # residuals that are not its output
    head = lambda th, u: u @ th[0]
    layers = [lbp.Layer(1, first, (0,), (("P", 0),))]
    layers += [lbp.Layer(i, residual if i % 2 else gated, (i - 1,), (("W", i), ("b", i)) if i % 2 else (("W", i),))
               for i in range(2, 22)]
    layers += [lbp.Layer(22, head, (21,), (("H", 0),))]
    net = lbp.Network(layers, [0], 22)
    rng = np.random.default_rng(0)
    params = {name: jnp.asarray(0.3 * rng.standard_normal((4, 4))) for name in net.param_names}
    params |= {("b", i): jnp.zeros(4) for i in range(3, 22, 2)}
    x = jnp.asarray(rng.standard_normal((2, 4)))
    plan = plan_for(net, net.select_params(params), (x,), "loop")
    assert [(start, stop, period) for start, stop, period in plan.segments if period == 0] == [(0, 1, 0), (21, 22, 0)]
    # their residuals: buffers of their own kept as lists of rows (no zeroed rows in a loop's buffer)
    one_off = {int(plan.step_kind[0]), int(plan.step_kind[21])}
    kept = {k: [plan.res_as_rows[r] for r in kind.own_groups] for k, kind in enumerate(plan.kinds)}
    assert any(kept[k] for k in one_off) and all(all(v) == (k in one_off) for k, v in kept.items() if v)
    loss = lambda p, x: jnp.sum(jnp.sin(net(p, x)))
    counts = counted(jax.make_jaxpr(lbp.grad_by_solve(loss, engine="loop"))(params, x))
    assert counts["cond"] == 0 and counts["scan"] + counts["while"] >= 1  # loops, no switch
    assert_loop_exact(loss, params, x)


def test_blocks_between_an_embedding_and_a_head_loop_with_the_block_compiled_once():
    """A transformer written with one layer per block (embedding, 12 blocks, head: 14 layers of
    three kinds) compiled unrolled under engine="auto" (14.5 s against 6.3 s for jax.grad over
    lax.scan), and looped with the blocks as period 2 — the block compiled twice in the loop body.
    Now it loops, the blocks a period-1 stretch, and stays exact."""
    from linbackprop._plan import plan_for

    embed = lambda th, u: jnp.tanh(u @ th[0])
    block = lambda th, u: u + jnp.tanh(jnp.tanh(u @ th[0]) @ th[1])
    head = lambda th, u: u @ th[0]
    layers = [lbp.Layer(0, embed, ("x",), ("E",))]
    layers += [lbp.Layer(i, block, (i - 1,), (lbp.Row("A", i - 1), lbp.Row("B", i - 1))) for i in range(1, 13)]
    layers += [lbp.Layer(13, head, (12,), ("H",))]
    net = lbp.Network(layers, ["x"], 13)
    rng = np.random.default_rng(1)
    params = {"E": rng.standard_normal((3, 4)), "A": 0.3 * rng.standard_normal((12, 4, 4)),
              "B": 0.3 * rng.standard_normal((12, 4, 4)), "H": rng.standard_normal((4, 2))}
    params = jax.tree.map(jnp.asarray, params)
    x = jnp.asarray(rng.standard_normal((2, 3)))
    plan = plan_for(net, net.select_params(params), (x,), "auto")
    assert not plan.unrolled
    assert plan.segments == [(0, 1, 0), (1, 13, 1), (13, 14, 0)]
    loss = lambda p, x: jnp.sum(jnp.sin(net(p, x)))
    counts = counted(jax.make_jaxpr(lbp.grad_by_solve(loss))(params, x))
    assert counts["cond"] == 0
    assert_loop_exact(loss, params, x)


def test_cheap_residuals_are_recomputed_not_stored():
    """tanh's VJP keeps t and 1 − t, sigmoid's s and s(1 − s): only t and s are stored; the
    weights and inputs are re-read, never stored again."""
    from linbackprop._plan import plan_for

    for fn in (residual, gated):
        net = lbp.Network([lbp.Layer(i, fn, (i - 1,), ((fn.__name__, i), ("b", i))[:1 if fn is gated else 2])
                           for i in range(1, 4)], [0], 3)
        params = {(fn.__name__, i): jnp.eye(4) for i in range(1, 4)} | {("b", i): jnp.zeros(4) for i in range(1, 4)}
        plan = plan_for(net, net.select_params(params), (jnp.ones((2, 4)),))
        (kind,) = plan.kinds
        # One residual stored per layer, shaped like the state (t or s); 1 − t and s(1 − s) are
        # recomputed from it where JAX's VJP keeps them too (a recipe), absent where it does not.
        assert len(kind.kept) == 1 and len(kind.recipes) <= 1
        assert [a.shape for a in plan.res_avals] == [(2, 4)]
        assert sum(plan.res_rows) == 3  # one stored row per layer


@pytest.mark.parametrize("bare", [False, True])
def test_loops_update_buffers_in_place(bare):
    """No step copies a whole stacked buffer: reads of the buffers a loop writes use indices XLA
    cannot compare with the writes' (else it fuses a write into a later read and copies), and a
    step's several writes into one buffer are one scatter that depends on all its reads. ``bare``:
    a skip layer whose VJP passes its cotangent straight through to one input."""
    blocks = 24
    gate = lambda th, u: u * jax.nn.sigmoid(u @ th[0] + (0 if bare else th[1]))
    skip2 = lambda th, u, s: u + jnp.tanh((0 if bare else u @ th[0]) + s @ th[1])
    layers = []
    for k in range(blocks):
        prev, back = (("c", k - 1) if k else "x"), (("c", k - 4) if k >= 4 else "x")
        layers += [lbp.Layer(("a", k), residual, (prev,), (lbp.Row("A", k), lbp.Row("a", k))),
                   lbp.Layer(("b", k), gate, (("a", k),), (lbp.Row("B", k), lbp.Row("b", k))),
                   lbp.Layer(("c", k), skip2, (("b", k), back), (lbp.Row("C", k), lbp.Row("S", k)))]
    net = lbp.Network(layers, ["x"], ("c", blocks - 1))
    params = {**{n: jnp.zeros((blocks, 4, 4)) for n in "ABCS"}, **{n: jnp.zeros((blocks, 4)) for n in "ab"}}
    loss = lambda p, x: jnp.sum(net(p, x) ** 2)
    for mode in ("after", "in_loop"):
        text = jax.jit(lbp.grad_by_solve(loss, param_products=mode)).lower(params, jnp.ones((2, 4))).compile().as_text()
        bodies = set(re.findall(r"body=%([\w.\-]+)", text))
        assert bodies
        copies = [line for name in bodies for line in loop_body(text, name).splitlines()
                  if (m := re.search(r"= \w+\[(\d+),[\d,]*\]\S* copy\(", line)) and int(m[1]) >= blocks]
        assert not copies, (mode, copies)


def loop_body(text, name):
    """The HLO text of computation ``name`` (a while body)."""
    return text.split(f"\n%{name} ", 1)[1].split("\n}\n", 1)[0]


def test_forward_loop_carries_the_previous_output():
    """Reads that are always the previous step's output come from the loop's carry (no round trip
    through the state buffer); other reads (skips, a read two steps back) still read the buffer,
    and the gradients stay exact."""
    from linbackprop._plan import plan_for

    def build(back):
        layers = [lbp.Layer(1, residual, (0,), (lbp.Row("W", 0), lbp.Row("b", 0)))]
        layers += [lbp.Layer(i, skip, (i - 1, i - back), (lbp.Row("S", i - 2),)) if i % 2 == 0 else
                   lbp.Layer(i, residual, (i - 1,), (lbp.Row("W", i // 2), lbp.Row("b", i // 2)))
                   for i in range(2, 33)]
        return lbp.Network(layers, [0], 32)

    params = {"W": jnp.full((16, 4, 4), 0.1), "b": jnp.zeros((16, 4)), "S": jnp.full((31, 4, 4), 0.05)}
    params = jax.tree.map(lambda v: v.astype(jnp.float64), params)
    x = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float64).reshape(2, 4)
    for back in (2, 1):
        net = build(back)
        plan = plan_for(net, net.select_params(params), (x,), "loop")
        found = [plan.forwarding(start, stop) for start, stop, _ in plan.segments]
        assert any(f is not None for f in found)
        assert {r for f in found if f is not None for r in f.read.values()} == {0}  # U_{i-1}, never U_{i-2}
        loss = lambda p, x: jnp.sum(jnp.sin(net(p, x)))
        expected = jax.grad(loss, (0, 1))(params, x)
        got = jax.jit(lbp.grad_by_solve(loss, (0, 1), engine="loop"))(params, x)
        for a, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
            np.testing.assert_allclose(a, e, rtol=1e-9, atol=1e-12)

    chain = lbp.Network([lbp.Layer(i, residual, (i - 1,), (lbp.Row("W", i - 1), lbp.Row("b", i - 1)))
                         for i in range(1, 21)], [0], 20)
    p = {"W": jnp.zeros((20, 4, 4)), "b": jnp.zeros((20, 4))}
    plan = plan_for(chain, chain.select_params(p), (jnp.ones((2, 4)),), "loop")
    assert [plan.forwarding(a, b) for a, b, _ in plan.segments] == [(0, {0: 0}, 0)]


def test_rows_of_unshared_blocks_are_set_once():
    """ℳΛ in the loop sets the rows of blocks no two layers share (no read of the old row) and
    accumulates the others; the gradients are jax.grad's either way."""
    from networks import REGISTRY

    from linbackprop._plan import plan_for

    case = REGISTRY["stacked"]()  # row R[1] and block "scale" shared; S's rows used once each
    params = case.net.select_params(case.params)
    plan = plan_for(case.net, params, case.inputs, "loop")
    once = {plan.param_groups[g].names for g in plan.params_written_once}
    assert once == {("S",)}
    expected = jax.grad(case.loss)(case.params, *case.inputs)
    for engine in ("loop", "unrolled"):
        got = jax.jit(lbp.grad_by_solve(case.loss, param_products="in_loop", engine=engine))(case.params, *case.inputs)
        for a, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
            np.testing.assert_allclose(a, e, rtol=1e-9, atol=1e-12)


def test_forward_only_sweeps_keep_only_rows_read_again():
    """jvp_by_solve's sweep (no residuals) stores a state only where a later step reads it from the
    buffer (not from the carry) or it is an input or output: a chain keeps two rows, a skip
    network also the states its skips read; tangents stay exact either way."""
    from linbackprop._plan import plan_for

    chain = lbp.Network([lbp.Layer(i, residual, (i - 1,), (lbp.Row("W", i - 1), lbp.Row("b", i - 1)))
                         for i in range(1, 41)], [0], 40)
    p = {"W": jnp.full((40, 4, 4), 0.1, jnp.float64), "b": jnp.zeros((40, 4), jnp.float64)}
    x = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float64).reshape(2, 4)
    compact = plan_for(chain, chain.select_params(p), (x,), "loop").compact
    assert [g.names for g in compact.state_groups] == [(0, 40)]

    layers = [lbp.Layer(1, residual, (0,), (lbp.Row("W", 0), lbp.Row("b", 0)))]
    layers += [lbp.Layer(i, skip, (i - 1, max(i - 3, 0)), (lbp.Row("S", i - 2),)) if i % 2 == 0 else
               lbp.Layer(i, residual, (i - 1,), (lbp.Row("W", i // 2), lbp.Row("b", i // 2))) for i in range(2, 41)]
    net = lbp.Network(layers, [0], 40)
    params = {"W": jnp.full((20, 4, 4), 0.1, jnp.float64), "b": jnp.zeros((20, 4), jnp.float64),
              "S": jnp.full((39, 4, 4), 0.05, jnp.float64)}
    compact = plan_for(net, net.select_params(params), (x,), "loop").compact
    kept = {name for g in compact.state_groups for name in g.names}
    assert kept == {0, 40} | {i - 3 for i in range(4, 41, 2)}  # the states the skips read (and 0)
    loss = lambda q, x: jnp.sum(jnp.sin(net(q, x)))
    t = (jax.tree.map(jnp.ones_like, params), jnp.ones_like(x))
    np.testing.assert_allclose(lbp.jvp_by_solve(loss, (params, x), t, engine="loop")[1],
                               jax.jvp(loss, (params, x), t)[1], rtol=1e-10)


def test_forward_pass_is_bound_whole_under_partial_evaluation():
    """Under jax.grad the network call's JVP rule is partially evaluated; its forward pass with
    residuals is a custom_jvp call (all inputs known: bound as it is, where JAX's partial
    evaluation of a loop would re-analyse the body). Its rule is the plain JVP: an HVP through
    it stays exact."""
    net, params = network(40, 3)
    loss = lambda p, x: jnp.sum(jnp.sin(net(p, x)))
    x = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
    counts = counted(jax.make_jaxpr(lbp.grad_by_solve(loss, engine="loop"))(params, x))
    assert counts["custom_jvp_call"] >= 1 and counts["scan"] + counts["while"] >= 2
    t = jax.tree.map(jnp.ones_like, params)
    hvp = lambda grad: jax.jvp(lambda p: grad(loss)(p, x), (params,), (t,))[1]
    for a, e in zip(jax.tree.leaves(hvp(lambda f: lbp.grad_by_solve(f, engine="loop"))),
                    jax.tree.leaves(hvp(jax.grad))):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6)
