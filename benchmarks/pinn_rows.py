"""The kfac-pinns Poisson problem of examples/pinn_poisson.py, every method on the same budget."""

from __future__ import annotations

import jax

from . import example

PINN_SECONDS = {"2-64-1": 300.0, "2-64-64-48-48-1": 1000.0}  # kfac-pinns' budgets


def pinn_rows(network: str, seconds: float) -> list[tuple[str, str, str]]:
    """Each method of examples/pinn_poisson.py on the same step-time budget (float64)."""
    pinn = example("pinn_poisson")
    widths = network.split("-")[1:-1]
    params, _, _, _, scale = pinn.make_problem(tuple(map(int, widths)))
    size = sum(x.size for x in jax.tree.leaves(params))
    result = pinn.main(["--seconds", str(seconds), "--widths", ",".join(widths), "--out", ""])
    best_adam = min((v, k) for k, v in result.items() if k.startswith("Adam"))
    rows = []
    for name, error in result.items():
        if not name.startswith("Adam") or name == best_adam[1]:
            label = f"{name} (best of three rates)" if name.startswith("Adam") else name
            rows.append((f"{network} ({size} parameters): {label}", f"{error:.2e} ({error / scale:.2e})",
                         f"{seconds:g} s"))
    return rows
