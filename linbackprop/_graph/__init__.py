"""The network as a graph, and the arrays it is stored in.

Modules, lowest first: `_buffers` (rows into and out of stacked buffers, one XLA kernel however
many rows; the buffers' shardings), `_layer` (a layer, a row of a stacked block or input, how a
layer is called), `_network` (`Network`: validation, topological order, the plain forward
substitution U = Φ(U, θ), and ``__call__``, which reads how to run from `_options`),
`_block_text` (a block pattern as text), `_in_turn` (LAPACK calls one after another) and
`_example_flow` (which example each value of a program reads: the proof that examples stay
apart) and `_jaxprs` (a layer's jaxpr text and constants: what a plan is checked against to find it stale;
the one jaxpr evaluator), and `_laplacian` (a Network lifted to (U, ∇U, ΔU): the forward
Laplacian, a network transformed into another).
"""

from ._block_text import block_matrix_text
from ._buffers import (
    explicit_sharding,
    index_row,
    mesh_of,
    place,
    replicated_result,
    sharded_as,
    stack_trees,
    take,
    under_vmap,
    update_row,
    zeros_of,
)
from ._example_codes import FREE, MIXED, SUMMED, describe, row_codes
from ._example_flow import Flow, example_flow, scan_counts
from ._in_turn import in_turn
from ._jaxprs import (
    Constant,
    bind_equation,
    computation_of,
    dependents,
    evaluate,
    needed_equations,
    random_values,
    read,
    run_equations,
)
from ._laplacian import forward_laplacian
from ._layer import (
    GraphError,
    Layer,
    Row,
    Stack,
    block_of,
    call_layer,
    check_array_leaves,
    label,
    layer_theta,
    not_an_array,
    resolve,
)
from ._network import Network, stack_states

__all__ = [
    "FREE",
    "MIXED",
    "SUMMED",
    "Constant",
    "Flow",
    "GraphError",
    "Layer",
    "Network",
    "Row",
    "Stack",
    "bind_equation",
    "block_matrix_text",
    "block_of",
    "call_layer",
    "check_array_leaves",
    "computation_of",
    "dependents",
    "describe",
    "evaluate",
    "example_flow",
    "explicit_sharding",
    "forward_laplacian",
    "in_turn",
    "index_row",
    "label",
    "layer_theta",
    "mesh_of",
    "needed_equations",
    "not_an_array",
    "place",
    "random_values",
    "read",
    "replicated_result",
    "resolve",
    "row_codes",
    "run_equations",
    "scan_counts",
    "sharded_as",
    "stack_states",
    "stack_trees",
    "take",
    "under_vmap",
    "update_row",
    "zeros_of",
]
