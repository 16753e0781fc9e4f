"""K-FAC's Kronecker factors of cotangents that are products of one example's operands, x_bᵀ y_b
(`OuterFactors`), and the biases that join such a product's block (`_biases`): what
`ParamFactors` forms K-FAC's factors from, read off a layer's per-example VJP.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import Literal

from .._graph import evaluate, replicated_result
from ._outer_products import leaf_terms
from ._patches import patch_products


class Term(NamedTuple):
    """One product x_bᵀ y_b of a cotangent leaf: ``eqn`` the ``dot_general``, ``side`` the adjoint
    operand's position in it, ``first`` whether the leaf takes x's free axes first. ``fixed`` is
    the λ-free operand's variable, or, where that operand is ``copies`` copies of another stacked
    along its contracted axis 0 (the forward Laplacian's d directions folded into the examples),
    that other's: then x_cᵀ y = xᵀ (Σ_k y_k), y's ``axis`` paired with the copies folded back."""

    eqn: Any
    side: int
    first: bool
    fixed: Any
    copies: int = 1
    axis: int = 0


class OuterFactors:
    """Kronecker factors of cotangent leaves that are products of one example's operands, x_bᵀ y_b
    (a ``dot_general`` without batch axes, the contracted axes summed: positions of a sequence),
    or sums of such products (a weight used several times in one layer), with y linear in the
    adjoint (the arguments marked ``varying``):

        Σ_b vec(x_bᵀ y_b) vec(x_bᵀ y_b)ᵀ  ≈  (1/N) (Σ_b x_bᵀ x_b) ⊗ (Σ_b y_bᵀ y_b)

    (K-FAC; exact for one example and one position; N counts the (example, position) terms, each
    use in a sum counted: K-FAC "expand"). `example_sums` gives what K-FAC "reduce" needs
    instead: each example's operands summed over its uses and positions.
    `parts` forms Σ_b w_b y_bᵀ y_b for one (adjoint, weights) — parts add up over the GGN's
    columns k — and `total` the λ-free Σ_b x_bᵀ x_b once; `layout` says in which
    order they make the leaf's Kronecker product. Leaves that are no such product (and all
    leaves, should JAX's jaxpr internals change) get no factors."""

    def __init__(self, per_example: Callable[..., list], example_args: list, varying: list[bool]):
        self.sources: list[Any] = []
        try:
            closed, leaves = leaf_terms(patch_products(jax.make_jaxpr(per_example)(*example_args), example_args,
                                                       varying), varying)
            producers = {v: eqn for eqn in closed.jaxpr.eqns for v in eqn.outvars}
            for terms in leaves:
                found = None if terms is None else [_term(producers, eqn, side, first) for eqn, _, side, first in terms]
                if found and len({self._layout(term) for term in found}) != 1:
                    found = None  # the terms would make different Kronecker layouts
                self.sources.append(_merged(found) if found else None)
            self.closed: Any = closed
            self.biases = _biases(closed.jaxpr, self.sources)
            wanted = [u for src in self.sources if src is not None for group in src for term in group
                      for u in (*term.eqn.invars, term.fixed)]
            jax.eval_shape(lambda a: evaluate(closed.jaxpr, closed.consts, a, wanted), list(example_args))
        except (AttributeError, TypeError, KeyError, ValueError, NotImplementedError):
            self.closed, self.sources, self.biases = None, [], {}  # JAX's jaxpr internals changed: no factors

    def factored(self, n: int) -> bool:
        return self.closed is not None and self.sources[n] is not None

    def layout(self, n: int) -> tuple[bool, int, int]:
        """Leaf ``n``: (whether the λ-free factor is the leading one, its size, the other's)."""
        return self._layout(self.sources[n][0][0])

    @staticmethod
    def _layout(term: Term) -> tuple[bool, int, int]:
        eqn, side, first = term.eqn, term.side, term.first
        sizes = [_free_size(v, c) for v, c in zip(eqn.invars, eqn.params["dimension_numbers"][0])]
        return first != side, sizes[1 - side], sizes[side]

    def count(self, n: int, batch: int) -> int:
        """N of leaf ``n``: examples times the contracted positions of every use (K-FAC "expand")."""
        positions = lambda t: math.prod(t.eqn.invars[t.side].aval.shape[d]
                                        for d in t.eqn.params["dimension_numbers"][0][t.side]) // t.copies
        return batch * sum(positions(t) for t, *_ in self.sources[n])

    def _uses(self, batched_args: list, in_axes: list, operand: int) -> list[list[tuple] | None]:
        """Per leaf: each use's operand ``operand`` (0: λ-free, 1: the adjoint's), [B, ...] one
        example per row, with its contracted (position) axes; None where not factored."""
        # a use's λ-free operand once, its adjoint operands added (xᵀy₁ + xᵀy₂ = xᵀ(y₁ + y₂))
        wanted = [t.eqn.invars[t.side] if operand else t.fixed for src in self.sources if src is not None
                  for group in src for t in (group if operand else group[:1])]
        closed = self.closed
        values = iter(jax.vmap(lambda a: evaluate(closed.jaxpr, closed.consts, a, wanted), in_axes=(in_axes,))(
            list(batched_args)))
        out: list[list[tuple] | None] = []
        for src in self.sources:
            if src is None:
                out.append(None)
                continue
            uses = []
            for group in src:
                eqn, side = group[0].eqn, group[0].side
                contracted = eqn.params["dimension_numbers"][0][side if operand else 1 - side]
                x = None
                for t in group if operand else ():
                    y = _folded(next(values), t)
                    x = y if x is None else x + y
                x = next(values) if x is None else x
                uses.append((x, tuple(d + 1 for d in contracted)))
            out.append(uses)
        return out

    def _grams(self, batched_args: list, in_axes: list, operand: int, weights: jax.Array | None) -> list:
        out = []
        ones_in = self._ones_columns() if operand == 0 else {}
        for n, uses in enumerate(self._uses(batched_args, in_axes, operand)):
            total = None
            for u, (x, contracted) in enumerate(uses or ()):  # each use's Gram matrix, added up
                axes = (0, *contracted)
                scaled = x if weights is None else weights.reshape((-1,) + (1,) * (x.ndim - 1)).astype(x.dtype) * x
                gram = lax.dot_general(scaled, x, ((axes, axes), ((), ())), **replicated_result(x, axes))
                size = math.prod(x.shape[1:]) // math.prod(x.shape[d] for d in contracted)
                gram = gram.reshape(size, size)
                if n in ones_in:  # the bias's column: Σ x over its terms beside x, their count in the corner
                    column = x.sum(axis=axes).reshape(size) if u in ones_in[n] else jnp.zeros(size, x.dtype)
                    count = x.shape[0] * math.prod(x.shape[d] for d in contracted) if u in ones_in[n] else 0
                    gram = jnp.block([[gram, column[:, None]], [column[None, :], jnp.full((1, 1), count, x.dtype)]])
                total = gram if total is None else total + gram
            out.append(total)
        return out

    def _ones_columns(self) -> dict[int, set[int]]:
        """Per weight leaf joined with its bias: the uses whose inputs get a column of ones (those
        whose adjoint operand the bias's cotangent sums; the others a column of zeros)."""
        return {weight: uses for weight, (_, uses) in self.biases.items()}

    def drop_bias(self, n: int) -> None:
        """Leaf ``n``'s factors without its bias's column (the bias left to a diagonal)."""
        self.biases.pop(n, None)

    def parts(self, batched_args: list, in_axes: list, weights: jax.Array) -> list:
        """Per leaf: Σ_b w_b y_bᵀ y_b (the adjoint's operand; None where not factored)."""
        return self._grams(batched_args, in_axes, 1, weights) if self.closed is not None else []

    def total(self, batched_args: list, in_axes: list) -> list:
        """Per leaf: Σ_b x_bᵀ x_b (the λ-free operand; None where not factored)."""
        return self._grams(batched_args, in_axes, 0, None) if self.closed is not None else []

    def example_sums(self, batched_args: list, in_axes: list, adjoint: bool) -> list:
        """Per leaf: each example's operand summed over its uses and positions, [B, size] — the
        λ-free one (x̄_b = Σ_t x_bt) or the adjoint's (ȳ_b = Σ_t y_bt): K-FAC "reduce" forms its
        factors from these (None where not factored)."""
        if self.closed is None:
            return []
        out = []
        ones_in = {} if adjoint else self._ones_columns()
        for n, uses in enumerate(self._uses(batched_args, in_axes, int(adjoint))):
            total = None
            for u, (x, contracted) in enumerate(uses or ()):
                summed = x.sum(axis=contracted).reshape(x.shape[0], -1)
                if n in ones_in:  # the bias's column: each example's count of the bias's terms
                    count = math.prod(x.shape[d] for d in contracted) if u in ones_in[n] else 0
                    summed = jnp.concatenate([summed, jnp.full((x.shape[0], 1), count, x.dtype)], axis=1)
                total = summed if total is None else total + summed
            out.append(total)
        return out


def _biases(jaxpr: Any, sources: list) -> dict[int, tuple[int, set[int]]]:
    """The bias leaves that join a weight leaf's Kronecker block: per weight leaf m, (the bias
    leaf n, the uses of m whose inputs get a column of ones). Leaf n is m's bias where its
    cotangent is a sum, over some of m's uses, of the use's adjoint operand y summed over that
    use's contracted axes (the positions) — Σ_t y_t, as a bias added after x W gets — laid out
    row-major as y's free axes: then [W; b]'s cotangent is [x; 1]ᵀ y (a column of zeros for
    the uses without the bias: a Laplacian's derivative rows). One such weight per bias, one
    bias per weight; anything else keeps its own curvature."""
    producers = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
    adjoints: dict[Any, list[tuple]] = {}  # each use's adjoint operand: var → (weight, use, term, summed axes)
    aliases: dict[Any, list[tuple]] = {}  # the same entries before axes of size 1 were added or moved
    for m, src in enumerate(sources):
        for u, group in enumerate(src or ()):
            for t, term in enumerate(group):
                y = term.eqn.invars[term.side]
                contracted = term.eqn.params["dimension_numbers"][0][term.side]
                axes = frozenset(d for d in contracted if y.aval.shape[d] != 1)
                adjoints.setdefault(y, []).append((m, u, t, axes))
                for alias, alias_axes in _unit_aliases(producers, y, axes):
                    aliases.setdefault(alias, []).append((m, u, t, alias_axes))
    # a bias may sum the adjoint operand as it was before the product's layout added axes of size 1
    # (an unbatched layer's example axis, a [1, n] transposed to [n, 1]: equinox's Linear and Conv)
    adjoints |= {v: found for v, found in aliases.items() if v not in adjoints and len(found) == 1}
    found: dict[int, tuple[int, set[int]]] = {}
    claimed: dict[int, int] = {}  # weight → how many biases matched it
    for n, var in enumerate(jaxpr.outvars):
        if sources[n] is not None:
            continue
        terms = _summed_terms(producers, var, adjoints)
        if not terms:
            continue
        matched = [[(m, u, t) for m, u, t, contracted in adjoints.get(y, ()) if contracted == axes]
                   for y, axes in terms]
        if any(len(ms) != 1 for ms in matched):
            continue
        hits = [ms[0] for ms in matched]
        weights = {m for m, _, _ in hits}
        if len(weights) != 1 or len(set(hits)) != len(hits):
            continue
        (m,) = weights
        uses = {u for _, u, _ in hits}
        if any({t for _, uu, t in hits if uu == u} != set(range(len(sources[m][u]))) for u in uses):
            continue  # a use whose copies the bias sums only in part
        y0, axes0 = terms[0]
        free = math.prod(k for d, k in enumerate(y0.aval.shape) if d not in axes0)
        if math.prod(var.aval.shape) != free:
            continue
        claimed[m] = claimed.get(m, 0) + 1
        found[m] = (n, uses)
    return {m: pair for m, pair in found.items() if claimed[m] == 1}


def _unit_aliases(producers: dict, var: Any, axes: frozenset) -> list[tuple[Any, frozenset]]:
    """The variables ``var`` was made from by reshapes, broadcasts and transposes that only add,
    drop or move axes of size 1 (the same entries in the same order), each with ``axes`` (of
    size > 1) renumbered as its own."""
    found = []
    while not isinstance(var, Literal) and var in producers:
        eqn = producers[var]
        name = eqn.primitive.name
        source = eqn.invars[0] if eqn.invars else None
        if name not in ("reshape", "broadcast_in_dim", "expand_dims", "squeeze", "transpose") or (
                source is None or isinstance(source, Literal)):
            break
        kept, before = _large_axes(var.aval.shape), _large_axes(source.aval.shape)
        if [var.aval.shape[d] for d in kept] != [source.aval.shape[d] for d in before]:
            break
        if name == "transpose" and [eqn.params["permutation"][d] for d in kept] != before:
            break  # the large axes reordered
        axes = frozenset(before[kept.index(d)] for d in axes)
        var = source
        found.append((var, axes))
    return found


def _large_axes(shape: tuple[int, ...]) -> list[int]:
    return [d for d, n in enumerate(shape) if n != 1]


def _summed_terms(producers: dict, var: Any, stop: dict) -> list[tuple[Any, frozenset]] | None:
    """``var`` as Σ_j (y_j summed over some of its axes), y_j among ``stop``, through
    ``add``/``add_any`` and row-major layout operations (no transposes): [(y_j, the axes of
    size > 1 summed)]."""
    if isinstance(var, Literal):
        return None
    if var in stop:
        return [(var, frozenset())]
    eqn = producers.get(var)
    if eqn is None:
        return None
    name = eqn.primitive.name
    if name in ("add", "add_any") and len(eqn.invars) == 2:
        parts = [_summed_terms(producers, v, stop) for v in eqn.invars]
        return None if None in parts else parts[0] + parts[1]
    same_size = not isinstance(eqn.invars[0], Literal) and eqn.invars[0].aval.size == var.aval.size
    if name in ("reshape", "squeeze", "expand_dims", "convert_element_type", "copy", "copy_p") or (
            name == "broadcast_in_dim" and same_size):  # size-1 axes added: the row-major order kept
        return _summed_terms(producers, eqn.invars[0], stop)
    if name == "reduce_sum" and not isinstance(eqn.invars[0], Literal) and eqn.invars[0] in stop:
        y = eqn.invars[0]
        return [(y, frozenset(d for d in eqn.params["axes"] if y.aval.shape[d] != 1))]
    if name == "reduce_sum" and not isinstance(eqn.invars[0], Literal) and all(
            eqn.invars[0].aval.shape[d] == 1 for d in eqn.params["axes"]):  # axes of size 1: a reshape
        return _summed_terms(producers, eqn.invars[0], stop)
    return None


def _term(producers: dict, eqn: Any, side: int, first: bool) -> Term:
    """The product as a `Term`, its λ-free operand traced back through copies stacked along its
    contracted axis 0: ``reshape(broadcast_in_dim(x, (d, *x.shape)), (d·n, ...))``."""
    fixed = eqn.invars[1 - side]
    (lc, rc), _ = eqn.params["dimension_numbers"]
    fixed_axes, adjoint_axes = (rc, lc) if side == 0 else (lc, rc)
    reshape = None if isinstance(fixed, Literal) else producers.get(fixed)
    if reshape is None or reshape.primitive.name != "reshape" or 0 not in fixed_axes:
        return Term(eqn, side, first, fixed)
    stacked = reshape.invars[0]
    broadcast = None if isinstance(stacked, Literal) else producers.get(stacked)
    if broadcast is None or broadcast.primitive.name != "broadcast_in_dim":
        return Term(eqn, side, first, fixed)
    source = broadcast.invars[0]
    d, *rest = stacked.aval.shape
    if (isinstance(source, Literal) or tuple(source.aval.shape) != tuple(rest) or not rest
            or tuple(broadcast.params["broadcast_dimensions"]) != tuple(range(1, len(rest) + 1))
            or tuple(fixed.aval.shape) != (d * rest[0], *rest[1:])):
        return Term(eqn, side, first, fixed)
    return Term(eqn, side, first, source, d, adjoint_axes[list(fixed_axes).index(0)])


def _folded(y: jax.Array, term: Term) -> jax.Array:
    """The adjoint operand ``y`` (one example per row) with a term's copies summed: the operand
    of xᵀ(Σ_k y_k), the product with the copies' source."""
    if term.copies == 1:
        return y
    axis = term.axis + 1  # after the examples' axis
    n = y.shape[axis] // term.copies
    return y.reshape(*y.shape[:axis], term.copies, n, *y.shape[axis + 1:]).sum(axis=axis)


def _merged(terms: list[Term]) -> list[list[Term]]:
    """The terms grouped into uses: products with the same λ-free operand (the same variable, or
    copies of it, the same contraction, the same adjoint operand's shape once copies are summed)
    are one use whose adjoint operands add — the copies of one product that nested JVPs leave in
    a program. A use's first term is one without copies where there is one (its sizes are the
    use's)."""
    groups: dict[tuple, list[Term]] = {}
    for t in terms:
        shape = list(t.eqn.invars[t.side].aval.shape)
        shape[t.axis] //= t.copies
        key = (id(t.eqn) if isinstance(t.fixed, Literal) else t.fixed, str(t.eqn.params["dimension_numbers"]), t.side,
               t.first, tuple(shape))
        groups.setdefault(key, []).append(t)
    return [sorted(group, key=lambda t: t.copies) for group in groups.values()]


def _free_size(var: Any, contracted: tuple[int, ...]) -> int:
    return math.prod(n for d, n in enumerate(var.aval.shape) if d not in contracted)

