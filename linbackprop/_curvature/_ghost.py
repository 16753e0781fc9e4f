"""Per-example gradient norms from the adjoints, without the per-example gradients: ghost norms.

After one back substitution for Σ_b ℓ_b, row b of Λ is example b's adjoint, and a parameter
row's gradient for example b is the sum over the layers i that use it of (∂Φ_i/∂θ)* Λ_i[b]. Its
squared norm is what DP-SGD clips by. Where each such term is a sum of outer products of one
example's operands — a dense layer a δᵀ, a weight used at every position of a sequence or by
several layers (an RNN's recurrent weight, a tied embedding's head), twice in one layer — the
sum over the uses and positions t is Uᵀ V with the uses' operands concatenated, and

    ‖Uᵀ V‖²  =  Σ_{t,s} (u_t·u_s)(v_t·v_s)

needs only the T × T Gram matrices (the "ghost" norm of Li et al. 2022 and Bu et al. 2023; the
fast gradient clipping of Opacus 1.5), or, where T(m + n) ≥ mn, the m × n product formed once per
example — never one per layer and position. Other cotangents (convolutions, layer norms'
scales, embedding lookups) are formed per example and squared. Rows of different blocks are
orthogonal parts of the gradient: their squares add.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._engine import (
    OuterTerms,
    Primal,
    Products,
    exclusive_groups,
    member_vjp,
    param_kinds,
    read_rows,
    scatter_add,
    squared_norms,
    squared_norms_and_products,
    tangent_leaves,
)
from .._options import Policy
from .._plan import Plan, RowList


class ParamNorms:
    """‖(ℳ Λ) restricted to example b‖² for every example b of one network call (its plan and
    stored forward pass), from the adjoints Λ of the summed per-example losses."""

    def __init__(self, plan: Plan, prim: Primal, batch: int):
        self.plan, self.prim, self.batch = plan, prim, batch
        self.kinds = param_kinds(plan)
        self.exclusive = exclusive_groups(plan)  # rows one layer uses: the members' own norms, vmapped
        self.members = []
        for kind in self.kinds:
            per_example, example, varying, th, xs, axes, _ = member_vjp(plan, prim, kind, batch)
            self.members.append((per_example, th, xs, axes, OuterTerms(per_example, example, varying)))
        # where a shared group's leaf has a use that is no aligned sum of products, every use of
        # it is formed per example (and summed, then squared)
        self.dense_shared: set[tuple[int, int]] = set()
        for kind, (*_, terms) in zip(self.kinds, self.members):
            for _, g, leaf, n in self._slots(kind):
                if g not in self.exclusive and not terms.aligned(n):
                    self.dense_shared.add((g, leaf))

    def _slots(self, kind: Any) -> list[tuple[int, int, int, int]]:
        """(parameter slot p of ``kind``, its group, leaf of a row of the group, leaf of the
        member's cotangents) — a group read twice by a layer (two rows) is two slots."""
        out, n = [], 0
        for p, g in enumerate(kind.param_groups):
            for leaf in range(tangent_leaves(self.plan.param_groups[g])):
                out.append((p, g, leaf, n))
                n += 1
        return out

    def values(self, lam: list[Any], examples: Chunk | None = None) -> list:
        """Per kind (None where its output has no adjoint): per leaf of a member's cotangents, its
        members' per-example values [members, B, ...] — `Products` (each term's operands) where
        the leaf is a sum of products, else the leaf itself — for all examples or those indexed
        by ``examples`` (`Chunk`). One evaluation of each layer's per-example VJP up to those operands
        serves the norms and the weighted sum."""
        out = []
        take = (lambda x: x) if examples is None else (lambda x: _chunk_rows(x, examples))
        for kind, (per_example, th, xs, axes, terms) in zip(self.kinds, self.members):
            if lam[kind.out_group] is None:
                out.append(None)
                continue
            lam_k = [take(x) for x in jax.tree.leaves(read_rows(lam[kind.out_group], kind.by_member.out[:kind.size]))]
            data = [x if a is None else take(x) for x, a in zip(xs, axes[len(th):])]  # [members, B, ...]
            dense = [(g, leaf) in self.dense_shared for _, g, leaf, _ in self._slots(kind)]
            out.append(jax.vmap(lambda th, xs, lm, axes=axes, terms=terms, dense=dense, f=per_example: terms.values(
                [*th, *xs, *lm], [*axes, *[0] * len(lm)], dense, f))(th, data, lam_k))
        return out

    def _uses(self, values: list) -> tuple[jax.Array, dict]:
        """The squared norms of the rows one layer uses (per example), and the uses of every
        other row: (group, leaf, row) -> [(its members' values [k, B, ...], the members)]."""
        batch = _batch_of(values)
        total = jnp.zeros((batch,), jnp.result_type(float))
        shared: dict[tuple[int, int, int], list] = {}
        for kind, (*_, terms), kind_values in zip(self.kinds, self.members, values):
            if kind_values is None:
                continue
            for p, g, leaf, n in self._slots(kind):
                value = kind_values[n]
                if isinstance(value, Products):  # (U, V) [members, B, T, ·]
                    value = jax.vmap(lambda v, n=n, terms=terms: terms.canonical(n, v))(value)
                if g in self.exclusive:
                    total = total + jnp.sum(jax.vmap(_squared)(value), axis=0).astype(total.dtype)
                    continue
                rows = np.asarray(kind.by_member.params[:kind.size, p])
                for row in np.unique(rows):  # the members using this row, in one piece
                    members = np.flatnonzero(rows == row)
                    shared.setdefault((g, leaf, int(row)), []).append((value, members))
        return total, shared

    def squared(self, values: list) -> tuple[jax.Array, dict]:
        """The (B,) squared norms of the call's per-example parameter gradients (B: the examples
        ``values`` holds), and the rows' per-example cotangents formed on the way: rows used by
        several layers (or members) are formed per example from all their uses where that is
        cheaper than the ghost norm — the product Σ u vᵀ [B, m, n], or the sum of the uses'
        leaves — and `weighted` sums those over the examples instead of forming the products
        again. {(group, leaf, row): [B, ...]}."""
        total, shared = self._uses(values)
        formed = {}
        for key, uses in shared.items():
            squares, formed[key] = _shared_squares(uses)
            total = total + squares.astype(total.dtype)
        return total, {key: x for key, x in formed.items() if x is not None}

    def example_bytes(self, lam: list[Any]) -> int:
        """What one example's shared rows take when formed (`_use_bytes`): the temporaries that
        grow with the examples at once, beyond the forward pass and Λ."""
        found = []

        def probe(lam: list[Any]) -> jax.Array:
            _, shared = self._uses(self.values(lam))
            found.append(sum(_use_bytes(value, len(members)) for uses in shared.values() for value, members in uses))
            return jnp.zeros(())

        jax.eval_shape(probe, lam)
        return found[0]

    def weighted(self, values: list, weights: jax.Array, formed: dict | None = None) -> list[Any]:
        """Σ_b w_b (ℳ Λ restricted to example b) in the parameter layout, from the same values:
        a sum of products Σ_b w_b x_bᵀ y_b is one product over the examples (no per-example
        leaf), another leaf Σ_b w_b X_b; the members' results are added into their rows. Rows
        whose per-example cotangents `squared` ``formed`` are those summed with the weights."""
        plan, formed = self.plan, formed or {}
        out = [g.zeros(plan.unrolled, tangent=True) for g in plan.param_groups]
        for kind, (*_, terms), kind_values in zip(self.kinds, self.members, values):
            if kind_values is None:
                continue
            leaves = []
            for p, g, leaf, n in self._slots(kind):
                value, row = kind_values[n], kind.shared_rows[p]
                rows = kind.by_member.params[:kind.size, p] if row is None else np.array([row])
                keep = np.array([(g, leaf, int(r)) not in formed for r in rows])  # the others: formed already
                if not keep.any():
                    leaves.append(jnp.zeros((len(rows), *self._leaf_shape(g, leaf)), weights.dtype))
                    continue
                if isinstance(value, Products) and row is not None:  # every member's products at once
                    ct = terms.weighted(n, value, weights, members=True)[None]
                elif isinstance(value, Products):
                    ct = jax.vmap(lambda v, n=n, terms=terms: terms.weighted(n, v, weights))(value)
                elif row is not None:  # summed over the members first: a reduction, not a transposed copy
                    ct = jnp.einsum("b,b...->...", weights.astype(value.dtype), jnp.sum(value, axis=0))[None]
                else:
                    ct = jnp.einsum("b,mb...->m...", weights.astype(value.dtype), value)
                leaves.append(ct if keep.all() else ct * keep.reshape((-1,) + (1,) * (ct.ndim - 1)).astype(ct.dtype))
            at = 0
            for p, g in enumerate(kind.param_groups):
                tree = jax.tree.structure(plan.param_groups[g].row_avals(tangent=True))
                ct = tree.unflatten(leaves[at:at + tree.num_leaves])
                at += tree.num_leaves
                row = kind.shared_rows[p]
                out[g] = scatter_add(out[g], kind.by_member.params[:kind.size, p] if row is None else np.array([row]),
                                     ct)
        for (g, leaf, row), x in formed.items():  # Σ_b w_b (the row's cotangent of example b)
            summed = jnp.einsum("b,b...->...", weights.astype(x.dtype), x).reshape(self._leaf_shape(g, leaf))
            avals = jax.tree.leaves(plan.param_groups[g].row_avals(tangent=True))
            cts = [summed[None] if k == leaf else jnp.zeros((1, *a.shape), a.dtype) for k, a in enumerate(avals)]
            out[g] = scatter_add(out[g], np.array([row]), jax.tree.structure(
                plan.param_groups[g].row_avals(tangent=True)).unflatten(cts))
        return out

    def _leaf_shape(self, g: int, leaf: int) -> tuple[int, ...]:
        return tuple(jax.tree.leaves(self.plan.param_groups[g].row_avals(tangent=True))[leaf].shape)


def _squared(value: Any) -> jax.Array:
    """(B,) squared norms of one leaf's per-example values: (U, V) or [B, ...]."""
    if isinstance(value, tuple):
        return squared_norms(*value)
    flat = value.reshape(value.shape[0], -1)
    return jnp.sum(flat * flat, axis=1)


def _use_bytes(value: Any, members: int) -> int:
    """Bytes one example's share of a shared row's use takes when formed: its operands gathered
    (U, V [members·T, ·]) and their product or Gram matrices, or its members' leaves."""
    if isinstance(value, tuple):
        u, v = value  # [all members, B, T, ·]
        t, m, n = members * u.shape[2], u.shape[3], v.shape[3]
        return (t * (m + n) + min(m * n, 2 * t * t)) * u.dtype.itemsize
    return (members + 1) * int(np.prod(value.shape[2:])) * value.dtype.itemsize


def _shared_squares(uses: list) -> tuple[jax.Array, jax.Array | None]:
    """Squared norms, per example, of one shared row's cotangent summed over its uses (each a
    kind's values [members, B, ...] and the members using the row), and that cotangent per
    example where it was formed (the product Σ u vᵀ, or the sum of the uses' leaves; else None)."""
    def take(x: jax.Array, members: np.ndarray) -> jax.Array:  # [k, B, ...]
        return x if len(members) == x.shape[0] else x[members]

    if isinstance(uses[0][0], tuple):  # aligned sums of products: every use's positions concatenated
        u = jnp.concatenate([_positions(take(value[0], members)) for value, members in uses], axis=1)
        v = jnp.concatenate([_positions(take(value[1], members)) for value, members in uses], axis=1)
        return squared_norms_and_products(u, v)
    summed = sum(jnp.sum(take(value, members), axis=0) for value, members in uses)
    return _squared(summed), summed


def _batch_of(values: list) -> int:
    return next(jax.tree.leaves(v)[0].shape[1] for v in values if v is not None)


def _positions(x: jax.Array) -> jax.Array:
    """[k, B, T, ·] -> [B, k·T, ·]: the members' positions one after another."""
    return jnp.moveaxis(x, 0, 1).reshape(x.shape[1], -1, x.shape[-1])


@dataclasses.dataclass(frozen=True)
class Chunk:
    """A chunk of the examples: ``size`` from ``start`` (a slice), the last one repeated where the
    chunk runs past the batch (a gather)."""

    start: jax.Array
    size: int
    batch: int

    @property
    def valid(self) -> jax.Array | None:
        """Which of the chunk's examples are its own (None: all): a repeat counts once."""
        return None if self.batch % self.size == 0 else self.start + jnp.arange(self.size) < self.batch


def _chunk_rows(x: jax.Array, examples: Chunk) -> jax.Array:
    """The chunk's rows of ``x`` [members, B, ...] (axis 1)."""
    if examples.valid is None:
        return jax.lax.dynamic_slice_in_dim(x, examples.start, examples.size, axis=1)
    return jnp.take(x, jnp.minimum(examples.start + jnp.arange(examples.size), examples.batch - 1), axis=1)


def ghost_squares(norms: list[ParamNorms], lams: list, batch: int, policy: Policy) -> jax.Array:
    """(B,) squared per-example gradient norms of the calls (`ParamNorms` and Λ of each), in
    chunks of examples where the shared rows' per-example temporaries call for them
    (`Policy.norm_chunk`)."""
    size = _chunk(norms, lams, batch, policy)

    def squares(examples: Chunk | None) -> jax.Array:
        return sum(n.squared(n.values(lam, examples))[0] for n, lam in zip(norms, lams))

    if size == batch:
        return squares(None)
    chunks = jax.lax.map(lambda s: squares(Chunk(s, size, batch)), jnp.arange(0, batch, size))
    return chunks.reshape(-1)[:batch]


def ghost_clipped(norms: list[ParamNorms], lams: list, batch: int, policy: Policy,
                  weights_of: Callable[[jax.Array], jax.Array], extra: jax.Array | None = None
                  ) -> tuple[jax.Array, list[list[Any]]]:
    """The (B,) per-example gradient norms and, per call, Σ_b w_b (ℳΛ of example b) in the
    parameter layout, w = ``weights_of(norms)`` elementwise (DP-SGD: min(1, C/‖g_b‖)); ``extra``:
    (B,) squares of the gradients' other part, added to the norms (a head outside the networks). Each
    example's weight needs only its own norm, so where chunks of examples pay
    (`Policy.norm_chunk`) one loop over them forms a chunk's values, norms, weights and weighted
    sum, reading the forward pass and Λ in place: the temporaries are one chunk's."""
    size = _chunk(norms, lams, batch, policy)

    def clipped(examples: Chunk | None) -> tuple[jax.Array, list]:
        values = [n.values(lam, examples) for n, lam in zip(norms, lams)]
        squared = [n.squared(v) for n, v in zip(norms, values)]
        more = 0 if extra is None else (extra if examples is None else _chunk_rows(extra[None], examples)[0])
        lengths = jnp.sqrt(sum(squares for squares, _ in squared) + more)
        weights = weights_of(lengths)
        if examples is not None and examples.valid is not None:  # the last chunk's repeats count once
            weights = jnp.where(examples.valid, weights, 0)
        return lengths, [n.weighted(v, weights, formed) for n, v, (_, formed) in zip(norms, values, squared)]

    if size == batch:
        return clipped(None)

    def body(total: list, start: jax.Array) -> tuple[list, jax.Array]:
        lengths, sums = clipped(Chunk(start, size, batch))
        return jax.tree.map(jnp.add, total, sums), lengths

    zeros = [[g.zeros(n.plan.unrolled, tangent=True) for g in n.plan.param_groups] for n in norms]
    sums, lengths = jax.lax.scan(body, zeros, jnp.arange(0, batch, size))
    return lengths.reshape(-1)[:batch], sums


def _chunk(norms: list[ParamNorms], lams: list, batch: int, policy: Policy) -> int:
    return policy.norm_chunk(batch, sum(n.example_bytes(lam) for n, lam in zip(norms, lams)))


def weighted_by_example(lam: list[Any], weights: jax.Array) -> list[Any]:
    """Λ with example b's rows scaled by w_b — the adjoints of Σ_b w_b ℓ_b, since row b of Λ is
    example b's alone (the back substitution is linear and keeps examples apart). Buffers hold
    [rows, batch, ...]; a RowList holds rows of [batch, ...]."""

    def scale(x: jax.Array, axis: int) -> jax.Array:
        if x.ndim <= axis or x.shape[axis] != weights.shape[0]:
            return x  # the cotangent of an input without the batch (a constant the layers read): no example's
        shape = [1] * x.ndim
        shape[axis] = weights.shape[0]
        return x * weights.reshape(shape).astype(x.dtype)

    out = []
    for buf in lam:
        if buf is None:
            out.append(None)
        elif isinstance(buf, RowList):
            out.append(RowList([jax.tree.map(lambda x: scale(x, 0), row) for row in buf.rows]))
        else:
            out.append(jax.tree.map(lambda x: scale(x, 1), buf))
    return out

