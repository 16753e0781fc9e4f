"""What an example is, proved (issue "Trust, round six"): losses that couple examples through their
data — partner indices with and without example 0, masks, class weights as long as the batch,
labels as indices — under every per-example and block-diagonal transform, eager and under
``jax.jit``, B ∈ {1, 2, 3, 5, 8}: the result equals ``jax.jacrev`` / the dense J*HJ, or the call
raises. Never a number that is wrong."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given
from hypothesis import strategies as st

import linbackprop as lbp

_NET = lbp.Network([lbp.Layer("h", lambda th, x: jnp.tanh(x @ th[0] + th[1]), ("x",), ("W", "b")),
                    lbp.Layer("y", lambda th, h: h @ th[0], ("h",), ("V",))], ["x"], "y")
_CLASSES = 3


def _losses(kind: str):
    """Per-example losses of the network's outputs o = net(p, x) and the data ``d`` (an int
    vector as long as the batch: a partner index, labels or a mask) and ``w`` (floats as long as
    the batch: class or sample weights)."""
    head = _head(kind)
    return lambda p, x, d, w: head(_NET(p, x), d, w)


def _head(kind: str):
    def losses(o, d, w):
        if kind == "partner":  # contrastive pairs through a data index
            return jnp.sum((o - o[d]) ** 2, axis=1) + 0.5 * jnp.sum(o ** 2, axis=1)
        if kind == "labels":  # labels read per row, optax's loss
            return optax.softmax_cross_entropy_with_integer_labels(o, d % _CLASSES)
        if kind == "arange":
            return -jax.nn.log_softmax(o)[jnp.arange(o.shape[0]), d % _CLASSES]
        if kind == "class_weights":  # as many classes' weights as examples, indexed by the labels
            return w[d] * optax.softmax_cross_entropy_with_integer_labels(o, d % _CLASSES)
        if kind == "mask":
            return (d % 2) * jnp.sum(o ** 2, axis=1) * w
        if kind == "reversed_tail":  # example 0 alone, the rest read each other in reverse order
            return jnp.sum(o * jnp.concatenate([o[:1], o[1:][::-1]]), axis=1)
        if kind == "batch_mean":
            return jnp.sum((o - jnp.mean(o, axis=0)) ** 2, axis=1)
        raise AssertionError(kind)

    return losses


def _problem(batch: int, kind: str, seed: int):
    rng = np.random.default_rng(seed)
    p = {"W": jnp.asarray(rng.standard_normal((2, 4))), "b": jnp.asarray(0.1 * rng.standard_normal(4)),
         "V": jnp.asarray(rng.standard_normal((4, _CLASSES)))}
    x = jnp.asarray(rng.standard_normal((batch, 2)))
    if kind == "partner":
        d = rng.permutation(batch) if rng.random() < 0.5 else np.concatenate([[0], 1 + rng.permutation(batch - 1)])
    else:
        d = rng.integers(0, batch, batch)
    w = jnp.asarray(rng.random(batch) + 0.5)
    return p, x, jnp.asarray(d), w


def _flat(tree, batch):
    return jnp.concatenate([jnp.reshape(x, (batch, -1)) for x in jax.tree.leaves(tree)], axis=1)


def _reference(transform: str, kind: str, p, x, d, w, clip: float):
    losses, head = _losses(kind), _head(kind)
    batch = x.shape[0]
    jac = _flat(jax.jacrev(losses)(p, x, d, w), batch)
    norms = jnp.linalg.norm(jac, axis=1)
    if transform == "per_example_grads":
        return jac
    if transform == "per_example_grad_norms":
        return norms
    if transform == "clipped_grad":
        return jnp.sum(jnp.minimum(1.0, clip / norms)[:, None] * jac, axis=0)
    # the GGN diagonal of the mean loss: diag(J* H J), J the outputs' Jacobian, H the loss's Hessian in them
    leaves, treedef = jax.tree.flatten(p)
    sizes = [x_.size for x_ in leaves]

    def outputs(flat):
        parts = jnp.split(flat, np.cumsum(sizes)[:-1])
        return _NET(treedef.unflatten([q.reshape(x_.shape) for q, x_ in zip(parts, leaves)]), x).reshape(-1)

    theta = jnp.concatenate([x_.reshape(-1) for x_ in leaves])
    o = outputs(theta)
    jo = jax.jacfwd(outputs)(theta)
    mean_loss = lambda o: jnp.mean(head(o.reshape(batch, -1), d, w))
    h = jax.hessian(mean_loss)(o)
    return jnp.diag(jo.T @ h @ jo)


def _ours(transform: str, losses, p, x, d, w, clip: float, jit: bool):
    batch = x.shape[0]
    if transform == "per_example_grads":
        f = lambda *a: _flat(lbp.per_example_grads(losses)(*a), batch)
    elif transform == "per_example_grad_norms":
        f = lbp.per_example_grad_norms(losses)
    elif transform == "clipped_grad":
        f = lambda *a: jnp.concatenate([jnp.reshape(g, -1) for g in jax.tree.leaves(
            lbp.clipped_grad(losses, clip)(*a)[0])])
    else:
        f = lambda *a: jnp.concatenate([jnp.reshape(g, -1) for g in jax.tree.leaves(
            lbp.diag_ggn(lambda *b: jnp.mean(losses(*b)))(*a))])
    return (jax.jit(f) if jit else f)(p, x, d, w)


# (labels by jnp.arange and a batch mean: test_the_forms_users_write_are_proved_not_refused and
# tests/test_curvature.py's refusals; the slow tier draws them here too)
_KINDS = ["partner", "labels", "class_weights", "mask", "reversed_tail",
          pytest.param("arange", marks=pytest.mark.slow), pytest.param("batch_mean", marks=pytest.mark.slow)]
_TRANSFORMS = ["per_example_grads", "per_example_grad_norms", "clipped_grad", "diag_ggn"]


@pytest.mark.parametrize("kind", _KINDS)
@given(batch=st.sampled_from([1, 2, 3, 5, 8]), seed=st.integers(0, 2**16), jit=st.booleans(),
       transform=st.sampled_from(_TRANSFORMS))
def test_the_result_is_the_reference_or_the_call_raises(kind, batch, seed, jit, transform):
    if kind == "reversed_tail" and batch < 2:
        batch = 2
    losses = _losses(kind)
    p, x, d, w = _problem(batch, kind, seed)
    expected = _reference(transform, kind, p, x, d, w, clip=0.5)
    try:
        found = _ours(transform, losses, p, x, d, w, clip=0.5, jit=jit)
    except ValueError as error:
        assert "mix" in str(error) or "couples" in str(error), error
        return
    np.testing.assert_allclose(np.asarray(found), np.asarray(expected), rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("jit", [False, True])
def test_the_forms_users_write_are_proved_not_refused(jit):
    """Labels read per row (optax, take_along_axis, x[arange(B), labels], one_hot · log_softmax),
    class weights as long as the batch indexed by the labels, masks and sample weights: accepted
    at every batch, eager and jitted, and equal to jax.jacrev."""
    for batch in (4,):
        for kind in ("labels", "arange", "class_weights", "mask"):
            losses = _losses(kind)
            p, x, d, w = _problem(batch, kind, 11)
            expected = _reference("per_example_grads", kind, p, x, d, w, clip=1.0)
            found = _ours("per_example_grads", losses, p, x, d, w, clip=1.0, jit=jit)
            np.testing.assert_allclose(np.asarray(found), np.asarray(expected), rtol=1e-8, atol=1e-10)
        one_hot = lambda p, x, d, w: -jnp.sum(jax.nn.one_hot(d % _CLASSES, _CLASSES)
                                              * jax.nn.log_softmax(_NET(p, x)), axis=1)
        p, x, d, w = _problem(batch, "labels", 12)
        f = lbp.per_example_grads(one_hot)
        np.testing.assert_allclose(_flat((jax.jit(f) if jit else f)(p, x, d, w), batch),
                                   _flat(jax.jacrev(one_hot)(p, x, d, w), batch), rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("jit", [False, True])
def test_couplings_that_leave_example_0_alone_are_refused_naming_the_operation(jit):
    """The issue's cases: a partner index pairing examples 1 and 2 (example 0 alone), a loss
    whose examples 1… read each other in reverse order, and the GGN diagonal of a paired loss —
    each refused, eager and under jax.jit, the message naming what reads which example and the
    operation with the user's line."""
    p, x, _, w = _problem(3, "partner", 0)
    partner = jnp.asarray([0, 2, 1])
    losses = _losses("partner")
    run = lambda f, *a: (jax.jit(f) if jit else f)(*a)
    for transform in (lbp.per_example_grads(losses), lbp.per_example_grad_norms(losses),
                      lbp.clipped_grad(losses, 1.0)):
        with pytest.raises(ValueError, match=r"loss \d reads .*test_what_an_example_is.py"):
            run(transform, p, x, partner, w)
    p, x, d, w = _problem(5, "reversed_tail", 0)
    with pytest.raises(ValueError, match=r"loss [1-4] reads"):
        run(lbp.per_example_grads(_losses("reversed_tail")), p, x, d, w)
    p, x, _, w = _problem(4, "partner", 0)
    with pytest.raises(ValueError, match="couples them"):
        run(lbp.diag_ggn(lambda *a: jnp.mean(losses(*a))), p, x, jnp.asarray([0, 2, 1, 3]), w)


def test_a_nan_example_leaves_the_others_norms_finite():
    """A head with a frozen vector as long as the batch (class weights) and one example whose input
    is NaN: that example's norm is NaN, the others' are jax.vmap(jax.grad)'s (each example's
    gradient from its own rows, proved; the batch's Jacobian would spread the NaN)."""
    net = lbp.Network([lbp.Layer("h", lambda th, x: jnp.tanh(x @ th[0]), ("x",), ("W",))], ["x"], "h")
    rng = np.random.default_rng(5)
    p = {"W": jnp.asarray(rng.standard_normal((3, 4))), "head": jnp.asarray(rng.standard_normal((4, 4)))}
    x = jnp.asarray(rng.standard_normal((4, 3))).at[0, 1].set(jnp.nan)
    labels, cw = jnp.asarray([1, 0, 3, 2]), jnp.asarray([1.0, 2.0, 0.5, 1.5])
    losses = lambda p, x, labels, cw: cw[labels] * optax.softmax_cross_entropy_with_integer_labels(
        net(p, x) @ p["head"], labels)
    one = lambda p, x, label, c: losses(p, x[None], label[None], cw)[0]
    expected = jax.vmap(lambda x, label: jnp.sqrt(sum(jnp.sum(g ** 2) for g in jax.tree.leaves(
        jax.grad(one)(p, x, label, cw)))))(x, labels)
    found = jax.jit(lbp.per_example_grad_norms(losses))(p, x, labels, cw)
    assert np.isnan(found[0]) and np.isnan(expected[0])
    np.testing.assert_allclose(found[1:], expected[1:], rtol=1e-10)


def test_a_head_whose_one_example_program_differs_is_caught_on_the_real_values():
    """A head after the network whose losses weigh example b by its position (1 + b, from
    jnp.arange of the batch): example b reads only its own rows (proved), but the losses traced on
    one example weigh every example by 1. The check on the real values inside the program
    catches it: eagerly a ValueError, under jax.jit the norms are NaN — never a wrong number."""
    net = lbp.Network([lbp.Layer("h", lambda th, x: jnp.tanh(x @ th[0]), ("x",), ("W",))], ["x"], "h")
    rng = np.random.default_rng(6)
    p = {"W": jnp.asarray(rng.standard_normal((3, 4))), "head": jnp.asarray(rng.standard_normal((4, 2)))}
    x = jnp.asarray(rng.standard_normal((5, 3)))
    losses = lambda p, x: jnp.sum((net(p, x) @ p["head"]) ** 2, axis=1) * (1.0 + jnp.arange(x.shape[0]))
    with pytest.raises(ValueError, match="traced on one example do not compute"):
        lbp.per_example_grad_norms(losses)(p, x)
    assert np.all(np.isnan(jax.jit(lbp.per_example_grad_norms(losses))(p, x)))
    plain = lambda p, x: jnp.sum((net(p, x) @ p["head"]) ** 2, axis=1)  # the same head, no position
    expected = jnp.linalg.norm(_flat(jax.jacrev(plain)(p, x), 5), axis=1)
    np.testing.assert_allclose(jax.jit(lbp.per_example_grad_norms(plain))(p, x), expected, rtol=1e-10)
