"""A registry of test networks, each small enough for dense checks.

Every entry returns a :class:`Case`: the network, float64 parameters and inputs, and a scalar
loss that calls the network (and, for some, uses parameters directly). Also the layer functions
of the structure tests' deep networks and a walk over a jaxpr's equations.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import linbackprop as lbp


def residual(th, u):
    return u + jnp.tanh(u @ th[0] + th[1])


def gated(th, u):
    return u * jax.nn.sigmoid(u @ th[0])


def skip(th, u, s):
    return u + jnp.tanh(s @ th[0])


def equations(closed):
    """The equations of a closed jaxpr and of every jaxpr nested in it (loop bodies, branches)."""
    def walk(jx):
        for eqn in jx.eqns:
            yield eqn
            for value in eqn.params.values():
                for sub in value if isinstance(value, (list, tuple)) else (value,):
                    sub = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
                    if hasattr(sub, "eqns"):
                        yield from walk(sub)

    return walk(closed.jaxpr)


@dataclasses.dataclass
class Case:
    net: lbp.Network
    params: dict
    inputs: tuple
    loss: Callable[..., Any]  # loss(params, *inputs) -> scalar


def _rand(rng: np.random.Generator, *shape, scale=0.5):
    return jnp.asarray(scale * rng.standard_normal(shape))


def _sum_outputs(net):
    def loss(params, *inputs):
        outs = net(params, *inputs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        return sum(jnp.sum(jnp.sin(leaf) + leaf**2) for leaf in jax.tree.leaves(outs))
    return loss


def dense(th, x):
    return jnp.tanh(x @ th[0] + th[1])


def chain() -> Case:
    rng = np.random.default_rng(0)
    widths = [3, 4, 4, 2]
    layers, params = [], {}
    for i in range(1, len(widths)):
        layers.append(lbp.Layer(f"h{i}", dense, (f"h{i-1}",), (f"W{i}", f"b{i}")))
        params[f"W{i}"], params[f"b{i}"] = _rand(rng, widths[i - 1], widths[i]), _rand(rng, widths[i])
    net = lbp.Network(layers, ["h0"], f"h{len(widths) - 1}")
    return Case(net, params, (_rand(rng, 5, widths[0], scale=1.0),), _sum_outputs(net))


def seed_sigma(x):
    return jnp.exp(-x)


def seed() -> Case:
    """The seed's network: 6 layers, skips 3←1, 5←2, 6←3; layers 3 and 4 share weight and bias."""
    rng = np.random.default_rng(42)
    d = [5, 4, 4, 4, 4, 3, 1]
    W = [[(0, 1)], [(1, 2)], [(2, 3), (1, 6)], [(3, 3)], [(4, 4), (2, 7)], [(5, 5), (3, 8)]]
    b = [9, 10, 11, 11, 12, 13]

    def make(n_reads):
        def layer(th, *u):
            z = sum(th[r] @ u[r] for r in range(n_reads)) + th[n_reads][:, None]
            return seed_sigma(z)
        return layer

    fns = {n: make(n) for n in (1, 2)}
    layers, params = [], {}
    for i in range(1, 7):
        reads = tuple(j for j, _ in W[i - 1])
        blocks = tuple(k for _, k in W[i - 1]) + (b[i - 1],)
        layers.append(lbp.Layer(i, fns[len(reads)], reads, blocks))
        for j, k in W[i - 1]:
            params.setdefault(k, _rand(rng, d[i], d[j], scale=0.3))
        params.setdefault(b[i - 1], _rand(rng, d[i], scale=0.3))
    net = lbp.Network(layers, [0], 6)
    m = 10
    U0, Y = _rand(rng, d[0], m, scale=0.3), _rand(rng, d[-1], m, scale=0.3)
    alpha = 1e-2

    def loss(params, u0):
        fit = jnp.sum((net(params, u0) - Y) ** 2) / (2 * m)
        return fit + alpha / 2 * sum(jnp.sum(p**2) for p in params.values())

    return Case(net, params, (U0,), loss)


def skips() -> Case:
    """Three widths, skip connections, a block shared by two layers."""
    rng = np.random.default_rng(1)

    def skip(th, x, s):
        return jnp.tanh(x @ th[0] + s @ th[1] + th[2])

    layers = [
        lbp.Layer("a", dense, ("x",), ("Wa", "ba")),
        lbp.Layer("b", dense, ("a",), ("Wb", "bb")),
        lbp.Layer("c", skip, ("b", "x"), ("Wc", "Sc", "bb")),
        lbp.Layer("d", skip, ("c", "a"), ("Wd", "Sd", "bd")),
        lbp.Layer("e", skip, ("d", "b"), ("We", "Se", "be")),
    ]
    shapes = {"Wa": (3, 5), "ba": (5,), "Wb": (5, 4), "bb": (4,), "Wc": (4, 4), "Sc": (3, 4),
              "Wd": (4, 2), "Sd": (5, 2), "bd": (2,), "We": (2, 4), "Se": (4, 4), "be": (4,)}
    params = {k: _rand(rng, *s) for k, s in shapes.items()}
    net = lbp.Network(layers, ["x"], ["e", "d"])
    return Case(net, params, (_rand(rng, 6, 3, scale=1.0),), _sum_outputs(net))


def densenet() -> Case:
    """Every layer reads all earlier states (concatenated)."""
    rng = np.random.default_rng(2)
    n, w = 4, 3

    def layer(th, *u):
        return jnp.tanh(jnp.concatenate(u, axis=-1) @ th[0] + th[1])

    layers, params = [], {}
    for i in range(1, n + 1):
        layers.append(lbp.Layer(i, layer, tuple(range(i)), (("W", i), ("b", i))))
        params[("W", i)], params[("b", i)] = _rand(rng, i * w, w), _rand(rng, w)
    net = lbp.Network(layers, [0], n)
    return Case(net, params, (_rand(rng, 2, w, scale=1.0),), _sum_outputs(net))


def rnn() -> Case:
    """An unrolled RNN with tied weights; every hidden state is an output; one input per step."""
    rng = np.random.default_rng(3)
    T, d_in, d_h = 4, 2, 3

    def cell(th, h, x):
        return jnp.tanh(h @ th[0] + x @ th[1] + th[2])

    layers = [lbp.Layer(("h", t), cell, (("h", t - 1), ("x", t)), ("Wh", "Wx", "b")) for t in range(1, T + 1)]
    inputs = [("h", 0)] + [("x", t) for t in range(1, T + 1)]
    net = lbp.Network(layers, inputs, [("h", t) for t in range(1, T + 1)])
    params = {"Wh": _rand(rng, d_h, d_h), "Wx": _rand(rng, d_in, d_h), "b": _rand(rng, d_h)}
    xs = (_rand(rng, 2, d_h, scale=1.0),) + tuple(_rand(rng, 2, d_in, scale=1.0) for _ in range(T))
    return Case(net, params, xs, _sum_outputs(net))


def lstm() -> Case:
    """Pytree states (h, c) and a pytree parameter block (a dict of gate weights)."""
    rng = np.random.default_rng(4)
    T, d = 3, 3

    def cell(th, state, x):
        h, c = state
        g = th[0]
        z = lambda n: x @ g[n]["x"] + h @ g[n]["h"]
        i, f, o = jax.nn.sigmoid(z("i")), jax.nn.sigmoid(z("f")), jax.nn.sigmoid(z("o"))
        c = f * c + i * jnp.tanh(z("c"))
        return (o * jnp.tanh(c), c)

    layers = [lbp.Layer(("s", t), cell, (("s", t - 1), ("x", t)), ("gates",)) for t in range(1, T + 1)]
    head = lbp.Layer("y", lambda th, s: s[0] @ th[0], (("s", T),), ("head",))
    inputs = [("s", 0)] + [("x", t) for t in range(1, T + 1)]
    net = lbp.Network([*layers, head], inputs, ["y", ("s", T)])
    gates = {n: {"x": _rand(rng, d, d), "h": _rand(rng, d, d)} for n in "ifoc"}
    params = {"gates": gates, "head": _rand(rng, d, 1)}
    s0 = (_rand(rng, 2, d, scale=1.0), _rand(rng, 2, d, scale=1.0))
    xs = (s0,) + tuple(_rand(rng, 2, d, scale=1.0) for _ in range(T))
    return Case(net, params, xs, _sum_outputs(net))


def multi_input() -> Case:
    """Two inputs of different widths, merged, plus a repeated parameter block in one layer."""
    rng = np.random.default_rng(5)
    layers = [
        lbp.Layer("a", dense, ("x",), ("Wx", "b")),
        lbp.Layer("c", lambda th, a, z: jnp.tanh(a @ th[0] + z @ th[1] + th[2] * th[2]), ("a", "z"),
                  ("Wa", "Wz", "b")),
        lbp.Layer("o", lambda th, c, a: c * a @ th[0] @ th[0], ("c", "a"), ("sq",)),
    ]
    net = lbp.Network(layers, ["x", "z"], "o")
    params = {"Wx": _rand(rng, 3, 4), "b": _rand(rng, 4), "Wa": _rand(rng, 4, 4), "Wz": _rand(rng, 2, 4),
              "sq": _rand(rng, 4, 4)}
    return Case(net, params, (_rand(rng, 3, 3, scale=1.0), _rand(rng, 3, 2, scale=1.0)), _sum_outputs(net))


def conv() -> Case:
    """States of different ranks: NHWC images through two convolutions, then a dense head."""
    rng = np.random.default_rng(6)

    def conv_layer(th, x):
        y = jax.lax.conv_general_dilated(x, th[0], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jnp.tanh(y + th[1])

    def head(th, x, skip):
        return (x.reshape(x.shape[0], -1) + skip.reshape(skip.shape[0], -1)) @ th[0]

    layers = [
        lbp.Layer("c1", conv_layer, ("img",), ("K1", "k1")),
        lbp.Layer("c2", conv_layer, ("c1",), ("K2", "k2")),
        lbp.Layer("y", head, ("c2", "c1"), ("H",)),
    ]
    net = lbp.Network(layers, ["img"], "y")
    params = {"K1": _rand(rng, 3, 3, 2, 2), "k1": _rand(rng, 2), "K2": _rand(rng, 3, 3, 2, 2), "k2": _rand(rng, 2),
              "H": _rand(rng, 4 * 4 * 2, 3)}
    return Case(net, params, (_rand(rng, 2, 4, 4, 2, scale=1.0),), _sum_outputs(net))


def stacked() -> Case:
    """Stacked blocks used by rows (lbp.Row): a pytree stacked block, one row shared by two layers,
    two rows of one block in one layer, an unused row (zero gradient), and a plain block too."""
    rng = np.random.default_rng(7)

    def res(th, u):
        return u + jnp.tanh(u @ th[0]["W"] + th[0]["b"]) * th[1]

    layers = [
        lbp.Layer(1, res, (0,), (lbp.Row("R", 0), "scale")),
        lbp.Layer(2, res, (1,), (lbp.Row("R", 1), "scale")),
        lbp.Layer(3, res, (2,), (lbp.Row("R", 1), "scale")),
        lbp.Layer(4, lambda th, u, v: jnp.tanh(u @ th[0] + v @ th[1]), (3, 1), (lbp.Row("S", 0), lbp.Row("S", 2))),
    ]
    net = lbp.Network(layers, [0], [4, 2])
    params = {"R": {"W": _rand(rng, 2, 3, 3), "b": _rand(rng, 2, 3)}, "scale": _rand(rng, 3), "S": _rand(rng, 3, 3, 3)}
    return Case(net, params, (_rand(rng, 4, 3, scale=1.0),), _sum_outputs(net))


REGISTRY: dict[str, Callable[[], Case]] = {
    f.__name__: f for f in (chain, seed, skips, densenet, rnn, lstm, multi_input, conv, stacked)
}
