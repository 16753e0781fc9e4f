"""Rows of models as written (``layers=``): the captured GPT, the nnx GPT, the equinox GRU, and the
staleness check outside jit."""

from __future__ import annotations

import jax
import numpy as np

import linbackprop as lbp

from . import example
from .gru_rows import gru_rows
from .models import chain, transformer
from .timing import compiled, interleaved


def captured_transformer(blocks: int, width: int, context: int, batch: int):
    """examples/transformer_lm.py's GPT as plain JAX — attention and MLP as ``@lbp.layer``
    functions, a ``lax.scan`` over the stacked blocks — differentiated with ``layers=``, beside the
    same model built by hand as a Network (``transformer``)."""
    lm = example("transformer_lm")
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
    rows += gru_rows(repeats)
    for row in rows:
        print(row, flush=True)
    return rows


def nnx_gpt_rows(repeats: int, blocks: int = 6, width: int = 128, context: int = 64, batch: int = 16):
    """examples/flax_gpt.py's flax nnx GPT as written (a Python loop over an nnx.List, dropout 0.1,
    tied embedding through a Head module): `value_and_grad_by_solve(layers=...)` against
    `nnx.value_and_grad` of the same model, each a pure function of the split state (the dropout
    streams advance in both), run (interleaved medians) and cold compile (medians of fresh builds)."""
    from flax import nnx

    flax_gpt = example("flax_gpt")
    model = flax_gpt.GPT(96, context, width, 4, blocks, 0.1, nnx.Rngs(0, dropout=1))
    graphdef, state = nnx.split(model)
    tokens = jax.random.randint(jax.random.PRNGKey(5), (batch, context + 1), 0, 96)

    def step_of(value_and_grad):
        def step(state, tokens):
            module = nnx.merge(graphdef, state)
            value, grads = value_and_grad(flax_gpt.loss)(module, tokens)
            return value, grads, nnx.state(module)
        return step

    ours = lambda: step_of(lambda f: lbp.value_and_grad_by_solve(f, layers=flax_gpt.LAYERS))
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
    more, to find a stale plan (a global a layer reads changed): that check's work — each kind's
    layer traced at its shapes, its jaxpr printed and its constants compared — timed here from
    the network's public parts (its layers and `Network.states`' shapes), against an eager
    grad_by_solve step (no jit of the user's) and an eager jax.grad step."""
    rows = []
    for name, made in (("chain 16×64×32", lambda: chain(16, 64, 32)),
                       ("deep chain 128×128×64", lambda: chain(128, 128, 64)),
                       ("character-level GPT, 12 blocks", lambda: transformer(12, 128, 64, 16))):
        loss, args, ref_loss, ref_args = made()
        ours, ref = lbp.grad_by_solve(loss), jax.grad(ref_loss)
        net, params, inputs = loss.net, args[0], loss.net_inputs(*args)
        names = [*net.inputs, *(layer.name for layer in net.layers)]  # (keys of mixed types: a list)
        states = dict(zip(names, jax.eval_shape(lambda p, *i: [net.states(p, *i)[n] for n in names],
                                                params, *inputs)))
        kinds = {}
        for layer in net.layers:  # one per function and shapes, as the plan's kinds
            theta = tuple(jax.tree.map(lambda x, p=p: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), params[p.block])
                          if isinstance(p, lbp.Row) else jax.eval_shape(lambda q=p: params[q]) for p in layer.params)
            ins = tuple(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), states[r.block])
                        if isinstance(r, lbp.Row) else states[r] for r in layer.reads)
            kinds.setdefault((layer.fn, str(jax.tree.map(lambda x: (x.shape, x.dtype), (theta, ins)))),
                             (layer, theta, ins))

        def trace(layer, theta, ins):
            closed = jax.make_jaxpr(lambda t, *u: layer.fn(t, *u))(theta, *ins)
            return str(closed.jaxpr), [np.asarray(c) for c in closed.consts if hasattr(c, "shape")]

        was = [trace(*kind) for kind in kinds.values()]

        def check():
            return [trace(*kind)[0] != w[0] for kind, w in zip(kinds.values(), was)]

        t_check, t_ours, t_ref = interleaved([(check, ()), (ours, args), (ref, ref_args)], repeats)
        rows.append((f"{name}: the check, {len(kinds)} kind{'s' * (len(kinds) > 1)}", f"{t_check * 1e3:.1f} ms",
                     f"{t_check / t_ours:.0%} of an eager grad_by_solve step ({t_ours * 1e3:.0f} ms; "
                     f"eager jax.grad {t_ref * 1e3:.0f} ms)"))
        print(rows[-1], flush=True)
    return rows
