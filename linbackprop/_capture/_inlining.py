"""The captured jaxpr flattened: the user's own ``jax.jit``s around marked calls inlined, and a
``lax.scan`` over stacked blocks unrolled with its rows read as `Row` blocks (`ScanRows`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend.core import Literal

from .._graph import scan_counts
from ._marks import contains_marks, marked_index


class NoInput:
    """The input of a network that reads no data (its every input differentiated): nothing reads it."""


def inline_calls(jaxpr: Any, consts: Sequence[Any], rows: ScanRows) -> tuple[list, list, list, list]:
    """The equations with unmarked ``jit`` s that hold marked calls inlined (a ``jax.jit`` the user
    put around part of the model): their equations take their place, and what read their outputs
    reads the inner values instead. Returns (eqns, constvars, consts, outvars)."""
    eqns: list = []
    constvars, consts = list(jaxpr.constvars), list(consts)
    rename: dict = {}
    fix = lambda atoms: [a if isinstance(a, Literal) else rename.get(a, a) for a in atoms]
    for eqn in jaxpr.eqns:
        eqn = eqn.replace(invars=fix(eqn.invars))
        if eqn.primitive.name == "scan" and contains_marks(eqn.params["jaxpr"].jaxpr):
            sub, sub_constvars, sub_consts, outs = _unrolled_scan(eqn, rows)
            eqns += sub
            constvars += sub_constvars
            consts += sub_consts
            rename.update(zip(eqn.outvars, outs))
            continue
        if marked_index(eqn) is None and eqn.primitive.name in ("pjit", "jit") and \
                contains_marks(eqn.params["jaxpr"].jaxpr):
            # traced again, not copied: JAX keeps one trace of a jitted function, so two calls of it
            # hold the same inner variables, and copies of one jaxpr would alias each other's values
            sub, sub_constvars, sub_consts, outs = _traced(jax.extend.core.jaxpr_as_fun(eqn.params["jaxpr"]),
                                                          eqn.invars, rows)
            eqns += sub
            constvars += sub_constvars
            consts += sub_consts
            rename.update(zip(eqn.outvars, outs))
            continue
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            if contains_marks(sub):
                what = eqn.primitive.name
                raise NotImplementedError(
                    f"A layers= call runs inside `{what}` (a {what} of the model's code, e.g. jax.checkpoint, a "
                    "custom_jvp or a while loop), which capture cannot see through: call the layers outside it "
                    "(checkpoints=k of the transform recomputes segments instead), or build the Network by hand "
                    "(lbp.Network).")
        eqns.append(eqn)
    return eqns, constvars, consts, fix(jaxpr.outvars)


def _traced(fn: Callable, atoms: Sequence[Any], rows: ScanRows) -> tuple[list, list, list, list]:
    """``fn`` traced at the avals of ``atoms`` and inlined (fresh variables), its inputs bound to
    ``atoms``: (eqns, constvars, consts, outvars)."""
    def fresh(*args: Any) -> Any:  # a new function object: JAX caches traces per function (same variables)
        return fn(*args)

    closed = jax.make_jaxpr(fresh)(*[jax.ShapeDtypeStruct(a.aval.shape, a.aval.dtype, weak_type=a.aval.weak_type)
                                     for a in atoms])
    eqns, constvars, consts, outvars = inline_calls(closed.jaxpr, closed.consts, rows)
    bound = dict(zip(closed.jaxpr.invars, atoms))
    bind = lambda xs: [a if isinstance(a, Literal) else bound.get(a, a) for a in xs]
    # rows a scan inside reads are rows of the atoms (a stack of blocks passed in)
    rows.rows.update({r: (bound.get(x, x), t) for r, (x, t) in rows.rows.items()})
    rows.chains.update({v: bound.get(x, x) for v, x in rows.chains.items()})
    return [e.replace(invars=bind(e.invars)) for e in eqns], constvars, consts, bind(outvars)


@dataclasses.dataclass
class ScanRows:
    """Rows of scanned-over arrays found while inlining. ``rows``: the variable a row is read as ->
    (the array, the row); a row of a differentiated leaf is a Row of its block in the layers that
    read it (a stack of blocks iterated by a scan: Row-stacked layers of one kind, as a hand-built
    network has them). ``chains``: every variable of the equations slicing a row -> the array."""

    rows: dict = dataclasses.field(default_factory=dict)
    chains: dict = dataclasses.field(default_factory=dict)


def static_rows(eqns: list, stacked: set, found: ScanRows) -> None:
    """Rows of differentiated leaves read with a Python index (``params["W"][i]`` in a loop over
    the layers: a ``slice`` of one row along the leading axis, then ``squeeze``), recorded in
    ``found`` as a scan's rows are: the layers read them as Row blocks, not through glue that
    makes a parameter a state (which the per-example transforms cannot take: it has no batch)."""
    sliced, rows, whole = {}, {}, set()
    for e in eqns:
        name = e.primitive.name
        if name == "slice" and e.invars[0] in stacked and e.params.get("strides") in (None, (1,) * len(e.params[
                "start_indices"])):
            start, limit, shape = e.params["start_indices"], e.params["limit_indices"], e.invars[0].aval.shape
            if limit[0] == start[0] + 1 and all(s == 0 for s in start[1:]) and tuple(limit[1:]) == tuple(shape[1:]):
                sliced[e.outvars[0]] = (e.invars[0], int(start[0]))
                continue
        if name == "squeeze" and tuple(e.params["dimensions"]) == (0,) and e.invars[0] in sliced:
            rows[e.outvars[0]] = e.invars[0]
            continue
        whole.update(a for a in e.invars if not isinstance(a, Literal) and a in stacked)
    whole |= {sliced[v][0] for v in sliced if v not in rows.values()}  # a row read other than squeezed
    for row, one in rows.items():
        source, t = sliced[one]
        if source not in whole:  # a leaf read whole anywhere (a layer, a weight decay) keeps its glue
            found.rows[row] = (source, t)
            found.chains[one] = found.chains[row] = source


def _unrolled_scan(eqn: Any, found: ScanRows) -> tuple[list, list, list, list]:
    """A ``lax.scan`` whose body makes marked calls, unrolled into one copy of the body per step
    (fresh variables), reading row t of each scanned-over array; the stacked outputs are stacked
    from the steps'. Returns (eqns, constvars, consts, outvars of the scan)."""
    params = eqn.params
    body, length, reverse = params["jaxpr"], params["length"], params["reverse"]
    n_consts, n_carry = scan_counts(params)
    consts_in = list(eqn.invars[:n_consts])
    carry = list(eqn.invars[n_consts:n_consts + n_carry])
    xs = list(eqn.invars[n_consts + n_carry:])
    eqns, constvars, consts, ys = [], [], [], []
    run = jax.extend.core.jaxpr_as_fun(body)
    for t in (range(length - 1, -1, -1) if reverse else range(length)):
        rows = []
        if xs:
            sub, cv, cs, rows = _traced(lambda *a, t=t: [x[t] for x in a], xs, found)
            eqns += sub
            constvars += cv
            consts += cs
            source = {x: x for x in xs}
            for e in sub:  # which array each slicing equation reads a row of
                src = next((source[a] for a in e.invars if not isinstance(a, Literal) and a in source), None)
                for o in e.outvars:
                    source[o] = src
                    found.chains[o] = src
            for x, r in zip(xs, rows):
                found.rows[r] = (x, t)
        sub, cv, cs, outs = _traced(run, consts_in + carry + rows, found)
        eqns += sub
        constvars += cv
        consts += cs
        carry, step_ys = outs[:n_carry], outs[n_carry:]
        ys.append(step_ys)
    if reverse:
        ys.reverse()
    stacked = []
    if ys and ys[0]:
        sub, cv, cs, stacked = _traced(lambda *a: [jax.numpy.stack(a[k::len(ys[0])]) for k in range(len(ys[0]))],
                                       [y for step in ys for y in step], found)
        eqns += sub
        constvars += cv
        consts += cs
    return eqns, constvars, consts, carry + stacked
