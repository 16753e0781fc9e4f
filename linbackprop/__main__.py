"""``python -m linbackprop``: the demo.

1. The seed's network: patterns of ℒ and ℳ*, and the gradient ℳ((ℒ*)⁻¹∇Uℓ) + αθ checked against
   finite differences, jax.grad and grad_by_solve.
2. A DAG network with skip connections and a shared block learns the digits data set (shipped
   with scikit-learn) with optax and grad_by_solve; prints the held-out test accuracy.
3. Writes a PNG: ℒ and ℳ* of the seed network, the digits network's DAG, the loss curve.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax

from ._pictures import main as seed_main


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m linbackprop", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=30, help="training epochs on digits (default 30)")
    parser.add_argument("--seed", type=int, default=0, help="random seed of data, split and initialisation")
    parser.add_argument("--out", default="linbackprop_demo.png", help="where to write the PNG")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    print("== 1. The seed network ==\n")
    checks = seed_main(42 + args.seed)

    print("\n== 2. Training on digits with optax and grad_by_solve ==\n")
    from ._pictures import digits_network, figure, train_digits

    print(digits_network(), "\n")
    run = train_digits(epochs=args.epochs, seed=args.seed, progress=not args.no_progress)
    print(f"final training loss {run['losses'][-1]:.4f}; held-out test accuracy {run['test_accuracy']:.4f} "
          f"({run['seconds']:.1f} s for {args.epochs} epochs, compilation included)")

    print("\n== 3. Picture ==\n")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install 'linbackprop[examples]')")
        return {**checks, **run}
    from ._operators import linearize
    from ._pictures import seed_problem

    out = Path(args.out).resolve()
    with jax.enable_x64(True):
        net, theta, u0, _ = seed_problem(42 + args.seed)
        figure(str(out), linearize(net, theta, u0), run["net"], run["losses"])
    print(f"wrote {out}")
    return {**checks, **run, "png": str(out)}


if __name__ == "__main__":
    main()
