"""The same network from equinox, flax nnx and flax linen modules, trained with grad_by_solve.

x → embed → `depth` residual blocks → head, the head reading the embedding too (a skip). The
blocks are one module stacked along a leading axis the way each library stacks layers —
``eqx.filter_vmap`` over the constructor, ``nnx.vmap`` over the constructor, ``jax.vmap`` over
a linen ``init`` — and every layer reads its row: ``lbp.Row("blocks", i)``. ``lbp.functional``
splits each module into its parameters (the library's own pytree: an equinox module, an
``nnx.State``, a linen dict) and a pure function, so the gradients come back in that pytree and
go straight into optax; ``rebuild`` turns trained parameters back into a module.

Every step also computes jax.grad of the same model written with lax.scan over the stacked
blocks, and the script reports the largest difference seen.

    python examples/flax_and_equinox.py [--steps 100] [--depth 4]
"""

from __future__ import annotations

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen, nnx

import linbackprop as lbp

IN, WIDTH = 8, 32

# -- the modules, once per library ---------------------------------------------------------------------


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help shows the description as written and each option's default."""


class EqxEmbed(eqx.Module):
    linear: eqx.nn.Linear

    def __init__(self, key):
        self.linear = eqx.nn.Linear(IN, WIDTH, key=key)

    def __call__(self, x):  # equinox modules act on one example: vmap over the batch
        return jax.vmap(self.linear)(x)


class EqxBlock(eqx.Module):
    norm: eqx.nn.LayerNorm
    linear: eqx.nn.Linear

    def __init__(self, key):
        self.norm, self.linear = eqx.nn.LayerNorm(WIDTH), eqx.nn.Linear(WIDTH, WIDTH, key=key)

    def __call__(self, h):
        return h + jnp.tanh(jax.vmap(self.linear)(jax.vmap(self.norm)(h)))


class EqxHead(eqx.Module):
    linear: eqx.nn.Linear

    def __init__(self, key):
        self.linear = eqx.nn.Linear(WIDTH, 1, key=key)

    def __call__(self, h):
        return jax.vmap(self.linear)(h)


def equinox_modules(key, depth):
    k = jax.random.split(key, depth + 2)
    return EqxEmbed(k[0]), eqx.filter_vmap(EqxBlock)(k[2:]), EqxHead(k[1])


class NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.norm, self.linear = nnx.LayerNorm(WIDTH, rngs=rngs), nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, h):
        return h + jnp.tanh(self.linear(self.norm(h)))


def nnx_modules(key, depth):
    k = jax.random.split(key, depth + 2)
    blocks = nnx.vmap(lambda key: NnxBlock(nnx.Rngs(key)))(k[2:])
    return nnx.Linear(IN, WIDTH, rngs=nnx.Rngs(k[0])), blocks, nnx.Linear(WIDTH, 1, rngs=nnx.Rngs(k[1]))


class LinenBlock(linen.Module):
    @linen.compact
    def __call__(self, h):
        return h + jnp.tanh(linen.Dense(WIDTH)(linen.LayerNorm()(h)))


def linen_modules(key, depth):
    """Linen modules hold no arrays: (module, variables) pairs, the blocks' variables vmapped."""
    k = jax.random.split(key, depth + 2)
    x, h = jnp.zeros((1, IN)), jnp.zeros((1, WIDTH))
    return ((linen.Dense(WIDTH), linen.Dense(WIDTH).init(k[0], x)),
            (LinenBlock(), jax.vmap(lambda key: LinenBlock().init(key, h))(k[2:])),
            (linen.Dense(1), linen.Dense(1).init(k[1], h)))


# -- one network, whichever library the modules come from ---------------------------------------------


def network(embed: lbp.Functional, blocks: lbp.Functional, head: lbp.Functional, depth: int) -> lbp.Network:
    layers = [lbp.Layer("embed", embed.layer, ("x",), ("embed",))]
    layers += [lbp.Layer(i, blocks.layer, (i - 1 if i else "embed",), (lbp.Row("blocks", i),)) for i in range(depth)]
    layers.append(lbp.Layer("y", lambda th, h, e: head.apply(th[0], h + e), (depth - 1, "embed"), ("head",)))
    return lbp.Network(layers, inputs=["x"], outputs="y")


def scan_model(embed: lbp.Functional, blocks: lbp.Functional, head: lbp.Functional):
    """The reference: the same model as plain JAX, lax.scan over the stacked blocks."""

    def forward(p, x):
        e = embed.apply(p["embed"], x)
        h, _ = jax.lax.scan(lambda h, row: (blocks.apply(row, h), None), e, p["blocks"])
        return head.apply(p["head"], h + e)

    return forward


def train(modules, depth: int, steps: int, data: tuple, seed: int) -> dict:
    embed, blocks, head = (lbp.functional(*m) if isinstance(m, tuple) else lbp.functional(m) for m in modules)
    net, reference = network(embed, blocks, head, depth), scan_model(embed, blocks, head)
    params = {"embed": embed.params, "blocks": blocks.params, "head": head.params}
    mse = lambda forward: lambda p, x, y: jnp.mean((forward(p, x)[:, 0] - y) ** 2)
    optimizer = optax.adam(3e-3)

    @jax.jit
    def step(p, s, x, y):
        value, g = lbp.value_and_grad_by_solve(mse(net))(p, x, y)
        g_ref = jax.grad(mse(reference))(p, x, y)
        difference = jnp.max(jnp.stack([jnp.max(jnp.abs(a - b)) for a, b in
                                        zip(jax.tree.leaves(g), jax.tree.leaves(g_ref), strict=True)]))
        updates, s = optimizer.update(g, s, p)  # gradients in the library's pytree, straight into optax
        return optax.apply_updates(p, updates), s, value, difference

    x, y = data
    rng = np.random.default_rng(seed)
    state, losses, worst = optimizer.init(params), [], 0.0
    for _ in range(steps):
        batch = rng.integers(0, len(x), 64)
        params, state, value, difference = step(params, state, x[batch], y[batch])
        losses.append(float(value))
        worst = max(worst, float(difference))
    trained = blocks.rebuild(params["blocks"])  # back to the library's own object
    return {"first_loss": losses[0], "final_loss": float(np.mean(losses[-10:])), "max_grad_difference": worst,
            "params_type": type(params["blocks"]).__name__, "rebuilt_type": type(trained).__name__}


def main(steps: int = 100, depth: int = 4, seed: int = 0) -> dict:
    key = jax.random.PRNGKey(seed)
    kx, kw = jax.random.split(key)
    x = jax.random.normal(kx, (1024, IN))
    y = jnp.sin(x @ jax.random.normal(kw, (IN,))) + 0.5 * jnp.cos(x[:, 0] * x[:, 1])  # a smooth target
    results = {}
    for name, make in (("equinox", equinox_modules), ("flax nnx", nnx_modules), ("flax linen", linen_modules)):
        r = results[name] = train(make(jax.random.PRNGKey(seed + 1), depth), depth, steps, (x, y), seed)
        print(f"{name:10s}: loss {r['first_loss']:.3f} → {r['final_loss']:.3f} in {steps} steps; "
              f"gradients as {r['params_type']}, rebuilt as {r['rebuilt_type']}; "
              f"max |grad_by_solve − jax.grad| {r['max_grad_difference']:.1e}")
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=_Help)
    parser.add_argument("--steps", type=int, default=100, help="training steps of each model")
    parser.add_argument("--depth", type=int, default=4, help="residual blocks")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data and the initial parameters")
    args = parser.parse_args()
    main(args.steps, args.depth, args.seed)
