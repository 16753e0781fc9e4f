"""The transforms at the compiler settings users run: the tests marked ``users_settings`` (each
transform against its independent reference) in a process of their own compiled at XLA's
defaults (``--xla-defaults``), where the rest of the suite compiles with LLVM's optimisations off
for speed (tests/conftest.py)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_transforms_at_xla_default_settings():
    env = {key: value for key, value in os.environ.items() if key not in ("XLA_FLAGS", "PYTEST_XDIST_WORKER")}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                             "-m", "users_settings", "--xla-defaults", "tests"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    passed = re.search(r"(\d+) passed", result.stdout)
    assert passed and int(passed.group(1)) >= 20, result.stdout[-2000:]  # each transform's tests ran
