"""The substitutions as one linear-solve primitive of linbackprop's own.

    x = A⁻¹ b,   A = ℒ (forward substitution) or ℒ* (back substitution, ``transposed``),
    or, for the joint system, A = [[I, 0], [−ℳ*, ℒ]] on (h, Z) and its transpose [[I, −ℳ], [0, ℒ*]]

bound on the leaves of the stored linearisation (``Primal``) and of b. Its rules:

- JVP: ẋ = A⁻¹ (ḃ − Ȧ x), Ȧ x the derivative of the product A x along the tangents of the
  linearisation (a ``jax.jvp`` of it); a solve again, so every order of forward mode works.
- transpose: linear in b only; b̄ = A⁻*  x̄, the other substitution. Leaves of b that are constants
  in a linear program are zeros (what JAX's JVP makes of a symbolic zero tangent): they get no
  cotangent. (JAX's own ``custom_linear_solve`` asserts instead, and its JVP rule passes symbolic
  zeros to its solve: a Hessian-vector product or ``jax.grad`` of a gradient would fail.)
- batching: one more ``jax.vmap`` level around the same substitutions; b is batched wherever the
  linearisation is, so the solution and the cotangents always are.

A primitive of our own (through ``jax.extend``, as ``_graph._buffers``'s) keeps JAX unchanged: no
other user of ``custom_linear_solve`` sees these rules.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from .._engine import (
    Primal,
    at_inputs,
    back_substitution,
    contracted_last,
    forward_substitution,
    param_adjoint,
    param_forward,
    state_product,
    take_rows,
    without_pad,
)
from .._graph import mesh_of, zeros_of
from .._plan import Plan
from ._variant import Params, SolveVariant


@dataclasses.dataclass(frozen=True)
class System:
    """What is static about one solve: the plan, whether it is the joint system over (h, Z), and
    the pytree structures of the linearisation and of b.

    ``compact``: Z (and b) in the layout of ``plan.compact``, rows only for the states read again
    from the buffer and for the network's inputs and outputs — for a tangent of the inputs alone
    (and ℳ* h in the loop). The solve is then x = P ℒ⁻¹ E Eᵀ b: b read at the input rows (E),
    the solution at the compact rows (P; its pad row zero); transposed, Eᵀ ℒ⁻* Pᵀ. With
    ``rhs_full`` (ℳ* h formed before the loop) b is in the full layout: x = P ℒ⁻¹ b, transposed
    ℒ⁻* Pᵀ (every row of Λ: ℳΛ is formed from them); ``carried_back``: that transpose solved in
    the compact layout, carrying Λ, each carried row set in a full-layout Λ
    (`back_substitution`'s ``every_row``; `Policy.carried_back_pays`), else in the full layout.
    ``joint`` with ``rhs_full``: b = (h, rhs), x = (h, P ℒ⁻¹ (rhs + ℳ* h)) with ℳ* h batched
    before the loop; its transpose forms ℳΛ after the back substitution, batched per kind, its
    products of short contractions (``contract_first``: from, to rows; None: none) computed
    with the contracted axes moved last first (`Policy.contract_first_rows`)."""

    plan: Plan
    joint: bool
    prim_tree: Any = None
    b_tree: Any = None
    compact: bool = False
    rhs_full: bool = False  # with compact: b in the full layout, read at every row: x = P ℒ⁻¹ b
    carried_back: bool = False  # with rhs_full: the transpose solved in the compact layout (Λ at every row)
    contract_first: tuple[int, int] | None = None  # joint, rhs_full: ℳΛ's contractions of these many rows moved last

    def __repr__(self) -> str:  # as printed in jaxprs
        net = self.plan.net
        extra = (", joint" if self.joint else "") + (", compact" if self.compact else "")
        extra += ", rhs full" if self.rhs_full else ""
        return f"System({len(net.layers)} layers, outputs {list(net.outputs)!r}{extra})"


def _held_weakly_by_jax_caches(cls: type) -> type:
    """Let JAX's caches that are keyed on primitive parameters (the abstract evaluation of every
    bind) hold a System weakly, as they hold jaxprs: an entry then goes when the last jaxpr using
    the System goes, instead of keeping its plan — the network and whatever its layers close over
    — until JAX's LRU evicts it. Without the private registry, memory is bounded by that LRU."""
    try:
        from jax._src.util import weakref_cache_key_types
    except ImportError:  # pragma: no cover - another JAX layout
        return cls
    weakref_cache_key_types.add(cls)
    return cls


System = _held_weakly_by_jax_caches(System)


def _solve_fn(system: System, transposed: bool) -> Callable[[Primal, Any], Any]:
    plan, compact = system.plan, system.compact
    if system.rhs_full and system.joint:  # (h, rhs) ↦ (h, P ℒ⁻¹ (rhs + ℳ* h)), ℳ* h and ℳΛ batched
        if transposed:
            back = _solve_fn(dataclasses.replace(system, joint=False), transposed)

            def solve_t(prim, g):
                lam = back(prim, g[1])
                adjoint = functools.partial(param_adjoint, plan, prim)
                if system.contract_first:
                    adjoint = contracted_last(adjoint, *system.contract_first)
                return [jax.tree.map(jnp.add, a, m) for a, m in zip(g[0], adjoint(lam))], lam
            return solve_t
        return lambda prim, b: (b[0], forward_substitution(plan, prim, param_forward(plan, prim, b[0], b[1]),
                                                           compact=True, rhs_full=True))
    if system.rhs_full:  # only as the transposed part of the joint system above: Pᵀ, then all of Λ
        assert transposed, "a non-joint system with rhs_full is never bound"
        if system.carried_back:  # ℒ⁻* Pᵀ b in the compact layout, Λ at every row
            return lambda prim, b: back_substitution(plan, prim, b, compact=True, every_row=True)
        full = _solve_fn(dataclasses.replace(system, compact=False, rhs_full=False), transposed)
        into, _ = _layouts(system, transposed)
        return lambda prim, b: full(prim, into(b))
    if not system.joint:
        if transposed:
            return lambda prim, b: back_substitution(plan, prim, b, compact=compact)
        return lambda prim, b: forward_substitution(plan, prim, b, compact=compact)
    if transposed:  # [[I, −ℳ], [0, ℒ*]] (grads, Λ) = (gh, gz): Λ by back substitution, grads = gh + ℳΛ
        def solve_t(prim, g):
            lam, grads = back_substitution(plan, prim, g[1], grads=g[0], compact=compact)
            return grads, lam
        return solve_t
    return lambda prim, b: (b[0], forward_substitution(plan, prim, b[1], h=b[0], compact=compact))


def _state_part(system: System, fn: Callable[[list[Any]], list[Any]]) -> Callable[[Any], Any]:
    """``fn`` applied to the state-layout part of a right-hand side or solution."""
    if system.joint:
        return lambda b: (b[0], fn(b[1]))
    return fn


def _layouts(system: System, transposed: bool) -> tuple[Callable, Callable]:
    """For a compact system, (its b -> the full system's b, the full system's solution -> its
    solution): the solve is P ℒ⁻¹ E Eᵀ b (transposed: Eᵀ ℒ⁻* Pᵀ b), with ``rhs_full`` P ℒ⁻¹ b
    (transposed: ℒ⁻* Pᵀ b)."""
    zplan = system.plan.compact
    to_full = functools.partial(take_rows, tables=zplan.to_compact)  # a compact row per full row
    to_compact = functools.partial(take_rows, tables=zplan.to_full)

    if transposed:  # Pᵀ b (the pad row is no row of the solution); Eᵀ at the input rows
        return (_state_part(system, lambda b: to_full(without_pad(zplan, b))),
                _state_part(system, lambda x: x if system.rhs_full else at_inputs(zplan, to_compact(x))))
    return (_state_part(system, lambda b: b if system.rhs_full else to_full(at_inputs(zplan, b))),
            _state_part(system, lambda x: without_pad(zplan, to_compact(x))))


def _matvec_fn(system: System, transposed: bool) -> Callable[[Primal, Any], Any]:
    plan = system.plan
    if not system.joint:
        return lambda prim, x: state_product(plan, prim, x, adjoint=transposed)
    if transposed:  # (a, b) ↦ (a − ℳ b, ℒ* b)
        def matvec_t(prim, x):
            m = param_adjoint(plan, prim, x[1])
            return jax.tree.map(jnp.subtract, x[0], m), state_product(plan, prim, x[1], adjoint=True)
        return matvec_t
    # (h, Z) ↦ (h, ℒZ − ℳ*h)
    return lambda prim, x: (x[0], param_forward(plan, prim, jax.tree.map(jnp.negative, x[0]),
                                                 state_product(plan, prim, x[1])))


def _apply(fn: Callable, system: System, axes: tuple, leaves: list[Any]) -> list[Any]:
    """``fn(prim, b)`` on flat leaves, vmapped once per batching level (``axes[0]`` outermost)."""
    n = system.prim_tree.num_leaves

    def core(*ls):
        prim = jax.tree.unflatten(system.prim_tree, ls[:n])
        b = jax.tree.unflatten(system.b_tree, ls[n:])
        return jax.tree.leaves(fn(prim, b))

    for level in reversed(axes):
        core = jax.vmap(core, in_axes=level)
    return core(*leaves)


def _impl(*leaves: Any, system: System, transposed: bool, axes: tuple) -> list[Any]:
    with mesh_of(leaves):
        return _apply(_solve_fn(system, transposed), system, axes, list(leaves))


def _abstract(*avals: Any, system: System, transposed: bool, axes: tuple) -> list[Any]:
    if not system.rhs_full:  # x is shaped like b
        return list(avals[system.prim_tree.num_leaves:])
    # compact rows from full ones (forward), or the other way (transposed)
    convert = _layouts(system, transposed)[1 if not transposed else 0]
    shapes = jax.eval_shape(lambda *ls: _apply(lambda prim, b: convert(b), system, axes, list(ls)),
                            *[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals])
    return [a.update(shape=x.shape) for a, x in zip(avals[system.prim_tree.num_leaves:], shapes)]


def _zeros(aval: Any) -> jax.Array:
    return zeros_of(jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=getattr(aval, "sharding", None)))


def _instantiate(t: Any, aval: Any) -> Any:
    return _zeros(aval) if type(t) is ad.Zero else t


def _jvp(primals: tuple, tangents: tuple, *, system: System, transposed: bool, axes: tuple) -> tuple:
    n = system.prim_tree.num_leaves
    params = dict(system=system, transposed=transposed, axes=axes)
    if system.compact and any(type(t) is not ad.Zero and jnp.result_type(t) != jax.dtypes.float0
                              for t in tangents[:n]):
        # The linearisation moves: Ȧ x needs the whole solution x, so the full system's rule.
        full = dataclasses.replace(system, compact=False, rhs_full=False)
        into, back = _layouts(system, transposed)
        convert = functools.partial(_apply, lambda prim, b: into(b), system, axes)
        restore = functools.partial(_apply, lambda prim, x: back(x), full, axes)
        db = [_instantiate(t, jax.typeof(p)) for t, p in zip(tangents[n:], primals[n:])]
        x, dx = _jvp((*primals[:n], *convert(list(primals))), (*tangents[:n], *convert([*primals[:n], *db])),
                     system=full, transposed=transposed, axes=axes)
        return restore([*primals[:n], *x]), restore([*primals[:n], *dx])
    x = solve_p.bind(*primals, **params)
    prim, dprim, db = list(primals[:n]), tangents[:n], tangents[n:]
    moving = [i for i, t in enumerate(dprim)
              if type(t) is not ad.Zero and jnp.result_type(t) != jax.dtypes.float0]
    if not moving and all(type(t) is ad.Zero for t in db):
        return x, [ad.Zero(jax.typeof(v).to_tangent_aval()) for v in x]
    rhs = [_instantiate(t, jax.typeof(p)) for t, p in zip(db, primals[n:])]
    if moving:  # ḃ − Ȧx: the product's derivative along the moving leaves of the linearisation

        def product(*ms):
            leaves = list(prim)
            for i, m in zip(moving, ms):
                leaves[i] = m
            return _apply(_matvec_fn(system, transposed), system, axes, leaves + list(x))

        da_x = jax.jvp(product, [prim[i] for i in moving], [dprim[i] for i in moving])[1]
        rhs = [r - d.astype(r.dtype) for r, d in zip(rhs, da_x)]
    return x, solve_p.bind(*prim, *rhs, **params)


def _transpose(cts: list, *operands: Any, system: System, transposed: bool, axes: tuple) -> list:
    n = system.prim_tree.num_leaves
    if any(ad.is_undefined_primal(p) for p in operands[:n]):
        raise NotImplementedError("linbackprop's solve is linear in its right-hand side only.")
    b = operands[n:]
    avals = [x.aval if ad.is_undefined_primal(x) else jax.typeof(x) for x in operands]
    out_avals = _abstract(*avals, system=system, transposed=transposed, axes=axes)
    cts = [_instantiate(ct, a) for ct, a in zip(cts, out_avals)]
    out = solve_p.bind(*operands[:n], *cts, system=system, transposed=not transposed, axes=axes)
    return [None] * n + [ct if ad.is_undefined_primal(x) else None for x, ct in zip(b, out)]


def _batch(args: tuple, dims: tuple, *, system: System, transposed: bool, axes: tuple) -> tuple:
    n = system.prim_tree.num_leaves
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    moved = [a if d is None else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims)]
    # b (and so x) batched throughout: the transposed solve's cotangents then fit its avals.
    moved[n:] = [a if d is not None else jnp.broadcast_to(a, (size, *np.shape(a)))
                 for a, d in zip(moved[n:], dims[n:])]
    level = tuple(None if d is None else 0 for d in dims[:n]) + (0,) * (len(args) - n)
    out = solve_p.bind(*moved, system=system, transposed=transposed, axes=(level, *axes))
    return out, [0] * len(out)


solve_p = Primitive("linbackprop_solve")
solve_p.multiple_results = True
solve_p.def_impl(_impl)
solve_p.def_abstract_eval(_abstract)


def _lowering(ctx: Any, *args: Any, **params: Any) -> Any:
    # A fresh function per lowering: JAX caches lowered functions weakly keyed on the function and
    # strongly on its parameters, so lowering ``_impl`` itself would keep every plan (and the
    # network and whatever its layers close over) until JAX's LRU evicts it.
    return mlir.lower_fun(functools.partial(_impl, **params), multiple_results=True)(ctx, *args)


mlir.register_lowering(solve_p, _lowering)
ad.primitive_jvps[solve_p] = _jvp
ad.primitive_transposes[solve_p] = _transpose
batching.primitive_batchers[solve_p] = _batch


def solve(plan: Plan, prim: Primal, h: list[Any] | None, rhs: list[Any], variant: SolveVariant) -> list[Any]:
    """Z with ℒ Z = rhs + ℳ* h (without h: ℒ Z = rhs), solved as ``variant`` says (`SolveVariant`,
    decided by `solve_variant`; nothing here decides again): by forward substitution,
    differentiable in (h, rhs) — the transpose is the back substitution, with ℳΛ where the
    variant forms it — and in the linearisation. With ``variant.compact`` Z is in the layout of
    ``plan.compact``, and so is rhs (at its input rows) unless ``variant.rhs_full``."""
    if variant.params is Params.NONE:
        return _bind(System(plan, False, compact=variant.compact), prim, rhs)
    if variant.params is Params.AFTER and not variant.compact:  # ℳ* h before the solve: JAX transposes it
        return _bind(System(plan, False), prim, param_forward(plan, prim, h, rhs))
    system = System(plan, True, compact=variant.compact, rhs_full=variant.rhs_full,
                    carried_back=variant.carried_back, contract_first=variant.contract_first)
    return _bind(system, prim, (h, rhs))[1]


def _bind(system: System, prim: Primal, b: Any) -> Any:
    """``solve_p`` bound on flat leaves, the trees' structures set in ``system``."""
    prim_leaves, prim_tree = jax.tree.flatten(prim)
    b_leaves, b_tree = jax.tree.flatten(b)
    system = dataclasses.replace(system, prim_tree=prim_tree, b_tree=b_tree)
    out = solve_p.bind(*prim_leaves, *b_leaves, system=system, transposed=False, axes=())
    return jax.tree.unflatten(b_tree, out)
