"""Linear solves that keep only the rows read again (``plan.compact``): the forward substitution
carries Z_i from step to step and returns the rows of inputs, outputs and states read from the
buffer. With rhs at the input rows alone (ℳ* h formed in the loop, or a tangent of the inputs
only) its transpose, the back substitution, carries the cotangent of those reads back too; with
ℳ* h formed before the loop rhs is read at every row. Every product, its transpose and their
derivatives (the linearisation moving) must stay exact."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from networks import equations, gated, residual, skip
from trees import assert_trees_close

import linbackprop as lbp
from linbackprop._options._policy import Policy
from linbackprop._options._settings import Settings, using
from linbackprop._solve._params_after import ParamsAfter


def rnn_cell(th, h, x):
    return jnp.tanh(h @ th[0] + x @ th[1])


def f64(tree):
    return jax.tree.map(lambda v: jnp.asarray(v, jnp.float64), tree)


def chain_case(depth=16):
    net = lbp.Network([lbp.Layer(i, residual, (i - 1,), (lbp.Row("W", i - 1), lbp.Row("b", i - 1)))
                       for i in range(1, depth + 1)], [0], depth)
    rng = np.random.default_rng(0)
    params = f64({"W": 0.3 * rng.standard_normal((depth, 4, 4)), "b": 0.1 * rng.standard_normal((depth, 4))})
    return net, params, (f64(rng.standard_normal((3, 4))),)


def skips_case():
    """Skips three states back (rows the buffer keeps), an output read again by a later layer."""
    layers = [lbp.Layer(1, residual, (0,), (lbp.Row("W", 0), lbp.Row("b", 0)))]
    layers += [lbp.Layer(i, skip, (i - 1, max(i - 3, 0)), (lbp.Row("S", i - 2),)) if i % 2 == 0 else
               lbp.Layer(i, residual, (i - 1,), (lbp.Row("W", i // 2), lbp.Row("b", i // 2))) for i in range(2, 31)]
    net = lbp.Network(layers, [0], [30, 20])
    rng = np.random.default_rng(1)
    params = f64({"W": 0.3 * rng.standard_normal((15, 4, 4)), "b": 0.1 * rng.standard_normal((15, 4)),
                  "S": 0.2 * rng.standard_normal((29, 4, 4))})
    return net, params, (f64(rng.standard_normal((3, 4))),)


def kinds_case(depth=20):
    """Three kinds in a repeating pattern (loop blocks of known kinds) with long skips."""
    layers, params = [], {}
    rng = np.random.default_rng(2)
    for i in range(1, depth + 1):
        if i % 3 == 2 and i > 8:
            layers.append(lbp.Layer(i, skip, (i - 1, i - 8), (("S", i),)))
            params[("S", i)] = 0.2 * rng.standard_normal((4, 4))
        elif i % 3 == 1:
            layers.append(lbp.Layer(i, gated, (i - 1,), (("G", i),)))
            params[("G", i)] = 0.3 * rng.standard_normal((4, 4))
        else:
            layers.append(lbp.Layer(i, residual, (i - 1,), (("W", i), ("b", i))))
            params[("W", i)], params[("b", i)] = 0.3 * rng.standard_normal((4, 4)), 0.1 * rng.standard_normal(4)
    return lbp.Network(layers, [0], depth), f64(params), (f64(rng.standard_normal((3, 4))),)


def rnn_case(steps=12):
    """Tied weights, a stacked input read row by row, every state returned (a Stack)."""
    layers = [lbp.Layer(("h", t), rnn_cell, (("h", t - 1), lbp.Row("xs", t - 1)), ("A", "B"))
              for t in range(1, steps + 1)]
    net = lbp.Network(layers, [("h", 0), "xs"], lbp.Stack([("h", t) for t in range(1, steps + 1)]))
    rng = np.random.default_rng(3)
    params = f64({"A": 0.4 * rng.standard_normal((4, 4)), "B": 0.4 * rng.standard_normal((2, 4))})
    return net, params, (f64(rng.standard_normal((3, 4))), f64(rng.standard_normal((steps, 3, 2))))


CASES = {"chain": chain_case, "skips": skips_case, "kinds": kinds_case, "rnn": rnn_case}


def losses(net):
    def model(p, *inputs):
        outs = net(p, *inputs)
        return outs if isinstance(outs, tuple) else (outs,)

    def loss(p, *inputs):
        return sum(jnp.sum(jnp.sin(o) + 0.5 * o**2) for o in model(p, *inputs))

    return model, loss


def assert_close(actual, expected, rtol=1e-8):
    assert_trees_close(actual, expected, rtol=rtol, atol=1e-11)


def solves(jaxpr):
    """The linbackprop solves of a closed jaxpr and of every jaxpr nested in it."""
    return [eqn for eqn in equations(jaxpr) if eqn.primitive.name == "linbackprop_solve"]


def test_a_chain_keeps_two_rows_in_both_substitutions():
    """The Gauss–Newton product of a chain: both solves (and the gradient's) compact, their state
    buffers of three rows (input, output, pad) instead of depth + 2, and a product's temporaries
    a fraction of one [depth, batch, width] buffer."""
    depth, batch, width = 64, 256, 8
    rng = np.random.default_rng(4)
    net = lbp.Network([lbp.Layer(i, residual, (i - 1,), (lbp.Row("W", i - 1), lbp.Row("b", i - 1)))
                       for i in range(1, depth + 1)], [0], depth)
    params = {"W": jnp.asarray(0.2 * rng.standard_normal((depth, width, width)), jnp.float32),
              "b": jnp.zeros((depth, width), jnp.float32)}
    x = jnp.asarray(rng.standard_normal((batch, width)), jnp.float32)
    loss = lambda p, x: 0.5 * jnp.sum(net(p, x) ** 2)
    gauss_newton = lbp.gauss_newton(loss, param_products="in_loop", engine="loop")

    found = solves(jax.make_jaxpr(lambda p, x, v: gauss_newton(p, x)[2].mv(v))(params, x, params))
    assert len(found) == 3 and all(eqn.params["variant"].compact for eqn in found)
    for eqn in found:
        assert {v.aval.shape[0] for v in eqn.outvars if v.aval.shape[1:] == (batch, width)} == {3}
    # ℳ* h before the loop: rhs at every row, the forward substitution's Z still three rows
    after = lbp.gauss_newton(loss, param_products="after", engine="loop")
    found = solves(jax.make_jaxpr(lambda p, x, v: after(p, x)[2].mv(v))(params, x, params))
    forward = [eqn for eqn in found if not eqn.params["transposed"]]
    assert forward and all(isinstance(eqn.params["variant"], ParamsAfter) for eqn in forward)
    for eqn in forward:
        assert {v.aval.shape[0] for v in eqn.outvars if v.aval.shape[1:] == (batch, width)} == {3}
    G = jax.jit(gauss_newton)(params, x)[2]  # the linearisation held: the product's arguments
    temps = jax.jit(lambda G, v: G.mv(v)).lower(G, params).compile().memory_analysis().temp_size_in_bytes
    assert temps < 0.25 * depth * batch * width * 4


@pytest.mark.parametrize(("name", "products"), [(name, "in_loop") for name in sorted(CASES)]
                         + [("rnn", "after")])  # ℳ* h before the loop: kinds in the test of the carried Λ below
def test_compact_solves_match_plain_jax(name, products):
    """G·v, gradients (of parameters and of inputs alone), Hessian–vector products and the
    derivative of G·v along the parameters (the linearisation moving under both substitutions),
    against plain JAX; with ℳ* h in the loop (rhs at the input rows) and before it (rhs at every
    row, Z still compact)."""
    net, params, inputs = CASES[name]()
    model, loss = losses(net)
    settings = dict(param_products=products, engine="loop")
    t = jax.tree.map(lambda a: jnp.cos(jnp.arange(a.size, dtype=a.dtype)).reshape(a.shape), params)

    def gn_ref(p, v):
        outs, jvp = jax.linearize(lambda q: model(q, *inputs), p)
        hv = jax.jvp(jax.grad(lambda o: loss_of_outs(o)), (outs,), (jvp(v),))[1]
        return jax.vjp(lambda q: model(q, *inputs), p)[1](hv)[0]

    def loss_of_outs(outs):
        return sum(jnp.sum(jnp.sin(o) + 0.5 * o**2) for o in outs)

    def gn(p, v):
        return lbp.gauss_newton(lambda q, *i: loss_of_outs(model(q, *i)), **settings)(p, *inputs)[2].mv(v)

    # each side compiled as one program (op by op, the references were most of the time)
    assert_close(jax.jit(gn)(params, t), jax.jit(gn_ref)(params, t))
    jvp_of = lambda f: jax.jit(lambda p: jax.jvp(lambda q: f(q, t), (p,), (t,))[1])(params)
    assert_close(jvp_of(gn), jvp_of(gn_ref), rtol=1e-7)
    argnums = tuple(range(1 + len(inputs)))
    assert_close(jax.jit(lbp.grad_by_solve(loss, argnums, **settings))(params, *inputs),
                 jax.jit(jax.grad(loss, argnums))(params, *inputs))
    if products == "in_loop":  # a tangent of an input alone: the same solve either way
        assert_close(lbp.grad_by_solve(loss, 1, **settings)(params, *inputs),
                     jax.jit(jax.grad(loss, 1))(params, *inputs))
    # HVPs, every argument moving (a stacked input too: its rows have no pad)
    moved = (t, *(jnp.cos(x) for x in inputs))
    hvp_all = lambda grad: jax.jit(lambda: jax.jvp(grad(loss, argnums), (params, *inputs), moved)[1])()
    assert_close(hvp_all(lambda f, a: lbp.grad_by_solve(f, a, **settings)), hvp_all(jax.grad), rtol=1e-7)


@pytest.mark.parametrize("products", ["in_loop", "after"])
def test_compact_solves_compose_with_vmap(products):
    """Batched over examples: gradients, HVPs and G·v of the compact solves stay exact."""
    net, params, (x,) = skips_case()
    _, loss = losses(net)
    settings = dict(param_products=products, engine="loop")
    xs = jnp.stack([x, -x, 0.5 * x])
    t = jax.tree.map(jnp.ones_like, params)
    per_example = lambda grad: jax.vmap(grad(loss), (None, 0))(params, xs)
    assert_close(jax.jit(lambda: per_example(lambda f: lbp.grad_by_solve(f, **settings)))(),
                 jax.jit(lambda: per_example(jax.grad))())
    hvps = lambda grad: jax.vmap(lambda x: jax.jvp(lambda p: grad(loss)(p, x), (params,), (t,))[1])(xs)
    assert_close(jax.jit(lambda: hvps(lambda f: lbp.grad_by_solve(f, **settings)))(), jax.jit(lambda: hvps(jax.grad))(),
                 rtol=1e-7)
    ts = jax.tree.map(lambda a: jnp.stack([a, 2 * a]), t)
    gv = jax.jit(jax.vmap(lambda v: lbp.gauss_newton(loss, **settings)(params, x)[2].mv(v)))(ts)
    unrolled = jax.jit(jax.vmap(lambda v: lbp.gauss_newton(loss, engine="unrolled")(params, x)[2].mv(v)))(ts)
    assert_close(gv, unrolled)


def test_a_stretch_of_integer_states_carries_no_tangent():
    """Layers of integer states (a step counter) forward each other in a stretch of their own:
    no tangent there to carry; the float layers after them stay exact in both substitutions."""
    count = lambda th, c: c + 1
    scaled = lambda th, u, c: u + jnp.tanh(u @ th[0]) * c.astype(u.dtype) / 8
    layers = [lbp.Layer(("c", i), count, (("c", i - 1),), ()) for i in range(1, 7)]
    layers += [lbp.Layer(i, residual if i % 2 else scaled, (i - 1,) if i % 2 else (i - 1, ("c", 6)),
                         (lbp.Row("W", i - 1), lbp.Row("b", i - 1)) if i % 2 else (lbp.Row("W", i - 1),))
               for i in range(1, 21)]
    net = lbp.Network(layers, [0, ("c", 0)], 20)
    rng = np.random.default_rng(5)
    params = f64({"W": 0.3 * rng.standard_normal((20, 4, 4)), "b": 0.1 * rng.standard_normal((20, 4))})
    x, c0 = f64(rng.standard_normal((3, 4))), jnp.asarray(2, jnp.int32)
    from linbackprop._plan import plan_for

    plan = plan_for(net, net.select_params(params), (x, c0), "loop")
    assert any(f is not None and not plan.state_groups[f.group].differentiable
               for f in (plan.forwarding(a, b) for a, b, _ in plan.segments))
    loss = lambda p, x, c: jnp.sum(jnp.sin(net(p, x, c)))

    @jax.jit
    def gv_ref(params):
        out, jvp = jax.linearize(lambda p: net(p, x, c0), params)
        hv = jax.jvp(jax.grad(lambda o: jnp.sum(jnp.sin(o))), (out,), (jvp(params),))[1]
        return jax.vjp(lambda p: net(p, x, c0), params)[1](hv)[0]

    for products, carried in (("in_loop", True), ("after", True), ("after", False)):  # Λ carried back or not
        with using(Settings(policy=Policy(carried_back_max_kept=float(carried)))):
            settings = dict(param_products=products, engine="loop")
            assert_close(jax.jit(lbp.grad_by_solve(loss, (0, 1), **settings))(params, x, c0),
                         jax.jit(jax.grad(loss, (0, 1)))(params, x, c0))
            assert_close(jax.jit(lambda p: lbp.gauss_newton(loss, **settings)(p, x, c0)[2].mv(p))(params),
                         gv_ref(params))


@pytest.mark.parametrize("name", ["kinds", "rnn"])  # a switch-free pattern of kinds with skips; a stacked input
def test_the_back_substitution_carries_lambda_or_not_with_the_same_result(name):
    """With ℳ* h formed before the loop, the transpose runs in the compact layout carrying Λ and
    sets each carried row of a full-layout Λ (`Policy.carried_back_pays`), or in the full layout:
    gradients (parameters and inputs) and G·v equal plain JAX's either way, HVPs where it carries
    (the full layout's are `test_compact_solves_match_plain_jax`'s), and the solve taken is the
    one asked for."""
    net, params, inputs = CASES[name]()
    model, loss = losses(net)
    settings = dict(param_products="after", engine="loop")
    argnums = tuple(range(1 + len(inputs)))
    t = jax.tree.map(lambda a: jnp.cos(jnp.arange(a.size, dtype=a.dtype)).reshape(a.shape), params)
    moved = (t, *(jnp.cos(x) for x in inputs))
    expected_grad = jax.jit(jax.grad(loss, argnums))(params, *inputs)
    expected_hvp = jax.jit(lambda: jax.jvp(jax.grad(loss, argnums), (params, *inputs), moved)[1])()

    @jax.jit
    def gv_reference(params, t):
        outs, jvp = jax.linearize(lambda q: model(q, *inputs), params)
        hv = jax.jvp(jax.grad(lambda o: sum(jnp.sum(jnp.sin(x) + 0.5 * x**2) for x in o)), (outs,), (jvp(t),))[1]
        return jax.vjp(lambda q: model(q, *inputs), params)[1](hv)[0]

    gv_ref = gv_reference(params, t)
    for carried in (True, False):
        with using(Settings(policy=Policy(carried_back_max_kept=float(carried)))):
            grad = lbp.grad_by_solve(loss, argnums, **settings)
            found = solves(jax.make_jaxpr(grad)(params, *inputs))
            transposed = [eqn.params["variant"] for eqn in found if eqn.params["transposed"]]
            assert transposed and all(isinstance(s, ParamsAfter) and s.carried_back == carried for s in transposed)
            assert_close(jax.jit(grad)(params, *inputs), expected_grad)
            if carried:
                assert_close(jax.jit(lambda: jax.jvp(grad, (params, *inputs), moved)[1])(), expected_hvp, rtol=1e-7)
            assert_close(jax.jit(lambda: lbp.gauss_newton(loss, **settings)(params, *inputs)[2].mv(t))(), gv_ref)
