"""ℒ and ℳ as operators: the linear-algebra view of a network's linearisation.

Modules: `_linear_operators` (`LinearOperator`, `StateOperator` ℒ and ℒ*, `ParamOperator` ℳ
and ℳ*, `Block`) and `_linearization` (`linearize`: the states at (θ, U₀), the stored forward
pass and both operators on it).
"""

from ._linear_operators import Block, LinearOperator, ParamOperator, StateOperator
from ._linearization import Linearization, linearize

__all__ = [
    "Block", "LinearOperator", "Linearization", "ParamOperator", "StateOperator", "linearize",
]
