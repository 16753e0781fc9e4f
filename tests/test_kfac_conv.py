"""K-FAC's Kronecker factors of convolutions (``lax.conv_general_dilated`` in a layer; flax nnx,
linen and equinox ``Conv`` through ``layers=``): patches ⊗ output cotangents, the bias joined.

References: on a linear convolution with a least-squares loss K-FAC "expand" is exact, so
left ⊗ right is the dense GGN Jᵀ H J of [W; b] (``jax.jacfwd`` of the plain call), for strides,
padding, both dilations, several layouts and spatial ranks — and one K-FAC step with learning
rate 1 and tiny damping lands on the least-squares optimum. On a nonlinear network: A from
``lax.conv_general_dilated_patches`` (an independent patch extraction), Γ = Σ_{b,t} J_btᵀ H_b J_bt
with J_bt the outputs' Jacobian w.r.t. a perturbation of position t's convolution output. The
models written with flax and equinox: the factors of the same network written by hand."""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen, nnx
from trees import assert_bias_of, assert_trees_close

import linbackprop as lbp

# (input spec, kernel spec, output spec, image size, channels in, channels out, window, keywords)
CONVS = {
    "same": (("NHWC", "HWIO", "NHWC"), (5, 5), 2, 3, (3, 3), {"window_strides": (1, 1), "padding": "SAME"}),
    "strided-dilated": (("NHWC", "HWIO", "NHWC"), (7, 6), 2, 2, (3, 2),
                        {"window_strides": (2, 1), "padding": "VALID", "rhs_dilation": (2, 1)}),
    "nchw-asymmetric": (("NCHW", "OIHW", "NCHW"), (6, 5), 2, 3, (2, 3),
                        {"window_strides": (2, 2), "padding": ((1, 0), (2, 1))}),
    "transposed": (("NHWC", "HWIO", "NHWC"), (3, 3), 2, 2, (3, 3),
                   {"window_strides": (1, 1), "padding": ((2, 2), (1, 2)), "lhs_dilation": (2, 2)}),
    "1d": (("NWC", "WIO", "NWC"), (9,), 3, 2, (3,), {"window_strides": (2,), "padding": "SAME"}),
    "3d": (("NCDHW", "OIDHW", "NCDHW"), (3, 4, 3), 1, 2, (2, 2, 2), {"window_strides": (1, 1, 1), "padding": "VALID"}),
}


def kernel_shape(specs, c_in, c_out, window):
    sizes = {"O": c_out, "I": c_in, **{d: n for d, n in zip([c for c in specs[1] if c not in "OI"], window)}}
    return tuple(sizes[c] for c in specs[1])


def image_shape(specs, batch, image, c_in):
    sizes = {"N": batch, "C": c_in, **{d: n for d, n in zip([c for c in specs[0] if c not in "NC"], image)}}
    return tuple(sizes[c] for c in specs[0])


def conv_model(specs, keywords):
    """The convolution plus its bias (broadcast along the output's channel axis)."""
    channel = specs[2].index("C")

    def apply(w, b, x):
        y = jax.lax.conv_general_dilated(x, w, dimension_numbers=specs, **keywords)
        return y + b.reshape([-1 if d == channel else 1 for d in range(y.ndim)])

    return apply


def block_vector(w, b, specs):
    """[W; b] (the kernel's output channels last: the bias a last row) or [W, b] (first: a last
    column), read row-major: the order of the Kronecker block's rows."""
    c_out = w.shape[specs[1].index("O")]
    if specs[1].index("O") == len(specs[1]) - 1:
        return jnp.concatenate([w.reshape(-1, c_out), b[None]], axis=0).ravel()
    return jnp.concatenate([w.reshape(c_out, -1), b[:, None]], axis=1).ravel()


@pytest.mark.parametrize("name", list(CONVS))
def test_a_linear_convolution_s_factors_are_its_dense_ggn_and_one_step_lands_on_the_optimum(name):
    specs, image, c_in, c_out, window, keywords = CONVS[name]
    rng = np.random.default_rng(0)
    apply = conv_model(specs, keywords)
    w = jnp.asarray(rng.standard_normal(kernel_shape(specs, c_in, c_out, window)))
    b = jnp.asarray(rng.standard_normal(c_out))
    x = jnp.asarray(rng.standard_normal(image_shape(specs, 3, image, c_in)))
    y = jnp.asarray(rng.standard_normal(apply(w, b, x).shape))
    net = lbp.Network([lbp.Layer("y", lambda th, u: apply(th[0], th[1], u), ("x",), ("w", "b"))], ["x"], "y")
    loss = lambda p, x: 0.5 * jnp.sum((net(p, x) - y) ** 2) / x.shape[0]
    params = {"w": w, "b": b}
    factors = jax.jit(lbp.kfac_factors(loss))(params, x)
    assert isinstance(factors["w"], lbp.Kronecker)
    o_last = specs[1].index("O") == len(specs[1]) - 1
    assert_bias_of(factors, "b", "['w']", "left" if o_last else "right")

    # the dense GGN of [W; b]: the outputs' Jacobian w.r.t. the block read row-major
    size = w.size + b.size

    def outputs(v):
        m = v.reshape(-1, c_out) if o_last else v.reshape(c_out, -1)
        wv, bv = (m[:-1], m[-1]) if o_last else (m[:, :-1], m[:, -1])
        return apply(wv.reshape(w.shape), bv, x).ravel()

    jac = jax.jacfwd(outputs)(block_vector(w, b, specs))
    ggn = jac.T @ jac / x.shape[0]
    assert ggn.shape == (size, size)
    f = factors["w"]
    np.testing.assert_allclose(jnp.kron(f.left, f.right), ggn, rtol=1e-10, atol=1e-10)

    # one step of K-FAC, learning rate 1, tiny damping: the least-squares optimum
    opt = lbp.kfac(damping=1e-12, min_damping=1e-12, learning_rate=1.0, momentum=0.0, adapt_damping=False)
    grad = jax.grad(loss)(params, x)
    updates, _ = opt.update(grad, opt.init(params), params, factors=factors)
    stepped = optax.apply_updates(params, updates)
    optimum = block_vector(w, b, specs) - jnp.linalg.lstsq(ggn, block_vector(grad["w"], grad["b"], specs))[0]
    np.testing.assert_allclose(block_vector(stepped["w"], stepped["b"], specs), optimum, rtol=1e-7, atol=1e-8)
    assert float(optax.tree.norm(jax.grad(loss)(stepped, x))) < 1e-8


@pytest.mark.parametrize("approximation", ["expand", "reduce"])
def test_a_nonlinear_convolution_network_s_factors_against_patches_and_perturbations(approximation):
    """Two convolutions (NHWC, stride 2 then 1), tanh, a dense head, cross-entropy: A from
    ``conv_general_dilated_patches`` (its features ordered (channel, window), reordered to the
    HWIO kernel's (window, channel)), Γ from perturbations of each position's conv output."""
    rng = np.random.default_rng(1)
    batch, classes = 4, 3
    specs = ("NHWC", "HWIO", "NHWC")
    conv = lambda w, x, s: jax.lax.conv_general_dilated(x, w, s, "SAME", dimension_numbers=specs)
    layers = [lbp.Layer("c1", lambda th, u: jnp.tanh(conv(th[0], u, (2, 2)) + th[1]), ("x",), ("K1", "k1")),
              lbp.Layer("c2", lambda th, u: jnp.tanh(conv(th[0], u, (1, 1)) + th[1]), ("c1",), ("K2", "k2")),
              lbp.Layer("y", lambda th, u: u.reshape(u.shape[0], -1) @ th[0], ("c2",), ("H",))]
    net = lbp.Network(layers, ["x"], "y")
    r = lambda *s: jnp.asarray(0.5 * rng.standard_normal(s))
    params = {"K1": r(3, 3, 2, 3), "k1": r(3), "K2": r(3, 3, 3, 2), "k2": r(2), "H": r(3 * 3 * 2, classes)}
    x, labels = r(batch, 6, 6, 2), jnp.asarray(rng.integers(0, classes, batch))
    xent = lambda o, t: -jnp.sum(jnp.take_along_axis(jax.nn.log_softmax(o, axis=-1), t[..., None], axis=-1))
    loss = lambda p, x: xent(net(p, x), labels)
    factors = jax.jit(lbp.kfac_factors(loss, approximation=approximation))(params, x)

    def plain(p, x, e1, e2):
        h1 = jnp.tanh(conv(p["K1"], x, (2, 2)) + e1 + p["k1"])
        h2 = jnp.tanh(conv(p["K2"], h1, (1, 1)) + e2 + p["k2"])
        return h2.reshape(h2.shape[0], -1) @ p["H"], h1

    out, h1 = plain(params, x, jnp.zeros((batch, 3, 3, 3)), jnp.zeros((batch, 3, 3, 2)))
    hess = jax.vmap(jax.hessian(lambda o, t: xent(o[None], t[None])))(out, labels)  # [B, C, C]

    def patches(u, window, strides):  # [B, positions, window..., channels] → [B, T, K] in HWIO order
        p = jax.lax.conv_general_dilated_patches(u, window, strides, "SAME", dimension_numbers=specs)
        c = u.shape[-1]
        p = p.reshape(*p.shape[:3], c, *window)  # (channel, window) → (window, channel)
        return jnp.moveaxis(p, 3, -1).reshape(u.shape[0], -1, c * math.prod(window))

    def with_ones(p):
        return jnp.concatenate([p, jnp.ones((*p.shape[:2], 1))], axis=-1)

    cases = (("K1", patches(x, (3, 3), (2, 2)), 0, 3), ("K2", patches(h1, (3, 3), (1, 1)), 1, 2))
    for name, p, which, c_out in cases:
        p = with_ones(p)  # the bias joins the block: [W; b]

        def perturbed(e, xb, which=which):
            zeros = [jnp.zeros((1, 3, 3, 3)), jnp.zeros((1, 3, 3, 2))]
            zeros[which] = e[None]
            return plain(params, xb[None], *zeros)[0][0]

        jac = jax.vmap(lambda xb, c_out=c_out, perturbed=perturbed: jax.jacfwd(perturbed)(
            jnp.zeros((3, 3, c_out)), xb))(x).reshape(batch, classes, 9, c_out)  # [B, C, T, O]
        n = batch * p.shape[1]
        if approximation == "expand":
            a = jnp.einsum("bti,btj->ij", p, p) / n
            gamma = jnp.einsum("bctx,bcd,bdty->xy", jac, hess, jac)
        else:  # each example's positions summed first
            a = jnp.einsum("bi,bj->ij", p.sum(1), p.sum(1)) / (n * p.shape[1])
            gamma = jnp.einsum("bcx,bcd,bdy->xy", jac.sum(2), hess, jac.sum(2))
        np.testing.assert_allclose(factors[name].left, a, rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(factors[name].right, gamma, rtol=1e-9, atol=1e-12)


def test_grouped_convolutions_and_kernels_with_output_channels_inside_take_their_diagonal():
    """Feature groups (a depthwise convolution: one block per group) and a kernel layout whose
    output-channel axis is neither first nor last are not factored: their leaves get the GGN
    diagonal, as ``diag_ggn`` gives it (the documented rule for a leaf that is no product)."""
    rng = np.random.default_rng(2)
    grouped = lambda th, u: jnp.tanh(jax.lax.conv_general_dilated(
        u, th[0], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=2))
    inside = lambda th, u: jnp.tanh(jax.lax.conv_general_dilated(
        u, th[0], (1, 1), "SAME", dimension_numbers=("NHWC", "HOWI", "NHWC")))
    head = lambda th, u: u.reshape(u.shape[0], -1) @ th[0]
    net = lbp.Network([lbp.Layer("g", grouped, ("x",), ("G",)), lbp.Layer("i", inside, ("g",), ("I",)),
                       lbp.Layer("y", head, ("i",), ("H",))], ["x"], "y")
    r = lambda *s: jnp.asarray(0.5 * rng.standard_normal(s))
    params = {"G": r(3, 3, 1, 4), "I": r(3, 2, 3, 4), "H": r(4 * 4 * 2, 2)}
    x = r(3, 4, 4, 2)
    loss = lambda p, x: 0.5 * jnp.sum(jnp.sin(net(p, x)) ** 2)
    factors = jax.jit(lbp.kfac_factors(loss))(params, x)
    diagonal = jax.jit(lbp.diag_ggn(loss))(params, x)
    assert isinstance(factors["H"], lbp.Kronecker)
    for name in ("G", "I"):
        np.testing.assert_allclose(factors[name], diagonal[name], rtol=1e-10, atol=1e-12)


# -- the same convolutional network written with flax nnx, flax linen and equinox ---------------------
IMAGE, C_IN, C_MID, CLASSES, BATCH = 6, 2, 3, 4, 5


def hand_written(kernel_layout):
    """conv 3×3 (stride 2, SAME) → tanh → conv 3×3 (SAME) → tanh → dense, as a ``Network``; the
    kernels in ``kernel_layout`` (flax: HWIO, equinox: OIHW), the images NHWC or NCHW alike."""
    image = "NHWC" if kernel_layout == "HWIO" else "NCHW"
    channel = image.index("C")
    conv = lambda w, u, s: jax.lax.conv_general_dilated(u, w, s, ((1, 1), (1, 1)) if s == (2, 2) else "SAME",
                                                        dimension_numbers=(image, kernel_layout, image))
    bias = lambda b, y: y + b.reshape([-1 if d == channel else 1 for d in range(y.ndim)])
    layers = [lbp.Layer("c1", lambda th, u: jnp.tanh(bias(th[1], conv(th[0], u, (2, 2)))), ("x",), ("K1", "k1")),
              lbp.Layer("c2", lambda th, u: jnp.tanh(bias(th[1], conv(th[0], u, (1, 1)))), ("c1",), ("K2", "k2")),
              lbp.Layer("y", lambda th, u: u.reshape(u.shape[0], -1) @ th[0] + th[1], ("c2",), ("H", "h"))]
    return lbp.Network(layers, ["x"], "y")


def xent(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def data(layout):
    rng = np.random.default_rng(4)
    shape = (BATCH, IMAGE, IMAGE, C_IN) if layout == "NHWC" else (BATCH, C_IN, IMAGE, IMAGE)
    return jnp.asarray(rng.standard_normal(shape)), jnp.asarray(rng.integers(0, CLASSES, BATCH))


def kronecker_leaves(factors):
    leaves = jax.tree.leaves(factors, is_leaf=lambda f: isinstance(f, (lbp.Kronecker, lbp.BiasOf)))
    return [f for f in leaves if isinstance(f, lbp.Kronecker)]


class NnxConvBlock(nnx.Module):
    def __init__(self, i, o, strides, rngs):
        self.conv = nnx.Conv(i, o, (3, 3), strides=strides, padding="SAME" if strides == 1 else ((1, 1), (1, 1)),
                             param_dtype=jnp.float64, rngs=rngs)

    def __call__(self, x):
        return jnp.tanh(self.conv(x))


class NnxCnn(nnx.Module):
    def __init__(self, rngs):
        self.c1, self.c2 = NnxConvBlock(C_IN, C_MID, 2, rngs), NnxConvBlock(C_MID, C_MID, 1, rngs)
        self.head = nnx.Linear(3 * 3 * C_MID, CLASSES, param_dtype=jnp.float64, rngs=rngs)

    def __call__(self, x):
        h = self.c2(self.c1(x))
        return self.head(h.reshape(h.shape[0], -1))


def test_nnx_conv_through_layers_has_the_factors_of_the_network_written_by_hand():
    model = NnxCnn(nnx.Rngs(0))
    x, labels = data("NHWC")
    loss = lambda m, x: xent(m(x), labels)
    factors = jax.jit(lambda m, x: lbp.kfac_factors(loss, layers=(NnxConvBlock, nnx.Linear))(m, x))(model, x)
    p = {"K1": model.c1.conv.kernel[...], "k1": model.c1.conv.bias[...], "K2": model.c2.conv.kernel[...],
         "k2": model.c2.conv.bias[...], "H": model.head.kernel[...], "h": model.head.bias[...]}
    net = hand_written("HWIO")
    ref = jax.jit(lbp.kfac_factors(lambda p, x: xent(net(p, x), labels)))(p, x)
    got = kronecker_leaves(factors)
    assert len(got) == 3  # both convolutions and the head: Kronecker blocks, each with its bias
    assert sum(isinstance(f, lbp.BiasOf) for f in jax.tree.leaves(
        factors, is_leaf=lambda f: isinstance(f, (lbp.Kronecker, lbp.BiasOf)))) == 3
    assert_trees_close(got, [ref["K1"], ref["K2"], ref["H"]], rtol=1e-9, atol=1e-12)


class LinenCnn(linen.Module):
    @linen.compact
    def __call__(self, x):
        x = jnp.tanh(linen.Conv(C_MID, (3, 3), strides=2, padding=((1, 1), (1, 1)), param_dtype=jnp.float64)(x))
        x = jnp.tanh(linen.Conv(C_MID, (3, 3), padding="SAME", param_dtype=jnp.float64)(x))
        return linen.Dense(CLASSES, param_dtype=jnp.float64)(x.reshape(x.shape[0], -1))


def test_linen_conv_through_layers_has_the_factors_of_the_network_written_by_hand():
    x, labels = data("NHWC")
    model = LinenCnn()
    variables = model.init(jax.random.key(0), x)
    loss = lambda v, x: xent(model.apply(v, x), labels)
    factors = jax.jit(lambda v, x: lbp.kfac_factors(loss, layers=(linen.Conv, linen.Dense))(v, x))(variables, x)
    q = variables["params"]
    p = {"K1": q["Conv_0"]["kernel"], "k1": q["Conv_0"]["bias"], "K2": q["Conv_1"]["kernel"],
         "k2": q["Conv_1"]["bias"], "H": q["Dense_0"]["kernel"], "h": q["Dense_0"]["bias"]}
    net = hand_written("HWIO")
    ref = jax.jit(lbp.kfac_factors(lambda p, x: xent(net(p, x), labels)))(p, x)
    assert_trees_close(kronecker_leaves(factors), [ref["K1"], ref["K2"], ref["H"]], rtol=1e-9, atol=1e-12)


class EqxCnn(eqx.Module):
    c1: eqx.nn.Conv2d
    c2: eqx.nn.Conv2d
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.c1 = eqx.nn.Conv2d(C_IN, C_MID, 3, stride=2, padding=1, key=k1, dtype=jnp.float64)
        self.c2 = eqx.nn.Conv2d(C_MID, C_MID, 3, padding="SAME", key=k2, dtype=jnp.float64)
        self.head = eqx.nn.Linear(3 * 3 * C_MID, CLASSES, key=k3, dtype=jnp.float64)

    def __call__(self, x):  # one example [C, H, W]
        h = jnp.tanh(self.c2(jnp.tanh(self.c1(x))))
        return self.head(h.reshape(-1))


def test_equinox_conv_through_layers_has_the_factors_of_the_network_written_by_hand():
    x, labels = data("NCHW")
    model = EqxCnn(jax.random.key(1))
    loss = lambda m, x: xent(jax.vmap(m)(x), labels)
    layers = (eqx.nn.Conv2d, eqx.nn.Linear)
    factors = eqx.filter_jit(lambda m, x: lbp.kfac_factors(loss, layers=layers)(m, x))(model, x)
    p = {"K1": model.c1.weight, "k1": model.c1.bias.reshape(-1), "K2": model.c2.weight,
         "k2": model.c2.bias.reshape(-1), "H": model.head.weight.T, "h": model.head.bias}
    net = hand_written("OIHW")
    ref = jax.jit(lbp.kfac_factors(lambda p, x: xent(net(p, x), labels)))(p, x)
    got = kronecker_leaves(factors)
    assert len(got) == 3
    # equinox's Linear is W x (its weight [out, in]): its factors are (Γ, A), the hand-written head's (A, Γ)
    assert_trees_close(got[:2], [ref["K1"], ref["K2"]], rtol=1e-9, atol=1e-12)
    assert_trees_close([got[2].left, got[2].right], [ref["H"].right, ref["H"].left], rtol=1e-9, atol=1e-12)
