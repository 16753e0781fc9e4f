"""``fun`` split into its Network calls (the model) and the rest (the loss ℓ of their outputs and
of the arguments directly), and the curvature transforms of a model as it is (``layers=``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from .._capture import NetworkCalls, rewrite


def normalise_argnums(argnums: int | Sequence[int]) -> tuple[tuple[int, ...], bool]:
    if isinstance(argnums, int):
        return (argnums,), True
    return tuple(argnums), False


class Split:
    """``fun`` at ``args`` as model and loss: ``model(*diff)`` the tuple of its network calls'
    outputs (in call order), ``loss(outs, *diff)`` its value (and aux) with each call's output
    replaced by ``outs[k]``; ``diff`` the arguments named by ``argnums``."""

    def __init__(self, fun: Callable, args: tuple, argnums: tuple[int, ...], has_aux: bool):
        self.fun, self.args, self.argnums, self.has_aux = fun, args, argnums, has_aux
        self.diff = tuple(args[i] for i in argnums)
        self._calls: NetworkCalls | None = None

    def args_with(self, diff: tuple) -> list:
        full = list(self.args)
        for i, d in zip(self.argnums, diff):
            full[i] = d
        return full

    def run(self, handler: Callable, diff: tuple) -> Any:
        """``fun`` at ``diff`` with each network call given to ``handler`` (``handler(net, params,
        inputs)`` its result): ``fun``'s jaxpr with its network calls found as ``layers=`` finds
        layers (`_capture.NetworkCalls`, traced once), evaluated."""
        if self._calls is None:
            self._calls = NetworkCalls(lambda *d: self.fun(*self.args_with(d)), self.diff)
        return self._calls.run(handler, jax.tree.leaves(diff))

    def model(self, *diff: Any) -> tuple:
        recorded = []

        def record(net, params, inputs):
            out = net(params, *inputs)
            recorded.append(out)
            return out

        self.run(record, diff)
        return tuple(recorded)

    def loss(self, outs: tuple, *diff: Any) -> tuple[Any, Any]:
        replay = iter(outs)
        result = self.run(lambda net, params, inputs: next(replay), diff)
        return result if self.has_aux else (result, None)


def add_trees(a: Any, b: Any) -> Any:
    return jax.tree.map(lambda x, y: x + y.astype(x.dtype), a, b)


class OnArguments:
    """J and J* of a captured model on its arguments' own types (nnx.State, an equinox module, a
    pytree) instead of the flat leaves the network's blocks are."""

    def __init__(self, arguments: tuple):
        self.arguments = arguments

    def jvp(self, jvp: Callable, *vs: Any) -> Any:
        return jvp(*[list(a.leaves_of(v)) for a, v in zip(self.arguments, vs)])

    def vjp(self, vjp: Callable, cotangent: Any) -> tuple:
        return tuple(a.gradient(list(g)) for a, g in zip(self.arguments, vjp(cotangent)))


def flat_result(rewritten: Callable) -> Callable:
    """A captured model's result alone (``rewritten(*parts)[0]``), keeping the function that
    computes it on one example's data (``__linbackprop_one_example__``, `_capture.rewrite`): the
    program traced at the batch keeps the batch in its shapes."""
    flat = lambda *parts: rewritten(*parts)[0]
    one = getattr(rewritten, "__linbackprop_one_example__", None)
    if one is not None:
        flat.__linbackprop_one_example__ = lambda *parts: one(*parts)[0]
    return flat


def on_model(transform: Callable, fun: Callable, argnums: int | Sequence[int], layers: Any,
              to_arguments: bool = True, with_extra: bool = False, name: str = "the per-example transforms"
              ) -> Callable:
    """``transform`` (a per-example or curvature transform taking ``(fun, argnums)``) of a model
    as it is: its network found with ``layers=`` (``_capture.rewrite``), the result given back in
    the arguments' own types (``to_arguments``: params-shaped results; ``with_extra``: a pair
    whose first entry is params-shaped, the second passed through; ``name``: the transform, as
    its errors say)."""
    nums, single = normalise_argnums(argnums)

    def run(*args: Any) -> Any:
        found = rewrite(fun, args, nums, layers, per_example=name)
        result = transform(flat_result(found.fun), tuple(range(len(nums))))(*found.args)
        if with_extra:
            return found.gradient(result[0], single), result[1]
        return found.gradient(result, single) if to_arguments else result

    return run
