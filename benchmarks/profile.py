"""Where the time goes, for the readings of docs/performance.md and docs/guides/curvature.md.

    python benchmarks/profile.py compile [--builds 6]      # 12-block GPT: trace / lower / XLA
    python benchmarks/profile.py gn-halves [--shape 128 128 64]
    python benchmarks/profile.py gn-temporaries            # one G·v, 64-layer chain
    perf record -g python benchmarks/profile.py xla ours   # XLA alone, to sample (also: scan)
    python benchmarks/profile.py checkpoint-memory [--sweep 100 --seed 2 --transforms gradient vmap products]
    python benchmarks/profile.py engine-rule [--builds 2]  # loop or unrolled: compile and run time
    python benchmarks/profile.py gram                      # G.gram's products: one by one or vmapped
    python benchmarks/profile.py roots                     # H's small blocks' Cholesky: LAPACK or ours
    python benchmarks/profile.py float64                   # the PINN's K-FAC step with/without YNNPACK
    python benchmarks/profile.py woodbury                  # ENGD's Woodbury solve: Gram or QR form

``compile``: ``jit(grad_by_solve)`` of the GPT of ``examples/transformer_lm.py`` against
``jit(jax.grad)`` over ``lax.scan``, each phase of freshly built networks timed separately
(interleaved builds, the first of each dropped, medians). ``gn-halves``: one Gauss–Newton product
split into its JVP half (forward substitution) and VJP half (back substitution and ℳ), each
against the same half of ``jax.linearize`` + ``jax.linear_transpose`` held once, 10 products per
call with the shared forward pass and gradient subtracted. ``gn-temporaries``: the temporaries
(``memory_analysis()``) of one Gauss–Newton product with the linearisation as its argument, on a
64-layer chain of width 8 and batch 256, against one [depth, batch, width] buffer. ``xla``: the
GPT's XLA compile alone (``--builds`` fresh builds lowered first, then compiled one after the
other), for a sampling profiler: ``perf report --children`` then splits it into LLVM's work on the
fused kernels (``xla::cpu::IrCompiler``), the fusion emitter, thunk emission and the HLO passes.
``checkpoint-memory``: the temporaries (``memory_analysis()``) of calls with ``checkpoints=k``
against the same calls without, for the cases the sequences guide and the CHANGELOG quote
(gradients, Gauss–Newton products, vmap, ``param_products="in_loop"``); ``--sweep n`` adds n
random settings (chains, RNNs, every state an output, two kinds with skips × depth, width, batch,
k, remat, schedule, where ℳΛ is formed; ``--transforms``: of gradients by default, or drawn from
gradients, gradients vmapped over 4 examples and two Gauss–Newton products) and lists every one
where checkpointing kept more.
``engine-rule``: compile time (lower + compile of fresh builds, medians) and run time (medians of
interleaved runs) of ``jit(grad_by_solve)`` with ``engine="loop"`` against ``"unrolled"`` for
networks of a few kinds and depths — a transformer with one layer per block (embedding, blocks,
head: three kinds), residual chains (one kind), a shallow network of distinct layers — and what
``engine="auto"`` picks for each (for the transformers also ``jax.grad`` over ``lax.scan``'s
compile): the measurement behind ``Policy.loop_pays``.
``gram``: ``G.gram([grad, v])`` (K-FAC's two products for its step size and momentum) after
``gauss_newton``, its time less that of ``gauss_newton`` alone (interleaved medians), with the
products one after another and vmapped as one substitution (``Policy.batched_products_cpu``), on
the digits MLP of ``--rows kfac``, the Poisson PINNs of ``examples/pinn_poisson.py`` (float64),
an RNN of 32 steps and a chain of 16 layers: the measurement behind
``Policy.batched_products_pay``.
``roots``: the Cholesky roots of 1,797 random positive definite blocks (what ``block_roots`` takes) of
4, 6 and 10 coordinates with LAPACK's batched Cholesky and with the same roots formed
column by column over the examples, interleaved medians and each one's compile time: the
measurement behind the size below which the library takes the roots column by column.
``float64``: the parts of ``examples/pinn_poisson.py``'s K-FAC step on 2-64-1 (``gauss_newton``
with the two G products, ``kfac_factors`` of the two-call loss, the whole ``lbp.kfac`` step), each
compiled with XLA's defaults and with the example's ``CPU_OPTIONS`` (YNNPACK's dot fusions off),
interleaved medians: the training guide's "float64 on the CPU".
``woodbury``: the Woodbury solve (λI + KᵀK)⁻¹g on the deep-wide PINN's rows (``ggn_factor(rank=1)``
at the initial parameters of 2-64-64-48-48-1: 1,020 × 9,873, float64): the Gram form with its
iterative refinement (``woodbury_solve``) against the QR form, their times (interleaved medians)
and relative residuals ‖g − (λI + KᵀK)x‖ / ‖g‖ at λ from 1e-2 to 1e-12, then the example's ENGD
step compiled with XLA's defaults and with ``CPU_OPTIONS``: the measurement behind
``_optim._gauss_newton.REFINEMENTS`` and the ENGD step's compile options in the example.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the benchmarks package from the repository, and not
    # this folder, where this file would stand in for the standard library's profile (cProfile reads it)
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np

import linbackprop as lbp
from benchmarks import example
from benchmarks.models import chain, fresh, kinds_dag, residual, rnn, transformer
from benchmarks.timing import compiled, interleaved, memory
from linbackprop._options._policy import POLICY


def _block_transformer(blocks: int, width: int = 128, context: int = 64, batch: int = 16):
    """examples/transformer_lm.py's GPT with one layer per block (attention and MLP in one layer
    function, as a flax or equinox Block is called): embedding, blocks, head — three kinds."""
    lm = example("transformer_lm")  # fresh layer functions: a cold compile
    params = lm.init(jax.random.PRNGKey(4), 96, context, width, blocks)
    tokens = jax.random.randint(jax.random.PRNGKey(5), (batch, context + 1), 0, 96)
    block = lambda th, x: lm.mlp((th[1],), lm.attention((th[0],), x))
    layers, previous = [lbp.Layer("embed", lm.embed, ("tokens",), ("wte", "wpe"))], "embed"
    for i in range(blocks):
        layers.append(lbp.Layer(i, block, (previous,), (lbp.Row("attn", i), lbp.Row("mlp", i))))
        previous = i
    layers.append(lbp.Layer("logits", lm.logits, (previous,), ("ln_f", "wte")))
    net = lbp.Network(layers, inputs=["tokens"], outputs="logits")
    scan = lambda p, t: lm.cross_entropy(lm.scan_forward, p, t)  # the reference: jax.grad over lax.scan
    return (lambda p, t: lm.cross_entropy(net, p, t)), (params, tokens), scan


def _distinct(depth: int, width: int = 128, batch: int = 64):
    """``depth`` residual layers, each a function of its own (a kind each)."""
    params = {**{("W", i): jax.random.normal(jax.random.PRNGKey(i), (width, width)) * 0.5 / np.sqrt(width)
                 for i in range(depth)}, **{("b", i): jnp.zeros(width) for i in range(depth)}}
    layers = [lbp.Layer(i + 1, fresh(residual), (i,), (("W", i), ("b", i))) for i in range(depth)]
    net = lbp.Network(layers, [0], depth)
    return (lambda p, x: jnp.sum(net(p, x) ** 2)), (params, jnp.ones((batch, width)))


def engine_rule(builds: int, only: str | None = None) -> None:

    cases = [(f"transformer, {n} blocks (3 kinds, {n + 2} layers)", lambda n=n: _block_transformer(n), n + 2, 3)
             for n in (2, 4, 8, 12)]
    cases += [(f"chain {d}×128×64 (1 kind)", lambda d=d: chain(d, 128, 64)[:2], d, 1) for d in (4, 8, 12, 16)]
    cases += [(f"chain {d}×32×8 (1 kind)", lambda d=d: chain(d, 32, 8)[:2], d, 1) for d in (4, 8, 12)]
    cases += [(f"{d} distinct layers ({d} kinds)", lambda d=d: _distinct(d), d, d) for d in (4, 8)]
    for name, build, depth, kinds in cases:
        if only and only not in name:
            continue
        times, runs = {}, []
        for engine in ("loop", "unrolled"):
            spent, scan = [], []
            for _ in range(builds):
                loss, args, *reference = build()
                c, t = compiled(lbp.grad_by_solve(loss, engine=engine), args)
                spent.append(t)
                if reference and engine == "loop":  # the transformers: jax.grad over lax.scan, built fresh
                    scan.append(compiled(jax.grad(reference[0]), args)[1])
            times[engine] = float(np.median(spent))
            times.setdefault("scan", float(np.median(scan)) if scan else None)
            runs.append((c, args))
        t_loop, t_unrolled = interleaved(runs, 9)
        auto = "loop" if POLICY.loop_pays(depth, kinds) else "unrolled"
        print(f"{name:42s} compile loop {times['loop']:6.2f} s  unrolled {times['unrolled']:6.2f} s   "
              f"run loop/unrolled {t_loop / t_unrolled:5.2f} ({t_loop * 1e3:7.2f} / {t_unrolled * 1e3:7.2f} ms)   "
              f"auto: {auto}" + (f"   (jax.grad over lax.scan compiles in {times['scan']:.2f} s: loop "
                                  f"{times['loop'] / times['scan']:.2f}x)" if times["scan"] else ""), flush=True)


def compile_phases(builds: int) -> None:
    phases = {"ours": [], "lax.scan": []}
    for _ in range(builds + 1):
        for name in phases:
            loss, args, ref, ref_args = transformer(12, 128, 64, 16)
            f, a = (lbp.grad_by_solve(loss), args) if name == "ours" else (jax.grad(ref), ref_args)
            t0 = time.perf_counter()
            traced = jax.jit(f).trace(*a)
            t1 = time.perf_counter()
            lowered = traced.lower()
            t2 = time.perf_counter()
            lowered.compile()
            phases[name].append((t1 - t0, t2 - t1, time.perf_counter() - t2))
    medians = {name: np.median(np.array(times[1:]), axis=0) for name, times in phases.items()}
    for name, (trace, lower, xla) in medians.items():
        print(f"{name:9s} trace {trace:.3f} s  lower {lower:.3f} s  XLA {xla:.3f} s  total {trace + lower + xla:.3f} s")
    print(f"compile ratio {medians['ours'].sum() / medians['lax.scan'].sum():.2f}")


def xla_only(which: str, builds: int) -> None:
    lowered = []
    for _ in range(builds):
        loss, args, ref, ref_args = transformer(12, 128, 64, 16)
        f, a = (lbp.grad_by_solve(loss), args) if which == "ours" else (jax.grad(ref), ref_args)
        lowered.append(jax.jit(f).trace(*a).lower())
    start = time.perf_counter()
    for lo in lowered:
        lo.compile()
    print(f"{which}: XLA {(time.perf_counter() - start) / builds:.3f} s per build")


def gauss_newton_halves(shape: tuple[int, int, int], products: int = 10) -> None:
    _, (params, x), _, _ = chain(*shape)
    y = jnp.zeros_like(x)
    layer = fresh(residual)

    def model(p, x):
        return jax.lax.scan(lambda u, wb: (layer(wb, u), None), x, (p["W"], p["b"]))[0]

    net = lbp.Network([lbp.Layer(i, layer, (i - 1,), (lbp.Row("W", i - 1), lbp.Row("b", i - 1)))
                       for i in range(1, shape[0] + 1)], [0], shape[0])
    loss = lambda p, x: 0.5 * jnp.sum((net(p, x) - y) ** 2)

    def ours(half):
        def f(p, x):
            _, grad, G = lbp.gauss_newton(loss)(p, x)
            if half == "jvp":
                step = lambda i, acc: acc + G._jvp(jax.tree.map(lambda a: a * (1 + i), grad))[0]
                return jax.lax.fori_loop(0, products, step, jnp.zeros_like(x))
            if half == "vjp":
                step = lambda i, acc: jax.tree.map(jnp.add, acc, G._vjp((x * i,))[0])
                return jax.lax.fori_loop(0, products, step, grad)
            return grad
        return f

    def held(half):
        def f(p, x):
            out, jvp = jax.linearize(lambda q: model(q, x), p)
            vjp = jax.linear_transpose(jvp, p)
            grad = vjp(out - y)[0]
            if half == "jvp":
                step = lambda i, acc: acc + jvp(jax.tree.map(lambda a: a * (1 + i), grad))
                return jax.lax.fori_loop(0, products, step, jnp.zeros_like(x))
            if half == "vjp":
                step = lambda i, acc: jax.tree.map(jnp.add, acc, vjp(x * i)[0])
                return jax.lax.fori_loop(0, products, step, grad)
            return grad
        return f

    args = (params, x)
    halves = ("jvp", "vjp", "none")
    fns = [compiled(make(half), args)[0] for half in halves for make in (ours, held)]
    t = dict(zip([(half, side) for half in halves for side in ("ours", "held")],
                 interleaved([(f, args) for f in fns], 10)))
    for half in ("jvp", "vjp"):
        each = {side: (t[(half, side)] - t[("none", side)]) / products for side in ("ours", "held")}
        print(f"{half} half: ours {each['ours'] * 1e3:.2f} ms, held {each['held'] * 1e3:.2f} ms, "
              f"ratio {each['ours'] / each['held']:.2f}")


def gauss_newton_temporaries(depth: int = 64, batch: int = 256, width: int = 8) -> None:
    loss, (params, x) = chain(depth, width, batch)[:2]
    G = jax.jit(lbp.gauss_newton(loss, param_products="in_loop", engine="loop"))(params, x)[2]
    temps = jax.jit(lambda G, v: G.mv(v)).lower(G, params).compile().memory_analysis().temp_size_in_bytes
    buffer = depth * batch * width * 4
    print(f"G·v temporaries {temps / 1e3:.0f} KB; one [depth, batch, width] buffer {buffer / 1e3:.0f} KB")


def _temporaries(fn, args) -> int:
    return memory(compiled(fn, args)[0])[1]


def _gradient(loss, **settings):
    return lbp.grad_by_solve(loss, **settings)


def _products(count: int):
    """``count`` Gauss–Newton products G(G(…g)) in one program."""
    def make(loss, **settings):
        def f(p, *rest):
            _, g, G = lbp.gauss_newton(loss, **settings)(p, *rest)
            for _ in range(count):
                g = G.mv(g)
            return g
        return f
    return make


def _vmapped(loss, **settings):
    """Gradients per example, weights shared (every argument but the first batched)."""
    def f(p, *rest):
        return jax.vmap(lbp.grad_by_solve(loss, **settings), in_axes=(None,) + (0,) * len(rest))(p, *rest)
    return f


def _batched(args: tuple, examples: int = 4) -> tuple:
    return (args[0], *(jnp.stack([a] * examples) for a in args[1:]))


def checkpoint_ratio(made, loss, args, k: int, schedule: str = "even", **settings) -> tuple[int, int]:
    """Temporaries (bytes) without and with ``checkpoints=k`` (placed by ``schedule``), everything
    else alike."""
    return (_temporaries(made(loss, **settings), args),
            _temporaries(made(loss, checkpoints=k, schedule=schedule, **settings), args))


TRANSFORMS = {"gradient": _gradient, "vmap": _vmapped, "products": _products(2)}


def checkpoint_sweep(count: int, seed: int, transforms: tuple[str, ...] = ("gradient",)):
    """``count`` random settings with checkpoints: (what, temporaries without, with). Gradients, or
    a transformation drawn from ``transforms`` (``TRANSFORMS``: gradients, gradients vmapped over
    4 examples, two Gauss–Newton products)."""
    rng = np.random.default_rng(seed)
    picked = []

    def pick(*options):
        picked.append(int(rng.choice(options)))
        return picked[-1]

    networks = {
        "chain": lambda: chain(pick(8, 24, 64), pick(8, 32, 64), pick(1, 4, 32)),
        "rnn": lambda: rnn(pick(32, 64, 200, 256), pick(16, 32), pick(1, 8)),
        "rnn, Stack": lambda: rnn(pick(32, 64, 200), 32, pick(1, 8), every=True),
        "two kinds, skips": lambda: kinds_dag(pick(8, 16, 24), pick(16, 32), pick(1, 4), kinds=2),
    }
    settings = [{}, {"remat": True}, {"schedule": "nested"}, {"param_products": "after"},
                {"param_products": "in_loop"}]
    for _ in range(count):
        name, picked[:] = str(rng.choice(list(networks))), []
        loss, args = networks[name]()[:2]
        shape = tuple(picked)  # the builder's arguments: chain (depth, width, batch), rnn (steps, width, batch) …
        k, extra = pick(2, 3, 5, 9, 13, 20), settings[rng.integers(len(settings))]
        how = transforms[0] if len(transforms) == 1 else str(rng.choice(transforms))
        if how == "vmap":
            args = _batched(args)
        yield (f"{how}: {name}{shape} k={k} {extra}", *checkpoint_ratio(TRANSFORMS[how], loss, args, k, **extra))


def checkpoint_memory(sweep: int, seed: int = 0, transforms: tuple[str, ...] = ("gradient",)) -> None:
    rnn_ = lambda steps, every=False: rnn(steps, 32, 8, every)[:2]
    cases = [  # what, network, transformation, k, settings
        ("gradient, RNN T=256 (segments unrolled)", rnn_(256), _gradient, 20, {}),
        ("gradient, RNN T=256, every state an output", rnn_(256, True), _gradient, 15, {}),
        ("gradient, chain 64x64x32", chain(64, 64, 32)[:2], _gradient, 5, {}),
        ("gradient, RNN T=64, ℳΛ in the loop asked for", rnn_(64), _gradient, 6, {"param_products": "in_loop"}),
        ("gradient, RNN T=200, remat", rnn_(200), _gradient, 13, {"remat": True}),
        ("gradient, chain 24x32x1, ℳΛ in the loop asked for", chain(24, 32, 1)[:2], _gradient, 9,
         {"param_products": "in_loop"}),
        ("gradient, chain 64x64x4", chain(64, 64, 4)[:2], _gradient, 9, {}),
        ("one G·v, chain 24x32x4", chain(24, 32, 4)[:2], _products(1), 5, {}),
        ("three G·v, chain 24x32x4", chain(24, 32, 4)[:2], _products(3), 5, {}),
        ("one G·v, chain 64x64x32", chain(64, 64, 32)[:2], _products(1), 5, {}),
        ("one G·v, RNN T=256", rnn_(256), _products(1), 20, {}),
        ("two G·v, RNN T=256", rnn_(256), _products(2), 20, {}),
        ("vmap of gradients, chain 24x32x4", chain(24, 32, 4)[:2], _vmapped, 8, {}),
        ("vmap of gradients, RNN T=128", rnn_(128), _vmapped, 8, {}),
        ("vmap of gradients, RNN T=200 (segments tile xs), remat", rnn_(200), _vmapped, 20, {"remat": True}),
    ]
    print(f"{'':56s} {'without':>10s} {'with':>10s} {'ratio':>6s}")
    for what, (loss, args), made, k, settings in cases:
        args = _batched(args) if made is _vmapped else args
        without, with_ = checkpoint_ratio(made, loss, args, k, **settings)
        print(f"{what + f', k={k}':56s} {without / 1e3:8.1f}KB {with_ / 1e3:8.1f}KB {with_ / without:6.2f}")
    if not sweep:
        return
    worse, saved = [], []
    for setting, without, with_ in checkpoint_sweep(sweep, seed, transforms):
        saved += [with_ / without] if with_ < without else []
        if with_ > without:
            worse.append(f"  {setting}: {without} -> {with_} bytes ({with_ / without:.3f}x)")
    same = sweep - len(saved) - len(worse)
    print(f"sweep of {sweep} settings (seed {seed}): checkpoints kept less in {len(saved)} (median ratio "
          f"{np.median(saved) if saved else 1:.2f}), as much in {same}, more in {len(worse)}")
    print("\n".join(worse))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["compile", "gn-halves", "gn-temporaries", "xla", "engine-rule",
                                         "checkpoint-memory", "gram", "roots", "float64",
                                         "woodbury"])
    parser.add_argument("which", nargs="?", choices=["ours", "scan"], default="ours", help="xla: whose program")
    parser.add_argument("--builds", type=int, default=6)
    parser.add_argument("--shape", type=int, nargs=3, default=(128, 128, 64))
    parser.add_argument("--sweep", type=int, default=0, help="checkpoint-memory: random settings to add")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default=None, help="engine-rule: the cases whose name contains this")
    parser.add_argument("--transforms", nargs="+", choices=list(TRANSFORMS), default=["gradient"],
                        help="checkpoint-memory --sweep: what to draw from (default: gradients)")
    options = parser.parse_args()
    if options.what == "compile":
        compile_phases(options.builds)
    elif options.what == "xla":
        xla_only(options.which, options.builds)
    elif options.what == "checkpoint-memory":
        checkpoint_memory(options.sweep, options.seed, tuple(options.transforms))
    elif options.what == "gn-halves":
        gauss_newton_halves(tuple(options.shape))
    elif options.what == "engine-rule":
        engine_rule(options.builds, options.only)
    elif options.what in ("gram", "roots", "float64", "woodbury"):  # the linear algebra's profiles
        from benchmarks import profile_linalg

        {"gram": profile_linalg.gram_products, "roots": profile_linalg.small_roots,
         "float64": profile_linalg.float64_options, "woodbury": profile_linalg.woodbury}[options.what]()
    else:
        gauss_newton_temporaries()
