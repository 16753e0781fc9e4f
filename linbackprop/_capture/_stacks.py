"""Network outputs that ``fun`` stacks: ``jnp.stack`` of states after the network (a ``lax.scan``'s
``ys``, unrolled into one layer per step, stacked again) read as one `Stack` output of the network.

The stack is then one read of consecutive rows of the state buffer (its tangent one slice, its
cotangent one write) instead of one output per state, each read, broadcast and concatenated on
its own: an equinox GRU over 64 steps whose loss reads every hidden state had 64 outputs.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from jax.extend.core import Literal

from .._graph import Stack


def stacked_outputs(after: tuple, outvars: tuple, output_vars: dict[Hashable, list]
                    ) -> tuple[tuple, dict[Hashable | Stack, list]]:
    """``after`` (the equations after the network) without each ``jnp.stack`` of network outputs
    — a ``stack`` on axis 0 of single-output states, or a ``concatenate`` on axis 0 of
    ``broadcast_in_dim`` s adding a leading axis to them — and ``output_vars`` with a `Stack` of
    those states for each (its var: the stack's), the states themselves kept only where something
    else still reads them."""
    single = {vars_[0]: name for name, vars_ in output_vars.items() if len(vars_) == 1}
    producer = {o: n for n, e in enumerate(after) for o in e.outvars}  # var -> the index of its equation
    readers: dict = {}
    for n, e in enumerate(after):
        for a in e.invars:
            if not isinstance(a, Literal):
                readers.setdefault(a, set()).add(n)
    dropped: set[int] = set()
    stacks: dict[Stack, list] = {}
    for n, e in enumerate(after):
        if e.primitive.name == "stack" and e.params.get("axis") == 0 and len(e.invars) > 1:  # jnp.stack
            names, parts = [single.get(a) if not isinstance(a, Literal) else None for a in e.invars], []
        elif e.primitive.name == "concatenate" and e.params.get("dimension") == 0 and len(e.invars) > 1:
            # jnp.stack where JAX writes it as x[None] of each, concatenated
            names = [_expanded_state(after[producer[a]] if a in producer else None, single) for a in e.invars]
            parts = [producer[a] for a in e.invars if a in producer]
            if any(readers.get(a, set()) != {n} for a in e.invars):
                continue
        else:
            continue
        if None in names or len(set(names)) != len(names):
            continue
        stacks[Stack(names)] = [e.outvars[0]]
        dropped.update([n, *parts])
    if not stacks:
        return after, dict(output_vars)
    kept = tuple(e for n, e in enumerate(after) if n not in dropped)
    read = {a for e in kept for a in e.invars if not isinstance(a, Literal)} | {
        a for a in outvars if not isinstance(a, Literal)}
    remaining = {name: vars_ for name, vars_ in output_vars.items() if any(v in read for v in vars_)}
    return kept, {**remaining, **stacks}


def _expanded_state(eqn: Any, single: dict) -> Hashable | None:
    """The state ``eqn`` gives a new leading axis of length 1 (``x[None]``, as ``jnp.stack`` does),
    or None."""
    if eqn is None or eqn.primitive.name != "broadcast_in_dim" or isinstance(eqn.invars[0], Literal):
        return None
    x, shape = eqn.invars[0], tuple(eqn.params["shape"])
    if x not in single or shape != (1, *x.aval.shape) or tuple(eqn.params["broadcast_dimensions"]) != tuple(
            range(1, 1 + len(x.aval.shape))):
        return None
    return single[x]
