"""A character-level GPT trained with grad_by_solve and optax on text that ships with Python.

The network: token + position embeddings, then `blocks` pre-norm transformer blocks as two kinds
of layer — causal self-attention x + Attn(LN(x)) and MLP x + MLP(LN(x)), each with its weights
stacked along a leading axis and read by row (``lbp.Row("attn", i)``) — then the logits
LN(x) Eᵀ with the embedding E tied to the input's (one block read by two layers: ℳ sums both
contributions). ℒ is block bidiagonal (every layer reads the one before), so the back
substitution is one loop over the 2·blocks layers whose program does not grow with depth.

The text is the docstrings of a few standard-library modules (no downloads). The script prints
the unigram entropy of the text (the loss of a model that ignores context), trains, writes the
loss curve to a PNG, samples text from the trained model, and times one training step of
grad_by_solve against jax.grad of the same model written with lax.scan over the stacked blocks.

    python examples/transformer_lm.py [--steps 800] [--blocks 4] [--out transformer_lm.png]
    python examples/transformer_lm.py --optimizer kfac --steps 200   # lbp.kfac instead of AdamW
"""

from __future__ import annotations

import argparse
import collections
import importlib
import inspect
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import linbackprop as lbp

MODULES = ["argparse", "collections", "contextlib", "csv", "dataclasses", "datetime", "decimal", "difflib",
           "fractions", "functools", "heapq", "inspect", "itertools", "json", "logging", "pathlib", "pickle",
           "random", "re", "shutil", "statistics", "string", "textwrap", "threading", "unittest", "zipfile"]


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help shows the description as written and each option's default."""


def corpus() -> str:
    """The docstrings of MODULES and of their public classes and functions (≈ 170 kB of English)."""
    parts = []
    for name in MODULES:
        module = importlib.import_module(name)
        objects = [module] + [obj for key, obj in sorted(vars(module).items()) if not key.startswith("_")
                              and (inspect.isclass(obj) or inspect.isfunction(obj)) and obj.__module__ == name]
        parts += [inspect.cleandoc(obj.__doc__) for obj in objects if obj.__doc__]
    return "\n\n".join(parts)


# -- the layers: pure functions of (blocks, states) ---------------------------------------------------


def layer_norm(p: dict, x: jax.Array) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-5) * p["g"] + p["b"]


def embed(theta, tokens):
    wte, wpe = theta
    return wte[tokens] + wpe[: tokens.shape[-1]]


def attention(theta, x, heads: int = 4):
    (p,) = theta  # one row of the stacked attention weights
    batch, length, width = x.shape
    q, k, v = jnp.split(layer_norm(p["ln"], x) @ p["qkv"], 3, axis=-1)
    split = lambda a: a.reshape(batch, length, heads, width // heads)
    scores = jnp.einsum("bqhd,bkhd->bhqk", split(q), split(k)) / math.sqrt(width // heads)
    causal = jnp.tril(jnp.ones((length, length), bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, split(v)).reshape(batch, length, width)
    return x + out @ p["proj"]


def mlp(theta, x):
    (p,) = theta
    return x + jax.nn.gelu(layer_norm(p["ln"], x) @ p["fc"] + p["fc_b"]) @ p["proj"] + p["proj_b"]


def logits(theta, x):
    ln_f, wte = theta
    return layer_norm(ln_f, x) @ wte.T  # tied embeddings: the input's E again


def network(blocks: int) -> lbp.Network:
    """embed → (attention, MLP) × blocks → logits: 2·blocks + 2 layers, two kinds in the middle."""
    layers, previous = [lbp.Layer("embed", embed, ("tokens",), ("wte", "wpe"))], "embed"
    for i in range(blocks):
        layers.append(lbp.Layer(("attn", i), attention, (previous,), (lbp.Row("attn", i),)))
        layers.append(lbp.Layer(("mlp", i), mlp, (("attn", i),), (lbp.Row("mlp", i),)))
        previous = ("mlp", i)
    layers.append(lbp.Layer("logits", logits, (previous,), ("ln_f", "wte")))
    return lbp.Network(layers, inputs=["tokens"], outputs="logits")


def scan_forward(params: dict, tokens: jax.Array) -> jax.Array:
    """The same model as plain JAX: lax.scan over the stacked (attention, MLP) blocks."""
    x = embed((params["wte"], params["wpe"]), tokens)
    x, _ = jax.lax.scan(lambda x, p: (mlp((p[1],), attention((p[0],), x)), None), x, (params["attn"], params["mlp"]))
    return logits((params["ln_f"], params["wte"]), x)


def init(key: jax.Array, vocab: int, context: int, width: int, blocks: int) -> dict:
    k = iter(jax.random.split(key, 6))
    normal = lambda shape, scale: jax.random.normal(next(k), shape, jnp.float32) * scale
    norm = lambda *lead: {"g": jnp.ones((*lead, width)), "b": jnp.zeros((*lead, width))}
    residual_scale = 0.02 / math.sqrt(2 * blocks)
    return {
        "wte": normal((vocab, width), 0.02), "wpe": normal((context, width), 0.02),
        "attn": {"ln": norm(blocks), "qkv": normal((blocks, width, 3 * width), 0.02),
                 "proj": normal((blocks, width, width), residual_scale)},
        "mlp": {"ln": norm(blocks), "fc": normal((blocks, width, 4 * width), 0.02),
                "fc_b": jnp.zeros((blocks, 4 * width)), "proj": normal((blocks, 4 * width, width), residual_scale),
                "proj_b": jnp.zeros((blocks, width))},
        "ln_f": norm(),
    }


def cross_entropy(forward, params, tokens):
    """Mean next-character loss in nats: position t predicts token t + 1."""
    return optax.softmax_cross_entropy_with_integer_labels(forward(params, tokens[:, :-1]), tokens[:, 1:]).mean()


def median_step_times(steps: dict, args: tuple, repeats: int) -> dict:
    """Median wall time of each jitted step, run interleaved (the machine's noise hits all alike),
    after one untimed call each (the first call compiles)."""
    for step in steps.values():
        jax.block_until_ready(step(*args))
    times = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            jax.block_until_ready(step(*args))
            times[name].append(time.perf_counter() - start)
    return {name: float(np.median(t)) for name, t in times.items()}


def sample(net: lbp.Network, params: dict, prompt: np.ndarray, context: int, count: int, key: jax.Array,
           temperature: float = 0.8) -> list[int]:
    """Autoregressive sampling with the plain forward pass over a window of `context` tokens (the
    causal mask lets the window be padded on the right: one compiled shape)."""
    forward = jax.jit(lambda p, window: net(p, window[None])[0])
    tokens = list(prompt)
    for k in jax.random.split(key, count):
        recent = tokens[-context:]
        window = np.zeros(context, np.int32)
        window[: len(recent)] = recent
        scores = forward(params, window)[len(recent) - 1]
        tokens.append(int(jax.random.categorical(k, scores / temperature)))
    return tokens


def main(steps: int = 800, blocks: int = 4, width: int = 64, context: int = 64, batch: int = 32, seed: int = 0,
         out: str | None = "transformer_lm.png", progress: bool = True, repeats: int = 10,
         optimizer_name: str = "adamw", seconds: float | None = None) -> dict:
    """Train for ``steps`` steps, or until ``seconds`` of step time (compile excluded) are spent;
    returns the losses and each step's end in seconds of step time (``"seconds"``)."""
    text = corpus()
    chars = sorted(set(text))
    lookup = {c: i for i, c in enumerate(chars)}
    data = np.array([lookup[c] for c in text], np.int32)
    counts = np.array(list(collections.Counter(data.tolist()).values())) / len(data)
    unigram = float(-(counts * np.log(counts)).sum())
    print(f"text: {len(text)} characters, {len(chars)} distinct; unigram entropy {unigram:.3f} nats")

    net = network(blocks)
    params = init(jax.random.PRNGKey(seed), len(chars), context, width, blocks)
    print(f"network: {len(net.layers)} layers ({blocks} attention + {blocks} MLP blocks), "
          f"{sum(a.size for a in jax.tree.leaves(params))} parameters")
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, min(50, steps // 5 + 1), max(steps, 51), 3e-4)
    optimizer = optax.adamw(schedule, weight_decay=0.01)

    def make_step(value_and_grad, forward):
        @jax.jit
        def step(p, s, tokens):
            value, g = value_and_grad(lambda p: cross_entropy(forward, p, tokens))(p)
            updates, s = optimizer.update(g, s, p)
            return optax.apply_updates(p, updates), s, value

        return step

    step = make_step(lbp.value_and_grad_by_solve, net)
    reference = make_step(jax.value_and_grad, scan_forward)
    rng = np.random.default_rng(seed)
    batches = lambda: data[rng.integers(0, len(data) - context - 1, batch)[:, None] + np.arange(context + 1)]
    opt_state, losses = optimizer.init(params), []
    if optimizer_name == "kfac":  # K-FAC: H's blocks per position, one sampled column per token
        loss = lambda p, tokens: cross_entropy(net, p, tokens)
        shapes = jax.eval_shape(lambda p, t: lbp.kfac_factors(loss, samples=1, key=jax.random.key(0))(p, t), params,
                                np.zeros((batch, context + 1), np.int32))  # the averages' shapes: no batch drawn
        kfac = lbp.kfac(factors=shapes)
        opt_state = kfac.init(params)

        @jax.jit
        def step(p, s, tokens):  # value, gradient, G and the factors from one pass
            key = jax.random.fold_in(jax.random.key(seed), s.count)
            value, grad, G = lbp.gauss_newton(loss, factors=True, samples=1, key=key)(p, tokens)
            updates, s = kfac.update(grad, s, p, curvature=G)
            return optax.apply_updates(p, updates), s, value

    bar = range(steps)
    if progress:
        from tqdm import tqdm

        what = "lbp.kfac" if optimizer_name == "kfac" else "grad_by_solve + optax.adamw"
        bar = tqdm(bar, desc=f"training ({what})", unit="step")
    clock, spent = [], 0.0
    for n in bar:
        tokens = batches()
        start = time.perf_counter()
        params, opt_state, value = step(params, opt_state, tokens)
        losses.append(float(value))  # waits for the step
        spent += time.perf_counter() - start if n else 0.0  # the first call compiles
        clock.append(spent)
        if progress and len(losses) % 10 == 0:
            bar.set_postfix(loss=f"{np.mean(losses[-10:]):.3f}")
        if seconds is not None and spent >= seconds:
            break
    steps = len(losses)
    final = float(np.mean(losses[-20:]))
    print(f"loss: {losses[0]:.3f} → {final:.3f} nats (mean of the last 20 steps); unigram entropy {unigram:.3f}")
    marks = sorted({max(10, steps * k // 4) for k in range(1, 5)} & set(range(10, steps + 1)))
    print("by step (mean of the 10 before): " + ", ".join(f"{n}: {np.mean(losses[n - 10:n]):.3f}" for n in marks))

    held = batches()
    ours = jax.jit(lbp.grad_by_solve(lambda p: cross_entropy(net, p, held)))(params)
    theirs = jax.jit(jax.grad(lambda p: cross_entropy(scan_forward, p, held)))(params)
    difference = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)))
    if optimizer_name == "kfac":
        times = median_step_times({"lbp.kfac": lambda p, s, t: step(p, s, t)}, (params, opt_state, held), repeats)
        times |= median_step_times({"jax.grad over lax.scan": reference}, (params, optimizer.init(params), held),
                                   repeats)
        print(f"one training step (median of {repeats}): lbp.kfac {1e3 * times['lbp.kfac']:.1f} ms, "
              f"jax.grad over lax.scan + adamw {1e3 * times['jax.grad over lax.scan']:.1f} ms; "
              f"max |Δgrad| {difference:.1e}")
    else:
        times = median_step_times({"grad_by_solve": step, "jax.grad over lax.scan": reference},
                                  (params, opt_state, held), repeats)
        print(f"one training step (median of {repeats}): grad_by_solve {1e3 * times['grad_by_solve']:.1f} ms, "
              f"jax.grad over lax.scan {1e3 * times['jax.grad over lax.scan']:.1f} ms "
              f"(ratio {times['grad_by_solve'] / times['jax.grad over lax.scan']:.2f}); "
              f"max |Δgrad| {difference:.1e}")

    prompt = np.array([lookup[c] for c in "Return the "], np.int32)
    generated = "".join(chars[i] for i in sample(net, params, prompt, context, 300, jax.random.PRNGKey(seed + 1)))
    print("sample:\n" + generated)
    if out:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(losses, lw=0.7, label="training loss (" + ("lbp.kfac" if optimizer_name == "kfac" else "grad_by_solve")
                + ")")
        ax.axhline(unigram, color="tab:red", ls="--", lw=1, label=f"unigram entropy {unigram:.2f}")
        ax.set(xlabel="step", ylabel="cross-entropy (nats)", title=f"character-level GPT, {len(net.layers)} layers")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out, dpi=120)
        plt.close(fig)
        print(f"wrote {out}")
    return {"losses": losses, "seconds": clock, "final_loss": final, "unigram_entropy": unigram, "times": times,
            "gradient_difference": difference, "sample": generated}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=_Help)
    parser.add_argument("--steps", type=int, default=800, help="training steps")
    parser.add_argument("--blocks", type=int, default=4, help="transformer blocks")
    parser.add_argument("--width", type=int, default=64, help="embedding width")
    parser.add_argument("--context", type=int, default=64, help="tokens of context")
    parser.add_argument("--batch", type=int, default=32, help="sequences per batch")
    parser.add_argument("--seed", type=int, default=0, help="seed of the parameters and the batches")
    parser.add_argument("--out", default="transformer_lm.png", help="loss curve PNG ('' for none)")
    parser.add_argument("--no-progress", action="store_true", help="logs instead of a progress bar")
    parser.add_argument("--optimizer", choices=("adamw", "kfac"), default="adamw",
                        help="kfac: lbp.kfac with one sampled column per token (H's blocks per position)")
    parser.add_argument("--draw-network", type=int, metavar="BLOCKS",
                        help="only draw lbp.plot_network of a BLOCKS-block model to --out (docs/transformer.png: 12)")
    args = parser.parse_args()
    if args.draw_network:
        import matplotlib

        matplotlib.use("Agg")
        net = network(args.draw_network)
        ax = lbp.plot_network(net, title=f"examples/transformer_lm.py, {args.draw_network} blocks: "
                                         f"{len(net.layers)} layers")
        ax.figure.savefig(args.out, dpi=120, bbox_inches="tight")
        print(f"wrote {args.out}")
        raise SystemExit
    main(args.steps, args.blocks, args.width, args.context, args.batch, args.seed, args.out or None,
         not args.no_progress, optimizer_name=args.optimizer)
