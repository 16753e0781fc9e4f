"""flax nnx: an ``nnx.Module``'s ``nnx.Param`` state is what is differentiated
(``nnx.split(model, nnx.Param, ...)``); its other state (RNG keys and counts, batch statistics)
goes into a call and the leaves the call changes come out, as nnx writes them."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend.core import Literal

from ._functional import Adapter, ArgumentSplit, Functional, Marking, method_of, named, needs_key, no_variables


class Nnx(Adapter):
    name, module = "flax nnx", "flax.nnx"

    def functional(self, model: Any, variables: Any, method: str | None, rng_streams: tuple[str, ...]) -> Functional:
        nnx = sys.modules["flax.nnx"]
        no_variables(model, variables)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def apply_nnx(p: Any, *args: Any, key: Any = None, **kwargs: Any) -> Any:
            # fresh Variables for the fixed state: a call may mutate them (an RNG count), and
            # nnx forbids mutating, inside a trace, Variables made outside it
            fixed = jax.tree.map(lambda x: x, rest)
            module = nnx.merge(graphdef, p, fixed)
            if key is not None:
                tags = sorted({stream.key.tag for _, stream in nnx.iter_graph(module)
                               if isinstance(stream, nnx.RngStream)})
                nnx.reseed(module, policy="match_shape",
                           **{tag: jax.random.fold_in(key, n) for n, tag in enumerate(tags)})
            counts = lambda: jax.tree.leaves(nnx.state(module, nnx.RngCount))
            before = counts()
            out = method_of(module, method)(*args, **kwargs)
            if key is None and any(a is not b for a, b in zip(before, counts())):  # a stream advanced
                raise TypeError(needs_key(model, "model.eval() before functional()"))
            return out

        return Functional(named(apply_nnx, model), params, lambda p: nnx.merge(graphdef, p, rest))

    def split(self, arg: Any) -> ArgumentSplit:
        nnx = sys.modules["flax.nnx"]
        graphdef, params, rest = nnx.split(arg, nnx.Param, ...)
        paths, treedef = jax.tree_util.tree_flatten_with_path(params)
        rest_paths, rest_def = jax.tree_util.tree_flatten_with_path(rest)

        def rebuild(d: list, r: list) -> Any:
            return nnx.merge(graphdef, jax.tree.unflatten(treedef, d), jax.tree.unflatten(rest_def, r))

        def state_out(module: Any) -> list:
            return jax.tree.leaves(nnx.split(module, nnx.Param, ...)[2])

        def write_back(r: list) -> None:
            nnx.update(arg, jax.tree.unflatten(rest_def, r))

        def leaves_of(t: Any) -> list:
            return jax.tree.leaves(nnx.split(t, nnx.Param, ...)[1] if isinstance(t, nnx.Module) else t)

        return ArgumentSplit(paths, treedef, rebuild, rest_paths, state_out, write_back, leaves_of)

    def layer_call(self, original: Callable, module: Any, args: tuple, kwargs: dict, marking: Marking) -> Any:
        """An nnx module's call, opaque: its parameters go in as operands, and of the rest of its
        state (RNG keys and counts, batch statistics) the leaves the call reads; the leaves it
        changes (an RNG count advanced by dropout) come out and are written back, as nnx does. A
        leaf neither read nor changed (a dropout's stream in eval mode) is no operand: the layer
        does not read it."""
        nnx = sys.modules["flax.nnx"]
        graphdef, params, rest = nnx.split(module, nnx.Param, ...)
        leaves, treedef = jax.tree.flatten(rest)

        def call(params: Any, chosen: Sequence[int], values: Sequence[Any], changed: Sequence[int] | None) -> Any:
            full = list(leaves)
            for i, v in zip(chosen, values):
                full[i] = v
            merged = nnx.merge(graphdef, params, jax.tree.unflatten(treedef, full))
            out = original(merged, *args, **kwargs)
            after = jax.tree.leaves(nnx.split(merged, nnx.Param, ...)[2])
            return out, after if changed is None else [after[i] for i in changed]

        everything = range(len(leaves))
        with marking.probing():  # which leaves the call reads and which it changes
            probe = jax.make_jaxpr(lambda p, v: call(p, everything, v, None))(params, leaves).jaxpr
        leaf_vars = probe.invars[len(jax.tree.leaves(params)):]
        read_vars = {a for e in probe.eqns for a in e.invars if not isinstance(a, Literal)}
        after_vars = probe.outvars[len(probe.outvars) - len(leaves):]
        changed = [i for i, (v, o) in enumerate(zip(leaf_vars, after_vars)) if o is not v]
        chosen = [i for i, v in enumerate(leaf_vars) if v in read_vars or i in changed]
        out, new = marking.opaque(lambda p, v: call(p, chosen, v, changed), (params, [leaves[i] for i in chosen]),
                                  type(module).__name__)
        full = list(leaves)
        for i, v in zip(changed, new):
            full[i] = v
        nnx.update(module, jax.tree.unflatten(treedef, full))
        return out
