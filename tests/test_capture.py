"""Models as they are (``layers=``): the network found by tracing, differentiated by the solve,
against nnx.grad / eqx.filter_grad / jax.grad of the same model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree
from networks import equations
from trees import assert_trees_close

import linbackprop as lbp

nnx = pytest.importorskip("flax.nnx", reason="pip install 'linbackprop[test]' installs flax")
eqx = pytest.importorskip("equinox", reason="pip install 'linbackprop[test]' installs equinox")

W = 6


def close(a, b, tol=1e-9):  # this file's tolerance, the one tree comparison
    assert_trees_close(a, b, rtol=tol, atol=tol)


def solved(fun, *args):
    """Whether the solve's primitive is in the program of ``fun(*args)``."""
    return any(e.primitive.name == "linbackprop_solve" for e in equations(jax.make_jaxpr(fun)(*args)))


# -- plain JAX: @lbp.layer -----------------------------------------------------------------------
@lbp.layer
def block(p, h):
    return h + jnp.tanh(h @ p["W"] + p["b"])


def blocks_loss(params, x, y):
    h = x
    for p in params["blocks"]:  # a Python loop over the blocks, glue between them
        h = block(p, jnp.sin(h))
    return jnp.mean((h @ params["head"] - y) ** 2)


def blocks_params(depth, seed=0):
    rng = np.random.default_rng(seed)
    return {"blocks": [{"W": jnp.asarray(0.3 * rng.standard_normal((W, W))), "b": jnp.asarray(rng.standard_normal(W))}
                       for _ in range(depth)], "head": jnp.asarray(rng.standard_normal((W, 2)))}


def test_plain_jax_layers_give_jax_grad_through_the_solve():
    params, x, y = blocks_params(5), jnp.ones((4, W)), jnp.zeros((4, 2))
    grads = lbp.grad_by_solve(blocks_loss, layers=block)(params, x, y)
    close(grads, jax.grad(blocks_loss)(params, x, y))
    value, grads = lbp.value_and_grad_by_solve(blocks_loss, layers=block)(params, x, y)
    close((value, grads), jax.value_and_grad(blocks_loss)(params, x, y))
    close(jax.jit(lbp.grad_by_solve(blocks_loss, layers=block))(params, x, y), jax.grad(blocks_loss)(params, x, y))
    assert solved(lbp.grad_by_solve(blocks_loss, layers=block), params, x, y)
    t = jax.tree.map(jnp.ones_like, params)
    close(lbp.jvp_by_solve(lambda p: blocks_loss(p, x, y), (params,), (t,), layers=block),
          jax.jvp(lambda p: blocks_loss(p, x, y), (params,), (t,)))


def test_capture_finds_the_blocks_the_glue_and_one_kind_for_repeated_blocks():
    params, x, y = blocks_params(4), jnp.ones((4, W)), jnp.zeros((4, 2))
    cap = lbp.capture(blocks_loss, params, x, y, layers=block)
    # sin(x) before the first block reads the data alone: it is computed before the network (its
    # input, named after the argument it comes from)
    assert list(cap.net.inputs) == ["x.1"]
    assert [layer.name for layer in cap.net.layers] == ["block0", "glue0", "block1", "glue1", "block2", "glue2",
                                                        "block3"]
    assert set(cap.net.param_names) == {f"['blocks'][{i}]['{k}']" for i in range(4) for k in "Wb"}
    # one function for the blocks (the first reads the input, the others a glue layer: both a
    # state read whole), one for the glue: one kind each
    assert len({layer.fn for layer in cap.net.layers[0::2]}) == 1
    assert len({layer.fn for layer in cap.net.layers[1::2]}) == 1
    lin = lbp.linearize(cap.net, cap.params, *cap.inputs)
    assert lin.L.pattern.shape == (7, 7)
    h = jnp.sin(x)
    for p in params["blocks"][:3]:
        h = jnp.sin(block(p, h))
    close(cap.net(cap.params, *cap.inputs), block(params["blocks"][3], h))  # one output: the state itself


def test_program_size_does_not_grow_with_depth():
    x, y = jnp.ones((4, W)), jnp.zeros((4, 2))
    count = lambda d: sum(e.primitive.name == "tanh" for e in equations(
        jax.make_jaxpr(lbp.grad_by_solve(blocks_loss, layers=block, engine="loop"))(blocks_params(d), x, y)))
    assert count(4) == count(12)


# -- flax nnx ------------------------------------------------------------------------------------
class Block(nnx.Module):
    def __init__(self, rngs, dropout=0.0):
        self.linear, self.norm = nnx.Linear(W, W, rngs=rngs), nnx.LayerNorm(W, rngs=rngs)
        self.dropout = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, x):
        return self.dropout(jnp.tanh(self.linear(self.norm(x))))


class Model(nnx.Module):
    """An embedding, blocks in an nnx.List called in a Python loop with residual adds between
    them, and a head tied to the embedding (embed.attend)."""

    def __init__(self, rngs, depth=3, dropout=0.0):
        self.embed = nnx.Embed(11, W, rngs=rngs)
        self.blocks = nnx.List([Block(rngs, dropout) for _ in range(depth)])

    def __call__(self, tokens):
        h = self.embed(tokens)
        for b in self.blocks:
            h = h + b(h)
        return self.embed.attend(h)


def lm_loss(model, tokens, targets):
    logits = model(tokens)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1))


def _tokens(seed=0):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.integers(0, 11, (3, 5))), jnp.asarray(rng.integers(0, 11, (3, 5)))


def test_nnx_model_as_written_gives_nnx_grad_and_goes_to_its_optimizer():
    model = Model(nnx.Rngs(0))
    tokens, targets = _tokens()
    grads = lbp.grad_by_solve(lm_loss, layers=Block)(model, tokens, targets)
    expected = nnx.grad(lm_loss)(model, tokens, targets)
    assert isinstance(grads, nnx.State)
    close(grads, expected, tol=1e-5)  # nnx makes float32 parameters
    assert solved(lambda m: lbp.grad_by_solve(lm_loss, layers=Block)(m, tokens, targets), model)
    optimizer = nnx.Optimizer(model, __import__("optax").adam(1e-2), wrt=nnx.Param)
    optimizer.update(model, grads)
    cap = lbp.capture(lm_loss, model, tokens, targets, layers=Block)
    names = [layer.name for layer in cap.net.layers]
    assert names[:3] == ["glue0", "Block0", "glue1"] and sum(n.startswith("Block") for n in names) == 3
    assert "['embed']['embedding']" in cap.net.param_names  # the tied embedding: read by the first glue layer


def test_nnx_dropout_draws_fresh_masks_and_advances_the_rng_as_nnx_grad():
    tokens, targets = _tokens(1)
    ours, theirs = Model(nnx.Rngs(0, dropout=3), dropout=0.5), Model(nnx.Rngs(0, dropout=3), dropout=0.5)
    for _ in range(2):  # the second call draws other masks, as nnx.grad's does
        close(lbp.grad_by_solve(lm_loss, layers=Block)(ours, tokens, targets),
              nnx.grad(lm_loss)(theirs, tokens, targets), tol=1e-5)
        close(nnx.state(ours, nnx.RngCount), nnx.state(theirs, nnx.RngCount))
    assert int(jax.tree.leaves(nnx.state(ours, nnx.RngCount))[0]) > 0


def test_a_module_called_twice_shares_its_blocks():
    class Twice(nnx.Module):
        def __init__(self, rngs):
            self.block = Block(rngs)

        def __call__(self, x):
            return self.block(self.block(x))

    model, x = Twice(nnx.Rngs(1)), jnp.ones((2, W))
    loss = lambda m, x: jnp.sum(m(x) ** 2)
    close(lbp.grad_by_solve(loss, layers=Block)(model, x), nnx.grad(loss)(model, x), tol=1e-5)
    cap = lbp.capture(loss, model, x, layers=Block)
    assert [len(layer.params) for layer in cap.net.layers] == [4, 4]
    assert cap.net.layers[0].params == cap.net.layers[1].params


# -- equinox --------------------------------------------------------------------------------------
class Mlp(eqx.Module):
    layers: list

    def __init__(self, key, depth=3):
        keys = jax.random.split(key, depth)
        self.layers = [eqx.nn.Linear(W, W, key=k) for k in keys]

    def __call__(self, x):
        for layer in self.layers:
            x = jnp.tanh(layer(x))
        return x


def test_equinox_per_example_vmap_idiom_gives_filter_grad():
    model = Mlp(jax.random.PRNGKey(0))
    x = jax.random.normal(jax.random.PRNGKey(1), (5, W))
    loss = lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2)  # equinox's idiom: the model on one example, vmapped
    grads = lbp.grad_by_solve(loss, layers=eqx.nn.Linear)(model, x)
    expected = eqx.filter_grad(loss)(model, x)
    close(grads, expected, tol=1e-5)
    assert solved(lambda m: lbp.grad_by_solve(loss, layers=eqx.nn.Linear)(m, x), model)


# -- curvature of a model as it is ---------------------------------------------------------------------
@pytest.mark.users_settings
def test_curvature_transforms_take_layers():
    params, x, y = blocks_params(3, seed=2), jnp.asarray(np.random.default_rng(3).standard_normal((4, W))), \
        jnp.zeros((4, 2))
    losses = lambda p, x, y: jnp.mean((jnp.tanh(_forward(p, x)) @ p["head"] - y) ** 2, axis=1)
    loss = lambda p, x, y: jnp.sum(losses(p, x, y))
    one = lambda p, xb, yb: losses(p, xb[None], yb[None])[0]
    ref = jax.jit(jax.vmap(jax.grad(one), (None, 0, 0)))(params, x, y)
    close(jax.jit(lbp.per_example_grads(losses, layers=block))(params, x, y), ref)
    norms = jax.jit(lbp.per_example_grad_norms(losses, layers=block))(params, x, y)
    close(norms, jnp.sqrt(sum(jnp.sum(g.reshape(4, -1) ** 2, axis=1) for g in jax.tree.leaves(ref))))
    value, grad, G = jax.jit(lbp.gauss_newton(loss, layers=block))(params, x, y)
    close((value, grad), jax.value_and_grad(loss)(params, x, y))

    flat, unravel = ravel_pytree(params)
    outs = lambda f: jnp.ravel(_forward(unravel(f), x))
    jac = jax.jit(jax.jacfwd(outs))(flat)
    h = jax.jit(jax.hessian(lambda o: loss_of_outs(o.reshape(4, W), params, y)))(outs(flat))
    dense = jac.T @ h @ jac
    # the head is in the loss (it follows the last layer call): G is the GGN of the blocks' outputs
    v = jax.tree.map(jnp.ones_like, params)
    close(ravel_pytree(jax.jit(lambda G, v: G.mv(v))(G, v))[0], dense @ ravel_pytree(v)[0])
    close(jax.jit(lbp.diag_ggn(loss, layers=block))(params, x, y), unravel(jnp.diag(dense)))
    factors = jax.jit(lbp.kfac_factors(loss, layers=block))(params, x, y)
    assert isinstance(factors["blocks"][0]["W"], lbp.Kronecker)
    close(factors["head"], jnp.zeros_like(params["head"]))  # in the loss: no part of G (J = 0 there)


def _forward(p, x):
    h = x
    for b in p["blocks"]:
        h = block(b, h)
    return h


def loss_of_outs(h, p, y):
    return jnp.sum(jnp.mean((jnp.tanh(h) @ p["head"] - y) ** 2, axis=1))


# -- errors -----------------------------------------------------------------------------------------
def test_errors_name_the_call_and_the_fix():
    params, x, y = blocks_params(2), jnp.ones((4, W)), jnp.zeros((4, 2))
    with pytest.raises(ValueError, match="names Block, but fun never called it"):
        lbp.grad_by_solve(blocks_loss, layers=(block, Block))(params, x, y)
    with pytest.raises(TypeError, match="decorate it"):
        lbp.grad_by_solve(blocks_loss, layers=jnp.tanh)(params, x, y)
    with pytest.raises(ValueError, match="names block, but fun never called it"):
        lbp.grad_by_solve(lambda p, x, y: jnp.sum(p["head"]), layers=block)(params, x, y)
    remat = lambda p, x, y: jnp.sum(jax.checkpoint(lambda p, x: block(p, x))(p["blocks"][0], x))
    with pytest.raises(NotImplementedError, match="inside `(remat|checkpoint)"):
        lbp.grad_by_solve(remat, layers=block)(params, x, y)


def test_layers_inside_a_jit_of_the_users_are_found():
    """A jax.jit the user put around the model's forward pass is looked through."""
    params, x, y = blocks_params(3), jnp.ones((4, W)), jnp.zeros((4, 2))
    forward = jax.jit(_forward)
    loss = lambda p, x, y: jnp.mean((forward(p, x) @ p["head"] - y) ** 2)
    close(lbp.grad_by_solve(loss, layers=block)(params, x, y), jax.grad(loss)(params, x, y))
    assert [layer.name for layer in lbp.capture(loss, params, x, y, layers=block).net.layers] == [
        "block0", "block1", "block2"]


@lbp.layer
def dense(W, x):
    return jnp.tanh(x @ W)


@lbp.layer
def dropout_dense(W, x, key):
    return jnp.tanh(jnp.where(jax.random.bernoulli(key, 0.5, x.shape), 2 * x, 0.0) @ W)


_jitted_dense = jax.jit(dense)
_jitted_dropout = jax.jit(lambda W, x, key: dropout_dense(W, x, key))
_JITTED_TWICE = {  # one jax.jit-ed block, called twice on different inputs (JAX keeps one trace of it)
    "twice": lambda W, x1, x2, k1, k2: jnp.sum(_jitted_dense(W, x1)) + jnp.sum(_jitted_dense(W, 2 * x1) ** 2),
    "siamese": lambda W, x1, x2, k1, k2: jnp.sum((_jitted_dense(W, x1) - _jitted_dense(W, x2)) ** 2),
    "chain": lambda W, x1, x2, k1, k2: jnp.sum(_jitted_dense(0.5 * W, _jitted_dense(W, x1)) ** 2),
    "dropout": lambda W, x1, x2, k1, k2: (jnp.sum(_jitted_dropout(W, x1, k1)) +
                                         jnp.sum(_jitted_dropout(W, x1, k2) ** 2)),
}


@pytest.mark.parametrize("case", list(_JITTED_TWICE))
def test_a_jitted_block_called_twice_is_two_layers(case):
    """The fuzzer's wrong gradient: a jitted block called twice was inlined as two copies of one
    trace sharing its variables (the second call's output read in both places)."""
    fun = _JITTED_TWICE[case]
    keys = jax.random.split(jax.random.PRNGKey(3), 5)
    W_, x1, x2 = (jax.random.normal(k, (4, 4) if n == 0 else (3, 4)) for n, k in enumerate(keys[:3]))
    args = (W_, x1, x2, keys[3], keys[4])
    layers = dropout_dense if case == "dropout" else dense
    close(lbp.value_and_grad_by_solve(fun, layers=layers)(*args), jax.value_and_grad(fun)(*args))
    close(jax.jit(lbp.grad_by_solve(fun, layers=layers))(*args), jax.grad(fun)(*args))
    assert len(lbp.capture(fun, *args, layers=layers).net.order) >= 2


# -- stacked blocks iterated by a scan: Row layers of one kind ---------------------------------------
def scanned_loss(p, x, y):
    h, _ = jax.lax.scan(lambda h, b: (block(b, h), None), x, p["blocks"])
    return jnp.mean((h @ p["head"] - y) ** 2)


def stacked_params(depth):
    params = blocks_params(depth, seed=4)
    return {"blocks": jax.tree.map(lambda *a: jnp.stack(a), *params["blocks"]), "head": params["head"]}


def test_blocks_scanned_over_become_row_layers_and_the_program_does_not_grow():
    params, x, y = stacked_params(5), jnp.ones((4, W)), jnp.zeros((4, 2))
    close(lbp.grad_by_solve(scanned_loss, layers=block)(params, x, y), jax.grad(scanned_loss)(params, x, y))
    cap = lbp.capture(scanned_loss, params, x, y, layers=block)
    assert [layer.params for layer in cap.net.layers] == [
        (lbp.Row("['blocks']['W']", t), lbp.Row("['blocks']['b']", t)) for t in range(5)]
    assert len({layer.fn for layer in cap.net.layers[1:]}) == 1  # the first reads the input, the rest states
    count = lambda d: sum(e.primitive.name == "tanh" for e in equations(jax.make_jaxpr(
        lbp.grad_by_solve(scanned_loss, layers=block))(stacked_params(d), x, y)))
    assert count(8) == count(16)


def test_equinox_filter_vmap_stacks_run_by_a_scan():
    class Residual(eqx.Module):
        linear: eqx.nn.Linear

        def __init__(self, key):
            self.linear = eqx.nn.Linear(W, W, key=key)

        def __call__(self, x):
            return x + jnp.tanh(self.linear(x))

    stack = eqx.filter_vmap(Residual)(jax.random.split(jax.random.PRNGKey(0), 4))

    def loss(model, x):
        params, static = eqx.partition(model, eqx.is_array)
        h, _ = jax.lax.scan(lambda h, p: (eqx.combine(p, static)(h), None), x, params)
        return jnp.sum(h ** 2)

    x = jax.random.normal(jax.random.PRNGKey(1), (W,))
    close(lbp.grad_by_solve(loss, layers=Residual)(stack, x), eqx.filter_grad(loss)(stack, x), tol=1e-5)


def test_nnx_vmap_stacks_run_by_nnx_scan():
    @nnx.vmap(in_axes=0, out_axes=0)
    def make(key):
        return Block(nnx.Rngs(key))

    blocks = make(jax.random.split(jax.random.key(0), 4))

    def loss(blocks, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def forward(h, block):
            return h + block(h)

        return jnp.sum(forward(x, blocks) ** 2)

    # Rows that vary: a constant row has no variance for the norm to divide by, and float32's
    # gradients of ~1e9 would be compared on the digits rounding leaves.
    x = jax.random.normal(jax.random.key(1), (3, W))
    close(lbp.grad_by_solve(loss, layers=Block)(blocks, x), nnx.grad(loss)(blocks, x), tol=1e-5)


def test_flax_linen_variables_through_module_apply():
    """A linen model as written: layers=Block marks each Block's call inside module.apply; the
    gradient is jax.grad's of the variables dict."""
    nn = pytest.importorskip("flax.linen")

    class LinenBlock(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x + jnp.tanh(nn.Dense(W)(x))

    class LinenModel(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(3):
                x = LinenBlock()(x)
            return x

    model, x = LinenModel(), jnp.ones((2, W))
    variables = jax.tree.map(lambda a: a.astype(jnp.float64), model.init(jax.random.PRNGKey(0), x))
    loss = lambda v, x: jnp.sum(model.apply(v, x) ** 2)
    close(lbp.grad_by_solve(loss, layers=LinenBlock)(variables, x), jax.grad(loss)(variables, x))
    cap = lbp.capture(loss, variables, x, layers=LinenBlock)
    assert [layer.name for layer in cap.net.layers] == ["LinenBlock0", "LinenBlock1", "LinenBlock2"]


def test_flax_linen_scan_gives_one_layer_per_step():
    """``nn.scan(length=5)`` over a linen block is five layers reading Row blocks of the stacked
    parameters (linen calls the body once more to learn the carry's shape; nothing reads that
    call's result, so it is no layer: there were six), and the gradient is jax.grad's."""
    nn = pytest.importorskip("flax.linen")

    class ScanBlock(nn.Module):
        @nn.compact
        def __call__(self, h, _):
            return jnp.tanh(nn.Dense(W)(h)), None

    class Scanned(nn.Module):
        @nn.compact
        def __call__(self, x):
            body = nn.scan(ScanBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=5)
            return nn.Dense(1)(body()(x, None)[0])

    model, x = Scanned(), jnp.linspace(-1.0, 1.0, 2 * W).reshape(2, W)
    variables = jax.tree.map(lambda a: a.astype(jnp.float64), model.init(jax.random.PRNGKey(0), x))
    loss = lambda v, x: jnp.sum(model.apply(v, x) ** 2)
    close(lbp.grad_by_solve(loss, layers=ScanBlock)(variables, x), jax.grad(loss)(variables, x))
    net = lbp.capture(loss, variables, x, layers=ScanBlock).net
    assert [layer.name for layer in net.layers] == [f"ScanBlock{t}" for t in range(5)]
    assert all(isinstance(p, lbp.Row) for layer in net.layers for p in layer.params)


def test_flax_linen_dropout_and_batch_statistics_under_layers():
    """linen as users run it: ``rngs={"dropout": key}`` for dropout inside the layers (a fresh key,
    a fresh mask: the gradient jax.grad's with the same key) and ``mutable=["batch_stats"]`` with
    has_aux returning the updated statistics."""
    from flax import linen as nn

    class DropBlock(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = True):
            x = nn.BatchNorm(use_running_average=not train)(x)
            return x + nn.Dropout(0.3, deterministic=not train)(jnp.tanh(nn.Dense(W)(x)))

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = True):
            for _ in range(3):
                x = DropBlock()(x, train)
            return x

    model, x = Model(), jnp.asarray(np.random.default_rng(5).standard_normal((6, W)))
    variables = jax.tree.map(lambda a: a.astype(jnp.float64), model.init(jax.random.PRNGKey(0), x, False))
    params, stats = variables["params"], variables["batch_stats"]

    def loss(params, stats, x, key):
        out, updated = model.apply({"params": params, "batch_stats": stats}, x, rngs={"dropout": key},
                                   mutable=["batch_stats"])
        return jnp.sum(out ** 2), updated

    for seed in (1, 2):  # two keys: two masks, both as jax.grad's
        key = jax.random.PRNGKey(seed)
        ours = lbp.value_and_grad_by_solve(loss, has_aux=True, layers=DropBlock)(params, stats, x, key)
        close(ours, jax.value_and_grad(loss, has_aux=True)(params, stats, x, key))
    a, b = (lbp.grad_by_solve(loss, has_aux=True, layers=DropBlock)(params, stats, x, jax.random.PRNGKey(s))[0]
            for s in (1, 2))
    assert not np.allclose(jax.tree.leaves(a)[0], jax.tree.leaves(b)[0])
    cap = lbp.capture(lambda *a: loss(*a)[0], params, stats, x, jax.random.PRNGKey(1), layers=DropBlock)
    assert [layer.name for layer in cap.net.layers] == ["DropBlock0", "DropBlock1", "DropBlock2"]


def test_has_aux_and_several_arguments_as_jax_grad():
    params, x, y = blocks_params(2), jnp.ones((4, W)), jnp.zeros((4, 2))
    with_aux = lambda p, x, y: (blocks_loss(p, x, y), {"mean": jnp.mean(x)})
    close(lbp.value_and_grad_by_solve(with_aux, has_aux=True, layers=block)(params, x, y),
          jax.value_and_grad(with_aux, has_aux=True)(params, x, y))
    close(lbp.grad_by_solve(blocks_loss, argnums=(0, 1), layers=block)(params, x, y),
          jax.grad(blocks_loss, argnums=(0, 1))(params, x, y))


@lbp.layer
def seq_block(p, h):
    """A block over [batch, positions, W] whose reshapes name the batch: traced at one batch size,
    its program keeps it (the per-example transforms trace the model again on one example)."""
    z = (h.reshape(h.shape[0] * h.shape[1], W) @ p["W"]).reshape(h.shape[0], -1, W)
    return h + jnp.tanh(z + p["b"])


def seq_losses(params, tokens):
    h = params["embed"][tokens]  # an embedding lookup (a gather fixed to the batch) in glue
    for p in params["blocks"]:
        h = seq_block(p, h)
    return jnp.sum((h @ params["embed"].T) ** 2, axis=(1, 2)) / 10  # the tied head is in the loss


def seq_network_losses(params, tokens):
    """The same model built by hand as a Network: its layer functions run at any batch."""
    depth = len(params["blocks"])
    layers = [lbp.Layer("embed", lambda th, t: th[0][t], ("tokens",), ("embed",))]
    layers += [lbp.Layer(f"b{k}", lambda th, h: seq_block.__linbackprop_layer__(th[0], h),
                         (f"b{k - 1}" if k else "embed",), (f"b{k}",)) for k in range(depth)]
    net = lbp.Network(layers, ["tokens"], f"b{depth - 1}")
    h = net({"embed": params["embed"], **{f"b{k}": p for k, p in enumerate(params["blocks"])}}, tokens)
    return jnp.sum((h @ params["embed"].T) ** 2, axis=(1, 2)) / 10


def test_per_example_quantities_of_layers_fixed_to_their_batch():
    """Layers found in a model replay programs traced at the call's batch (reshapes, broadcasts and
    gathers keep it); the per-example transforms, which evaluate each layer on one example, get
    each layer's program at one example too: exact against jax.vmap(jax.grad), and the GGN
    diagonal and K-FAC as on the same model built by hand."""
    rng = np.random.default_rng(4)
    params = {"embed": jnp.asarray(0.5 * rng.standard_normal((7, W))),
              "blocks": [{"W": jnp.asarray(0.4 * rng.standard_normal((W, W))), "b": jnp.asarray(rng.standard_normal(W))}
                         for _ in range(3)]}
    tokens = jnp.asarray(rng.integers(0, 7, (5, 4)))
    ref = jax.jit(jax.vmap(jax.grad(lambda p, t: seq_losses(p, t[None])[0]), (None, 0)))(params, tokens)
    close(jax.jit(lbp.per_example_grads(seq_losses, layers=seq_block))(params, tokens), ref)
    norms = jnp.sqrt(sum(jnp.sum(g.reshape(5, -1) ** 2, axis=1) for g in jax.tree.leaves(ref)))
    close(jax.jit(lbp.per_example_grad_norms(seq_losses, layers=seq_block))(params, tokens), norms)
    clipped, found = jax.jit(lbp.clipped_grad(seq_losses, 1.0, layers=seq_block))(params, tokens)
    close(found, norms)
    close(clipped, jax.tree.map(lambda g: jnp.tensordot(jnp.minimum(1, 1 / norms), g, 1), ref))
    total = lambda p, t: jnp.sum(seq_losses(p, t))
    by_hand = lambda p, t: jnp.sum(seq_network_losses(p, t))
    close(by_hand(params, tokens), total(params, tokens))
    close(jax.jit(lbp.diag_ggn(total, layers=seq_block))(params, tokens),
          jax.jit(lbp.diag_ggn(by_hand))(params, tokens))
    is_pair = lambda x: isinstance(x, lbp.Kronecker)
    found, expected = (jax.jit(lbp.kfac_factors(total, layers=seq_block))(params, tokens),
                       jax.jit(lbp.kfac_factors(by_hand))(params, tokens))
    assert isinstance(found["blocks"][0]["W"], lbp.Kronecker)
    close(jax.tree.leaves(found, is_leaf=is_pair), jax.tree.leaves(expected, is_leaf=is_pair))


def test_per_example_quantities_of_an_nnx_model_with_embedding_and_layer_norm():
    """The nnx model as written (an embedding, layer norms, blocks in a Python loop, the tied head
    in the loss): per-example gradients, norms and the clipped sum against jax.vmap(jax.grad) of
    the same model split with nnx.split."""
    model = Model(nnx.Rngs(0), depth=2)
    tokens, targets = _tokens(5)
    losses = lambda m, t, y: -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(m(t)), y[..., None], -1)[..., 0],
                                       axis=1)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    one = lambda p, t, y: losses(nnx.merge(graphdef, p, rest), t[None], y[None])[0]
    ref = jax.jit(jax.vmap(jax.grad(one), (None, 0, 0)))(params, tokens, targets)
    close(jax.jit(lbp.per_example_grads(losses, layers=Block))(model, tokens, targets), ref, tol=1e-5)
    norms = jnp.sqrt(sum(jnp.sum(g.reshape(3, -1) ** 2, axis=1) for g in jax.tree.leaves(ref)))
    clipped, found_norms = jax.jit(lbp.clipped_grad(losses, 0.5, layers=Block))(model, tokens, targets)
    close(found_norms, norms, tol=1e-5)
    close(clipped, jax.tree.map(lambda g: jnp.tensordot(jnp.minimum(1, 0.5 / norms), g, 1), ref), tol=1e-5)


def test_a_marked_function_not_named_in_layers_is_not_a_layer():
    """``@lbp.layer`` marks a function; only ``layers=`` that names it makes its calls layers. With
    ``layers=body``, a marked ``head`` is part of the loss: G is the GGN of body's outputs
    (dense J* H J from jax.jacfwd and jax.hessian), head's weight has no part in it, and the
    gradient stays jax.grad's."""
    @lbp.layer
    def body(p, x):
        return jnp.tanh(x @ p["W"])

    @lbp.layer
    def head(p, h):
        return jnp.tanh(h @ p["V"])

    rng = np.random.default_rng(6)
    params = {"W": jnp.asarray(rng.standard_normal((3, 4))), "V": jnp.asarray(rng.standard_normal((4, 2)))}
    x = jnp.asarray(rng.standard_normal((5, 3)))
    loss = lambda p, x: 0.5 * jnp.sum(head(p, body(p, x)) ** 2)
    value, grad, G = jax.jit(lbp.gauss_newton(loss, layers=body))(params, x)
    close((value, grad), jax.value_and_grad(loss)(params, x))

    flat, unravel = ravel_pytree(params)
    jac = jax.jacfwd(lambda f: body(unravel(f), x).ravel())(flat)
    h = jax.hessian(lambda o: loss_of_head(params, o.reshape(5, 4)))(body(params, x).ravel())
    close(jax.jit(lambda G: G.todense())(G), jac.T @ h @ jac)
    assert [layer.name for layer in lbp.capture(loss, params, x, layers=body).net.layers
            if not layer.name.startswith("glue")] == ["body0"]


def loss_of_head(p, h):
    return 0.5 * jnp.sum(jnp.tanh(h @ p["V"]) ** 2)


@pytest.mark.parametrize("transform", ["kfac_factors", "diag_ggn", "ggn_factor"])
def test_curvature_of_a_model_without_layers_says_to_name_them(transform):
    """A model as written, no ``layers=``: there is no network call whose outputs H is taken
    over, and the error says that ``layers=`` names the calls (it said the calls' outputs had
    no batch axis)."""
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    loss = lambda m, x: jnp.sum(m(x) ** 2)
    with pytest.raises(ValueError, match=rf"{transform}: fun calls no network.*layers="):
        getattr(lbp, transform)(loss)(model, jnp.ones((4, 3)))


@lbp.layer
def gated_cell(p, h, x):
    return jnp.tanh(h @ p["A"] + x @ p["B"]) * jax.nn.sigmoid(x @ p["C"])


def test_a_scan_over_a_sequence_reads_its_steps_as_rows_of_one_input():
    """``lax.scan`` over the inputs of a sequence, its loss reading every hidden state: the steps
    read rows of one input (as a hand-built network's ``Row("xs", t)``), not one input per step,
    and the stacked states are one `Stack` output; gradients, per-example gradients (the batch on
    the Stack's axis 1) and Gauss–Newton products as plain JAX's."""
    T, B, D, H = 5, 3, 2, 4
    k = jax.random.split(jax.random.key(7), 4)
    params = {"A": 0.5 * jax.random.normal(k[0], (H, H)), "B": jax.random.normal(k[1], (D, H)),
              "C": jax.random.normal(k[2], (D, H))}
    xs = jax.random.normal(k[3], (T, B, D))

    def losses(p, xs):
        _, hs = jax.lax.scan(lambda h, x: (gated_cell(p, h, x),) * 2, jnp.zeros((xs.shape[1], H)), xs)
        return jnp.sum(hs**2, axis=(0, 2))

    loss = lambda p, xs: jnp.sum(losses(p, xs))
    cap = lbp.capture(loss, params, xs, layers=gated_cell)
    assert cap.net.inputs.count("xs") == 1 and len(cap.net.inputs) <= 2, cap.net.inputs
    assert [layer.reads[1] for layer in cap.net.layers] == [lbp.Row("xs", t) for t in range(T)]
    # the stacked ys: one Stack output (one read of consecutive rows), not T outputs stacked after
    assert cap.net.output_spec == (lbp.Stack([layer.name for layer in cap.net.layers]),)
    close(jax.jit(lbp.grad_by_solve(loss, layers=gated_cell))(params, xs), jax.jit(jax.grad(loss))(params, xs))

    def batch_first(p, xs):  # [B, T, D]: the batch leads, as the per-example transforms need
        _, hs = jax.lax.scan(lambda h, x: (gated_cell(p, h, x),) * 2, jnp.zeros((xs.shape[0], H)),
                             jnp.swapaxes(xs, 0, 1))
        return jnp.sum(hs**2, axis=(0, 2))

    xs_b = jnp.swapaxes(xs, 0, 1)
    close(jax.jit(lbp.per_example_grads(batch_first, layers=gated_cell))(params, xs_b),
          jax.jacrev(batch_first)(params, xs_b))
    tangent = jax.tree.map(jnp.ones_like, params)
    close(jax.jit(lambda p: lbp.gauss_newton(loss, layers=gated_cell)(p, xs)[2].mv(tangent))(params),
          jax.jit(lambda p: jax.vjp(lambda q: losses_states(q, xs), p)[1](
              2 * jax.jvp(lambda q: losses_states(q, xs), (p,), (tangent,))[1])[0])(params))


def losses_states(p, xs):
    """The hidden states of the scan in the rows test (the GGN's outputs: H = 2 I for Σ h²)."""
    _, hs = jax.lax.scan(lambda h, x: (gated_cell(p, h, x),) * 2, jnp.zeros((xs.shape[1], 4)), xs)
    return hs


def test_per_example_transforms_of_a_head_after_a_frozen_backbone():
    """Every differentiated parameter used after the last layer call (a frozen backbone named
    in ``layers=``, a trainable head in the loss): the networks contribute nothing, the
    per-example gradients, norms and clipped sum are the head's, as jax.jacrev gives them."""
    rng = np.random.default_rng(9)
    backbone = jnp.asarray(rng.standard_normal((3, 4)))

    @lbp.layer
    def body(W, x):
        return jnp.tanh(x @ W)

    def losses(head, x):
        return jnp.sum((body(jax.lax.stop_gradient(backbone), x) @ head) ** 2, axis=1)

    head, x = jnp.asarray(rng.standard_normal((4, 2))), jnp.asarray(rng.standard_normal((5, 3)))
    ref = jax.jit(jax.jacrev(losses))(head, x)
    norms = jnp.linalg.norm(ref.reshape(5, -1), axis=1)
    close(jax.jit(lbp.per_example_grads(losses, layers=body))(head, x), ref)
    close(jax.jit(lbp.per_example_grad_norms(losses, layers=body))(head, x), norms)
    clipped, found = jax.jit(lbp.clipped_grad(losses, 1.0, layers=body))(head, x)
    close(found, norms)
    close(clipped, jnp.tensordot(jnp.minimum(1, 1 / norms), ref, 1))


@pytest.mark.users_settings
@pytest.mark.parametrize("tied", [False, True])
def test_norms_and_clipping_of_a_head_outside_the_layers(tied):
    """Residual blocks named in ``layers=``, a head after them in the loss (as README's model):
    the blocks' norms are ghost norms and the head's per-example gradients come from the loss
    alone, their squares added (4× a gradient before, when the whole gradient was formed per
    example); a head tied to a block's weight (read inside and outside the networks) keeps the
    per-example gradients. Norms and the clipped sum as jax.vmap(jax.grad)'s."""
    rng = np.random.default_rng(14)

    @lbp.layer
    def block(p, h):
        return h + jnp.tanh(h @ p["W"] + p["b"])

    def losses(p, x, y):
        h = x
        for q in p["blocks"]:
            h = block(q, h)
        logits = h @ (p["blocks"][0]["W"] if tied else p["head"])[:, :3]
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(logp, y[:, None], axis=1)[:, 0]

    params = {"blocks": [{"W": jnp.asarray(0.5 * rng.standard_normal((4, 4))), "b": jnp.asarray(rng.standard_normal(4))}
                         for _ in range(3)], "head": jnp.asarray(rng.standard_normal((4, 3)))}
    x, y = jnp.asarray(rng.standard_normal((6, 4))), jnp.asarray(rng.integers(0, 3, 6))
    grads = jax.vmap(lambda xb, yb: jax.grad(lambda p: losses(p, xb[None], yb[None])[0])(params))(x, y)
    norms = jnp.sqrt(sum(jnp.sum(g.reshape(6, -1) ** 2, axis=1) for g in jax.tree.leaves(grads)))
    close(jax.jit(lbp.per_example_grad_norms(losses, layers=block))(params, x, y), norms)
    clipped, found = jax.jit(lbp.clipped_grad(losses, 0.5, layers=block))(params, x, y)
    close(found, norms)
    close(clipped, jax.tree.map(lambda g: jnp.tensordot(jnp.minimum(1, 0.5 / norms), g, 1), grads))


def test_one_example_retrace_keeps_a_raw_key_and_names_a_fixed_batch():
    """The per-example transforms trace fun again on one example. What is sliced is decided by
    how the data flows: a raw PRNG key (uint32 [2]) at batch 2 reaches ``random_wrap`` as one
    key, so it is kept whole (slicing it made an invalid key), while raw keys per example
    ([2, 2], one key per row) are sliced; both per-example gradients are jax.jacrev's. A model
    with the batch size written into it raises an error that names the slicing and the fix, not
    JAX's reshape error."""
    rng = np.random.default_rng(10)

    @lbp.layer
    def body(W, x):
        return jnp.tanh(x @ W)

    W = jnp.asarray(rng.standard_normal((3, 4)))

    def noisy(W, x, key):
        return jnp.sum(body(W, x + 0.01 * jax.random.normal(key, (x.shape[1],))) ** 2, axis=1)

    x, key = jnp.asarray(rng.standard_normal((2, 3))), jax.random.PRNGKey(0)
    close(lbp.per_example_grads(noisy, layers=body)(W, x, key), jax.jacrev(noisy)(W, x, key))

    def noisy_per_example(W, x, keys):
        noise = jax.vmap(lambda k: jax.random.normal(k, (x.shape[1],)))(keys)
        return jnp.sum(body(W, x + 0.01 * noise) ** 2, axis=1)

    keys = jax.random.split(jax.random.PRNGKey(1), 2)  # raw keys, one per example
    assert keys.shape == (2, 2)
    close(lbp.per_example_grads(noisy_per_example, layers=body)(W, x, keys),
          jax.jacrev(noisy_per_example)(W, x, keys))

    def fixed(W, x):
        return jnp.sum(body(W, x).reshape(5, -1) ** 2, axis=1)

    with pytest.raises(ValueError, match=r"traced again on one example.*h\.reshape\(h\.shape\[0\], -1\)"):
        lbp.per_example_grads(fixed, layers=body)(W, jnp.asarray(rng.standard_normal((5, 3))))


@pytest.mark.parametrize("batch", [4, 5])
def test_a_constant_whose_leading_axis_is_the_batch_size_stays_whole(batch):
    """An array the layers close over is part of the layers, not per-example data, whatever its
    leading axis: at batch 5, as at 4, the per-example gradients of a layer reading a (5, 3)
    constant are jax.jacrev's (it was sliced to one row and refused)."""
    rng = np.random.default_rng(12)
    C = jnp.asarray(rng.standard_normal((5, 3)))

    @lbp.layer
    def mixed(W, x):
        return jnp.tanh(x @ (W + C.T @ C / 5))

    W, x = jnp.asarray(rng.standard_normal((3, 3))), jnp.asarray(rng.standard_normal((batch, 3)))
    losses = lambda W, x: jnp.sum(mixed(W, mixed(W, x)) ** 2, axis=1)
    close(jax.jit(lbp.per_example_grads(losses, layers=mixed))(W, x), jax.jacrev(losses)(W, x))
    assert lbp.capture(losses, W, x, layers=mixed).net.inputs == ("x",)


@pytest.mark.parametrize("batch", [2, 3])
def test_a_frozen_argument_as_long_as_the_batch_is_not_sliced(batch):
    """An argument that is not differentiated is data only where fun treats it so: a frozen 2 × 2
    matrix and a frozen bias of 2 at batch 2, an embedding table with as many rows as examples
    (``losses(frozen, trainable, x)``, ``argnums=1``) are read whole, as at batch 3 — per-example
    gradients, their norms, the clipped sum and the GGN diagonal equal jax.jacrev's and the dense
    J*HJ's, under jax.jit (the frozen arguments traced) and without (they were sliced to one row
    and refused with advice about reshapes)."""
    rng = np.random.default_rng(13)

    @lbp.layer
    def dense(W, frozen, bias, table, h, tokens):
        return jnp.tanh(h @ W @ frozen + bias + table[tokens])

    def losses(fixed, W, x, tokens):
        frozen, bias, table = fixed
        h = dense(W, frozen, bias, table, x, tokens)
        return jnp.sum(dense(W, frozen, bias, table, h, tokens) ** 2, axis=1)

    fixed = (jnp.asarray(rng.standard_normal((2, 2))), jnp.asarray(rng.standard_normal(2)),
             jnp.asarray(rng.standard_normal((batch, 2))))
    W, x = jnp.asarray(rng.standard_normal((2, 2))), jnp.asarray(rng.standard_normal((batch, 2)))
    tokens = jnp.asarray((np.arange(batch) + 1) % batch)  # example b reads row b + 1 of the table
    ref = jax.jacrev(losses, argnums=1)(fixed, W, x, tokens)
    norms = jnp.linalg.norm(ref.reshape(batch, -1), axis=1)
    J = jax.jacrev(lambda W: jnp.tanh(_hidden(fixed, W, x, tokens)))(W).reshape(batch, 2, -1)  # outputs
    out = jnp.tanh(_hidden(fixed, W, x, tokens))
    diagonal = jnp.einsum("bip,bi,bip->p", J, 2 * jnp.ones_like(out), J).reshape(2, 2)  # H = 2 I per example
    for run in (lambda f: f, jax.jit):
        close(run(lbp.per_example_grads(losses, argnums=1, layers=dense))(fixed, W, x, tokens), ref)
        close(run(lbp.per_example_grad_norms(losses, argnums=1, layers=dense))(fixed, W, x, tokens), norms)
        clipped, found = run(lbp.clipped_grad(losses, 1.0, argnums=1, layers=dense))(fixed, W, x, tokens)
        close(found, norms)
        close(clipped, jnp.tensordot(jnp.minimum(1, 1 / norms), ref, 1))
        loss = lambda fixed, W, x, tokens: jnp.sum(losses(fixed, W, x, tokens))
        close(run(lbp.diag_ggn(loss, argnums=1, layers=dense))(fixed, W, x, tokens), diagonal)


def _hidden(fixed, W, x, tokens):
    """The second layer's pre-activation in the frozen-argument test (its outputs' Jacobian)."""
    frozen, bias, table = fixed
    h = jnp.tanh(x @ W @ frozen + bias + table[tokens])
    return h @ W @ frozen + bias + table[tokens]


class _DropoutBlock(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(4, 4, rngs=rngs)
        self.dropout = nnx.Dropout(0.3, rngs=rngs)

    def __call__(self, x):
        return self.dropout(jnp.tanh(self.linear(x)))


class _DropoutModel(nnx.Module):
    def __init__(self, rngs):
        self.blocks = nnx.List([_DropoutBlock(rngs) for _ in range(2)])

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_dropout_in_a_layer_gauss_newton_takes_the_masks_and_per_example_transforms_refuse():
    """nnx.Dropout in training mode inside the layers: gauss_newton's value and gradient are
    nnx.value_and_grad's (the same masks, from the same RNG state, and the RNG count advanced as
    nnx.grad advances it), and G is J* H J with those masks (jax.jvp and jax.vjp of the model at
    that state); the per-example transforms refuse, naming the random numbers and the fix."""
    with jax.enable_x64(False):
        model = _DropoutModel(nnx.Rngs(0, dropout=1))
        x = jnp.asarray(np.random.default_rng(13).standard_normal((6, 4)), jnp.float32)
        loss = lambda m, x: 0.5 * jnp.mean(m(x) ** 2)
        counts = lambda m: [int(c) for c in jax.tree.leaves(nnx.state(m, nnx.RngCount))]
        reference, ours = nnx.clone(model), nnx.clone(model)
        reference_value, reference_grad = nnx.value_and_grad(loss)(reference, x)
        value, grad, G = lbp.gauss_newton(loss, layers=_DropoutBlock)(ours, x)
        close(value, reference_value, tol=1e-6)
        close(ravel_pytree(grad)[0], ravel_pytree(reference_grad)[0], tol=1e-5)
        assert counts(ours) == counts(reference) != counts(model)
        graphdef, params, rest = nnx.split(nnx.clone(model), nnx.Param, ...)
        at = lambda p: nnx.merge(graphdef, p, nnx.clone(rest))(x)  # the RNG state of the step: its masks
        v = jax.tree.map(lambda a: jnp.cos(jnp.arange(a.size, dtype=a.dtype)).reshape(a.shape), params)
        jv = jax.jvp(at, (params,), (v,))[1]
        expected = jax.vjp(at, params)[1](jv / jv.size)[0]  # J* H J v, H = I / (entries) for this mean
        close(ravel_pytree(G.mv(v))[0], ravel_pytree(expected)[0], tol=1e-5)
        losses = lambda m, x: 0.5 * jnp.mean(m(x) ** 2, axis=1)
        for transform in (lbp.per_example_grads(losses, layers=_DropoutBlock),
                          lbp.diag_ggn(loss, layers=_DropoutBlock), lbp.kfac_factors(loss, layers=_DropoutBlock)):
            with pytest.raises(ValueError, match=r"draws random numbers \(nnx\.Dropout.*model\.eval\(\)"):
                transform(nnx.clone(model), x)


def test_a_fori_loop_over_stacked_blocks_is_refused_with_advice_that_applies():
    """``lax.fori_loop`` slicing a stacked block (``Ws[i]``) makes the slices glue computed from
    the parameters: the gradient is right, and the per-example transforms refuse, saying the
    glue reads no per-example state and to loop with lax.scan or Python (not "put the batch
    first", which it is)."""

    @lbp.layer
    def block(W, h):
        return jnp.tanh(h @ W)

    def losses(Ws, x):
        return jnp.sum(jax.lax.fori_loop(0, Ws.shape[0], lambda i, h: block(Ws[i], h), x) ** 2, axis=1)

    Ws, x = 0.5 * jnp.asarray(np.random.default_rng(14).standard_normal((3, 4, 4))), jnp.ones((5, 4))
    total = lambda Ws, x: jnp.sum(losses(Ws, x))
    close(lbp.grad_by_solve(total, layers=block)(Ws, x), jax.grad(total)(Ws, x))
    with pytest.raises(ValueError, match=r"read no per-example state.*lax\.fori_loop.*lax\.scan or a Python loop"):
        lbp.per_example_grads(losses, layers=block)(Ws, x)


def test_a_jit_of_yours_around_a_scan_over_stacked_blocks_keeps_row_blocks():
    """A ``jax.jit`` around a ``lax.scan`` over stacked blocks: the scan's rows are rows of the
    jit's operand, so the layers read Row blocks as without the jit, and the per-example
    gradients are jax.jacrev's (the slices were glue layers, refused)."""

    @lbp.layer
    def block(W, h):
        return jnp.tanh(h @ W)

    @jax.jit
    def body(Ws, x):
        return jax.lax.scan(lambda h, W: (block(W, h), None), x, Ws)[0]

    losses = lambda Ws, x: jnp.sum(body(Ws, x) ** 2, axis=1)
    rng = np.random.default_rng(15)
    Ws, x = 0.5 * jnp.asarray(rng.standard_normal((3, 4, 4))), jnp.asarray(rng.standard_normal((5, 4)))
    net = lbp.capture(lambda Ws, x: jnp.sum(losses(Ws, x)), Ws, x, layers=block).net
    assert [layer.params for layer in net.layers] == [(lbp.Row("", t),) for t in range(3)]
    close(jax.jit(lbp.per_example_grads(losses, layers=block))(Ws, x), jax.jacrev(losses)(Ws, x))


def test_captures_in_two_threads_at_once_leave_the_class_as_it_was():
    """#63: layers= patches a class's __call__ while a capture traces; two threads capturing the same
    class (and one capturing another class, which must not mark this one's calls) at once, many
    times over: every gradient exact, and the class's own __call__ back afterwards."""
    import threading

    class Dense(eqx.Module):
        w: jax.Array

        def __call__(self, x):
            return jnp.tanh(x @ self.w)

    class Other(eqx.Module):
        w: jax.Array

        def __call__(self, x):
            return jnp.sin(x @ self.w)

    own, own_other = Dense.__call__, Other.__call__
    keys = jax.random.split(jax.random.PRNGKey(11), 3)
    model = [Dense(jax.random.normal(keys[0], (3, 3))), Dense(jax.random.normal(keys[1], (3, 3)))]
    other = [Other(jax.random.normal(keys[2], (3, 3)))]
    x = jnp.ones((2, 3))
    loss = lambda m, x: jnp.sum(m[1](m[0](x)) ** 2)
    mixed = lambda o, m, x: jnp.sum(m[0](o[0](x)) ** 2)
    expected = eqx.filter_grad(loss)(model, x)
    expected_mixed = eqx.filter_grad(mixed)(other, model, x)
    barrier, failures = threading.Barrier(3), []

    def work(kind):
        try:
            barrier.wait()
            for n in range(6):
                if kind == "other":
                    got = lbp.grad_by_solve(lambda o, x: mixed(o, model, x + 0.0 * n), layers=Other)(other, x)
                    close(got, expected_mixed)
                else:
                    close(lbp.grad_by_solve(lambda m, x: loss(m, x + 0.0 * n), layers=Dense)(model, x), expected)
        except Exception as error:  # reported below, in the test's thread
            failures.append(error)

    threads = [threading.Thread(target=work, args=(kind,)) for kind in ("dense", "dense", "other")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures
    assert Dense.__call__ is own and Other.__call__ is own_other


def test_a_stacked_parameter_indexed_in_a_python_loop_is_read_as_rows():
    """``params["W"][i]`` in a Python loop over the layers: each layer reads Row(W, i) (as a
    ``lax.scan`` over the stack gives), not a glue layer that makes the rows states — which the
    per-example transforms refused (a state without the batch). Gradient, per-example gradients,
    their norms and the clipped sum against jax.grad and jax.jacrev, under jax.jit."""
    @lbp.layer
    def block(W, b, h):
        return h + jnp.tanh(h @ W + b)

    rng = np.random.default_rng(11)
    depth, width, batch, classes = 3, 4, 5, 3
    params = {"W": jnp.asarray(0.5 * rng.standard_normal((depth, width, width))),
              "b": jnp.asarray(rng.standard_normal((depth, width))),
              "head": jnp.asarray(rng.standard_normal((width, classes)))}
    x, labels = jnp.asarray(rng.standard_normal((batch, width))), jnp.asarray(rng.integers(0, classes, batch))

    def losses(p, x, labels):
        h = x
        for i in range(depth):
            h = block(p["W"][i], p["b"][i], h)
        logp = jax.nn.log_softmax(h @ p["head"], axis=-1)
        return -jnp.take_along_axis(logp, labels[:, None], axis=1)[:, 0]

    net = lbp.capture(losses, params, x, labels, layers=block).net
    assert [lay.params for lay in net.layers] == [(lbp.Row("['W']", i), lbp.Row("['b']", i)) for i in range(depth)]
    total = lambda p, x, labels: jnp.sum(losses(p, x, labels))
    close(jax.jit(lbp.grad_by_solve(total, layers=block))(params, x, labels), jax.grad(total)(params, x, labels))
    per_example = jax.jacrev(losses)(params, x, labels)
    close(jax.jit(lbp.per_example_grads(losses, layers=block))(params, x, labels), per_example)
    norms = jnp.sqrt(sum(jnp.sum(g.reshape(batch, -1) ** 2, axis=1) for g in jax.tree.leaves(per_example)))
    np.testing.assert_allclose(jax.jit(lbp.per_example_grad_norms(losses, layers=block))(params, x, labels), norms,
                               rtol=1e-10)
    clipped, clip_norms = jax.jit(lbp.clipped_grad(losses, 1.0, layers=block))(params, x, labels)
    weights = jnp.minimum(1.0, 1.0 / norms)
    close(clipped, jax.tree.map(lambda g: jnp.einsum("b,b...->...", weights, g), per_example))
    np.testing.assert_allclose(clip_norms, norms, rtol=1e-10)


def test_a_parameter_read_both_whole_and_by_rows_keeps_its_glue():
    """``W[1]`` as one layer's bias and ``W`` whole in another: rows of a block used whole too
    would be two uses the network refuses, so such a leaf's rows stay glue — the gradient as
    before, against jax.grad."""
    @lbp.layer
    def dense(W, h):
        return jnp.tanh(h @ W)

    @lbp.layer
    def shift(b, h):
        return h + b

    rng = np.random.default_rng(12)
    params, x = {"W": jnp.asarray(rng.standard_normal((3, 3)))}, jnp.asarray(rng.standard_normal((4, 3)))

    def loss(p, x):
        return jnp.sum(shift(p["W"][-1], dense(p["W"], shift(p["W"][1], x))) ** 2)

    net = lbp.capture(loss, params, x, layers=(dense, shift)).net
    assert not any(isinstance(block, lbp.Row) for lay in net.layers for block in lay.params)
    close(jax.jit(lbp.grad_by_solve(loss, layers=(dense, shift)))(params, x), jax.grad(loss)(params, x))


def test_a_stacked_block_read_whole_and_by_rows_is_two_uses_of_one_leaf():
    """A stacked weight read whole by glue (a scale from all its entries) and by rows by a scan
    over the blocks (inside a user's jax.jit or not) was refused ("used whole ... and by rows");
    jax.grad takes it. Its rows are now a block of their own, the same leaf: the gradient and the
    per-example gradients and norms are jax.grad's and jax.jacrev's."""
    @lbp.layer
    def block(W, b, h):
        return h + jnp.tanh(h @ W + b)

    rng = np.random.default_rng(11)
    p = {"W": jnp.asarray(0.3 * rng.standard_normal((3, 4, 4))), "b": jnp.zeros((3, 4)),
         "V": jnp.asarray(rng.standard_normal((4, 2)))}
    x = jnp.asarray(rng.standard_normal((5, 4)))

    def losses(p, x):
        @jax.jit
        def region(W, b, h):
            h = h * (1 + 0.1 * jnp.mean(W))  # W read whole
            return jax.lax.scan(lambda h, wb: (block(wb[0], wb[1], h), None), h, (W, b))[0]  # and by rows
        return jnp.sum((region(p["W"], p["b"], jnp.tanh(x)) @ p["V"]) ** 2, axis=1)

    loss = lambda p, x: jnp.mean(losses(p, x))
    close(lbp.grad_by_solve(loss, layers=block)(p, x), jax.grad(loss)(p, x))
    expected = jax.jacrev(losses)(p, x)
    close(lbp.per_example_grads(losses, layers=block)(p, x), expected)
    norms = jnp.sqrt(sum(jnp.sum(g.reshape(5, -1) ** 2, axis=1) for g in jax.tree.leaves(expected)))
    close(lbp.per_example_grad_norms(losses, layers=block)(p, x), norms)


@pytest.mark.parametrize("pick", ["astype", "take", "columns"])
def test_a_slice_of_a_stacked_block_taken_in_a_loop_is_named_as_such(pick):
    """W[i].astype(...), jnp.take(W, i, 0) or W[:, i] with i a lax.fori_loop's index: glue computed
    from the parameters alone, said so with the fix (lax.scan or a Python loop), not "put the
    batch first"."""
    @lbp.layer
    def block(W, b, h):
        return h + jnp.tanh(h @ W + b)

    rng = np.random.default_rng(13)
    p = {"W": jnp.asarray(0.3 * rng.standard_normal((3, 4, 4))), "b": jnp.zeros((3, 4))}
    x = jnp.asarray(rng.standard_normal((5, 4)))
    slices = {"astype": lambda p, i: p["W"][i].astype(jnp.float64), "take": lambda p, i: jnp.take(p["W"], i, 0),
              "columns": lambda p, i: jnp.swapaxes(p["W"], 0, 1)[:, i]}

    def losses(p, x):
        h = jax.lax.fori_loop(0, 3, lambda i, h: block(slices[pick](p, i), p["b"][i], h), x)
        return jnp.sum(h ** 2, axis=1)

    with pytest.raises(ValueError, match=r"compute from the parameters or constants alone.*lax\.scan"):
        lbp.per_example_grads(losses, layers=block)(p, x)


def test_frozen_arrays_as_long_as_the_batch_are_read_as_tables():
    """Six frozen matrices whose leading axis equals the batch (4), read whole by a layer, and a
    frozen (4, 4) weight read only by a layer whose output nothing uses: which arguments are data is
    proved from the program (the 64-subset search never tried the one-leaf data subset with six
    such leaves, and the unused layer's weight was taken for data); per_example_grads and diag_ggn
    equal jax.jacrev's and the dense GGN's."""
    @lbp.layer
    def mixed(W, tables, h):
        return jnp.tanh(h @ (W + sum(tables) / 10.0))

    rng = np.random.default_rng(14)
    batch = 4
    W = jnp.asarray(0.5 * rng.standard_normal((batch, batch)))
    tables = tuple(jnp.asarray(rng.standard_normal((batch, batch))) for _ in range(6))
    unused = jnp.asarray(rng.standard_normal((batch, batch)))
    x = jnp.asarray(rng.standard_normal((batch, batch)))

    def losses(W, x, tables, unused):
        mixed(W, tables, x @ unused)  # a layer whose output nothing reads
        return jnp.sum(mixed(W, tables, x) ** 2, axis=1)

    close(lbp.per_example_grads(losses, layers=mixed)(W, x, tables, unused), jax.jacrev(losses)(W, x, tables, unused))
    mean = lambda *a: jnp.mean(losses(*a))
    out = lambda W: mixed(W, tables, x).reshape(-1)
    j = jax.jacfwd(out)(W).reshape(-1, W.size)
    h = jax.hessian(lambda o: jnp.mean(jnp.sum(o.reshape(batch, -1) ** 2, axis=1)))(out(W))
    close(lbp.diag_ggn(mean, layers=mixed)(W, x, tables, unused).reshape(-1), jnp.diag(j.T @ h @ j))
