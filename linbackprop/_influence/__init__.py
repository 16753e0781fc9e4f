"""Training-data attribution: influence functions from the per-example gradients and the
curvature transforms.

Modules, lowest first: `_chunks` (examples a chunk at a time, memory bounded by the chunk),
`_curvatures` (the fitted approximations of G and their damped inverses: identity, diagonal,
K-FAC and EK-FAC's eigenbases, the exact G), `_influence` (`influence`, `Influence`,
`InfluenceFit`: the fit, the scores and the self-influence).
"""

from ._influence import Influence, InfluenceFit, influence

__all__ = ["Influence", "InfluenceFit", "influence"]
