"""A character-level GPT written as a flax nnx model, trained with grad_by_solve as it is.

The model is plain flax nnx — `nnx.Embed`, `nnx.MultiHeadAttention`, `nnx.LayerNorm`,
`nnx.Dropout`, blocks in an `nnx.List` run by a Python loop, and logits from the input embedding
again (`embed.attend`: tied weights) — and nothing in it knows about linbackprop.
``layers=(Attention, Mlp, Head)`` names the calls that are the layers; `grad_by_solve` finds the
network by tracing the loss (the embedding lookup before the first block becomes a glue layer,
the embedding matrix a block shared by it and the head), and returns what `nnx.grad` returns,
which goes to `nnx.Optimizer.update` unchanged. Dropout draws its masks from the model's RNG
streams, which advance as under `nnx.grad`.

The script checks one gradient against `nnx.grad` with the same RNG state, trains on the
docstrings of a few standard-library modules (no downloads; as examples/transformer_lm.py),
times a training step against the same step with `nnx.value_and_grad`, samples text, and draws
the network `lbp.capture` finds beside the loss curve.

    python examples/flax_gpt.py [--steps 300] [--blocks 4] [--out flax_gpt.png]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import linbackprop as lbp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from transformer_lm import corpus  # the text both examples train on


# -- the model, as flax users write it ----------------------------------------------------------------
class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help shows the description as written and each option's default."""


class Attention(nnx.Module):
    """Pre-norm causal self-attention with a residual: x + Dropout(MHA(LN(x)))."""

    def __init__(self, width: int, heads: int, dropout: float, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(width, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(heads, width, decode=False, rngs=rngs)
        self.dropout = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        causal = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
        return x + self.dropout(self.attention(self.norm(x), mask=causal))


class Mlp(nnx.Module):
    """Pre-norm MLP with a residual: x + Dropout(W₂ gelu(W₁ LN(x)))."""

    def __init__(self, width: int, dropout: float, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(width, rngs=rngs)
        self.up, self.down = nnx.Linear(width, 4 * width, rngs=rngs), nnx.Linear(4 * width, width, rngs=rngs)
        self.dropout = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.dropout(self.down(nnx.gelu(self.up(self.norm(x)))))


class Head(nnx.Module):
    """The logits LN(x) Eᵀ, with E the input embedding's matrix (the same nnx.Embed object)."""

    def __init__(self, embed: nnx.Embed, width: int, rngs: nnx.Rngs):
        self.embed, self.norm = embed, nnx.LayerNorm(width, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.embed.attend(self.norm(x))


class GPT(nnx.Module):
    def __init__(self, vocab: int, context: int, width: int, heads: int, blocks: int, dropout: float,
                 rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, width, embedding_init=nnx.initializers.normal(0.02), rngs=rngs)
        self.position = nnx.Param(0.02 * jax.random.normal(rngs.params(), (context, width)))
        self.blocks = nnx.List([nnx.List([Attention(width, heads, dropout, rngs), Mlp(width, dropout, rngs)])
                                for _ in range(blocks)])
        self.head = Head(self.embed, width, rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.position[: tokens.shape[-1]]
        for attention, mlp in self.blocks:
            x = mlp(attention(x))
        return self.head(x)


def loss(model: GPT, tokens: jax.Array) -> jax.Array:
    """Mean next-character loss in nats: position t predicts token t + 1."""
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


LAYERS = (Attention, Mlp, Head)  # the calls that are the layers: all linbackprop is told


def training_step(value_and_grad):
    """One AdamW step of ``model`` with the gradient from ``value_and_grad(loss)``."""

    @nnx.jit
    def step(model: GPT, optimizer: nnx.Optimizer, tokens: jax.Array) -> jax.Array:
        value, grads = value_and_grad(loss)(model, tokens)
        optimizer.update(model, grads)
        return value

    return step


def batches(ids: np.ndarray, context: int, batch: int, seed: int):
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(ids) - context - 1, batch)
        yield jnp.asarray(np.stack([ids[s:s + context + 1] for s in starts]))


def median_step_times(runs: dict, tokens: jax.Array, repeats: int) -> dict:
    """Median wall time of each (model, optimizer, step), run interleaved, after a call each."""
    for model, optimizer, step in runs.values():
        jax.block_until_ready(step(model, optimizer, tokens))
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, (model, optimizer, step) in runs.items():
            start = time.perf_counter()
            jax.block_until_ready(step(model, optimizer, tokens))
            times[name].append(time.perf_counter() - start)
    return {name: float(np.median(t)) for name, t in times.items()}


def sample(model: GPT, prompt: list[int], context: int, count: int, key: jax.Array,
           temperature: float = 0.8) -> list[int]:
    """Autoregressive sampling in eval mode over a right-padded window (one compiled shape)."""
    model.eval()
    forward = nnx.jit(lambda model, window: model(window[None])[0])
    tokens = list(prompt)
    for k in jax.random.split(key, count):
        recent = tokens[-context:]
        window = np.zeros(context, np.int32)
        window[: len(recent)] = recent
        scores = forward(model, jnp.asarray(window))[len(recent) - 1]
        tokens.append(int(jax.random.categorical(k, scores / temperature)))
    model.train()
    return tokens


def draw(cap: lbp.Capture, losses: list[float], entropy: float, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (dag, curve) = plt.subplots(2, 1, figsize=(11, 7.5), gridspec_kw={"height_ratios": [1.15, 1]})
    lbp.plot_network(cap.net, ax=dag, title=f"the network lbp.capture finds in GPT (flax nnx, eval mode): "
                                            f"{len(cap.net.layers)} layers, {len(cap.net.param_names)} blocks")
    curve.plot(losses, lw=0.8, label="training loss (grad_by_solve, layers=(Attention, Mlp, Head))")
    curve.axhline(entropy, color="gray", ls="--", lw=0.8, label=f"unigram entropy {entropy:.2f} nats")
    curve.set(xlabel="step", ylabel="nats per character")
    curve.legend(frameon=False, fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(steps: int = 300, blocks: int = 4, width: int = 64, context: int = 64, batch: int = 32, heads: int = 4,
         dropout: float = 0.1, lr: float = 3e-3, out: str = "flax_gpt.png", seed: int = 0, repeats: int = 10,
         samples: int = 200) -> dict:
    """Check, train, time (``repeats`` interleaved steps of each; 0: no timing), sample, draw."""
    text = corpus()
    chars = sorted(set(text))
    ids = np.array([chars.index(c) for c in text], np.int32)
    counts = np.bincount(ids, minlength=len(chars)) / len(ids)
    entropy = float(-(counts[counts > 0] * np.log(counts[counts > 0])).sum())
    print(f"{len(text)} characters, {len(chars)} distinct, unigram entropy {entropy:.2f} nats")
    make = lambda: GPT(len(chars), context, width, heads, blocks, dropout, nnx.Rngs(seed, dropout=seed + 1))
    data = batches(ids, context, batch, seed)
    first = next(data)

    # one gradient against nnx.grad, the dropout streams in the same state (clones)
    model = make()
    reference = nnx.clone(model)
    ours = lbp.grad_by_solve(loss, layers=LAYERS)(model, first)
    theirs = nnx.grad(loss)(reference, first)
    scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(theirs))
    versus_nnx = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)))
    print(f"grad_by_solve(layers=...) against nnx.grad: max |difference| {versus_nnx:.1e} "
          f"(largest entry {scale:.1e}, float32)")

    model = make()
    optimizer = nnx.Optimizer(model, optax.adamw(lr, weight_decay=0.01), wrt=nnx.Param)
    step = training_step(lambda f: lbp.value_and_grad_by_solve(f, layers=LAYERS))
    losses, start = [], time.perf_counter()
    for n in range(steps):
        losses.append(float(step(model, optimizer, next(data))))
        if n % max(1, steps // 6) == 0 or n == steps - 1:
            print(f"step {n:4d}  loss {losses[-1]:.3f}  ({time.perf_counter() - start:.0f} s)", flush=True)

    ratio = None
    if repeats:  # a step of each, side by side (fresh models: the trained one keeps training the same way)
        runs = {"grad_by_solve": (model, optimizer, step)}
        other = make()
        runs["nnx.value_and_grad"] = (other, nnx.Optimizer(other, optax.adamw(lr, weight_decay=0.01),
                                                           wrt=nnx.Param), training_step(nnx.value_and_grad))
        times = median_step_times(runs, first, repeats)
        ratio = times["grad_by_solve"] / times["nnx.value_and_grad"]
        print(f"training step: grad_by_solve(layers=...) {times['grad_by_solve'] * 1e3:.1f} ms, nnx.value_and_grad "
              f"{times['nnx.value_and_grad'] * 1e3:.1f} ms (ratio {ratio:.2f})")

    model.eval()  # the architecture, without the dropout streams' inputs
    cap = lbp.capture(loss, model, first, layers=LAYERS)
    model.train()
    prompt = [chars.index(c) for c in "Return the "]
    text_out = "".join(chars[i] for i in sample(model, prompt, context, samples, jax.random.key(seed)))
    print("sample:", text_out.replace("\n", " "))
    draw(cap, losses, entropy, out)
    print(f"wrote {out}")
    return {"versus_nnx_grad": versus_nnx, "largest_entry": scale, "first_loss": losses[0],
            "final_loss": float(np.mean(losses[-max(1, steps // 10):])), "entropy": entropy, "step_ratio": ratio,
            "layers": [layer.name for layer in cap.net.layers], "sample": text_out, "capture": cap}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=_Help)
    parser.add_argument("--steps", type=int, default=300, help="training steps")
    parser.add_argument("--blocks", type=int, default=4, help="transformer blocks")
    parser.add_argument("--width", type=int, default=64, help="embedding width")
    parser.add_argument("--context", type=int, default=64, help="tokens of context")
    parser.add_argument("--batch", type=int, default=32, help="sequences per batch")
    parser.add_argument("--dropout", type=float, default=0.1, help="dropout rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the parameters, the batches and dropout")
    parser.add_argument("--out", default="flax_gpt.png", help="loss curve PNG ('' for none)")
    args = parser.parse_args()
    main(steps=args.steps, blocks=args.blocks, width=args.width, context=args.context, batch=args.batch,
         dropout=args.dropout, seed=args.seed, out=args.out)
