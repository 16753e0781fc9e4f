"""clipped_grad and the ghost norms against jax.vmap(jax.grad) of the same per-example losses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree
from test_curvature import CASES, close

import linbackprop as lbp


def reference(losses, params, inputs, clip):
    """The DP-SGD sum from the per-example gradients themselves."""
    grads = jax.jit(jax.jacrev(losses))(params, *inputs)
    flat = jax.vmap(lambda g: ravel_pytree(g)[0])(grads)
    norms = jnp.linalg.norm(flat, axis=1)
    weights = jnp.minimum(1.0, clip / norms)
    return jax.tree.map(lambda g: jnp.einsum("b,b...->...", weights, g), grads), norms


@pytest.mark.users_settings
@pytest.mark.parametrize("name", ["rnn-rows", "transformer", "multi_input"])
def test_clipped_sum_and_norms_equal_the_per_example_gradients(name):
    """An RNN with its recurrent weight shared over the steps and Row("xs", t) reads, a
    transformer with tied embeddings (a gather and a product on one block), a block used twice
    in one layer. The norms alone of every case of tests/test_curvature.py (convolutions, stacked
    rows shared by two layers, two rows in one layer, an LSTM) are checked by its per-example
    test."""
    losses, params, inputs = CASES[name]
    norms_ref = reference(losses, params, inputs, 1.0)[1]
    clip = float(jnp.median(norms_ref))  # about half the examples clipped
    clipped, norms = jax.jit(lbp.clipped_grad(losses, clip))(params, *inputs)
    clipped_ref, _ = reference(losses, params, inputs, clip)
    np.testing.assert_allclose(norms, norms_ref, rtol=1e-10)
    close(clipped, clipped_ref, rtol=1e-9, atol=1e-11)


def dense_net(n=4, w=32, b=64, seed=0):
    rng = np.random.default_rng(seed)
    layers = [lbp.Layer(i, lambda th, u: u + jnp.tanh(u @ th[0] + th[1]), (i - 1,),
                        (lbp.Row("W", i - 1), lbp.Row("c", i - 1))) for i in range(1, n + 1)]
    net = lbp.Network([*layers, lbp.Layer("y", lambda th, u: u @ th[0], (n,), ("H",))], [0], "y")
    params = {"W": jnp.asarray(rng.standard_normal((n, w, w)) / w), "c": jnp.zeros((n, w)),
              "H": jnp.asarray(rng.standard_normal((w, 3)))}
    x = jnp.asarray(rng.standard_normal((b, w)))
    labels = jnp.asarray(rng.integers(0, 3, b))

    def losses(p, x, labels):
        return -jnp.take_along_axis(jax.nn.log_softmax(net(p, x), axis=1), labels[:, None], axis=1)[:, 0]

    return losses, params, (x, labels)


def test_dense_layers_form_no_per_example_gradient():
    """Ghost norms: the compiled clipped sum keeps no [batch, W] buffer (it would be b · W.nbytes)."""
    losses, params, inputs = dense_net()
    compiled = jax.jit(lbp.clipped_grad(losses, 0.5)).lower(params, *inputs).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < inputs[0].shape[0] * params["W"].nbytes / 4
    clipped, norms = compiled(params, *inputs)
    clipped_ref, norms_ref = reference(losses, params, inputs, 0.5)
    np.testing.assert_allclose(norms, norms_ref, rtol=1e-10)
    close(clipped, clipped_ref)


def test_layer_norm_and_a_weight_used_twice_in_one_layer_and_a_sequence():
    """A layer norm's scale (no outer product: formed per example), W used at every position of a
    sequence and twice in one layer (x W + tanh(x W) W: a sum of two outer products per position)."""
    rng = np.random.default_rng(3)
    B, T, D = 5, 4, 3

    def block(th, x):  # x: [B, T, D]
        W, g = th
        mean = x.mean(-1, keepdims=True)
        normed = (x - mean) / jnp.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-3) * g
        return x + normed @ W + jnp.tanh(normed @ W) @ W

    net = lbp.Network([lbp.Layer(i, block, (i - 1,), ("W", lbp.Row("g", i - 1))) for i in (1, 2)], [0], 2)
    params = {"W": jnp.asarray(0.5 * rng.standard_normal((D, D))),
              "g": jnp.asarray(1 + 0.1 * rng.standard_normal((2, D)))}
    x = jnp.asarray(rng.standard_normal((B, T, D)))
    losses = lambda p, x: jnp.sum(jnp.sin(net(p, x)), axis=(1, 2))
    clip = float(jnp.median(reference(losses, params, (x,), 1.0)[1]))
    clipped, norms = lbp.clipped_grad(losses, clip)(params, x)
    clipped_ref, norms_ref = reference(losses, params, (x,), clip)
    np.testing.assert_allclose(norms, norms_ref, rtol=1e-10)
    close(clipped, clipped_ref)
    np.testing.assert_allclose(lbp.per_example_grad_norms(losses)(params, x), norms_ref, rtol=1e-10)


def test_a_term_outside_the_network_and_several_arguments():
    """A per-example term of the parameters themselves: the norms are those of the whole gradient
    (formed per example there); argnums=(0, 1) clips over both arguments together."""
    losses, params, inputs = dense_net(n=2, w=4, b=6, seed=1)
    with_term = lambda p, x, labels: losses(p, x, labels) + 0.3 * jnp.sum(p["H"] ** 2) * jnp.arange(6.0)
    clipped, norms = jax.jit(lbp.clipped_grad(with_term, 0.7))(params, *inputs)
    clipped_ref, norms_ref = reference(with_term, params, inputs, 0.7)
    np.testing.assert_allclose(norms, norms_ref, rtol=1e-10)
    close(clipped, clipped_ref)

    x = inputs[0]
    two = lambda p, q, x, labels: losses({**p, "H": q}, x, labels)
    p, q = {k: v for k, v in params.items() if k != "H"}, params["H"]
    (cp, cq), norms = jax.jit(lbp.clipped_grad(two, 0.7, argnums=(0, 1)))(p, q, x, inputs[1])
    clipped_ref, norms_ref = reference(losses, params, inputs, 0.7)
    np.testing.assert_allclose(norms, norms_ref, rtol=1e-10)
    close({**cp, "H": cq}, clipped_ref)


def test_layers_that_mix_examples_and_bad_clips_are_refused():
    bn = lambda th, u: (u - u.mean(0)) / (u.std(0) + 1.0) @ th[0]
    net = lbp.Network([lbp.Layer("y", bn, ("x",), ("W",))], ["x"], "y")
    losses = lambda p, x: jnp.sum(net(p, x) ** 2, axis=1)
    p, x = {"W": jnp.ones((3, 2))}, jnp.asarray(np.random.default_rng(0).standard_normal((5, 3)))
    with pytest.raises(ValueError, match="mix examples"):
        lbp.clipped_grad(losses, 1.0)(p, x)
    with pytest.raises(ValueError, match="clip must be a positive norm"):
        lbp.clipped_grad(losses, 0.0)
    with pytest.raises(ValueError, match="one loss per example"):
        lbp.clipped_grad(lambda p, x: jnp.sum(losses(p, x)), 1.0)(p, x)


def test_a_model_as_it_is_with_layers():
    """An equinox-style plain JAX model found by layers=: the clipped sum in the argument's own
    structure, equal to the DP-SGD sum of jax.vmap(jax.grad)."""
    @lbp.layer
    def block(p, h):
        return h + jnp.tanh(h @ p["W"] + p["b"])

    rng = np.random.default_rng(4)
    params = {"blocks": [{"W": jnp.asarray(0.4 * rng.standard_normal((3, 3))), "b": jnp.zeros(3)} for _ in range(3)],
              "head": jnp.asarray(rng.standard_normal((3, 2)))}

    def losses(params, x, y):
        h = x
        for p in params["blocks"]:
            h = block(p, jnp.sin(h))
        return jnp.sum((h @ params["head"] - y) ** 2, axis=1)

    x, y = jnp.asarray(rng.standard_normal((6, 3))), jnp.asarray(rng.standard_normal((6, 2)))
    clipped, norms = lbp.clipped_grad(losses, 1.0, layers=block)(params, x, y)
    clipped_ref, norms_ref = reference(losses, params, (x, y), 1.0)
    np.testing.assert_allclose(norms, norms_ref, rtol=1e-10)
    close(clipped, clipped_ref)


def _head_after_the_network(form, head_form):
    """Three residual blocks — in a lax.scan named in layers= (``form="layers"``), or a Network of
    Row blocks — and a head after them in the losses, in one of three forms: as written (each
    example's gradient from its own rows), with the batch written into a reshape (only a Network:
    layers= refuses it; the losses cannot run on one example's rows, so the batch's Jacobian), and
    reading a frozen argument whose leading axis is the batch as a table (proved not read by row:
    passed whole to each example's losses)."""
    @lbp.layer
    def block(W, b, h):
        return h + jnp.tanh(h @ W + b)

    net = lbp.Network([lbp.Layer(i + 1, lambda th, h: block(*th, h), (i,), (lbp.Row("W", i), lbp.Row("b", i)))
                       for i in range(3)], [0], 3)
    rng = np.random.default_rng(7)
    batch, width, classes = 4, 3, 2
    params = {"W": jnp.asarray(0.4 * rng.standard_normal((3, width, width))), "b": jnp.asarray(
        0.1 * rng.standard_normal((3, width))), "head": jnp.asarray(rng.standard_normal((width, classes)))}
    x, labels = jnp.asarray(rng.standard_normal((batch, width))), jnp.asarray(rng.integers(0, classes, batch))
    frozen = jnp.asarray(rng.standard_normal((batch, classes)))  # a table of 4 rows, not the examples

    def losses(params, x, labels, frozen):
        if form == "layers":
            h, _ = jax.lax.scan(lambda h, wb: (block(wb[0], wb[1], h), None), x, (params["W"], params["b"]))
        else:
            h = net(params, x)
        logits = h @ params["head"]
        if head_form == "reshape":
            logits = logits.reshape(batch, classes)
        if head_form == "frozen":
            logits = logits + frozen[0]  # every example reads the table's first row
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(logp, labels[:, None], axis=1)[:, 0]

    return losses, (block if form == "layers" else None), params, (x, labels, frozen)


@pytest.mark.parametrize(("form", "head_form", "one_example"),
                         [("layers", "as-written", True), ("layers", "frozen", True),
                          ("network", "as-written", True), ("network", "reshape", False)])
def test_a_head_after_the_network_from_each_examples_rows(form, head_form, one_example, monkeypatch):
    """The per-example gradients of a head the losses apply after the network come from each
    example's own rows of the outputs and the data (one batched backward pass) where the losses
    run on one example — checked on the real values inside the program — and from the batch's
    Jacobian where they do not; the norms and the clipped sum equal jax.vmap(jax.grad)'s either
    way, under jax.jit."""
    from linbackprop._curvature import _per_example

    taken = []
    original = _per_example.one_example_losses
    monkeypatch.setattr(_per_example, "one_example_losses",
                        lambda *a: taken.append(original(*a)) or taken[-1])
    losses, layers, params, inputs = _head_after_the_network(form, head_form)
    norms_ref = reference(losses, params, inputs, 1.0)[1]
    clip = float(jnp.median(norms_ref))
    clipped, norms = jax.jit(lbp.clipped_grad(losses, clip, layers=layers))(params, *inputs)
    clipped_ref, _ = reference(losses, params, inputs, clip)
    np.testing.assert_allclose(norms, norms_ref, rtol=1e-10)
    close(clipped, clipped_ref)
    np.testing.assert_allclose(jax.jit(lbp.per_example_grad_norms(losses, layers=layers))(params, *inputs),
                               norms_ref, rtol=1e-10)
    assert taken and all((each is not None) == one_example for each in taken)


@pytest.mark.parametrize(("stored", "chunk"), [(True, None), (True, 1), (True, 2), (False, 2)],
                         ids=["stored-residuals", "chunks-of-1", "chunks-of-2", "linearised-again"])
def test_operands_from_the_stored_residuals_or_linearised_again(stored, chunk, monkeypatch):
    """Each layer's per-example operands come from the forward pass's stored residuals and
    outputs where the layer linearised on one example has the same residuals (here: tanh′ from
    the stored state), else (forced here) from the layer linearised again on each example. With
    ``chunk``, the norms and the clipped sum go in a loop over chunks of that many examples (3
    examples: chunks of 2 repeat the last one, which must count once)."""
    import dataclasses

    from linbackprop._engine import _per_example
    from linbackprop._options._policy import Policy
    from linbackprop._options._settings import Settings, using

    @dataclasses.dataclass(frozen=True)
    class Chunks(Policy):
        def norm_chunk(self, batch, example_bytes):
            return batch if chunk is None else chunk

    found = []
    original = _per_example._example_residuals
    monkeypatch.setattr(_per_example, "_example_residuals",
                        lambda *a: found.append(original(*a) if stored else None) or found[-1])
    losses, params, inputs = CASES["rnn-rows"]
    clip = float(jnp.median(reference(losses, params, inputs, 1.0)[1]))
    with using(Settings(policy=Chunks())):
        clipped, norms = jax.jit(lbp.clipped_grad(losses, clip))(params, *inputs)
        norms_alone = jax.jit(lbp.per_example_grad_norms(losses))(params, *inputs)
    clipped_ref, norms_ref = reference(losses, params, inputs, clip)
    np.testing.assert_allclose(norms, norms_ref, rtol=1e-10)
    np.testing.assert_allclose(norms_alone, norms_ref, rtol=1e-10)
    close(clipped, clipped_ref, rtol=1e-9, atol=1e-11)
    assert found and all((f is not None) == stored for f in found)


def test_norm_chunks_keep_under_the_budget_and_divide_the_batch():
    from linbackprop._options._policy import Policy

    policy = Policy(norm_chunk_bytes=1000)
    assert policy.norm_chunk(64, 10) == 64  # all at once
    assert policy.norm_chunk(64, 100) == 8  # 10 fit: 8 chunks of 8, none repeated
    assert policy.norm_chunk(7, 300) == 3  # 3 fit, 7 is prime: 3 chunks of 3, the last repeats one twice
    assert policy.norm_chunk(5, 10**6) == 1


def test_a_residual_whose_batch_axis_is_not_first_is_linearised_again(monkeypatch):
    """tanh(W uᵀ)ᵀ stores tanh(W uᵀ) [width, batch]: on one example it is [width, 1], not a row
    of the stored one, so that layer's operands come from its linearisation on each example."""
    from linbackprop._engine import _per_example

    found = []
    original = _per_example._example_residuals
    monkeypatch.setattr(_per_example, "_example_residuals",
                        lambda *a: found.append(original(*a)) or found[-1])
    rng = np.random.default_rng(5)
    net = lbp.Network([lbp.Layer("h", lambda th, u: jnp.tanh(th[0] @ u.T).T, ("x",), ("W",)),
                       lbp.Layer("y", lambda th, u: u @ th[0], ("h",), ("V",))], ["x"], "y")
    params = {"W": jnp.asarray(rng.standard_normal((4, 4))), "V": jnp.asarray(rng.standard_normal((4, 2)))}
    x = jnp.asarray(rng.standard_normal((6, 4)))
    losses = lambda p, x: jnp.sum(net(p, x) ** 2, axis=1)
    clipped, norms = jax.jit(lbp.clipped_grad(losses, 1.0))(params, x)
    clipped_ref, norms_ref = reference(losses, params, (x,), 1.0)
    np.testing.assert_allclose(norms, norms_ref, rtol=1e-10)
    close(clipped, clipped_ref, rtol=1e-9, atol=1e-11)
    assert len(found) == 2 and sum(f is None for f in found) == 1
