"""flax (nnx, linen) and equinox modules as layers via lbp.functional: gradients equal jax.grad's of
the plain model, come back in the framework's own pytree and go straight into optax."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from trees import assert_trees_close

import linbackprop as lbp

eqx = pytest.importorskip("equinox", reason="pip install 'linbackprop[test]' installs equinox")
nnx = pytest.importorskip("flax.nnx", reason="pip install 'linbackprop[test]' installs flax")
nn = pytest.importorskip("flax.linen")

D, DEPTH, B = 6, 4, 3


def close(a, b, tol=1e-10):  # this file's tolerance, the one tree comparison
    assert_trees_close(a, b, rtol=tol, atol=tol)


def chain(embed, blocks, head, depth=DEPTH):
    """x → embed → depth Row-stacked blocks → head (reads the embedding too: a skip)."""
    layers = [lbp.Layer("e", embed.layer, ("x",), ("embed",))]
    layers += [lbp.Layer(i, blocks.layer, (i - 1 if i else "e",), (lbp.Row("blocks", i),)) for i in range(depth)]
    layers.append(lbp.Layer("y", lambda th, h, e: head.apply(th[0], h + e), (depth - 1, "e"), ("head",)))
    return lbp.Network(layers, ["x"], "y")


def reference(embed, blocks, head):
    """The same model as plain JAX: lax.scan over the stacked blocks."""

    def forward(p, x):
        e = embed.apply(p["embed"], x)
        h, _ = jax.lax.scan(lambda h, row: (blocks.apply(row, h), None), e, p["blocks"])
        return head.apply(p["head"], h + e)

    return forward


def check(embed, blocks, head, x):
    net = chain(embed, blocks, head)
    params = {"embed": embed.params, "blocks": blocks.params, "head": head.params}
    forward = reference(embed, blocks, head)
    loss = lambda p, x: jnp.sum(jnp.sin(net(p, x)))
    close(net(params, x), forward(params, x))
    grads = lbp.grad_by_solve(loss)(params, x)
    close(grads, jax.grad(lambda p, x: jnp.sum(jnp.sin(forward(p, x))))(params, x))
    optimizer = optax.adam(1e-2)
    updates, _ = optimizer.update(grads, optimizer.init(params), params)
    return net, optax.apply_updates(params, updates)


class EqxEmbed(eqx.Module):
    linear: eqx.nn.Linear

    def __init__(self, key):
        self.linear = eqx.nn.Linear(3, D, key=key)

    def __call__(self, x):
        return jax.vmap(self.linear)(x)


def scaled_tanh(h):  # a field that is not an array: equinox.partition keeps it out of the params
    return 0.9 * jnp.tanh(h)


class EqxBlock(eqx.Module):
    linear: eqx.nn.Linear
    norm: eqx.nn.LayerNorm
    activation: object

    def __init__(self, key):
        self.linear, self.norm = eqx.nn.Linear(D, D, key=key), eqx.nn.LayerNorm(D)
        self.activation = scaled_tanh

    def __call__(self, h):
        return h + self.activation(jax.vmap(self.linear)(jax.vmap(self.norm)(h)))


class EqxHead(eqx.Module):
    linear: eqx.nn.Linear

    def __init__(self, key):
        self.linear = eqx.nn.Linear(D, 2, key=key)

    def scores(self, h):  # called through method="scores"
        return jax.vmap(self.linear)(h) ** 2


def test_equinox_modules_and_filter_vmap_stacked_blocks():
    keys = jax.random.split(jax.random.PRNGKey(0), DEPTH + 3)
    embed = lbp.functional(EqxEmbed(keys[0]))
    blocks = lbp.functional(eqx.filter_vmap(EqxBlock)(keys[3:]))
    head = lbp.functional(EqxHead(keys[1]), method="scores")
    _, trained = check(embed, blocks, head, jax.random.normal(keys[2], (B, 3)))
    assert blocks.layer.__name__ == "EqxBlock"  # the name plot_network's legend and errors show
    assert isinstance(trained["blocks"], EqxBlock) and trained["blocks"].linear.weight.shape == (DEPTH, D, D)
    model = blocks.rebuild(trained["blocks"])  # the trained stack as an equinox module again
    assert model.activation is scaled_tanh and model.linear.in_features == D


class NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.linear, self.norm = nnx.Linear(D, D, rngs=rngs), nnx.LayerNorm(D, rngs=rngs)

    def __call__(self, h):
        return h + jnp.tanh(self.linear(self.norm(h)))


class NnxHead(nnx.Module):
    """Batch statistics besides parameters: held fixed (evaluation mode)."""

    def __init__(self, rngs):
        self.norm = nnx.BatchNorm(D, use_running_average=True, rngs=rngs)
        self.linear = nnx.Linear(D, 2, rngs=rngs)

    def __call__(self, h):
        return self.linear(self.norm(h))


def test_flax_nnx_modules_and_nnx_vmap_stacked_blocks():
    keys = jax.random.split(jax.random.PRNGKey(1), DEPTH + 1)
    stack = nnx.vmap(lambda key: NnxBlock(nnx.Rngs(key)))(keys[1:])
    head_module = NnxHead(nnx.Rngs(2))
    head_module.norm.mean.set_value(jnp.arange(D) / D)  # non-trivial statistics, not differentiated
    embed, blocks, head = (lbp.functional(m) for m in (nnx.Linear(3, D, rngs=nnx.Rngs(0)), stack, head_module))
    assert isinstance(blocks.params, nnx.State) and set(head.params["norm"]) == {"scale", "bias"}
    _, trained = check(embed, blocks, head, jax.random.normal(keys[0], (B, 3)))
    assert isinstance(trained["blocks"], nnx.State)
    rebuilt = head.rebuild(trained["head"])  # an nnx module with the trained parameters
    np.testing.assert_allclose(rebuilt.linear.kernel.get_value(), trained["head"]["linear"]["kernel"].get_value())
    np.testing.assert_allclose(rebuilt.norm.mean.get_value(), jnp.arange(D) / D)


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, h):
        return h + jnp.tanh(nn.Dense(D)(nn.LayerNorm()(h)))


def test_flax_linen_modules_and_vmapped_init():
    keys = jax.random.split(jax.random.PRNGKey(2), DEPTH + 3)
    x, h = jax.random.normal(keys[0], (B, 3)), jnp.zeros((B, D))
    embed = lbp.functional(nn.Dense(D), nn.Dense(D).init(keys[1], x))
    stacked = jax.vmap(lambda k: LinenBlock().init(k, h))(keys[3:])
    blocks = lbp.functional(LinenBlock(), stacked)
    head = lbp.functional(nn.Dense(2), nn.Dense(2).init(keys[2], h))
    _, trained = check(embed, blocks, head, x)
    assert trained["blocks"]["Dense_0"]["kernel"].shape == (DEPTH, D, D)
    assert set(blocks.rebuild(trained["blocks"])) == {"params"}


def test_functional_errors_name_the_fix():
    with pytest.raises(TypeError, match="linen module: pass its variables"):
        lbp.functional(nn.Dense(2))
    with pytest.raises(TypeError, match="only linen modules take variables"):
        lbp.functional(EqxHead(jax.random.PRNGKey(0)), {"params": {}})
    with pytest.raises(TypeError, match="got builtins.dict"):
        lbp.functional({"W": jnp.ones(2)})


class NnxAttentionWithDropout(nnx.Module):
    """A call that mutates state (the dropout stream's count) and an nnx attention layer."""

    def __init__(self, rngs):
        self.attention = nnx.MultiHeadAttention(num_heads=2, in_features=D, decode=False, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.dropout(self.attention(x))


def test_nnx_dropout_draws_a_fresh_mask_from_each_key_and_never_a_held_one():
    """A module whose call advances its RNG streams: ``layer`` raises (a pure layer function would
    hold one mask for every call), ``keyed_layer`` reseeds the streams from a key read as a state
    (as ``nnx.reseed`` with ``fold_in(key, n)``): the output and the gradient are the nnx call's
    and ``nnx.grad``'s after that reseeding, and another key draws another mask."""
    model = NnxAttentionWithDropout(nnx.Rngs(0, dropout=1))
    blocks = lbp.functional(model)
    x = jax.random.normal(jax.random.PRNGKey(3), (B, 5, D))
    held = lbp.Network([lbp.Layer("y", blocks.layer, ("x",), ("attention",))], ["x"], "y")
    with pytest.raises(TypeError, match="draws random numbers.*keyed_layer.*model.eval"):
        held({"attention": blocks.params}, x)
    with pytest.raises(TypeError, match="draws random numbers"):
        lbp.grad_by_solve(lambda p, x: jnp.sum(held(p, x)))({"attention": blocks.params}, x)
    net = lbp.Network([lbp.Layer("y", blocks.keyed_layer, ("key", "x"), ("attention",))], ["key", "x"], "y")
    loss = lambda p, key, x: jnp.sum(jnp.sin(net(p, key, x)))
    params = {"attention": blocks.params}

    masks = []
    for seed in (5, 6):
        key = jax.random.key(seed)
        copy = nnx.clone(model)
        nnx.reseed(copy, dropout=jax.random.fold_in(key, 0))
        close(net(params, key, x), copy(x), tol=1e-6)
        copy = nnx.clone(model)
        nnx.reseed(copy, dropout=jax.random.fold_in(key, 0))
        expected = nnx.grad(lambda m: jnp.sum(jnp.sin(m(x))))(copy)
        # nnx makes float32 parameters even under x64: float32 rounding
        close(jax.jit(lbp.grad_by_solve(loss))(params, key, x)["attention"], expected, tol=1e-5)
        masks.append(net(params, key, x) == 0)
    assert jnp.any(masks[0]) and jnp.any(masks[0] != masks[1])  # dropout applied, another key another mask
    assert [int(c) for c in jax.tree.leaves(nnx.state(model, nnx.RngCount))] == [0]  # the model is untouched


def test_linen_dropout_asks_for_a_key_and_draws_from_it():
    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dropout(0.5, deterministic=False)(nn.Dense(D)(x))

    module, x = Block(), jnp.ones((B, D))
    variables = module.init(jax.random.PRNGKey(0), x)
    blocks = lbp.functional(module, variables)
    with pytest.raises(TypeError, match="draws random numbers.*keyed_layer"):
        blocks.apply(blocks.params, x)
    key = jax.random.key(7)
    net = lbp.Network([lbp.Layer("y", blocks.keyed_layer, ("key", "x"), ("block",))], ["key", "x"], "y")
    plain = lambda p: jnp.sum(jnp.sin(module.apply({"params": p}, x, rngs={"dropout": jax.random.fold_in(key, 0)})))
    close(lbp.grad_by_solve(lambda p: jnp.sum(jnp.sin(net({"block": p}, key, x))))(blocks.params), jax.grad(plain)(
        blocks.params))
    assert jnp.any(net({"block": blocks.params}, key, x) != net({"block": blocks.params}, jax.random.key(8), x))


class NnxModel(nnx.Module):
    """The flax pattern for deep models: blocks stacked with nnx.vmap, run with nnx.scan."""

    def __init__(self, rngs):
        self.embed = nnx.Linear(3, D, rngs=rngs)
        self.blocks = nnx.vmap(lambda key: NnxBlock(nnx.Rngs(key)))(jax.random.split(rngs.params(), DEPTH))
        self.head = nnx.Linear(D, 2, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(h, block):
            return block(h)

        return self.head(run(self.embed(x), self.blocks))


def test_a_whole_nnx_model_state_is_the_params_and_nnx_optimizer_takes_the_gradient():
    """nnx.split(model, nnx.Param) is a Mapping of the submodules' states: used as the network's
    params, the gradient is an nnx.State shaped like nnx.grad's, for nnx.Optimizer.update."""
    model = NnxModel(nnx.Rngs(4))
    _, params = nnx.split(model, nnx.Param)
    embed, blocks, head = (lbp.functional(m) for m in (model.embed, model.blocks, model.head))
    layers = [lbp.Layer("e", embed.layer, ("x",), ("embed",))]
    layers += [lbp.Layer(i, blocks.layer, (i - 1 if i else "e",), (lbp.Row("blocks", i),)) for i in range(DEPTH)]
    layers.append(lbp.Layer("y", head.layer, (DEPTH - 1,), ("head",)))
    net = lbp.Network(layers, ["x"], "y")
    x = jax.random.normal(jax.random.PRNGKey(5), (B, 3))
    grads = lbp.grad_by_solve(lambda p: jnp.sum(jnp.sin(net(p, x))))(params)
    close(grads, nnx.grad(lambda m: jnp.sum(jnp.sin(m(x))))(model), tol=1e-5)  # nnx: float32 parameters
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    kernel = model.head.kernel.get_value()
    optimizer.update(model, grads)
    np.testing.assert_allclose(model.head.kernel.get_value(), kernel - 0.1 * grads["head"]["kernel"].get_value(),
                               rtol=1e-6)
