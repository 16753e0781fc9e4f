"""The solve stage: a Network call differentiated by ℒ Z = ℳ* h + E₀ dU₀ and its transpose, and the
transforms that enter it.

Modules, lowest first: `_segments` (where a checkpointed call cuts), `_checkpoint` (checkpointed
calls), `_memory_model` (what a call keeps: where ℳΛ is formed, how many checkpoint levels pay),
`_primitive` (the solve as a JAX primitive with its JVP, transpose and batching rules), `_call`
(`network_call`: the custom JVP per network, the forward pass and the right-hand side) and
`_transforms` (`grad_by_solve`, `value_and_grad_by_solve`, `jvp_by_solve`, `solve_mode`: JAX's
transforms with `network_call` named the solver of every Network call).
"""

from ._call import output_tangents, outputs_of, prepare, stored_tangents
from ._transforms import grad_by_solve, jvp_by_solve, solve_mode, value_and_grad_by_solve

__all__ = [
    "grad_by_solve", "jvp_by_solve", "output_tangents", "outputs_of", "prepare", "solve_mode", "stored_tangents",
    "value_and_grad_by_solve",
]
