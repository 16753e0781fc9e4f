"""Models from other libraries: one adapter per framework (equinox, flax nnx, flax linen; a pytree
otherwise) that `functional` and the capture of ``layers=`` both use. Imports nothing of
linbackprop; flax and equinox only through the modules a caller's model comes from.
"""

from ._adapters import ADAPTERS, adapter_of, adapter_of_class, functional, split_argument
from ._equinox import Equinox
from ._functional import Adapter, ArgumentSplit, Functional, Marking, plain_split
from ._linen import Linen
from ._nnx import Nnx

__all__ = ["ADAPTERS", "Adapter", "ArgumentSplit", "Equinox", "Functional", "Linen", "Marking", "Nnx",
           "adapter_of", "adapter_of_class", "functional", "plain_split", "split_argument"]
