"""ℒ and ℳ as operators: the linear-algebra view of a network's linearisation.

Modules, lowest first: `_operator_type` (`LinearOperator`, the one operator type, and `Block`),
`_network_operators` (`StateOperator` ℒ and ℒ*, `ParamOperator` ℳ and ℳ*) and `_linearization`
(`linearize`: the states at (θ, U₀), the stored forward pass and both operators on it).
"""

from ._linearization import Linearization, linearize
from ._network_operators import ParamOperator, StateOperator
from ._operator_type import Block, LinearOperator

__all__ = [
    "Block", "LinearOperator", "Linearization", "ParamOperator", "StateOperator", "linearize",
]
