"""Jaxprs: what a layer computes at given shapes, and the one evaluator of jaxprs the package uses.

`computation_of` is a value that compares equal only when the layer would compute the same
thing: its jaxpr and the constants it closes over.

Plans and compiled solves are cached per network and shapes, as ``jax.jit`` caches traces. A
layer function that reads a Python global, or a mutable object it closes over, computes
something else once that changes — which ``jax.grad`` of the plain call would see, and a cached
solve would not. Comparing each kind's `computation_of` with the one its plan was made
from tells a stale plan (``_plan.current_plan``) before it is used.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal

from ._layer import Layer, call_layer


def random_values() -> Callable[[Any], Any]:
    """Random values for avals, the same on every call: PRNG keys, small integers and booleans,
    normal draws for the rest. What the layers' one-example alarm (`_curvature._separation`)
    runs them at — an extra alarm; what examples a program reads is proved by `example_flow`."""
    rng = np.random.default_rng(0)

    def sample(aval: Any) -> Any:
        if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.prng_key):
            keys = jax.random.split(jax.random.key(0, impl=jax.random.key_impl(jax.random.key(0))), max(1, aval.size))
            return keys[: aval.size].reshape(aval.shape)
        if not jnp.issubdtype(aval.dtype, jnp.inexact):  # integers, booleans
            return jnp.asarray(rng.integers(0, 2, aval.shape), aval.dtype)
        return jnp.asarray(rng.standard_normal(aval.shape), aval.dtype)

    return sample


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
    with _user_line(eqn):  # the equation keeps the user's line (what error messages name), as in eval_jaxpr
        return eqn.primitive.bind(*subfuns, *args, **params)


def _user_line(eqn: Any) -> Any:
    """A context in which new equations carry ``eqn``'s traceback (the user's line) — JAX's own
    switch (``source_info_util.user_context``, which ``jax.core.eval_jaxpr`` uses) is private:
    without it, no change."""
    try:
        from jax._src.source_info_util import user_context
    except ImportError:  # pragma: no cover - another JAX layout
        return contextlib.nullcontext()
    return user_context(eqn.source_info.traceback)


Rule = Callable[[Any, list], "list | None"]
"""``rule(eqn, ins)``: an equation's outputs computed another way, or None: the equation as it is."""


def read(env: dict, v: Any) -> Any:
    """A variable's value in ``env``, or a literal's own."""
    return v.val if isinstance(v, Literal) else env[v]


def run_equations(eqns: Iterable[Any], env: dict, rule: Rule | None = None) -> None:
    """Equations run in order in ``env`` (variable -> value), as ``jax.core.eval_jaxpr`` runs them,
    each through ``rule`` first where one is given (the package's only jaxpr evaluator: the
    capture's programs, the outer products found in a VJP, the contractions moved last)."""
    for eqn in eqns:
        ins = [read(env, v) for v in eqn.invars]
        outs = rule(eqn, ins) if rule is not None else None
        if outs is None:
            outs = bind_equation(eqn, ins)
            outs = outs if eqn.primitive.multiple_results else [outs]
        env.update(zip(eqn.outvars, outs))


def dependents(eqns: Iterable[Any], sources: Iterable[Any], also: Callable[[Any], bool] = lambda e: False) -> set:
    """The variables that depend on ``sources`` (and the outputs of the equations ``also`` names),
    an equation counted as depending on all its operands (conservative): the package's one
    forward walk over a jaxpr's dependencies."""
    moving = set(sources)
    for eqn in eqns:
        if also(eqn) or any(not isinstance(v, Literal) and v in moving for v in eqn.invars):
            moving.update(eqn.outvars)
    return moving


def needed_equations(eqns: Sequence[Any], wanted: Iterable[Any], keep: Callable[[Any], bool] = lambda e: False
                     ) -> list:
    """The equations the ``wanted`` variables depend on (and those ``keep`` keeps, with what they
    depend on), in order: the package's one backward walk over a jaxpr's dependencies."""
    needed, kept = {v for v in wanted if not isinstance(v, Literal)}, []
    for eqn in reversed(eqns):
        if keep(eqn) or any(v in needed for v in eqn.outvars):
            kept.append(eqn)
            needed.update(v for v in eqn.invars if not isinstance(v, Literal))
    return kept[::-1]


def evaluate(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], wanted: Sequence[Any] | None = None,
             rule: Rule | None = None) -> list:
    """The outputs of ``jaxpr`` at ``args`` (or the values of the ``wanted`` variables, running only
    the equations they need), each equation through ``rule`` where one is given."""
    eqns = jaxpr.eqns if wanted is None else needed_equations(jaxpr.eqns, wanted)
    env = dict(zip(jaxpr.constvars, consts)) | dict(zip(jaxpr.invars, args))
    run_equations(eqns, env, rule)
    return [read(env, v) for v in (jaxpr.outvars if wanted is None else wanted)]
