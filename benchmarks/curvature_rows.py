"""Curvature rows: Gauss–Newton products and per-example quantities against plain JAX."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import linbackprop as lbp

from .models import chain, fresh, normal, residual
from .timing import compiled, interleaved, memory


def gauss_newton_rows(repeats: int) -> list[tuple[str, str, str]]:
    """One Gauss–Newton step (10 CG iterations on G + λI, squared error) against the same step
    written with jax.linearize + jax.linear_transpose of the lax.scan network (the linearisation
    held once), and against recomputing the forward pass for every product (jax.jvp + jax.vjp)."""
    out = []
    for name, shape, target in (("deep narrow chain 512×32×8, `Row` blocks", (512, 32, 8), "<= 0.8"),
                                ("chain 128×128×64, `Row` blocks", (128, 128, 64), "<= 1.0")):
        _, (params, x), _, _ = chain(*shape)
        y = jnp.zeros_like(x)
        layer = fresh(residual)

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
    params = {**params, "head": normal(jax.random.PRNGKey(1), (width, classes), 1 / np.sqrt(width))}
    labels = jnp.arange(batch) % classes
    layer, head = fresh(residual), lambda th, u: u @ th[0]
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
    layer, head_fn = fresh(residual), lambda th, u: u @ th[0]
    layers = [lbp.Layer(i, layer, (i - 1,), (lbp.Row("W", i - 1), lbp.Row("b", i - 1))) for i in range(1, depth + 1)]
    net = lbp.Network([*layers, lbp.Layer("logits", head_fn, (depth,), ("head",))], [0], "logits")
    params = {"W": normal(keys[0], (depth, width, width), 0.5 / np.sqrt(width)), "b": jnp.zeros((depth, width)),
              "head": normal(keys[1], (width, classes), 1 / np.sqrt(width))}
    x = normal(keys[2], (batch, width), 1.0)
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
