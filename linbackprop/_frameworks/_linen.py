"""flax linen: a module with its ``variables``; ``variables["params"]`` is what is
differentiated, the other collections are held fixed (or, inside a marked call, written as the
call writes them)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from ._functional import Adapter, Functional, Marking, named, needs_key


class Linen(Adapter):
    name, module = "flax linen", "flax.linen"

    def functional(self, model: Any, variables: Any, method: str | None, rng_streams: tuple[str, ...]) -> Functional:
        if variables is None or "params" not in variables:
            raise TypeError(f"functional({type(model).__name__}) is a linen module: pass its variables too, "
                            "functional(module, module.init(key, x)) — they must hold a 'params' collection.")
        rest = {k: v for k, v in variables.items() if k != "params"}
        kw = {} if method is None else {"method": method}

        def apply_linen(p: Any, *args: Any, key: Any = None, **kwargs: Any) -> Any:
            rngs = {} if key is None else {"rngs": {s: jax.random.fold_in(key, n) for n, s in enumerate(rng_streams)}}
            try:
                return model.apply({"params": p, **rest}, *args, **kw, **rngs, **kwargs)
            except Exception as err:
                if key is None and type(err).__name__ == "InvalidRngError":  # flax's: a stream was asked for
                    raise TypeError(f"{needs_key(model, 'deterministic=True in the call')}\n({err})") from err
                raise

        return Functional(named(apply_linen, model), variables["params"], lambda p: {"params": p, **rest})

    def layer_call(self, original: Callable, module: Any, args: tuple, kwargs: dict, marking: Marking) -> Any:
        """A bound linen module's call, opaque: the mutable collections it writes
        (``batch_stats`` under ``mutable=["batch_stats"]``, sown intermediates) come out of the
        call and are written into the scope's variables in place, as the call would have written
        them. An unbound module's call is the call alone."""
        scope = module.scope
        if scope is None:
            return super().layer_call(original, module, args, kwargs, marking)

        def call() -> Any:
            out = original(module, *args, **kwargs)
            return out, dict(scope.mutable_variables())

        out, after = marking.opaque(call, (), type(module).__name__)
        _assign(scope.mutable_variables(), after)
        return out


def _assign(target: dict, values: dict) -> None:
    """``values`` written into the nested dicts of ``target`` in place (the scopes of the
    submodules hold references to them)."""
    for k, v in values.items():
        if isinstance(v, dict) and isinstance(target.get(k), dict):
            _assign(target[k], v)
        else:
            target[k] = v
