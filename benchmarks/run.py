"""Benchmarks: grad_by_solve against jax.grad, side by side in one process.

    python benchmarks/run.py [--repeats 15] [--write-docs] [--quick]
        [--rows {all,gradients,curvature,headline,eager,capture,private,pinn,kfac,lm}]
        [--pinn-network {2-64-1,2-64-64-48-48-1}] [--pinn-seconds S]

Every timing row runs jit(grad_by_solve) and its reference jit(jax.grad) interleaved (medians of
``--repeats`` runs each) and prints the ratio: absolute times are not comparable across runs on a
noisy machine. Compile times are lower + compile of a freshly built network (the compile-and-scaling
rows: medians of three builds). Peak memory is temp + argument + output bytes
from ``compiled.memory_analysis()``. With ``--write-docs`` the tables replace those between the
markers in docs/performance.md (gradients, and where ℳ after the loop pays) and
docs/guides/curvature.md (curvature), and the headline rows those in README.md. ``--rows headline``
is the short list for an accelerator (README's rows and the ℳ-after-the-loop sweep, a few
minutes); on an accelerator ``--write-docs`` writes README's accelerator rows only, naming the
device, and leaves the CPU tables as they are. ``--rows pinn`` (not in ``all``: it takes
6 × ``--pinn-seconds`` of steps) trains the kfac-pinns Poisson problem of
examples/pinn_poisson.py with each method on the same budget (kfac-pinns' 300 s on 2-64-1,
1000 s on the deep-wide 2-64-64-48-48-1) and writes that network's table into
docs/guides/training.md. ``--rows kfac`` (not in ``all``, a few minutes) trains scikit-learn's
digits with ``lbp.kfac`` and Adam (benchmarks/kfac_rows.py) and writes its table there too;
``--rows lm`` (not in ``all``, under a minute) runs Levenberg–Marquardt against optimistix's
(benchmarks/lm_rows.py; optimistix installed by hand) and writes its table there.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script (python benchmarks/run.py): the package from the repository,
    # and not this folder, whose profile.py would stand in for the standard library's (IPython, which flax
    # imports, reads cProfile)
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    sys.path.insert(0, str(here.parent))

import jax

from benchmarks import ROOT
from benchmarks.capture_rows import capture_rows, eager_rows
from benchmarks.curvature_rows import gauss_newton_rows, per_example_rows
from benchmarks.gradient_rows import compile_rows, gradient_rows, threshold_rows
from benchmarks.pinn_rows import PINN_SECONDS, pinn_rows
from benchmarks.private_rows import private_rows
from benchmarks.tables import HEADLINE, headline, small_table, tables, write_between, write_headline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--write-docs", action="store_true",
                        help="write the tables into docs/performance.md, docs/guides/curvature.md and README.md "
                             "(on an accelerator: README's accelerator rows only)")
    parser.add_argument("--quick", action="store_true", help="smaller compile-scaling rows (a smoke test)")
    parser.add_argument("--pinn-network", choices=list(PINN_SECONDS), default="2-64-1", help="--rows pinn: the MLP")
    parser.add_argument("--pinn-seconds", type=float, help="--rows pinn: seconds of steps per method "
                                                           "(default: kfac-pinns' budget for the network)")
    parser.add_argument("--rows", choices=["all", "gradients", "curvature", "headline", "eager", "capture", "private",
                                           "pinn", "kfac", "lm"],
                        default="all",
                        help="which tables to measure (and write); headline: README's rows and where ℳ after the "
                             "loop stops paying, the short list for an accelerator")
    args = parser.parse_args()
    r = args.repeats
    on_cpu = jax.default_backend() == "cpu"
    if args.rows == "headline":
        timing, threshold = gradient_rows(r, HEADLINE), threshold_rows(r)
        print(headline(timing), small_table("where ℳ after the loop pays", threshold), sep="\n\n")
        if args.write_docs:
            write_headline(timing, threshold, args.rows, on_cpu)
        return
    if args.rows == "pinn":
        seconds = args.pinn_seconds or PINN_SECONDS[args.pinn_network]
        text = small_table("Poisson PINN, L2 error (relative) after the budget",
                           pinn_rows(args.pinn_network, seconds), "budget")
        print(text)
        if args.write_docs and on_cpu:
            flags = f" --pinn-network {args.pinn_network}" + (f" --pinn-seconds {seconds:g}" * bool(args.pinn_seconds))
            write_between(ROOT / "docs" / "guides" / "training.md", f"pinn table {args.pinn_network}", text,
                           args.rows, flags)
        return
    if args.rows == "kfac":
        from benchmarks.kfac_rows import kfac_rows

        text = small_table("K-FAC on scikit-learn's digits", kfac_rows(r))
        print(text)
        if args.write_docs and on_cpu:
            write_between(ROOT / "docs" / "guides" / "training.md", "kfac table", text, args.rows)
        return
    if args.rows == "lm":
        from benchmarks.lm_rows import lm_rows

        text = small_table("Levenberg–Marquardt against optimistix", lm_rows(min(r, 5)))
        print(text)
        if args.write_docs and on_cpu:
            write_between(ROOT / "docs" / "guides" / "training.md", "lm table", text, args.rows)
        return
    if args.rows in ("all", "private"):
        text = small_table("DP-SGD's clipped sum", private_rows(r))
        print(text)
        if args.write_docs and on_cpu:
            write_between(ROOT / "docs" / "performance.md", "private table", text, args.rows)
        if args.rows == "private":
            return
    if args.rows in ("all", "capture"):
        text = small_table("a model as it is (`layers=`)", capture_rows(r))
        print(text)
        if args.write_docs and on_cpu:
            write_between(ROOT / "docs" / "performance.md", "capture table", text, args.rows)
        if args.rows == "capture":
            return
    if args.rows in ("all", "eager"):
        text = small_table("the staleness check outside jit", eager_rows(r), "against")
        print(text)
        if args.write_docs and on_cpu:
            write_between(ROOT / "docs" / "performance.md", "eager table", text, args.rows)
        if args.rows == "eager":
            return
    if args.rows in ("all", "curvature"):
        curvature = gauss_newton_rows(r) + per_example_rows(r)
        text = small_table("curvature", curvature)
        print(text)
        if args.write_docs and on_cpu:
            write_between(ROOT / "docs" / "guides" / "curvature.md", "curvature table", text, args.rows)
        if args.rows == "curvature":
            return
    timing, threshold = gradient_rows(r), threshold_rows(r)
    text = tables(timing, compile_rows(args.quick))
    print(text, small_table("where ℳ after the loop pays", threshold), sep="\n\n")
    if args.write_docs:
        if on_cpu:
            write_between(ROOT / "docs" / "performance.md", "benchmark table", text, args.rows)
        write_headline(timing, threshold, args.rows, on_cpu)


if __name__ == "__main__":
    main()
