"""optax transforms that consume the curvature: the damped Gauss–Newton direction (G + λI)⁻¹ g
(`_gauss_newton`), K-FAC's bare preconditioned direction (`_scale_by_kfac`) and the whole K-FAC
optimizer (`_kfac`: step size, momentum and damping chosen each step from exact G products).

The ``scale_by_*`` transforms take the gradient as their ``updates`` and return a *direction*
to be scaled by a negative learning rate, as ``optax.scale_by_adam`` does; ``kfac`` returns the
update itself, as ``optax.adam`` does. The curvature comes in as extra arguments of ``update``
(``curvature=G``, ``factors=...``), so they chain with optax's line searches and the rest.
"""

from ._blocks import CurvatureBlock, block_matrix, blocks_of, split_block
from ._gauss_newton import scale_by_gauss_newton
from ._kfac import KfacState, kfac
from ._kronecker import Diagonal
from ._scale_by_kfac import scale_by_kfac

__all__ = ["CurvatureBlock", "Diagonal", "KfacState", "block_matrix", "blocks_of", "kfac", "scale_by_gauss_newton",
           "scale_by_kfac", "split_block"]
