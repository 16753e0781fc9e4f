"""The substitutions as one linear-solve primitive of linbackprop's own.

    x = A⁻¹ b,   A = ℒ (forward substitution) or ℒ* (back substitution, ``transposed``),
    or, for the joint system, A = [[I, 0], [−ℳ*, ℒ]] on (h, Z) and its transpose [[I, −ℳ], [0, ℒ*]]

bound on the leaves of the stored linearisation (``Primal``) and of b, parametrised by the call's
`SolveVariant` (a `StoredSolve`), which holds the solve, its transpose and the product A x. Its rules:

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

from .._engine import Primal
from .._graph import mesh_of, zeros_of
from ._variant import StoredSolve


def held_weakly_by_jax_caches(cls: type) -> type:
    """Let JAX's caches that are keyed on primitive parameters (the abstract evaluation of every
    bind) hold a `StoredSolve` weakly, as they hold jaxprs: an entry then goes when the last
    jaxpr using the variant goes, instead of keeping its plan — the network and whatever its
    layers close over — until JAX's LRU evicts it. Without the private registry, memory is bounded
    by that LRU. (JAX compares exact types: each variant class registers.)"""
    try:
        from jax._src.util import weakref_cache_key_types
    except ImportError:  # pragma: no cover - another JAX layout
        return cls
    weakref_cache_key_types.add(cls)
    return cls


def _apply(fn: Callable, variant: StoredSolve, axes: tuple, leaves: list[Any]) -> list[Any]:
    """``fn(prim, b)`` on flat leaves, vmapped once per batching level (``axes[0]`` outermost)."""
    n = variant.prim_tree.num_leaves

    def core(*ls):
        prim = jax.tree.unflatten(variant.prim_tree, ls[:n])
        b = jax.tree.unflatten(variant.b_tree, ls[n:])
        return jax.tree.leaves(fn(prim, b))

    for level in reversed(axes):
        core = jax.vmap(core, in_axes=level)
    return core(*leaves)


def _impl(*leaves: Any, variant: StoredSolve, transposed: bool, axes: tuple) -> list[Any]:
    with mesh_of(leaves):
        return _apply(functools.partial(variant.solve, transposed=transposed), variant, axes, list(leaves))


def _abstract(*avals: Any, variant: StoredSolve, transposed: bool, axes: tuple) -> list[Any]:
    if not variant.reshapes(transposed):  # x is shaped like b
        return list(avals[variant.prim_tree.num_leaves:])
    # compact rows from full ones (forward), or the other way (transposed)
    convert = variant.layouts(transposed)[1 if not transposed else 0]
    shapes = jax.eval_shape(lambda *ls: _apply(lambda prim, b: convert(b), variant, axes, list(ls)),
                            *[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals])
    return [a.update(shape=x.shape) for a, x in zip(avals[variant.prim_tree.num_leaves:], shapes)]


def _zeros(aval: Any) -> jax.Array:
    return zeros_of(jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=getattr(aval, "sharding", None)))


def _instantiate(t: Any, aval: Any) -> Any:
    return _zeros(aval) if type(t) is ad.Zero else t


def _jvp(primals: tuple, tangents: tuple, *, variant: StoredSolve, transposed: bool, axes: tuple) -> tuple:
    n = variant.prim_tree.num_leaves
    params = dict(variant=variant, transposed=transposed, axes=axes)
    full = variant.in_full_layout()
    if full is not None and any(type(t) is not ad.Zero and jnp.result_type(t) != jax.dtypes.float0
                                for t in tangents[:n]):
        # The linearisation moves: Ȧ x needs the whole solution x, so the full system's rule.
        full = dataclasses.replace(full, prim_tree=variant.prim_tree, b_tree=variant.b_tree)
        into, back = variant.layouts(transposed)
        convert = functools.partial(_apply, lambda prim, b: into(b), variant, axes)
        restore = functools.partial(_apply, lambda prim, x: back(x), full, axes)
        db = [_instantiate(t, jax.typeof(p)) for t, p in zip(tangents[n:], primals[n:])]
        x, dx = _jvp((*primals[:n], *convert(list(primals))), (*tangents[:n], *convert([*primals[:n], *db])),
                     variant=full, transposed=transposed, axes=axes)
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
            return _apply(functools.partial(variant.product, transposed=transposed), variant, axes,
                          leaves + list(x))

        da_x = jax.jvp(product, [prim[i] for i in moving], [dprim[i] for i in moving])[1]
        rhs = [r - d.astype(r.dtype) for r, d in zip(rhs, da_x)]
    return x, solve_p.bind(*prim, *rhs, **params)


def _transpose(cts: list, *operands: Any, variant: StoredSolve, transposed: bool, axes: tuple) -> list:
    n = variant.prim_tree.num_leaves
    if any(ad.is_undefined_primal(p) for p in operands[:n]):
        raise NotImplementedError("linbackprop's solve is linear in its right-hand side only.")
    b = operands[n:]
    avals = [x.aval if ad.is_undefined_primal(x) else jax.typeof(x) for x in operands]
    out_avals = _abstract(*avals, variant=variant, transposed=transposed, axes=axes)
    cts = [_instantiate(ct, a) for ct, a in zip(cts, out_avals)]
    out = solve_p.bind(*operands[:n], *cts, variant=variant, transposed=not transposed, axes=axes)
    return [None] * n + [ct if ad.is_undefined_primal(x) else None for x, ct in zip(b, out)]


def _batch(args: tuple, dims: tuple, *, variant: StoredSolve, transposed: bool, axes: tuple) -> tuple:
    n = variant.prim_tree.num_leaves
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    moved = [a if d is None else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims)]
    # b (and so x) batched throughout: the transposed solve's cotangents then fit its avals.
    moved[n:] = [a if d is not None else jnp.broadcast_to(a, (size, *np.shape(a)))
                 for a, d in zip(moved[n:], dims[n:])]
    level = tuple(None if d is None else 0 for d in dims[:n]) + (0,) * (len(args) - n)
    out = solve_p.bind(*moved, variant=variant, transposed=transposed, axes=(level, *axes))
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


def bind(variant: StoredSolve, prim: Primal, b: Any) -> Any:
    """``solve_p`` bound on flat leaves: x = A⁻¹ b for ``variant``'s A, the trees' structures set
    in the variant it is parametrised by."""
    prim_leaves, prim_tree = jax.tree.flatten(prim)
    b_leaves, b_tree = jax.tree.flatten(b)
    variant = dataclasses.replace(variant, prim_tree=prim_tree, b_tree=b_tree)
    out = solve_p.bind(*prim_leaves, *b_leaves, variant=variant, transposed=False, axes=())
    return jax.tree.unflatten(b_tree, out)
