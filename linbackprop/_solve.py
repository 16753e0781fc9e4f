"""The engine: forward pass, forward and back substitution, and the block-sparse products.

Vectors of 𝒰 are lists of state-layout buffers (one stacked pytree per group of same-shaped
states, network inputs included); vectors of Θ are lists of parameter-layout buffers.
Network inputs are rows of ℒ with the identity and nothing else, so the same solve also
yields the cotangents (or takes the tangents) of the inputs.

The substitutions are ``lax.fori_loop`` over the topologically ordered layers. The body switches
over *kinds* of layer (not layers), every branch returns only the current layer's small results,
and every write into a large buffer happens outside the switch: a branch that updated a buffer
would make XLA copy it on every step. Writes of inactive kinds go to a pad row (or add zeros).

The ℳ-type products never enter a loop: they run for all layers of a kind at once, vmapped over
the stacked residuals, i.e. one batched product per kind instead of one small one per layer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._plan import Kind, Plan


class Primal(NamedTuple):
    """Everything the linear maps need: parameters, states and per-kind own residuals.

    ``residuals`` is None in the rematerialising mode: only the states are kept, and every
    product re-linearises its layers from their (re-read) parameters and inputs.
    """

    params: list[Any]
    states: list[Any]
    residuals: list[Any] | None


# -- small buffer helpers -----------------------------------------------------------------------
def _row(buf: Any, i: Any) -> Any:
    return jax.tree.map(lambda b: lax.dynamic_index_in_dim(b, i, 0, keepdims=False), buf)


def _set_row(buf: Any, i: Any, value: Any) -> Any:
    return jax.tree.map(lambda b, v: lax.dynamic_update_index_in_dim(b, v.astype(b.dtype), i, 0), buf, value)


def _add_row(buf: Any, i: Any, value: Any) -> Any:
    def add(b, v):
        return lax.dynamic_update_index_in_dim(b, lax.dynamic_index_in_dim(b, i, 0, False) + v.astype(b.dtype), i, 0)

    return jax.tree.map(add, buf, value)


def _contiguous(idx: Any) -> int | None:
    """The start of a static index table that is a contiguous range (then slices, not gathers)."""
    if isinstance(idx, np.ndarray) and idx.ndim == 1 and len(idx) and np.array_equal(idx, idx[0] + np.arange(len(idx))):
        return int(idx[0])
    return None


def _rows(buf: Any, idx: Any) -> Any:
    start = _contiguous(idx)
    if start is not None:
        return jax.tree.map(lambda b: lax.slice_in_dim(b, start, start + len(idx)), buf)
    return jax.tree.map(lambda b: b[idx], buf)


def _scatter_add(buf: Any, idx: Any, value: Any) -> Any:
    start = _contiguous(idx)
    if start is not None:
        def add(b, v):
            part = lax.slice_in_dim(b, start, start + len(idx)) + v.astype(b.dtype)
            return part if part.shape == b.shape else lax.dynamic_update_slice_in_dim(b, part, start, 0)

        return jax.tree.map(add, buf, value)
    return jax.tree.map(lambda b, v: b.at[idx].add(v.astype(b.dtype)), buf, value)


def _zeros_like_aval(tree: Any, lead: tuple[int, ...] = ()) -> Any:
    return jax.tree.map(lambda a: jnp.zeros((*lead, *a.shape), a.dtype), tree)


def _at(table: np.ndarray, i: Any) -> Any:
    """Entry i of a static table: static for a static i (unrolled), else a gather from a constant."""
    return table[i] if isinstance(i, (int, np.integer)) else jnp.asarray(table)[i]


def _loop(plan: Plan, body: Callable[[Any, Any], Any], init: Any) -> Any:
    """``lax.fori_loop`` over the steps, or the same body as straight-line code (static steps)."""
    if not plan.unrolled:
        return lax.fori_loop(0, plan.depth, body, init)
    carry = init
    for i in range(plan.depth):
        carry = body(i, carry)
    return carry


def _arguments(plan: Plan, kind: Kind, prim: Primal, pos: Any) -> tuple[tuple, tuple]:
    """θ and input states of the kind's member ``pos`` (an index or an array of indices)."""
    if isinstance(pos, np.ndarray):  # all members at once: static tables
        take, pslots, rslots = _rows, kind.param_slots[pos], kind.read_slots[pos]
    else:
        take, pslots, rslots = _row, _at(kind.param_slots, pos), _at(kind.read_slots, pos)
    theta = tuple(take(prim.params[g], pslots[..., p]) for p, g in enumerate(kind.param_groups))
    inputs = tuple(take(prim.states[g], rslots[..., r]) for r, g in enumerate(kind.read_groups))
    return theta, inputs


def _own(kind_res: Any, pos: Any) -> Any:
    return _rows(kind_res, pos) if isinstance(pos, np.ndarray) else _row(kind_res, pos)


# -- the four block maps of one layer, from its rebuilt VJP ---------------------------------------
class LayerMaps:
    """The blocks of one layer i: ∂Φ_i/∂U (ℒ, negated) and ∂Φ_i/∂θ (ℳ*), with adjoints."""

    def __init__(self, plan: Plan, kind: Kind, vjp: Callable):
        self.vjp = vjp
        self.kind = kind
        self.diff_reads = tuple(plan.state_groups[g].differentiable for g in kind.read_groups)

    def state_adjoint(self, lam: Any) -> tuple:
        """(∂Φ_i/∂U_j)* Λ_i for each read j (None for non-differentiable reads)."""
        cts = self.vjp(lam)[1:]
        return tuple(ct if d else None for ct, d in zip(cts, self.diff_reads))

    def param_adjoint(self, lam: Any) -> tuple:
        """(∂Φ_i/∂θ_{S_i})* Λ_i, one cotangent per parameter slot of the layer."""
        return self.vjp(lam)[0]

    def state_forward(self, z_reads: tuple) -> Any:
        """Σ_j ∂Φ_i/∂U_j Z_j, the transpose of :meth:`state_adjoint`."""
        keep = [z for z, d in zip(z_reads, self.diff_reads) if d]
        if not keep:
            return _zeros_like_aval(self.kind.out_aval)

        def adjoint(lam):
            return tuple(ct for ct, d in zip(self.vjp(lam)[1:], self.diff_reads) if d)

        return jax.linear_transpose(adjoint, self.kind.out_aval)(tuple(keep))[0]

    def param_forward(self, h: tuple) -> Any:
        """∂Φ_i/∂θ h_{S_i}, the transpose of :meth:`param_adjoint`."""
        return jax.linear_transpose(self.param_adjoint, self.kind.out_aval)(h)[0]


def _vjp(kind: Kind, prim: Primal, own: Any, theta: tuple, inputs: tuple, out: Any) -> Callable:
    if prim.residuals is None:  # remat: linearise again
        return jax.vjp(kind.layers[0].fn, theta, *inputs)[1]
    return kind.rebuild(own, theta, inputs, out)


def layer_maps(plan: Plan, kind: Kind, prim: Primal, k: int, pos: Any) -> LayerMaps:
    theta, inputs = _arguments(plan, kind, prim, pos)
    out = _row(prim.states[kind.out_group], _at(kind.out_slots, pos))
    own = None if prim.residuals is None else _own(prim.residuals[k], pos)
    return LayerMaps(plan, kind, _vjp(kind, prim, own, theta, inputs, out))


# -- the sequential parts --------------------------------------------------------------------------
def _step(plan: Plan, i: Any, branch: Callable[[int, Any], Any], zeros: Callable[[int], Any],
          operand: Any) -> list[Any]:
    """Run the branch of step i's kind; every other kind's entry holds ``zeros(kind)`` (None when
    the step is static: nothing to write)."""
    if isinstance(i, int):
        k = int(plan.step_kind[i])
        return [branch(k, operand) if kk == k else None for kk in range(len(plan.kinds))]
    if len(plan.kinds) == 1:
        return [branch(0, operand)]

    def make(k):
        def run(op):
            return [branch(k, op) if kk == k else zeros(kk) for kk in range(len(plan.kinds))]

        return run

    return lax.switch(jnp.asarray(plan.step_kind)[i], [make(k) for k in range(len(plan.kinds))], operand)


def forward(plan: Plan, params: list[Any], states: list[Any], residuals: bool = True) -> Primal:
    """U = Φ(U, θ) by forward substitution; with ``residuals``, each layer's VJP residuals too."""
    def zeros(k):
        kind = plan.kinds[k]
        return _zeros_like_aval(kind.out_aval), kind.own_zeros() if residuals else ()

    def body(i, carry):
        sts, res = carry

        def branch(k, sts):
            kind = plan.kinds[k]
            pos = _at(kind.step_pos, i)
            theta, inputs = _arguments(plan, kind, Primal(params, sts, []), pos)
            fn = kind.layers[0].fn
            if not residuals:
                return fn(theta, *inputs), ()
            out, vjp = jax.vjp(fn, theta, *inputs)
            return out, kind.split_residuals(vjp)

        results = _step(plan, i, branch, zeros, sts)
        sts, res = list(sts), list(res)
        for k, (kind, result) in enumerate(zip(plan.kinds, results)):
            if result is None:
                continue
            out, own = result
            g = kind.out_group
            sts[g] = _set_row(sts[g], _at(kind.step_out_slot, i), out)
            if residuals:
                res[k] = _set_row(res[k], _at(kind.step_pos, i), own)
        return sts, res

    res0 = [kind.own_zeros(kind.size + 1) if residuals else () for kind in plan.kinds]
    states, res = _loop(plan, body, (list(states), res0))
    return Primal(params, states, res if residuals else None)


def forward_substitution(plan: Plan, prim: Primal, rhs: list[Any]) -> list[Any]:
    """Z with ℒ Z = rhs: Z_i = rhs_i + Σ_j ∂Φ_i/∂U_j Z_j, first layer to last."""
    def body(i, z):
        def branch(k, zz):
            kind = plan.kinds[k]
            if zz[kind.out_group] is None:  # an integer state: no tangent
                return _zeros_like_aval(kind.out_aval)
            pos = _at(kind.step_pos, i)
            slots = _at(kind.read_slots, pos)
            reads = tuple(_row(zz[g], slots[r]) if zz[g] is not None else None
                          for r, g in enumerate(kind.read_groups))
            return layer_maps(plan, kind, prim, k, pos).state_forward(reads)

        results = _step(plan, i, branch, lambda k: _zeros_like_aval(plan.kinds[k].out_aval), z)
        z = list(z)
        for kind, dz in zip(plan.kinds, results):
            g = kind.out_group
            if dz is not None and z[g] is not None:
                z[g] = _add_row(z[g], _at(kind.step_out_slot, i), dz)
        return z

    return _loop(plan, body, list(rhs))


def back_substitution(plan: Plan, prim: Primal, rhs: list[Any], grads: list[Any] | None = None) -> Any:
    """Λ with ℒ* Λ = rhs: Λ_j = rhs_j + Σ_{i reads j} (∂Φ_i/∂U_j)* Λ_i, last layer to first.

    With ``grads`` (parameter-layout buffers), ℳΛ is also added into them inside the loop, from
    the same linearisation of each layer; returns (Λ, grads + ℳΛ) then.
    """
    in_loop = grads is not None

    def read_zeros(k):
        groups = [plan.state_groups[g] for g in plan.kinds[k].read_groups]
        reads = tuple(_zeros_like_aval(g.treedef.unflatten(list(g.leaves))) if g.differentiable else None
                      for g in groups)
        if not in_loop:
            return reads
        pgroups = [plan.param_groups[g] for g in plan.kinds[k].param_groups]
        return reads, tuple(_zeros_like_aval(g.treedef.unflatten(list(g.leaves))) for g in pgroups)

    def body(t, carry):
        lam, acc = carry if in_loop else (carry, None)
        i = plan.depth - 1 - t

        def branch(k, ll):
            kind = plan.kinds[k]
            if ll[kind.out_group] is None:  # an integer state: no cotangent to propagate
                return read_zeros(k)
            pos = _at(kind.step_pos, i)
            lam_i = _row(ll[kind.out_group], _at(kind.out_slots, pos))
            maps = layer_maps(plan, kind, prim, k, pos)
            return (maps.state_adjoint(lam_i), maps.param_adjoint(lam_i)) if in_loop else maps.state_adjoint(lam_i)

        results = _step(plan, i, branch, read_zeros, lam)
        lam, acc = list(lam), (list(acc) if in_loop else None)
        for kind, res in zip(plan.kinds, results):
            if res is None:
                continue
            cts, pcts = res if in_loop else (res, ())
            slots = _at(kind.step_read_slots, i)
            for r, (g, ct) in enumerate(zip(kind.read_groups, cts)):
                if ct is not None:
                    lam[g] = _add_row(lam[g], slots[r], ct)
            if pcts:  # inactive kinds add zeros to a member row: harmless
                pslots = _at(kind.param_slots, _at(kind.step_pos, i))
                for p, (g, ct) in enumerate(zip(kind.param_groups, pcts)):
                    acc[g] = _add_row(acc[g], pslots[p], ct)
        return (lam, acc) if in_loop else lam

    init = (list(rhs), list(grads)) if in_loop else list(rhs)
    return _loop(plan, body, init)


# -- the parallel parts: one vmapped application per kind -------------------------------------------
def _per_kind(plan: Plan, prim: Primal, k: int, apply: Callable[[LayerMaps, Any], Any], args: Any) -> Any:
    """``apply`` to every member layer of kind k at once, vmapped over the stacked residuals."""
    kind = plan.kinds[k]
    members = np.arange(kind.size)
    theta, inputs = _arguments(plan, kind, prim, members)
    own = None if prim.residuals is None else _own(prim.residuals[k], members)
    out = _rows(prim.states[kind.out_group], kind.out_slots[:-1])

    def one(theta, inputs, own, out, a):
        return apply(LayerMaps(plan, kind, _vjp(kind, prim, own, theta, inputs, out)), a)

    return jax.vmap(one)(theta, inputs, own, out, args)


def state_product(plan: Plan, prim: Primal, e: list[Any], adjoint: bool = False) -> list[Any]:
    """ℒ E = E − D_UΦ E, or ℒ* E with ``adjoint``; every layer at once (no recursion)."""
    out = list(e)
    for k, kind in enumerate(plan.kinds):
        n = kind.size
        if e[kind.out_group] is None:  # integer states: rows of the identity only
            continue
        if not adjoint:
            reads = tuple(_rows(e[g], kind.read_slots[:n, r]) if e[g] is not None else None
                          for r, g in enumerate(kind.read_groups))
            dz = _per_kind(plan, prim, k, lambda m, a: m.state_forward(a), reads)
            g = kind.out_group
            out[g] = _scatter_add(out[g], kind.out_slots[:n], jax.tree.map(jnp.negative, dz))
        else:
            lam = _rows(e[kind.out_group], kind.out_slots[:n])
            cts = _per_kind(plan, prim, k, lambda m, a: m.state_adjoint(a), lam)
            for r, (g, ct) in enumerate(zip(kind.read_groups, cts)):
                if ct is not None:
                    out[g] = _scatter_add(out[g], kind.read_slots[:n, r], jax.tree.map(jnp.negative, ct))
    return out


def param_forward(plan: Plan, prim: Primal, h: list[Any], into: list[Any]) -> list[Any]:
    """``into`` + ℳ* h (state layout): row i gets ∂Φ_i/∂θ h_{S_i}, all layers of a kind at once."""
    out = list(into)
    for k, kind in enumerate(plan.kinds):
        n = kind.size
        if out[kind.out_group] is None or not kind.param_groups:
            continue
        hs = tuple(_rows(h[g], kind.param_slots[:n, p]) for p, g in enumerate(kind.param_groups))
        dz = _per_kind(plan, prim, k, lambda m, a: m.param_forward(a), hs)
        g = kind.out_group
        out[g] = _scatter_add(out[g], kind.out_slots[:n], dz)
    return out


def param_adjoint(plan: Plan, prim: Primal, lam: list[Any]) -> list[Any]:
    """ℳ Λ (parameter layout): block k sums (∂Φ_i/∂θ_k)* Λ_i over the layers i that use it."""
    out = [g.zeros() for g in plan.param_groups]
    for k, kind in enumerate(plan.kinds):
        n = kind.size
        if lam[kind.out_group] is None or not kind.param_groups:
            continue
        lam_k = _rows(lam[kind.out_group], kind.out_slots[:n])
        cts = _per_kind(plan, prim, k, lambda m, a: m.param_adjoint(a), lam_k)
        for p, (g, ct) in enumerate(zip(kind.param_groups, cts)):
            out[g] = _scatter_add(out[g], kind.param_slots[:n, p], ct)
    return out
