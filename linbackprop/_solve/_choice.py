"""`solve_variant`: the one place that decides how a network call's linear part is solved — the
`SolveVariant` from the plan (its engine), the settings (forward only, where ℳΛ is formed, the
`Policy`'s thresholds) and whether the parameters' tangents move.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from .._options import Settings
from .._plan import Plan
from ._in_forward_sweep import InForwardSweep
from ._params_after import ParamsAfter
from ._params_before import ParamsBefore
from ._params_in_loop import ParamsInLoop
from ._states_only import StatesOnly
from ._variant import SolveVariant


def solve_variant(plan: Plan, settings: Settings, moves_params: bool) -> SolveVariant:
    """The variant for a call of ``plan`` with ``settings``. ``moves_params``: some parameter
    tangent is not a symbolic zero."""
    if settings.forward_only:
        return InForwardSweep(plan, moves_params)
    compact = not plan.unrolled
    if not moves_params:
        return StatesOnly(plan, compact=compact)
    if (_params_in_loop(plan, settings, settings.segments)
            and all(g.differentiable for g in plan.param_groups)):
        return ParamsInLoop(plan, compact=compact)
    if not compact:
        return ParamsBefore(plan)
    policy = settings.policy
    return ParamsAfter(plan, carried_back=policy.carried_back_pays(plan.compact.state_elements, plan.state_elements),
                       contract_first=policy.contract_first_rows(jax.default_backend()))


def _params_in_loop(plan: Plan, settings: Settings, checkpointed: bool = False) -> bool:
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
