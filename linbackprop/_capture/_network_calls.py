"""The Network calls of a function, found in its jaxpr as ``layers=`` finds layer calls (`_marks`):
``fun`` is traced once with each ``Network`` call made one opaque equation (a ``jax.jit`` named
``linbackprop_network<k>``), and evaluated again with each such equation handed to a handler —
the curvature transforms' split of ``fun`` into its network calls and the rest (the loss).

A user's ``jax.jit`` around a call is seen through (its equations evaluated in place). A call
inside another transformation within ``fun`` — ``jax.vmap`` (the call's operands then carry a
batch axis the call was not made with), ``jax.checkpoint``, ``lax.scan``, ``lax.cond``, a custom
derivative — is refused by name: the handler would be given that transformation's values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax

from .._graph import evaluate
from .._options import calls_handled, plain
from ._marks import marked_index, marks_in

NETWORK_MARK = "linbackprop_network"

Handler = Callable[[Any, Any, tuple], Any]
"""``handler(net, params, inputs)``: what a network call returns instead (`calls_handled`'s)."""


@dataclasses.dataclass(frozen=True)
class _Call:
    """One network call as traced: the network, its operands' structure and avals, its result's."""

    net: Any
    operands: Any  # the treedef of (params, inputs)
    avals: tuple
    result: Any  # the treedef of its outputs


def _index(eqn: Any) -> int | None:
    return marked_index(eqn, NETWORK_MARK)


def _marks_in(jaxpr: Any) -> list[int]:
    return marks_in(jaxpr, NETWORK_MARK)


class NetworkCalls:
    """``fun`` at ``args`` (traced once) with its network calls found: ``run(handler, leaves)``
    evaluates it at the flat ``leaves`` of the arguments it was traced at, each call's result
    ``handler(net, params, inputs)``, and returns ``fun``'s result (its pytree; leaves that are
    no traced values — a Python number or string in an aux — as ``fun`` returned them)."""

    def __init__(self, fun: Callable, args: Sequence[Any]):
        calls: list[_Call] = []

        def mark(net: Any, params: Any, inputs: tuple) -> Any:
            k = len(calls)
            flat, operands = jax.tree.flatten((params, inputs))
            result = []

            def traced(*leaves: Any) -> list:
                p, xs = jax.tree.unflatten(operands, leaves)
                with plain():  # only its outputs' avals are used: the handler computes them
                    out, tree = jax.tree.flatten(net(p, *xs))
                result.append(tree)
                return out

            traced.__name__ = traced.__qualname__ = f"{NETWORK_MARK}{k}"
            out = jax.jit(traced)(*flat)  # no call inside marks: the network runs with no handler
            calls.append(_Call(net, operands, tuple(jax.typeof(x) for x in flat), result[0]))
            return jax.tree.unflatten(result[0], out)

        static: list = []  # fun's result: its tree, and each leaf that is no traced value (kept as it is)

        def traced_fun(*a: Any) -> list:
            leaves, tree = jax.tree.flatten(fun(*a))
            static[:] = [tree, [None if isinstance(x, (jax.Array, jax.core.Tracer)) else x for x in leaves]]
            return [x for x in leaves if isinstance(x, (jax.Array, jax.core.Tracer))]

        with calls_handled(mark):
            closed = jax.make_jaxpr(traced_fun)(*args)
        self.jaxpr, self.consts, self.calls = closed.jaxpr, closed.consts, calls
        self.result, self.kept = static
        self.inlined = _checked(self.jaxpr, calls)  # the user's jits around calls, by id

    def run(self, handler: Handler, leaves: Sequence[Any]) -> Any:
        calls, inlined = self.calls, self.inlined

        def rule(eqn: Any, ins: list) -> list | None:
            k = _index(eqn)
            if k is not None:
                call = calls[k]
                params, inputs = jax.tree.unflatten(call.operands, ins)
                out, tree = jax.tree.flatten(handler(call.net, params, tuple(inputs)))
                if tree != call.result:
                    raise ValueError(f"Network call {k} of fun returned {tree} where it was traced returning "
                                     f"{call.result}.")
                return out
            if id(eqn) in inlined:
                inner = eqn.params["jaxpr"]  # a jax.jit of the user's around calls: evaluated in place
                return evaluate(inner.jaxpr, inner.consts, ins, rule=rule)
            return None

        out = iter(evaluate(self.jaxpr, self.consts, list(leaves), rule=rule))
        return jax.tree.unflatten(self.result, [next(out) if x is None else x for x in self.kept])


def _check_operands(eqn: Any, call: _Call, k: int) -> None:
    """A call whose operands' shapes are not those it was made with ran under ``jax.vmap``."""
    found = tuple((tuple(v.aval.shape), v.aval.dtype) for v in eqn.invars)
    made = tuple((tuple(a.shape), a.dtype) for a in call.avals)
    if found != made:
        raise ValueError(_nested(k, call, "jax.vmap (its operands carry a batch axis the call was not made with)"))


def _checked(jaxpr: Any, calls: list[_Call]) -> set[int]:
    """Every network call must be evaluated where it is: in ``fun``'s own equations or a
    ``jax.jit`` of the user's among them (whose ids are returned: evaluated in place); one inside
    another transformation is refused, and so is one whose operands are not those it was made
    with (it ran under ``jax.vmap``)."""
    inlined = set()
    for eqn in jaxpr.eqns:
        k = _index(eqn)
        if k is not None:
            _check_operands(eqn, calls[k], k)
            continue
        inner = [k for sub in jax.extend.core.jaxprs_in_params(eqn.params) for k in _marks_in(sub)]
        if not inner:
            continue
        if eqn.primitive.name not in ("pjit", "jit"):
            raise ValueError(_nested(inner[0], calls[inner[0]], f"`{eqn.primitive.name}`"))
        inlined.add(id(eqn))
        inlined |= _checked(eqn.params["jaxpr"].jaxpr, calls)
    return inlined


def _nested(k: int, call: _Call, where: str) -> str:
    return (f"Network call {k} of fun (outputs {list(call.net.outputs)!r}) is made inside {where} within fun: the "
            "curvature transforms split fun at its network calls, which must run in fun itself or in a jax.jit "
            "of it. Call the network outside that transformation (transform the result instead: "
            "jax.vmap(lbp.diag_ggn(loss)), say), or name the model's layers with layers= (which sees through "
            "lax.scan too).")
