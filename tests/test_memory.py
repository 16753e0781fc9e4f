"""Networks built and differentiated in a loop are not kept alive by linbackprop's caches (nor by
JAX's, through parameters of linbackprop's primitives): memory stays bounded."""

import gc
import weakref

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given
from hypothesis import strategies as st

import linbackprop as lbp
from linbackprop import _plan
from linbackprop._solve import _call


class Model:
    """What a layer closes over (a model with arrays)."""

    def __init__(self, n: int):
        self.scale = jnp.full((64, 64), float(n))


def test_networks_built_in_a_loop_are_released(monkeypatch):
    # the jitted networks' bound lowered (it is read at each call): past both caches in 44
    # networks instead of 72, each a compile
    monkeypatch.setattr(_call, "JITTED_NETWORKS", 4)
    x, p = jnp.ones((2, 4)), {"W": jnp.ones((4, 4))}
    first = None
    count = _plan.make_plan.cache_info().maxsize + _call.JITTED_NETWORKS + 8
    for n in range(count):
        model = Model(n)
        layer = lambda th, u, model=model: jnp.tanh(u @ th[0]) * model.scale[0, 0]
        net = lbp.Network([lbp.Layer("h", layer, ("x",), ("W",))], ["x"], "h")
        g = lbp.grad_by_solve(lambda p, x, net=net: jnp.sum(net(p, x) ** 2))(p, x)
        assert g["W"].shape == (4, 4)
        if first is None:
            first = weakref.ref(model)
        del model, layer, net
    gc.collect()
    assert first() is None  # the first network, its closure and its compiled solve are gone
    live = sum(isinstance(o, Model) for o in gc.get_objects())
    assert live <= _plan.make_plan.cache_info().maxsize  # at most what the plan cache keeps
    assert jax.tree.leaves(g)


# -- checkpoints never cost memory ---------------------------------------------------------------


def _rnn(steps: int, every: bool, width: int = 32, batch: int = 8):
    cell = lambda th, h, x: jnp.tanh(h @ th[0] + x @ th[1] + th[2])
    layers = [lbp.Layer(t, cell, (t - 1, lbp.Row("xs", t - 1)), ("A", "B", "c")) for t in range(1, steps + 1)]
    net = lbp.Network(layers, [0, "xs"], lbp.Stack(range(1, steps + 1)) if every else steps)
    k = jax.random.split(jax.random.key(0), 3)
    params = {"A": 0.1 * jax.random.normal(k[0], (width, width)), "B": 0.1 * jax.random.normal(k[1], (width, width)),
              "c": jnp.zeros(width)}
    return (lambda p, h0, xs: jnp.sum(net(p, h0, xs) ** 2),
            (params, jnp.ones((batch, width)), jnp.ones((steps, batch, width))))


def _chain(depth: int, width: int, batch: int):
    step = lambda th, u: u + jnp.tanh(u @ th[0] + th[1])
    net = lbp.Network([lbp.Layer(i, step, (i - 1,), (lbp.Row("W", i - 1), lbp.Row("b", i - 1)))
                       for i in range(1, depth + 1)], [0], depth)
    params = {"W": 0.1 * jax.random.normal(jax.random.key(1), (depth, width, width)), "b": jnp.zeros((depth, width))}
    return lambda p, x: jnp.sum(net(p, x) ** 2), (params, jnp.ones((batch, width)))


def _skips(depth: int, width: int = 16, batch: int = 4):
    """Two kinds alternating, each layer also reading the state four layers back."""
    a = lambda th, u, s: jnp.tanh(u @ th[0]) + s
    b = lambda th, u, s: u * jax.nn.sigmoid(s @ th[0])
    layers = [lbp.Layer(i, a if i % 2 else b, (i - 1, max(i - 4, 0)), (lbp.Row("A" if i % 2 else "B", i // 2),))
              for i in range(1, depth + 1)]
    net = lbp.Network(layers, [0], depth)
    params = {"A": 0.2 * jnp.ones((depth // 2 + 1, width, width)), "B": 0.2 * jnp.ones((depth // 2 + 1, width, width))}
    return lambda p, x: jnp.sum(net(p, x) ** 2), (params, jnp.ones((batch, width)))


def _temps(loss, args, **settings) -> int:
    return jax.jit(lbp.grad_by_solve(loss, **settings)).lower(*args).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("name", ["rnn, every state an output (Stack)", "rnn, last state", "chain", "short chain",
                                  "two kinds with skips"])
def test_checkpoints_never_raise_temporaries(name):
    """``checkpoints=k`` keeps at most what the same call keeps without, for every k (where
    checkpointing would keep more — every state an output, one checkpoint, weights larger than
    the states — the call runs without it), with and without remat. k = 20 on the RNN: segments of
    13 layers, short enough to run unrolled (their ℳ* h rows once kept as 13 padded copies)."""
    loss, args = {"rnn, every state an output (Stack)": lambda: _rnn(256, True),
                  "rnn, last state": lambda: _rnn(256, False), "chain": lambda: _chain(64, 64, 32),
                  "short chain": lambda: _chain(24, 32, 4), "two kinds with skips": lambda: _skips(40)}[name]()
    for remat in (False, True):
        plain = _temps(loss, args, remat=remat)
        for k in (1, 2, 5, 15, 20):
            assert _temps(loss, args, remat=remat, checkpoints=k) <= plain, (remat, k)


def test_checkpoints_never_raise_temporaries_with_products_asked_in_the_loop():
    """``param_products="in_loop"`` asked for: short unrolled segments whose layers share their
    blocks still form ℳΛ as one product after their substitution (in the loop XLA kept every
    layer's product alive: a 64-step RNN in 10-layer segments kept 1.4× the plain call's)."""
    loss, args = _rnn(64, False)
    assert _temps(loss, args, param_products="in_loop", checkpoints=6) <= _temps(loss, args, param_products="in_loop")


@pytest.mark.parametrize("name", ["short chain", "rnn, last state"])
def test_checkpoints_never_raise_gauss_newton_temporaries(name):
    """The same for two Gauss–Newton products in one program: each product transposes the scan
    over the segments into a parameter-sized stack of its own (on the short chain one product kept
    2.7× the plain program's temporaries, three 6.7×, before the rule counted them); the long RNN,
    whose weights are small, still checkpoints and saves (0.58×)."""
    loss, args = {"short chain": lambda: _chain(24, 32, 4), "rnn, last state": lambda: _rnn(256, False)}[name]()

    def products(**settings):
        def f(p, *rest):
            _, g, G = lbp.gauss_newton(loss, **settings)(p, *rest)
            return G.mv(G.mv(g))
        return jax.jit(f).lower(*args).compile().memory_analysis().temp_size_in_bytes

    plain = products()
    assert products(checkpoints=5) <= plain
    assert products(checkpoints=20) <= plain * (0.7 if name.startswith("rnn") else 1.0)


@pytest.mark.parametrize("name", ["short chain", "rnn, last state", "rnn, segments tiling the inputs, remat"])
def test_checkpoints_never_raise_temporaries_under_vmap(name):
    """And for gradients vmapped over examples (the weights shared): the scan's parameter
    cotangents, stacked per example and moved into the result's layout, kept 2.3× the plain
    call's temporaries on the short chain; the RNN, whose weights are small, still saves (0.34×).
    Segments that tile the inputs (200 steps, k = 20) once scanned over them, reshaped: under
    vmap a copy of all inputs, twice (1.016× the plain call's); sliced in the body: 0.2×."""
    loss, args, k, settings = {"short chain": lambda: (*_chain(24, 32, 4), 8, {}),
                               "rnn, last state": lambda: (*_rnn(128, False), 8, {}),
                               "rnn, segments tiling the inputs, remat": lambda: (*_rnn(200, False), 20,
                                                                                  {"remat": True})}[name]()
    p, *rest = args
    batched = (p, *(jnp.stack([r] * 4) for r in rest))

    def temps(**more):
        f = jax.vmap(lbp.grad_by_solve(loss, **settings, **more), in_axes=(None,) + (0,) * len(rest))
        return jax.jit(f).lower(*batched).compile().memory_analysis().temp_size_in_bytes

    plain = temps()
    assert temps(checkpoints=k) <= plain * (0.5 if name.startswith("rnn") else 1.0)


def test_checkpoints_still_save_memory_where_they_can():
    """The rule above does not simply turn checkpointing off: a long RNN keeps a fraction (0.30
    since the plain call carries Λ instead of a buffer of every state: 1.11 -> 0.59 MB)."""
    loss, args = _rnn(256, False)
    assert _temps(loss, args, checkpoints=15) < 0.35 * _temps(loss, args)


def test_nested_schedule_memory_grows_slowly_with_the_sequence():
    """schedule="nested" with a fixed budget: temporaries grow by levels (like log T), evenly
    spaced segments like T/k; at T = 4096 the nested schedule keeps less than half."""
    nested, even = {}, {}
    for steps in (512, 4096):
        loss, args = _rnn(steps, False)
        nested[steps] = _temps(loss, args, checkpoints=15, schedule="nested")
        even[steps] = _temps(loss, args, checkpoints=15)
    assert nested[4096] / nested[512] < 0.6 * even[4096] / even[512]  # T × 8: measured 2.6× against 5.5×
    assert nested[4096] < 0.5 * even[4096]


def test_nested_schedule_keeps_no_more_than_equinox_checkpointed_scan():
    """The issue's RNN (T = 2048, width 64, batch 16, 45 checkpoints): schedule="nested" keeps at
    most the temporaries of equinox's checkpointed scan (a binomial schedule) with as many
    checkpoints (measured 0.64×)."""
    import equinox.internal as eqxi

    steps, width, batch, k = 2048, 64, 16, 45
    cell = lambda th, h, x: jnp.tanh(h @ th[0] + x @ th[1] + th[2])
    layers = [lbp.Layer(t, cell, (t - 1, lbp.Row("xs", t - 1)), ("A", "B", "c")) for t in range(1, steps + 1)]
    net = lbp.Network(layers, [0, "xs"], steps)
    key = jax.random.split(jax.random.key(2), 3)
    params = {"A": 0.1 * jax.random.normal(key[0], (width, width)),
              "B": 0.1 * jax.random.normal(key[1], (width, width)), "c": jnp.zeros(width)}
    args = (params, jnp.ones((batch, width)), jax.random.normal(key[2], (steps, batch, width)))

    def scanned(p, h0, xs):
        body = lambda h, x: (cell((p["A"], p["B"], p["c"]), h, x), None)
        return jnp.sum(eqxi.scan(body, h0, xs, kind="checkpointed", checkpoints=k)[0] ** 2)

    ours = _temps(lambda p, h0, xs: jnp.sum(net(p, h0, xs) ** 2), args, checkpoints=k, schedule="nested")
    theirs = jax.jit(jax.grad(scanned)).lower(*args).compile().memory_analysis().temp_size_in_bytes
    assert ours <= theirs


def test_checkpoints_with_remat_read_a_shared_weight_once():
    """With ``remat=True`` the layers of a segment are re-linearised for its products, each from
    its arguments: a weight all of them share is read once, not gathered per layer (a 200-step RNN
    in 15-layer segments kept 15 copies of A and B: 1.001× the plain call's temporaries, now
    0.53×)."""
    loss, args = _rnn(200, False)
    assert _temps(loss, args, remat=True, checkpoints=13) < 0.7 * _temps(loss, args, remat=True)


@pytest.mark.parametrize("k", [5, 9])
def test_checkpoints_never_raise_temporaries_of_a_call_carrying_lambda(k):
    """``param_products="in_loop"`` on a chain with one example: the plain call carries Λ from
    step to step and keeps little besides a weight row, while 3-layer segments copy their rows of
    the stacked weights (k = 9: 1.26× the plain call's temporaries, k = 5: 1.61×, before the
    bound counted both)."""
    loss, args = _chain(24, 32, 1)
    plain = _temps(loss, args, param_products="in_loop")
    assert _temps(loss, args, param_products="in_loop", checkpoints=k) <= plain


def test_checkpoints_never_raise_temporaries_where_segments_copy_their_weights():
    """A chain whose stacked weights outweigh its states, in 7-layer segments: each copies its
    rows and keeps its products with them (1.09× the plain call's temporaries before)."""
    loss, args = _chain(64, 64, 4)
    assert _temps(loss, args, checkpoints=9) <= _temps(loss, args)


def test_checkpoints_never_raise_temporaries_of_one_example_whose_segments_loop():
    """One example through a 64-step RNN with remat, 7-layer segments that loop over their layers:
    each segment's loop stacks the shared blocks and scatters into their cotangent, twice (its
    recomputation, its substitution), which outweighs states of one example (the rule predicted
    0.39 of the plain call and kept 1.11× before it counted those copies; a fresh draw of the
    random test below found it)."""
    loss, args = _rnn(64, False, 32, 1)
    assert _temps(loss, args, checkpoints=9, remat=True) <= _temps(loss, args, remat=True)


@pytest.mark.parametrize("name", ["rnn of 8 steps, remat", "chain, weights outweighing the states"])
def test_checkpoints_left_out_leave_the_plain_program(name):
    """Where the rule runs the call without checkpoints, the program is the plain call's, text for
    text: nothing else depends on checkpoints having been asked for (an 8-step RNN with remat
    formed ℳΛ after its substitution, as checkpointed segments do, and kept 1.05×)."""
    loss, args, settings_ = {"rnn of 8 steps, remat": lambda: (*_rnn(8, False, 8, 1), {"remat": True}),
                             "chain, weights outweighing the states": lambda: (*_chain(64, 64, 32), {})}[name]()
    program = lambda **more: jax.jit(lbp.grad_by_solve(loss, **settings_, **more)).lower(*args).as_text()
    assert program(checkpoints=2) == program()


@given(network=st.sampled_from(["chain", "rnn", "rnn, every state an output", "two kinds with skips"]),
       depth=st.sampled_from([8, 24, 64, 200]), width=st.sampled_from([8, 32, 64]), batch=st.sampled_from([1, 4, 32]),
       k=st.sampled_from([2, 3, 5, 9, 13, 20]),
       setting=st.sampled_from([{}, {"remat": True}, {"schedule": "nested"}, {"param_products": "after"},
                                {"param_products": "in_loop"}]))
def test_checkpoints_never_raise_temporaries_over_random_networks(network, depth, width, batch, k, setting):
    """The rule over random networks and settings (the space ``benchmarks/profile.py
    checkpoint-memory --sweep`` draws from; it found the cases above)."""
    if network != "rnn" and depth == 200:
        depth = 40  # long stacked weights or skips: slow to compile, nothing new
    loss, args = {"chain": lambda: _chain(depth, width, batch),
                  "rnn": lambda: _rnn(depth, False, width, batch),
                  "rnn, every state an output": lambda: _rnn(depth, True, width, batch),
                  "two kinds with skips": lambda: _skips(depth, width, batch)}[network]()
    plain = {key: value for key, value in setting.items() if key != "schedule"}
    assert _temps(loss, args, checkpoints=k, **setting) <= _temps(loss, args, **plain)
