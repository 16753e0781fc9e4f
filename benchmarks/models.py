"""The networks the rows measure, each with its reference: chains, RNNs, the GPT, DAGs of several kinds."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np

import linbackprop as lbp

from . import example


def residual(th, u):
    return u + jnp.tanh(u @ th[0] + th[1])


def gated(th, u):
    return u * jax.nn.sigmoid(u @ th[0] + th[1])


def skip(th, u, s):
    return u + jnp.tanh(u @ th[0] + s @ th[1])


def fresh(fn):
    """A new function object with fn's code: JAX caches traces per function object, so every
    network built here compiles cold, as a user's first compile does."""
    return types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def normal(key, shape, scale):
    return jax.random.normal(key, shape, jnp.float32) * scale


# -- networks: (loss, args, reference loss, reference args, forward, forward args) -------------------


def chain(depth: int, width: int, batch: int, rows: bool = True):
    """u + tanh(uW + b), depth times. Reference: lax.scan over the stacked weights."""
    kw, kx = jax.random.split(jax.random.PRNGKey(0))
    ws, bs = normal(kw, (depth, width, width), 0.5 / np.sqrt(width)), jnp.zeros((depth, width))
    x = normal(kx, (batch, width), 1.0)
    if rows:
        blocks = lambda i: (lbp.Row("W", i - 1), lbp.Row("b", i - 1))
        params = {"W": ws, "b": bs}
    else:
        blocks = lambda i: (("W", i), ("b", i))
        params = {k: v for i in range(1, depth + 1) for k, v in ((("W", i), ws[i - 1]), (("b", i), bs[i - 1]))}
    layer = fresh(residual)
    net = lbp.Network([lbp.Layer(i, layer, (i - 1,), blocks(i)) for i in range(1, depth + 1)], [0], depth)
    def loss(p, x):
        return jnp.sum(net(p, x) ** 2)

    loss.net, loss.net_inputs = net, lambda p, x: (x,)  # its network and inputs, for eager_rows

    def scan_loss(stacked, x):
        u, _ = jax.lax.scan(lambda u, wb: (layer(wb, u), None), x, stacked)
        return jnp.sum(u**2)

    return loss, (params, x), scan_loss, ((ws, bs), x)


def rnn_step(th, h, x):
    return jnp.tanh(h @ th[0] + x @ th[1] + th[2])


def rnn(steps: int, width: int, batch: int, every: bool = False, checkpointed_reference: bool = False,
        equinox_checkpoints: int | None = None):
    """h_t = tanh(h_{t-1} A + x_t B + c) over one stacked input xs (``Row("xs", t)`` reads), the
    last state (or, ``every``, all states as a ``Stack``) into the loss. Reference: lax.scan
    (``checkpointed_reference``: its step under jax.checkpoint; ``equinox_checkpoints``:
    equinox's checkpointed scan with that many checkpoints, a treeverse/binomial schedule)."""
    keys = jax.random.split(jax.random.PRNGKey(3), 4)
    params = {"A": normal(keys[0], (width, width), 0.5 / np.sqrt(width)),
              "B": normal(keys[1], (width, width), 0.5 / np.sqrt(width)), "c": jnp.zeros(width)}
    h0, xs = normal(keys[2], (batch, width), 1.0), normal(keys[3], (steps, batch, width), 1.0)
    step = fresh(rnn_step)
    layers = [lbp.Layer(t, step, (t - 1, lbp.Row("xs", t - 1)), ("A", "B", "c")) for t in range(1, steps + 1)]
    net = lbp.Network(layers, [0, "xs"], lbp.Stack(range(1, steps + 1)) if every else steps)
    loss = lambda p, h0, xs: jnp.sum(net(p, h0, xs) ** 2)

    def scan_loss(p, h0, xs):
        body = lambda h, x: (step((p["A"], p["B"], p["c"]), h, x),) * 2
        if equinox_checkpoints is not None:
            import equinox.internal as eqxi  # the test extra installs equinox; only this row needs it

            last, hs = eqxi.scan(body, h0, xs, kind="checkpointed", checkpoints=equinox_checkpoints)
        else:
            last, hs = jax.lax.scan(jax.checkpoint(body) if checkpointed_reference else body, h0, xs)
        return jnp.sum((hs if every else last) ** 2)

    return loss, (params, h0, xs), scan_loss, (params, h0, xs)


def transformer(blocks: int, width: int, context: int, batch: int):
    """examples/transformer_lm.py's character-level GPT (two Row-stacked kinds, tied embeddings),
    next-token cross-entropy on random tokens. Reference: its lax.scan over the stacked blocks."""
    lm = example("transformer_lm")  # a fresh module: fresh layer functions, a cold compile
    params = lm.init(jax.random.PRNGKey(4), 96, context, width, blocks)
    tokens = jax.random.randint(jax.random.PRNGKey(5), (batch, context + 1), 0, 96)
    net = lm.network(blocks)

    def loss(p, t):
        return lm.cross_entropy(net, p, t)

    loss.net, loss.net_inputs = net, lambda p, t: (t[:, :-1],)  # its network and inputs, for eager_rows
    return (loss, (params, tokens),
            lambda p, t: lm.cross_entropy(lm.scan_forward, p, t), (params, tokens))


SKIP = 4  # the DAG's long skips reach SKIP blocks (kinds * SKIP layers) back


def kinds_dag(blocks: int, width: int, batch: int, kinds: int = 3):
    """Three kinds of layer per block k (residual, gated, skip; ``kinds=2``: residual, skip) and a
    long skip from the block output SKIP blocks back: kinds * blocks layers. Reference: lax.scan
    over blocks carrying a window of the last SKIP block outputs — the best jax.grad formulation
    we know for it."""
    keys = jax.random.split(jax.random.PRNGKey(1), 6)
    s = 0.5 / np.sqrt(width)
    p = {"A": normal(keys[0], (blocks, width, width), s), "a": jnp.zeros((blocks, width)),
         "C": normal(keys[2], (blocks, width, width), s), "S": normal(keys[3], (blocks, width, width), s)}
    if kinds == 3:
        p |= {"B": normal(keys[1], (blocks, width, width), s), "b": jnp.zeros((blocks, width))}
    x = normal(keys[4], (batch, width), 1.0)
    residual_, gated_, skip_ = fresh(residual), fresh(gated), fresh(skip)
    layers = []
    for k in range(blocks):
        prev = ("c", k - 1) if k else "x"
        back = ("c", k - SKIP) if k >= SKIP else "x"
        layers.append(lbp.Layer(("a", k), residual_, (prev,), (lbp.Row("A", k), lbp.Row("a", k))))
        if kinds == 3:
            layers.append(lbp.Layer(("b", k), gated_, (("a", k),), (lbp.Row("B", k), lbp.Row("b", k))))
        layers.append(lbp.Layer(("c", k), skip_, (layers[-1].name, back), (lbp.Row("C", k), lbp.Row("S", k))))
    net = lbp.Network(layers, ["x"], ("c", blocks - 1))
    loss = lambda p, x: jnp.sum(net(p, x) ** 2)

    def scan_loss(p, x):
        def step(window, w):
            u = residual_((w["A"], w["a"]), window[-1])
            if kinds == 3:
                u = gated_((w["B"], w["b"]), u)
            c = skip_((w["C"], w["S"]), u, window[0])
            return jnp.concatenate([window[1:], c[None]]), None

        window, _ = jax.lax.scan(step, jnp.broadcast_to(x, (SKIP, *x.shape)), p)
        return jnp.sum(window[-1] ** 2)

    return loss, (p, x), scan_loss, (p, x)


def shallow_dag(width: int = 256, batch: int = 256):
    """12 layers, three widths, skips and shared blocks. Reference: jax.grad of the same network
    (plain JAX: a Python loop over the layers, the natural way to write a shallow network)."""
    w = {"s": width // 2, "m": width, "l": 2 * width}
    spec = [  # name, reads, width, blocks
        ("h1", ("x",), "m", ("W1", "b_m")), ("h2", ("h1",), "l", ("W2", "b_l")),
        ("h3", ("h2",), "m", ("W3", "b_m")), ("h4", ("h3", "h1"), "m", ("W4", "V4")),
        ("h5", ("h4",), "s", ("W5", "b_s")), ("h6", ("h5",), "l", ("W6", "b_l")),
        ("h7", ("h6", "h2"), "l", ("W7", "V7")), ("h8", ("h7",), "m", ("W8", "b_m")),
        ("h9", ("h8", "h4"), "m", ("W9", "V9")), ("h10", ("h9",), "s", ("W10", "b_s")),
        ("h11", ("h10",), "s", ("Wsh", "b_s")), ("h12", ("h11",), "s", ("Wsh", "b_s")),
    ]
    width_of = {"x": "m"}
    layers, params = [], {}
    key = jax.random.PRNGKey(2)
    for name, reads, out, blocks in spec:
        width_of[name] = out
        if len(reads) == 1:
            fn = lambda th, u: jnp.tanh(u @ th[0] + th[1])
            shapes = [(w[width_of[reads[0]]], w[out]), (w[out],)]
        else:
            fn = lambda th, u, v: jnp.tanh(u @ th[0] + v @ th[1])
            shapes = [(w[width_of[reads[0]]], w[out]), (w[width_of[reads[1]]], w[out])]
        for block, shape in zip(blocks, shapes):
            key, sub = jax.random.split(key)
            init = normal(sub, shape, 1 / np.sqrt(shape[0])) if len(shape) == 2 else jnp.zeros(shape)
            params.setdefault(block, init)
        layers.append(lbp.Layer(name, fn, reads, blocks))
    net = lbp.Network(layers, ["x"], "h12")
    x = normal(key, (batch, w["m"]), 1.0)
    loss = lambda p, x: jnp.sum(net(p, x) ** 2)
    return loss, (params, x), loss, (params, x)
