"""Backpropagation through time as one solve: an unrolled RNN with tied weights.

The network has one layer per time step, h_t = tanh(h_{t-1} A + x_t B + c), reading the previous
state and row t of the one stacked input xs (``lbp.Row("xs", t)``, as lax.scan's xs); every step
uses the same blocks A, B, c, so ℳ sums each block's cotangent over all T steps, and ℒ is block
bidiagonal. The network returns every state stacked (``lbp.Stack``, as lax.scan's ys); a readout
y_t = h_t O outside the network (a direct use of a parameter) is trained to echo the input from
`delay` steps before. grad_by_solve solves ℒ*Λ = ∇Uℓ backwards in time, one block per step; with
``--checkpoints k`` it keeps only k states and recomputes the others segment by segment.

``--optimizer kfac`` trains it with ``lbp.kfac`` instead of Adam: K-FAC's curvature is the
Gauss–Newton matrix of the network's outputs, so there the readout is part of the network (a
layer y_t = h_t O per step, O shared by all of them: one more weight used T times); a readout
outside the network would have no curvature in G and be stepped by g/λ. A, B and O get a
Kronecker term per step, c (added after two products) its GGN diagonal.

    python examples/rnn_sequence.py [--steps 400] [--length 20] [--checkpoints K] [--optimizer kfac]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import linbackprop as lbp


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help shows the description as written and each option's default."""


def cell(theta, h, x):
    a, b, c = theta
    return jnp.tanh(h @ a + x @ b + c)


def rnn(length: int) -> lbp.Network:
    """h_1 .. h_length from h_0 and xs (length rows), all states returned stacked."""
    layers = [lbp.Layer(t, cell, (t - 1, lbp.Row("xs", t - 1)), ("A", "B", "c")) for t in range(1, length + 1)]
    return lbp.Network(layers, inputs=[0, "xs"], outputs=lbp.Stack(range(1, length + 1)))


def rnn_with_readout(length: int) -> lbp.Network:
    """`rnn` with the readout y_t = h_t O as layers of the network, all y_t returned stacked."""
    layers = [lbp.Layer(t, cell, (t - 1, lbp.Row("xs", t - 1)), ("A", "B", "c")) for t in range(1, length + 1)]
    layers += [lbp.Layer(("y", t), lambda th, h: h @ th[0], (t,), ("O",)) for t in range(1, length + 1)]
    return lbp.Network(layers, inputs=[0, "xs"], outputs=lbp.Stack([("y", t) for t in range(1, length + 1)]))


def main(steps: int = 400, length: int = 20, hidden: int = 32, delay: int = 2, batch: int = 32,
         seed: int = 0, checkpoints: int | None = None, optimizer: str = "adam",
         seconds: float | None = None) -> dict:
    """Train for ``steps`` steps, or until ``seconds`` of step time (compile excluded) are spent;
    returns the losses and each step's end in seconds of step time."""
    net = rnn(length)
    key = jax.random.PRNGKey(seed)
    ka, kb, ko = jax.random.split(key, 3)
    params = {"A": jax.random.orthogonal(ka, hidden) * 0.9, "B": jax.random.normal(kb, (1, hidden)),
              "c": jnp.zeros(hidden), "O": jax.random.normal(ko, (hidden, 1)) / np.sqrt(hidden)}

    def loss(p, xs):
        hs = net(p, jnp.zeros((xs.shape[1], hidden)), xs)  # [length, batch, hidden]
        ys = hs @ p["O"]                                    # the readout: outside the network
        target = jnp.concatenate([jnp.zeros_like(xs[:delay]), xs[:-delay]])
        return jnp.mean((ys - target) ** 2)

    small = rnn(4)  # ℒ of four steps: block bidiagonal (backpropagation through time)
    print(lbp.linearize(small, params, jnp.zeros((1, hidden)), jnp.zeros((4, 1, 1))).L, "\n")
    rng = np.random.default_rng(seed)
    sample = lambda: jnp.asarray(rng.uniform(-1, 1, (length, batch, 1)), jnp.float32)
    if optimizer == "kfac":
        readout = rnn_with_readout(length)

        def loss(p, xs):  # the same loss, the readout inside the network
            ys = readout(p, jnp.zeros((xs.shape[1], hidden)), xs)  # [length, batch, 1]
            target = jnp.concatenate([jnp.zeros_like(xs[:delay]), xs[:-delay]])
            return jnp.mean((ys - target) ** 2)

        example = jnp.zeros((length, batch, 1), jnp.float32)  # the averages' shapes (no data drawn)
        kfac = lbp.kfac(factors=lbp.kfac_factors(loss)(params, example))
        opt_state = kfac.init(params)

        @jax.jit
        def step(p, s, xs):
            value, grad, G = lbp.gauss_newton(loss, checkpoints=checkpoints)(p, xs)
            factors = lbp.kfac_factors(loss)(p, xs)
            updates, s = kfac.update(grad, s, p, factors=factors, curvature=G, value=value,
                                     value_fn=G.value_at)
            return optax.apply_updates(p, updates), s, value
    else:
        adam = optax.adam(1e-2)
        opt_state = adam.init(params)

        @jax.jit
        def step(p, s, xs):
            value, g = lbp.value_and_grad_by_solve(loss, checkpoints=checkpoints)(p, xs)
            updates, s = adam.update(g, s, p)
            return optax.apply_updates(p, updates), s, value

    first = float(loss(params, sample()))
    spent, losses, clock = 0.0, [], []
    for n in range(steps):
        xs = sample()
        start = time.perf_counter()
        params, opt_state, value = jax.block_until_ready(step(params, opt_state, xs))
        spent += (time.perf_counter() - start) if n >= 2 else 0.0  # the first two compile
        losses.append(float(value))
        clock.append(spent)
        if (n + 1) % max(1, steps // 5) == 0:
            print(f"step {n + 1:4d}: mean squared error {float(value):.2e}")
        if seconds is not None and spent >= seconds:
            break
    steps = len(losses)
    last = float(loss(params, sample()))
    per_step = spent / max(1, steps - 2)
    print(f"echo with delay {delay}: error {first:.4f} before training, {last:.2e} after "
          f"({optimizer}, {per_step * 1e3:.2f} ms per step)")
    return {"initial_loss": first, "final_loss": last, "ms_per_step": per_step * 1e3, "losses": losses,
            "seconds": clock}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=_Help)
    parser.add_argument("--steps", type=int, default=400, help="training steps")
    parser.add_argument("--length", type=int, default=20, help="sequence length")
    parser.add_argument("--checkpoints", type=int, default=None, help="keep only this many states")
    parser.add_argument("--optimizer", choices=("adam", "kfac"), default="adam", help="the optimizer trained with")
    args = parser.parse_args()
    main(args.steps, args.length, checkpoints=args.checkpoints, optimizer=args.optimizer)
