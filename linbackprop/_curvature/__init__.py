"""Curvature from the operators: Gauss–Newton products, per-example gradients and their norms,
the exact diagonal of the generalised Gauss–Newton matrix and its K-FAC factors.

In ``fun`` the Network calls are the model and the rest is the loss ℓ of their outputs (and of
the arguments directly). With J = E ℒ⁻¹ ℳ* (E picks the outputs) and H the Hessian of ℓ w.r.t.
the outputs,

    G = J* H J,     G v = ℳ ℒ⁻* E* H E ℒ⁻¹ ℳ* v

is one forward substitution, one product with H, one back substitution and ℳ, all on the
linearisation stored by one forward pass (no forward pass per product). Per-example quantities
use that the leading axis of every state is the batch: one back substitution serves every
example, and ℳ is applied to each example's rows alone.

Modules, lowest first: `_split` (``fun`` as model and loss), `_operator` (G as a pytree
operator), `_separation` (the checks that examples stay apart), `_ghost` (per-example norms),
`_calls` (the calls' forward pass, adjoints, products and per-example products), `_sampling`
(samples of H's per-example blocks), `_examples` (what an example is: the set-up of every
per-example transform, and H's blocks), `_per_example` (per-example gradients and norms),
`_example_products` (each example's gradient against given directions, as ghost inner
products), `_ggn`
(the GGN diagonal and its factor), `_kfac` (K-FAC's factors), `_one_pass` (value, gradient, G,
the factors and the diagonal from one pass), `_gauss_newton` (the transform), `_clipping`
(DP-SGD's clipped sum).
"""

from ._clipping import clipped_grad
from ._example_products import per_example_products
from ._gauss_newton import gauss_newton
from ._ggn import diag_ggn, ggn_factor
from ._kfac import BiasOf, Kronecker, is_factor, kfac_factors
from ._operator import GaussNewton
from ._per_example import per_example_grad_norms, per_example_grads

__all__ = ["BiasOf", "GaussNewton", "Kronecker", "clipped_grad", "diag_ggn", "gauss_newton", "ggn_factor",
           "is_factor", "kfac_factors", "per_example_grad_norms", "per_example_grads", "per_example_products"]
