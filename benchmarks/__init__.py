"""The benchmarks: each row family a module, measured side by side with its reference in one process.

Run ``python benchmarks/run.py`` (or ``python -m benchmarks.run``) from the repository; see
`run` for the options. Modules: `timing` (the one timing helper: compiled programs, runs
interleaved, steps of a loop, memory), `models` (the networks and their references), the row
families `gradient_rows`, `curvature_rows`, `private_rows`, `capture_rows`, `gru_rows`,
`pinn_rows`, `kfac_rows`, `lm_rows`, `digits_problems` (the digits data and initial parameters both
sides of the K-FAC comparison use, no linbackprop in it), and `tables` (printing and writing into
the docs).
`pinn_starts.py` (the probed Gauss–Newton step from many starts, and its rule's ablation),
`profile.py` (the memory and engine profiles), `kfac_jax_digits.py` (kfac-jax's side, in its own
environment), the influence functions' `influence_lds.py` (the linear datamodeling score against
TRAK), `influence_cost.py` (seconds and memory against the plain form), `influence_mislabels.py`
(self-influence on flipped labels) and `influence_kronfluence.py` with `kronfluence_digits.py`
(kronfluence's side, in PyTorch's environment), and `program_hashes.py` (hashes of the programs the
package builds, to check that a refactor changes none) are scripts.
"""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def example(name: str) -> types.ModuleType:
    """examples/<name>.py loaded as a fresh module (fresh layer functions: a cold compile)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
