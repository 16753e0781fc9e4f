"""Each example's gradient against given directions, without the gradients: the ghost inner
products ⟨v, ∇ℓ_b⟩ an influence score is made of.

With Λ the adjoints of Σ_b ℓ_b (one back substitution; row b of every state is example b's) and
ℳ* v the parameter tangent's right-hand side (row i: ∂Φ_i/∂θ v, every layer on its own stored
linearisation, no substitution),

    ⟨v, ∇ℓ_b⟩ = ⟨v, Σ_i (∂Φ_i/∂θ)* Λ_i[b]⟩ = Σ_i ⟨(∂Φ_i/∂θ v)[b], Λ_i[b]⟩

— for a dense layer Σ_t a_tᵀ V δ_t, for a convolution the same over its patches, for a weight
shared along a sequence a sum over its uses: the per-example gradient is never formed, only
one state-shaped tangent per direction.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .._capture import rewrite
from .._engine import param_forward
from .._options import Engine
from .._plan import RowList
from ._examples import per_example_setup
from ._per_example import direct_reads
from ._split import flat_result, normalise_argnums


def per_example_products(fun: Callable, argnums: int | Sequence[int] = 0, *, engine: Engine = "auto",
                         layers: Any = None) -> Callable:
    """``run(directions, *args)`` -> (Q, B): ⟨v_q, ∇ℓ_b⟩ for per-example losses ``fun(*args)``
    (B,) and ``directions`` shaped like the gradient (per argument ``argnums`` names, a tuple of
    them for several) with a leading axis Q — ``directions · per_example_grads(fun)(*args)ᵀ``
    without the per-example gradients. The losses must read the arguments only through their
    network calls, of one batch (else a ``ValueError`` names the way that forms them)."""
    nums, single = normalise_argnums(argnums)
    if layers is not None:
        def run_model(directions: Any, *args: Any) -> jax.Array:
            found = rewrite(fun, args, nums, layers, per_example="influence's scores (by='ghost')")
            given = (directions,) if single else tuple(directions)
            leaves = tuple(list(a.leaves_of(d)) for a, d in zip(found.arguments, given))
            inner = per_example_products(flat_result(found.fun), tuple(range(len(nums))), engine=engine)
            return inner(leaves, *found.args)

        return run_model

    def run(directions: Any, *args: Any) -> jax.Array:
        split, calls, losses, batch, lams = per_example_setup(fun, args, nums, engine)
        if calls.spans is not None or any(direct_reads(split, calls, losses)):
            raise ValueError("scores(by='ghost'): the losses read the parameters outside their network calls, or "
                             "call networks of different batches; use by='gradients' (each example's gradient "
                             "formed, a chunk at a time).")
        given = (directions,) if single else tuple(directions)

        def one(direction: tuple) -> jax.Array:
            thetas = jax.linear_transpose(calls.vjp, calls.thetas)(direction)[0]  # each call's blocks
            total = jnp.zeros((batch,), jnp.result_type(*jax.tree.leaves(direction)))
            for plan, prim, theta, lam in zip(calls.plans, calls.stored, thetas, lams):
                into = [group.zeros(plan.unrolled, tangent=True) for group in plan.state_groups]
                tangent = param_forward(plan, prim, plan.pack_params(theta, tangent=True), into)
                for z, adjoint in zip(tangent, lam):
                    if z is None or adjoint is None:
                        continue
                    rows = isinstance(z, RowList)  # one array per row, [B, ...]; else stacked, [rows, B, ...]
                    for a, b in zip(jax.tree.leaves(z), jax.tree.leaves(adjoint)):
                        others = tuple(range(1, a.ndim)) if rows else (0, *range(2, a.ndim))
                        total = total + jnp.sum(a * b, axis=others).astype(total.dtype)
            return total

        return jax.vmap(one)(given)

    return run
