"""`InForwardSweep`: ``jvp_by_solve`` alone, whose tangents are never transposed. The forward
substitution ℒ Z = ℳ* h + E₀ dU₀ runs inside the forward sweep — each layer's JVP where the layer
runs — so nothing is stored and no solve primitive is bound: there is no transpose to give.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .._engine import forward
from .._options import Settings
from ._boundary import input_tangents, instantiate, output_tangents, outputs_of
from ._variant import SolveVariant


@dataclasses.dataclass(frozen=True, repr=False)
class InForwardSweep(SolveVariant):
    """The forward substitution fused into the forward sweep (see the module's docstring).

    Attributes:
        moves_params: some parameter tangent is not a symbolic zero (ℳ* h formed in the sweep).
    """

    moves_params: bool = False

    def jvp(self, theta: dict, inputs: tuple, dtheta: dict, dinputs: tuple,
            settings: Settings) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        plan = self.plan.compact
        net = plan.net
        h = plan.pack_params(instantiate(dtheta), tangent=True) if self.moves_params else None
        prim, z = forward(plan, plan.pack_params(theta), plan.pack_states(dict(zip(net.inputs, inputs))),
                          residuals=False, tangents=(h, input_tangents(plan, dinputs)))
        return outputs_of(plan, prim.states), output_tangents(plan, z)
