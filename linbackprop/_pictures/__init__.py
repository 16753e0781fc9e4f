"""Pictures of networks and their operators, and the demo of ``python -m linbackprop``.

Modules: `_plots` (`spy`, `plot_network`), `_seed_network` (the seed text's six-layer network
with skip connections and shared blocks, solved by hand against the library) and `_demo` (the
digits classifier the demo trains and draws).
"""

from ._demo import digits_network, figure, train_digits
from ._plots import plot_network, spy
from ._seed_network import main, seed_problem

__all__ = [
    "digits_network", "figure", "main", "plot_network", "seed_problem", "spy", "train_digits",
]
