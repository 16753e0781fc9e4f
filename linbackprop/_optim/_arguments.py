"""What the optimizers share: which extra arguments of ``update`` go on to ``value_fn``, and the
parameters' floating dtype."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

# the arguments the transforms consume themselves; the rest go on to value_fn where it takes them
OWN = frozenset({"curvature", "factors", "diagonal", "value", "value_fn", "grad", "rows"})


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
