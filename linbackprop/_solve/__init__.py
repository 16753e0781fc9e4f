"""The solve stage: a Network call differentiated by ℒ Z = ℳ* h + E₀ dU₀ and its transpose, and the
transforms that enter it.

Modules, lowest first: `_segments` (where a checkpointed call cuts), `_checkpoint` (checkpointed
calls), `_boundary` (the stored forward pass, the inputs' tangents on their rows, the outputs read
from theirs), `_variant` (`SolveVariant`, `StoredSolve`: how a call's linear part is solved, as an
object), `_primitive` (the solve as a JAX primitive parametrised by that object, with its JVP,
transpose and batching rules), one module per variant (`_states_only`, `_params_before`,
`_params_in_loop`, `_params_after`, `_in_forward_sweep`), `_choice` (`solve_variant`, where the
variant is decided), `_memory_model` (what a call keeps: how many checkpoint levels pay), `_call`
(`network_call`: the custom JVP per network whose rule runs the variant) and `_transforms`
(`grad_by_solve`, `value_and_grad_by_solve`, `jvp_by_solve`, `solve_mode`: JAX's transforms with
`network_call` named the solver of every Network call).
"""

from ._boundary import output_tangents, outputs_of, prepare
from ._call import stored_tangents
from ._transforms import grad_by_solve, jvp_by_solve, solve_mode, value_and_grad_by_solve

__all__ = [
    "grad_by_solve", "jvp_by_solve", "output_tangents", "outputs_of", "prepare", "solve_mode", "stored_tangents",
    "value_and_grad_by_solve",
]
