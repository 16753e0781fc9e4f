"""Curvature from the operators against plain-JAX references only: the dense J* H J from
jax.jacfwd and jax.hessian, products from jax.jvp + jax.vjp, per-example gradients from
jax.jacrev — on DAGs with skips, shared whole blocks, Row blocks, pytree states, an RNN with tied
weights reading Row("xs", t), and a tied-embedding transformer; both engines, under jit and vmap."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree
from networks import REGISTRY
from trees import assert_trees_close

import linbackprop as lbp

close = functools.partial(assert_trees_close, rtol=1e-9, atol=1e-11)  # this file's tolerances


# -- networks whose states have the batch on the leading axis ------------------------------------
def per_example_loss(net):
    """Per-example losses (B,) of every output: sum over the non-batch axes (Stack: axis 1 is the batch)."""
    def losses(params, *inputs):
        outs = net(params, *inputs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        total = 0.0
        for item, o in zip(net.output_spec, outs):
            for leaf in jax.tree.leaves(o):
                leaf = jnp.moveaxis(leaf, 1, 0) if isinstance(item, lbp.Stack) else leaf
                total = total + jnp.sum((jnp.sin(leaf) + 0.5 * leaf**2).reshape(leaf.shape[0], -1), axis=1)
        return total

    return losses


def rnn_case():
    """Tied weights along a sequence read as Row("xs", t), every state stacked as the output."""
    rng = np.random.default_rng(11)
    T, B, D, W = 5, 3, 2, 3
    cell = lambda th, h, x: jnp.tanh(h @ th[0] + x @ th[1] + th[2])
    layers = [lbp.Layer(t, cell, (t - 1, lbp.Row("xs", t - 1)), ("Wh", "Wx", "b")) for t in range(1, T + 1)]
    net = lbp.Network(layers, [0, "xs"], lbp.Stack(range(1, T + 1)))
    params = {"Wh": jnp.asarray(0.5 * rng.standard_normal((W, W))), "Wx": jnp.asarray(rng.standard_normal((D, W))),
              "b": jnp.asarray(0.1 * rng.standard_normal(W))}
    inputs = (jnp.asarray(rng.standard_normal((B, W))), jnp.asarray(rng.standard_normal((T, B, D))))
    return net, params, inputs


def transformer_case():
    """A tiny causal transformer over token ids with tied embeddings (the embedding block is read
    by the first and the last layer) and Row-stacked blocks."""
    rng = np.random.default_rng(12)
    V, L, E, B, depth = 7, 4, 6, 3, 2

    def embed(th, ids):
        return th[0][ids] + th[1]

    def block(th, h):
        p = th[0]
        q, k, v = h @ p["q"], h @ p["k"], h @ p["v"]
        scores = jnp.einsum("bld,bmd->blm", q, k) / jnp.sqrt(E)
        scores = jnp.where(jnp.tril(jnp.ones((L, L), bool)), scores, -1e9)
        h = h + jnp.einsum("blm,bmd->bld", jax.nn.softmax(scores, axis=-1), v) @ p["o"]
        return h + jnp.tanh(h @ p["m"])

    def unembed(th, h):
        return h @ th[0].T

    layers = [lbp.Layer("h0", embed, ("ids",), ("emb", "pos"))]
    layers += [lbp.Layer(f"h{i}", block, (f"h{i - 1}",), (lbp.Row("blocks", i - 1),)) for i in range(1, depth + 1)]
    layers += [lbp.Layer("logits", unembed, (f"h{depth}",), ("emb",))]
    net = lbp.Network(layers, ["ids"], "logits")
    r = lambda *s: jnp.asarray(0.4 * rng.standard_normal(s))
    params = {"emb": r(V, E), "pos": r(L, E), "blocks": {n: r(depth, E, E) for n in "qkvom"}}
    ids = jnp.asarray(rng.integers(0, V, (B, L)))
    targets = jnp.asarray(rng.integers(0, V, (B, L)))
    return net, params, (ids,), targets


def xent_per_example(net, targets):
    def losses(params, ids):
        logp = jax.nn.log_softmax(net(params, ids), axis=-1)
        return -jnp.sum(jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0], axis=1)

    return losses


def cases():
    out = {}
    for name in ("chain", "skips", "densenet", "rnn", "lstm", "multi_input", "conv", "stacked"):
        c = REGISTRY[name]()
        out[name] = (per_example_loss(c.net), c.params, c.inputs)
    net, params, inputs = rnn_case()
    out["rnn-rows"] = (per_example_loss(net), params, inputs)
    net, params, inputs, targets = transformer_case()
    out["transformer"] = (xent_per_example(net, targets), params, inputs)
    return out


CASES = cases()


# -- Gauss–Newton ---------------------------------------------------------------------------------
def reference_ggn(losses, params, inputs):
    """Dense J* H J from plain JAX: J by jacfwd of the network outputs, H by jax.hessian of the
    loss as a function of the outputs (the networks replaced by their values). Compiled as one
    program: op by op, its many small operations were most of a test's time."""
    return jax.jit(_reference_ggn, static_argnums=0)(losses, params, tuple(inputs))


def _reference_ggn(losses, params, inputs):
    flat, unravel = ravel_pytree(params)
    calls = []

    def model(v):
        calls.clear()
        return _outputs_of(losses, unravel(v), inputs)

    outs = model(flat)
    out_flat, out_unravel = ravel_pytree(outs)
    jac = jax.jacfwd(lambda v: ravel_pytree(model(v))[0])(flat)
    hess = jax.hessian(lambda o: jnp.sum(_loss_of_outputs(losses, params, inputs, out_unravel(o))))(out_flat)
    return jac.T @ hess @ jac


def _outputs_of(losses, params, inputs):
    recorded = []
    from linbackprop._options._settings import calls_handled

    def record(net, p, xs):
        out = net(p, *xs)
        recorded.append(out)
        return out

    with calls_handled(record):
        losses(params, *inputs)
    return tuple(recorded)


def _loss_of_outputs(losses, params, inputs, outs):
    from linbackprop._options._settings import calls_handled

    replay = iter(outs)
    with calls_handled(lambda net, p, xs: next(replay)):
        return losses(params, *inputs)


@pytest.mark.users_settings
@pytest.mark.parametrize("name", ["chain", "conv", "lstm", "rnn-rows", "skips", "stacked", "transformer"])
def test_gauss_newton_dense_and_products(name):
    losses, params, inputs = CASES[name]
    loss = lambda p, *xs: jnp.sum(losses(p, *xs))
    v = jax.tree.map(lambda x: jnp.asarray(np.random.default_rng(1).standard_normal(np.shape(x))), params)

    @jax.jit  # ours and the references each compiled once (eager op-by-op dispatch is the slow part)
    def both(params, inputs, v):
        value, grad, G = lbp.gauss_newton(loss)(params, *inputs)
        ours = value, grad, G.todense(), G.T.todense(), G.mv(v)
        return ours, (*jax.value_and_grad(loss)(params, *inputs), reference_ggn(losses, params, inputs))

    (value, grad, dense_g, dense_gt, gv), (ref_value, ref_grad, dense) = both(params, inputs, v)
    close(value, ref_value)
    close(grad, ref_grad)
    np.testing.assert_allclose(dense_g, dense, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(dense_gt, dense.T, rtol=1e-8, atol=1e-10)
    close(ravel_pytree(gv)[0], dense @ ravel_pytree(v)[0], rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("engine", ["loop", "unrolled"])
def test_gauss_newton_product_against_jvp_and_vjp_on_a_deep_row_chain(engine):
    """G v = J*(H(J v)) with J v by jax.jvp and J* by jax.vjp of the plain network; squared error
    (G is the Fisher) with a weight decay term that G leaves out."""
    rng = np.random.default_rng(3)
    n, w = 20, 4
    net = lbp.Network([lbp.Layer(i, lambda th, u: u + jnp.tanh(u @ th[0]), (i - 1,), (lbp.Row("W", i - 1),))
                       for i in range(1, n + 1)], [0], n)
    p = {"W": jnp.asarray(0.3 * rng.standard_normal((n, w, w)))}
    x, y = jnp.asarray(rng.standard_normal((6, w))), jnp.asarray(rng.standard_normal((6, w)))
    loss = lambda p, x: 0.5 * jnp.sum((net(p, x) - y) ** 2) + 1e-2 * jnp.sum(p["W"] ** 2)
    v = {"W": jnp.asarray(rng.standard_normal((n, w, w)))}
    _, grad, G = lbp.gauss_newton(loss, engine=engine)(p, x)
    close(grad, jax.grad(loss)(p, x))
    _, jv = jax.jvp(lambda q: net(q, x), (p,), (v,))
    expected = jax.vjp(lambda q: net(q, x), p)[1](jv)[0]  # H = I for squared error
    close(G.mv(v), expected, rtol=1e-9, atol=1e-11)


def test_levenberg_marquardt_step_with_cg_under_jit():
    """A jitted Levenberg–Marquardt step: cg on G + λI, from the stored linearisation."""
    losses, params, inputs = CASES["skips"]
    loss = lambda p, *xs: jnp.sum(losses(p, *xs))

    @jax.jit
    def step(p, x):
        _, grad, G = lbp.gauss_newton(loss)(p, x)
        delta, _ = jax.scipy.sparse.linalg.cg(lambda v: jax.tree.map(lambda a, b: a + 0.1 * b, G.mv(v), v), grad,
                                              tol=1e-12, maxiter=500)
        return delta

    delta = step(params, *inputs)
    dense = reference_ggn(losses, params, inputs) + 0.1 * np.eye(ravel_pytree(params)[0].size)
    expected = np.linalg.solve(dense, ravel_pytree(jax.grad(loss)(params, *inputs))[0])
    np.testing.assert_allclose(ravel_pytree(delta)[0], expected, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("batched", [False, True])
def test_gram_is_the_dense_quadratic_form_one_by_one_and_batched(batched):
    """G.gram([u, v, w]) = [aᵀ G b] against the dense J* H J, with the k products one after
    another (CPU's rule) and vmapped as one substitution (the accelerators')."""
    from linbackprop._options import Policy
    from linbackprop._options._settings import Settings, using

    losses, params, inputs = CASES["rnn-rows"]
    loss = lambda p, *xs: jnp.sum(losses(p, *xs))
    rng = np.random.default_rng(5)
    vectors = [jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(np.shape(x))), params) for _ in range(3)]
    with using(Settings(policy=Policy(batched_products_cpu=batched))):
        gram = jax.jit(lambda p, vs: lbp.gauss_newton(loss)(p, *inputs)[2].gram(vs))(params, vectors)
    rows = np.stack([ravel_pytree(v)[0] for v in vectors])
    expected = rows @ reference_ggn(losses, params, inputs) @ rows.T
    np.testing.assert_allclose(gram, expected, rtol=1e-9, atol=1e-10)


def test_gauss_newton_with_several_arguments_and_aux():
    losses, params, inputs = CASES["multi_input"]
    loss = lambda p, x, z: (jnp.sum(losses(p, x, z)), {"n": 1.0, "note": "text", "mean": jnp.mean(x)})
    (_, aux), grad, G = lbp.gauss_newton(loss, argnums=(0, 1), has_aux=True)(params, *inputs)
    ref = jax.grad(lambda *a: loss(*a)[0], argnums=(0, 1))(params, *inputs)
    close(grad, ref)
    # as fun returned it (jax.value_and_grad's aux): Python values stay Python values
    assert type(aux["n"]) is float and aux["n"] == 1.0 and aux["note"] == "text"
    np.testing.assert_allclose(aux["mean"], jnp.mean(inputs[0]))
    v = jax.tree.map(jnp.ones_like, (params, inputs[0]))
    u = G.mv(v)
    assert jax.tree.structure(u) == jax.tree.structure(v)
    # symmetric: ⟨u, G v⟩ = ⟨G u, v⟩
    w = jax.tree.map(lambda a: jnp.cos(jnp.arange(a.size, dtype=a.dtype).reshape(a.shape)), v)
    dot = lambda a, b: sum(jnp.vdot(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    np.testing.assert_allclose(dot(w, G.mv(v)), dot(G.mv(w), v), rtol=1e-10)


# -- per-example gradients and norms --------------------------------------------------------------
@pytest.mark.users_settings
@pytest.mark.parametrize("name", sorted(CASES))
def test_per_example_gradients_equal_jacrev(name):
    losses, params, inputs = CASES[name]
    ours = jax.jit(lbp.per_example_grads(losses))(params, *inputs)
    reference = jax.jit(jax.jacrev(losses))(params, *inputs)
    close(ours, reference, rtol=1e-9, atol=1e-11)
    norms = jax.jit(lbp.per_example_grad_norms(losses, chunk=2))(params, *inputs)
    flat = jax.vmap(lambda g: ravel_pytree(g)[0])(reference)
    np.testing.assert_allclose(norms, jnp.linalg.norm(flat, axis=1), rtol=1e-9)


@pytest.mark.parametrize("engine", ["loop", "unrolled"])
def test_per_example_gradients_with_a_direct_term_and_both_engines(engine):
    net, params, inputs = rnn_case()
    losses = lambda p, h0, xs: per_example_loss(net)(p, h0, xs) + 0.1 * jnp.sum(p["b"] ** 2) * jnp.arange(3.0)
    close(lbp.per_example_grads(losses, engine=engine)(params, *inputs), jax.jacrev(losses)(params, *inputs))


def test_per_example_gradients_under_vmap():
    """vmap over independent problems (e.g. ensembles of parameters)."""
    losses, params, inputs = CASES["chain"]
    stacked = jax.tree.map(lambda a: jnp.stack([a, 1.1 * a]), params)
    ours = jax.jit(jax.vmap(lambda p: lbp.per_example_grads(losses)(p, *inputs)))(stacked)
    ref = jax.jit(jax.vmap(lambda p: jax.jacrev(losses)(p, *inputs)))(stacked)
    close(ours, ref)


def test_layers_that_mix_examples_raise():
    """Batch statistics: the output for one example depends on the others."""
    bn = lambda th, u: (u - u.mean(0)) / (u.std(0) + 1.0) @ th[0]
    net = lbp.Network([lbp.Layer("y", bn, ("x",), ("W",))], ["x"], "y")
    losses = lambda p, x: jnp.sum(net(p, x) ** 2, axis=1)
    p, x = {"W": jnp.ones((3, 2))}, jnp.asarray(np.random.default_rng(0).standard_normal((5, 3)))
    with pytest.raises(ValueError, match=r"\['y'\] mix examples"):
        lbp.per_example_grads(losses)(p, x)
    with pytest.raises(ValueError, match="mix examples"):
        lbp.diag_ggn(lambda p, x: jnp.sum(losses(p, x)))(p, x)


def test_losses_that_mix_examples_raise():
    """Each loss reads the batch mean of the outputs: loss b's gradient is not ℳ of Λ's row b.
    Refused (with or without jit, for every per-example transform) where jax.jacrev differs;
    a loss of each example's own outputs plus a batch-wide constant passes."""
    net = lbp.Network([lbp.Layer("y", lambda th, x: jnp.tanh(x @ th[0]), ("x",), ("W",))], ["x"], "y")
    rng = np.random.default_rng(3)
    p, x = {"W": jnp.asarray(rng.standard_normal((3, 2)))}, jnp.asarray(rng.standard_normal((5, 3)))
    centred = lambda p, x: jnp.sum((net(p, x) - jnp.mean(net(p, x), axis=0)) ** 2, axis=1)
    ref = jax.jacrev(centred)(p, x)["W"]
    assert float(jnp.abs(ref).max()) > 0
    for transform in (lbp.per_example_grads(centred), lbp.per_example_grad_norms(centred),
                      lbp.clipped_grad(centred, 1.0)):
        for wrap in (lambda f: f, jax.jit):
            with pytest.raises(ValueError, match=r"losses mix examples: loss \d reads"):
                wrap(transform)(p, x)
    shifted = lambda p, x: jnp.sum(net(p, x) ** 2, axis=1) + jnp.mean(x)
    close(jax.jit(lbp.per_example_grads(shifted))(p, x), jax.jacrev(shifted)(p, x))



def test_two_calls_of_equal_batches_whose_losses_count_each_calls_examples():
    """#63: concatenate([f(net(p, xi)), g(net(p, xb))]) worked with batches 4 and 3 and raised with
    4 and 4 (taken as one batch shared by both calls): 8 losses say each call's own examples."""
    net = lbp.Network([lbp.Layer("y", lambda th, x: jnp.tanh(x @ th[0]), ("x",), ("W",))], ["x"], "y")
    rng = np.random.default_rng(10)
    p = {"W": jnp.asarray(rng.standard_normal((3, 2)))}
    losses = lambda p, xi, xb: jnp.concatenate([jnp.sum(net(p, xi) ** 2, 1), jnp.sum(jnp.sin(net(p, xb)), 1)])
    for other in (3, 4):
        xi, xb = jnp.asarray(rng.standard_normal((4, 3))), jnp.asarray(rng.standard_normal((other, 3)))
        ref = jax.jacrev(losses)(p, xi, xb)
        close(jax.jit(lbp.per_example_grads(losses))(p, xi, xb), ref)
        close(jax.jit(lbp.per_example_grad_norms(losses))(p, xi, xb), jnp.sqrt(jnp.sum(ref["W"] ** 2, axis=(1, 2))))


def test_a_loss_whose_hessian_couples_examples_is_refused_by_the_blockwise_curvature():
    """#63: loss = (Σ outputs)² has H = 2·11ᵀ; diag_ggn gave [17.29, 14.40, 5.27] where the dense
    diag(JᵀHJ) is [3.09, 10.68, 5.15], with no error. diag_ggn, ggn_factor and kfac_factors
    (hence lbp.kfac) refuse it, with and without jit; a sum of per-example terms of the same
    network stays exact against the dense GGN, and so do two calls of different batches (a PINN)."""
    net = lbp.Network([lbp.Layer("y", lambda th, x: jnp.tanh(x @ th[0]), ("x",), ("W",))], ["x"], "y")
    rng = np.random.default_rng(9)
    p, x = {"W": jnp.asarray(rng.standard_normal((3, 1)))}, jnp.asarray(rng.standard_normal((4, 3)))
    coupled = lambda p, x: jnp.sum(net(p, x)) ** 2
    jac = jax.jacrev(lambda w: net({"W": w}, x)[:, 0])(p["W"]).reshape(4, 3)
    dense = jac.T @ (2 * jnp.ones((4, 4))) @ jac
    close(jax.jit(lbp.gauss_newton(coupled))(p, x)[2].todense(), dense)  # G's products: exact for any H
    for transform in (lbp.diag_ggn, lbp.ggn_factor, lbp.kfac_factors):
        for wrap in (lambda f: f, jax.jit):
            with pytest.raises(ValueError, match="this loss couples them"):
                wrap(transform(coupled))(p, x)
    apart = lambda p, x: jnp.sum(net(p, x) ** 2) + 0.5 * jnp.mean(net(p, x[:3]) ** 4)
    _, _, G = jax.jit(lbp.gauss_newton(apart))(p, x)
    close(jax.jit(lbp.diag_ggn(apart))(p, x)["W"].ravel(), jnp.diag(G.todense()))
def test_batch_not_leading_raises():
    case = REGISTRY["seed"]()  # states are (features, examples)
    losses = lambda p, u: jnp.sum(case.net(p, u) ** 2, axis=0)
    with pytest.raises(ValueError, match="leading axis"):
        lbp.per_example_grads(losses)(case.params, *case.inputs)


def test_chained_networks_are_refused_for_per_example():
    a = lbp.Network([lbp.Layer("h", lambda th, x: jnp.tanh(x @ th[0]), ("x",), ("A",))], ["x"], "h")
    b = lbp.Network([lbp.Layer("y", lambda th, h: h @ th[0], ("h",), ("B",))], ["h"], "y")
    losses = lambda p, x: jnp.sum(b(p, a(p, x)) ** 2, axis=1)
    p, x = {"A": jnp.ones((2, 2)), "B": jnp.ones((2, 1))}, jnp.ones((3, 2))
    with pytest.raises(NotImplementedError, match="inputs to be data"):
        lbp.per_example_grads(losses)(p, x)



@pytest.mark.parametrize("around", ["jit", "jit twice", "vmap", "checkpoint", "scan", "cond"])
def test_a_network_called_inside_a_transformation_within_fun(around):
    """The curvature transforms find ``fun``'s network calls in its jaxpr, as ``layers=`` finds
    layers: a ``jax.jit`` of the user's around a call is seen through (the same factors, diagonal,
    G·v and per-example gradients as the call made directly); a call inside another
    transformation within ``fun`` is refused by name (an UnexpectedTracerError from deep inside,
    before), while the gradient, which needs no split, takes it."""
    net = lbp.Network([lbp.Layer(i, lambda th, u: jnp.tanh(u @ th[0] + th[1]), (i - 1,), (f"W{i}", f"b{i}"))
                       for i in (1, 2)], [0], 2)
    p = {"W1": 0.5 * jnp.eye(3), "W2": jnp.ones((3, 3)) / 3, "b1": jnp.arange(3.0) / 5, "b2": -jnp.ones(3) / 4}
    x = jnp.arange(6.0).reshape(2, 3) / 6
    jitted = jax.jit(lambda p, x: net(p, x))
    inside = {
        "jit": lambda p, x: jitted(p, x),
        "jit twice": lambda p, x: jax.jit(lambda p, x: jitted(p, x) + jitted(p, -x))(p, x) / 2,
        "vmap": lambda p, x: jax.vmap(lambda r: net(p, r[None])[0])(x),
        "checkpoint": lambda p, x: jax.checkpoint(net)(p, x),
        "scan": lambda p, x: jax.lax.scan(lambda c, _: (net(p, c), None), x, None, length=1)[0],
        "cond": lambda p, x: jax.lax.cond(True, lambda: net(p, x), lambda: x),
    }[around]
    direct = {"jit": lambda p, x: net(p, x), "jit twice": lambda p, x: (net(p, x) + net(p, -x)) / 2}.get(around)
    losses = lambda f: lambda p, x: 0.5 * jnp.sum(jnp.sin(f(p, x)) ** 2, axis=1)
    loss = lambda f: lambda p, x: jnp.sum(losses(f)(p, x))
    v = jax.tree.map(jnp.cos, p)
    transforms = {
        "diag_ggn": lambda f: lbp.diag_ggn(loss(f))(p, x),
        "kfac_factors": lambda f: lbp.kfac_factors(loss(f))(p, x),
        "gauss_newton": lambda f: lbp.gauss_newton(loss(f))(p, x)[2].mv(v),
        "per_example_grads": lambda f: lbp.per_example_grads(losses(f))(p, x),
        "one pass": lambda f: lbp.gauss_newton(loss(f), factors=True, diagonal=True)(p, x)[2].diagonal,
    }
    for transform in transforms.values():
        if direct is not None:
            assert_trees_close(transform(inside), transform(direct), rtol=1e-12, atol=1e-14)
            continue
        made = {"vmap": "jax.vmap", "checkpoint": "`(remat|checkpoint)", "scan": "`scan`", "cond": "`cond`"}[around]
        with pytest.raises(ValueError, match=r"Network call 0 of fun \(outputs \[2\]\) is made inside " + made
                           + r".*layers="):
            transform(inside)
    assert_trees_close(lbp.grad_by_solve(loss(inside))(p, x), jax.grad(loss(inside))(p, x))

# -- the GGN diagonal -----------------------------------------------------------------------------
@pytest.mark.users_settings
@pytest.mark.parametrize("name", ["chain", "skips", "stacked", "rnn-rows", "transformer", "lstm"])
def test_diag_ggn_is_the_diagonal_of_the_dense_ggn(name):
    losses, params, inputs = CASES[name]
    loss = lambda p, *xs: jnp.sum(losses(p, *xs))
    ours = jax.jit(lbp.diag_ggn(loss))(params, *inputs)
    dense = reference_ggn(losses, params, inputs)
    np.testing.assert_allclose(ravel_pytree(ours)[0], np.diag(dense), rtol=1e-8, atol=1e-10)


def test_two_calls_on_the_same_examples_share_them():
    """Two calls with the same batch (two views of each example, one weight): row b of both is
    example b — the GGN diagonal is that of the dense J* H J (the views' cross terms in), and
    K-FAC gives a Kronecker pair per call (three here: ``losses(p, x)`` is called twice)."""
    losses, params, (x,) = CASES["chain"]
    two = lambda p, x: jnp.sum(losses(p, x)) + jnp.sum(losses(p, jnp.tanh(x)) * losses(p, x))
    dense = reference_ggn(lambda p, x: losses(p, x) + losses(p, jnp.tanh(x)) * losses(p, x), params, (x,))
    ours = jax.jit(lbp.diag_ggn(two))(params, x)
    np.testing.assert_allclose(ravel_pytree(ours)[0], np.diag(dense), rtol=1e-8, atol=1e-10)
    factors = jax.jit(lbp.kfac_factors(two))(params, x)
    terms = lambda f: type(f) is tuple and all(isinstance(t, lbp.Kronecker) for t in f)
    pairs = [f for f in jax.tree.leaves(factors, is_leaf=terms) if terms(f)]
    assert len(pairs) == 3 and all(len(f) == 3 for f in pairs)


def test_diag_ggn_through_a_transformation_of_the_parameters():
    """Parameters that reach the network through user code (here scaled): the general path."""
    losses, params, inputs = CASES["skips"]
    loss = lambda p, *xs: jnp.sum(losses(jax.tree.map(lambda a: 1.5 * a, p), *xs))
    ours = jax.jit(lbp.diag_ggn(loss))(params, *inputs)
    dense = reference_ggn(lambda p, *xs: losses(jax.tree.map(lambda a: 1.5 * a, p), *xs), params, inputs)
    np.testing.assert_allclose(ravel_pytree(ours)[0], np.diag(dense), rtol=1e-8, atol=1e-10)


def test_dropout_with_one_key_for_the_batch_mixes_examples():
    """A mask drawn for the whole batch from one key is not the mask of an example alone."""
    drop = lambda th, u, key: jnp.where(jax.random.bernoulli(key, 0.5, u.shape), u @ th[0], 0.0)
    net = lbp.Network([lbp.Layer("y", drop, ("x", "key"), ("W",))], ["x", "key"], "y")
    losses = lambda p, x, key: jnp.sum(net(p, x, key) ** 2, axis=1)
    p, x = {"W": jnp.ones((3, 3))}, jnp.ones((6, 3))
    with pytest.raises(ValueError, match="mix examples"):
        lbp.per_example_grads(losses)(p, x, jax.random.key(0))


def test_gauss_newton_under_vmap_over_an_ensemble():
    losses, params, inputs = CASES["chain"]
    loss = lambda p, *xs: jnp.sum(losses(p, *xs))
    stacked = jax.tree.map(lambda a: jnp.stack([a, 0.8 * a]), params)
    v = jax.tree.map(jnp.ones_like, params)
    ours = jax.vmap(lambda p: lbp.gauss_newton(loss)(p, *inputs)[2].mv(v))(stacked)
    for n in range(2):
        p = jax.tree.map(lambda a, n=n: a[n], stacked)
        dense = reference_ggn(losses, p, inputs)
        np.testing.assert_allclose(ravel_pytree(jax.tree.map(lambda a, n=n: a[n], ours))[0],
                                   dense @ ravel_pytree(v)[0], rtol=1e-8, atol=1e-10)


def test_diag_ggn_of_dense_layers_forms_no_per_example_parameters():
    """Dense layers' per-example cotangents are outer products: their squares are summed as matrix
    products (a²)ᵀ(δ²), so the compiled diagonal keeps no [batch, parameters] buffer."""
    n, w, b = 8, 32, 64
    rng = np.random.default_rng(0)
    layers = [lbp.Layer(i, lambda th, u: u + jnp.tanh(u @ th[0] + th[1]), (i - 1,),
                        (lbp.Row("W", i - 1), lbp.Row("c", i - 1))) for i in range(1, n + 1)]
    net = lbp.Network([*layers, lbp.Layer("y", lambda th, u: u @ th[0], (n,), ("H",))], [0], "y")
    p = {"W": jnp.asarray(rng.standard_normal((n, w, w)) / w), "c": jnp.zeros((n, w)),
         "H": jnp.asarray(rng.standard_normal((w, 2)))}
    x = jnp.asarray(rng.standard_normal((b, w)))
    loss = lambda p, x: 0.5 * jnp.sum(jnp.tanh(net(p, x)) ** 2)
    compiled = jax.jit(lbp.diag_ggn(loss)).lower(p, x).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < b * p["W"].nbytes / 2  # one [b, W] buffer: b * nbytes
    flat, unravel = ravel_pytree(p)

    @jax.jit
    def reference(flat, x):
        jac = jax.jacrev(lambda v: net(unravel(v), x).ravel())(flat)
        h = jax.hessian(lambda o: 0.5 * jnp.sum(jnp.tanh(o) ** 2))(net(unravel(flat), x).ravel())
        return jnp.einsum("oi,op,pi->i", jac, h, jac)

    np.testing.assert_allclose(ravel_pytree(compiled(p, x))[0], reference(flat, x), rtol=1e-8, atol=1e-12)


def test_diag_ggn_where_the_weight_is_the_left_factor():
    """y = tanh(W uᵀ)ᵀ: the outer product's adjoint factor is the left operand of its product."""
    rng = np.random.default_rng(2)
    layer = lambda th, u: jnp.tanh(jnp.einsum("ij,bj->bi", th[0], u) + th[1])
    net = lbp.Network([lbp.Layer(i, layer, (i - 1,), (lbp.Row("W", i - 1), "c")) for i in (1, 2)], [0], 2)
    p = {"W": jnp.asarray(rng.standard_normal((2, 3, 3))), "c": jnp.asarray(rng.standard_normal(3))}
    x = jnp.asarray(rng.standard_normal((5, 3)))
    losses = lambda p, x: jax.nn.logsumexp(net(p, x), axis=1) - net(p, x)[:, 0]
    ours = jax.jit(lbp.diag_ggn(lambda p, x: jnp.sum(losses(p, x))))(p, x)
    np.testing.assert_allclose(ravel_pytree(ours)[0], np.diag(reference_ggn(losses, p, (x,))), rtol=1e-8, atol=1e-10)


def test_diag_ggn_where_a_block_is_used_twice_in_a_layer():
    """u ↦ tanh(u W) W: the cotangent of W is no single outer product; the general path."""
    rng = np.random.default_rng(1)
    net = lbp.Network([lbp.Layer("y", lambda th, u: jnp.tanh(u @ th[0]) @ th[0], ("x",), ("W",))], ["x"], "y")
    p, x = {"W": jnp.asarray(rng.standard_normal((3, 3)))}, jnp.asarray(rng.standard_normal((4, 3)))
    losses = lambda p, x: jnp.sum(jnp.sin(net(p, x)), axis=1)
    ours = lbp.diag_ggn(lambda p, x: jnp.sum(losses(p, x)))(p, x)
    np.testing.assert_allclose(ravel_pytree(ours)[0], np.diag(reference_ggn(losses, p, (x,))), rtol=1e-8, atol=1e-10)


@pytest.mark.users_settings
def test_monte_carlo_ggn_diagonal_estimates_the_exact_one():
    """softmax cross-entropy (H positive semi-definite): the mean over many samples approaches the
    exact diagonal; one sample is a different, noisy value."""
    losses, params, inputs = CASES["transformer"]
    loss = lambda p, ids: jnp.sum(losses(p, ids))
    exact = ravel_pytree(jax.jit(lbp.diag_ggn(loss))(params, *inputs))[0]
    estimate = ravel_pytree(jax.jit(lbp.diag_ggn(loss, samples=300, key=jax.random.key(0)))(params, *inputs))[0]
    assert float(jnp.linalg.norm(estimate - exact) / jnp.linalg.norm(exact)) < 0.15
    one = ravel_pytree(jax.jit(lbp.diag_ggn(loss, samples=1, key=jax.random.key(1)))(params, *inputs))[0]
    assert not np.allclose(one, exact, rtol=1e-3)
    with pytest.raises(ValueError, match="PRNG key"):
        lbp.diag_ggn(loss, samples=2)(params, *inputs)


def test_calls_whose_outputs_are_inputs_give_zeros_beside_the_others():
    """A network whose outputs are only its inputs uses no parameter (J = 0 there): the
    per-example quantities, the GGN diagonal and K-FAC give what plain JAX gives — zeros for it,
    the other call's values beside — instead of a bare StopIteration (the call was not recorded)."""
    rng = np.random.default_rng(3)
    passthrough = lbp.Network([lbp.Layer("h", lambda th, x: x @ th[0], ("x",), ("V",))], ["x"], "x")
    dense = lbp.Network([lbp.Layer("y", lambda th, x: jnp.tanh(x @ th[0]), ("x",), ("W",))], ["x"], "y")
    params = {"V": jnp.asarray(rng.standard_normal((2, 2))), "W": jnp.asarray(rng.standard_normal((2, 3)))}
    x = jnp.asarray(rng.standard_normal((4, 2)))
    losses = lambda p, x: jnp.sum(passthrough(p, x) ** 2, axis=1) + jnp.sum(jnp.sin(dense(p, x)), axis=1)
    loss = lambda p, x: jnp.sum(losses(p, x))
    one = lambda p, xb: losses(p, xb[None])[0]
    flat, unravel = ravel_pytree(params)

    @jax.jit
    def references(params, x):
        grads = jax.vmap(jax.grad(one), (None, 0))(params, x)
        jac = jax.jacfwd(lambda f: jnp.ravel(dense(unravel(f), x)))(flat)
        outs = dense(params, x)
        h = jax.hessian(lambda o: jnp.sum(jnp.sin(o)))(outs).reshape(outs.size, outs.size)
        return grads, unravel(jnp.diag(jac.T @ h @ jac))

    reference, diagonal = references(params, x)
    close(jax.jit(lbp.per_example_grads(losses))(params, x), reference)
    norms = jnp.sqrt(sum(jnp.sum(g.reshape(4, -1) ** 2, axis=1) for g in jax.tree.leaves(reference)))
    close(jax.jit(lbp.per_example_grad_norms(losses))(params, x), norms)
    close(jax.jit(lbp.diag_ggn(loss))(params, x), diagonal)
    factors = jax.jit(lbp.kfac_factors(loss))(params, x)
    assert isinstance(factors["W"], lbp.Kronecker)
    close(factors["V"], jnp.zeros_like(params["V"]))  # no call uses it: its GGN diagonal is zero
    alone = lambda p, x: jnp.sum(passthrough(p, x) ** 2)  # no call uses a parameter at all
    close(lbp.diag_ggn(alone)(params, x), jax.tree.map(jnp.zeros_like, params))


def test_sampled_columns_have_each_block_as_covariance():
    """``samples=M`` draws s_b with E[s_b s_bᵀ] = H_b: one rank-one term of a diagonally dominant
    block (softmax cross-entropy's, mixed signs, one output) — each draw ±√W (e_i + σ_ij e_j) or
    ±√W e_i, drawn as often as its weight |H_ij| or excess says, either sign alike (E[s] = 0),
    the average s sᵀ near H_b; a float32 softmax block whose diagonal round-off broke its
    dominance, as its dominant repair — and
    R_b z where a block is not dominant (then every coordinate is drawn, not at most two)."""
    from linbackprop._curvature._examples import Examples

    rng = np.random.default_rng(11)
    count, coords = 5, 4
    p = np.exp(3 * rng.standard_normal((count, coords)))
    p /= p.sum(1, keepdims=True)
    softmax = np.stack([np.diag(q) - np.outer(q, q) for q in p]) / count
    m = rng.standard_normal((count, coords, coords))
    mixed = m + np.swapaxes(m, 1, 2)
    mixed += np.stack([np.diag(np.abs(b).sum(1) + rng.uniform(0, 1, coords)) for b in mixed])
    dense = m @ np.swapaxes(m, 1, 2)  # positive definite, not dominant
    assert np.any(np.diagonal(dense, axis1=1, axis2=2) < np.abs(dense).sum(2) - np.diagonal(dense, axis1=1, axis2=2))

    def draws(blocks, n):
        draw = Examples([[0]], [blocks.shape[0]], [jnp.asarray(blocks)], None, []).draws()
        return np.asarray(jax.jit(jax.vmap(lambda k: draw(k)[0]))(jax.random.split(jax.random.key(3), n)))

    for blocks in (softmax, mixed, np.abs(rng.standard_normal((count, 1, 1)))):
        s = draws(blocks, 20000)
        size = blocks.shape[-1]
        for b in range(count):
            h = blocks[b]
            excess = np.diag(h) - (np.abs(h).sum(1) - np.abs(np.diag(h)))
            total = (np.abs(h).sum() - np.abs(np.diag(h)).sum()) / 2 + np.maximum(excess, 0).sum()  # W
            terms, hits = np.unique(s[:, b], axis=0, return_counts=True)
            for v, hit in zip(terms, hits):  # each term drawn: √W (e_i + σ_ij e_j) or √W e_i
                at = np.flatnonzero(v)
                assert len(at) in (1, 2) and np.isclose(v[at[0]] ** 2, total, rtol=1e-12)
                if len(at) == 2:
                    i, j = at
                    assert np.sign(v[i] * v[j]) == np.sign(h[i, j])
                weight = abs(h[at[0], at[1]]) if len(at) == 2 else excess[at[0]]
                chance = weight / total / 2  # P(±term) = w / 2W, within five binomial deviations
                assert abs(hit / len(s) - chance) <= 5 * np.sqrt(chance * (1 - chance) / len(s)) + 1e-12
            if blocks is softmax:  # a Laplacian's every draw has ‖s‖² = tr H
                np.testing.assert_allclose(np.sum(s[:, b] ** 2, axis=1), np.trace(h), rtol=1e-12)
            if size == 1:  # one output: its exact root every time
                np.testing.assert_allclose(s[:, b, 0] ** 2, h[0, 0], rtol=1e-12)
            np.testing.assert_allclose(np.einsum("ti,tj->ij", s[:, b], s[:, b]) / len(s), h,
                                       atol=0.05 * np.abs(h).max())
    # float32 cross-entropy of a saturated softmax: the diagonal's p_0 (1 − p_0) cancels below its
    # row's off-diagonal sum, H + δI is indefinite (1ᵀH1 < 0), and the roots would raise it to
    # dominance: the terms sample that, H's exact value
    q = np.array([1 - 3e-9, 1e-9, 2e-9])
    exact = np.diag(q) - np.outer(q, q)
    computed = exact.copy()
    computed[0, 0] = 1e-9
    draw = Examples([[0]], [1], [jnp.asarray(computed[None], jnp.float32)], None, []).draws()
    s = np.asarray(jax.jit(jax.vmap(lambda k: draw(k)[0]))(jax.random.split(jax.random.key(4), 20000)))
    assert np.all(np.count_nonzero(s, axis=2) <= 2)
    np.testing.assert_allclose(np.einsum("tbi,tbj->ij", s, s) / len(s), exact, atol=0.05 * np.abs(exact).max())
    s = draws(dense, 20000)
    assert np.all(np.count_nonzero(s, axis=2) == coords)  # R_b z
    np.testing.assert_allclose(np.einsum("tbi,tbj->bij", s, s) / len(s), dense, atol=0.06 * np.abs(dense).max())


def test_float32_samples_of_a_block_short_of_dominance_are_unbiased():
    """float32, C = 98 (the LM's vocabulary): softmax cross-entropy's block plus a dense
    positive semi-definite term, short of diagonal dominance by 2.6× its largest diagonal entry
    — no round-off. Its samples come from the Cholesky root (every coordinate drawn), and
    E[‖s‖²] is tr H within five standard errors, E[s sᵀ] is H; the dominance test at √ε scale
    took it for dominant and drew rank-one terms of H + diag(deficit): ‖s‖² = tr H + 2.6 max diag
    (15 % more) at every draw."""
    from linbackprop._curvature._examples import Examples

    rng = np.random.default_rng(21)
    coords = 98
    logits = rng.standard_normal(coords)
    p = np.exp(logits) / np.sum(np.exp(logits))
    u = rng.standard_normal(coords)
    u /= np.linalg.norm(u)
    h = np.diag(p) - np.outer(p, p) + 0.1 * p.max() * np.outer(u, u)
    off = np.abs(h).sum(axis=1) - np.abs(np.diag(h))
    deficit = np.sum(np.maximum(off - np.diag(h), 0))
    assert 2.0 * h.diagonal().max() < deficit < 3.0 * h.diagonal().max()  # dominant at the old √ε scale
    assert np.linalg.eigvalsh(h).min() > -1e-12
    draw = Examples([[0]], [1], [jnp.asarray(h[None], jnp.float32)], None, []).draws()
    s = np.asarray(jax.jit(jax.vmap(lambda k: draw(k)[0]))(jax.random.split(jax.random.key(6), 20000)),
                   np.float64)[:, 0]
    assert np.all(np.count_nonzero(s, axis=1) == coords)  # R z, not a rank-one term
    squares = np.sum(s**2, axis=1)
    assert abs(squares.mean() - np.trace(h)) <= 5 * squares.std() / np.sqrt(len(s))
    np.testing.assert_allclose(s.T @ s / len(s), h, atol=0.05 * np.abs(h).max())


@pytest.mark.parametrize("small_block", [0, 6])
def test_sampling_roots_square_to_each_block_or_its_diagonally_dominant_repair(small_block, monkeypatch):
    """``samples=M`` draws s = R z with R Rᵀ = H_b (Cholesky, a round-off shift) where the blocks
    are positive semi-definite; a block whose Cholesky fails is made diagonally dominant first
    (each diagonal entry raised to its row's off-diagonal sum): a float32 softmax cross-entropy
    block of a saturated softmax gets its exact diagonal back, an indefinite block a positive
    semi-definite surrogate above it, the other blocks unchanged; a NaN block its diagonal's root.
    With LAPACK's Cholesky (``small_block`` 0) and the column-by-column one of small blocks."""
    from linbackprop._curvature import _sampling

    monkeypatch.setattr(_sampling, "SMALL_BLOCK", small_block)

    rng = np.random.default_rng(5)
    m = rng.standard_normal((6, 4, 3))
    psd = jnp.asarray(m @ np.swapaxes(m, 1, 2))  # rank 3 of 4: singular, positive semi-definite
    roots = lambda blocks: np.asarray(_sampling.block_roots(blocks))
    square = lambda r: r @ np.swapaxes(r, 1, 2)
    r = roots(psd)
    np.testing.assert_allclose(square(r), psd, rtol=1e-6, atol=1e-6)
    block = np.zeros((4, 4))
    block[:3, :3] = [[1.0, 0.5, 0.0], [0.5, -0.5, 0.25], [0.0, 0.25, 2.0]]  # indefinite
    indefinite = psd.at[2].set(jnp.asarray(block))
    r = roots(indefinite)
    repaired = np.asarray(indefinite[2]).copy()
    repaired[1, 1] = 0.75  # raised to |0.5| + |0.25|; the other rows dominate already
    np.testing.assert_allclose(square(r)[2], repaired, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.delete(square(r), 2, axis=0), np.delete(np.asarray(psd), 2, axis=0),
                               rtol=1e-6, atol=1e-6)
    # softmax cross-entropy's H = diag(p) − p pᵀ of a saturated softmax, in float32: the diagonal's
    # p_0 (1 − p_0) cancels to a value below its row's off-diagonal sum, and Cholesky fails
    p = np.array([1 - 3e-9, 1e-9, 2e-9], np.float64)
    exact = np.diag(p) - np.outer(p, p)
    computed = exact.copy()
    computed[0, 0] = 1e-9  # cancellation: the exact 3e-9 lost
    r = roots(jnp.asarray(computed[None], jnp.float32))
    np.testing.assert_allclose(square(r)[0], exact, rtol=1e-3, atol=1e-11)  # the shift: 3e-12
    nan = psd.at[3].set(jnp.nan * jnp.eye(4))
    r = roots(nan)
    assert np.all(np.isnan(np.diagonal(r[3]))) and np.all(np.isfinite(r[[0, 1, 2, 4, 5]]))
    np.testing.assert_allclose(square(r[[0, 1, 2, 4, 5]]), np.asarray(psd)[[0, 1, 2, 4, 5]], rtol=1e-6, atol=1e-6)


@pytest.mark.users_settings
def test_outputs_the_loss_does_not_read_cost_no_columns():
    """A loss that reads one leaf of a network's outputs (a physics-informed loss reads the lifted
    Δu, not u and ∇u): H has no rows there, so ggn_factor has one row per coordinate read (2 per
    example, not 5) and every transform still agrees with the dense J* H J."""
    two = lambda th, x: {"a": jnp.tanh(x @ th[0]), "b": jnp.sin(x @ th[1])}
    net = lbp.Network([lbp.Layer("y", two, ("x",), ("A", "B"))], ["x"], "y")
    k = jax.random.split(jax.random.key(3), 3)
    params = {"A": jax.random.normal(k[0], (4, 3)), "B": jax.random.normal(k[1], (4, 2))}
    x = jax.random.normal(k[2], (6, 4))
    loss = lambda p, x: (lambda b: jnp.sum(jnp.cos(b) + b**2))(net(p, x)["b"])  # one call
    flat, unravel = ravel_pytree(params)
    outs = lambda v: net(unravel(v), x)["b"].reshape(-1)
    J = jax.jacfwd(outs)(flat)
    H = jax.hessian(lambda o: jnp.sum(jnp.cos(o) + o**2))(outs(flat))
    dense = J.T @ H @ J  # H is diagonal: 2 - cos(o) > 0
    K = jax.jit(lbp.ggn_factor(loss))(params, x)
    assert K["A"].shape[0] == K["B"].shape[0] == 2 * 6
    rows = np.concatenate([np.asarray(K[n]).reshape(12, -1) for n in ("A", "B")], axis=1)
    np.testing.assert_allclose(rows.T @ rows, dense, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(ravel_pytree(jax.jit(lbp.diag_ggn(loss))(params, x))[0], np.diag(dense),
                               rtol=1e-10, atol=1e-12)
    factors = jax.jit(lbp.kfac_factors(loss))(params, x)
    np.testing.assert_array_equal(factors["A"].right, 0)  # Γ of the unread output
    one = jax.jit(lbp.kfac_factors(loss))(params, x[:1])["B"]  # one example: K-FAC is exact
    J1, H1 = jax.jacfwd(lambda v: net(unravel(v), x[:1])["b"].reshape(-1))(flat), jnp.diag(2 - jnp.cos(outs(flat)[:2]))
    np.testing.assert_allclose(np.kron(one.left, one.right), (J1.T @ H1 @ J1)[12:, 12:], rtol=1e-10, atol=1e-12)
