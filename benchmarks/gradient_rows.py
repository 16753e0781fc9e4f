"""Gradient rows: ``grad_by_solve`` / ``jvp_by_solve`` against ``jax.grad`` / ``jax.jvp`` of the same
model, compile time and scaling, and where ℳ after the loop pays."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import linbackprop as lbp
from linbackprop._options._policy import POLICY

from .models import chain, kinds_dag, rnn, shallow_dag, transformer
from .timing import compiled, interleaved, memory


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
