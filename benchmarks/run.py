"""Benchmarks: grad_by_solve against jax.grad, side by side in one process.

    python benchmarks/run.py [--repeats 15] [--write-docs] [--quick]
        [--rows {all,gradients,curvature,headline,eager,capture,private,pinn,kfac,lm}]
        [--pinn-network {2-64-1,2-64-64-48-48-1}] [--pinn-seconds S]

Every timing row runs jit(grad_by_solve) and its reference jit(jax.grad) interleaved (medians of
``--repeats`` runs each) and prints the ratio: absolute times are not comparable across runs on a
noisy machine. Compile times are lower + compile of a freshly built network (the compile-and-scaling
rows: medians of three builds). Peak memory is temp + argument + output bytes
from ``compiled.memory_analysis()``. With ``--write-docs`` the tables replace those between the
markers in docs/performance.md (gradients, and where ℳ after the loop pays) and
docs/guides/curvature.md (curvature), and the headline rows those in README.md. ``--rows headline``
is the short list for an accelerator (README's rows and the ℳ-after-the-loop sweep, a few
minutes); on an accelerator ``--write-docs`` writes README's accelerator rows only, naming the
device, and leaves the CPU tables as they are. ``--rows pinn`` (not in ``all``: it takes
6 × ``--pinn-seconds`` of steps) trains the kfac-pinns Poisson problem of
examples/pinn_poisson.py with each method on the same budget (kfac-pinns' 300 s on 2-64-1,
1000 s on the deep-wide 2-64-64-48-48-1) and writes that network's table into
docs/guides/training.md. ``--rows kfac`` (not in ``all``, a few minutes) trains scikit-learn's
digits with ``lbp.kfac`` and Adam (benchmarks/kfac_rows.py) and writes its table there too;
``--rows lm`` (not in ``all``, under a minute) runs Levenberg–Marquardt against optimistix's
(benchmarks/lm_rows.py; optimistix installed by hand) and writes its table there.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import time
import types
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import linbackprop as lbp
from linbackprop._policy import POLICY

ROOT = Path(__file__).resolve().parents[1]

# -- the layers -------------------------------------------------------------------------------------


def residual(th, u):
    return u + jnp.tanh(u @ th[0] + th[1])


def gated(th, u):
    return u * jax.nn.sigmoid(u @ th[0] + th[1])


def skip(th, u, s):
    return u + jnp.tanh(u @ th[0] + s @ th[1])


def _fresh(fn):
    """A new function object with fn's code: JAX caches traces per function object, so every
    network built here compiles cold, as a user's first compile does."""
    return types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _normal(key, shape, scale):
    return jax.random.normal(key, shape, jnp.float32) * scale


# -- networks: (loss, args, reference loss, reference args, forward, forward args) -------------------


def chain(depth: int, width: int, batch: int, rows: bool = True):
    """u + tanh(uW + b), depth times. Reference: lax.scan over the stacked weights."""
    kw, kx = jax.random.split(jax.random.PRNGKey(0))
    ws, bs = _normal(kw, (depth, width, width), 0.5 / np.sqrt(width)), jnp.zeros((depth, width))
    x = _normal(kx, (batch, width), 1.0)
    if rows:
        blocks = lambda i: (lbp.Row("W", i - 1), lbp.Row("b", i - 1))
        params = {"W": ws, "b": bs}
    else:
        blocks = lambda i: (("W", i), ("b", i))
        params = {k: v for i in range(1, depth + 1) for k, v in ((("W", i), ws[i - 1]), (("b", i), bs[i - 1]))}
    layer = _fresh(residual)
    net = lbp.Network([lbp.Layer(i, layer, (i - 1,), blocks(i)) for i in range(1, depth + 1)], [0], depth)
    loss = lambda p, x: jnp.sum(net(p, x) ** 2)

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
    params = {"A": _normal(keys[0], (width, width), 0.5 / np.sqrt(width)),
              "B": _normal(keys[1], (width, width), 0.5 / np.sqrt(width)), "c": jnp.zeros(width)}
    h0, xs = _normal(keys[2], (batch, width), 1.0), _normal(keys[3], (steps, batch, width), 1.0)
    step = _fresh(rnn_step)
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
    spec = importlib.util.spec_from_file_location("transformer_lm", ROOT / "examples" / "transformer_lm.py")
    lm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lm)  # a fresh module: fresh layer functions, a cold compile
    params = lm.init(jax.random.PRNGKey(4), 96, context, width, blocks)
    tokens = jax.random.randint(jax.random.PRNGKey(5), (batch, context + 1), 0, 96)
    net = lm.network(blocks)
    return (lambda p, t: lm.cross_entropy(net, p, t), (params, tokens),
            lambda p, t: lm.cross_entropy(lm.scan_forward, p, t), (params, tokens))


SKIP = 4  # the DAG's long skips reach SKIP blocks (kinds * SKIP layers) back


def kinds_dag(blocks: int, width: int, batch: int, kinds: int = 3):
    """Three kinds of layer per block k (residual, gated, skip; ``kinds=2``: residual, skip) and a
    long skip from the block output SKIP blocks back: kinds * blocks layers. Reference: lax.scan
    over blocks carrying a window of the last SKIP block outputs — the best jax.grad formulation
    we know for it."""
    keys = jax.random.split(jax.random.PRNGKey(1), 6)
    s = 0.5 / np.sqrt(width)
    p = {"A": _normal(keys[0], (blocks, width, width), s), "a": jnp.zeros((blocks, width)),
         "C": _normal(keys[2], (blocks, width, width), s), "S": _normal(keys[3], (blocks, width, width), s)}
    if kinds == 3:
        p |= {"B": _normal(keys[1], (blocks, width, width), s), "b": jnp.zeros((blocks, width))}
    x = _normal(keys[4], (batch, width), 1.0)
    residual_, gated_, skip_ = _fresh(residual), _fresh(gated), _fresh(skip)
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
            init = _normal(sub, shape, 1 / np.sqrt(shape[0])) if len(shape) == 2 else jnp.zeros(shape)
            params.setdefault(block, init)
        layers.append(lbp.Layer(name, fn, reads, blocks))
    net = lbp.Network(layers, ["x"], "h12")
    x = _normal(key, (batch, w["m"]), 1.0)
    loss = lambda p, x: jnp.sum(net(p, x) ** 2)
    return loss, (params, x), loss, (params, x)


# -- measuring --------------------------------------------------------------------------------------


def compiled(fn: Callable, args: tuple):
    start = time.perf_counter()
    out = jax.jit(fn).lower(*args).compile()
    return out, time.perf_counter() - start


def memory(c) -> tuple[int, int]:
    """(peak, temp) bytes."""
    m = c.memory_analysis()
    return m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes, m.temp_size_in_bytes


def interleaved(runs: list, repeats: int) -> list[float]:
    times: list[list[float]] = [[] for _ in runs]
    for f, args in runs:
        jax.block_until_ready(f(*args))
    for _ in range(repeats):
        for n, (f, args) in enumerate(runs):
            start = time.perf_counter()
            jax.block_until_ready(f(*args))
            times[n].append(time.perf_counter() - start)
    return [float(np.median(t)) for t in times]


def timing_row(name: str, reference: str, made, repeats: int, grad=lbp.grad_by_solve) -> dict:
    loss, args, ref_loss, ref_args = made
    ours, c_ours = compiled(grad(loss), args)
    ref, c_ref = compiled(jax.grad(ref_loss), ref_args)
    fwd, _ = compiled(ref_loss, ref_args)
    t_ours, t_ref, t_fwd = interleaved([(ours, args), (ref, ref_args), (fwd, ref_args)], repeats)
    (p_ours, m_ours), (p_ref, m_ref) = memory(ours), memory(ref)
    row = {"network": name, "reference": reference, "ratio": t_ours / t_ref, "ours ms": t_ours * 1e3,
           "ref ms": t_ref * 1e3, "peak": p_ours / p_ref, "temp": m_ours / max(m_ref, 1), "grad/fwd": t_ours / t_fwd,
           "compile": (c_ours, c_ref)}
    print(row, flush=True)
    return row


def jvp_row(name: str, made, repeats: int) -> dict:
    """Forward mode: jvp_by_solve against jax.jvp of the reference, tangents all ones."""
    loss, (params, x), ref_loss, (ref_params, ref_x) = made
    ones = lambda tree: jax.tree.map(jnp.ones_like, tree)
    ours, c_ours = compiled(lambda p, t: lbp.jvp_by_solve(lambda q: loss(q, x), (p,), (t,)), (params, ones(params)))
    ref, c_ref = compiled(lambda p, t: jax.jvp(lambda q: ref_loss(q, ref_x), (p,), (t,)),
                          (ref_params, ones(ref_params)))
    fwd, _ = compiled(ref_loss, (ref_params, ref_x))
    t_ours, t_ref, t_fwd = interleaved([(ours, (params, ones(params))), (ref, (ref_params, ones(ref_params))),
                                        (fwd, (ref_params, ref_x))], repeats)
    (p_ours, m_ours), (p_ref, m_ref) = memory(ours), memory(ref)
    row = {"network": name, "reference": "jit(jax.jvp), lax.scan over stacked weights", "ratio": t_ours / t_ref,
           "ours ms": t_ours * 1e3, "ref ms": t_ref * 1e3, "peak": p_ours / p_ref, "temp": m_ours / max(m_ref, 1),
           "grad/fwd": t_ours / t_fwd, "compile": (c_ours, c_ref)}
    print(row, flush=True)
    return row


def cold_compile(build: Callable, grad: Callable = lbp.grad_by_solve, builds: int = 3) -> float:
    """Median lower + compile time of ``grad`` of ``build()``'s loss over fresh builds (one
    compile is too noisy to compare: single runs of the same row differed by 1.6x)."""
    times = []
    for _ in range(builds):
        loss, args = build()[:2]
        times.append(compiled(grad(loss), args)[1])
    return float(np.median(times))


def compile_rows(quick: bool) -> list[tuple[str, str, str]]:
    """(what, measured, target) rows about compile time (each a median of fresh builds)."""
    deep, shallow = (256, 32) if quick else (512, 64)
    out = []
    c_shallow = cold_compile(lambda: chain(shallow, 64, 8))
    c_deep = cold_compile(lambda: chain(deep, 64, 8))
    out.append((f"chain, compile(depth {deep}) / compile(depth {shallow})",
                f"{c_deep / c_shallow:.2f} ({c_deep:.2f} s / {c_shallow:.2f} s)", "<= 1.5"))
    c_ours = cold_compile(lambda: chain(128, 64, 8, rows=False))
    c_unrolled = cold_compile(lambda: chain(128, 64, 8, rows=False), jax.grad)
    c_rows = cold_compile(lambda: chain(128, 64, 8))
    out.append(("depth 128: compile grad_by_solve (`Row` blocks) / jax.grad of the unrolled network",
                f"{c_rows / c_unrolled:.2f} ({c_rows:.2f} s / {c_unrolled:.2f} s)", "<= 0.25"))
    out.append(("same, one block per layer (256 arrays to pack and unpack)",
                f"{c_ours / c_unrolled:.2f} ({c_ours:.2f} s / {c_unrolled:.2f} s)", "<= 0.25"))
    c_one = cold_compile(lambda: chain(256, 64, 8))
    for kinds, word in ((2, "two"), (3, "three")):
        blocks = 256 // kinds
        c_kinds = cold_compile(lambda: kinds_dag(blocks, 64, 8, kinds))
        out.append((f"{kinds * blocks} layers of {word} kinds with long skips / 256-layer one-kind chain, compile",
                    f"{c_kinds / c_one:.2f} ({c_kinds:.2f} s / {c_one:.2f} s)", "<= 1.5"))
    small, large = (30, 120) if quick else (42, 168)
    runs = []
    for b in (small, large):
        loss, args, _, _ = kinds_dag(b, 64, 8)
        runs.append((compiled(lbp.grad_by_solve(loss), args)[0], args))
    t_small, t_large = interleaved(runs, 7)
    out.append((f"three kinds, run time(depth {3 * large}) / run time(depth {3 * small})",
                f"{t_large / t_small:.2f} (depth ratio {large / small:.0f})", "linear in depth"))
    for row in out:
        print(row, flush=True)
    return out


# -- gradient rows ------------------------------------------------------------------------------------


def gradient_rows(repeats: int, names: tuple[str, ...] | None = None) -> list[dict]:
    """The gradient table's rows (or those whose name starts with one of ``names``); each network
    is built only when its row runs."""
    scan = "jit(jax.grad), lax.scan over stacked weights"
    eqx = "jit(jax.grad), equinox's checkpointed scan (45 checkpoints)"
    grad = lbp.grad_by_solve
    specs = [  # name, reference, network, options (grad: the transform; jvp: a forward-mode row)
        ("deep chain 128×128×64 (depth×width×batch), `Row` blocks (compute-bound: ℳΛ in the loop)", scan,
         lambda: chain(128, 128, 64), {}),
        ("same, one block per layer (dict of 256 arrays)", scan, lambda: chain(128, 128, 64, rows=False), {}),
        ("same, ℳ batched after the loop (`param_products=\"after\"`)", scan, lambda: chain(128, 128, 64),
         {"grad": lambda f: grad(f, param_products="after")}),
        ("same, `remat=True` (ℳΛ in the loop)", scan, lambda: chain(128, 128, 64),
         {"grad": lambda f: grad(f, remat=True)}),
        ("same, `remat=True`, ℳ batched after the loop", scan, lambda: chain(128, 128, 64),
         {"grad": lambda f: grad(f, remat=True, param_products="after")}),
        ("same, forward mode: `jvp_by_solve` (the substitution inside the forward loop; last column: jvp / "
         "forward)", None, lambda: chain(128, 128, 64), {"jvp": True}),
        ("deep narrow chain 512×32×8, `Row` blocks (latency-bound: ℳ after the loop)", scan,
         lambda: chain(512, 32, 8), {}),
        ("same, ℳΛ inside the loop", scan, lambda: chain(512, 32, 8),
         {"grad": lambda f: grad(f, param_products="in_loop")}),
        ("deep narrow DAG: 510 layers of three kinds, skips 12 layers back, width 32, batch 8",
         "jit(jax.grad), lax.scan over blocks carrying a window of states", lambda: kinds_dag(170, 32, 8), {}),
        ("shallow heterogeneous DAG: 12 layers, widths 128/256/512, skips, shared blocks, batch 256",
         "jit(jax.grad) of the same network", shallow_dag, {}),
        ("RNN, 2048 steps, width 64, batch 16: one stacked input (`Row(\"xs\", t)`), last state as output",
         "jit(jax.grad), lax.scan", lambda: rnn(2048, 64, 16), {}),
        ("same, every state as output (`Stack`)", "jit(jax.grad), lax.scan (ys)", lambda: rnn(2048, 64, 16, True),
         {}),
        ("same, last state, `checkpoints=45`", "jit(jax.grad), lax.scan", lambda: rnn(2048, 64, 16),
         {"grad": lambda f: grad(f, checkpoints=45)}),
        ("same, `checkpoints=45`", "jit(jax.grad), lax.scan of a `jax.checkpoint`-ed step",
         lambda: rnn(2048, 64, 16, checkpointed_reference=True), {"grad": lambda f: grad(f, checkpoints=45)}),
        ("same, `checkpoints=45`", "jit(jax.grad), equinox's checkpointed scan "
         "(`eqx.internal.scan(kind=\"checkpointed\", checkpoints=45)`, binomial schedule)",
         lambda: rnn(2048, 64, 16, equinox_checkpoints=45), {"grad": lambda f: grad(f, checkpoints=45)}),
        ("same, `checkpoints=45, schedule=\"nested\"` (levels chosen from the shapes: three of 7)", eqx,
         lambda: rnn(2048, 64, 16, equinox_checkpoints=45),
         {"grad": lambda f: grad(f, checkpoints=45, schedule="nested")}),
        ("RNN, 16384 steps, width 64, batch 16, `checkpoints=45` (evenly spaced)", eqx,
         lambda: rnn(16384, 64, 16, equinox_checkpoints=45),
         {"grad": lambda f: grad(f, checkpoints=45), "repeats": max(3, repeats // 3)}),
        ("same, `checkpoints=45, schedule=\"nested\"` (four levels of 7)", eqx,
         lambda: rnn(16384, 64, 16, equinox_checkpoints=45),
         {"grad": lambda f: grad(f, checkpoints=45, schedule="nested"), "repeats": max(3, repeats // 3)}),
        ("deep chain 128×128×64, `Row` blocks, `checkpoints=12`", scan, lambda: chain(128, 128, 64),
         {"grad": lambda f: grad(f, checkpoints=12)}),
        ("character-level GPT (examples/transformer_lm.py): 12 blocks = 26 layers of four kinds, width 128, "
         "context 64, batch 16, tied embeddings", "jit(jax.grad), lax.scan over stacked blocks",
         lambda: transformer(12, 128, 64, 16), {}),
        ("same, `remat=True`", "jit(jax.grad), lax.scan over stacked blocks", lambda: transformer(12, 128, 64, 16),
         {"grad": lambda f: grad(f, remat=True)}),
    ]
    rows = []
    for name, reference, build, options in specs:
        if names is not None and not name.startswith(names):
            continue
        if options.get("jvp"):
            rows.append(jvp_row(name, build(), repeats))
        else:
            rows.append(timing_row(name, reference, build(), options.get("repeats", repeats),
                                   options.get("grad", lbp.grad_by_solve)))
    return rows


def threshold_rows(repeats: int, depth: int = 128) -> list[tuple[str, str, str]]:
    """Where ℳ batched after the loop pays: chains of depth 128 timed with
    ``param_products="after"`` against ``"in_loop"`` (interleaved) over state sizes (width × batch),
    with the temporaries of both and what the rule (``param_products="auto"``) picks there; the
    last row counts the sizes where the rule picks the faster one (within 3 %)."""

    backend = jax.default_backend()
    shapes = [(64, 1), (32, 8), (64, 16), (16, 32), (32, 32), (128, 16), (16, 128), (64, 64), (128, 64), (256, 128)]
    if backend != "cpu":
        shapes += [(64, 1024), (512, 256), (512, 512), (1024, 512), (1024, 1024)]
    out, right = [], 0
    for width, batch in shapes:
        loss, args = chain(depth, width, batch)[:2]
        runs = [(compiled(lbp.grad_by_solve(loss, param_products=where), args)[0], args)
                for where in ("after", "in_loop")]
        after, in_loop = interleaved(runs, repeats)
        temps = [memory(c)[1] / 1e3 for c, _ in runs]
        picks_after = POLICY.after_loop_pays(width * batch, batch, backend)
        right += (after <= 1.03 * in_loop) if picks_after else (in_loop <= 1.03 * after)
        out.append((f"chain {depth}×{width}×{batch} ({width * batch} elements in {batch} rows): time, ℳ after the "
                    "loop / ℳΛ in the loop", f"{after / in_loop:.2f} ({after * 1e3:.2f} / {in_loop * 1e3:.2f} ms; "
                    f"temporaries {temps[0]:.0f} / {temps[1]:.0f} KB)",
                    "rule: after" if picks_after else "rule: in the loop"))
        print(out[-1], flush=True)
    out.append((f"sizes where the rule picks the faster (within 3 %) on {backend}", f"{right} of {len(shapes)}",
                f"{len(shapes)} of {len(shapes)}"))
    return out


# -- curvature ----------------------------------------------------------------------------------------


def gauss_newton_rows(repeats: int) -> list[tuple[str, str, str]]:
    """One Gauss–Newton step (10 CG iterations on G + λI, squared error) against the same step
    written with jax.linearize + jax.linear_transpose of the lax.scan network (the linearisation
    held once), and against recomputing the forward pass for every product (jax.jvp + jax.vjp)."""
    out = []
    for name, shape, target in (("deep narrow chain 512×32×8, `Row` blocks", (512, 32, 8), "<= 0.8"),
                                ("chain 128×128×64, `Row` blocks", (128, 128, 64), "<= 1.0")):
        _, (params, x), _, _ = chain(*shape)
        y = jnp.zeros_like(x)
        layer = _fresh(residual)

        def model(p, x, layer=layer):
            u, _ = jax.lax.scan(lambda u, wb: (layer(wb, u), None), x, (p["W"], p["b"]))
            return u

        net = lbp.Network([lbp.Layer(i, layer, (i - 1,), (lbp.Row("W", i - 1), lbp.Row("b", i - 1)))
                           for i in range(1, shape[0] + 1)], [0], shape[0])
        sq = lambda p, x, net=net: 0.5 * jnp.sum((net(p, x) - y) ** 2)
        damped = lambda mv: (lambda v: jax.tree.map(lambda a, b: a + 1e-2 * b, mv(v), v))

        def ours(p, x, sq=sq):
            _, grad, G = lbp.gauss_newton(sq)(p, x)
            return jax.scipy.sparse.linalg.cg(damped(G.mv), grad, maxiter=10)[0]

        def held(p, x, model=model):
            out, jvp = jax.linearize(lambda q: model(q, x), p)
            vjp = jax.linear_transpose(jvp, p)
            grad = vjp(out - y)[0]
            return jax.scipy.sparse.linalg.cg(damped(lambda v: vjp(jvp(v))[0]), grad, maxiter=10)[0]

        def recomputed(p, x, model=model):
            out, vjp = jax.vjp(lambda q: model(q, x), p)
            grad = vjp(out - y)[0]
            mv = lambda v: jax.vjp(lambda q: model(q, x), p)[1](jax.jvp(lambda q: model(q, x), (p,), (v,))[1])[0]
            return jax.scipy.sparse.linalg.cg(damped(mv), grad, maxiter=10)[0]

        args = (params, x)
        fns = [compiled(f, args)[0] for f in (ours, held, recomputed)]
        t_ours, t_held, t_recomputed = interleaved([(f, args) for f in fns], repeats)
        out.append((f"Gauss–Newton step, 10 CG iterations, {name}: `lbp.gauss_newton` / jax.linearize + "
                    f"linear_transpose (held once)", f"{t_ours / t_held:.2f} ({t_ours * 1e3:.1f} ms / "
                    f"{t_held * 1e3:.1f} ms)", target))
        out.append(("same / recomputing the forward pass per product (jax.jvp + jax.vjp)",
                    f"{t_ours / t_recomputed:.2f} ({t_recomputed * 1e3:.1f} ms)", "—"))
        print(out[-2:], flush=True)
    out.append(_cross_entropy_gauss_newton_row(repeats))
    print(out[-1], flush=True)
    return out


def _cross_entropy_gauss_newton_row(repeats: int, shape: tuple[int, int, int] = (512, 32, 8),
                                    classes: int = 10) -> tuple[str, str, str]:
    """The Gauss–Newton step above with the loss most users have: a 10-class head and softmax
    cross-entropy (H the softmax's Fisher, no longer the identity), against the same step written
    with jax.linearize of the lax.scan network and head, H from linearising the loss's gradient."""
    _, (params, x), _, _ = chain(*shape)
    depth, width, batch = shape
    params = {**params, "head": _normal(jax.random.PRNGKey(1), (width, classes), 1 / np.sqrt(width))}
    labels = jnp.arange(batch) % classes
    layer, head = _fresh(residual), lambda th, u: u @ th[0]
    net = lbp.Network([lbp.Layer(i, layer, (i - 1,), (lbp.Row("W", i - 1), lbp.Row("b", i - 1)))
                       for i in range(1, depth + 1)] + [lbp.Layer("logits", head, (depth,), ("head",))], [0], "logits")
    xent = lambda logits: optax.softmax_cross_entropy_with_integer_labels(logits, labels).sum()
    damped = lambda mv: (lambda v: jax.tree.map(lambda a, b: a + 1e-2 * b, mv(v), v))

    def model(p, x):
        u, _ = jax.lax.scan(lambda u, wb: (layer(wb, u), None), x, (p["W"], p["b"]))
        return u @ p["head"]

    def ours(p, x):
        _, grad, G = lbp.gauss_newton(lambda q, x: xent(net(q, x)))(p, x)
        return jax.scipy.sparse.linalg.cg(damped(G.mv), grad, maxiter=10)[0]

    def held(p, x):
        out, jvp = jax.linearize(lambda q: model(q, x), p)
        vjp = jax.linear_transpose(jvp, p)
        g_out, hvp = jax.linearize(jax.grad(xent), out)
        grad = vjp(g_out)[0]
        return jax.scipy.sparse.linalg.cg(damped(lambda v: vjp(hvp(jvp(v)))[0]), grad, maxiter=10)[0]

    args = (params, x)
    fns = [compiled(f, args)[0] for f in (ours, held)]
    t_ours, t_held = interleaved([(f, args) for f in fns], repeats)
    return (f"same with a {classes}-class head and softmax cross-entropy, deep narrow chain {depth}×{width}×{batch}: "
            f"`lbp.gauss_newton` / jax.linearize + linear_transpose (held once)",
            f"{t_ours / t_held:.2f} ({t_ours * 1e3:.1f} ms / {t_held * 1e3:.1f} ms)", "<= 0.8")


def per_example_rows(repeats: int) -> list[tuple[str, str, str]]:
    """12 residual layers, width 128, batch 256: per-example gradients against jax.vmap(jax.grad)
    (time) and per-example norms against vmap-then-norm (temporaries); the exact GGN diagonal with
    10 classes against one gradient's time."""
    depth, width, batch, classes = 12, 128, 256, 10
    keys = jax.random.split(jax.random.PRNGKey(6), 4)
    layer, head_fn = _fresh(residual), lambda th, u: u @ th[0]
    layers = [lbp.Layer(i, layer, (i - 1,), (lbp.Row("W", i - 1), lbp.Row("b", i - 1))) for i in range(1, depth + 1)]
    net = lbp.Network([*layers, lbp.Layer("logits", head_fn, (depth,), ("head",))], [0], "logits")
    params = {"W": _normal(keys[0], (depth, width, width), 0.5 / np.sqrt(width)), "b": jnp.zeros((depth, width)),
              "head": _normal(keys[1], (width, classes), 1 / np.sqrt(width))}
    x = _normal(keys[2], (batch, width), 1.0)
    labels = jax.random.randint(keys[3], (batch,), 0, classes)

    def losses(p, x, labels):
        logp = jax.nn.log_softmax(net(p, x), axis=-1)
        return -jnp.take_along_axis(logp, labels[:, None], axis=1)[:, 0]

    single = lambda p, x, y: losses(p, x[None], y[None])[0]
    vmapped = lambda p, x, y: jax.vmap(jax.grad(single), in_axes=(None, 0, 0))(p, x, y)
    norms_ref = lambda p, x, y: jnp.sqrt(sum(jnp.sum(g.reshape(batch, -1) ** 2, axis=1)
                                            for g in jax.tree.leaves(vmapped(p, x, y))))
    mean_loss = lambda p, x, y: jnp.mean(losses(p, x, y))
    args = (params, x, labels)
    ours_g, _ = compiled(lbp.per_example_grads(losses), args)
    ref_g, _ = compiled(vmapped, args)
    ours_n, _ = compiled(lbp.per_example_grad_norms(losses), args)
    ref_n, _ = compiled(norms_ref, args)
    diag, _ = compiled(lbp.diag_ggn(mean_loss), args)
    grad, _ = compiled(lbp.grad_by_solve(mean_loss), args)
    t = interleaved([(ours_g, args), (ref_g, args), (ours_n, args), (ref_n, args), (diag, args), (grad, args)],
                    repeats)
    rows = [("per-example gradients, 12 residual layers width 128 + 10-class head, batch 256: "
             "`per_example_grads` / jax.vmap(jax.grad)", f"{t[0] / t[1]:.2f} ({t[0] * 1e3:.1f} ms / "
             f"{t[1] * 1e3:.1f} ms)", "<= 1.0"),
            ("same, norms: `per_example_grad_norms` temporaries / vmap-then-norm's",
             f"{memory(ours_n)[1] / memory(ref_n)[1]:.2f} (time {t[2] / t[3]:.2f}×)", "<= 0.5"),
            ("exact GGN diagonal (`diag_ggn`, 10 classes) / one gradient (`grad_by_solve`)",
             f"{t[4] / t[5]:.1f} ({t[4] * 1e3:.1f} ms / {t[5] * 1e3:.1f} ms)", "<= 12")]
    for row in rows:
        print(row, flush=True)
    return rows


def private_cases():
    """Per-example losses for the DP-SGD rows, each with its single-example form for
    ``jax.vmap(jax.grad)`` (the vmap axes of its arguments): the docs' 12 residual layers (width
    128, 10 classes, batch 256), an RNN with its recurrent weight shared over 64 steps reading
    Row("xs", t) (width 64, batch 64), and examples/transformer_lm.py's 12-block GPT with tied
    embeddings (width 128, context 64, batch 16)."""
    keys = jax.random.split(jax.random.PRNGKey(8), 8)
    depth, width, batch, classes = 12, 128, 256, 10
    layer, head_fn = _fresh(residual), lambda th, u: u @ th[0]
    layers = [lbp.Layer(i, layer, (i - 1,), (lbp.Row("W", i - 1), lbp.Row("b", i - 1))) for i in range(1, depth + 1)]
    net = lbp.Network([*layers, lbp.Layer("logits", head_fn, (depth,), ("head",))], [0], "logits")
    params = {"W": _normal(keys[0], (depth, width, width), 0.5 / np.sqrt(width)), "b": jnp.zeros((depth, width)),
              "head": _normal(keys[1], (width, classes), 1 / np.sqrt(width))}
    x, labels = _normal(keys[2], (batch, width), 1.0), jax.random.randint(keys[3], (batch,), 0, classes)

    def residual_losses(p, x, labels, net=net):
        logp = jax.nn.log_softmax(net(p, x), axis=-1)
        return -jnp.take_along_axis(logp, labels[:, None], axis=1)[:, 0]

    steps, rwidth, rbatch = 64, 64, 64
    step = _fresh(rnn_step)
    rlayers = [lbp.Layer(t, step, (t - 1, lbp.Row("xs", t - 1)), ("A", "B", "c")) for t in range(1, steps + 1)]
    rnet = lbp.Network(rlayers, [0, "xs"], lbp.Stack(range(1, steps + 1)))
    rparams = {"A": _normal(keys[4], (rwidth, rwidth), 0.9 / np.sqrt(rwidth)),
               "B": _normal(keys[5], (rwidth, rwidth), 1 / np.sqrt(rwidth)), "c": jnp.zeros(rwidth)}
    h0, xs = jnp.zeros((rbatch, rwidth)), _normal(keys[6], (steps, rbatch, rwidth), 1.0)
    rnn_losses = lambda p, h0, xs: jnp.mean(rnet(p, h0, xs) ** 2, axis=(0, 2))  # states [T, B, W]

    spec = importlib.util.spec_from_file_location("transformer_lm", ROOT / "examples" / "transformer_lm.py")
    lm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lm)
    gpt, gparams = lm.network(12), lm.init(jax.random.PRNGKey(4), 96, 64, 128, 12)
    tokens = jax.random.randint(jax.random.PRNGKey(5), (16, 65), 0, 96)

    def gpt_losses(p, t):
        return optax.softmax_cross_entropy_with_integer_labels(gpt(p, t[:, :-1]), t[:, 1:]).mean(axis=1)

    return [("12 residual layers width 128 + 10-class head, batch 256", residual_losses, (params, x, labels),
             (None, 0, 0)),
            ("RNN, weight shared over 64 steps (Row(\"xs\", t)), width 64, batch 64", rnn_losses, (rparams, h0, xs),
             (None, 0, 1)),
            ("12-block GPT, tied embeddings, width 128, context 64, batch 16", gpt_losses, (gparams, tokens),
             (None, 0))]


def private_rows(repeats: int) -> list[tuple[str, str, str]]:
    """DP-SGD's clipped sum, side by side in one process: `clipped_grad` against a
    `grad_by_solve` step of the mean loss (time and temporaries), and the same clipped sum by
    `jax.vmap(jax.grad)` and by jax-privacy's `clipping.clipped_grad` (where installed:
    ``pip install jax-privacy``, a benchmark-only dependency)."""
    try:
        from jax_privacy import clipping as jax_privacy_clipping
    except ImportError:
        jax_privacy_clipping = None
    rows = []
    for name, losses, args, axes in private_cases():
        clip = 1.0
        mean = lambda *a, losses=losses: jnp.mean(losses(*a))

        def single(p, *example, losses=losses, axes=axes):
            one = [jnp.expand_dims(e, ax) for e, ax in zip(example, axes[1:])]
            return losses(p, *one)[0]

        def vmapped(p, *data, single=single, axes=axes):
            grads = jax.vmap(jax.grad(single), in_axes=axes)(p, *data)
            norms = jnp.sqrt(sum(jnp.sum(g.reshape(g.shape[0], -1) ** 2, axis=1) for g in jax.tree.leaves(grads)))
            w = jnp.minimum(1.0, clip / norms)
            return jax.tree.map(lambda g: jnp.einsum("b,b...->...", w, g), grads), norms

        fns = {"ours": lbp.clipped_grad(losses, clip), "grad": lbp.grad_by_solve(mean), "vmap": vmapped}
        if jax_privacy_clipping is not None and all(a == 0 for a in axes[1:]):  # its batch axis is 0
            fns["jax-privacy"] = jax_privacy_clipping.clipped_grad(
                lambda p, *data, losses=losses: jnp.sum(losses(p, *data)), l2_clip_norm=clip,
                batch_argnums=tuple(range(1, len(args))))
        built = {k: compiled(f, args)[0] for k, f in fns.items()}
        # ours and the gradient side by side, the references after: run between them, their
        # hundreds of MB leave the caches cold for whichever step comes next
        times = dict(zip(("ours", "grad"), interleaved([(built["ours"], args), (built["grad"], args)], repeats)))
        references = [k for k in built if k not in ("ours", "grad")]
        slow = interleaved([(built[k], args) for k in (*references, "grad")], max(3, repeats // 3))
        times |= dict(zip(references, slow))
        reference_grad = slow[-1]  # the gradient beside the references
        temps = {k: memory(c)[1] for k, c in built.items()}
        norms, ref_norms = built["ours"](*args)[1], built["vmap"](*args)[1]
        error = float(jnp.max(jnp.abs(norms - ref_norms) / ref_norms))
        target = "<= 1.5" if name.startswith("12 residual") else "<= 2"
        rows.append((f"{name}: `clipped_grad` / `grad_by_solve` step", f"{times['ours'] / times['grad']:.2f} "
                     f"({times['ours'] * 1e3:.1f} / {times['grad'] * 1e3:.1f} ms)", target))
        rows.append(("same, temporaries / the gradient's", f"{temps['ours'] / max(temps['grad'], 1):.2f} "
                     f"({temps['ours'] / 2**20:.1f} / {temps['grad'] / 2**20:.1f} MiB)", "<= 2"))
        rows.append(("same, jax.vmap(jax.grad) DP step / `grad_by_solve` step",
                     f"{times['vmap'] / reference_grad:.2f} ({times['vmap'] * 1e3:.1f} ms; norms agree to "
                     f"{error:.0e})", "—"))
        if "jax-privacy" in times:
            rows.append(("same, jax-privacy `clipping.clipped_grad` / `grad_by_solve` step",
                         f"{times['jax-privacy'] / reference_grad:.2f} ({times['jax-privacy'] * 1e3:.1f} ms)", "—"))
        for row in rows[len(rows) - (4 if "jax-privacy" in times else 3):]:
            print(row, flush=True)
    return rows


def captured_transformer(blocks: int, width: int, context: int, batch: int):
    """examples/transformer_lm.py's GPT as plain JAX — attention and MLP as ``@lbp.layer``
    functions, a ``lax.scan`` over the stacked blocks — differentiated with ``layers=``, beside the
    same model built by hand as a Network (``transformer``)."""
    spec = importlib.util.spec_from_file_location("transformer_lm", ROOT / "examples" / "transformer_lm.py")
    lm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lm)
    params = lm.init(jax.random.PRNGKey(4), 96, context, width, blocks)
    tokens = jax.random.randint(jax.random.PRNGKey(5), (batch, context + 1), 0, 96)
    attention, mlp = lbp.layer(lm.attention), lbp.layer(lm.mlp)

    def forward(p, t):
        x = lm.embed((p["wte"], p["wpe"]), t)
        x, _ = jax.lax.scan(lambda x, b: (mlp((b[1],), attention((b[0],), x)), None), x, (p["attn"], p["mlp"]))
        return lm.logits((p["ln_f"], p["wte"]), x)

    return (lambda p, t: lm.cross_entropy(forward, p, t)), (params, tokens), (attention, mlp)


def capture_rows(repeats: int) -> list[tuple[str, str, str]]:
    """The 12-block GPT found by ``layers=`` in plain JAX against the same GPT built by hand as a
    Network: run time (interleaved medians) and cold compile time (medians of fresh builds)."""
    builds = 3
    hand = [compiled(lbp.grad_by_solve(made[0]), made[1]) for made in (transformer(12, 128, 64, 16)
                                                                       for _ in range(builds))]
    found = []
    for _ in range(builds):
        loss, args, layers = captured_transformer(12, 128, 64, 16)
        found.append((compiled(lbp.grad_by_solve(loss, layers=layers), args), args))
    args = transformer(12, 128, 64, 16)[1]
    t_found, t_hand = interleaved([(found[-1][0][0], found[-1][1]), (hand[-1][0], args)], repeats)
    c_found = float(np.median([c for (_, c), _ in found]))
    c_hand = float(np.median([c for _, c in hand]))
    rows = [("12-block GPT, `layers=(attention, mlp)` over plain JAX (a lax.scan) / built by hand: run",
             f"{t_found / t_hand:.2f} ({t_found * 1e3:.1f} / {t_hand * 1e3:.1f} ms)", "<= 1.1"),
            ("same, compile (lower + compile, medians of fresh builds)",
             f"{c_found / c_hand:.2f} ({c_found:.2f} / {c_hand:.2f} s)", "<= 1.1")]
    rows += nnx_gpt_rows(repeats)
    from gru_rows import gru_rows  # benchmarks/ is the script's directory

    rows += gru_rows(repeats, interleaved)
    for row in rows:
        print(row, flush=True)
    return rows


def nnx_gpt_rows(repeats: int, blocks: int = 6, width: int = 128, context: int = 64, batch: int = 16):
    """examples/flax_gpt.py's flax nnx GPT as written (a Python loop over an nnx.List, dropout 0.1,
    tied embedding through a Head module): `value_and_grad_by_solve(layers=...)` against
    `nnx.value_and_grad` of the same model, each a pure function of the split state (the dropout
    streams advance in both), run (interleaved medians) and cold compile (medians of fresh builds)."""
    from flax import nnx

    spec = importlib.util.spec_from_file_location("flax_gpt", ROOT / "examples" / "flax_gpt.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    model = example.GPT(96, context, width, 4, blocks, 0.1, nnx.Rngs(0, dropout=1))
    graphdef, state = nnx.split(model)
    tokens = jax.random.randint(jax.random.PRNGKey(5), (batch, context + 1), 0, 96)

    def step_of(value_and_grad):
        def step(state, tokens):
            module = nnx.merge(graphdef, state)
            value, grads = value_and_grad(example.loss)(module, tokens)
            return value, grads, nnx.state(module)
        return step

    ours = lambda: step_of(lambda f: lbp.value_and_grad_by_solve(f, layers=example.LAYERS))
    theirs = lambda: step_of(nnx.value_and_grad)
    builds = 3
    c_ours = [compiled(ours(), (state, tokens)) for _ in range(builds)]
    c_theirs = [compiled(theirs(), (state, tokens)) for _ in range(builds)]
    t_ours, t_theirs = interleaved([(c_ours[-1][0], (state, tokens)), (c_theirs[-1][0], (state, tokens))], repeats)
    c_o, c_t = float(np.median([c for _, c in c_ours])), float(np.median([c for _, c in c_theirs]))
    rows = [(f"flax nnx GPT as written ({blocks} blocks, width {width}, dropout; examples/flax_gpt.py), "
             "`layers=(Attention, Mlp, Head)` / `nnx.value_and_grad`: run",
             f"{t_ours / t_theirs:.2f} ({t_ours * 1e3:.1f} / {t_theirs * 1e3:.1f} ms)", "—"),
            ("same, compile (lower + compile, medians of fresh builds)",
             f"{c_o / c_t:.2f} ({c_o:.2f} / {c_t:.2f} s)", "—")]
    for row in rows:
        print(row, flush=True)
    return rows


def eager_rows(repeats: int) -> list[tuple[str, str, str]]:
    """Outside the user's jit every call that enters the solve traces each kind of layer once
    more, to find a stale plan (a global a layer reads changed): that check's time against an
    eager grad_by_solve step (no jit of the user's) and an eager jax.grad step."""
    from linbackprop import _call, _traced

    rows = []
    for name, made in (("chain 16×64×32", lambda: chain(16, 64, 32)),
                       ("deep chain 128×128×64", lambda: chain(128, 128, 64)),
                       ("character-level GPT, 12 blocks", lambda: transformer(12, 128, 64, 16))):
        loss, args, ref_loss, ref_args = made()
        ours, ref = lbp.grad_by_solve(loss), jax.grad(ref_loss)
        plans = []
        original = _call.current_plan  # the plan each network call checks, as network_call finds it

        def spy(net, theta, inputs, engine="auto", policy=POLICY):
            plan = original(net, theta, inputs, engine, policy)
            plans.append(plan)
            return plan

        _call.current_plan = spy
        try:
            jax.block_until_ready(ours(*args))
        finally:
            _call.current_plan = original
        plan = plans[-1]

        def check():
            return [_traced.computation_of(layer, th, ins) != was for layer, th, ins, was in plan.computations]

        t_check, t_ours, t_ref = interleaved([(check, ()), (ours, args), (ref, ref_args)], repeats)
        kinds = len(plan.computations)
        rows.append((f"{name}: the check, {kinds} kind{'s' * (kinds > 1)}", f"{t_check * 1e3:.1f} ms",
                     f"{t_check / t_ours:.0%} of an eager grad_by_solve step ({t_ours * 1e3:.0f} ms; "
                     f"eager jax.grad {t_ref * 1e3:.0f} ms)"))
        print(rows[-1], flush=True)
    return rows


PINN_SECONDS = {"2-64-1": 300.0, "2-64-64-48-48-1": 1000.0}  # kfac-pinns' budgets


def pinn_rows(network: str, seconds: float) -> list[tuple[str, str, str]]:
    """Each method of examples/pinn_poisson.py on the same step-time budget (float64)."""
    spec = importlib.util.spec_from_file_location("pinn_poisson", ROOT / "examples" / "pinn_poisson.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    widths = network.split("-")[1:-1]
    params, _, _, _, scale = example.make_problem(tuple(map(int, widths)))
    size = sum(x.size for x in jax.tree.leaves(params))
    result = example.main(["--seconds", str(seconds), "--widths", ",".join(widths), "--out", ""])
    best_adam = min((v, k) for k, v in result.items() if k.startswith("Adam"))
    rows = []
    for name, error in result.items():
        if not name.startswith("Adam") or name == best_adam[1]:
            label = f"{name} (best of three rates)" if name.startswith("Adam") else name
            rows.append((f"{network} ({size} parameters): {label}", f"{error:.2e} ({error / scale:.2e})",
                         f"{seconds:g} s"))
    return rows


def tables(timing: list[dict], compile_: list[tuple[str, str, str]]) -> str:
    lines = ["| network | reference | run ratio | solve ms | ref ms | compile s (solve / ref) | peak memory ratio "
             "| temp memory ratio | grad / forward |", "|---|---|---|---|---|---|---|---|---|"]
    for r in timing:
        lines.append(f"| {r['network']} | {r['reference']} | **{r['ratio']:.2f}** | {r['ours ms']:.2f} | "
                     f"{r['ref ms']:.2f} | {r['compile'][0]:.2f} / {r['compile'][1]:.2f} | {r['peak']:.2f} | "
                     f"{r['temp']:.2f} | {r['grad/fwd']:.2f} |")
    lines += ["", "| compile and scaling | measured | target |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in compile_]
    return "\n".join(lines)


def small_table(title: str, rows: list[tuple[str, str, str]], third: str = "target") -> str:
    return "\n".join([f"| {title} | measured | {third} |", "|---|---|---|",
                      *(f"| {a} | {b} | {c} |" for a, b, c in rows)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--write-docs", action="store_true",
                        help="write the tables into docs/performance.md, docs/guides/curvature.md and README.md "
                             "(on an accelerator: README's accelerator rows only)")
    parser.add_argument("--quick", action="store_true", help="smaller compile-scaling rows (a smoke test)")
    parser.add_argument("--pinn-network", choices=list(PINN_SECONDS), default="2-64-1", help="--rows pinn: the MLP")
    parser.add_argument("--pinn-seconds", type=float, help="--rows pinn: seconds of steps per method "
                                                           "(default: kfac-pinns' budget for the network)")
    parser.add_argument("--rows", choices=["all", "gradients", "curvature", "headline", "eager", "capture", "private",
                                           "pinn", "kfac", "lm"],
                        default="all",
                        help="which tables to measure (and write); headline: README's rows and where ℳ after the "
                             "loop stops paying, the short list for an accelerator")
    args = parser.parse_args()
    r = args.repeats
    on_cpu = jax.default_backend() == "cpu"
    if args.rows == "headline":
        timing, threshold = gradient_rows(r, HEADLINE), threshold_rows(r)
        print(headline(timing), small_table("where ℳ after the loop pays", threshold), sep="\n\n")
        if args.write_docs:
            _write_headline(timing, threshold, args.rows, on_cpu)
        return
    if args.rows == "pinn":
        seconds = args.pinn_seconds or PINN_SECONDS[args.pinn_network]
        text = small_table("Poisson PINN, L2 error (relative) after the budget",
                           pinn_rows(args.pinn_network, seconds), "budget")
        print(text)
        if args.write_docs and on_cpu:
            flags = f" --pinn-network {args.pinn_network}" + (f" --pinn-seconds {seconds:g}" * bool(args.pinn_seconds))
            _write_between(ROOT / "docs" / "guides" / "training.md", f"pinn table {args.pinn_network}", text,
                           args.rows, flags)
        return
    if args.rows == "kfac":
        from kfac_rows import kfac_rows  # benchmarks/ is the script's directory

        text = small_table("K-FAC on scikit-learn's digits", kfac_rows(r, interleaved))
        print(text)
        if args.write_docs and on_cpu:
            _write_between(ROOT / "docs" / "guides" / "training.md", "kfac table", text, args.rows)
        return
    if args.rows == "lm":
        from lm_rows import lm_rows

        text = small_table("Levenberg–Marquardt against optimistix", lm_rows(min(r, 5)))
        print(text)
        if args.write_docs and on_cpu:
            _write_between(ROOT / "docs" / "guides" / "training.md", "lm table", text, args.rows)
        return
    if args.rows in ("all", "private"):
        text = small_table("DP-SGD's clipped sum", private_rows(r))
        print(text)
        if args.write_docs and on_cpu:
            _write_between(ROOT / "docs" / "performance.md", "private table", text, args.rows)
        if args.rows == "private":
            return
    if args.rows in ("all", "capture"):
        text = small_table("a model as it is (`layers=`)", capture_rows(r))
        print(text)
        if args.write_docs and on_cpu:
            _write_between(ROOT / "docs" / "performance.md", "capture table", text, args.rows)
        if args.rows == "capture":
            return
    if args.rows in ("all", "eager"):
        text = small_table("the staleness check outside jit", eager_rows(r), "against")
        print(text)
        if args.write_docs and on_cpu:
            _write_between(ROOT / "docs" / "performance.md", "eager table", text, args.rows)
        if args.rows == "eager":
            return
    if args.rows in ("all", "curvature"):
        curvature = gauss_newton_rows(r) + per_example_rows(r)
        text = small_table("curvature", curvature)
        print(text)
        if args.write_docs and on_cpu:
            _write_between(ROOT / "docs" / "guides" / "curvature.md", "curvature table", text, args.rows)
        if args.rows == "curvature":
            return
    timing, threshold = gradient_rows(r), threshold_rows(r)
    text = tables(timing, compile_rows(args.quick))
    print(text, small_table("where ℳ after the loop pays", threshold), sep="\n\n")
    if args.write_docs:
        if on_cpu:
            _write_between(ROOT / "docs" / "performance.md", "benchmark table", text, args.rows)
        _write_headline(timing, threshold, args.rows, on_cpu)


def _write_headline(timing: list[dict], threshold: list[tuple[str, str, str]], rows: str, on_cpu: bool) -> None:
    """README's headline rows (CPU) or accelerator rows (elsewhere, with the threshold sweep), and
    the sweep in docs/performance.md (CPU)."""
    sweep = small_table("where ℳ after the loop pays", threshold)
    if on_cpu:
        _write_between(ROOT / "README.md", "headline rows", headline(timing), rows)
        _write_between(ROOT / "docs" / "performance.md", "threshold table", sweep, rows)
    else:
        _write_between(ROOT / "README.md", "accelerator rows", f"{headline(timing)}\n\n{sweep}", rows)


# The README's rows: one per regime (compute-bound, latency-bound, several kinds, a sequence, a transformer).
HEADLINE = ("deep chain 128×128×64 (depth×width×batch)", "deep narrow chain 512×32×8", "deep narrow DAG",
            "RNN, 2048 steps", "character-level GPT")


def headline(timing: list[dict]) -> str:
    lines = ["| network | time / `jax.grad` over `lax.scan` | peak memory ratio | compile s (solve / ref) |",
             "|---|---|---|---|"]
    for r in timing:
        if r["network"].startswith(HEADLINE):
            short = r["network"].split(" (", 1)[0].split(":", 1)[0]
            lines.append(f"| {short} | **{r['ratio']:.2f}** | {r['peak']:.2f} | "
                         f"{r['compile'][0]:.2f} / {r['compile'][1]:.2f} |")
    return "\n".join(lines)


def _write_between(path: Path, marker: str, text: str, rows: str, flags: str = "") -> None:
    """Replace what ``path`` holds between ``<!-- marker -->`` and ``<!-- /marker -->``."""
    flag = ("" if rows == "all" else f" --rows {rows}") + flags
    device = jax.devices()[0]
    where = "CPU" if device.platform == "cpu" else f"{device.platform.upper()} ({device.device_kind})"
    block = (f"<!-- {marker} -->\n`python benchmarks/run.py --write-docs{flag}` on "
             f"{where} ({'float64' if jax.config.jax_enable_x64 else 'float32'}), jax {jax.__version__}:\n\n{text}\n"
             f"<!-- /{marker} -->")
    content, found = re.subn(f"<!-- {marker} -->.*<!-- /{marker} -->", lambda _: block, path.read_text(), flags=re.S)
    if not found:
        raise SystemExit(f"{path} has no <!-- {marker} --> ... <!-- /{marker} --> markers")
    path.write_text(content)


if __name__ == "__main__":
    main()
