"""What a layer computes at given shapes, as a value that compares equal only when the layer
would compute the same thing: its jaxpr and the constants it closes over.

Plans and compiled solves are cached per network and shapes, as ``jax.jit`` caches traces. A
layer function that reads a Python global, or a mutable object it closes over, computes
something else once that changes — which ``jax.grad`` of the plain call would see, and a cached
solve would not. Comparing each kind's `computation_of` with the one its plan was made
from tells a stale plan (``_plan.current_plan``) before it is used.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import jax
import numpy as np

from ._layer import Layer, call_layer


class Constant:
    """A constant of a jaxpr (a closed-over array), equal to another of the same shape, dtype and
    values: a new array with the same values computes the same thing."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Constant):
            return False
        a, b = self.value, other.value
        if a is b:
            return True
        if np.shape(a) != np.shape(b) or jax.numpy.result_type(a) != jax.numpy.result_type(b):
            return False
        try:
            return bool(np.array_equal(np.asarray(a), np.asarray(b)))
        except (TypeError, ValueError):  # not readable as numpy (a PRNG key array): only itself
            return False

    def __hash__(self) -> int:
        return hash((np.shape(self.value), str(jax.numpy.result_type(self.value))))


def computation_of(layer: Layer, theta_avals: tuple[Any, ...], input_avals: tuple[Any, ...]) -> Hashable:
    """The layer's traced computation at these avals: the text of its jaxpr (equations, literals,
    nested jaxprs; variables are named in order, so equal programs print equal) and its
    constants, compared by value."""
    closed = jax.make_jaxpr(lambda t, *u: call_layer(layer, t, u))(theta_avals, *input_avals)
    return str(closed.jaxpr), tuple(Constant(c) for c in closed.consts)


def bind_equation(eqn: Any, args: list) -> Any:
    """An equation applied to ``args``, as ``jax.core.eval_jaxpr`` applies it (bind parameters: a
    dict, or in some JAX versions (sub-functions, dict))."""
    params = eqn.primitive.get_bind_params(eqn.params)
    subfuns, params = params if isinstance(params, tuple) else ((), params)
    return eqn.primitive.bind(*subfuns, *args, **params)
