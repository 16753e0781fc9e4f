"""Batched products with a short contraction, their contracted axes moved last first.

ℳΛ after the loop sums, per layer, outer products over the few rows of a latency-bound state:
W̄_l = Σ_b x_lbᵀ δ_lb, a ``dot_general`` batched over the layers l whose left operand contracts
its middle axis b. XLA on CPU runs that as one small product per layer; with the left operand
transposed first, [l, i, b], and kept so (an optimisation barrier: XLA would fold the transpose
back into the product), it is the batched matrix product its fast kernels take. `contracted_last`
evaluates a function with each such product rewritten that way.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
from jax import lax

from .._graph import bind_equation, evaluate


def contracted_last(fn: Callable, min_size: int, max_size: int) -> Callable:
    """``fn``, its batched ``dot_general``s whose operands contract ``min_size`` to ``max_size``
    entries right after their batch axes computed from the right operand transposed first (the
    same values; nested ``jit``s inlined)."""

    def run(*args: Any) -> Any:
        closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        out = _evaluate(closed.jaxpr, closed.consts, jax.tree.leaves(args), (min_size, max_size))
        return jax.tree.unflatten(jax.tree.structure(shape), out)

    return run


def _evaluate(jaxpr: Any, consts: list, args: list, sizes: tuple[int, int]) -> list:
    def rule(eqn: Any, ins: list) -> list | None:
        if eqn.primitive.name == "dot_general":
            return [_dot(eqn, ins, sizes)]
        if eqn.primitive.name in ("pjit", "jit"):  # inlined: its products are found too
            inner = eqn.params["jaxpr"]
            return _evaluate(inner.jaxpr, inner.consts, ins, sizes)
        return None

    return evaluate(jaxpr, consts, args, rule=rule)


def _dot(eqn: Any, ins: list, sizes: tuple[int, int]) -> jax.Array:
    """The product, where its left operand contracts a few entries right after its batch axes
    ([l, b, i], a per-layer sum of outer products over rows b), as (r̃ᵀ-first product)ᵀ: the
    right operand transposed first, [l, j, b], times the left one, [l, b, i], gives [l, j, i],
    transposed back (XLA folds that transpose into the one JAX's VJP puts after the product)."""
    lhs, rhs = ins
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    nb, nc = len(lb), len(lc)
    size = math.prod(lhs.shape[d] for d in lc)
    after_batch = lambda c, b: tuple(b) == tuple(range(len(b))) and tuple(c) == tuple(range(len(b), len(b) + len(c)))
    placed = eqn.params.get("out_sharding") is not None  # the result's sharding names its axes as they are
    shaped = bool(lb) and bool(lc) and after_batch(lc, lb) and after_batch(rc, rb)
    if placed or not shaped or not sizes[0] <= size <= sizes[1]:
        return bind_equation(eqn, ins)
    r_free = [d for d in range(rhs.ndim) if d not in rb and d not in rc]
    moved = lax.optimization_barrier(lax.transpose(rhs, (*rb, *r_free, *rc)))  # [l, j, b]
    numbers = ((tuple(range(rhs.ndim - nc, rhs.ndim)), tuple(lc)), (tuple(range(nb)), tuple(lb)))
    out = lax.dot_general(moved, lhs, numbers, precision=eqn.params["precision"],
                          preferred_element_type=eqn.params["preferred_element_type"])  # [l, j, i]
    l_free = lhs.ndim - nb - nc
    perm = (*range(nb), *range(nb + len(r_free), nb + len(r_free) + l_free), *range(nb, nb + len(r_free)))
    return lax.transpose(out, perm)
