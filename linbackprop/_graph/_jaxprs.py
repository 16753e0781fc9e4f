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
from jax.sharding import AbstractMesh, NamedSharding

from ._buffers import explicit_sharding
from ._layer import Layer, call_layer


def random_values() -> Callable[[Any], Any]:
    """Random values for avals, the same on every call: PRNG keys (a dropout mask must not mix
    examples either), 0/1 for integers and booleans, normal draws for the rest. What the checks
    that run a function at trace time, on values JAX has not given yet, evaluate it at."""
    rng = np.random.default_rng(0)

    def sample(aval: Any) -> Any:
        if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.prng_key):
            keys = jax.random.split(jax.random.key(0, impl=jax.random.key_impl(jax.random.key(0))), max(1, aval.size))
            return keys[: aval.size].reshape(aval.shape)
        if not jnp.issubdtype(aval.dtype, jnp.inexact):  # integers, booleans
            return jnp.asarray(rng.integers(0, 2, aval.shape), aval.dtype)
        return jnp.asarray(rng.standard_normal(aval.shape), aval.dtype)

    return sample


def at_random(fn: Callable, *args: Any) -> tuple[Callable, list[Any], Any]:
    """``fn`` as a function of its flat arguments' leaves, run op by op (`_Evaluate`), with values drawn at
    random (`random_values`) for whatever it closes over that is a tracer (labels or parameters
    under ``jax.jit``: only their shapes are known at trace time): ``(evaluate, values, shape)``,
    ``evaluate(*leaves)`` the flat list of its outputs' leaves, ``values`` random leaves for its
    arguments and ``shape`` its output's structure. ``fn`` is traced once, at ``args``' avals."""
    draw = random_values()
    closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    meshes = {c.sharding.mesh.axis_names: c.sharding.mesh for c in closed.consts
              if not isinstance(c, jax.core.Tracer) and isinstance(getattr(c, "sharding", None), NamedSharding)}
    placed = lambda aval: _placed_as(draw(aval), aval, meshes)
    with jax.ensure_compile_time_eval():
        consts = [placed(c.aval) if isinstance(c, jax.core.Tracer) else c for c in closed.consts]
        values = [placed(v.aval) for v in closed.jaxpr.invars]
    return _Evaluate(closed.jaxpr, consts), values, shape


class _Evaluate:
    """A jaxpr evaluated op by op at its constants: ``evaluate(*leaves)``. ``evaluate.run(fn,
    *args)`` is ``fn(evaluate, *args)`` — where the constants span several processes' devices (a
    mesh over processes), one compiled program with the constants as its arguments: JAX refuses
    to embed such arrays, which differentiating the op-by-op evaluation does; every process runs
    the program in step, as it runs the trace that called it."""

    def __init__(self, jaxpr: Any, consts: list):
        self.jaxpr, self.consts = jaxpr, consts

    def __call__(self, *leaves: Any) -> list:
        return jax.core.eval_jaxpr(self.jaxpr, self.consts, *leaves)

    def run(self, fn: Callable, *args: Any) -> Any:
        if all(_addressable(x) for x in (*self.consts, *jax.tree.leaves(args))):
            return fn(self, *args)
        # traced without the caller's compile-time evaluation (which would fold what the program
        # builds from constants into arrays over the mesh, embedded again), then run at once
        with _staging():
            program = jax.jit(lambda consts, *a: fn(_Evaluate(self.jaxpr, consts), *a))
            compiled = program.lower(self.consts, *args).compile()
        return compiled(self.consts, *args)


def _staging() -> Any:
    """A context in which JAX stages operations on constants instead of evaluating them (inside
    ``jax.ensure_compile_time_eval``); JAX's own switch is private: without it, no change."""
    try:
        from jax._src.config import eager_constant_folding
    except ImportError:  # pragma: no cover - another JAX layout
        return contextlib.nullcontext()
    return eager_constant_folding(False)


def _addressable(x: Any) -> bool:
    return getattr(x, "is_fully_addressable", True)


def on_host(x: Any) -> np.ndarray:
    """``x``'s values as a NumPy array on this process: an array over several processes'
    devices gathered from all of them (a collective: every process calls it in step)."""
    if _addressable(x):
        return np.asarray(x)
    from jax.experimental import multihost_utils  # the multi-process case alone needs it

    with jax.ensure_compile_time_eval():
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _placed_as(value: Any, aval: Any, meshes: dict) -> Any:
    """A drawn value sharded as ``aval``'s type says where that is an explicit sharding (a batch
    sharded over a mesh with Explicit axes: the jaxpr's operations check their operands'
    shardings agree), on the mesh of an array it closes over, else ``jax.make_mesh``'s."""
    sharding = explicit_sharding(aval)
    if sharding is None:  # replicated on such a mesh counts too: its values must live on the mesh's devices
        return value
    abstract = sharding.mesh if isinstance(sharding.mesh, AbstractMesh) else sharding.mesh.abstract_mesh
    mesh = meshes.get(abstract.axis_names)
    if mesh is None:  # under jax.jit only the abstract mesh is known: jax.make_mesh's devices for it
        mesh = jax.make_mesh(abstract.axis_sizes, abstract.axis_names, axis_types=abstract.axis_types)
    return jax.device_put(value, NamedSharding(mesh, sharding.spec))


def agree_at_random(expected: Any, found: Any, low_precision_tol: float = 1e-3) -> bool:
    """Whether two values of an `at_random` evaluation are equal up to round-off of their dtype
    (relative to the larger entries of ``expected``; ``low_precision_tol`` below 64 bits and for
    integers, 1e-8 in float64), NaN where NaN; as numpy, so no tracer is left under a jit."""
    if np.shape(expected) != np.shape(found):
        return False
    a, b = np.asarray(expected, np.float64), np.asarray(found, np.float64)
    dtype = jax.numpy.result_type(expected)
    precise = jax.numpy.issubdtype(dtype, jax.numpy.inexact) and jax.numpy.finfo(dtype).bits >= 64
    tol = 1e-8 if precise else low_precision_tol
    return bool(np.allclose(a, b, rtol=tol, atol=tol * (1.0 + float(np.nanmax(np.abs(a), initial=0.0))),
                            equal_nan=True))


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
