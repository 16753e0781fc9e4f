"""`ParamsBefore`: the unrolled engine's solve with parameter tangents,

    ℒ Z = ℳ* h + E₀ dU₀,   ℳ* h batched per kind before the solve,

bound as the solve of the states alone (`StatesOnly`'s, in the full layout); its transpose — ℳΛ
after the back substitution, batched per kind — is JAX's transpose of that product. (An unrolled
solve has little to batch in its loop: `Policy.params_in_loop`.)
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from .._engine import Primal, param_forward
from ._primitive import held_weakly_by_jax_caches
from ._states_only import StatesOnly


@held_weakly_by_jax_caches
@dataclasses.dataclass(frozen=True, repr=False)
class ParamsBefore(StatesOnly):
    """ℒ Z = ℳ* h + E₀ dU₀ with ℳ* h formed before the full layout's solve of the states (see the
    module's docstring): `StatesOnly`'s solve and products, its right-hand side moved by h."""

    moves_params: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.compact:
            raise ValueError(f"{self!r}: ℳ* h is formed before the loop only in the full layout (ParamsAfter "
                             "forms it inside a compact solve).")

    def bind(self, prim: Primal, h: list[Any] | None, rhs: list[Any]) -> list[Any]:
        return super().bind(prim, None, param_forward(self.plan, prim, h, rhs))
