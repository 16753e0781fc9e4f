"""What the optimizers share: which extra arguments of ``update`` go on to ``value_fn``, the
parameters' floating dtype, and a state's parameter-shaped tree read in the gradient's
structure."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

# the arguments the transforms consume themselves; the rest go on to value_fn where it takes them
OWN = frozenset({"curvature", "factors", "diagonal", "value", "value_fn", "grad", "rows", "residuals", "terms"})


def accepted(fn: Callable, extra: dict[str, Any]) -> dict[str, Any]:
    """The extra arguments ``fn`` takes by name (all of them where it has ``**kwargs``)."""
    rest = {k: v for k, v in extra.items() if k not in OWN}
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return rest
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return rest
    names = {p.name for p in parameters}
    return {k: v for k, v in rest.items() if k in names}


def params_dtype(params: Any) -> Any:
    leaves = jax.tree.leaves(params)
    return jnp.result_type(*leaves) if leaves else jnp.float32


def shaped_as(tree: Any, like: Any) -> Any:
    """``tree``'s leaves in ``like``'s structure. A parameter-shaped tree the state made at
    ``init`` may hold wrappers the gradient does not: ``nnx.Optimizer`` calls ``init`` with
    ``nnx.Param`` Variables and ``update`` with pure arrays; the leaves are the same, in order."""
    structure = jax.tree.structure(like)
    if jax.tree.structure(tree) == structure:
        return tree
    return jax.tree.unflatten(structure, jax.tree.leaves(tree))
