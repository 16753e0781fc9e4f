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

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._engine import Primal, exclusive_groups, member_vjp, param_kinds, read_rows, scatter_add, tangent_leaves
from .._outer import OuterTerms, Products, squared_norms
from .._plan import Plan, RowList
from .._policy import Policy


class ParamNorms:
    """‖(ℳ Λ) restricted to example b‖² for every example b of one network call (its plan and
    stored forward pass), from the adjoints Λ of the summed per-example losses."""

    def __init__(self, plan: Plan, prim: Primal, batch: int, policy: Policy):
        self.plan, self.prim, self.batch, self.policy = plan, prim, batch, policy
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

    def values(self, lam: list[Any]) -> list:
        """Per kind (None where its output has no adjoint): per leaf of a member's cotangents, its
        members' per-example values [members, B, ...] — `Products` (each term's operands) where
        the leaf is a sum of products, else the leaf itself. One evaluation of each layer's
        per-example VJP up to those operands serves the norms and the weighted sum."""
        out = []
        for kind, (per_example, th, xs, axes, terms) in zip(self.kinds, self.members):
            if lam[kind.out_group] is None:
                out.append(None)
                continue
            lam_k = jax.tree.leaves(read_rows(lam[kind.out_group], kind.by_member.out[:kind.size]))
            dense = [(g, leaf) in self.dense_shared for _, g, leaf, _ in self._slots(kind)]
            out.append(jax.vmap(lambda th, xs, lm, axes=axes, terms=terms, dense=dense, f=per_example: terms.values(
                [*th, *xs, *lm], [*axes, *[0] * len(lm)], dense, f))(th, xs, lam_k))
        return out

    def squared(self, values: list) -> jax.Array:
        """The (B,) squared norms of the call's per-example parameter gradients. Rows used by
        several layers (or members) are formed per example from all their uses — a product or
        Gram matrix per example — so they go in chunks of examples (`Policy.norm_chunk`): their
        temporaries then stay near one chunk's, not the batch's."""
        total = jnp.zeros((self.batch,), jnp.result_type(float))
        shared: dict[tuple[int, int, int], list] = {}  # (group, leaf, row) -> its uses: (value, members)
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
        if not shared:
            return total
        per_example = sum(_use_bytes(value, len(members)) for uses in shared.values() for value, members in uses)
        size = self.policy.norm_chunk(self.batch, per_example)
        starts = np.arange(0, self.batch, size)

        def chunk(start: jax.Array) -> jax.Array:
            examples = jnp.minimum(start + jnp.arange(size), self.batch - 1)
            return sum(_shared_squares(uses, examples).astype(total.dtype) for uses in shared.values())

        if len(starts) == 1:
            return total + chunk(jnp.asarray(0))
        return total + jax.lax.map(chunk, jnp.asarray(starts)).reshape(-1)[:self.batch]

    def weighted(self, values: list, weights: jax.Array) -> list[Any]:
        """Σ_b w_b (ℳ Λ restricted to example b) in the parameter layout, from the same values:
        a sum of products Σ_b w_b x_bᵀ y_b is one product over the examples (no per-example
        leaf), another leaf Σ_b w_b X_b; the members' results are added into their rows."""
        plan = self.plan
        out = [g.zeros(plan.unrolled, tangent=True) for g in plan.param_groups]
        for kind, (*_, terms), kind_values in zip(self.kinds, self.members, values):
            if kind_values is None:
                continue
            leaves = []
            for p, _, _, n in self._slots(kind):
                value, one_row = kind_values[n], kind.shared_rows[p] is not None
                if isinstance(value, Products) and one_row:  # every member's products at once
                    leaves.append(terms.weighted(n, value, weights, members=True)[None])
                elif isinstance(value, Products):
                    leaves.append(jax.vmap(lambda v, n=n, terms=terms: terms.weighted(n, v, weights))(value))
                elif one_row:  # summed over the members first: a reduction, not a transposed copy
                    leaves.append(jnp.einsum("b,b...->...", weights.astype(value.dtype), jnp.sum(value, axis=0))[None])
                else:
                    leaves.append(jnp.einsum("b,mb...->m...", weights.astype(value.dtype), value))
            at = 0
            for p, g in enumerate(kind.param_groups):
                tree = jax.tree.structure(plan.param_groups[g].row_avals(tangent=True))
                ct = tree.unflatten(leaves[at:at + tree.num_leaves])
                at += tree.num_leaves
                row = kind.shared_rows[p]
                out[g] = scatter_add(out[g], kind.by_member.params[:kind.size, p] if row is None else np.array([row]),
                                     ct)
        return out


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


def _shared_squares(uses: list, examples: jax.Array) -> jax.Array:
    """Squared norms, for ``examples``, of one shared row's cotangent summed over its uses (each a
    kind's values [members, B, ...] and the members using the row)."""
    def take(x: jax.Array, members: np.ndarray) -> jax.Array:  # [k, examples, ...]
        x = x if len(members) == x.shape[0] else x[members]
        return jnp.take(x, examples, axis=1)

    if isinstance(uses[0][0], tuple):  # aligned sums of products: every use's positions concatenated
        u = jnp.concatenate([_positions(take(value[0], members)) for value, members in uses], axis=1)
        v = jnp.concatenate([_positions(take(value[1], members)) for value, members in uses], axis=1)
        return squared_norms(u, v)
    summed = sum(jnp.sum(take(value, members), axis=0) for value, members in uses)
    return _squared(summed)


def _positions(x: jax.Array) -> jax.Array:
    """[k, B, T, ·] -> [B, k·T, ·]: the members' positions one after another."""
    return jnp.moveaxis(x, 0, 1).reshape(x.shape[1], -1, x.shape[-1])


def weighted_by_example(lam: list[Any], weights: jax.Array) -> list[Any]:
    """Λ with example b's rows scaled by w_b — the adjoints of Σ_b w_b ℓ_b, since row b of Λ is
    example b's alone (the back substitution is linear and keeps examples apart). Buffers hold
    [rows, batch, ...]; a RowList holds rows of [batch, ...]."""

    def scale(x: jax.Array, axis: int) -> jax.Array:
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

