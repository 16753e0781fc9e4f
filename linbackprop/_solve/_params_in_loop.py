"""`ParamsInLoop`: the joint system over (h, Z), ℳ* h formed in the forward loop and ℳΛ
accumulated in the back substitution, from the same linearisation of each layer:

    [[I, 0], [−ℳ*, ℒ]] (h, Z) = (h, E₀ dU₀),   transposed   [[I, −ℳ], [0, ℒ*]] (ḡ, Λ) = (gh, gz).

Chosen where forming ℳΛ after the loop would not pay (`Policy.params_in_loop`): with ``remat``,
unrolled, blocks shared by a kind's members, or small states. It keeps no Λ beyond the step's: the
memory model counts it at its least as the states and the residuals.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from .._engine import Primal, back_substitution, forward_substitution, param_adjoint, param_forward, state_product
from .._plan import Plan
from ._primitive import bind, held_weakly_by_jax_caches
from ._variant import StoredSolve, compact_layouts


def joint_product(plan: Plan, prim: Primal, x: Any, transposed: bool) -> Any:
    """(h, Z) ↦ (h, ℒZ − ℳ*h); transposed, (a, b) ↦ (a − ℳ b, ℒ* b)."""
    if transposed:
        m = param_adjoint(plan, prim, x[1])
        return jax.tree.map(jnp.subtract, x[0], m), state_product(plan, prim, x[1], adjoint=True)
    return x[0], param_forward(plan, prim, jax.tree.map(jnp.negative, x[0]), state_product(plan, prim, x[1]))


@held_weakly_by_jax_caches
@dataclasses.dataclass(frozen=True, repr=False)
class ParamsInLoop(StoredSolve):
    """The joint system, ℳ* h and ℳΛ in the loops (see the module's docstring).

    Attributes:
        compact: Z in the layout of ``plan.compact`` (the loop engine).
    """

    compact: bool = False

    joint: ClassVar[bool] = True
    moves_params: ClassVar[bool] = True

    def solve(self, prim: Primal, b: Any, transposed: bool) -> Any:
        if transposed:  # Λ by back substitution, ḡ = gh + ℳΛ
            lam, grads = back_substitution(self.plan, prim, b[1], grads=b[0], compact=self.compact,
                                             every_row=False)
            return grads, lam
        return b[0], forward_substitution(self.plan, prim, b[1], h=b[0], compact=self.compact,
                                          rhs_full=False)

    def product(self, prim: Primal, x: Any, transposed: bool) -> Any:
        return joint_product(self.plan, prim, x, transposed)

    def in_full_layout(self) -> ParamsInLoop | None:
        return ParamsInLoop(self.plan) if self.compact else None

    def layouts(self, transposed: bool) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
        return compact_layouts(self, transposed)

    def least_kept(self, states: int, residuals: int) -> int:
        # Λ goes from step to step: no row of it kept beyond the step's
        return states + residuals

    def bind(self, prim: Primal, h: list[Any] | None, rhs: list[Any]) -> list[Any]:
        return bind(self, prim, (h, rhs))[1]
