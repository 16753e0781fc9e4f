"""Making plans: `make_plan` (cached per network, shapes and engine), `plan_for` of values, and
`current_plan`, which makes them anew where a layer's computation changed since.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Hashable
from typing import Any

import jax
import numpy as np

from .._graph import Layer, Network, Row, Stack, computation_of, explicit_sharding, mesh_of
from .._options import POLICY, Policy
from ._groups import Aval, Group, dtype_key
from ._kinds import Kind, MemberRows, StepRows, function_key
from ._layout import Plan
from ._residuals import analyse_kind, avals_of
from ._schedule import straight_line_kinds


@functools.lru_cache(maxsize=32)
def make_plan(net: Network, param_structs: tuple, input_structs: tuple, engine: str = "auto",
              generation: int = 0, policy: Policy = POLICY) -> Plan:
    """The layout for ``net`` at the given shapes (``param_structs`` follows ``net.param_names``);
    ``generation`` (`plans_generation`) keys the cache only; ``policy``: where a loop pays and its
    longest period."""
    params = {p: _unstruct(s) for p, s in zip(net.param_names, param_structs)}
    plain = [(p, a) for p, a in params.items() if p not in net.stacked_blocks]
    param_groups, param_loc = _group(plain, pad=False)
    for p in net.param_names:
        if p in net.stacked_blocks:  # its own group; the layers' Row entries are its slots
            param_loc[p] = (len(param_groups), None)
            param_groups += (_stacked_group(p, param_structs[net.param_names.index(p)]),)

    def slot(p: Hashable) -> tuple[int, int]:
        return (param_loc[p.block][0], p.index) if isinstance(p, Row) else param_loc[p]

    def read_slot(r: Hashable) -> tuple[int, int]:
        return (state_loc[r.block][0], r.index) if isinstance(r, Row) else state_loc[r]

    avals: dict[Hashable, Any] = {name: _unstruct(s) for name, s in zip(net.inputs, input_structs)}
    kind_info: dict[Any, tuple] = {}
    computations: list[tuple[Layer, tuple, tuple, Hashable]] = []
    layer_kind: list[Any] = []
    for layer in net.layers:
        theta = tuple(_row_aval(params, p) for p in layer.params)
        ins = tuple(_row_aval(avals, r) for r in layer.reads)
        key = (function_key(layer.fn), _structure(theta), _structure(ins), tuple(slot(p)[0] for p in layer.params),
               tuple(isinstance(r, Row) and r.block for r in layer.reads))
        if key not in kind_info:
            kind_info[key] = analyse_kind(layer, theta, ins)
            computations.append((layer, theta, ins, computation_of(layer, theta, ins)))
        avals[layer.name] = kind_info[key][0]
        layer_kind.append(key)

    state_groups, state_loc = _group([(n, a) for n, a in avals.items() if n not in net.stacked_inputs], pad=True)
    for name in net.inputs:
        if name in net.stacked_inputs:  # its own group, like a stacked block: rows are the Row indices
            state_loc[name] = (len(state_groups), None)
            state_groups += (_stacked_group(name, input_structs[net.inputs.index(name)]),)
    _check_stacks(net, state_groups, state_loc)

    keys = list(dict.fromkeys(layer_kind))
    step_kind = np.array([keys.index(k) for k in layer_kind], dtype=np.int32)
    residuals = _ResidualBuffers()
    straight_only = straight_line_kinds(step_kind, len(keys), policy.max_period)
    kinds = []
    for k, key in enumerate(keys):
        members = np.flatnonzero(step_kind == k)
        layers = tuple(net.layers[n] for n in members)
        first = layers[0]
        out_aval, treedef, sources, own, kept, recipes, probe = kind_info[key]
        pgroups = tuple(slot(p)[0] for p in first.params)
        rgroups = tuple(read_slot(r)[0] for r in first.reads)
        ogroup = state_loc[first.name][0]
        by_member = MemberRows(
            params=_table([[slot(p)[1] for p in layer.params] for layer in layers], len(pgroups)),
            reads=_table([[read_slot(r)[1] for r in layer.reads] for layer in layers], len(rgroups)),
            out=_table([[state_loc[layer.name][1]] for layer in layers], 1)[:, 0])
        kinds.append(Kind(
            fn=_fresh(first.fn), layers=layers, param_groups=pgroups, read_groups=rgroups, out_group=ogroup,
            by_member=by_member, by_step=_by_step(by_member, members, len(net.layers), state_groups, rgroups, ogroup),
            out_aval=out_aval, vjp_treedef=treedef, res_sources=sources, kept=kept,
            recipes=recipes, probe=probe, **residuals.assign(own, len(layers), as_rows=k in straight_only)))
    unrolled = engine == "unrolled" or (engine == "auto" and not policy.loop_pays(len(net.layers), len(kinds)))
    return Plan(net=net, state_groups=state_groups, param_groups=param_groups, state_loc=state_loc,
                param_loc=param_loc, kinds=tuple(kinds), step_kind=step_kind, res_avals=tuple(residuals.avals),
                res_rows=tuple(residuals.rows), res_as_rows=tuple(residuals.as_rows), unrolled=unrolled,
                max_period=policy.max_period, computations=tuple(computations), serial=next(_serials))


def _table(rows: list[list[int]], width: int) -> np.ndarray:
    """``rows`` as an int32 table of ``width`` columns, with a pad row of zeros appended."""
    return np.array([*rows, [0] * width], dtype=np.int32).reshape(len(rows) + 1, width)


def _by_step(by_member: MemberRows, members: np.ndarray, n_steps: int, state_groups: tuple[Group, ...],
             read_groups: tuple[int, ...], out_group: int) -> StepRows:
    """A kind's rows per step of the loop: its members' at their steps, pad rows elsewhere."""
    pads = np.array([state_groups[g].pad_row for g in read_groups], dtype=np.int32)
    member = np.full(n_steps, len(members), dtype=np.int32)
    member[members] = np.arange(len(members))
    out = np.full(n_steps, state_groups[out_group].pad_row, dtype=np.int32)
    out[members] = by_member.out[:-1]
    reads = np.tile(pads, (n_steps, 1)).reshape(n_steps, len(read_groups))
    reads[members] = by_member.reads[:-1]
    return StepRows(member=member, out=out, reads=reads)


class _ResidualBuffers:
    """The stored residuals of all kinds share one buffer per shape and dtype; each kind's
    members take consecutive rows of it. Kinds that only run straight-line (``as_rows``: a
    transformer's embedding and head) get buffers of their own kept as lists of rows: plain
    values, where rows of a shared buffer are zeroed and written outside the loops (≈ 10 kernels
    of a 12-block GPT)."""

    def __init__(self) -> None:
        self.avals: list[Aval] = []
        self.rows: list[int] = []
        self.as_rows: list[bool] = []

    def assign(self, own: tuple[Aval, ...], members: int, as_rows: bool = False) -> dict[str, tuple[int, ...]]:
        """Rows for ``members`` layers storing residuals ``own``: per residual, its buffer and the
        row of the first member (the Kind fields ``own_groups`` and ``own_offsets``)."""
        groups, offsets = [], []
        for a in own:
            a = Aval(a.shape, a.dtype, sharding=explicit_sharding(a))
            r = None if as_rows else next((r for r, (b, own) in enumerate(zip(self.avals, self.as_rows))
                                           if b == a and not own), None)
            if r is None:  # a new buffer
                r = len(self.avals)
                self.avals.append(a)
                self.rows.append(0)
                self.as_rows.append(as_rows)
            groups.append(r)
            offsets.append(self.rows[r])
            self.rows[r] += members
        return {"own_groups": tuple(groups), "own_offsets": tuple(offsets)}


def _fresh(fn: Any) -> Any:
    """``fn`` as a new function object. JAX's trace caches (``jax.vjp``, ``jax.jvp``) compare
    functions with ``==``: two layer functions that compare equal but compute different things
    (dataclass fields with ``compare=False``) would share one trace."""

    def kind_fn(theta: tuple, *inputs: Any) -> Any:
        return fn(theta, *inputs)

    return kind_fn


def _row_aval(avals: dict[Hashable, Any], p: Hashable) -> Any:
    """The aval a layer receives for a block or state name (one row of it for a ``Row``)."""
    if isinstance(p, Row):
        return jax.tree.map(_row_of, avals[p.block])
    return avals[p]


def _check_stacks(net: Network, groups: tuple[Group, ...], loc: dict[Hashable, tuple[int, Any]]) -> None:
    """Every [`Stack`][linbackprop.Stack] output holds states of one structure, shape and dtype (one group)."""
    for item in net.output_spec:
        if isinstance(item, Stack):
            first = item.names[0]
            for name in item.names:
                # Groups may differ in weak types alone (a Python scalar input beside a state):
                # jnp.stack of such states is strongly typed, and so is the Stack.
                if loc[name][1] is None or loc[first][1] is None or (
                        loc[name][0] != loc[first][0]
                        and _strong(groups[loc[name][0]].row_avals()) != _strong(groups[loc[first][0]].row_avals())):
                    shown = lambda n: groups[loc[n][0]].row_avals() if loc[n][1] is not None else "a stacked input"
                    raise ValueError(
                        f"{item!r}: state {name!r} ({shown(name)}) and state {first!r} ({shown(first)}) differ in "
                        "structure, shape or dtype; a Stack needs states of one shape.")


def _strong(tree: Any) -> Any:
    """Structure, shapes and dtypes of a pytree of avals, weak types left out."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((tuple(a.shape), dtype_key(a.dtype)) for a in leaves)


# -- the struct codec: a pytree of avals as a hashable (treedef, per leaf (shape, dtype, sharding,
# weak type)), the key of the plan cache and of the groups, and back
def _encoded(treedef: Any, avals: Any) -> tuple:
    return treedef, tuple((tuple(a.shape), dtype_key(a.dtype), explicit_sharding(a), bool(a.weak_type)) for a in avals)


def _structure(tree: Any) -> tuple:
    """The struct of a pytree of avals."""
    leaves, treedef = jax.tree.flatten(tree)
    return _encoded(treedef, leaves)


def _struct_of(tree: Any, where: str) -> tuple:
    """The struct of a pytree of arrays, each leaf checked (``where`` names it in errors)."""
    return _encoded(*avals_of(tree, where))


def _leaf_avals(struct: tuple) -> tuple[Aval, ...]:
    return tuple(Aval(s, d, sharding=x, weak_type=w) for s, d, x, w in struct[1])


def _unstruct(struct: tuple) -> Any:
    """The pytree of avals a struct encodes."""
    return struct[0].unflatten(list(_leaf_avals(struct)))


def _stacked_group(name: Hashable, struct: tuple) -> Group:
    """The group of a stacked block or input: its own, one row per leading index."""
    leaves = _leaf_avals(struct)
    return Group(struct[0], tuple(_row_of(a) for a in leaves), (name,), False, leaves[0].shape[0])


def _row_of(a: Aval) -> Aval:
    """The aval of one row of a stacked leaf."""
    sharding = explicit_sharding(a)
    if sharding is not None:
        sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*sharding.spec[1:]))
    return Aval(a.shape[1:], a.dtype, sharding=explicit_sharding(Aval(a.shape[1:], a.dtype, sharding=sharding)),
                weak_type=a.weak_type)


def _group(items: list[tuple[Hashable, Any]], pad: bool) -> tuple[tuple[Group, ...], dict]:
    by_key: dict[Any, list[Hashable]] = {}
    avals: dict[Any, Any] = {}
    for name, aval in items:
        key = _structure(aval)
        by_key.setdefault(key, []).append(name)
        avals[key] = aval
    groups, loc = [], {}
    for g, (key, names) in enumerate(by_key.items()):
        groups.append(Group(treedef=key[0], leaves=_leaf_avals(key), names=tuple(names), pad=pad))
        for slot, name in enumerate(names):
            loc[name] = (g, slot)
    return tuple(groups), loc


def plan_for(net: Network, theta: dict[Hashable, Any], inputs: tuple[Any, ...], engine: str = "auto",
             policy: Policy = POLICY) -> Plan:
    """Validate the arguments' leaves and return the (cached) plan for their shapes.

    ``engine``: "loop" (``lax.fori_loop`` substitutions), "unrolled", or "auto" (`Policy.loop_pays`).
    """
    param_structs = tuple(_struct_of(theta[p], f"Parameter block {p!r}") for p in net.param_names)
    input_structs = tuple(_struct_of(x, f"Network input {name!r}") for name, x in zip(net.inputs, inputs))
    with mesh_of((theta, inputs)):  # the layers' analysis types its arrays on the arguments' mesh
        return make_plan(net, param_structs, input_structs, engine, _generation[0], policy)


# Bumped whenever a plan is found stale: every plan and compiled solve is then made anew (what
# changed — a global a layer reads — may be read by any network's layers, and by the segments
# of checkpointed calls, which are networks of their own).
_generation = [0]
_generation_lock = threading.Lock()


# each plan made takes the next number: a plan numbered after a call began was made during it,
# from what the layers compute now (in whichever thread made it)
_serials = itertools.count(1)


def plans_generation() -> int:
    """The generation of the plans: caches of what is compiled from plans key on it too."""
    return _generation[0]


def current_plan(net: Network, theta: dict[Hashable, Any], inputs: tuple[Any, ...], engine: str = "auto",
                 policy: Policy = POLICY) -> Plan:
    """`plan_for`, made anew — with every cached plan and compiled solve — where a layer
    computes something other than when its plan was made (a Python global it reads changed:
    ``computation_of`` differs). Called where a network call enters the solve from user code
    (once per trace: each kind's layer traced once more), so that outside the user's ``jit`` a
    result is always what ``jax.grad`` gives; under it, JAX's own caching holds."""
    began = next(_serials)
    plan = plan_for(net, theta, inputs, engine, policy)
    if plan.serial > began:  # made just now, from what the layers compute now
        return plan
    with mesh_of((theta, inputs)):
        stale = any(computation_of(layer, th, ins) != was for layer, th, ins, was in plan.computations)
    if stale:
        with _generation_lock:
            _generation[0] += 1
        plan = plan_for(net, theta, inputs, engine, policy)
    return plan
