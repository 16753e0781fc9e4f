"""linbackprop: gradients of neural networks as the solution of a sparse, unit lower block
triangular linear system.

    ℒ Z = ℳ* h        (forward mode: forward substitution)
    ℒ* Λ = ∇_Uℓ,  ∇_θJ = ℳ Λ + ∇_θℓ     (reverse mode: back substitution)

with ℒ = I − D_UΦ and ℳ* = D_θΦ for a network U = Φ(U, θ) given as a DAG of layers.
"""

from ._capture import Capture, capture, layer
from ._curvature import (
                         BiasOf,
                         GaussNewton,
                         Kronecker,
                         clipped_grad,
                         diag_ggn,
                         gauss_newton,
                         ggn_factor,
                         kfac_factors,
                         per_example_grad_norms,
                         per_example_grads,
)
from ._frameworks import Functional, functional
from ._graph import GraphError, Layer, Network, Row, Stack, forward_laplacian
from ._influence import Influence, InfluenceFit, influence
from ._operators import Block, Linearization, LinearOperator, ParamOperator, StateOperator, linearize
from ._optim import KfacState, kfac, scale_by_gauss_newton, scale_by_kfac
from ._options import solving
from ._pictures import plot_network, spy
from ._solve import grad_by_solve, jvp_by_solve, value_and_grad_by_solve

__version__ = "0.1.0"

__all__ = [
                         "BiasOf",
                         "Block",
                         "Capture",
                         "Functional",
                         "GaussNewton",
                         "GraphError",
                         "Influence",
                         "InfluenceFit",
                         "KfacState",
                         "Kronecker",
                         "Layer",
                         "LinearOperator",
                         "Linearization",
                         "Network",
                         "ParamOperator",
                         "Row",
                         "Stack",
                         "StateOperator",
                         "capture",
                         "clipped_grad",
                         "diag_ggn",
                         "forward_laplacian",
                         "functional",
                         "gauss_newton",
                         "ggn_factor",
                         "grad_by_solve",
                         "influence",
                         "jvp_by_solve",
                         "kfac",
                         "kfac_factors",
                         "layer",
                         "linearize",
                         "per_example_grad_norms",
                         "per_example_grads",
                         "plot_network",
                         "scale_by_gauss_newton",
                         "scale_by_kfac",
                         "solving",
                         "spy",
                         "value_and_grad_by_solve",
]
