"""equinox: an ``eqx.Module``'s inexact (floating) arrays are what is differentiated
(``eqx.partition(model, eqx.is_inexact_array)``); the rest is held fixed."""

from __future__ import annotations

import sys
from typing import Any

import jax

from ._functional import Adapter, ArgumentSplit, Functional, method_of, named, no_variables


class Equinox(Adapter):
    name, module = "equinox", "equinox"

    def functional(self, model: Any, variables: Any, method: str | None, rng_streams: tuple[str, ...]) -> Functional:
        eqx = sys.modules["equinox"]
        no_variables(model, variables)
        params, static = eqx.partition(model, eqx.is_inexact_array)

        def apply_equinox(p: Any, *args: Any, **kwargs: Any) -> Any:
            return method_of(eqx.combine(p, static), method)(*args, **kwargs)

        return Functional(named(apply_equinox, model), params, lambda p: eqx.combine(p, static))

    def split(self, arg: Any) -> ArgumentSplit:
        eqx = sys.modules["equinox"]
        diff, static = eqx.partition(arg, eqx.is_inexact_array)
        paths, treedef = jax.tree_util.tree_flatten_with_path(diff)
        return ArgumentSplit(paths, treedef, lambda d, r: eqx.combine(jax.tree.unflatten(treedef, d), static),
                             leaves_of=lambda t: jax.tree.leaves(eqx.filter(t, eqx.is_inexact_array)))
