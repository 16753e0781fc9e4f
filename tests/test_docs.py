"""Every public name has a docstring with an example, and the examples run (doctest)."""

import doctest
import importlib
import inspect

import jax
import pytest

import linbackprop as lbp

MODULES = ["_network", "_operators", "_plot", "_transforms"]


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
