"""`ParamsBefore`: the unrolled engine's solve with parameter tangents,

    ℒ Z = ℳ* h + E₀ dU₀,   ℳ* h batched per kind before the solve,

bound as the solve of the states alone; its transpose — ℳΛ after the back substitution, batched
per kind — is JAX's transpose of that product. (An unrolled solve has little to batch in its
loop: `Policy.params_in_loop`.)
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from .._engine import Primal, param_forward
from ._primitive import held_weakly_by_jax_caches
from ._states_only import StatesOnly
from ._variant import StoredSolve


@held_weakly_by_jax_caches
@dataclasses.dataclass(frozen=True, repr=False)
class ParamsBefore(StoredSolve):
    """ℒ Z = ℳ* h + E₀ dU₀ with ℳ* h formed before a full-layout solve (see the module's
    docstring). Its solve and products are the full layout's `StatesOnly`'s."""

    moves_params: ClassVar[bool] = True

    def solve(self, prim: Primal, b: Any, transposed: bool) -> Any:
        return self._states().solve(prim, b, transposed)

    def product(self, prim: Primal, x: Any, transposed: bool) -> Any:
        return self._states().product(prim, x, transposed)

    def bind(self, prim: Primal, h: list[Any] | None, rhs: list[Any]) -> list[Any]:
        return self._states().bind(prim, None, param_forward(self.plan, prim, h, rhs))

    def _states(self) -> StatesOnly:
        return StatesOnly(self.plan, self.prim_tree, self.b_tree)
