"""The engine's switches: ℳΛ in the loop or batched after it, and rematerialisation. Every
combination must give jax.grad's gradient; remat must really keep fewer bytes."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from networks import REGISTRY, equations
from trees import assert_trees_close

import linbackprop as lbp

MODES = [dict(param_products="in_loop", engine="loop"), dict(remat=True, engine="loop"),
         dict(remat=True, param_products="after"), dict(param_products="after", engine="unrolled")]


def assert_close(actual, expected, rtol=1e-9):
    assert_trees_close(actual, expected, rtol=rtol, atol=1e-12)


@pytest.mark.parametrize("name", ["seed", "lstm", "stacked"])
@pytest.mark.parametrize("mode", MODES, ids=str)
def test_modes_match_jax_grad(name, mode):
    case = REGISTRY[name]()
    argnums = tuple(range(1 + len(case.inputs)))
    expected = jax.jit(jax.grad(case.loss, argnums))(case.params, *case.inputs)
    assert_close(jax.jit(lbp.grad_by_solve(case.loss, argnums, **mode))(case.params, *case.inputs), expected)
    _, grads = jax.jit(lbp.value_and_grad_by_solve(case.loss, **mode))(case.params, *case.inputs)
    assert_close(grads, expected[0])


@pytest.mark.parametrize("mode", MODES, ids=str)
def test_modes_compose_with_hvp_and_vmap(mode):
    case = REGISTRY["seed"]()
    t = jax.tree.map(jnp.ones_like, case.params)
    hvp = lambda grad: jax.jvp(lambda p: grad(case.loss)(p, *case.inputs), (case.params,), (t,))[1]
    assert_close(jax.jit(lambda: hvp(lambda f: lbp.grad_by_solve(f, **mode)))(), jax.jit(lambda: hvp(jax.grad))(),
                 rtol=1e-8)
    xs = jnp.stack([case.inputs[0], -case.inputs[0]])
    per_example = lambda grad: jax.vmap(grad(case.loss), (None, 0))(case.params, xs)
    assert_close(jax.jit(lambda: per_example(lambda f: lbp.grad_by_solve(f, **mode)))(),
                 jax.jit(lambda: per_example(jax.grad))())


def test_the_switch_changes_the_program():
    case = REGISTRY["chain"]()
    text = lambda **kw: str(jax.make_jaxpr(lbp.grad_by_solve(case.loss, **kw))(case.params, *case.inputs))
    after, in_loop = text(param_products="after", engine="loop"), text(param_products="in_loop", engine="loop")
    assert after != in_loop
    # The rule: after the loop when the loop runs; in the loop with remat or when unrolled.
    assert text(engine="loop") == after
    assert text(engine="loop", remat=True) == text(engine="loop", remat=True, param_products="in_loop")
    assert text(engine="unrolled") == text(engine="unrolled", param_products="in_loop")
    assert text(engine="unrolled") != text(engine="unrolled", param_products="after")
    with pytest.raises(ValueError, match="param_products must be"):
        lbp.grad_by_solve(case.loss, param_products="sometimes")


def test_remat_keeps_fewer_bytes():
    depth, width = 32, 16
    layer = lambda th, u: u + jnp.tanh(u @ th[0])
    net = lbp.Network([lbp.Layer(i, layer, (i - 1,), (lbp.Row("W", i - 1),)) for i in range(1, depth + 1)], [0], depth)
    loss = lambda p, x: jnp.sum(net(p, x) ** 2)
    args = ({"W": jnp.ones((depth, width, width)) * 0.01}, jnp.ones((64, width)))
    compiled = lambda **kw: jax.jit(lbp.grad_by_solve(loss, **kw)).lower(*args).compile()
    temp = lambda **kw: compiled(**kw).memory_analysis().temp_size_in_bytes
    assert temp(remat=True) < 0.8 * temp()


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the one-row rule is CPU's (measured there)")
def test_one_row_forms_the_products_in_the_loop():
    """One example (one row): each weight product is an outer product, which after the loop XLA
    formed by broadcasting in the transposed layout and copied into the gradient — temporaries the
    size of the weights (2.2 MB against jax.grad over lax.scan's 116 KB on a 128×64 chain). The
    rule forms them in the loop there: about the scan's temporaries (0.73× with JAX 0.10, 1.01×
    with 0.12)."""
    depth, width = 128, 64
    layer = lambda th, u: u + jnp.tanh(u @ th[0])
    net = lbp.Network([lbp.Layer(i, layer, (i - 1,), (lbp.Row("W", i - 1),)) for i in range(1, depth + 1)], [0], depth)
    loss = lambda p, x: jnp.sum(net(p, x) ** 2)
    p, x = {"W": jnp.ones((depth, width, width)) * 0.01}, jnp.ones((1, width))
    scan = lambda W, x: jnp.sum(jax.lax.scan(lambda u, w: (layer((w,), u), None), x, W)[0] ** 2)
    temp = lambda f, *args: jax.jit(f).lower(*args).compile().memory_analysis().temp_size_in_bytes
    ours = temp(lbp.grad_by_solve(loss, engine="loop"), p, x)
    assert ours <= 1.1 * temp(jax.grad(scan), p["W"], x) and ours < p["W"].nbytes / 8
    program = lambda **kw: str(jax.make_jaxpr(lbp.grad_by_solve(loss, engine="loop", **kw))(p, x))
    assert program() == program(param_products="in_loop")


def test_every_transform_and_linearize_see_the_settings_they_were_given(monkeypatch):
    """Each transform enters its settings whole (one frozen value): inside another transform's
    context nothing of the outer options leaks in, and every plan is made with the engine the
    settings name (``linearize`` planned with "auto" while its forward pass read the engine of
    the enclosing mode; ``jvp_by_solve`` set 6 of the 9 modes)."""
    from linbackprop import _plan
    from linbackprop._options import _settings
    from linbackprop._solve import _transforms
    seen = []
    make_plan = _plan.make_plan

    def recording(net, params, inputs, engine="auto", *rest):
        seen.append((engine, _settings.current()))
        return make_plan(net, params, inputs, engine, *rest)

    monkeypatch.setattr(_plan._make, "make_plan", recording)  # where plan_for calls it
    layers = [lbp.Layer(i, lambda th, u: jnp.tanh(u @ th[0]), (i - 1,), (lbp.Row("W", i - 1),)) for i in range(1, 5)]
    net = lbp.Network(layers, [0], 4)
    p, x = {"W": 0.5 * jnp.ones((4, 3, 3))}, jnp.ones((2, 3))
    loss = lambda p, x: jnp.sum(net(p, x) ** 2)
    losses = lambda p, x: jnp.sum(net(p, x) ** 2, axis=1)
    S = _settings.Settings
    cases = [
        (lambda: lbp.jvp_by_solve(loss, (p, x), (p, x), engine="loop"), S(engine="loop", forward_only=True)),
        (lambda: lbp.grad_by_solve(loss, engine="unrolled", param_products="after")(p, x),
         S(engine="unrolled", param_products="after")),
        (lambda: lbp.value_and_grad_by_solve(loss, remat=True, engine="loop")(p, x), S(engine="loop", remat=True)),
        (lambda: lbp.gauss_newton(loss, engine="loop")(p, x)[2].mv(p), S(engine="loop", products=True)),
        (lambda: lbp.per_example_grads(losses, engine="unrolled")(p, x), S(engine="unrolled")),
        (lambda: lbp.per_example_grad_norms(losses, engine="loop")(p, x), S(engine="loop")),
        (lambda: lbp.diag_ggn(loss, engine="unrolled")(p, x), S(engine="unrolled")),
        (lambda: lbp.kfac_factors(loss, engine="loop")(p, x), S(engine="loop")),
        (lambda: lbp.linearize(net, p, x).L.T.solve({i: jnp.ones((2, 3)) for i in range(1, 5)}), S()),
    ]
    outer = dict(engine="unrolled", remat=True, checkpoints=2, schedule="nested", param_products="in_loop",
                 products=True)
    for n, (run, expected) in enumerate(cases):
        # alone, and (jvp_by_solve, gauss_newton, per-example, linearize) inside another transform's context
        for context in (lambda f: f(), lambda f: _transforms.solve_mode(f, **outer)())[:1 + (n in (0, 3, 4, 8))]:
            seen.clear()
            make_plan.cache_clear()  # every plan made anew, under the eyes of `recording`
            jax.make_jaxpr(lambda: context(run))()  # traced: plans are made at trace time
            assert seen, expected
            if run is not cases[-1][0]:  # linearize enters no context: it passes its settings down
                assert {s for _, s in seen} == {expected}, (expected, seen)
            assert {e for e, _ in seen} == {expected.engine}, (expected, seen)


def test_the_solve_variant_is_decided_once_and_runs_as_decided(monkeypatch):
    """`solve_variant` is the one place that decides how a call's linear part is solved; the
    variant object it returns (recorded where `_call` asks) is what runs — the solve primitive's
    parameter where the call stores its linearisation, the fused forward sweep under
    `jvp_by_solve` — for each kind of call, each giving plain JAX's derivative."""
    from linbackprop._solve import _call
    from linbackprop._solve._in_forward_sweep import InForwardSweep
    from linbackprop._solve._params_after import ParamsAfter
    from linbackprop._solve._params_before import ParamsBefore
    from linbackprop._solve._params_in_loop import ParamsInLoop
    from linbackprop._solve._states_only import StatesOnly

    asked = []
    decide = _call.solve_variant

    def recording(plan, settings, moves_params):
        asked.append(decide(plan, settings, moves_params))
        return asked[-1]

    monkeypatch.setattr(_call, "solve_variant", recording)
    layers = [lbp.Layer(i, lambda th, u: jnp.tanh(u @ th[0]), (i - 1,), (lbp.Row("W", i - 1),)) for i in range(1, 9)]
    net = lbp.Network(layers, [0], 8)
    p, x = {"W": 0.5 * jax.random.normal(jax.random.key(0), (8, 3, 3))}, jnp.ones((2, 3))
    loss = lambda p, x: jnp.sum(net(p, x) ** 2)
    cases = {
        "loop": (dict(engine="loop"), 0, ParamsAfter, "loop"),
        "in the loop": (dict(engine="loop", param_products="in_loop"), 0, ParamsInLoop, "loop"),
        "unrolled": (dict(engine="unrolled", param_products="after"), 0, ParamsBefore, "unrolled"),
        "unrolled in the loop": (dict(engine="unrolled", param_products="in_loop"), 0, ParamsInLoop, "unrolled"),
        "inputs only": (dict(engine="loop"), 1, StatesOnly, "loop"),
    }
    for name, (options, argnums, kind, engine) in cases.items():
        asked.clear()
        got = jax.jit(lbp.grad_by_solve(loss, argnums=argnums, **options))(p, x)
        want = jax.grad(loss, argnums=argnums)(p, x)
        assert len(asked) == 1, (name, asked)  # one decision per call traced
        assert type(asked[0]) is kind and asked[0].engine == engine, (name, asked[0])
        assert asked[0].compact == (engine == "loop"), (name, asked[0])
        solves = [e.params["variant"] for e in equations(jax.make_jaxpr(lbp.grad_by_solve(loss, argnums=argnums,
                                                                                           **options))(p, x))
                  if e.primitive.name == "linbackprop_solve"]
        assert solves and {type(v) for v in solves} == {kind}, (name, solves)  # the primitive's parameter
        assert_trees_close(got, want, rtol=1e-5, atol=1e-6)
    for engine in ("loop", "unrolled"):  # jvp_by_solve alone: nothing stored, no primitive bound
        asked.clear()
        t = jax.tree.map(jnp.ones_like, p)
        got = lbp.jvp_by_solve(loss, (p, x), (t, jnp.zeros_like(x)), engine=engine)
        assert [type(v) for v in asked] == [InForwardSweep] and asked[0].moves_params, asked
        assert not [e for e in equations(jax.make_jaxpr(lambda: lbp.jvp_by_solve(loss, (p, x), (t, jnp.zeros_like(x)),
                                                                                  engine=engine))())
                    if e.primitive.name == "linbackprop_solve"]
        assert_trees_close(got, jax.jvp(loss, (p, x), (t, jnp.zeros_like(x))), rtol=1e-6)
    # the memory model's count: ℳΛ in the loop keeps no Λ beyond the step's
    plan = asked[0].plan
    assert ParamsInLoop(plan).least_kept(10, 3) == 13 and ParamsAfter(plan).least_kept(10, 3) == 23


PROGRAM = """
import jax, jax.numpy as jnp
import linbackprop as lbp
jax.config.update("jax_enable_x64", True)
step = lambda th, u: u + jnp.tanh(u @ th[0] + th[1])
net = lbp.Network([lbp.Layer(i, step, (i - 1,), (lbp.Row("W", i - 1), lbp.Row("b", i - 1))) for i in range(1, 9)],
                  [0], 8)
loss = lambda p, x: jnp.sum(net(p, x) ** 2)
p, x = {"W": jnp.zeros((8, 4, 4)), "b": jnp.zeros((8, 4))}, jnp.ones((3, 4))
print(jax.make_jaxpr(lbp.grad_by_solve(loss, engine="loop"))(p, x))
"""


@pytest.mark.slow
def test_a_program_is_the_same_in_every_process():
    """The jaxpr of a gradient does not depend on Python's string hashing (``PYTHONHASHSEED``):
    the loop's write slots were ordered by iterating a set of buffers, so two processes built the
    same program with its updates in different orders — different programs to XLA and to the
    persistent compilation cache."""
    runs = [subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "PYTHONHASHSEED": seed}, check=True).stdout for seed in ("1", "2")]
    assert runs[0] == runs[1]
