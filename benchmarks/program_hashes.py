"""Hashes of the programs linbackprop builds, to check that a change inside the package (a move,
a rename, a refactor) changes none of them. Not a benchmark: a script.

    python benchmarks/program_hashes.py before.json        # at the commit before (a git worktree)
    python benchmarks/program_hashes.py after.json         # at the change
    python benchmarks/program_hashes.py --compare before.json after.json

Each program is hashed twice over: its jaxpr (with the solve primitive's parameter — its name and
printed form, not behaviour — removed) and its lowered StableHLO, which holds what the primitive
computes (a jaxpr shows the primitive, not its implementation). The programs: gradients,
values and gradients, G·g, vmapped gradients, ``jvp_by_solve``, HVPs over a chain, a short
chain, an RNN (its last state, and a ``Stack`` of every state) and a skip DAG × the engines,
``param_products``, ``remat`` and checkpoints; the `Policy` switches that decide where Λ is
carried and which contractions move last; the curvature transforms; ``layers=`` captures. Run
with the same JAX and ``PYTHONHASHSEED`` on both sides.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp

import linbackprop as lbp
from linbackprop._options._policy import Policy
from linbackprop._options._settings import Settings, using

SOLVE_PARAMETER = re.compile(r"\s*(system|variant)=\w+\(\d+ layers, outputs \[[^\]]*\](, [a-z ]+)*\)")


def digest(f: Callable, *args) -> str:
    """The hash of ``f``'s jaxpr (the solve parameter removed) and lowered StableHLO at ``args``."""
    text = SOLVE_PARAMETER.sub("", str(jax.make_jaxpr(f)(*args))) + jax.jit(f).lower(*args).as_text()
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def chain(depth: int = 8, width: int = 4, batch: int = 3) -> tuple[Callable, tuple]:
    step = lambda th, u: u + jnp.tanh(u @ th[0] + th[1])
    net = lbp.Network([lbp.Layer(i, step, (i - 1,), (lbp.Row("W", i - 1), lbp.Row("b", i - 1)))
                       for i in range(1, depth + 1)], [0], depth)
    p = {"W": 0.1 * jax.random.normal(jax.random.key(1), (depth, width, width)), "b": jnp.zeros((depth, width))}
    return (lambda p, x: jnp.sum(net(p, x) ** 2)), (p, jnp.ones((batch, width)))


def rnn(steps: int = 12, width: int = 4, batch: int = 3, every: bool = False) -> tuple[Callable, tuple]:
    cell = lambda th, h, x: jnp.tanh(h @ th[0] + x @ th[1] + th[2])
    layers = [lbp.Layer(t, cell, (t - 1, lbp.Row("xs", t - 1)), ("A", "B", "c")) for t in range(1, steps + 1)]
    net = lbp.Network(layers, [0, "xs"], lbp.Stack(range(1, steps + 1)) if every else steps)
    k = jax.random.split(jax.random.key(0), 3)
    p = {"A": 0.1 * jax.random.normal(k[0], (width, width)), "B": 0.1 * jax.random.normal(k[1], (width, width)),
         "c": jnp.zeros(width)}
    args = (p, jnp.ones((batch, width)), jnp.ones((steps, batch, width)))
    return (lambda p, h0, xs: jnp.sum(net(p, h0, xs) ** 2)), args


def skips(depth: int = 4, width: int = 3, batch: int = 2) -> tuple[Callable, tuple]:
    dense = lambda th, u, s: jnp.tanh(u @ th[0] + th[1]) + s
    net = lbp.Network([lbp.Layer(i, dense, (i - 1, max(i - 2, 0)), (f"W{i}", f"b{i}")) for i in range(1, depth + 1)],
                      [0], depth)
    p = {f"W{i}": 0.3 * jax.random.normal(jax.random.key(i), (width, width)) for i in range(1, depth + 1)}
    p |= {f"b{i}": jnp.zeros(width) for i in range(1, depth + 1)}
    return (lambda p, x: jnp.sum(net(p, x) ** 2)), (p, jnp.ones((batch, width)))


CASES = {"chain": chain, "chain-short": lambda: chain(3), "rnn": rnn, "rnn-every": lambda: rnn(every=True),
         "skips": skips}
SETTINGS = [{}, {"engine": "loop"}, {"engine": "unrolled"}, {"param_products": "in_loop"},
            {"param_products": "after"}, {"remat": True}, {"checkpoints": 3}]
POLICIES = {"carried": Policy(carried_back_max_kept=1.0), "not carried": Policy(carried_back_max_kept=0.0),
            "contract first": Policy(contract_first_min_cpu=1, contract_first_max_cpu=10**6),
            "no contract first": Policy(contract_first_max_cpu=0)}


def solve_programs(out: dict) -> None:
    for name, make in CASES.items():
        loss, args = make()
        t = jax.tree.map(jnp.ones_like, args[0])
        zeros = tuple(map(jnp.zeros_like, args[1:]))
        batched = (args[0], *(jnp.stack([a, a]) for a in args[1:]))
        for st in SETTINGS:
            key = f"{name} {json.dumps(st)}"
            grad = lbp.grad_by_solve(loss, **st)
            eng = {k: v for k, v in st.items() if k == "engine"}
            out[key + " grad"] = digest(grad, *args)
            out[key + " value_and_grad"] = digest(lbp.value_and_grad_by_solve(loss, **st), *args)
            out[key + " G.g"] = digest(lambda *a, st=st: (lambda v, g, G: G.mv(g))(*lbp.gauss_newton(loss, **st)(*a)),
                                       *args)
            out[key + " vmap grad"] = digest(jax.vmap(grad, in_axes=(None,) + (0,) * (len(args) - 1)), *batched)
            out[key + " jvp"] = digest(lambda p, *r, eng=eng: lbp.jvp_by_solve(loss, (p, *r), (t, *zeros), **eng),
                                       *args)
            out[key + " hvp"] = digest(lambda p, *r, grad=grad: jax.jvp(lambda q: grad(q, *r), (p,), (t,)), *args)


def policy_programs(out: dict) -> None:
    for name in ("chain", "rnn", "rnn-every", "skips"):
        loss, args = CASES[name]()
        t = jax.tree.map(jnp.ones_like, args[0])
        for label, policy in POLICIES.items():
            for engine in ("loop", "unrolled"):
                key = f"{name} {label} {engine}"
                with using(Settings(policy=policy)):
                    grad = lbp.grad_by_solve(loss, engine=engine, param_products="after")
                    both = lbp.grad_by_solve(loss, argnums=(0, 1), engine=engine, param_products="after")
                    inputs = lbp.grad_by_solve(loss, argnums=1, engine=engine, param_products="after")
                    out[key + " grad"] = digest(grad, *args)
                    out[key + " grad in (θ, x)"] = digest(both, *args)
                    out[key + " hvp"] = digest(lambda p, *r: jax.jvp(lambda q: grad(q, *r), (p,), (t,)), *args)
                    out[key + " grad of an input gradient"] = digest(
                        lambda p, *r: jax.grad(lambda q: jnp.sum(inputs(q, *r)))(p), *args)
        out[name + " kfac_factors"] = digest(lbp.kfac_factors(loss), *args)
        out[name + " diag_ggn"] = digest(lbp.diag_ggn(loss), *args)
        out[name + " one pass"] = digest(
            lambda *a: lbp.gauss_newton(loss, factors=True, diagonal=True, samples=1, key=jax.random.key(0))(*a)[2]
            .factors, *args)


@lbp.layer
def _dense(W, b, u):
    return jnp.tanh(u @ W + b)


def capture_programs(out: dict) -> None:
    def looped(p, x):
        for i in range(4):
            x = _dense(p[f"W{i}"], p[f"b{i}"], x)
        return 0.5 * jnp.sum(x**2)

    def scanned(p, x):
        return 0.5 * jnp.sum(jax.lax.scan(lambda u, wb: (_dense(wb[0], wb[1], u), None), x, (p["Ws"], p["bs"]))[0] ** 2)

    p = {f"W{i}": jax.random.normal(jax.random.fold_in(jax.random.key(0), i), (4, 4)) / 2 for i in range(4)}
    p |= {f"b{i}": jnp.zeros(4) for i in range(4)}
    stacked = {"Ws": jnp.stack([p[f"W{i}"] for i in range(4)]), "bs": jnp.zeros((4, 4))}
    x = jnp.ones((3, 4))
    for name, fn, params in (("layer loop", looped, p), ("scan", scanned, stacked)):
        out[f"layers= {name} grad"] = digest(lbp.grad_by_solve(fn, layers=_dense), params, x)
        out[f"layers= {name} kfac_factors"] = digest(lbp.kfac_factors(fn, layers=_dense), params, x)
        out[f"layers= {name} diag_ggn"] = digest(lbp.diag_ggn(fn, layers=_dense), params, x)
        out[f"layers= {name} G.v"] = digest(lambda q, y, fn=fn: lbp.gauss_newton(fn, layers=_dense)(q, y)[2].mv(q),
                                            params, x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", help="where to write the hashes (JSON)")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="two files this script wrote")
    args = parser.parse_args()
    if args.compare:
        before, after = (json.load(open(f)) for f in args.compare)
        differ = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        print(f"{len(before)} / {len(after)} programs, {len(differ)} differ" + "".join(f"\n  {k}" for k in differ))
        raise SystemExit(1 if differ else 0)
    jax.config.update("jax_enable_x64", True)
    out: dict[str, str] = {}
    solve_programs(out)
    policy_programs(out)
    capture_programs(out)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=0, sort_keys=True)
    print(f"{len(out)} programs hashed into {args.out}")


if __name__ == "__main__":
    main()
