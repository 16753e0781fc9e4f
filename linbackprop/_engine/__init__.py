"""The engine: forward pass, forward and back substitution, and the block-sparse products.

Vectors of 𝒰 are lists of state-layout buffers (one stacked pytree per group of same-shaped
states, network inputs included); vectors of Θ are lists of parameter-layout buffers.
Network inputs are rows of ℒ with the identity and nothing else, so the same solve also
yields the cotangents (or takes the tangents) of the inputs.

The substitutions are ``lax.fori_loop`` over the topologically ordered layers (or the same body
unrolled with static indices, for shallow networks: ``Plan.unrolled``). The body switches over
*kinds* of layer (not layers), every branch returns only the current layer's small results, and
every write into a large buffer happens outside the switch: a branch that updated a buffer would
make XLA copy it on every step. Kinds share write *slots* (``Plan.writes``): per buffer, a step
writes as many rows as the kind that writes most there; inactive slots write zeros into a pad row
(or add zeros). Stored residuals of all kinds share buffers by shape and dtype.

ℳΛ is formed after the back substitution by default: for all layers of a kind at once, vmapped
over the stacked residuals — one batched product per kind instead of one small one per layer
(reverse mode gets it as JAX's transpose of the batched ℳ*h of the forward rule). Inside the loop
(``back_substitution(..., grads=...)``) is the alternative.

Modules, lowest first: `_rows` (the stored forward pass, buffer rows, loop indices), `_loop`
(the loop driver and a step's arguments), `_maps` (one layer's block maps), `_sweeps` (the
forward pass and both substitutions), `_products` (the batched products per kind),
`_per_example` (ℳΛ split by example, the GGN diagonal's squares, the K-FAC factors, from
`_outer_products`, `_outer_factors` and `_patches`: a convolution's kernel cotangent as patches
times the output cotangent).
"""

from ._contractions import contracted_last
from ._maps import LayerMaps, layer_maps
from ._outer_products import (
    OuterTerms,
    Products,
    depending,
    squared_norms,
    squared_norms_and_products,
    weighted_square_sum,
)
from ._per_example import (
           ParamFactors,
           ParamSquares,
           exclusive_groups,
           member_vjp,
           param_adjoint_per_example,
           param_kinds,
           tangent_leaves,
)
from ._products import param_adjoint, param_forward, state_product
from ._rows import Primal, at_inputs, read_row, read_rows, scatter_add, take_rows, without_pad
from ._sweeps import back_substitution, forward, forward_substitution

__all__ = [
    "LayerMaps",
    "OuterTerms",
    "ParamFactors",
    "ParamSquares",
    "Primal",
    "Products",
    "at_inputs",
    "back_substitution",
    "contracted_last",
    "depending",
    "exclusive_groups",
    "forward",
    "forward_substitution",
    "layer_maps",
    "member_vjp",
    "param_adjoint",
    "param_adjoint_per_example",
    "param_forward",
    "param_kinds",
    "read_row",
    "read_rows",
    "scatter_add",
    "squared_norms",
    "squared_norms_and_products",
    "state_product",
    "take_rows",
    "tangent_leaves",
    "weighted_square_sum",
    "without_pad",
]
