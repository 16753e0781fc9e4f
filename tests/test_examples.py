"""The seed example and the demo entry point run and report small errors."""

import subprocess
import sys
from pathlib import Path

from linbackprop._seed import main

ROOT = Path(__file__).resolve().parents[1]


def test_seed_example_reproduces_the_seed(capsys):
    result = main()
    out = capsys.readouterr().out
    assert "6×6 ℒ" in out and "14 stored blocks" in out and "8 below the diagonal" in out
    assert "6×13 ℳ*" in out
    assert result["versus_finite_difference"] < 1e-7
    assert result["versus_jax_grad"] < 1e-12
    assert result["formula_versus_grad_by_solve"] < 1e-12


def test_seed_script_and_module_entry_point_run():
    for cmd in ([sys.executable, str(ROOT / "examples" / "seed_network.py")], [sys.executable, "-m", "linbackprop"]):
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
        assert "versus_finite_difference" in done.stdout
