"""K-FAC factors against plain-JAX references: for one example and one use of each weight they
are the GGN block itself (jax.jacfwd and jax.hessian); for a batch, for weights shared along a
sequence and for positions of a sequence, they are the K-FAC "expand" sums A = (1/N) Σ x xᵀ and
Γ = Σ Jᵀ H J over the examples and uses, J the Jacobian of the outputs w.r.t. each use's product
(perturbations added to the products of a plain-JAX copy of the network), and the "reduce" sums
of each example's uses summed first."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree
from trees import assert_bias_of, assert_trees_close

import linbackprop as lbp

close = functools.partial(assert_trees_close, rtol=1e-8, atol=1e-10)  # this file's tolerances


def xent(logits, labels):
    return -jnp.sum(jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), labels[:, None], axis=-1))


# -- an MLP: Row-stacked hidden layers, a head, and a layer with the weight on the left ---------------
DEPTH, WIDTH, CLASSES = 2, 4, 3


def mlp(perturb=None):
    """Layers u ↦ tanh(u W_i + b_i) (W_i a Row), u ↦ tanh(V uᵀ)ᵀ (weight on the left), u ↦ u H.
    ``perturb``: None for the Network; else a plain function of (params, x, e) with e added to
    each product (the points whose Jacobian gives K-FAC's Γ)."""
    hidden = lambda th, u: jnp.tanh(u @ th[0] + th[1])
    left = lambda th, u: jnp.tanh(jnp.einsum("ij,bj->bi", th[0], u))
    head = lambda th, u: u @ th[0]
    if perturb is None:
        layers = [lbp.Layer(i, hidden, (i - 1,), (lbp.Row("W", i - 1), lbp.Row("b", i - 1)))
                  for i in range(1, DEPTH + 1)]
        layers += [lbp.Layer("left", left, (DEPTH,), ("V",)), lbp.Layer("y", head, ("left",), ("H",))]
        return lbp.Network(layers, [0], "y")

    def plain(p, x, e):
        u, inputs = x, {}
        for i in range(DEPTH):
            inputs[("W", i)] = u
            u = jnp.tanh(u @ p["W"][i] + e[("W", i)] + p["b"][i])
        inputs["V"] = u
        u = jnp.tanh(jnp.einsum("ij,bj->bi", p["V"], u) + e["V"])
        inputs["H"] = u
        return u @ p["H"] + e["H"], inputs

    return plain


def mlp_params(seed=0):
    rng = np.random.default_rng(seed)
    r = lambda *s: jnp.asarray(0.7 * rng.standard_normal(s))
    return {"W": r(DEPTH, WIDTH, WIDTH), "b": r(DEPTH, WIDTH), "V": r(WIDTH, WIDTH), "H": r(WIDTH, CLASSES)}


def expand_reference(plain, params, x, losses, products):
    """A = (1/N) Σ x xᵀ and Γ = Σ_b Jᵀ H_b J per product (name → output width), from plain JAX."""
    zeros = {name: jnp.zeros((x.shape[0], width)) for name, width in products.items()}
    outs, inputs = plain(params, x, zeros)
    out = {}
    for name in products:
        a = inputs[name]
        jac = jax.vmap(lambda xb, name=name: jax.jacfwd(lambda e: plain(params, xb[None], {
            **{n: jnp.zeros((1, w)) for n, w in products.items()}, name: e[None]})[0][0])(jnp.zeros(products[name])))(x)
        hess = jax.vmap(lambda o, b: jax.hessian(lambda o: losses(o[None], b))(o))(outs, jnp.arange(x.shape[0]))
        gamma = jnp.einsum("bci,bcd,bdj->ij", jac, hess, jac)
        if name[0] == "W":  # tanh(u W_i + b_i): the bias in W_i's block, a column of ones beside u
            a = jnp.concatenate([a, jnp.ones((a.shape[0], 1))], axis=1)
        out[name] = (a.T @ a / a.shape[0], gamma)
    return out


@pytest.mark.parametrize("jit", [False, True])
def test_one_example_factors_are_the_ggn_blocks(jit):
    """One example, every weight used once: A ⊗ Γ is the GGN block exactly (jacfwd, hessian)."""
    net, params = mlp(), mlp_params()
    x = jnp.asarray(np.random.default_rng(1).standard_normal((1, WIDTH)))
    labels = jnp.array([2])
    loss = lambda p, x: xent(net(p, x), labels)
    factors = (jax.jit(lbp.kfac_factors(loss)) if jit else lbp.kfac_factors(loss))(params, x)
    assert_bias_of(factors, "b", "['W']", "left")  # in W's block: [W_i; b_i], the inputs with a ones column
    flat, unravel = ravel_pytree(params)
    jac = jax.jacfwd(lambda v: net(unravel(v), x).ravel())(flat)
    ggn = jac.T @ jax.hessian(lambda o: xent(o.reshape(1, -1), labels))(net(params, x).ravel()) @ jac
    offsets = np.cumsum([0] + [a.size for a in jax.tree.leaves(params)])
    at = dict(zip(sorted(params), offsets[:-1]))  # ravel_pytree: leaves in sorted key order
    for name in ("H", "V"):
        block = ggn[at[name]:at[name] + params[name].size, at[name]:at[name] + params[name].size]
        close(jnp.kron(factors[name].left, factors[name].right), block)
    for i in range(DEPTH):  # [W_i; b_i] row-major: W_i's entries, then b_i's
        index = np.concatenate([at["W"] + i * WIDTH * WIDTH + np.arange(WIDTH * WIDTH), at["b"] + i * WIDTH
                                + np.arange(WIDTH)])
        close(jnp.kron(factors["W"].left[i], factors["W"].right[i]), ggn[np.ix_(index, index)])


@pytest.mark.parametrize("engine", ["loop", "unrolled"])
def test_batch_factors_are_the_expand_sums(engine):
    """A batch: A = (1/B) Σ_b a_b a_bᵀ, Γ = Σ_b J_bᵀ H_b J_b per weight (the weight on the left:
    the factors in the order of its axes, Γ first)."""
    net, plain, params = mlp(), mlp(perturb=True), mlp_params(2)
    rng = np.random.default_rng(3)
    x, labels = jnp.asarray(rng.standard_normal((5, WIDTH))), jnp.asarray(rng.integers(0, CLASSES, 5))
    loss = lambda p, x: xent(net(p, x), labels)
    factors = jax.jit(lbp.kfac_factors(loss, engine=engine))(params, x)
    products = {("W", 0): WIDTH, ("W", 1): WIDTH, "V": WIDTH, "H": CLASSES}
    ref = expand_reference(plain, params, x, lambda o, b: xent(o, labels[b][None]), products)
    for i in range(DEPTH):
        close(factors["W"].left[i], ref[("W", i)][0])
        close(factors["W"].right[i], ref[("W", i)][1])
    close(factors["H"].left, ref["H"][0])
    close(factors["H"].right, ref["H"][1])
    close(factors["V"].left, ref["V"][1])  # V uᵀ: V's rows are the outputs
    close(factors["V"].right, ref["V"][0])


def test_weights_shared_along_a_sequence_sum_every_step():
    """An RNN h_t = tanh(h_{t-1} A + x_t B + c), x_t read as Row("xs", t): A's factors sum over
    the examples and the steps (N = B T), Γ over the columns of H and the steps."""
    rng = np.random.default_rng(4)
    T, B, D, W = 4, 3, 2, 3
    cell = lambda th, h, x: jnp.tanh(h @ th[0] + x @ th[1] + th[2])
    net = lbp.Network([lbp.Layer(t, cell, (t - 1, lbp.Row("xs", t - 1)), ("A", "B", "c")) for t in range(1, T + 1)],
                      [0, "xs"], T)
    params = {"A": jnp.asarray(0.6 * rng.standard_normal((W, W))), "B": jnp.asarray(rng.standard_normal((D, W))),
              "c": jnp.asarray(0.1 * rng.standard_normal(W))}
    h0, xs = jnp.asarray(rng.standard_normal((B, W))), jnp.asarray(rng.standard_normal((T, B, D)))
    loss = lambda p, h0, xs: 0.5 * jnp.sum(jnp.sin(net(p, h0, xs)) ** 2)
    factors = jax.jit(lbp.kfac_factors(loss))(params, h0, xs)
    # c is added after two products (h A + x B): no one weight's bias, its GGN diagonal instead
    diagonal = jax.jit(lbp.diag_ggn(loss))(params, h0, xs)
    close(factors["c"], diagonal["c"])

    def plain(p, h0, xs, e):  # e[t]: added to step t's products (A's and B's: one sum)
        h, seen = h0, []
        for t in range(T):
            seen.append(h)
            h = jnp.tanh(h @ p["A"] + xs[t] @ p["B"] + e[t] + p["c"])
        return h, jnp.stack(seen)

    out, hs = plain(params, h0, xs, jnp.zeros((T, B, W)))
    hess = jax.vmap(jax.hessian(lambda o: 0.5 * jnp.sum(jnp.sin(o) ** 2)))(out)  # [B, W, W]
    jac = jax.vmap(lambda h, x: jax.jacfwd(lambda e: plain(params, h[None], x[:, None], e[:, None])[0][0])(
        jnp.zeros((T, W))))(h0, jnp.swapaxes(xs, 0, 1))  # [B, W(out), T, W(e)]
    gamma = jnp.einsum("bctx,bcd,bdty->xy", jac, hess, jac)
    close(factors["A"].left, jnp.einsum("tbi,tbj->ij", hs, hs) / (B * T))
    close(factors["A"].right, gamma)
    close(factors["B"].left, jnp.einsum("tbi,tbj->ij", xs, xs) / (B * T))
    close(factors["B"].right, gamma)
    # "reduce": each example's steps summed first, A = (1/(B T²)) Σ_b h̄_b h̄_bᵀ, Γ = Σ_b J̄_bᵀ H_b J̄_b
    reduced = jax.jit(lbp.kfac_factors(loss, approximation="reduce"))(params, h0, xs)
    jac_sum = jac.sum(axis=2)  # [B, W(out), W(e)]: the steps' perturbations summed
    gamma_sum = jnp.einsum("bcx,bcd,bdy->xy", jac_sum, hess, jac_sum)
    close(reduced["A"].left, jnp.einsum("bi,bj->ij", hs.sum(0), hs.sum(0)) / (B * T * T))
    close(reduced["A"].right, gamma_sum)
    close(reduced["B"].left, jnp.einsum("bi,bj->ij", xs.sum(0), xs.sum(0)) / (B * T * T))
    close(reduced["B"].right, gamma_sum)
    close(reduced["c"], diagonal["c"])
    with pytest.raises(ValueError, match="approximation='mean'"):
        lbp.kfac_factors(loss, approximation="mean")


def test_positions_of_a_sequence_are_summed_and_tied_embeddings_take_their_diagonal():
    """A transformer block reads [B, L, E] states: its weights' factors sum the L positions; the
    tied embedding (a gather in one layer, a product in another) and the LayerNorm-free position
    table get None."""
    rng = np.random.default_rng(5)
    V, L, E, B = 7, 4, 6, 3
    embed = lambda th, ids: th[0][ids] + th[1]
    mlp_block = lambda th, h: h + jnp.tanh(h @ th[0])
    unembed = lambda th, h: h @ th[0].T
    net = lbp.Network([lbp.Layer("h0", embed, ("ids",), ("emb", "pos")),
                       lbp.Layer("h1", mlp_block, ("h0",), ("M",)),
                       lbp.Layer("logits", unembed, ("h1",), ("emb",))], ["ids"], "logits")
    r = lambda *shape: jnp.asarray(0.5 * rng.standard_normal(shape))
    params = {"emb": r(V, E), "pos": r(L, E), "M": r(E, E)}
    ids, targets = jnp.asarray(rng.integers(0, V, (B, L))), jnp.asarray(rng.integers(0, V, (B, L)))

    def loss(p, ids):
        logp = jax.nn.log_softmax(net(p, ids), axis=-1)
        return -jnp.sum(jnp.take_along_axis(logp, targets[..., None], axis=-1))

    factors = jax.jit(lbp.kfac_factors(loss))(params, ids)
    diagonal = jax.jit(lbp.diag_ggn(loss))(params, ids)  # a gather and a product: their GGN diagonal
    close(factors["emb"], diagonal["emb"])
    close(factors["pos"], diagonal["pos"])

    def plain(p, ids, e):
        h0 = p["emb"][ids] + p["pos"]
        h1 = h0 + jnp.tanh(h0 @ p["M"] + e)
        return h1 @ p["emb"].T, h0

    logits, h0 = plain(params, ids, jnp.zeros((B, L, E)))
    per_example = lambda o, t: -jnp.sum(jnp.take_along_axis(jax.nn.log_softmax(o, axis=-1), t[..., None], axis=-1))
    hess = jax.vmap(jax.hessian(per_example))(logits, targets)  # [B, L, V, L, V]
    jac = jax.vmap(lambda i: jax.jacfwd(lambda e: plain(params, i[None], e[None])[0][0])(jnp.zeros((L, E))))(ids)
    close(factors["M"].left, jnp.einsum("bli,blj->ij", h0, h0) / (B * L))
    # Γ = Σ_b Σ_t J_btᵀ H_b J_bt, J_bt the outputs' Jacobian w.r.t. position t's product (each
    # position its own use; jac: [B, L(out), V, L(e), E], hess: [B, L, V, L, V]).
    close(factors["M"].right, jnp.einsum("bpvtx,bpvqw,bqwty->xy", jac, hess, jac))
    # "reduce": the positions summed per example before the products
    reduced = jax.jit(lbp.kfac_factors(loss, approximation="reduce"))(params, ids)
    close(reduced["emb"], diagonal["emb"])
    close(reduced["M"].left, jnp.einsum("bi,bj->ij", h0.sum(1), h0.sum(1)) / (B * L * L))
    close(reduced["M"].right, jnp.einsum("bpvx,bpvqw,bqwy->xy", jac.sum(3), hess, jac.sum(3)))


def test_monte_carlo_factors_estimate_the_exact_ones():
    net, params = mlp(), mlp_params(6)
    rng = np.random.default_rng(7)
    x, labels = jnp.asarray(rng.standard_normal((6, WIDTH))), jnp.asarray(rng.integers(0, CLASSES, 6))
    loss = lambda p, x: xent(net(p, x), labels)
    exact = lbp.kfac_factors(loss)(params, x)["H"]
    estimate = jax.jit(lbp.kfac_factors(loss, samples=400, key=jax.random.key(0)))(params, x)["H"]
    close(estimate.left, exact.left)  # the λ-free factor is the same
    assert float(jnp.linalg.norm(estimate.right - exact.right) / jnp.linalg.norm(exact.right)) < 0.15
    with pytest.raises(ValueError, match="PRNG key"):
        lbp.kfac_factors(loss, samples=2)(params, x)


def test_parameters_transformed_before_the_network_are_refused():
    net, params = mlp(), mlp_params()
    x, labels = jnp.ones((2, WIDTH)), jnp.array([0, 1])
    with pytest.raises(NotImplementedError, match="one parameter block"):
        lbp.kfac_factors(lambda p, x: xent(net(jax.tree.map(lambda a: 2.0 * a, p), x), labels))(params, x)
    with pytest.raises(ValueError, match="scalar loss"):
        lbp.kfac_factors(lambda p, x: net(p, x).sum(axis=1))(params, x)


def test_factors_under_vmap_over_an_ensemble():
    net, params = mlp(), mlp_params(8)
    rng = np.random.default_rng(9)
    x, labels = jnp.asarray(rng.standard_normal((4, WIDTH))), jnp.asarray(rng.integers(0, CLASSES, 4))
    loss = lambda p, x: xent(net(p, x), labels)
    stacked = jax.tree.map(lambda a: jnp.stack([a, 0.7 * a]), params)
    batched = jax.vmap(lambda p: lbp.kfac_factors(loss)(p, x))(stacked)
    for n in range(2):
        one = lbp.kfac_factors(loss)(jax.tree.map(lambda a, n=n: a[n], stacked), x)
        for name in ("W", "V", "H"):
            close(batched[name].left[n], one[name].left)
            close(batched[name].right[n], one[name].right)
        assert batched["b"] == one["b"]
        assert_bias_of(one, "b", "['W']", "left")


def test_an_example_with_too_many_output_coordinates_is_refused_before_it_runs_out_of_memory(monkeypatch):
    """H is one dense block per example: a sequence model's example (positions × vocabulary
    coordinates) made blocks of several GiB and the process was killed. The transforms take a
    block per position where the loss is a sum over positions (here 1 × 1: exactly G's block),
    and refuse over the limit, naming the blocks' size and, for whole blocks, why not per
    position."""
    from linbackprop._curvature import _examples

    monkeypatch.setattr(_examples, "MAX_HESSIAN_BLOCK_BYTES", 4 * 6 * 6 * 8 - 1)  # just under 4 blocks of 6²
    net = lbp.Network([lbp.Layer("y", lambda th, x: x @ th[0], ("x",), ("W",))], ["x"], "y")
    coupled = lambda p, x: jnp.sum(jnp.sum(net(p, x), axis=1) ** 2)  # H couples the 6 coordinates
    params, x = {"W": jnp.ones((2, 6))}, jnp.arange(8.0).reshape(4, 2)
    for transform in (lbp.kfac_factors, lbp.diag_ggn):
        with pytest.raises(ValueError, match=r"6 × 6 block per example \(4 examples.*H couples positions"):
            transform(coupled)(params, x)
    separate = lambda p, x: jnp.sum(net(p, x) ** 2)  # one 1 × 1 block per coordinate
    with pytest.raises(ValueError, match="ggn_factor needs each example's whole block"):
        lbp.ggn_factor(separate)(params, x)
    per_position = lbp.kfac_factors(separate)(params, x)["W"]
    monkeypatch.setattr(_examples, "MAX_HESSIAN_BLOCK_BYTES", 4 * 6 * 6 * 8)
    dense = lbp.kfac_factors(coupled)(params, x)["W"]  # whole blocks again: the same A, Γ of its own H
    assert dense.right.shape == (6, 6)
    close(per_position.left, x.T @ x / 4)  # A = (1/N) Σ x xᵀ, Γ = Σ_b H_b = 4 · 2I: A ⊗ Γ = Σ_b x xᵀ ⊗ 2I, G itself
    close(per_position.right, 8 * jnp.eye(6))
    monkeypatch.setattr(_examples, "MAX_HESSIAN_BLOCK_BYTES", 4 * 6 * 8 - 1)  # too small even per position
    with pytest.raises(ValueError, match=r"6 blocks of 1 × 1 per example \(one per position\)"):
        lbp.kfac_factors(separate)(params, x)


def test_blocks_per_position_of_a_sequence_model_against_its_whole_blocks(monkeypatch):
    """An RNN with a readout at every step (a Stack of logits, [T, B, V]: the batch on axis 1)
    and cross-entropy summed over positions, its blocks per position: the GGN diagonal against
    the dense J* H J of plain JAX, and K-FAC's factors as from each sequence's whole block, under
    jit; sampled columns (each position's root) average to the diagonal."""
    from linbackprop._curvature import _examples

    rng = np.random.default_rng(4)
    T, B, V, W = 4, 3, 5, 4
    cell = lambda th, h, x: jnp.tanh(h @ th[0] + x @ th[1] + th[2])
    layers = [lbp.Layer(f"h{t}", cell, (f"h{t - 1}", lbp.Row("xs", t - 1)), ("A", "B", "c")) for t in range(1, T + 1)]
    layers += [lbp.Layer(f"o{t}", lambda th, h: h @ th[0], (f"h{t}",), ("O",)) for t in range(1, T + 1)]
    net = lbp.Network(layers, ["h0", "xs"], lbp.Stack([f"o{t}" for t in range(1, T + 1)]))
    r = lambda *shape: jnp.asarray(0.7 * rng.standard_normal(shape))
    params = {"A": r(W, W), "B": r(2, W), "c": r(W), "O": r(W, V)}
    h0, xs, targets = r(B, W), r(T, B, 2), jnp.asarray(rng.integers(0, V, (T, B)))
    xent = lambda logits: -jnp.sum(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1))
    loss = lambda p, h0, xs: xent(net(p, h0, xs))
    both = lambda loss: jax.jit(lambda p: (lbp.kfac_factors(loss)(p, h0, xs), lbp.diag_ggn(loss)(p, h0, xs)))
    per_position = both(loss)(params)
    monkeypatch.setattr(_examples, "_positions", lambda *_: "whole blocks asked for")
    whole = both(lambda *a: loss(*a))(params)  # traced anew (jit's cache is keyed on the function)
    flat, unravel = ravel_pytree(params)
    outputs = lambda v: net(unravel(v), h0, xs)
    jac = jax.jacfwd(lambda v: outputs(v).ravel())(flat)
    hess = jax.hessian(lambda o: xent(o.reshape(T, B, V)))(outputs(flat).ravel())
    close(ravel_pytree(per_position[1])[0], jnp.diag(jac.T @ hess @ jac), rtol=1e-9, atol=1e-12)
    for name in ("A", "B", "O"):
        close(per_position[0][name].left, whole[0][name].left)
        close(per_position[0][name].right, whole[0][name].right)
    close(per_position[0]["c"], whole[0]["c"])
    sampled = jax.jit(lambda p: lbp.diag_ggn(loss, samples=400, key=jax.random.key(0))(p, h0, xs))(params)
    estimate, target = ravel_pytree(sampled)[0], ravel_pytree(per_position[1])[0]
    assert float(jnp.linalg.norm(estimate - target) / jnp.linalg.norm(target)) < 0.15
