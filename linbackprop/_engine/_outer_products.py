"""Sums of squared per-example cotangents as matrix products, where they are outer products.

A dense layer's parameter cotangent for one example is an outer product, W̄_b = a_bᵀ δ_b (a
``dot_general`` whose contracted axes all have size 1), so

    Σ_b w_b W̄_b²  =  (a²)ᵀ (w δ²)          (elementwise squares; one matrix product over b)

instead of forming every W̄_b. ``SquareSums`` finds such cotangents in the jaxpr of a layer's
per-example VJP (through layout operations after the product: transposes, reshapes, casts) and
evaluates the VJP only up to their operands, vmapped over the examples; other cotangents are
formed per example, squared and summed (XLA fuses that). Over several adjoints (the GGN
diagonal's output coordinates k) the λ-free factor a and the product are formed once:
Σ_k Σ_b w_kb W̄_kb² = (a²)ᵀ (Σ_k w_k δ_k²).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import Literal

from .._graph import bind_equation, dependents, evaluate

# Operations that move or copy entries without combining them: squaring commutes with them, and so
# does summing over the examples.
LAYOUT = frozenset({"transpose", "reshape", "convert_element_type", "squeeze", "expand_dims", "broadcast_in_dim",
                    "copy", "copy_p", "neg"})


def _outer_source(jaxpr: Any, var: Any, summed: bool = False) -> tuple[Any, list[Any]] | None:
    """The ``dot_general`` equation whose outer product ``var`` is (up to layout operations after
    it), and those operations from the product on; None where it is not one. ``summed``: also a
    sum of outer products (contracted axes of any size: the positions of a sequence)."""
    producers = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
    path = []
    while not isinstance(var, Literal) and var in producers:
        eqn = producers[var]
        name = eqn.primitive.name
        if name == "dot_general":
            (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
            lhs, rhs = eqn.invars
            if lb or rb or isinstance(lhs, Literal) or isinstance(rhs, Literal):
                return None
            if not summed and (any(lhs.aval.shape[d] != 1 for d in lc) or any(rhs.aval.shape[d] != 1 for d in rc)):
                return None
            return eqn, path[::-1]
        if name not in LAYOUT or len(eqn.invars) != 1:
            return None
        path.append(eqn)
        var = eqn.invars[0]
    return None


class SquareSums:
    """Σ_b w_b (leaf_b)² of the cotangent leaves ``per_example(*args)`` returns for one example, in
    two phases so that sums over several adjoints and weightings (the GGN diagonal's Σ_k) form
    each outer product's λ-free factor and its matrix product once:

        Σ_k Σ_b w_kb (a_bᵀ δ_kb)²  =  (a²)ᵀ (Σ_k w_k δ_k²)

    `parts` evaluates, per (adjoint, weights), what varies with them — Σ_b w_b leaf² for
    leaves formed per example, w δ² [B, ...] for outer products, the per-example leaves [B, ...]
    where not ``squared`` — parts add up over k, and `total` finishes once. ``varying``
    marks the arguments the adjoint is (the cotangent is linear in them)."""

    def __init__(self, per_example: Callable[..., list], example_args: list, squared: list[bool],
                 varying: list[bool]):
        self.per_example, self.squared = per_example, squared
        try:
            closed = jax.make_jaxpr(per_example)(*example_args)
            jaxpr = closed.jaxpr
            moving = depending(jaxpr, varying)
            self.sources = []
            for var, sq in zip(jaxpr.outvars, squared):
                src = _outer_source(jaxpr, var) if sq else None
                sides = None if src is None else [not isinstance(v, Literal) and v in moving for v in src[0].invars]
                self.sources.append(None if src is None or sum(sides) != 1 else (*src, sides.index(True)))
            self.closed: Any = closed
            wanted = [v for v, src in zip(jaxpr.outvars, self.sources) if src is None]
            wanted += [u for src in self.sources if src is not None for u in src[0].invars]
            jax.eval_shape(lambda a: evaluate(jaxpr, closed.consts, a, wanted), list(example_args))  # evaluable
        except (AttributeError, TypeError, KeyError, ValueError, NotImplementedError):
            self.closed = None  # JAX's jaxpr internals changed: every cotangent formed per example

    def _values(self, batched_args: list, in_axes: list, wanted: list) -> list:
        closed = self.closed
        return jax.vmap(lambda a: evaluate(closed.jaxpr, closed.consts, a, wanted), in_axes=(in_axes,))(
            list(batched_args))

    def parts(self, batched_args: list, in_axes: list, weights: jax.Array) -> list:
        if self.closed is None:
            leaves = jax.vmap(self.per_example, in_axes=in_axes)(*batched_args)
            return [weighted_square_sum(x, weights) if sq else x for x, sq in zip(leaves, self.squared)]
        outvars = self.closed.jaxpr.outvars
        wanted = [v if src is None else src[0].invars[src[2]] for v, src in zip(outvars, self.sources)]
        values = self._values(batched_args, in_axes, wanted)
        out = []
        for value, src, sq in zip(values, self.sources, self.squared):
            if src is not None:  # w δ²: the varying factor of the outer product
                out.append(weights.reshape((-1,) + (1,) * (value.ndim - 1)).astype(value.dtype) * value * value)
            else:
                out.append(weighted_square_sum(value, weights) if sq else value)
        return out

    def total(self, parts: list, batched_args: list, in_axes: list) -> list:
        if self.closed is None or all(src is None for src in self.sources):
            return parts
        fixed = [src[0].invars[1 - src[2]] for src in self.sources if src is not None]
        found = iter(self._values(batched_args, in_axes, fixed))
        out = []
        for part, src in zip(parts, self.sources):
            if src is None:
                out.append(part)
                continue
            eqn, path, side = src
            x = next(found)
            operands = [x * x, part] if side == 1 else [part, x * x]
            (lc, rc), _ = eqn.params["dimension_numbers"]
            contract = ((0, *(c + 1 for c in lc)), (0, *(c + 1 for c in rc)))
            value = lax.dot_general(*operands, (contract, ((), ())), precision=eqn.params.get("precision"),
                                    preferred_element_type=eqn.params.get("preferred_element_type"))
            for op in path:
                value = bind_equation(op, [value])
            out.append(value)
        return out


def weighted_square_sum(x: jax.Array, weights: jax.Array) -> jax.Array:
    return jnp.einsum("b,b...->...", weights.astype(x.dtype), x * x)


def depending(jaxpr: Any, varying: list[bool]) -> set:
    """The variables of ``jaxpr`` that depend on its inputs marked ``varying`` (an equation
    counted as depending on all its operands: conservative)."""
    return dependents(jaxpr.eqns, (v for v, m in zip(jaxpr.invars, varying) if m))


def first_operand(eqn: Any, path: list[Any]) -> int | None:
    """Which operand of the product (0: lhs, 1: rhs) holds the leading axes of the leaf the
    ``path`` makes of it, where the leaf, read row-major, is the product's two groups of free
    axes one after the other (the Kronecker layout); None where the path mixes them."""
    (lc, rc), _ = eqn.params["dimension_numbers"]
    lhs, rhs = eqn.invars
    labels = [0] * (lhs.aval.ndim - len(lc)) + [1] * (rhs.aval.ndim - len(rc))
    flat = False  # reshaped: the row-major order is kept, the axes no longer tracked
    for op in path:
        name = op.primitive.name
        if name == "transpose":
            if flat:
                return None
            labels = [labels[d] for d in op.params["permutation"]]
        elif name in ("reshape", "squeeze", "expand_dims", "broadcast_in_dim"):
            if name == "broadcast_in_dim" and op.outvars[0].aval.size != op.invars[0].aval.size:
                return None
            flat = True
        elif name not in ("convert_element_type", "copy", "copy_p", "neg"):
            return None
        if labels != sorted(labels) and labels != sorted(labels, reverse=True):
            return None  # the two groups interleaved
    if not labels or len(set(labels)) == 1:
        return labels[0] if labels else 0
    return labels[0]


def leaf_terms(closed: Any, varying: list[bool]) -> tuple[Any, list[list[tuple[Any, list[Any], int, int]] | None]]:
    """The jaxpr of a per-example VJP (``closed``) and, per output leaf, its outer-product terms
    as (eqn, path, the moving operand, the first operand) — None where the leaf is no such sum or
    a term has not exactly one operand moving with the varying arguments."""
    moving = depending(closed.jaxpr, varying)
    leaves: list = []
    for var in closed.jaxpr.outvars:
        terms = outer_terms(closed.jaxpr, var)
        found: list | None = [] if terms is not None else None
        for eqn, path in terms or ():
            sides = [not isinstance(v, Literal) and v in moving for v in eqn.invars]
            first = first_operand(eqn, path)
            if sum(sides) != 1 or first is None:
                found = None
                break
            found.append((eqn, path, sides.index(True), first))
        leaves.append(found)
    return closed, leaves


def outer_terms(jaxpr: Any, var: Any) -> list[tuple[Any, list[Any]]] | None:
    """``var`` as a sum of products of one example's operands — each a ``dot_general`` without
    batch axes (contracted axes of any size), then layout operations — through ``add`` /
    ``add_any``: a weight used twice in one layer, x Wᵀ + h Wᵀ. The (product, operations after
    it) of each term; None where ``var`` is not such a sum."""
    producers = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
    eqn = producers.get(var) if not isinstance(var, Literal) else None
    if eqn is not None and eqn.primitive.name in ("add", "add_any") and len(eqn.invars) == 2:
        parts = [outer_terms(jaxpr, v) for v in eqn.invars]
        return None if None in parts else parts[0] + parts[1]
    found = _outer_source(jaxpr, var, summed=True)
    return None if found is None else [found]


class OuterTerms:
    """Per-example squared norms of cotangent leaves that are sums of products of one example's
    operands, ‖Σ_t u_t v_tᵀ‖² over the positions t (and the terms) of a dense layer, a weight
    used at every position of a sequence or twice in a layer — without forming them:

        ‖Σ_t u_t v_tᵀ‖²  =  Σ_{t,s} (u_t·u_s)(v_t·v_s)                      (ghost norm)

    `values` gives, per such leaf, its terms' operands per example (`Products`), or the leaf itself
    per example where it is no such sum or ``dense`` asks for it; `canonical` makes them U
    [B, T, m] and V [B, T, n] (U the one whose free axes lead the leaf when read row-major, the
    terms' positions concatenated, a term negated by the layout operations after it negated) for
    `squared_norms`, and `weighted` the sum Σ_b w_b (leaf of b). Leaves whose every term's operands have one free
    axis each are `aligned`: their U, V read the leaf as the (m, n) matrix Σ_t u_t v_tᵀ, so
    terms from other layers (a shared block) can be concatenated with them."""

    def __init__(self, per_example: Callable[..., list], example_args: list, varying: list[bool]):
        self.terms: list[Any] = []
        try:
            closed, leaves = leaf_terms(jax.make_jaxpr(per_example)(*example_args), varying)
            for found in leaves:
                described: list | None = []
                for eqn, path, _, first in found or ():
                    if any(op.primitive.name == "broadcast_in_dim" for op in path):  # copies change the norm
                        described = None
                        break
                    sign = -1 if sum(op.primitive.name == "neg" for op in path) % 2 else 1
                    (lc, rc), _ = eqn.params["dimension_numbers"]
                    single = all(v.aval.ndim - len(c) <= 1 for v, c in zip(eqn.invars, (lc, rc)))
                    described.append((eqn, first, sign, single, path))
                self.terms.append(described or None)
            self.closed: Any = closed
            wanted = [u for terms in self.terms if terms for eqn, *_ in terms for u in eqn.invars]
            jax.eval_shape(lambda a: evaluate(closed.jaxpr, closed.consts, a, wanted), list(example_args))
        except (AttributeError, TypeError, KeyError, ValueError, NotImplementedError):
            self.closed, self.terms = None, []  # JAX's jaxpr internals changed: every leaf formed per example

    def factored(self, n: int) -> bool:
        return self.closed is not None and self.terms[n] is not None

    def aligned(self, n: int) -> bool:
        return self.factored(n) and (len(self.terms[n]) == 1 or all(t[3] for t in self.terms[n]))

    def values(self, batched_args: list, in_axes: list, dense: list[bool], per_example: Callable) -> list:
        """Per leaf, for the examples (the batch leading): `Products` — each term's two operands —
        where factored and not ``dense``, else the leaf itself [B, ...]."""
        if self.closed is None:
            return list(jax.vmap(per_example, in_axes=in_axes)(*batched_args))
        closed = self.closed
        factored = [self.factored(n) and not d for n, d in enumerate(dense)]
        wanted: list = []
        for n, var in enumerate(closed.jaxpr.outvars):
            wanted += [u for eqn, *_ in self.terms[n] for u in eqn.invars] if factored[n] else [var]
        values = iter(jax.vmap(lambda a: evaluate(closed.jaxpr, closed.consts, a, wanted), in_axes=(in_axes,))(
            list(batched_args)))
        return [Products([(next(values), next(values)) for _ in self.terms[n]]) if factored[n] else next(values)
                for n in range(len(closed.jaxpr.outvars))]

    def canonical(self, n: int, products: Products) -> tuple[jax.Array, jax.Array]:
        """Leaf ``n``'s (U [B, T, m], V [B, T, n]) from its `Products`: U the operand whose free
        axes lead the leaf, the terms' positions concatenated, a term negated by the operations
        after its product negated."""
        us, vs = [], []
        for (eqn, first, sign, _, _), operands in zip(self.terms[n], products.pairs):
            (lc, rc), _ = eqn.params["dimension_numbers"]
            u, v = (_positions_first(operands[k], (lc, rc)[k]) for k in (first, 1 - first))
            us.append(sign * u)
            vs.append(v)
        return jnp.concatenate(us, axis=1), jnp.concatenate(vs, axis=1)

    def weighted(self, n: int, products: Products, weights: jax.Array, members: bool = False) -> jax.Array:
        """Σ_b w_b (leaf ``n`` of example b) from its `Products`: per term one product over the
        examples and positions, (w x)ᵀ y, then the layout operations after it. ``members``: the
        operands have a leading axis of layers using one row (an RNN's recurrent weight),
        contracted too — one product, not one per layer added up."""
        total = None
        lead = 2 if members else 1
        for (eqn, _, _, _, path), (lhs, rhs) in zip(self.terms[n], products.pairs):
            (lc, rc), _ = eqn.params["dimension_numbers"]
            shape = (1, -1) if members else (-1,)
            scaled = weights.reshape(shape + (1,) * (lhs.ndim - lead)).astype(lhs.dtype) * lhs
            contract = ((*range(lead), *(c + lead for c in lc)), (*range(lead), *(c + lead for c in rc)))
            value = lax.dot_general(scaled, rhs, (contract, ((), ())), precision=eqn.params.get("precision"),
                                    preferred_element_type=eqn.params.get("preferred_element_type"))
            for op in path:
                value = bind_equation(op, [value])
            total = value if total is None else total + value
        return total


@jax.tree_util.register_pytree_node_class
class Products:
    """The operands (x_b, y_b) of each term of a cotangent that is a sum of products, per example
    (a leading batch axis): a pytree, so that it can be vmapped over a kind's members."""

    def __init__(self, pairs: list[tuple[jax.Array, jax.Array]]):
        self.pairs = list(pairs)

    def tree_flatten(self) -> tuple[list, int]:
        return [x for pair in self.pairs for x in pair], len(self.pairs)

    @classmethod
    def tree_unflatten(cls, count: int, leaves: list) -> Products:
        return cls([(leaves[2 * k], leaves[2 * k + 1]) for k in range(count)])


def _positions_first(x: jax.Array, contracted: tuple[int, ...]) -> jax.Array:
    """One operand [B, ...] of an example's product as [B, T, free]: its contracted axes (the
    positions, in the product's pairing order) first, flattened, then its free axes."""
    axes = [d + 1 for d in contracted]
    moved = jnp.moveaxis(x, axes, list(range(1, 1 + len(axes))))
    positions = math.prod(x.shape[d] for d in axes)
    return moved.reshape(x.shape[0], positions, -1)


def squared_norms(u: jax.Array, v: jax.Array) -> jax.Array:
    """‖Σ_t u_t v_tᵀ‖² per example from U [B, T, m], V [B, T, n]: the ghost norm
    Σ_{t,s} (u_t·u_s)(v_t·v_s) where T(m + n) < mn, else the product formed and squared."""
    return squared_norms_and_products(u, v)[0]


def squared_norms_and_products(u: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """`squared_norms`, and the per-example products Σ_t u_t v_tᵀ [B, m, n] where they were
    formed (T(m + n) ≥ mn; else None)."""
    _, t, m = u.shape
    n = v.shape[2]
    if t * (m + n) < m * n:
        return jnp.einsum("bts,bts->b", jnp.einsum("btm,bsm->bts", u, u), jnp.einsum("btn,bsn->bts", v, v)), None
    product = jnp.einsum("btm,btn->bmn", u, v)
    return jnp.sum(product * product, axis=(1, 2)), product
