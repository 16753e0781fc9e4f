"""`ParamsAfter`: the loop engine's joint system with ℳ* h batched per kind before a compact
loop and ℳΛ after the back substitution, batched per kind:

    b = (h, rhs),   x = (h, P ℒ⁻¹ (rhs + ℳ* h)),   rhs in the full layout, read at every row.

Its transpose solves ℒ* Λ = Pᵀ ḡ for Λ at every row of the full layout — ``carried_back``: in
the compact layout, carrying Λ from step to step and setting each carried row of a full-layout
Λ once it is complete (`Policy.carried_back_pays`); else in the full layout — then forms ℳΛ,
its products of short contractions (``contract_first``: from, to rows; None: none) computed with
the contracted axes moved last first (`Policy.contract_first_rows`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from .._engine import (
    Primal,
    back_substitution,
    contracted_last,
    forward_substitution,
    param_adjoint,
    param_forward,
    take_rows,
    without_pad,
)
from .._plan import Plan
from ._params_in_loop import ParamsInLoop, joint_product
from ._primitive import bind, held_weakly_by_jax_caches
from ._variant import StoredSolve, compact_layouts


@held_weakly_by_jax_caches
@dataclasses.dataclass(frozen=True, repr=False)
class ParamsAfter(StoredSolve):
    """The joint system, ℳ* h and ℳΛ batched outside a compact loop (see the module's docstring).

    Attributes:
        carried_back: the transpose's back substitution carries Λ in the compact layout.
        contract_first: the fewest and most rows whose outer products ℳΛ forms with the
            contracted axis moved last first (None: none).
    """

    carried_back: bool = False
    contract_first: tuple[int, int] | None = None

    joint: ClassVar[bool] = True
    moves_params: ClassVar[bool] = True

    @property
    def compact(self) -> bool:
        return True

    @property
    def rhs_layout(self) -> Plan:
        return self.plan  # ℳ* h at every row

    def _extra(self) -> str:
        return super()._extra() + ", rhs full" + (", carried back" if self.carried_back else "")

    def solve(self, prim: Primal, b: Any, transposed: bool) -> Any:
        plan = self.plan
        if not transposed:
            return b[0], forward_substitution(plan, prim, param_forward(plan, prim, b[0], b[1]), h=None,
                                              compact=True, rhs_full=True)
        lam = self._lambda_at_every_row(prim, b[1])
        adjoint = functools.partial(param_adjoint, plan, prim)
        if self.contract_first:
            adjoint = contracted_last(adjoint, *self.contract_first)
        return [jax.tree.map(jnp.add, a, m) for a, m in zip(b[0], adjoint(lam))], lam

    def _lambda_at_every_row(self, prim: Primal, g: list[Any]) -> list[Any]:
        """ℒ⁻* Pᵀ g: Λ at every row of the full layout."""
        if self.carried_back:
            return back_substitution(self.plan, prim, g, grads=None, compact=True, every_row=True)
        zplan = self.plan.compact  # Pᵀ g (the pad row is no row of the solution), then the full layout's
        return back_substitution(self.plan, prim, take_rows(without_pad(zplan, g), zplan.to_compact), grads=None,
                                 compact=False, every_row=False)

    def product(self, prim: Primal, x: Any, transposed: bool) -> Any:
        return joint_product(self.plan, prim, x, transposed)

    def in_full_layout(self) -> ParamsInLoop:
        return ParamsInLoop(self.plan)

    def layouts(self, transposed: bool) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
        return compact_layouts(self, transposed, rhs_full=True)

    def reshapes(self, transposed: bool) -> bool:
        return True  # compact rows from full ones (forward), or the other way (transposed)

    def bind(self, prim: Primal, h: list[Any] | None, rhs: list[Any]) -> list[Any]:
        return bind(self, prim, (h, rhs))[1]
