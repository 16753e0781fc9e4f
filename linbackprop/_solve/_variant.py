"""How a network call's linear part is solved: one value, `SolveVariant`, decided once by
`solve_variant` from the plan, the settings and whether the parameters' tangents move, and passed
down to the solve primitive and the engine's sweeps, which do not decide again.

The three places ℳ* h and ℳΛ can be formed (`Params`):

    NONE      ℒ Z = E₀ dU₀                       no parameter tangent: ℳ never applied
    IN_LOOP   [[I, 0], [−ℳ*, ℒ]] (h, Z) = (h, E₀ dU₀)
              ℳ* h formed in the forward loop, ℳΛ accumulated in the back substitution
    AFTER     ℒ Z = ℳ* h + E₀ dU₀ with ℳ* h batched per kind before the loop; reverse mode
              forms ℳΛ after the back substitution as its transpose, batched per kind

and the layouts: ``compact`` (the loop engine: Z only at the rows read again, a chain carrying
Z_i from step to step; the unrolled engine keeps every row as a value XLA drops where unread),
``carried_back`` (AFTER, compact: the back substitution carries Λ in the compact layout, each row
set in a full-layout Λ for ℳΛ) and ``contract_first`` (AFTER, compact: ℳΛ's short contractions
moved last first on CPU). Each threshold is the `Policy`'s.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import jax
import numpy as np

from .._options import Settings
from .._plan import Plan


class Params(enum.Enum):
    """Where ℳ* h (and, in reverse mode, ℳΛ) is formed."""

    NONE = "no parameter tangent"
    IN_LOOP = "in the loops"
    AFTER = "batched per kind, before the forward loop and after the back substitution"


@dataclasses.dataclass(frozen=True)
class SolveVariant:
    """How one network call's linear part is solved (see the module's docstring).

    Attributes:
        params: where ℳ* h and ℳΛ are formed.
        compact: Z, its right-hand side and Λ in the layout of ``plan.compact``.
        carried_back: with ``params`` AFTER and ``compact``: the back substitution carries Λ
            (`Policy.carried_back_pays`).
        contract_first: with ``params`` AFTER and ``compact``: the fewest and most rows whose
            outer products ℳΛ forms with the contracted axis moved last first (None: none;
            `Policy.contract_first_rows`).
    """

    params: Params
    compact: bool
    carried_back: bool = False
    contract_first: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if (self.carried_back or self.contract_first) and not self.rhs_full:
            raise ValueError(f"{self}: carried_back and contract_first apply to ℳ* h formed before a compact loop.")

    @property
    def rhs_full(self) -> bool:
        """ℳ* h formed before the loop inside the solve: its right-hand side read at every row of
        the full layout while Z stays compact."""
        return self.params is Params.AFTER and self.compact


def params_in_loop(plan: Plan, settings: Settings, checkpointed: bool = False) -> bool:
    """Whether ℳΛ is formed in the back substitution for ``plan`` (`Policy.params_in_loop`,
    from the plan's shapes on the default backend)."""
    return settings.policy.params_in_loop(settings.param_products, settings.remat, unrolled=plan.unrolled,
                                          shared=plan.params_shared_by_members,
                                          largest_state=_largest_state(plan), backend=jax.default_backend(),
                                          checkpointed=checkpointed)


def _largest_state(plan: Plan) -> tuple[int, int]:
    """(elements, rows) of the largest state of any kind (rows: of its largest leaf, the elements
    over the last axis)."""
    def size(a: Any) -> int:
        return int(np.prod(a.shape))

    leaves = max((jax.tree.leaves(k.out_aval) for k in plan.kinds), key=lambda ls: sum(map(size, ls)))
    leaf = max(leaves, key=size)
    return sum(map(size, leaves)), size(leaf) // leaf.shape[-1] if leaf.shape and leaf.shape[-1] else 1


def solve_variant(plan: Plan, settings: Settings, moves_params: bool) -> SolveVariant:
    """The variant for a call of ``plan`` in solve mode with ``settings``: the only place it is
    decided. ``moves_params``: some parameter tangent is not a symbolic zero."""
    compact = not plan.unrolled
    if not moves_params:
        return SolveVariant(Params.NONE, compact)
    if (params_in_loop(plan, settings, settings.segments)
            and all(g.differentiable for g in plan.param_groups)):
        return SolveVariant(Params.IN_LOOP, compact)
    if not compact:
        return SolveVariant(Params.AFTER, False)
    policy = settings.policy
    return SolveVariant(Params.AFTER, True,
                        carried_back=policy.carried_back_pays(plan.compact.state_elements, plan.state_elements),
                        contract_first=policy.contract_first_rows(jax.default_backend()))
