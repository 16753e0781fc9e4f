"""grad_by_solve against central differences of the loss along random directions (float64)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from networks import REGISTRY

import linbackprop as lbp


@pytest.mark.parametrize("name", ["seed", "skips", "rnn", "lstm", "conv"])
def test_directional_derivative_matches_central_difference(name):
    case = REGISTRY[name]()
    rng = np.random.default_rng(11)
    h = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(np.shape(x))), case.params)
    grad = lbp.grad_by_solve(case.loss)(case.params, *case.inputs)
    eps = 1e-6
    shift = lambda s: jax.tree.map(lambda p, d: p + s * eps * d, case.params, h)
    directional = (case.loss(shift(1.0), *case.inputs) - case.loss(shift(-1.0), *case.inputs)) / (2 * eps)
    predicted = sum(jnp.vdot(g, d) for g, d in zip(jax.tree.leaves(grad), jax.tree.leaves(h)))
    assert abs(directional - predicted) / abs(predicted) < 1e-7
