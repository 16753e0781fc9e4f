"""Sequences and memory: stacked inputs (Row reads), stacked outputs (Stack), checkpoints=k.

Every gradient is compared with jax.grad of the same network called plainly (float64)."""

import dataclasses
import typing

import jax
import jax.extend
import jax.numpy as jnp
import pytest
from trees import assert_trees_close

import linbackprop as lbp
from linbackprop._options._policy import POLICY, Policy
from linbackprop._options._settings import Settings, current, using
from linbackprop._solve._segments import split, units

pytestmark = pytest.mark.usefixtures("always_checkpoint")  # the segments are under test

T, B, W, D = 24, 3, 4, 5


def cell(th, h, x):
    return jnp.tanh(h @ th[0] + x["u"] @ th[1] + x["v"][:, None] * th[2])


def rnn(steps=T, outputs="last"):
    layers = [lbp.Layer(t, cell, (t - 1, lbp.Row("xs", t - 1)), ("A", "B", "c")) for t in range(1, steps + 1)]
    outs = {"last": steps, "every": lbp.Stack(range(1, steps + 1)),
            "mixed": [lbp.Stack(range(2, steps + 1, 3)), 5, lbp.Stack([steps, 1])]}[outputs]
    return lbp.Network(layers, [0, "xs"], outs)


def data(steps=T, seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 5)
    p = {"A": jax.random.normal(k[0], (W, W)) / 2, "B": jax.random.normal(k[1], (D, W)) / 2,
         "c": jax.random.normal(k[2], (W,))}
    xs = {"u": jax.random.normal(k[3], (steps, B, D)), "v": jax.random.normal(k[4], (steps, B))}
    return p, jnp.ones((B, W)) * 0.1, xs


def loss_of(net):
    return lambda p, h0, xs: sum(jnp.sum(jnp.sin(o) * (1 + n)) for n, o in enumerate(jax.tree.leaves(net(p, h0, xs))))


def close(a, b, tol=1e-10):  # this file's tolerance, the one tree comparison
    assert_trees_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("outputs", ["last", "every", "mixed"])
@pytest.mark.parametrize("engine", ["loop", "unrolled"])
def test_stacked_inputs_and_outputs_match_jax_grad(outputs, engine):
    net = rnn(outputs=outputs)
    loss = loss_of(net)
    args = data()
    expected = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)
    close(lbp.grad_by_solve(loss, argnums=(0, 1, 2), engine=engine)(*args), expected)
    close(jax.jit(lbp.grad_by_solve(loss, engine=engine))(*args), expected[0])  # params only: no xs cotangent


def test_stack_output_values_and_forward_mode():
    net = rnn(outputs="mixed")
    p, h0, xs = data()
    states = net.states(p, h0, xs)
    hs, five, pair = net(p, h0, xs)
    close(hs, jnp.stack([states[t] for t in range(2, T + 1, 3)]))
    close(pair, jnp.stack([states[T], states[1]]))
    close(five, states[5])
    tangent = jax.tree.map(jnp.ones_like, p)
    ours = lbp.jvp_by_solve(lambda q: net(q, h0, xs), (p,), (tangent,))
    close(ours, jax.jvp(lambda q: net(q, h0, xs), (p,), (tangent,)))


@pytest.mark.parametrize(("checkpoints", "outputs"), [(1, "every"), (3, "mixed"), (5, "last"), (22, "every")])
def test_checkpoints_match_jax_grad(checkpoints, outputs):
    net = rnn(outputs=outputs)
    loss = loss_of(net)
    args = data()
    expected = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)
    close(lbp.grad_by_solve(loss, argnums=(0, 1, 2), checkpoints=checkpoints)(*args), expected)
    value, grads = jax.jit(lbp.value_and_grad_by_solve(loss, checkpoints=checkpoints))(*args)
    close(value, loss(*args))
    close(grads, expected[0])


def residual(th, u):
    return u + jnp.tanh(u @ th[0] + th[1])


def skip(th, u, s):
    return u + jnp.tanh(u @ th[0] + s @ th[1])


@pytest.mark.parametrize("checkpoints", [2, 7])
def test_checkpoints_on_a_dag_with_row_blocks_and_long_skips(checkpoints):
    """Skips reaching across segments, two kinds, Row-stacked blocks, a shared block."""
    layers = []
    for i in range(1, 31):
        if i % 3 == 0:
            layers.append(lbp.Layer(i, skip, (i - 1, max(i - 7, 0)), (lbp.Row("W", i - 1), "S")))
        else:
            layers.append(lbp.Layer(i, residual, (i - 1,), (lbp.Row("W", i - 1), lbp.Row("b", i - 1))))
    net = lbp.Network(layers, [0], [30, lbp.Stack([10, 20])])
    k = jax.random.split(jax.random.PRNGKey(1), 4)
    p = {"W": jax.random.normal(k[0], (30, W, W)) / 3, "b": jax.random.normal(k[1], (30, W)),
         "S": jax.random.normal(k[2], (W, W)) / 3}
    x = jax.random.normal(k[3], (B, W))
    loss = lambda p, x: jnp.sum(jnp.cos(net(p, x)[0])) + jnp.sum(net(p, x)[1] ** 2)
    expected = jax.jit(jax.grad(loss, argnums=(0, 1)))(p, x)
    close(lbp.grad_by_solve(loss, argnums=(0, 1), checkpoints=checkpoints)(p, x), expected)


def test_checkpoints_compose_with_hessian_vector_products():
    net = rnn(steps=12)
    loss = loss_of(net)
    p, h0, xs = data(12)
    v = jax.tree.map(jnp.ones_like, p)
    hvp = lambda g: jax.jvp(lambda q: g(lambda r: loss(r, h0, xs))(q), (p,), (v,))[1]
    close(hvp(lambda f: lbp.grad_by_solve(f, checkpoints=3)), hvp(jax.grad), tol=1e-9)


def _size(jaxpr) -> int:
    """Equations, nested ones included."""
    n = 0
    for eqn in jaxpr.eqns:
        n += 1
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            n += _size(sub)
    return n


@pytest.mark.parametrize("checkpoints", [None, "per 16 steps"])
def test_program_does_not_grow_with_the_sequence(checkpoints):
    sizes = []
    for steps in (64, 256):
        net = rnn(steps, outputs="every")
        k = None if checkpoints is None else steps // 16 - 1
        grad = lbp.grad_by_solve(loss_of(net), checkpoints=k)
        sizes.append(_size(jax.make_jaxpr(grad)(*data(steps)).jaxpr))
    assert sizes[0] == sizes[1]


def test_bad_sequences_are_named():
    with pytest.raises(lbp.GraphError, match="Row in reads names a row of a stacked network input"):
        lbp.Network([lbp.Layer(1, cell, (0,), ()), lbp.Layer(2, cell, (1, lbp.Row(1, 0)), ())], [0], 2)
    with pytest.raises(lbp.GraphError, match="read whole by layer 2 and by rows"):
        lbp.Network([lbp.Layer(1, cell, (0, lbp.Row("xs", 0)), ()), lbp.Layer(2, cell, (1, "xs"), ())],
                    [0, "xs"], 2)
    net = rnn(outputs="every")
    p, h0, xs = data(T - 1)
    with pytest.raises(ValueError, match=r"reads Row\(block='xs', index=23\).*leading axis longer"):
        net(p, h0, xs)
    odd = lbp.Network([lbp.Layer(1, lambda th, x: x, (0,)), lbp.Layer(2, lambda th, x: x.sum(0), (1,))],
                      [0], lbp.Stack([1, 2]))
    with pytest.raises(ValueError, match=r"Stack\(\[1, 2\]\).*differ"):
        odd({}, jnp.ones((2, 3)))
    with pytest.raises(ValueError, match=r"Stack\(\[1, 2\]\).*differ"):
        lbp.grad_by_solve(lambda x: jnp.sum(odd({}, x)[0]))(jnp.ones((2, 3)))
    with pytest.raises(ValueError, match="checkpoints must be a positive int"):
        lbp.grad_by_solve(lambda x: x, checkpoints=0)


def test_checkpoints_with_unevenly_spaced_rows():
    """Segments alike whose Row indices move by different amounts are one scan all the same
    (each step slices its rows at a table's offsets)."""
    index = [i if i < 8 else i + 2 for i in range(16)]  # rows 0..7, then 10..17
    net = lbp.Network([lbp.Layer(i + 1, residual, (i,), (lbp.Row("W", index[i]), lbp.Row("b", index[i])))
                       for i in range(16)], [0], 16)
    k = jax.random.split(jax.random.PRNGKey(2), 3)
    p = {"W": jax.random.normal(k[0], (18, W, W)) / 3, "b": jax.random.normal(k[1], (18, W))}
    x = jax.random.normal(k[2], (B, W))
    loss = lambda p, x: jnp.sum(jnp.sin(net(p, x)))
    close(lbp.grad_by_solve(loss, checkpoints=3)(p, x), jax.grad(loss)(p, x))
    assert [len(unit) for unit in units(split(net, 3))] == [4]


def _periodic_dag(depth: int) -> lbp.Network:
    """Kinds repeating with period 3 (two residual layers, then a skip reaching 7 layers back)."""
    return lbp.Network([lbp.Layer(i, skip, (i - 1, max(i - 7, 0)), (lbp.Row("W", i - 1), "S")) if i % 3 == 0 else
                        lbp.Layer(i, residual, (i - 1,), (lbp.Row("W", i - 1), lbp.Row("b", i - 1)))
                        for i in range(1, depth + 1)], [0], depth)


def _periodic_problem(depth: int, seed: int) -> tuple:
    """``_periodic_dag(depth)`` with random parameters and input, and a loss of its output."""
    net = _periodic_dag(depth)
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    p = {"W": jax.random.normal(k[0], (depth, W, W)) / 3, "b": jax.random.normal(k[1], (depth, W)),
         "S": jax.random.normal(k[2], (W, W)) / 3}
    return net, lambda p, x: jnp.sum(jnp.cos(net(p, x))), p, jax.random.normal(k[3], (B, W))


def test_program_does_not_grow_with_checkpoints_when_the_period_does_not_divide_the_segments():
    """60 layers repeating with period 3: ⌈60/(k+1)⌉-layer segments are not translates for most k;
    segments of the next multiple of the period are, so the program is one scan (and a first
    and a last segment) whatever k: its size does not grow with k."""
    net, loss, p, x = _periodic_problem(60, seed=3)
    sizes = []
    for checkpoints in (3, 5, 7, 11, 19):
        assert len(units(split(net, checkpoints))) <= 3, checkpoints
        assert len(split(net, checkpoints)) <= checkpoints + 1  # at most k states kept
        sizes.append(_size(jax.make_jaxpr(lbp.grad_by_solve(loss, checkpoints=checkpoints))(p, x).jaxpr))
    assert max(sizes[1:]) <= sizes[0], sizes
    close(lbp.grad_by_solve(loss, checkpoints=11)(p, x), jax.grad(loss)(p, x))


@pytest.mark.parametrize("checkpoints", [7, 9])  # 61 layers: segments of 8 and of 7, neither tiling the rows
def test_checkpoints_keep_fewer_temporaries_and_no_copy_of_the_weights(checkpoints):
    """compiled.memory_analysis() is deterministic: the checkpointed gradient's temporaries are a
    fraction of the plain solve's and smaller than the stacked weights (a scan that copied the
    rows it reads would hold most of them)."""
    n, width = 61, 32
    net = lbp.Network([lbp.Layer(i, residual, (i - 1,), (lbp.Row("W", i - 1), lbp.Row("b", i - 1)))
                       for i in range(1, n + 1)], [0], n)
    p = {"W": jnp.ones((n, width, width)) / width, "b": jnp.zeros((n, width))}
    x = jnp.ones((16, width))
    loss = lambda p, x: jnp.sum(jnp.sin(net(p, x)))

    def temp(**kw):
        return jax.jit(lbp.grad_by_solve(loss, **kw)).lower(p, x).compile().memory_analysis().temp_size_in_bytes

    ours = temp(checkpoints=checkpoints)
    assert ours < 0.35 * temp() and ours < p["W"].nbytes
    close(lbp.grad_by_solve(loss, checkpoints=checkpoints)(p, x), jax.grad(loss)(p, x))


def test_checkpoints_with_states_a_scan_carries_read_again_later():
    """States that the scan over segments carries (7, 14, 21 for segments of 7) read again by a
    final layer and a Stack: they come from the stacked outputs or the last carry."""
    final = lambda th, h, a, b: h * a + b @ th[0]
    for reads in [(T, 7, 14), (T, 14, 21)]:
        layers = list(rnn().layers) + [lbp.Layer("out", final, reads, ("O",))]
        net = lbp.Network(layers, [0, "xs"], ["out", lbp.Stack([7, 14])])
        p, h0, xs = data()
        p = {**p, "O": jnp.eye(W) / 2}
        loss = lambda p, h0, xs, net=net: jnp.sum(jnp.sin(net(p, h0, xs)[0])) + jnp.sum(net(p, h0, xs)[1] ** 3)
        assert [len(unit) for unit in units(split(net, 3))] == [3, 1]  # one scan of three segments
        close(lbp.grad_by_solve(loss, argnums=(0, 1, 2), checkpoints=3)(p, h0, xs),
              jax.grad(loss, argnums=(0, 1, 2))(p, h0, xs))


def test_blocks_of_the_operators_of_a_network_reading_rows_of_an_input():
    """lin.L.block(i, j) and lin.M.block of a layer that reads x_t by Row: Jacobians of the cell
    (block() looked the Row up as a state and raised KeyError)."""
    net = rnn(steps=4)
    p, h0, xs = data(4)
    lin = lbp.linearize(net, p, h0, xs)
    theta = (p["A"], p["B"], p["c"])
    jac = jax.jacobian(lambda h: cell(theta, h, jax.tree.map(lambda a: a[2], xs)))(lin.states[2])
    close(lin.L.block(3, 2).todense(), -jac.reshape(B * W, B * W))
    jac_a = jax.jacobian(lambda a: cell((a, p["B"], p["c"]), lin.states[2], jax.tree.map(lambda x: x[2], xs)))(p["A"])
    close(lin.M.T.block(3, "A").todense(), jac_a.reshape(B * W, W * W))


@dataclasses.dataclass(frozen=True)
class _LevelsByLayersAlone(Policy):
    """Nested levels chosen without the cost of a level (these tiny parameters would make one
    level cheapest), each choice recorded."""

    chosen: typing.ClassVar[list] = []

    def nested_levels(self, layers, checkpoints, level_cost=0.0):
        self.chosen.append(super().nested_levels(layers, checkpoints, 0.0))
        return self.chosen[-1]


@pytest.fixture
def levels_by_layers_alone():
    """Every test below runs two or three levels: the policy injected, the levels it chose."""
    _LevelsByLayersAlone.chosen.clear()
    around = current().policy  # always_checkpoint's
    with using(Settings(policy=_LevelsByLayersAlone(**{f.name: getattr(around, f.name)
                                                       for f in dataclasses.fields(Policy)}))):
        yield _LevelsByLayersAlone.chosen


@pytest.mark.parametrize(("steps", "checkpoints", "outputs"), [(64, 9, "last"), (40, 3, "mixed")])
def test_nested_schedule_matches_jax_grad(steps, checkpoints, outputs, levels_by_layers_alone):
    """schedule="nested": segments within segments (stacked inputs handed down whole with offsets),
    pytree xs read by Row, Stack outputs, argnums over parameters, h0 and xs."""
    net = rnn(steps, outputs)
    loss = loss_of(net)
    args = data(steps, seed=4)
    expected = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)
    close(jax.jit(lbp.grad_by_solve(loss, argnums=(0, 1, 2), checkpoints=checkpoints, schedule="nested"))(*args),
          expected)
    assert levels_by_layers_alone and all(len(levels) > 1 for levels in levels_by_layers_alone)


def test_nested_schedule_on_a_chain_with_row_blocks_and_skips(levels_by_layers_alone):
    _, loss, p, x = _periodic_problem(36, seed=5)
    close(jax.jit(lbp.grad_by_solve(loss, argnums=(0, 1), checkpoints=6, schedule="nested"))(p, x),
          jax.jit(jax.grad(loss, argnums=(0, 1)))(p, x))
    assert len(levels_by_layers_alone[-1]) > 1


def test_nested_levels_fit_the_budget():
    for layers, checkpoints in [(2048, 45), (16384, 45), (100, 3), (64, 9), (10, 1), (1000, 45)]:
        for cost in (0.0, 8.0, 1e4):
            levels = POLICY.nested_levels(layers, checkpoints, cost)
            assert sum(levels) <= checkpoints and all(k >= 1 for k in levels)
    # 2048 = 8 · 8 · 8 · 4: three levels of 7 states, leaves of 4 layers, no segment of another
    # length (a remainder is another program below, with buffers of its own).
    assert POLICY.nested_levels(2048, 45, 8.0) == (7, 7, 7)
    assert POLICY.nested_levels(16384, 45, 8.0) == (7, 7, 7, 7)  # a longer sequence: one more level
    assert POLICY.nested_levels(2048, 45, 1e4) == (45,)  # levels dearer than states: evenly spaced
    assert POLICY.nested_levels(2048, 9, 8.0) == (1, 1, 1, 3, 3)  # few states: more levels (as revolve)
    with pytest.raises(ValueError, match="give their number, checkpoints=k"):
        lbp.grad_by_solve(lambda x: x, schedule="nested")
    with pytest.raises(ValueError, match="schedule must be one of"):
        lbp.grad_by_solve(lambda x: x, checkpoints=3, schedule="binomial")
