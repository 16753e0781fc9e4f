"""From the jaxpr to a Network: `build` splits it into before (data) / the network (the marked
calls and the glue between them, one layer function per equal program) / after (the loss),
and `Program` evaluates it in that order; `Capture` is what `capture` returns.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Literal

from .._graph import Constant, Layer, Network, Row, dependents, needed_equations, read, run_equations
from ._inlining import NoInput, ScanRows, inline_calls, marked_index, static_rows
from ._stacks import stacked_outputs


# -- the captured program -----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Capture:
    """A network found in a model by `capture`.

    Attributes:
        net: the ``Network`` found: its layers are the marked calls and the glue between them.
        params: its parameter blocks, ``{name: array}``, named by their paths in the
            differentiated argument (``jax.tree_util.keystr``).
        inputs: its inputs (the data it reads), in ``net.inputs`` order.

    Examples:
        >>> import jax.numpy as jnp, linbackprop as lbp
        >>> dense = lbp.layer(lambda W, x: jnp.tanh(x @ W))
        >>> loss = lambda p, x: jnp.sum(dense(p, x))
        >>> cap = lbp.capture(loss, jnp.eye(2), jnp.ones((1, 2)), layers=dense)
        >>> out = cap.net(cap.params, *cap.inputs)  # one output: the state itself
        >>> out.shape, bool(jnp.allclose(out, jnp.tanh(1.0)))
        ((1, 2), True)
    """

    net: Network
    params: dict[Hashable, Any]
    inputs: tuple[Any, ...]


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
    """``fun``'s jaxpr as before / network / after: ``run(diff, rest)`` evaluates it with the
    network called once (differentiated by the solve inside the transforms)."""

    net: Network
    before: tuple  # equations evaluated before the network
    after: tuple  # ... and after it
    invars: tuple  # the jaxpr's invars: the differentiated leaves, then the others
    constvars: tuple
    consts: tuple
    outvars: tuple
    block_vars: tuple  # per block of net.param_names: its invar
    input_atoms: tuple  # per network input: the atom it is
    output_vars: tuple  # per network output (a state): the vars it holds
    calls: tuple  # display names of the marked calls (for errors)
    unbatched: tuple = ()  # per network input: fed with a leading axis of one (`FromUnbatched`)
    one: Program | None = None  # fun traced on one example (`at_any_batch`): its loss side runs there

    def _fed(self, inputs: list) -> list:
        return [x[None] if wrap else x for x, wrap in zip(inputs, self.unbatched or [False] * len(inputs))]

    def blocks(self, diff: Sequence[Any]) -> dict[Hashable, Any]:
        env = dict(zip(self.invars, diff))
        return {name: env[v] for name, v in zip(self.net.param_names, self.block_vars)}

    def _before(self, leaves: Sequence[Any]) -> dict[Any, Any]:
        """The values after the equations before the network, by variable."""
        env: dict[Any, Any] = dict(zip(self.constvars, self.consts))
        env.update(zip(self.invars, leaves))
        run_equations(self.before, env)
        return env

    def run(self, leaves: Sequence[Any]) -> list[Any]:
        env = self._before(leaves)
        inputs = self._fed([read(env, a) for a in self.input_atoms])
        outs = self.net({name: env[v] for name, v in zip(self.net.param_names, self.block_vars)}, *inputs)
        outs = (outs,) if self.net.single_output else outs
        for state, vars_ in zip(outs, self.output_vars):
            env.update(zip(vars_, state if len(vars_) > 1 else (state,)))
        run_equations(self.after, env)
        return [read(env, a) for a in self.outvars]

    def inputs_of(self, leaves: Sequence[Any]) -> tuple[Any, ...]:
        env = self._before(leaves)
        return tuple(self._fed([read(env, a) for a in self.input_atoms]))


# -- from the jaxpr to a Network ----------------------------------------------------------------
_FUNCTIONS: collections.OrderedDict[Hashable, Callable] = collections.OrderedDict()
NETWORKS: collections.OrderedDict[Hashable, Program] = collections.OrderedDict()
CACHED = 64


def shared_value(key: Hashable, make: Callable[[], Any], cache: collections.OrderedDict) -> Any:
    if key in cache:
        cache.move_to_end(key)
        return cache[key]
    value = cache[key] = make()
    if len(cache) > CACHED:
        cache.popitem(last=False)
    return value


def _input_name(var: Any, origin: dict, taken: set) -> str:
    """A network input's name: the argument's (``tokens``, ``batch[0]``) where it is one, else
    ``<argument>.<k>`` for the k-th value computed from it before the network."""
    source = origin.get(var, ("from", "input"))
    if isinstance(source, str) and source not in taken:
        return source
    base = source[1] if isinstance(source, tuple) else source
    k = 1
    while f"{base}.{k}" in taken:
        k += 1
    return f"{base}.{k}"


@dataclasses.dataclass(frozen=True)
class FromParam:
    """A layer's operand: its ``k``-th parameter block."""

    k: int

    def value(self, theta: tuple, states: tuple) -> Any:
        return theta[self.k]


@dataclasses.dataclass(frozen=True)
class FromRead:
    """A layer's operand: output ``j`` of the node it reads ``r``-th, a node of several outputs (a
    captured call's results)."""

    r: int
    j: int

    def value(self, theta: tuple, states: tuple) -> Any:
        return states[self.r][self.j]


@dataclasses.dataclass(frozen=True)
class FromState:
    """A layer's operand: the state it reads ``r``-th, whole — a network input (data computed
    before the network) or the output of a node with one output. One spec for both, so that a
    chain's first step, which reads an input, is the same kind of layer as the steps after it,
    which read the step before (an unrolled scan: one kind, not two)."""

    r: int

    def value(self, theta: tuple, states: tuple) -> Any:
        return states[self.r]


@dataclasses.dataclass(frozen=True)
class FromConstant:
    """A layer's operand: an array ``fun`` closes over (a concrete constant, no tracer): part of
    the layer, not a network input, since a constant has no batch axis (its leading axis may
    equal the batch size by chance)."""

    constant: Constant

    def value(self, theta: tuple, states: tuple) -> Any:
        return self.constant.value


@dataclasses.dataclass(frozen=True)
class FromUnbatched:
    """A layer's operand: the network input it reads ``r``-th, fed with a leading axis of one in
    front (`Program.unbatched`): data that is not per example (a frozen parameter argument)
    whose leading axis equals the batch by chance. The per-example transforms take a state's
    leading axis for the examples where it equals the batch; with the axis in front it is one."""

    r: int

    def value(self, theta: tuple, states: tuple) -> Any:
        return states[self.r][0]


Operand = FromParam | FromRead | FromState | FromConstant | FromUnbatched


def _unmarked(eqn: Any, args: list) -> list | None:
    """A marked call run as its own program, without its (numbered) jit."""
    if marked_index(eqn) is None:
        return None
    return jax.extend.core.jaxpr_as_fun(eqn.params["jaxpr"])(*args)


def _layer_fn(eqns: tuple, operands: tuple, outs: tuple, specs: tuple[Operand, ...], name: str = "layer") -> Callable:
    """A layer function ``fn(theta, *states)`` running ``eqns`` with its operands taken as
    ``specs`` says (per operand: a parameter block, an output of a node read, a network input):
    returns the tuple of ``outs``. Equal programs share one function object (one kind), named
    after the first call it was made for (``Attention``, ``glue``)."""
    def raw(*values: Any) -> tuple:
        env = dict(zip(operands, values))
        run_equations(eqns, env, _unmarked)
        return tuple(read(env, a) for a in outs)

    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type) for v in operands]
    closed = jax.make_jaxpr(raw)(*avals)
    key = (str(closed.jaxpr), tuple(Constant(c) for c in closed.consts), specs)
    return shared_value(key, lambda: _replay(specs, {_operand_shapes(avals): closed}, name), _FUNCTIONS)


def _operand_shapes(values: Sequence[Any]) -> tuple:
    return tuple(tuple(np.shape(v)) for v in values)


def _replay(specs: tuple, programs: dict[tuple, ClosedJaxpr], name: str) -> Callable:
    """``fn(theta, *states)``: the program of ``programs`` traced at its operands' shapes, run on
    the operands ``specs`` picks (a call traced at the batch and at one example has two)."""
    def fn(theta: tuple, *states: Any) -> tuple:
        values = [spec.value(theta, states) for spec in specs]
        shapes = _operand_shapes(values)
        if shapes not in programs:
            raise ValueError(
                f"Layer {name!r} was found by layers= and replays the program traced at the call's shapes "
                f"{list(next(iter(programs)))}; it was called with {list(shapes)}. A layer "
                "found in a model runs at the shapes fun was traced at (the transforms trace fun again for "
                "other shapes): build the Network with lbp.Layer for functions of any shape.")
        out = jax.extend.core.jaxpr_as_fun(programs[shapes])(*values)
        return out[0] if len(out) == 1 else tuple(out)  # one output: the state itself

    fn.__name__ = fn.__qualname__ = name
    fn.__linbackprop_captured__ = True  # per-example checks say so in their errors
    fn.__linbackprop_programs__ = programs  # read by `at_any_batch`
    fn.__linbackprop_specs__ = specs
    return fn


def at_any_batch(full: Program, one: Program) -> Program:
    """``full`` (``fun`` traced at its batch) whose layers also run on one example: each layer
    function holds both programs, ``full``'s and that of the same call in ``one`` (``fun`` traced
    with its batched data sliced to one example), chosen by the operands' shapes. The
    per-example transforms evaluate each layer on one example; a program traced at the batch
    keeps it in its reshapes, broadcasts and gathers."""
    mine, theirs = full.net, one.net
    def shape_of(net: Network) -> list:
        return [(lay.name, lay.reads, lay.params) for lay in net.layers]

    if shape_of(mine) != shape_of(theirs) or mine.inputs != theirs.inputs or mine.outputs != theirs.outputs:
        raise ValueError(
            "layers=: fun traced on one example finds another network than on the whole batch "
            f"(layers {[lay.name for lay in mine.layers][:8]} reading {[lay.reads for lay in mine.layers][:8]} vs "
            f"{[lay.name for lay in theirs.layers][:8]} reading {[lay.reads for lay in theirs.layers][:8]}). "
            "Per-example quantities trace fun again with every data argument whose leading axis is the batch "
            "sliced to one example: make the model's structure independent of the batch size, or use "
            "jax.vmap(jax.grad) of a per-example loss.")
    def merged(a: Callable, b: Callable) -> Callable:
        specs = a.__linbackprop_specs__
        if specs != b.__linbackprop_specs__:
            raise ValueError(f"layers=: layer {a.__name__!r} reads other operands on one example than on the batch; "
                             "per-example quantities need the same call at both sizes.")
        key = ("any batch", a, b)  # functions compare by identity
        programs = {**b.__linbackprop_programs__, **a.__linbackprop_programs__}
        return shared_value(key, lambda: _replay(specs, programs, a.__name__), _FUNCTIONS)

    layers = [Layer(lay.name, merged(lay.fn, other.fn), reads=lay.reads, params=lay.params)
              for lay, other in zip(mine.layers, theirs.layers)]
    outputs = mine.output_spec[0] if mine.single_output else list(mine.output_spec)  # Stacks kept
    net = Network(layers, inputs=list(mine.inputs), outputs=outputs)
    return dataclasses.replace(full, net=net, one=one)


def _read_equations(eqns: list, outvars: list) -> list:
    """The equations something reads (the outputs, or an equation kept), those with effects, and
    every marked call that reads a traced value (a layer is a call of the user's, read or not).
    A marked call of constants alone whose result nothing reads is no layer: linen's ``nn.scan``
    calls its body once more to learn the carry's shape (a ``length=5`` scan gave six layers)."""
    def keep(e: Any) -> bool:
        return bool(e.effects) or (marked_index(e) is not None and any(not isinstance(a, Literal) for a in e.invars))

    return needed_equations(eqns, outvars, keep=keep)


def build(closed: ClosedJaxpr, n_diff: int, block_names: Sequence[Hashable], calls: Sequence[str],
          rest_names: Sequence[str] = (), unbatched: frozenset[str] = frozenset()) -> Program:
    """The Program of ``closed`` (``fun`` traced with its marked calls), whose first ``n_diff``
    invars are the differentiated leaves named ``block_names`` and the others the arrays named
    ``rest_names`` (the network's inputs are named after them: ``tokens``, or ``tokens.1`` for a
    value computed from ``tokens`` before the network). ``unbatched``: the inputs read as
    `FromUnbatched` (named by the per-example transforms' retrace, `_rewrite._at_one_example`)."""
    found = ScanRows()
    eqns, constvars, consts, outvars = inline_calls(closed.jaxpr, closed.consts, found)
    eqns = _read_equations(eqns, outvars)
    invars = list(closed.jaxpr.invars)
    diff_vars = set(invars[:n_diff])
    block_of_var: dict = dict(zip(invars[:n_diff], block_names))
    static_rows(eqns, diff_vars, found)
    for row, (source, t) in found.rows.items():  # rows of stacked blocks a scan iterates over: Row blocks
        if source in block_of_var:
            block_of_var[row] = Row(block_of_var[source], t)
    # the equations slicing those rows are no glue: the layers read the rows as Row blocks
    rows_of_blocks = {v for v, src in found.chains.items() if src in block_of_var and
                      not isinstance(block_of_var[src], Row)}
    diff_vars |= set(block_of_var)
    marked = [marked_index(e) for e in eqns]
    if not any(m is not None for m in marked):
        raise ValueError("layers=: no call of the layers named was found in fun (check that fun calls them, "
                         "with the classes or @lbp.layer functions passed to layers=).")
    # which equations depend on a layer's output or a differentiated leaf, and which feed a layer
    is_marked = lambda e: marked_index(e) is not None
    moving = dependents(eqns, diff_vars, also=is_marked)
    feeding = {id(e) for e in needed_equations(eqns, (), keep=is_marked)}
    feeds = [id(e) in feeding for e in eqns]
    in_net = [m is not None or (feeds[n] and any(a in moving for a in e.invars if not isinstance(a, Literal))
                                and not all(o in rows_of_blocks for o in e.outvars))  # a Row: read as a block
              for n, (e, m) in enumerate(zip(eqns, marked))]
    # a stacked block read whole by some node (glue: a norm of all the weights) and by rows by
    # others (a scan's steps): the rows become a block of their own, the same argument leaf (its
    # gradient the sum of both uses, as jax.grad's), since a Network reads a block one way only
    whole_read = {a for e, inside in zip(eqns, in_net) if inside for a in e.invars
                  if not isinstance(a, Literal) and a in block_of_var and not isinstance(block_of_var[a], Row)}
    rows_source: dict = {}  # a block of rows made its own -> the argument leaf's var
    for row, (source, t) in found.rows.items():
        if source in whole_read and isinstance(block_of_var.get(row), Row):
            rows_block = f"{block_of_var[source]} (rows)"
            block_of_var[row] = Row(rows_block, t)
            rows_source[rows_block] = source
    # before the network: what depends on none of its values; after it: the rest (the loss)
    tainted: set = set()
    before, after = [], []
    for e, inside in zip(eqns, in_net):
        if inside:
            tainted.update(e.outvars)
        elif any(a in tainted for a in e.invars if not isinstance(a, Literal)):
            tainted.update(e.outvars)
            after.append(e)
        else:
            before.append(e)
    before, after = tuple(before), tuple(after)
    fed_whole: dict = {}  # network input atom -> fed with a leading axis of one
    origin = dict(zip(invars[n_diff:], rest_names))  # var -> the argument it is, or is computed from
    for e in before:
        sources = [origin[a] for a in e.invars if not isinstance(a, Literal) and a in origin]
        for o in e.outvars:
            first = sources[0] if sources else "input"
            origin.setdefault(o, first if isinstance(first, tuple) else ("from", first))
    # the network's nodes: each marked call, and each run of glue between them
    nodes: list[tuple[str, list]] = []
    seen_names = collections.Counter()  # a call's name, numbered in order (a scan's steps repeat one call)
    glue_open = False  # the last node is a run of glue, which the next unmarked equation joins
    for e, inside, m in zip(eqns, in_net, marked):
        if not inside:
            continue
        if m is not None:
            nodes.append((f"{calls[m]}{seen_names[calls[m]]}", [e]))
            seen_names[calls[m]] += 1
            glue_open = False
        elif glue_open:
            nodes[-1][1].append(e)
        else:
            nodes.append((f"glue{seen_names['glue']}", [e]))
            seen_names["glue"] += 1
            glue_open = True
    producer: dict = {}
    used_later: set = set()
    for e in after:
        used_later.update(a for a in e.invars if not isinstance(a, Literal))
    used_later.update(a for a in outvars if not isinstance(a, Literal))
    readers: dict = collections.defaultdict(set)  # var -> the nodes that read it
    for n, (_, node_eqns) in enumerate(nodes):
        for e in node_eqns:
            for a in e.invars:
                if not isinstance(a, Literal):
                    readers[a].add(n)
    data_rows = {row: (source, t) for row, (source, t) in found.rows.items()
                 if source not in block_of_var and source not in moving}
    inputs: dict = {}  # atom -> input name
    constants = {v: Constant(c) for v, c in zip(constvars, consts)
                 if np.ndim(c) and not isinstance(c, jax.core.Tracer)}  # arrays fun closes over
    layers = []
    output_vars: dict[Hashable, list] = {}
    outputs_of: dict[str, int] = {}  # per node: how many outputs (one: its state is that value)
    for n, (name, node_eqns) in enumerate(nodes):
        defined = {o for e in node_eqns for o in e.outvars}
        operands, specs, params, reads = [], [], [], []
        for e in node_eqns:
            for a in e.invars:
                if isinstance(a, Literal) or a in defined or a in operands:
                    continue
                operands.append(a)
                if a in block_of_var:
                    if block_of_var[a] not in params:
                        params.append(block_of_var[a])
                    specs.append(FromParam(params.index(block_of_var[a])))
                elif a in producer:
                    src, j = producer[a]
                    if src not in reads:
                        reads.append(src)
                    specs.append(FromState(reads.index(src)) if outputs_of[src] == 1 else FromRead(reads.index(src), j))
                elif a in constants:
                    specs.append(FromConstant(constants[a]))
                else:  # data: a value computed before the network, an argument, a traced constant
                    # row t of an array a scan iterates over (a sequence's step): a Row of that
                    # array, one input for all the steps, as a hand-built network reads it
                    stacked, t = data_rows.get(a, (a, None))
                    if stacked not in inputs:
                        inputs[stacked] = _input_name(stacked, origin, {*inputs.values(),
                                                                        *(name for name, _ in nodes)})
                    read = inputs[stacked] if t is None else Row(inputs[stacked], t)
                    if read not in reads:
                        reads.append(read)
                    fed_whole[stacked] = t is None and inputs[stacked] in unbatched
                    spec = FromUnbatched if fed_whole[stacked] else FromState
                    specs.append(spec(reads.index(read)))
        outs = [o for e in node_eqns for o in e.outvars if not isinstance(o, jax.extend.core.DropVar)]
        outs = [o for o in outs if o in used_later or readers[o] - {n}] or outs[:1]
        outputs_of[name] = len(outs)
        for j, o in enumerate(outs):
            producer[o] = (name, j)
        if any(o in used_later for o in outs):
            output_vars[name] = outs
        fn = _layer_fn(tuple(node_eqns), tuple(operands), tuple(outs), tuple(specs), name.rstrip("0123456789"))
        layers.append(Layer(name, fn, reads=tuple(reads), params=tuple(params)))
    if not output_vars:
        raise ValueError("layers=: the layers' outputs reach nothing fun returns.")
    input_names = list(inputs.values())
    if not input_names:  # a network needs an input: a dummy one nothing reads (a constant of the program)
        dummy = NoInput()
        input_names, inputs = ["input"], {dummy: "input"}
        constvars, consts = [*constvars, dummy], [*consts, np.float32(0)]
    after, output_vars = stacked_outputs(after, tuple(outvars), output_vars)
    names = list(output_vars)
    net = Network(layers, inputs=input_names, outputs=names[0] if len(names) == 1 else names)
    block_vars = tuple(rows_source[p] if p in rows_source else
                       next(v for v, b in block_of_var.items() if not isinstance(b, Row) and b == p)
                       for p in net.param_names)
    # before the network, only what the network's inputs and the loss read: the steps of an
    # unrolled scan read rows of its xs (Row inputs), which leaves the row slices unread
    read_later = [*inputs, *(a for e in after for a in e.invars), *outvars]
    before = tuple(needed_equations(before, [a for a in read_later if not isinstance(a, NoInput)]))
    return Program(net=net, before=before, after=after, invars=tuple(invars), constvars=tuple(constvars),
                   consts=tuple(consts), outvars=tuple(outvars), block_vars=block_vars,
                   input_atoms=tuple(inputs), output_vars=tuple(tuple(output_vars[n]) for n in names),
                   calls=tuple(calls), unbatched=tuple(fed_whole.get(a, False) for a in inputs))
