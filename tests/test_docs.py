"""Every public name has a docstring with an example, and the examples run (doctest)."""

import doctest
import importlib
import inspect

import jax
import pytest

import linbackprop as lbp

MODULES = ["_curvature", "_graph", "_interop", "_operators", "_pictures", "_transforms"]


@pytest.mark.parametrize("name", lbp.__all__)
def test_public_names_have_docstrings_with_examples(name):
    doc = inspect.getdoc(getattr(lbp, name)) or ""
    assert len(doc) > 80 and ">>>" in doc, f"lbp.{name} needs a docstring with a runnable example"


@pytest.mark.parametrize("module", MODULES)
def test_docstring_examples_run(module):
    with jax.enable_x64(False):
        mod = importlib.import_module(f"linbackprop.{module}")
        result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


def test_readme_python_blocks_run():
    """The quick start and the other Python snippets of README.md run as written."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    assert len(blocks) >= 2
    namespace: dict = {}
    with jax.enable_x64(False):
        for block in blocks:
            exec(compile(block, "README.md", "exec"), namespace)
