"""DP-SGD rows: the clipped sum of per-example gradients against plain JAX (and jax-privacy where installed)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import linbackprop as lbp

from . import example
from .models import fresh, normal, residual, rnn_step
from .timing import compiled, interleaved, memory


def private_cases():
    """Per-example losses for the DP-SGD rows, each with its single-example form for
    ``jax.vmap(jax.grad)`` (the vmap axes of its arguments): the docs' 12 residual layers (width
    128, 10 classes, batch 256), an RNN with its recurrent weight shared over 64 steps reading
    Row("xs", t) (width 64, batch 64), and examples/transformer_lm.py's 12-block GPT with tied
    embeddings (width 128, context 64, batch 16)."""
    keys = jax.random.split(jax.random.PRNGKey(8), 8)
    depth, width, batch, classes = 12, 128, 256, 10
    layer, head_fn = fresh(residual), lambda th, u: u @ th[0]
    layers = [lbp.Layer(i, layer, (i - 1,), (lbp.Row("W", i - 1), lbp.Row("b", i - 1))) for i in range(1, depth + 1)]
    net = lbp.Network([*layers, lbp.Layer("logits", head_fn, (depth,), ("head",))], [0], "logits")
    params = {"W": normal(keys[0], (depth, width, width), 0.5 / np.sqrt(width)), "b": jnp.zeros((depth, width)),
              "head": normal(keys[1], (width, classes), 1 / np.sqrt(width))}
    x, labels = normal(keys[2], (batch, width), 1.0), jax.random.randint(keys[3], (batch,), 0, classes)

    def residual_losses(p, x, labels, net=net):
        logp = jax.nn.log_softmax(net(p, x), axis=-1)
        return -jnp.take_along_axis(logp, labels[:, None], axis=1)[:, 0]

    steps, rwidth, rbatch = 64, 64, 64
    step = fresh(rnn_step)
    rlayers = [lbp.Layer(t, step, (t - 1, lbp.Row("xs", t - 1)), ("A", "B", "c")) for t in range(1, steps + 1)]
    rnet = lbp.Network(rlayers, [0, "xs"], lbp.Stack(range(1, steps + 1)))
    rparams = {"A": normal(keys[4], (rwidth, rwidth), 0.9 / np.sqrt(rwidth)),
               "B": normal(keys[5], (rwidth, rwidth), 1 / np.sqrt(rwidth)), "c": jnp.zeros(rwidth)}
    h0, xs = jnp.zeros((rbatch, rwidth)), normal(keys[6], (steps, rbatch, rwidth), 1.0)
    rnn_losses = lambda p, h0, xs: jnp.mean(rnet(p, h0, xs) ** 2, axis=(0, 2))  # states [T, B, W]

    lm = example("transformer_lm")
    gpt, gparams = lm.network(12), lm.init(jax.random.PRNGKey(4), 96, 64, 128, 12)
    tokens = jax.random.randint(jax.random.PRNGKey(5), (16, 65), 0, 96)

    def gpt_losses(p, t):
        return optax.softmax_cross_entropy_with_integer_labels(gpt(p, t[:, :-1]), t[:, 1:]).mean(axis=1)

    nnx_case = _nnx_residual_case(depth, width, batch, classes, x, labels)
    return [("12 residual layers width 128 + 10-class head, batch 256", residual_losses, (params, x, labels),
             (None, 0, 0)),
            _scan_residual_case(params, x, labels),
            *([nnx_case] if nnx_case else []),
            ("RNN, weight shared over 64 steps (Row(\"xs\", t)), width 64, batch 64", rnn_losses, (rparams, h0, xs),
             (None, 0, 1)),
            ("12-block GPT, tied embeddings, width 128, context 64, batch 16", gpt_losses, (gparams, tokens),
             (None, 0))]


def _scan_residual_case(params: dict, x: jax.Array, labels: jax.Array):
    """The same residual network in plain JAX: an ``@lbp.layer`` block in a ``lax.scan`` over the
    stacked W and b, named in ``layers=``, the head a product after it in the losses (not a
    layer: its per-example gradients come from each example's own rows)."""
    block = lbp.layer(fresh(residual))

    def losses(p, x, labels):
        h, _ = jax.lax.scan(lambda h, wb: (block(wb, h), None), x, (p["W"], p["b"]))
        logp = jax.nn.log_softmax(h @ p["head"], axis=-1)
        return -jnp.take_along_axis(logp, labels[:, None], axis=1)[:, 0]

    def as_model(transform, per_example):
        """``transform`` (clipped_grad or grad_by_solve with layers=block) of the losses as written."""
        return transform(losses if per_example else (lambda *a: jnp.mean(losses(*a))))

    losses.as_model, losses.layers = as_model, block
    return ("the same in plain JAX, a block in a lax.scan named in layers=, head after it", losses,
            (params, x, labels), (None, 0, 0))


def _nnx_residual_case(depth: int, width: int, batch: int, classes: int, x: jax.Array, labels: jax.Array):
    """The same residual network as README's quick start writes a model: flax nnx blocks named
    in ``layers=``, the head an ``nnx.Linear`` after them in the loss (not a layer); the losses a
    function of the split state. None without flax (``pip install -e ".[flax]"``)."""
    try:
        from flax import nnx
    except ImportError:
        return None

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(width, width, rngs=rngs)

        def __call__(self, h):
            return h + jnp.tanh(self.linear(h))

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.blocks = nnx.List([Block(rngs) for _ in range(depth)])
            self.head = nnx.Linear(width, classes, rngs=rngs)

        def __call__(self, h):
            for block in self.blocks:
                h = block(h)
            return self.head(h)

    graphdef, state = nnx.split(Model(nnx.Rngs(0)))

    def model_losses(model, x, labels):
        logp = jax.nn.log_softmax(model(x), axis=-1)
        return -jnp.take_along_axis(logp, labels[:, None], axis=1)[:, 0]

    def losses(state, x, labels):  # the references' form: a function of the split state
        return model_losses(nnx.merge(graphdef, state), x, labels)

    def as_model(transform, per_example):
        """``transform`` (clipped_grad or grad_by_solve with layers=Block) of the model as written."""
        fun = model_losses if per_example else (lambda *a: jnp.mean(model_losses(*a)))
        return lambda state, x, labels: transform(fun)(nnx.merge(graphdef, state), x, labels)

    losses.as_model, losses.layers = as_model, Block
    return ("the same as nnx blocks in layers=, head after them (README's form)", losses, (state, x, labels),
            (None, 0, 0))


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
        if hasattr(losses, "as_model"):  # the model as written, its layers found (layers=)
            layers = losses.layers
            fns["ours"] = losses.as_model(lambda f, layers=layers: lbp.clipped_grad(f, clip, layers=layers), True)
            fns["grad"] = losses.as_model(lambda f, layers=layers: lbp.grad_by_solve(f, layers=layers), False)
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
        target = "<= 1.5" if name.startswith(("12 residual", "the same")) else "<= 2"
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
