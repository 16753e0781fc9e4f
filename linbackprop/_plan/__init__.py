"""The static layout of a network at given shapes: buffers, kinds of layer, index tables.

The solve runs one ``lax.fori_loop`` step per layer. To keep the compiled program independent of
depth, layers are grouped into *kinds* (same function, same parameter and input shapes): the loop
body holds one branch per kind, not per layer. Same-shaped states (and parameter blocks) are
stacked into one buffer per *group*, and static integer tables say, for every step, which kind
runs, which rows of which buffers it reads, and where its results go.

Each kind is linearised once abstractly (``jax.eval_shape`` of ``jax.vjp``) to learn the pytree
structure of its residuals. Residuals that are the layer's own arguments verbatim (weights,
input states) are not stored again: they are re-read from the parameter and state buffers.

Modules, lowest first: `_groups` (buffers), `_residuals` (what a kind stores), `_kinds`
(kinds, rows, write slots), `_schedule` (the loop rule and segments), `_layout` (`Plan`),
`_make` (making and caching plans).
"""

from ._groups import (
           Aval,
           Group,
           RowList,
           as_dtype,
           differentiable_dtype,
           dtype_key,
           float0_zeros,
           leaf_aval,
           weakly_typed,
)
from ._kinds import Family, Forwarding, Kind, MemberRows, Same, StepRows, Sweep, Writes, function_key, make_writes
from ._layout import Plan
from ._make import current_plan, make_plan, plan_for, plans_generation
from ._residuals import CHEAP_PRIMITIVES, MAX_RECIPE_DEPTH, Recipe, Source, analyse_kind, avals_of, rebuilt_vjp
from ._schedule import periodic_segments, straight_line_kinds

__all__ = ["CHEAP_PRIMITIVES", "MAX_RECIPE_DEPTH", "Aval",
           "Family", "Forwarding", "Group", "Kind", "MemberRows", "Plan", "Recipe", "RowList", "Same",
           "Source", "StepRows", "Sweep", "Writes", "analyse_kind", "as_dtype", "avals_of", "current_plan",
           "differentiable_dtype",
           "dtype_key", "float0_zeros", "function_key", "leaf_aval", "make_plan", "make_writes",
           "periodic_segments", "plan_for", "plans_generation", "rebuilt_vjp", "straight_line_kinds", "weakly_typed"]
