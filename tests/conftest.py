"""The suite's two tiers and its shared settings.

- The default tier (``python -m pytest``, README's test command): every behaviour's checks, the
  property-based tests at the ``dev`` profile's example counts.
- The slow tier (``python -m pytest --slow``, both tiers): adds the tests marked ``slow`` —
  the examples end to end, multi-process and multi-device runs, the docs build, the guides'
  code and the docstrings' examples — the rest of each cross product (below), and runs the
  property-based tests at the ``ci`` profile's counts.

Cross products: a test parametrised by three or more ``parametrize`` marks runs in the default
tier on a pairwise covering subset of its combinations — every pair of values of any two marks in
at least one, chosen in collection order — and on all of them with --slow. A test with one or two
marks (a hand-written list of cases, or engines × networks) runs every case in both tiers, and so
does a test named on the command line (``file.py::test``). The run's header says how many
combinations the default tier leaves to --slow.

Hypothesis profiles: ``dev`` (the default tier: fixed counts, derandomised — the same examples
every run) and ``ci`` (--slow: four times the examples, drawn afresh each run; a failure prints
the blob that reproduces it, ``@reproduce_failure``). Both have a deadline per example that catches
a hang but not a compilation (a JAX trace and compile takes seconds; a re-run hits the cache, so a
tight deadline would report every compile as flaky). ``HYPOTHESIS_PROFILE`` chooses another.

XLA: the tests compile with LLVM's optimisations off (``--xla_backend_optimization_level=0``; on
jaxlib 0.10 XLA:CPU's fusion emitters off too): the suite is compile-bound (XLA's compiles were
≈ 60 % of a profiled test's time) and checks numbers, not speed; the same tests took 0.75× the
time, and a test's compiles 4.3 s instead of 9.2 s without the fusion emitters. ``--xla-defaults``
compiles at XLA's defaults, the settings users run: the tests marked ``users_settings`` (each
transform against its reference) run so in the slow tier (`tests/test_users_settings.py`, a
process of their own) and in CI on the newest JAX. Speed is measured in ``benchmarks/``, at the
default level.

JAX's persistent compilation cache holds the run's compiled programs under
``build/jax-cache-py<X.Y>-jax<version>`` (one per Python and JAX version, never shared between
them): programs the two workers both compile are compiled once. Measured on a fresh clone
(three test files, 2 workers): 68.8 s against 73.6 s without; a second run reuses it.
"""

import os
import sys
from datetime import timedelta
from importlib.metadata import version
from pathlib import Path

import jax
import pytest
from hypothesis import HealthCheck, settings

# The XLA flags of the tests (`pytest_configure` sets them unless --xla-defaults): LLVM's
# optimisations off; on jaxlib 0.10 also XLA:CPU's fusion emitters (its older loop emitters compile
# the same program in half the time). Later jaxlibs have no such flag, and XLA aborts on a flag it
# does not know.
_FAST_COMPILE = ["--xla_backend_optimization_level=0",
                 *(["--xla_cpu_use_fusion_emitters=false"]
                   if tuple(int(part) for part in version("jaxlib").split(".")[:2]) < (0, 11) else [])]

jax.config.update("jax_enable_x64", True)
_PYTHON = f"{sys.version_info[0]}.{sys.version_info[1]}"
_CACHE = Path(__file__).resolve().parents[1] / "build" / f"jax-cache-py{_PYTHON}-jax{jax.__version__}"
if not os.environ.get("_NOCACHE"):
    jax.config.update("jax_compilation_cache_dir", str(_CACHE))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # the small programs are most of the compiles
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

settings.register_profile("dev", max_examples=3, derandomize=True, deadline=timedelta(minutes=5),
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("ci", parent=settings.get_profile("dev"), max_examples=12, derandomize=False,
                          print_blob=True, database=None)


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", default=False,
                     help="also run the slow tier (tests marked slow) and the long property-based runs")
    parser.addoption("--xla-defaults", action="store_true", default=False,
                     help="compile at XLA's default settings (as users run) instead of LLVM's level 0")


def pytest_configure(config):
    """The tier's hypothesis profile and the XLA flags; JAX's backend starts after this (at the
    first array a test module makes), so the flags reach every compile, and subprocesses inherit
    them."""
    slow = config.getoption("--slow")
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if slow else "dev"))
    flags = os.environ.get("XLA_FLAGS", "")
    if not config.getoption("--xla-defaults") and "xla_backend_optimization_level" not in flags:
        os.environ["XLA_FLAGS"] = " ".join([flags, *_FAST_COMPILE]).strip()
    config.xla_flags = os.environ.get("XLA_FLAGS") or "XLA's defaults"


def _marks(item) -> list:
    """The test's ``parametrize`` marks, each as the names it sets."""
    return [tuple(m.args[0].split(",") if isinstance(m.args[0], str) else m.args[0])
            for m in item.iter_markers("parametrize")]


def _beyond_covering(items, named: set) -> set:
    """The combinations of each cross product of three or more ``parametrize`` marks that a
    pairwise covering subset leaves out: walking them in order, one is kept when it has a pair of
    values of two marks that no kept one has. Tests ``named`` on the command line keep all."""
    families: dict = {}
    for item in items:
        marks = _marks(item)
        if len(marks) >= 3 and item.originalname not in named:
            families.setdefault((item.path, item.originalname), []).append(item)
    left_out = set()
    for members in families.values():
        seen: set = set()
        for item in members:
            params = item.callspec.params
            values = [tuple((name.strip(), repr(params[name.strip()])) for name in mark) for mark in _marks(item)]
            pairs = {(a, b) for i, a in enumerate(values) for b in values[i + 1:]}
            if pairs - seen:
                seen |= pairs
            else:
                left_out.add(item)
    return left_out


def pytest_collection_modifyitems(config, items):
    """Without --slow, the tests marked slow and the combinations beyond each cross product's
    covering subset are deselected (not skipped: they are the other tier)."""
    if config.getoption("--slow"):
        return
    named = {arg.split("::")[1].split("[")[0] for arg in config.args if "::" in arg}
    beyond = _beyond_covering(items, named)
    config.left_to_slow = len(beyond)
    slow = [item for item in items if item.get_closest_marker("slow") or item in beyond]
    if slow:
        config.hook.pytest_deselected(items=slow)
        kept = set(slow)
        items[:] = [item for item in items if item not in kept]


def pytest_report_header(config):
    tier = "default and slow tiers" if config.getoption("--slow") else "default tier (--slow adds the slow tier)"
    return f"linbackprop: {tier}; hypothesis profile {settings._current_profile}; XLA_FLAGS: {config.xla_flags}"


def pytest_terminal_summary(terminalreporter, config):
    left = getattr(config, "left_to_slow", 0)
    if left:
        terminalreporter.write_line(f"linbackprop: {left} combinations of cross products beyond their pairwise "
                                    "covering subsets are left to --slow")


@pytest.fixture(scope="module")
def always_checkpoint():
    """``checkpoints=k`` as asked, even where the memory rule would run the call without (the
    small networks of tests of the segments themselves keep no less by checkpointing)."""
    from linbackprop._options._policy import Policy
    from linbackprop._options._settings import Settings, using

    with using(Settings(policy=Policy(checkpoint_saving=float("inf"), checkpoint_bound=float("inf")))):
        yield
