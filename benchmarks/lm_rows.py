"""Levenberg–Marquardt against optimistix's (``python benchmarks/run.py --rows lm``): a tanh MLP
2-16-16-1 (337 parameters) fit to 256 points of a smooth function, least squares, float32.

``lbp.scale_by_gauss_newton`` with its defaults (λ₀ = 10⁻³ · max diag G, Nielsen's rule) in one
jitted iteration — the residuals' rows (``rows=lbp.ggn_factor``) or the operator
(``curvature=G``), both exact by Woodbury (256 rows < 337 parameters) — against
``optimistix.LevenbergMarquardt`` stepped one iteration at a time (``solver.step``, jitted). The
rows: ½‖r‖² after 10, 25 and 100 iterations, the iterations from 1 to 100 at which either of
ours is behind, the seconds per iteration (medians of interleaved
runs) and the loss at equal time. optimistix is not a dependency: ``pip install optimistix``
(without it the row says so).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

import linbackprop as lbp

from .timing import seconds_per_step

ITERATIONS = (10, 25, 100)
EVERY = tuple(range(1, 101))


def lm_problem() -> tuple[Callable, Callable, dict]:
    """The residual function r(params) (½‖r‖² = ½ mean of the squared errors), the network's loss
    and the initial parameters."""
    sizes = (2, 16, 16, 1)
    dense = lambda th, u: jnp.tanh(u @ th[0] + th[1])
    head = lambda th, u: u @ th[0] + th[1]
    net = lbp.Network([lbp.Layer(1, dense, (0,), ("W0", "b0")), lbp.Layer(2, dense, (1,), ("W1", "b1")),
                       lbp.Layer(3, head, (2,), ("W2", "b2"))], [0], 3)
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.uniform(keys[3], (256, 2), jnp.float32, -1.0, 1.0)
    y = jnp.sin(3 * x[:, :1]) * jnp.cos(2 * x[:, 1:])
    params = {}
    for i, (m, n) in enumerate(itertools.pairwise(sizes)):
        params[f"W{i}"] = jax.random.normal(keys[i], (m, n), jnp.float32) / jnp.sqrt(m)
        params[f"b{i}"] = jnp.zeros(n, jnp.float32)
    scale = 1 / jnp.sqrt(jnp.float32(x.shape[0]))
    residuals = lambda p: ((net(p, x) - y) * scale).ravel()
    loss = lambda p: 0.5 * jnp.sum(((net(p, x) - y) * scale) ** 2)
    return residuals, loss, params


def ours(loss: Callable, params: dict, given: str) -> tuple[Callable, tuple]:
    """One jitted Levenberg–Marquardt iteration of ``scale_by_gauss_newton`` (its defaults)."""
    tx = optax.chain(lbp.scale_by_gauss_newton(), optax.scale(-1.0))

    @jax.jit
    def step(p, state):
        if given == "rows":
            value, grad = lbp.value_and_grad_by_solve(loss)(p)
            kwargs = {"rows": lbp.ggn_factor(loss)(p)}
        else:
            value, grad, G = lbp.gauss_newton(loss)(p)
            kwargs = {"curvature": G}
        updates, state = tx.update(grad, state, p, value=value, value_fn=lambda q: loss(q), **kwargs)
        return optax.apply_updates(p, updates), state

    return step, (params, tx.init(params))


def theirs(residuals: Callable, params: dict) -> tuple[Callable, tuple] | None:
    """optimistix's Levenberg–Marquardt, one ``solver.step`` per call (None without optimistix)."""
    try:
        import optimistix as optx
    except ImportError:
        return None
    solver = optx.LevenbergMarquardt(rtol=1e-12, atol=1e-12)
    fn = lambda p, _: (residuals(p), None)  # solver.step takes (value, aux)
    f_struct = jax.eval_shape(lambda: residuals(params))
    state = solver.init(fn, params, None, {}, f_struct, None, frozenset())

    import equinox as eqx  # optimistix's own dependency

    @eqx.filter_jit  # the state holds a linearised jaxpr: jax.jit cannot take it
    def step(p, state):
        p, state, _ = solver.step(fn, p, None, {}, state, frozenset())
        return p, state

    return step, (params, state)


def _losses(step: Callable, carry: tuple, loss: Callable, counts: tuple[int, ...]) -> dict[int, float]:
    out, done = {}, 0
    for n in counts:
        for _ in range(n - done):
            carry = step(*carry)
        done = n
        out[n] = float(loss(carry[0]))
    return out


def lm_rows(repeats: int) -> list[tuple[str, str, str]]:
    residuals, loss, params = lm_problem()
    methods = {"ours, rows=": ours(loss, params, "rows"), "ours, curvature=G": ours(loss, params, "operator")}
    other = theirs(residuals, params)
    if other is None:
        rows = [("optimistix.LevenbergMarquardt", "not installed (pip install optimistix)", "—")]
    else:
        methods["optimistix"] = other
        rows = []
    curves = {name: _losses(step, carry, loss, EVERY) for name, (step, carry) in methods.items()}
    times = {name: sorted(seconds_per_step(step, carry, 50)[1] for _ in range(repeats))[repeats // 2]
             for name, (step, carry) in methods.items()}
    what = "MLP 2-16-16-1 (337 parameters), 256 residuals, float32"
    for n in ITERATIONS:
        rows.append((f"{what}: ½‖r‖² after {n} iterations",
                     ", ".join(f"{name} {curves[name][n]:.2e}" for name in methods), "ours ≤ optimistix"))
    if other is not None:
        behind = [n for n in EVERY if max(curves["ours, rows="][n], curves["ours, curvature=G"][n])
                  > curves["optimistix"][n]]
        rows.append(("same, iterations 1–100 where either of ours is behind optimistix", str(len(behind)), "0"))
    for name in methods:
        rows.append((f"same, ms per iteration: {name}", f"{times[name] * 1e3:.2f}", "—"))
    if other is not None:
        budget = 100 * times["optimistix"]
        for name in ("ours, rows=", "ours, curvature=G"):
            n = max(1, int(budget / times[name]))
            rows.append((f"same, at optimistix's time for 100 iterations ({budget * 1e3:.0f} ms): {name}",
                         f"{_losses(*methods[name], loss, (n,))[n]:.2e} ({n} iterations)",
                         f"≤ {curves['optimistix'][100]:.2e}"))
    for row in rows:
        print(row, flush=True)
    return rows


if __name__ == "__main__":
    lm_rows(5)
