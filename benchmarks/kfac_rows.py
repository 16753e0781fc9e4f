"""K-FAC on scikit-learn's digits (``python benchmarks/run.py --rows kfac``): ``lbp.kfac`` against
Adam on a tanh MLP 64-128-128-10, full batch (1,797 images), float32.

The rows: K-FAC's loss after 100 steps against the best of five Adam rates after 250 steps, and
the time of a K-FAC step (fresh factors from one sampled column per example, the gradient with G,
the two G products of the step size and momentum, the inverses every ``update_every`` steps)
against a gradient + Adam step, both averaged over their whole runs (the late steps included:
the factors' cost changes as the softmax saturates), then each part of the step against one
gradient, early (the initial parameters) and late (after K-FAC's 100 steps), as interleaved
medians, with a floor: what those parts compute, written for this MLP alone in plain JAX
(`plain_parts`). The two kinds of K-FAC step (applying the held decompositions; recomputing them
and measuring the loss for the damping, every 5th) are also timed apart.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

import linbackprop as lbp

from .digits_problems import SIZES, cnn_params, digits, mean_cross_entropy, mlp_params
from .timing import interleaved, seconds_per_step

ROUNDS = 3  # the mean steps' runs, each taken this many times in turn
ADAM_RATES = (1e-3, 3e-3, 1e-2, 3e-2, 1e-1)  # the best inside the grid, not at its edge


def digits_problem(seed: int = 0) -> tuple[Callable, dict, tuple]:
    """The loss (mean cross-entropy of the MLP), its initial parameters (from ``seed``) and the
    full batch (`digits_problems`, kfac-jax's side's too)."""
    dense = lambda th, u: jnp.tanh(u @ th[0] + th[1])
    head = lambda th, u: u @ th[0] + th[1]
    layers = [lbp.Layer(i + 1, dense if i < len(SIZES) - 2 else head, (i,), (f"W{i}", f"b{i}"))
              for i in range(len(SIZES) - 1)]
    net = lbp.Network(layers, [0], len(SIZES) - 1)
    return lambda p, x, y: mean_cross_entropy(net(p, x), y), mlp_params(seed), digits()


def digits_cnn_problem(seed: int = 0) -> tuple[Callable, dict, tuple]:
    """The digits CNN of the time-to-loss table: 8×8×1 → conv 3×3 16 → conv 3×3 32 (SAME, tanh) →
    dense 10, full batch, float32; its loss (mean cross-entropy), initial parameters and batch."""
    conv = lambda th, u: jnp.tanh(jax.lax.conv_general_dilated(
        u, th[0], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")) + th[1])
    head = lambda th, u: u.reshape(u.shape[0], -1) @ th[0] + th[1]
    net = lbp.Network([lbp.Layer("c1", conv, ("x",), ("K1", "k1")), lbp.Layer("c2", conv, ("c1",), ("K2", "k2")),
                       lbp.Layer("y", head, ("c2",), ("H", "h"))], ["x"], "y")
    return lambda p, x, y: mean_cross_entropy(net(p, x), y), cnn_params(seed), digits((-1, 8, 8, 1))


def _kfac_step(loss: Callable, batch: tuple, opt, value_at: bool, one_pass: bool = True) -> Callable:
    """The jitted K-FAC step: the value, gradient, G and fresh factors from one sampled column
    per example in one pass (``gauss_newton(factors=True)``; or, ``one_pass=False``,
    ``gauss_newton`` and ``kfac_factors`` apart), ``opt``'s update; the loss after the step
    from ``G.value_at`` or from ``loss``."""

    @jax.jit
    def step(p, state, key):
        key, sample = jax.random.split(key)
        if one_pass:
            value, grad, G = lbp.gauss_newton(loss, factors=True, samples=1, key=sample)(p, *batch)
            factors = None  # G's
        else:
            value, grad, G = lbp.gauss_newton(loss)(p, *batch)
            factors = lbp.kfac_factors(loss, samples=1, key=sample)(p, *batch)
        value_fn = G.value_at if value_at else (lambda q, **_: loss(q, *batch))
        updates, state = opt.update(grad, state, p, factors=factors, curvature=G, value=value, value_fn=value_fn)
        return optax.apply_updates(p, updates), state, key

    return step


def _plain_pass(params: dict, batch: tuple, key: jax.Array) -> tuple:
    """This MLP's value, gradient, factor sums and G's Gram matrix (as a function of vectors),
    in plain JAX: the loss and its gradient, one sampled label per example (K-FAC's Fisher
    estimator, kfac-jax's `fisher_gradients`: s = p − e_y, y ~ p) back substituted to the
    pre-activations, A = Σ [x, 1]ᵀ[x, 1] and Γ = Σ sᵀs per layer, and [vᵢᵀ G vⱼ] by JVPs."""
    x, y = batch
    depth = len(SIZES) - 1

    def logits(p, shifts):
        h = x
        for i in range(depth):
            z = h @ p[f"W{i}"] + p[f"b{i}"] + shifts[i]
            h = jnp.tanh(z) if i < depth - 1 else z
        return h

    def inputs(p):
        h, out = x, []
        for i in range(depth):
            out.append(jnp.concatenate([h, jnp.ones((x.shape[0], 1), h.dtype)], axis=1))
            h = jnp.tanh(h @ p[f"W{i}"] + p[f"b{i}"]) if i < depth - 1 else h
        return out

    zeros = [jnp.zeros((x.shape[0], params[f"W{i}"].shape[1]), x.dtype) for i in range(depth)]
    out, pullback = jax.vjp(lambda p: logits(p, zeros), params)
    logp = jax.nn.log_softmax(out)
    value = -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))
    prob = jnp.exp(logp)
    (grad,) = pullback((prob - jax.nn.one_hot(y, SIZES[-1])) / x.shape[0])
    sampled = prob - jax.nn.one_hot(jax.random.categorical(key, logp), SIZES[-1])
    (deltas,) = jax.vjp(lambda z: logits(params, z), zeros)[1](sampled)
    factors = [(a.T @ a, d.T @ d) for a, d in zip(inputs(params), deltas)]

    def gram(vectors: list) -> jax.Array:
        tangents = jax.tree.map(lambda *v: jnp.stack(v), *vectors)
        jv = jax.vmap(lambda t: jax.jvp(lambda q: logits(q, zeros), (params,), (t,))[1])(tangents)
        hjv = prob * jv - prob * jnp.sum(prob * jv, axis=-1, keepdims=True)
        return jnp.einsum("inj,knj->ik", jv, hjv) / x.shape[0]

    return value, grad, factors, gram


def plain_parts(params: dict, batch: tuple, key: jax.Array) -> tuple:
    """What the step's parts compute, written for this MLP alone in plain JAX (`_plain_pass`) and
    the 2 × 2 Gram matrix of G's products with the gradient and another vector (two JVPs) — the
    arithmetic of a K-FAC step without the update, for a floor to compare with."""
    value, grad, factors, gram = _plain_pass(params, batch, key)
    return value, grad, factors, gram([grad, _other_vector(params)])


def plain_kfac(params: dict, batch: tuple, damping: float = 1e-3, decay: float = 0.95, update_every: int = 5,
               damping_interval: int = 5, damping_decay: float = 0.95) -> tuple[Callable, dict]:
    """The whole KFAC* step written for this MLP alone in plain JAX — the floor of ``lbp.kfac``'s
    step, with its defaults: `_plain_pass`; the factors' bias-corrected average; per layer one
    block [W; b], eigendecompositions of A/N and Γ/N every ``update_every`` steps (and each of the
    first), Δ = −(F̄ + λI)⁻¹ g with λ added exactly; (α, μ) from the 2 × 2 model with G's
    products of Δ and the previous update; every ``damping_interval`` steps the loss at θ + u and
    Martens & Grosse's rule for λ. Returns the jitted ``step(params, state, key)`` and the first
    state."""
    x, y = batch
    n, depth, omega = x.shape[0], len(SIZES) - 1, damping_decay ** damping_interval
    as_blocks = lambda t: [jnp.concatenate([t[f"W{i}"], t[f"b{i}"][None]], axis=0) for i in range(depth)]
    from_blocks = lambda bs: {k: v for i, b in enumerate(bs) for k, v in ((f"W{i}", b[:-1]), (f"b{i}", b[-1]))}
    vdot = lambda a, b: sum(jnp.vdot(a[k], b[k]) for k in a)

    def eigh(m):
        values, vectors = jnp.linalg.eigh(m)
        return jnp.maximum(values, 0), vectors

    def loss_at(p):
        h = x
        for i in range(depth):
            h = h @ p[f"W{i}"] + p[f"b{i}"]
            h = jnp.tanh(h) if i < depth - 1 else h
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(h), y[:, None], axis=1))

    @jax.jit
    def step(p, s, key):
        key, sample = jax.random.split(key)
        value, grad, factors, gram = _plain_pass(p, batch, sample)
        sums = [(decay * a0 + a / n, decay * g0 + g / n) for (a0, g0), (a, g) in zip(s["sums"], factors)]
        weight = decay * s["weight"] + 1
        now = (s["count"] < update_every) | (s["count"] % update_every == 0)
        eigs = jax.lax.cond(now, lambda: [(eigh(a / weight), eigh(g / weight)) for a, g in sums], lambda: s["eigs"])
        lam = s["damping"]
        blocks = [qa @ ((qa.T @ m @ qg) / (a[:, None] * g[None, :] + lam)) @ qg.T
                  for ((a, qa), (g, qg)), m in zip(eigs, as_blocks(grad))]
        direction, previous = jax.tree.map(jnp.negative, from_blocks(blocks)), s["previous"]
        products = gram([direction, previous])
        m = products + lam * jnp.array([[vdot(direction, direction), vdot(direction, previous)],
                                        [vdot(direction, previous), vdot(previous, previous)]])
        b = jnp.stack([vdot(grad, direction), vdot(grad, previous)])
        det = m[0, 0] * m[1, 1] - m[0, 1] ** 2
        line = det <= 64 * jnp.finfo(det.dtype).eps * m[0, 0] * m[1, 1]  # the first step: δ = 0
        w = jnp.where(line, jnp.stack([-b[0] / m[0, 0], 0.0]),
                      jnp.stack([-b[0] * m[1, 1] + b[1] * m[0, 1], -b[1] * m[0, 0] + b[0] * m[0, 1]])
                      / jnp.where(line, 1, det))
        update = jax.tree.map(lambda d, u: w[0] * d + w[1] * u, direction, previous)
        measure = s["count"] % damping_interval == 0
        after = jax.lax.cond(measure, lambda: loss_at(jax.tree.map(jnp.add, p, update)), lambda: jnp.nan)
        rho = (after - value) / (w @ b + 0.5 * w @ products @ w)  # the model without λ
        factor = jnp.where(rho < 0.25, 1 / omega, jnp.where(rho > 0.75, omega, 1.0))
        lam = jnp.where(measure, jnp.clip(lam * factor, 1e-8, 1e8), lam)
        new = {"count": s["count"] + 1, "damping": lam, "sums": sums, "weight": weight, "eigs": eigs,
               "previous": update}
        return jax.tree.map(jnp.add, p, update), new, key

    zeros = [(jnp.zeros((a, a)), jnp.zeros((g, g))) for a, g in zip((m + 1 for m in SIZES[:-1]), SIZES[1:])]
    state = {"count": jnp.zeros((), jnp.int32), "damping": jnp.asarray(damping, jnp.float32), "sums": zeros,
             "weight": jnp.zeros(()), "eigs": [((jnp.zeros(a.shape[0]), a), (jnp.zeros(g.shape[0]), g))
                                             for a, g in zeros],
             "previous": jax.tree.map(jnp.zeros_like, params)}
    return step, state


def _other_vector(p: dict) -> dict:
    """The second vector of the timed G products, beside the gradient (the same one twice
    would be one product)."""
    return jax.tree.map(lambda a: 0.5 * a + 0.01, p)


def _with_gram(value, grad, G, p):
    """The step's products: G's Gram matrix of the gradient and `_other_vector`."""
    return value, grad, G.gram([grad, _other_vector(p)])


def kfac_rows(repeats: int) -> list[tuple[str, str, str]]:
    """The rows of the K-FAC table (medians of ``repeats`` runs taken in turn)."""
    loss, params, batch = digits_problem()
    opt = lbp.kfac()
    kfac_step = _kfac_step(loss, batch, opt, value_at=False)

    plain_step, plain_state = plain_kfac(params, batch)
    two_pass_step = _kfac_step(loss, batch, opt, value_at=False, one_pass=False)
    adam = []
    for rate in ADAM_RATES:
        tx = optax.adam(rate)

        @jax.jit
        def adam_step(p, state, tx=tx):
            grad = lbp.grad_by_solve(loss)(p, *batch)
            updates, state = tx.update(grad, state, p)
            return optax.apply_updates(p, updates), state

        (p, _), _ = seconds_per_step(adam_step, (params, tx.init(params)), 248, warmup=2)
        adam.append((float(loss(p, *batch)), rate, adam_step, tx))
    best, rate, adam_step, tx = min(adam, key=lambda run: run[:2])
    # the whole runs' mean steps, the four runs taken in turn ``ROUNDS`` times (this machine's
    # speed drifts over seconds: one run apart once measured a step 40 % slower) and averaged
    runs = {"kfac": (kfac_step, (params, opt.init(params), jax.random.key(1))),
            "plain": (plain_step, (params, plain_state, jax.random.key(1))),
            "two": (two_pass_step, (params, opt.init(params), jax.random.key(1))),
            "adam": (adam_step, (params, tx.init(params)))}
    means: dict[str, list[float]] = {name: [] for name in runs}
    ends = {}
    for _ in range(ROUNDS):
        for name, (step, carry) in runs.items():
            ends[name], t = seconds_per_step(step, carry, 98, warmup=2)
            means[name].append(t)
    t_kfac, t_plain, t_two, t_adam = (sum(means[n]) / ROUNDS for n in ("kfac", "plain", "two", "adam"))
    (late, late_state, late_key), (plain_late, _, _) = ends["kfac"], ends["plain"]
    kfac_loss = float(loss(late, *batch))
    rows = [("digits MLP 64-128-128-10 (tanh, full batch, float32): `lbp.kfac` loss after 100 steps",
             f"{kfac_loss:.2e}", f"< {best:.2e} (Adam after 250 steps, best of rates "
                                 f"{', '.join(f'{r:g}' for r in ADAM_RATES)}: {rate:g})"),
            ("same, a K-FAC step (one pass) / a gradient + Adam step (means over 3 runs each, in turn)",
             f"{t_kfac / t_adam:.1f} ({t_kfac * 1e3:.1f} / {t_adam * 1e3:.2f} ms)", "≤ 2.5"),
            ("same, the whole KFAC* step written for this MLP alone in plain JAX (the floor: "
             "`kfac_rows.plain_kfac`, update, eigendecompositions every 5th step and ρ included) / a gradient + "
             "Adam step (means over 3 runs each, in turn)",
             f"{t_plain / t_adam:.1f} ({t_plain * 1e3:.1f} / {t_adam * 1e3:.2f} ms; loss after 100 steps "
             f"{float(loss(plain_late, *batch)):.2e})", "—"),
            ("same, a K-FAC step with `gauss_newton` and `kfac_factors` apart (two passes) / a gradient + Adam step",
             f"{t_two / t_adam:.1f} ({t_two * 1e3:.1f} / {t_adam * 1e3:.2f} ms)", "—")]
    # the two kinds of K-FAC step apart (interleaved medians, late): one that applies the held
    # decompositions, and one that also recomputes them and measures the loss for the damping
    count = lambda n: late_state._replace(count=jnp.asarray(n, late_state.count.dtype))
    held, recomputed, adam_alone = interleaved([(kfac_step, (late, count(101), late_key)),
                                                (kfac_step, (late, count(100), late_key)),
                                                (adam_step, (late, tx.init(late)))], repeats)
    for name, t in (("applying the held decompositions", held),
                    ("recomputing them and measuring ρ (every 5th)", recomputed)):
        rows.append((f"same, late: a K-FAC step {name} / a gradient + Adam step (interleaved medians)",
                     f"{t / adam_alone:.1f} ({t * 1e3:.1f} / {adam_alone * 1e3:.2f} ms)", "—"))
    key = jax.random.key(2)
    one_pass = lambda p: lbp.gauss_newton(loss, factors=True, samples=1, key=key)(p, *batch)
    parts = {"`gauss_newton(factors=True, samples=1)`: value, gradient, G and the factors in one pass":
                 lambda p: (lambda v, g, G: (v, g, G.factors))(*one_pass(p)),
             "the same and the two G products": lambda p: (lambda v, g, G: (G.factors, *_with_gram(v, g, G, p)))(
                 *one_pass(p)),
             "`gauss_newton` (value, gradient, G)": lambda p: lbp.gauss_newton(loss)(p, *batch)[:2],
             "`gauss_newton` and the two G products (`G.gram` of the gradient and another vector)":
                 lambda p: _with_gram(*lbp.gauss_newton(loss)(p, *batch), p),
             "`kfac_factors`, one sampled column": lambda p: lbp.kfac_factors(loss, samples=1, key=key)(p, *batch)}
    parts["the same arithmetic in plain JAX: gradient, one sampled label per example (K-FAC's Fisher estimator, "
          "kfac-jax's `fisher_gradients`), "
          "A and Γ, the two G products"] = lambda p: plain_parts(p, batch, key)
    gradient = jax.jit(lambda p: lbp.grad_by_solve(loss)(p, *batch))
    for when, p in (("early", params), ("late", late)):
        compiled = [jax.jit(f) for f in parts.values()]
        times = interleaved([(gradient, (p,)), *((f, (p,)) for f in compiled)], repeats)
        for name, t in zip(parts, times[1:]):
            rows.append((f"same, {when}: {name} / a gradient", f"{t / times[0]:.2f} ({t * 1e3:.1f} / "
                                                                f"{times[0] * 1e3:.2f} ms)", "—"))
    rows.append(("OpenBLAS threads of the factorisations (`OPENBLAS_NUM_THREADS`)",
                 os.environ.get("OPENBLAS_NUM_THREADS", "unset (OpenBLAS's default)"), "—"))
    for row in rows:
        print(row, flush=True)
    return rows
