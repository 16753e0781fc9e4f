"""The linear algebra's profiles, run through ``python benchmarks/profile.py gram | roots | float64 |
woodbury`` (what each measures: that module's docstring): K-FAC's two G products, H's small
blocks' Cholesky roots, the PINN's K-FAC step under XLA's CPU options, ENGD's Woodbury solve.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

import linbackprop as lbp
from benchmarks import example
from benchmarks.models import chain, rnn
from benchmarks.timing import compiled, interleaved


def gram_products(repeats: int = 20) -> None:
    from benchmarks.kfac_rows import digits_problem
    from linbackprop._options import Policy
    from linbackprop._options._settings import Settings, using

    pinn = example("pinn_poisson")
    cases = [("digits MLP 64-128-128-10, float32", *digits_problem())]
    with jax.enable_x64(True):
        for widths in ((64,), (64, 64, 48, 48)):
            params, points, loss, _, _ = pinn.make_problem(widths)
            cases.append((f"Poisson PINN 2-{'-'.join(map(str, widths))}-1, float64", loss, params, (points,)))
    loss, (params, *rest), _, _ = rnn(32, 64, 32, every=True)
    cases.append(("RNN 32 steps, width 64, batch 32", loss, params, tuple(rest)))
    loss, (params, *rest), _, _ = chain(16, 64, 64)
    cases.append(("chain 16 × 64, batch 64", loss, params, tuple(rest)))
    for name, loss, params, rest in cases:
        with jax.enable_x64(jax.tree.leaves(params)[0].dtype == jnp.float64):  # traced and run as made
            v = jax.tree.map(lambda a: 0.3 * a + 0.01, params)
            programs = [(jax.jit(lambda p, v, loss=loss, rest=rest: lbp.gauss_newton(loss)(p, *rest)[:2]), (params, v))]
            for batched in (False, True):
                def both(p, v, loss=loss, rest=rest):
                    value, grad, G = lbp.gauss_newton(loss)(p, *rest)
                    return value, grad, G.gram([grad, v])
                with using(Settings(policy=Policy(batched_products_cpu=batched))):  # traced under the rule
                    programs.append((jax.jit(both).lower(params, v).compile(), (params, v)))
            base, one_by_one, batched = interleaved(programs, repeats)
        print(f"{name}: gauss_newton {base * 1e3:.2f} ms; the two products one by one {(one_by_one - base) * 1e3:.2f} "
              f"ms, vmapped {(batched - base) * 1e3:.2f} ms", flush=True)


def small_roots(repeats: int = 30) -> None:
    """LAPACK's batched Cholesky against the same roots column by column over all examples at once
    (Crout's order, written here as `_curvature._sampling` writes it): the measurement behind the
    size below which the library takes the latter."""

    def by_columns(h: jax.Array) -> jax.Array:
        a = jnp.moveaxis(h, 0, -1)  # [C, C, B]: each step over every example at once
        columns: list[jax.Array] = []
        for j in range(a.shape[0]):
            v = a[j:, j]
            for done in columns:
                v = v - done[j:] * done[j]
            columns.append(jnp.concatenate([jnp.zeros_like(a[:j, j]), v / jnp.sqrt(v[0])]))
        return jnp.moveaxis(jnp.stack(columns, axis=1), -1, 0)

    for coords in (4, 6, 10):
        x = jax.random.normal(jax.random.key(coords), (1797, coords, coords))
        blocks = x @ jnp.swapaxes(x, 1, 2) / coords + 0.1 * jnp.eye(coords)  # well conditioned: both finite
        programs = [compiled(jnp.linalg.cholesky, (blocks,)), compiled(by_columns, (blocks,))]
        np.testing.assert_allclose(programs[0][0](blocks), programs[1][0](blocks), rtol=1e-4, atol=1e-4)
        lapack, ours = interleaved([(made, (blocks,)) for made, _ in programs], repeats)
        print(f"1,797 blocks of {coords} × {coords}: LAPACK {lapack * 1e3:.3f} ms (compile {programs[0][1]:.2f} s), "
              f"column by column {ours * 1e3:.3f} ms (compile {programs[1][1]:.2f} s)", flush=True)


def float64_options(repeats: int = 30) -> None:
    import optax

    pinn = example("pinn_poisson")
    if not pinn.CPU_OPTIONS:
        print(f"jax {jax.__version__} on {jax.default_backend()}: the example keeps XLA's defaults")
        return
    with jax.enable_x64(True):
        params, points, _, _, _ = pinn.make_problem((64,))
        loss = pinn.two_call_loss((64,))
        opt = lbp.kfac(damping=1e-3, update_every=1, min_damping=1e-20)
        v = jax.tree.map(lambda a: 0.3 * a + 0.01, params)

        def gram(p, v):
            _, grad, G = lbp.gauss_newton(loss)(p, points)
            return G.gram([grad, v])

        def step(p, s):
            value, grad, G = lbp.gauss_newton(loss)(p, points)
            factors = lbp.kfac_factors(loss)(p, points)
            updates, s = opt.update(grad, s, p, factors=factors, curvature=G, value=value,
                                    value_fn=lambda q, **_: loss(q, points))
            return optax.apply_updates(p, updates), s

        state = jax.jit(step)(params, opt.init(params))[1]  # the state after the first update
        parts = {"gauss_newton and the two G products": (gram, (params, v)),
                 "kfac_factors (two calls)": (lambda p: lbp.kfac_factors(loss)(p, points), (params,)),
                 "the whole lbp.kfac step": (step, (params, state))}
        for name, (fn, args) in parts.items():
            default, without = interleaved([(jax.jit(fn), args),
                                            (jax.jit(fn, compiler_options=pinn.CPU_OPTIONS), args)], repeats)
            print(f"{name}: {default * 1e3:.2f} ms default, {without * 1e3:.2f} ms without YNNPACK "
                  f"(jax {jax.__version__})", flush=True)


def woodbury(repeats: int = 7) -> None:
    from jax.flatten_util import ravel_pytree

    from linbackprop._optim._woodbury import _woodbury_qr, woodbury_solve

    pinn = example("pinn_poisson")
    with jax.enable_x64(True):
        params, points, loss, _, _ = pinn.make_problem((64, 64, 48, 48))
        rows = jax.jit(lambda p: lbp.ggn_factor(loss, rank=1)(p, points))(params)
        k = jax.vmap(lambda r: ravel_pytree(r)[0])(rows)
        g = ravel_pytree(jax.jit(lambda p: lbp.grad_by_solve(loss)(p, points))(params))[0]
        gram, qr = jax.jit(woodbury_solve), jax.jit(_woodbury_qr)
        residual = lambda x, lam: float(jnp.linalg.norm(g - lam * x - k.T @ (k @ x)) / jnp.linalg.norm(g))
        print(f"rows {k.shape[0]} x {k.shape[1]}, ‖KKᵀ‖ {float(jnp.linalg.norm(k, 2)) ** 2:.3g}")
        for lam in (1e-2, 1e-6, 1e-9, 1e-12):
            print(f"λ {lam:.0e}: relative residual, Gram form {residual(gram(k, g, lam), lam):.1e}, "
                  f"QR form {residual(qr(k, g, lam), lam):.1e}")
        t_gram, t_qr = interleaved([(gram, (k, g, 1e-6)), (qr, (k, g, 1e-6))], repeats)
        print(f"Gram form {t_gram * 1e3:.0f} ms, QR form {t_qr * 1e3:.0f} ms "
              f"(OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')})")
        step, state = pinn.engd(loss, params, points)  # compiled with XLA's defaults (Woodbury)
        options_step, _ = pinn.engd(loss, params, points, jit_step=pinn.jit)
        default, options = interleaved([(step, (state,)), (options_step, (state,))], repeats)
        print(f"ENGD step, 2-64-64-48-48-1: {default * 1e3:.0f} ms with XLA's defaults, {options * 1e3:.0f} ms with "
              f"{pinn.CPU_OPTIONS or 'the same (no options on this XLA)'} (jax {jax.__version__})")
