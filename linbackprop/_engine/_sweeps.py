"""The sequential sweeps: the forward pass (optionally with the forward substitution fused in),
the forward substitution ℒZ = ℳ*h and the back substitution ℒ*Λ = g, each one loop over the
layers whose body switches over kinds and writes its large buffers outside the switch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import jaxpr_as_fun

from .._graph import update_row
from .._plan import Family, Kind, Plan, RowList, Sweep, Writes
from ._loop import Step, layer_arguments, run_loop
from ._maps import layer_maps
from ._rows import (
    Primal,
    add_row,
    at_inputs,
    index_at,
    index_scalar,
    out_rows,
    read_row,
    read_rows,
    rows_not_carried,
    scatter_add,
    set_row,
    take_rows,
    without_pad,
    zeros_like_aval,
)


# -- the sequential parts --------------------------------------------------------------------------
def _slot_zeros(plan: Plan, writes: Writes, buffer: tuple[Family, int]) -> Any:
    """Zeros shaped like one row of ``buffer``: what an inactive kind writes into a slot."""
    family, n = buffer
    if family is Family.RESIDUAL:
        return zeros_like_aval(plan.res_avals[n])
    group = (plan.param_groups if family is Family.PARAM else plan.state_groups)[n]
    return group.row_zeros(tangent=family in writes.tangent)


def _step(plan: Plan, step: Step, writes: Writes, branch: Callable[[int, Any], Any], operand: Any,
          carried: Any = None) -> Any:
    """The step's values, one per write slot: the branch of the step's kind fills its slots; with
    several kinds (a ``lax.switch``), the other slots hold zeros. None: nothing to write.

    With ``carried`` (zeros shaped like a value the loop carries to the next step), a branch
    returns (its values, that value or None) and so does this: (slots, value)."""
    def place(k: int, values: list) -> list:
        out: list = [None] * len(writes.buffers)
        for v, s in zip(values, writes.of_kind[k]):
            out[s] = v
        return out

    def run_kind(k: int, op: Any) -> Any:
        if carried is None:
            return place(k, branch(k, op))
        values, extra = branch(k, op)
        return place(k, values), carried if extra is None else extra

    if step.kind is not None:
        return run_kind(step.kind, operand)

    def make(k):
        def run(op):
            out = run_kind(k, op)
            slots = out if carried is None else out[0]
            slots = [_slot_zeros(plan, writes, writes.buffers[s]) if v is None else v for s, v in enumerate(slots)]
            return slots if carried is None else (slots, out[1])

        return run

    branches = [make(k) for k in range(len(plan.kinds))]
    return lax.switch(index_scalar(index_at(plan.step_kind, step.index)), branches, operand)


def _write(bufs: dict[str, list], writes: Writes, i: Any, values: list, add: bool,
           set_buffers: frozenset = frozenset()) -> None:
    """All writes of a step, outside any switch: XLA updates the big buffers in place.
    ``add``: values are added, except into ``set_buffers`` (rows written once: set)."""
    rows = index_at(writes.rows, i)
    by_buffer: dict[tuple[str, int], list[int]] = {}
    for s, v in enumerate(values):
        if v is not None:
            by_buffer.setdefault(writes.buffers[s], []).append(s)
    for (family, n), slots in by_buffer.items():
        buf = bufs[family][n]
        if (family, n) in set_buffers:
            for s in slots:
                buf = set_row(buf, rows[s], values[s])
        elif len(slots) == 1 or isinstance(buf, RowList) or not add:
            for s in slots:
                buf = (add_row if add else set_row)(buf, rows[s], values[s])
        else:  # one scatter: the write depends on every value, so on every read behind them
            idx = jnp.stack([jnp.asarray(index_scalar(rows[s], affine=False)) for s in slots])
            buf = jax.tree.map(lambda b, *vs: b.at[idx].add(jnp.stack([v.astype(b.dtype) for v in vs])),
                               buf, *[values[s] for s in slots])
        bufs[family][n] = buf


def _jvp_moving(fn: Callable, theta: tuple, inputs: tuple, dtheta: tuple, dinputs: tuple) -> tuple[Any, Any]:
    """fn(θ, *inputs) and its derivative along the tangents that are not None (the rest held)."""
    moving = [(0, p, t) for p, t in enumerate(dtheta) if t is not None]
    moving += [(1, r, t) for r, t in enumerate(dinputs) if t is not None]

    def f(*args):
        th, ins = list(theta), list(inputs)
        for (where, n, _), a in zip(moving, args):
            (th if where == 0 else ins)[n] = a
        return fn(tuple(th), *ins)

    primals = tuple((theta if where == 0 else inputs)[n] for where, n, _ in moving)
    if not primals:  # nothing moves: the tangent is zero
        out = fn(theta, *inputs)
        return out, jax.tree.map(jnp.zeros_like, out)
    return jax.jvp(f, primals, tuple(t for _, _, t in moving))


def _with_residuals(plan: Plan, k: int, theta: tuple, inputs: tuple) -> list[Any]:
    """A forward step that keeps the layer's residuals: its output, then its stored residuals.
    The plan's analysis traced the layer's linearisation once already: its jaxpr is replayed, so
    the stored residuals are always those of the analysed linearisation (whatever the arguments:
    one array passed twice, weak types) and the layer's Python is not traced again."""
    kind = plan.kinds[k]
    values = jaxpr_as_fun(kind.probe)(*jax.tree.leaves((theta, inputs)))
    n_out = len(jax.tree.leaves(kind.out_aval))
    out = jax.tree.unflatten(jax.tree.structure(kind.out_aval), values[:n_out])
    return [out, *(values[n_out + n] for n in kind.kept)]


def _with_tangent(plan: Plan, kind: Kind, pos: Any, theta: tuple, inputs: tuple, h: list[Any] | None,
                  tangents: list[Any], carried: tuple[int, Any] | None) -> list[Any]:
    """A forward step that also takes row i of the forward substitution: U_i, then Z_i =
    ∂Φ_i/∂θ h + Σ_j ∂Φ_i/∂U_j Z_j (one JVP of the layer). ``carried``: (read slot, Z) of a read
    that the loop carries instead of reading it from ``tangents``."""
    pslots, rslots = index_at(kind.by_member.params, pos), index_at(kind.by_member.reads, pos)
    pgroups, sgroups = plan.param_groups, plan.state_groups
    dtheta = tuple(None if h is None or not pgroups[g].differentiable
                   else pgroups[g].full_tangent(read_row(h[g], pslots[..., p]))
                   for p, g in enumerate(kind.param_groups))
    dinputs = [None if tangents[g] is None else read_row(tangents[g], rslots[..., r], written=True)
               for r, g in enumerate(kind.read_groups)]
    if carried is not None and carried[1] is not None:
        dinputs[carried[0]] = carried[1]
    dinputs = [None if d is None else sgroups[g].full_tangent(d) for d, g in zip(dinputs, kind.read_groups)]
    out, dout = _jvp_moving(kind.fn, theta, inputs, dtheta, tuple(dinputs))
    if tangents[kind.out_group] is None:
        return [out]
    return [out, sgroups[kind.out_group].tangent(dout)]


# -- what a loop carries from step to step in a stretch (``Plan.forwarding``): entering, the row
# its first step reads; leaving, the row of its last output
def _entry_row(plan: Plan, fwd: Any, bufs: list[Any], tangent: bool) -> Any:
    """The value the first step of a stretch reads from the carry: its row of ``bufs`` (zeros
    where it has none)."""
    if fwd.first_row is None:
        return plan.state_groups[fwd.group].row_zeros(tangent)
    return read_row(bufs[fwd.group], fwd.first_row)


def _exit_row(zplan: Plan, plan: Plan, stop: int) -> int:
    """The row (of ``zplan``'s layout) of the output of a stretch's last step, ``stop`` − 1."""
    return int(zplan.kinds[int(plan.step_kind[stop - 1])].by_step.out[stop - 1])


def _carry_start(plan: Plan, start: int, stop: int, states: list[Any], tangents: list[Any] | None) -> Any:
    """What the forward pass carries into segment ``start:stop``: the output the segment's first
    step reads, and its tangent; None where nothing is carried."""
    fwd = plan.forwarding(start, stop)
    if fwd is None:
        return None
    entry = lambda bufs, tangent: None if bufs[fwd.group] is None else _entry_row(plan, fwd, bufs, tangent)
    return entry(states, False), entry(tangents, True) if tangents is not None else None


def forward(plan: Plan, params: list[Any], states: list[Any], residuals: bool = True,
            tangents: tuple[list[Any] | None, list[Any]] | None = None) -> Any:
    """U = Φ(U, θ) by forward substitution; with ``residuals``, each layer's VJP residuals too.

    With ``tangents`` = (h, Z₀) — parameter- and state-layout tangents, None for constant groups —
    the same sweep also solves ℒ Z = ℳ* h + Z₀: row i, Z_i = ∂Φ_i/∂θ h + Σ_j ∂Φ_i/∂U_j Z_j (+ Z₀_i),
    needs only layer i's linearisation, at hand the moment U_i is computed (a JVP of the layer),
    so nothing is stored for it. Returns (Primal, Z) then.
    """
    assert not (residuals and tangents is not None)
    h = tangents[0] if tangents is not None else None
    writes = plan.writes(Sweep.FORWARD_RESIDUALS if residuals else Sweep.FORWARD_TANGENTS if tangents is not None
                         else Sweep.FORWARD)

    def body(step, carry):
        states, res, tans, prev = carry
        fwd = plan.forwarding(*step.segment) if step.segment else None

        def branch(k, operand):
            sts, tns, prev = operand
            kind = plan.kinds[k]
            pos = index_at(kind.by_step.member, step.index)
            theta, inputs = layer_arguments(plan, kind, Primal(params, sts, []), pos, written=True)
            carried = fwd is not None and k in fwd.read  # the previous step's output, carried
            if carried:
                r = fwd.read[k]
                inputs = (*inputs[:r], plan.state_groups[fwd.group].typed(prev[0]), *inputs[r + 1:])
            if residuals:
                return _with_residuals(plan, k, theta, inputs)
            if tangents is None:
                return [kind.fn(theta, *inputs)]
            return _with_tangent(plan, kind, pos, theta, inputs, h, tns, (fwd.read[k], prev[1]) if carried else None)

        values = _step(plan, step, writes, branch, (states, tans, prev))
        bufs = {Family.STATE: list(states), Family.RESIDUAL: list(res), Family.TANGENT: list(tans)}
        _write(bufs, writes, step.index, values, add=False)
        if fwd is not None:  # every kind here writes its output to fwd.group: the same slots
            slots = writes.of_kind[step.kind if step.kind is not None else next(iter(fwd.read))]
            group = plan.state_groups[fwd.group]
            prev = (group.cast(values[slots[0]]),
                    group.cast(values[slots[1]], tangent=True) if prev[1] is not None else None)
        return bufs[Family.STATE], bufs[Family.RESIDUAL], bufs[Family.TANGENT], prev

    def enter(start, stop, carry):
        states, res, tans, _ = carry
        return states, res, tans, _carry_start(plan, start, stop, states, tans if tangents is not None else None)

    res0 = [RowList([zeros_like_aval(a)] * (n + 1)) if plan.unrolled or as_rows else zeros_like_aval(a, (n + 1,))
            for a, n, as_rows in zip(plan.res_avals, plan.res_rows, plan.res_as_rows)] if residuals else []
    tans0 = list(tangents[1]) if tangents is not None else [None] * len(plan.state_groups)
    states, res, tans, _ = run_loop(plan, body, (list(states), res0, tans0, None), enter=enter)
    prim = Primal(params, states, res if residuals else None)
    return (prim, tans) if tangents is not None else prim


def forward_substitution(plan: Plan, prim: Primal, rhs: list[Any], *, h: list[Any] | None, compact: bool,
                         rhs_full: bool) -> list[Any]:
    """Z with ℒ Z = rhs: Z_i = rhs_i + Σ_j ∂Φ_i/∂U_j Z_j, first layer to last. With ``h``
    (parameter-layout tangents; None: none), ℒ Z = rhs + ℳ* h: ∂Φ_i/∂θ h is formed in the loop, from
    the same linearisation of each layer (the transpose of ℳΛ accumulated in the back
    substitution). Each argument is the caller's `SolveVariant`'s: nothing here chooses.

    ``compact``: Z in the layout of ``plan.compact`` — rows only for the states read again from
    the buffer or returned (inputs and outputs); the others go from step to step in the loop's
    carry — and rhs read at the input rows only (a tangent of the inputs: every row a layer
    writes is set, not added to). Returns that layout, its pad row zero. With ``rhs_full`` rhs is
    in the full layout and read at every row (ℳ* h formed before the loop): Z_i = rhs_i + ..., Z
    still compact."""
    assert not (compact and plan.unrolled), "compact is the loop engine's layout"
    zplan = plan.compact if compact else plan
    writes = zplan.writes(Sweep.FORWARD_SUBSTITUTION)
    everywhere = rhs if compact and rhs_full else None
    if everywhere is not None:  # the buffer starts from rhs at its rows (the inputs' among them)
        rhs = take_rows(rhs, zplan.to_full)

    def forwarded(segment: tuple[int, int] | None) -> Any:
        fwd = zplan.forwarding(*segment) if compact and segment else None
        return None if fwd is None or rhs[fwd.group] is None else fwd  # integer states: no tangent

    def body(step, carry):
        z, prev = carry
        i = step.index
        fwd = forwarded(step.segment)

        def branch(k, operand):
            zz, prev = operand
            kind = plan.kinds[k]
            if zz[kind.out_group] is None:  # an integer state: no tangent
                return []
            pos = index_at(kind.by_step.member, i)
            slots = index_at(zplan.kinds[k].by_member.reads, pos)
            reads = [read_row(zz[g], slots[r], written=True) if zz[g] is not None else None
                     for r, g in enumerate(kind.read_groups)]
            if fwd is not None and k in fwd.read and prev is not None:  # the previous step's Z
                reads[fwd.read[k]] = prev
            hs = None
            if h is not None and kind.param_groups:
                pslots = index_at(kind.by_member.params, pos)
                hs = tuple(read_row(h[g], pslots[..., p]) for p, g in enumerate(kind.param_groups))
            value = layer_maps(plan, kind, prim, k, pos).state_forward(tuple(reads), hs)
            if everywhere is not None:
                earlier = read_row(everywhere[kind.out_group], index_at(kind.by_member.out, pos))
                value = jax.tree.map(jnp.add, value, earlier)
            return [value]

        values = _step(zplan, step, writes, branch, (z, prev))
        bufs = {Family.STATE: list(z)}
        if fwd is None or not zplan.carried_only(*step.segment):  # else: the last step's, on leaving
            _write(bufs, writes, i, values, add=not compact)
        if fwd is not None:
            value = values[writes.of_kind[step.kind if step.kind is not None else next(iter(fwd.read))][0]]
            prev = None if value is None else zplan.state_groups[fwd.group].cast(value, tangent=True)
        return bufs[Family.STATE], prev

    def enter(start, stop, carry):
        z, _ = carry
        fwd = forwarded((start, stop))
        if fwd is None:
            return z, None
        return z, _entry_row(zplan, fwd, z, True)

    def leave(start, stop, carry):
        z, prev = carry
        fwd = forwarded((start, stop))
        if fwd is None or not zplan.carried_only(start, stop):
            return carry
        z = list(z)
        z[fwd.group] = set_row(z[fwd.group], _exit_row(zplan, plan, stop), prev)
        return z, None

    # Without ``compact`` Z_i is not carried to the next step: the step still reads rhs_i from the
    # buffer, so carrying saves nothing there.
    z, _ = run_loop(plan, body, (list(rhs), None), enter=enter, leave=leave)
    return without_pad(zplan, z) if compact else z


def back_substitution(plan: Plan, prim: Primal, rhs: list[Any], *, grads: list[Any] | None, compact: bool,
                      every_row: bool) -> Any:
    """Λ with ℒ* Λ = rhs: Λ_j = rhs_j + Σ_{i reads j} (∂Φ_i/∂U_j)* Λ_i, last layer to first.

    With ``grads`` (parameter-layout buffers; None: no ℳΛ here), ℳΛ is also added into them inside
    the loop, from the same linearisation of each layer; returns (Λ, grads + ℳΛ) then. Each
    argument is the caller's `SolveVariant`'s: nothing here chooses.

    ``compact``: the transpose of `forward_substitution`'s. rhs and Λ in the layout of
    ``plan.compact``; the cotangent of a read the forward substitution carried goes to the
    previous step in the loop's carry (for a state without a row, its Λ), into the buffer only
    at the start of the stretch. Λ is returned at the input rows, zeros elsewhere (the forward
    substitution reads rhs only there).

    ``every_row`` (with ``compact``, rhs zero at the rows the compact layout drops: Pᵀ b): Λ at
    every row of the full layout, for ℳΛ after the loop, still solved in the compact layout. A
    step the loop carries into sets its row of Λ once it is complete, in a buffer the loop never
    reads; the rows of the other states are the compact buffer's. A carried step then reads no
    row and adds into none, where the full layout's back substitution reads Λ_i and adds into
    its input's row: a round trip through the buffer that dominates latency-bound steps.
    """
    in_loop = grads is not None
    assert not (compact and plan.unrolled), "compact is the loop engine's layout"
    assert not (every_row and (in_loop or not compact)), "every_row: a compact solve without ℳΛ in the loop"
    zplan = plan.compact if compact else plan
    absent = frozenset(g for g, b in enumerate(rhs) if b is None)  # no cotangent wanted (or none exists)
    writes = zplan.writes(Sweep.BACK_SUBSTITUTION, with_params=in_loop, absent=absent)

    def forwarded(segment: tuple[int, int] | None) -> Any:
        fwd = zplan.forwarding(*segment) if compact and segment else None
        return None if fwd is None or fwd.group in absent else fwd

    step_rows = out_rows(zplan)  # per step, the row of its output (compact layout)

    def body(step, carry):
        lam, acc, ct_next, everywhere = carry
        i = step.index
        fwd = forwarded(step.segment)
        only_carried = fwd is not None and zplan.carried_only(*step.segment)
        if fwd is not None:  # Λ_i: every kind here writes fwd.group, so it is known outside the switch
            if only_carried:  # the next step's cotangent alone (the last's: read on entry)
                lam_step = ct_next
            else:  # plus what the other readers added to its row
                lam_step = jax.tree.map(jnp.add, read_row(lam[fwd.group], index_at(step_rows, i), written=True),
                                        ct_next)
            if every_row:  # complete: its row of the full layout, which the loop never reads
                everywhere = list(everywhere)
                everywhere[fwd.group] = jax.tree.map(
                    lambda b, v: update_row(b, index_scalar(index_at(full_rows, i)), v.astype(b.dtype)),
                    everywhere[fwd.group], lam_step)
            ct_next = lam_step

        def branch(k, operand):
            ll, ct_next = operand
            kind = plan.kinds[k]
            if ll[kind.out_group] is None:  # an integer state: no cotangent to propagate
                return [] if fwd is None else ([], None)
            pos = index_at(kind.by_step.member, i)
            if fwd is not None:  # Λ_i, formed above
                lam_i = ct_next
            else:
                lam_i = read_row(ll[kind.out_group], index_at(zplan.kinds[k].by_member.out, pos), written=True)
            maps = layer_maps(plan, kind, prim, k, pos)
            cts, pcts = maps.adjoints(lam_i) if in_loop else (maps.state_adjoint(lam_i), ())
            carried = fwd.read.get(k) if fwd is not None else None
            passed = None if carried is None else cts[carried]
            # the carried read keeps its slot, written nothing (None: zeros where kinds switch)
            values = [None if r == carried else ct for r, (ct, g) in enumerate(zip(cts, kind.read_groups))
                      if ct is not None and g not in absent]
            values += list(pcts)
            return values if fwd is None else (values, passed)

        zeros = None if fwd is None else zplan.state_groups[fwd.group].row_zeros(True)
        out = _step(zplan, step, writes, branch, (lam, ct_next), carried=zeros)
        values, ct_next = (out, ct_next) if fwd is None else out
        bufs = {Family.STATE: list(lam), Family.PARAM: list(acc)}
        # With kinds known at trace time no slot of a parameter group written once is inactive
        # (an inactive one adds zeros to row 0), so its rows are set: no read of the old row.
        once = (frozenset((Family.PARAM, g) for g in plan.params_written_once) if step.kind is not None
                else frozenset())
        _write(bufs, writes, i, values, add=True, set_buffers=once)
        return bufs[Family.STATE], bufs[Family.PARAM], ct_next, everywhere

    def enter(start, stop, carry):
        fwd = forwarded((start, stop))
        if fwd is None:
            return (*carry[:2], None, carry[3])
        if zplan.carried_only(start, stop):  # the last step's Λ: complete, its readers are behind
            return (*carry[:2], read_row(carry[0][fwd.group], _exit_row(zplan, plan, stop)), carry[3])
        return (*carry[:2], zplan.state_groups[fwd.group].row_zeros(True), carry[3])

    def leave(start, stop, carry):
        lam, acc, ct, everywhere = carry
        fwd = forwarded((start, stop))
        if fwd is not None and fwd.first_row is not None:  # the stretch's first read: a row
            lam = list(lam)
            lam[fwd.group] = add_row(lam[fwd.group], fwd.first_row, ct)
        return lam, acc, None, everywhere

    if compact:  # the pad row of rhs is no row of Λ (it must stay zero: unwritten states read it)
        rhs = without_pad(zplan, rhs)
    # Zeros in the full layout (the gather behind them is dead code): each carried step sets its row.
    full_rows, everywhere = None, None
    if every_row:
        full_rows = out_rows(plan)
        everywhere = [None if b is None else jax.tree.map(jnp.zeros_like, b) for b in take_rows(rhs, zplan.to_compact)]
    # ℳΛ goes into fresh zeros, added to ``grads`` after the loop: rows can then be set rather
    # than accumulated, and XLA drops the addition where ``grads`` is zeros (a gradient).
    acc = [g.zeros(plan.unrolled, tangent=True) for g in plan.param_groups] if in_loop else []
    lam, acc, _, everywhere = run_loop(plan, body, (list(rhs), acc, None, everywhere), reverse=True, enter=enter,
                                       leave=leave)
    if every_row:  # the carried steps' rows from the loop, the other kept rows from the compact buffer
        for g, (full, kept) in enumerate(rows_not_carried(zplan, forwarded)):
            if everywhere[g] is not None and len(full):
                everywhere[g] = scatter_add(everywhere[g], full, read_rows(lam[g], kept))
        return everywhere
    lam = at_inputs(zplan, lam) if compact else lam
    return (lam, [jax.tree.map(jnp.add, g, a) for g, a in zip(grads, acc)]) if in_loop else lam
