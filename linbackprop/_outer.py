"""Sums of squared per-example cotangents as matrix products, where they are outer products.

A dense layer's parameter cotangent for one example is an outer product, W̄_b = a_bᵀ δ_b (a
``dot_general`` whose contracted axes all have size 1), so

    Σ_b w_b W̄_b²  =  (a²)ᵀ (w δ²)          (elementwise squares; one matrix product over b)

instead of forming every W̄_b. ``square_sums`` finds such cotangents in the jaxpr of a layer's
per-example VJP (through layout operations after the product: transposes, reshapes, casts) and
evaluates the VJP only up to their operands, vmapped over the examples; other cotangents are
formed per example, squared and summed (XLA fuses that).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import Literal

# Operations that move or copy entries without combining them: squaring commutes with them, and so
# does summing over the examples.
LAYOUT = frozenset({"transpose", "reshape", "convert_element_type", "squeeze", "expand_dims", "broadcast_in_dim",
                    "copy", "copy_p", "neg"})


def _outer_source(jaxpr: Any, var: Any) -> tuple[Any, list[Any]] | None:
    """The ``dot_general`` equation whose outer product ``var`` is (up to layout operations after
    it), and those operations from the product on; None where it is not one."""
    producers = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
    path = []
    while not isinstance(var, Literal) and var in producers:
        eqn = producers[var]
        name = eqn.primitive.name
        if name == "dot_general":
            (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
            lhs, rhs = eqn.invars
            if lb or rb or any(lhs.aval.shape[d] != 1 for d in lc) or any(rhs.aval.shape[d] != 1 for d in rc):
                return None
            return eqn, path[::-1]
        if name not in LAYOUT or len(eqn.invars) != 1:
            return None
        path.append(eqn)
        var = eqn.invars[0]
    return None


def _bind(eqn: Any, args: list) -> Any:
    """An equation applied to ``args``, as ``jax.core.eval_jaxpr`` applies it (bind parameters: a
    dict, or in some JAX versions (sub-functions, dict))."""
    params = eqn.primitive.get_bind_params(eqn.params)
    subfuns, params = params if isinstance(params, tuple) else ((), params)
    return eqn.primitive.bind(*subfuns, *args, **params)


def _evaluate(jaxpr: Any, consts: list, args: list, wanted: list) -> list:
    """The values of ``wanted`` variables of ``jaxpr`` at ``args``, evaluating only what they need."""
    needed = {v for v in wanted if not isinstance(v, Literal)}
    eqns = []
    for eqn in reversed(jaxpr.eqns):
        if any(v in needed for v in eqn.outvars):
            eqns.append(eqn)
            needed.update(v for v in eqn.invars if not isinstance(v, Literal))
    env = dict(zip(jaxpr.constvars, consts)) | dict(zip(jaxpr.invars, args))
    read = lambda v: v.val if isinstance(v, Literal) else env[v]
    for eqn in reversed(eqns):
        out = _bind(eqn, [read(v) for v in eqn.invars])
        env.update(zip(eqn.outvars, out if eqn.primitive.multiple_results else [out]))
    return [read(v) for v in wanted]


def square_sums(per_example: Callable[..., list], example_args: list, batched_args: list, in_axes: list,
                weights: jax.Array, squared: list[bool]) -> list:
    """For ``per_example(*args) -> list of cotangent leaves`` (one example): per leaf, Σ_b w_b
    (leaf_b)² where ``squared``, else the per-example leaves [B, ...]; ``batched_args`` vmapped
    with ``in_axes``, ``example_args`` shaped like one example's."""
    try:
        return _square_sums(per_example, example_args, batched_args, in_axes, weights, squared)
    except (AttributeError, TypeError, KeyError, ValueError, NotImplementedError):
        # JAX's jaxpr internals changed: every cotangent formed per example, then squared.
        leaves = jax.vmap(per_example, in_axes=in_axes)(*batched_args)
        return [jnp.einsum("b,b...->...", weights.astype(x.dtype), x * x) if sq else x
                for x, sq in zip(leaves, squared)]


def _square_sums(per_example: Callable[..., list], example_args: list, batched_args: list, in_axes: list,
                 weights: jax.Array, squared: list[bool]) -> list:
    closed = jax.make_jaxpr(per_example)(*example_args)
    jaxpr = closed.jaxpr
    sources = [_outer_source(jaxpr, v) if sq else None for v, sq in zip(jaxpr.outvars, squared)]
    wanted = [v for v, src, sq in zip(jaxpr.outvars, sources, squared) if src is None]
    wanted += [v for src in sources if src is not None for v in src[0].invars]
    values = jax.vmap(lambda a: _evaluate(jaxpr, closed.consts, a, wanted), in_axes=(in_axes,))(list(batched_args))
    found = dict(zip(wanted, values))
    out = []
    for var, src, sq in zip(jaxpr.outvars, sources, squared):
        if src is None:
            leaf = found[var]
            out.append(jnp.einsum("b,b...->...", weights.astype(leaf.dtype), leaf * leaf) if sq else leaf)
            continue
        eqn, path = src
        x, y = (found[v] for v in eqn.invars)
        (lc, rc), _ = eqn.params["dimension_numbers"]
        w = weights.reshape((-1,) + (1,) * (y.ndim - 1)).astype(y.dtype)
        contract = ((0, *(c + 1 for c in lc)), (0, *(c + 1 for c in rc)))
        value = lax.dot_general(x * x, w * y * y, (contract, ((), ())),
                                precision=eqn.params.get("precision"),
                                preferred_element_type=eqn.params.get("preferred_element_type"))
        for op in path:
            value = _bind(op, [value])
        out.append(value)
    return out
