"""The one tree comparison of the tests: the structure first (a missing, extra or re-nested leaf
fails, where a bare ``zip`` of the leaves would pass), then each leaf's shape, dtype where asked,
and values."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def assert_trees_close(actual: Any, expected: Any, rtol: float = 1e-9, atol: float = 1e-12,
                       dtypes: bool = False) -> None:
    structures = jax.tree.structure(actual), jax.tree.structure(expected)
    assert structures[0] == structures[1], f"tree structures differ: {structures[0]} != {structures[1]}"
    for n, (a, e) in enumerate(zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True)):
        a, e = np.asarray(a), np.asarray(e)
        assert a.shape == e.shape, f"leaf {n}: shape {a.shape} != {e.shape}"
        if dtypes:
            assert a.dtype == e.dtype, f"leaf {n}: dtype {a.dtype} != {e.dtype}"
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol, err_msg=f"leaf {n}")


def assert_bias_of(factors: Any, bias: Any, weight: str, side: str) -> None:
    """``factors[bias]`` marks the bias as joined to ``weight`` (its path) on ``side``, and its
    index and count point at that weight among the factors' leaves (read here by path)."""
    import linbackprop as lbp

    marker = factors[bias]
    assert isinstance(marker, lbp.BiasOf), marker
    assert (marker.weight, marker.side) == (weight, side), marker
    paths = jax.tree_util.tree_flatten_with_path(factors, is_leaf=lambda x: x is None or isinstance(
        x, (lbp.Kronecker, lbp.BiasOf, tuple)))[0]
    assert marker.leaves == len(paths), (marker, len(paths))
    assert jax.tree_util.keystr(paths[marker.leaf][0]) == weight, (marker, paths[marker.leaf][0])
