"""What a kind of layer stores for its linear maps: the residuals of its VJP, found abstractly
(``jax.eval_shape`` of ``jax.vjp``); those that are its own arguments verbatim are re-read from
the buffers, and cheap elementwise functions of them are recomputed (`Recipe`).
"""

from __future__ import annotations

import enum
from typing import Any

import jax
from jax.extend.core import Literal

from .._graph import Layer, call_layer, run_equations
from ._groups import Aval, leaf_aval


def avals_of(tree: Any, where: str) -> tuple[Any, tuple[Aval, ...]]:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple(leaf_aval(x, where) for x in leaves)


# Residuals computed from others by a few of these are recomputed in the back substitution
# instead of stored (tanh's 1 − t next to t, sigmoid's s(1 − s) next to s): less memory, fewer writes.
CHEAP_PRIMITIVES = frozenset({"add", "sub", "mul", "neg", "integer_pow", "square", "convert_element_type"})
MAX_RECIPE_DEPTH = 3


class Source(enum.Enum):
    """Where a residual of a layer's VJP comes from when it is rebuilt."""

    ARGUMENT = enum.auto()  # one of the layer's arguments (θ, inputs), re-read
    OUTPUT = enum.auto()  # the layer's output, re-read
    OWN = enum.auto()  # the layer's own: stored, or recomputed by a `Recipe`


class Recipe:
    """An own residual as a few elementwise equations of the layer's linearisation, whose inputs
    are stored residuals, the output or the arguments (``sources``: var -> (Source, index))."""

    def __init__(self, eqns: list, sources: dict):
        self.eqns, self.sources = eqns, sources

    def __call__(self, found: dict[Source, Any]) -> Any:
        env = {var: found[where][n] for var, (where, n) in self.sources.items()}
        run_equations(self.eqns, env)
        return env[self.eqns[-1].outvars[0]]


def _recipe(var: Any, available: dict, producers: dict, depth: int) -> tuple[list, dict] | None:
    if var in available:
        return [], {var: available[var]}
    eqn = producers.get(var)
    if eqn is None or eqn.primitive.name not in CHEAP_PRIMITIVES or depth == 0:
        return None
    eqns: list = []
    used: dict = {}
    for v in eqn.invars:
        if isinstance(v, Literal):
            continue
        sub = _recipe(v, available, producers, depth - 1)
        if sub is None:
            return None
        eqns += [e for e in sub[0] if all(e is not f for f in eqns)]
        used.update(sub[1])
    return [*eqns, eqn], used


def _recipes(jaxpr: Any, n_out: int) -> tuple[tuple[int, ...], dict[int, Recipe]]:
    """Which own residuals (the jaxpr's outputs after the n_out output leaves) to store, and
    recipes for the others."""
    own_vars = jaxpr.outvars[n_out:]
    available = {v: (Source.ARGUMENT, n) for n, v in enumerate(jaxpr.invars)}
    available.update({v: (Source.OUTPUT, n) for n, v in enumerate(jaxpr.outvars[:n_out]) if not isinstance(v, Literal)})
    producers = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
    kept, pinned, recipes = set(range(len(own_vars))), set(), {}
    for j, var in enumerate(own_vars):
        if j in pinned or isinstance(var, Literal):
            continue
        others = {w: (Source.OWN, k) for k, w in enumerate(own_vars)
                  if k in kept and k != j and not isinstance(w, Literal)}
        found = _recipe(var, {**available, **others}, producers, MAX_RECIPE_DEPTH)
        if found is not None and found[0]:
            kept.discard(j)
            recipes[j] = Recipe(*found)
            pinned |= {n for where, n in found[1].values() if where is Source.OWN}
    return tuple(sorted(kept)), recipes


def rebuilt_vjp(treedef: Any, res_sources: tuple[tuple[Source, int], ...], kept: tuple[int, ...],
                recipes: dict[int, Recipe], own: tuple[Any, ...], theta: tuple[Any, ...], inputs: tuple[Any, ...],
                out: Any) -> Any:
    """A layer's VJP (as `analyse_kind` found its structure) from its stored residuals ``own``,
    its (re-read) arguments and its output."""
    found = {Source.OWN: dict(zip(kept, own)), Source.ARGUMENT: jax.tree.leaves((theta, inputs)),
             Source.OUTPUT: jax.tree.leaves(out)}
    for n, recipe in recipes.items():
        found[Source.OWN][n] = recipe(found)
    return treedef.unflatten([found[where][n] for where, n in res_sources])


def analyse_kind(layer: Layer, theta_avals: tuple[Any, ...], input_avals: tuple[Any, ...]):
    """Abstractly linearise one layer: its output shape and the structure of its residuals."""
    found: dict[str, Any] = {}

    def probe(theta, *inputs):
        out, vjp = jax.vjp(lambda t, *u: call_layer(layer, t, u), theta, *inputs)
        leaves, treedef = jax.tree.flatten(vjp)
        known = {Source.ARGUMENT: jax.tree.leaves((theta, inputs)), Source.OUTPUT: jax.tree.leaves(out),
                 Source.OWN: []}
        sources = []
        for leaf in leaves:  # residuals that are arguments or the output are re-read, not stored
            where = next((w for w in Source if any(leaf is a for a in known[w])), None)
            if where is None:
                where = Source.OWN
                known[Source.OWN].append(leaf)
            sources.append((where, next(n for n, a in enumerate(known[where]) if leaf is a)))
        found.update(treedef=treedef, sources=tuple(sources))
        return out, tuple(known[Source.OWN])

    closed, (out_aval, own) = jax.make_jaxpr(probe, return_shape=True)(theta_avals, *input_avals)
    avals_of(out_aval, f"The output of layer {layer.name!r}")
    try:
        kept, recipes = _recipes(closed.jaxpr, len(jax.tree.leaves(out_aval)))
    except (AttributeError, TypeError, KeyError, ValueError):  # jaxpr internals changed: store them all
        kept, recipes = tuple(range(len(own))), {}
    return out_aval, found["treedef"], found["sources"], tuple(own[n] for n in kept), kept, recipes, closed
