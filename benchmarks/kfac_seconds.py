"""K-FAC against the first-order optimizer at equal wall time: the RNN and the transformer LM
examples trained with ``lbp.kfac``, then with Adam / AdamW for the same seconds of step time
(compile excluded on both sides), the training loss against seconds in one picture each.

    OPENBLAS_NUM_THREADS=1 python benchmarks/kfac_seconds.py [--rnn-steps 400] [--lm-steps 200]
        [--out-dir docs]

K-FAC runs its steps first and sets the budget T (its seconds of step time); the other optimizer
then runs until it has spent T (Adam at the RNN example's rate 1e-2; AdamW with the LM example's
warm-up and cosine schedule, sized to the steps that fit in T from K-FAC's run's median step
times). Each curve is the mean loss of the 10 steps before each point; the printed table reads
them at quarters of T.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the package from the repository
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from benchmarks import example


def smoothed(losses: list[float], window: int = 10) -> np.ndarray:
    """The mean of the ``window`` losses up to each step (fewer at the start)."""
    cumulative = np.cumsum(np.asarray(losses, np.float64))
    n = np.arange(1, len(losses) + 1)
    lagged = np.concatenate([np.zeros(window), cumulative[:-window]]) if len(losses) > window else np.zeros(len(losses))
    return (cumulative - lagged[: len(losses)]) / np.minimum(n, window)


def at_seconds(run: dict, t: float) -> float:
    """The smoothed loss at the last step that ended by ``t`` seconds of step time."""
    k = max(int(np.searchsorted(np.asarray(run["seconds"]), t, side="right")) - 1, 0)
    return float(smoothed(run["losses"])[k])


def compare(title: str, runs: dict[str, dict], out: Path | None, log: bool) -> list[str]:
    """The table rows (loss at quarters of K-FAC's time) and the picture of both runs."""
    budget = next(iter(runs.values()))["seconds"][-1]
    marks = [budget * k / 4 for k in range(1, 5)]
    lines = [f"{title}: the loss (mean of 10 steps) at seconds of step time",
             "| seconds | " + " | ".join(runs) + " |", "|---|" + "---|" * len(runs)]
    for t in marks:
        lines.append(f"| {t:.2f} | " + " | ".join(f"{at_seconds(run, t):.3g}" for run in runs.values()) + " |")
    lines.append("| steps | " + " | ".join(str(len(run["losses"])) for run in runs.values()) + " |")
    if out is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        for name, run in runs.items():
            ax.plot(run["seconds"], smoothed(run["losses"]), lw=1.0, label=f"{name} ({len(run['losses'])} steps)")
        ax.set(xlabel="seconds of step time (compile excluded)", ylabel="training loss (mean of 10 steps)",
               title=title)
        if log:
            ax.set_yscale("log")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out, dpi=120)
        plt.close(fig)
        lines.append(f"wrote {out}")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rnn-steps", type=int, default=400, help="K-FAC's steps on the RNN (sets its budget)")
    parser.add_argument("--lm-steps", type=int, default=200, help="K-FAC's steps on the LM (sets its budget)")
    parser.add_argument("--out-dir", default="", help="where the PNGs go ('' for none)")
    args = parser.parse_args(argv)
    out_dir = Path(args.out_dir) if args.out_dir else None

    rnn = example("rnn_sequence")
    kfac = rnn.main(args.rnn_steps, optimizer="kfac")
    adam = rnn.main(100 * args.rnn_steps, optimizer="adam", seconds=kfac["seconds"][-1])
    lines = compare("echo RNN (examples/rnn_sequence.py)", {"lbp.kfac": kfac, "Adam (lr 1e-2)": adam},
                    out_dir / "rnn_kfac_seconds.png" if out_dir else None, log=True)

    lm = example("transformer_lm")
    kfac = lm.main(args.lm_steps, out=None, progress=False, optimizer_name="kfac")
    budget = kfac["seconds"][-1]
    fits = math.ceil(1.1 * budget / kfac["times"]["jax.grad over lax.scan"])  # AdamW's schedule spans them
    adamw = lm.main(fits, out=None, progress=False, seconds=budget)
    lines += [""] + compare("character-level GPT (examples/transformer_lm.py)",
                            {"lbp.kfac": kfac, "AdamW (warm-up, cosine)": adamw},
                            out_dir / "transformer_kfac_seconds.png" if out_dir else None, log=False)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
