"""`StatesOnly`: a call whose parameters' tangents are all zero (a gradient with respect to the
inputs alone, a JVP along the inputs):

    ℒ Z = E₀ dU₀     by forward substitution;   transposed, ℒ* Λ = 𝒫* ḡ by back substitution.

ℳ is never applied. With ``compact`` (the loop engine) Z keeps only the rows read again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from .._engine import Primal, back_substitution, forward_substitution, state_product
from ._primitive import bind, held_weakly_by_jax_caches
from ._variant import StoredSolve, compact_layouts


@held_weakly_by_jax_caches
@dataclasses.dataclass(frozen=True, repr=False)
class StatesOnly(StoredSolve):
    """ℒ Z = E₀ dU₀ (see the module's docstring).

    Attributes:
        compact: Z in the layout of ``plan.compact`` (the loop engine).
    """

    compact: bool = False

    def solve(self, prim: Primal, b: Any, transposed: bool) -> Any:
        if transposed:
            return back_substitution(self.plan, prim, b, grads=None, compact=self.compact, every_row=False)
        return forward_substitution(self.plan, prim, b, h=None, compact=self.compact, rhs_full=False)

    def product(self, prim: Primal, x: Any, transposed: bool) -> Any:
        return state_product(self.plan, prim, x, adjoint=transposed)

    def in_full_layout(self) -> StatesOnly | None:
        return StatesOnly(self.plan) if self.compact else None

    def layouts(self, transposed: bool) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
        return compact_layouts(self, transposed)

    def bind(self, prim: Primal, h: list[Any] | None, rhs: list[Any]) -> list[Any]:
        return bind(self, prim, rhs)
