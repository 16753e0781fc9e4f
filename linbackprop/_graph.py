"""Layers and networks: the static DAG U_i = Φ_i(S_i(θ), U_j for j in reads(i)).

A [`Network`][linbackprop.Network] only knows names and functions; shapes are looked at when it is called.
Called plainly it is ordinary JAX code (a Python loop over its layers in topological order),
so ``jax.grad`` of a function that calls it is the independent reference for the solve.
Inside [`grad_by_solve`][linbackprop.grad_by_solve] and friends the same call is differentiated by
solving with ℒ = I − D_UΦ instead (see ``_transforms.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from ._stacking import take

__all__ = ["GraphError", "Layer", "Network", "Row", "Stack"]


class GraphError(ValueError):
    """An invalid network graph, raised at [`Network`][linbackprop.Network] construction.

    Examples:
        >>> import linbackprop as lbp
        >>> lbp.Network([lbp.Layer("a", lambda th, u: u, ("a",))], inputs=["x"], outputs="a")
        Traceback (most recent call last):
        ...
        linbackprop._graph.GraphError: Layer 'a' reads itself: a cycle. A layer reads earlier states only.
    """


class Row(NamedTuple):
    """Row ``index`` (along the leading axis) of a stacked parameter block or network input.

    Deep networks of repeated layers are usually written with stacked weights, one array of shape
    ``(depth, ...)`` per parameter, as for ``lax.scan``. A layer that names ``Row("W", i)`` in its
    ``params`` receives ``params["W"][i]`` (leaf by leaf for a pytree block), and the gradient of
    ``"W"`` comes back stacked. The solve then reads the weights in place and writes the gradient
    once: no per-block packing and unpacking.

    In ``reads``, ``Row("xs", t)`` is row t of the network input ``"xs"``, stacked along its
    leading axis like ``lax.scan``'s ``xs`` (a sequence: one input array instead of T inputs).
    A stacked input is read by rows only; its cotangent comes back stacked.

    Attributes:
        block: the stacked parameter block's or input's name.
        index: the row, an int.

    Examples:
        >>> import jax.numpy as jnp, linbackprop as lbp
        >>> step = lambda th, u: u + jnp.tanh(u @ th[0])
        >>> layers = [lbp.Layer(i, step, (i - 1,), (lbp.Row("W", i - 1),)) for i in (1, 2, 3)]
        >>> net = lbp.Network(layers, inputs=[0], outputs=3)
        >>> net.param_names
        ('W',)
        >>> net({"W": jnp.zeros((3, 2, 2))}, jnp.ones((4, 2))).shape
        (4, 2)
        >>> cell = lambda th, h, x: jnp.tanh(h @ th[0] + x)
        >>> reads = lambda t: (t - 1, lbp.Row("xs", t - 1))
        >>> steps = [lbp.Layer(t, cell, reads(t), ("A",)) for t in (1, 2, 3)]
        >>> rnn = lbp.Network(steps, inputs=[0, "xs"], outputs=3)
        >>> rnn({"A": jnp.eye(2)}, jnp.zeros(2), jnp.ones((3, 2))).shape
        (2,)
    """

    block: Hashable
    index: int


class Stack:
    """In a network's ``outputs``: the states ``names``, stacked along a new leading axis (leaf by
    leaf for pytree states), like ``lax.scan``'s ``ys``. ``outputs`` may be one Stack or a list
    mixing Stacks and single names. Under the solve the cotangent of a stacked output goes into
    the back substitution's rows directly (no T separate arrays).

    Attributes:
        names: the stacked states' names, in order (a tuple).

    Examples:
        >>> import jax.numpy as jnp, linbackprop as lbp
        >>> step = lambda th, h: jnp.tanh(h * th[0])
        >>> layers = [lbp.Layer(t, step, (t - 1,), ("a",)) for t in (1, 2, 3)]
        >>> net = lbp.Network(layers, inputs=[0], outputs=[lbp.Stack([1, 2, 3]), 3])
        >>> hs, last = net({"a": 2.0}, jnp.ones(4))
        >>> hs.shape, last.shape
        ((3, 4), (4,))
    """

    __slots__ = ("names",)

    def __init__(self, names: Iterable[Hashable]):
        if isinstance(names, (str, bytes)) or not isinstance(names, Iterable):
            raise TypeError(f"Stack needs a sequence of state names, got {names!r}.")
        names = tuple(names)
        if not names:
            raise GraphError("Stack([]) stacks nothing: give it at least one state name.")
        object.__setattr__(self, "names", names)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Stack is immutable.")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Stack) and self.names == other.names

    def __hash__(self) -> int:
        return hash((Stack, self.names))

    def __len__(self) -> int:
        return len(self.names)

    def __repr__(self) -> str:
        if len(self.names) > 6:
            return f"Stack([{label(self.names[0])}, ..., {label(self.names[-1])}] ({len(self.names)} states))"
        return f"Stack([{', '.join(map(label, self.names))}])"


def block_of(p: Hashable) -> Hashable:
    """The name of the parameter block that a layer's ``params`` entry refers to."""
    return p.block if isinstance(p, Row) else p


def resolve(p: Hashable, theta: Mapping[Hashable, Any]) -> Any:
    """The value a layer receives for its ``params`` entry ``p``."""
    if isinstance(p, Row):
        return jax.tree.map(lambda leaf: leaf[p.index], theta[p.block])
    return theta[p]


@dataclasses.dataclass(frozen=True, eq=False)
class Layer:
    """One layer U_name = fn(theta, *inputs) of a [`Network`][linbackprop.Network].

    Args:
        name: any hashable, unique among the network's inputs and layers.
        fn: ``fn(theta, *inputs) -> state``; ``theta`` is the tuple of the parameter blocks named
            in ``params`` (in that order), ``inputs`` the states named in ``reads``.
        reads: names of the states this layer reads (network inputs or other layers).
        params: names of the parameter blocks this layer uses (S_i of the seed). A block may be
            shared by several layers, or appear twice in one layer. ``Row(name, i)`` names row i
            of a stacked block.

    Examples:
        >>> import jax.numpy as jnp, linbackprop as lbp
        >>> dense = lbp.Layer("h", lambda th, x: jnp.tanh(x @ th[0] + th[1]),
        ...                   reads=("x",), params=("W", "b"))
    """

    name: Hashable
    fn: Callable[..., Any]
    reads: tuple[Hashable, ...] = ()
    params: tuple[Hashable, ...] = ()

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise TypeError(f"Layer {self.name!r}: fn must be callable, got {type(self.fn).__name__}.")
        for field in ("reads", "params"):
            value = getattr(self, field)
            if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
                raise TypeError(
                    f"Layer {self.name!r}: {field} must be a sequence of names, got {value!r}; "
                    f"write {field}=({value!r},) for a single name."
                )
            object.__setattr__(self, field, tuple(value))
        for p in (*self.params, *self.reads):
            if isinstance(p, Row) and (not isinstance(p.index, int) or isinstance(p.index, bool) or p.index < 0):
                raise TypeError(f"Layer {self.name!r}: {p!r} needs a non-negative int index.")
        try:
            hash((self.name, self.reads, self.params))
        except TypeError as err:
            raise TypeError(f"Layer {self.name!r}: names must be hashable ({err}).") from None

    def _key(self) -> tuple:
        # fn by identity: two functions that compare equal may still compute different things
        # (a Network keys jit's and the plan's caches); Row("W", 1) is not the block ("W", 1).
        return (self.name, id(self.fn), tuple((type(r) is Row, r) for r in self.reads),
                tuple((type(p) is Row, p) for p in self.params))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Layer):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


def _topological_order(layers: Sequence[Layer], inputs: tuple[Hashable, ...]) -> tuple[int, ...]:
    """Kahn's algorithm; ties broken by the order the layers were given."""
    index = {layer.name: n for n, layer in enumerate(layers)}
    state_reads = [{r for r in layer.reads if not isinstance(r, Row)} for layer in layers]
    pending = [sum(1 for r in reads if r in index) for reads in state_reads]
    readers: dict[Hashable, list[int]] = {}
    for n, reads in enumerate(state_reads):
        for r in reads:
            if r in index:
                readers.setdefault(r, []).append(n)
    import heapq

    ready = [n for n, count in enumerate(pending) if count == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        n = heapq.heappop(ready)
        order.append(n)
        for m in readers.get(layers[n].name, ()):
            pending[m] -= 1
            if pending[m] == 0:
                heapq.heappush(ready, m)
    if len(order) < len(layers):
        stuck = [layers[n].name for n in range(len(layers)) if pending[n] > 0]
        raise GraphError(
            f"The layers {stuck!r} form a cycle (or read one): a layer may only read network "
            "inputs and layers that do not depend on it."
        )
    return tuple(order)


class Network:
    """A static DAG of layers: U_i = Φ_i(S_i(θ), U_j for j in reads(i)).

    Args:
        layers: [`Layer`][linbackprop.Layer] objects in any order; they are sorted topologically (ties keep
            the order given).
        inputs: names of the input states (U_0 of the seed); several are allowed.
        outputs: a single name (``net(...)`` returns that state) or a sequence of names
            (``net(...)`` returns a tuple). A tuple that is itself the name of a state is that
            single name; write ``[name]`` for a 1-tuple of outputs. A [`Stack`][linbackprop.Stack] of names
            (alone or in the sequence) returns those states stacked on a new leading axis.

    Raises:
        GraphError: duplicate names, reads of unknown states, cycles (self-reads included),
            unknown outputs, a layer named like an input.

    A network is immutable and hashable: close over it or pass it as a static argument.

    Examples:
        >>> import jax.numpy as jnp, linbackprop as lbp
        >>> dense = lambda th, x: jnp.tanh(x @ th[0] + th[1])
        >>> net = lbp.Network([lbp.Layer("h", dense, ("x",), ("W1", "b1")),
        ...                    lbp.Layer("y", dense, ("h",), ("W2", "b2"))],
        ...                   inputs=["x"], outputs="y")
        >>> net.order, net.param_names
        (('h', 'y'), ('W1', 'b1', 'W2', 'b2'))
    """

    def __init__(
        self,
        layers: Iterable[Layer],
        inputs: Sequence[Hashable],
        outputs: Hashable | Stack | Sequence[Hashable | Stack],
    ) -> None:
        layers = tuple(layers)
        for layer in layers:
            if not isinstance(layer, Layer):
                raise TypeError(f"Network layers must be lbp.Layer objects, got {layer!r}.")
        if isinstance(inputs, (str, bytes)) or not isinstance(inputs, Iterable):
            raise GraphError(f"inputs must be a sequence of names, got {inputs!r}; write [{inputs!r}].")
        inputs = tuple(inputs)
        if not inputs:
            raise GraphError("A network needs at least one input state.")
        if not layers:
            raise GraphError("A network needs at least one layer.")
        # A tuple is a sequence of names, unless it is itself the name of a state (("c", 3)).
        names = {*inputs, *(layer.name for layer in layers)}
        self._single_output = (isinstance(outputs, (str, bytes)) or not isinstance(outputs, (list, tuple))
                               or (isinstance(outputs, tuple) and outputs in names))
        spec = (outputs,) if self._single_output else tuple(outputs)
        outputs_t = tuple(n for item in spec for n in (item.names if isinstance(item, Stack) else (item,)))

        seen: set[Hashable] = set()
        for name in inputs:
            if name in seen:
                raise GraphError(f"Duplicate input name {name!r}: input names must be unique.")
            seen.add(name)
        for layer in layers:
            if layer.name in seen:
                what = "an input" if layer.name in inputs else "another layer"
                raise GraphError(
                    f"Layer name {layer.name!r} is already used by {what}: names must be unique "
                    "among inputs and layers."
                )
            seen.add(layer.name)
        for layer in layers:
            for r in layer.reads:
                if isinstance(r, Row):
                    if r.block not in inputs:
                        what = "a layer" if r.block in seen else "no state"
                        raise GraphError(
                            f"Layer {layer.name!r} reads {r!r}, but {r.block!r} is {what}: Row in reads names a "
                            f"row of a stacked network input (one of {list(inputs)!r}).")
                    continue
                if r == layer.name:
                    raise GraphError(f"Layer {layer.name!r} reads itself: a cycle. A layer reads earlier states only.")
                if r not in seen:
                    raise GraphError(
                        f"Layer {layer.name!r} reads unknown state {r!r}; known states are the inputs "
                        f"{list(inputs)!r} and the layers."
                    )
        if not spec:
            raise GraphError("A network needs at least one output.")
        for o in outputs_t:
            if o not in seen:
                raise GraphError(f"Unknown output {o!r}: outputs must name inputs or layers.")

        order = _topological_order(layers, inputs)
        self._layers = tuple(layers[n] for n in order)
        self._given_layers = layers
        self._inputs = inputs
        self._outputs = outputs_t
        self._output_spec = spec
        self._outputs_arg = outputs if self._single_output else spec
        names: list[Hashable] = []
        for layer in self._layers:
            names.extend(b for b in map(block_of, layer.params) if b not in names)
        self._param_names = tuple(names)
        self._stacked = _used_by_rows(self._layers, "params")
        self._stacked_inputs = _used_by_rows(self._layers, "reads")
        self._hash = hash((self._given_layers, self._inputs, self._output_spec, self._single_output))
        self._live: Network | bool | None = None  # False: no layer reaches an output

    # -- the graph ---------------------------------------------------------------------------
    @property
    def layers(self) -> tuple[Layer, ...]:
        """The layers in topological order."""
        return self._layers

    @property
    def order(self) -> tuple[Hashable, ...]:
        """Layer names in topological order (ties: the order given)."""
        return tuple(layer.name for layer in self._layers)

    @property
    def param_names(self) -> tuple[Hashable, ...]:
        """Parameter block names in order of first use along `order`."""
        return self._param_names

    @property
    def stacked_blocks(self) -> frozenset:
        """The blocks that layers use by rows ([`Row`][linbackprop.Row])."""
        return self._stacked

    @property
    def stacked_inputs(self) -> frozenset:
        """The network inputs that layers read by rows ([`Row`][linbackprop.Row] in ``reads``)."""
        return self._stacked_inputs

    @property
    def inputs(self) -> tuple[Hashable, ...]:
        return self._inputs

    @property
    def outputs(self) -> tuple[Hashable, ...]:
        """The names of the states the network returns (those of a [`Stack`][linbackprop.Stack] in order)."""
        return self._outputs

    @property
    def output_spec(self) -> tuple[Hashable | Stack, ...]:
        """What a call returns, item by item: a state's name or a [`Stack`][linbackprop.Stack] of names."""
        return self._output_spec

    @property
    def single_output(self) -> bool:
        """True when ``outputs`` was given as one name, so that a call returns one state."""
        return self._single_output

    @property
    def live(self) -> Network | None:
        """The network without the layers that reach no output (itself when every layer does;
        None when none does: the outputs are network inputs only).

        The outputs do not depend on such layers, so their gradient is exactly zero and they have
        no place in the substitutions: keeping them would cost time and multiply their zero Λ
        with their residuals (NaN where those are NaN or inf, where ``jax.grad`` gives zeros).
        """
        if self._live is None:
            needed = set(self._outputs)
            for layer in reversed(self._layers):
                if layer.name in needed:
                    needed.update(r for r in layer.reads if not isinstance(r, Row))
            if all(layer.name in needed for layer in self._layers):
                self._live = self
            elif not any(layer.name in needed for layer in self._layers):
                self._live = False  # cached: no network
            else:
                kept = [layer for layer in self._given_layers if layer.name in needed]
                self._live = Network(kept, self._inputs, self._outputs_arg)
        return self._live or None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Network):
            return NotImplemented
        return (self._given_layers, self._inputs, self._output_spec, self._single_output) == (
            other._given_layers,
            other._inputs,
            other._output_spec,
            other._single_output,
        )

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        """One line per layer in topological order: ``name = fn(reads; params)``."""
        outs = self._output_spec[0] if self._single_output else list(self._output_spec)
        lines = [f"Network(inputs={list(self._inputs)!r}, outputs={outs!r}, "
                 f"{len(self._layers)} layers, {len(self._param_names)} parameter blocks)"]
        for layer in self._layers:
            reads = ", ".join(label(r) for r in layer.reads)
            params = ", ".join(label(p) for p in layer.params)
            fn_name = getattr(layer.fn, "__name__", type(layer.fn).__name__)
            lines.append(f"  {label(layer.name)} = {fn_name}({reads}" + (f"; {params})" if params else ")"))
        return "\n".join(lines)

    # -- evaluation ----------------------------------------------------------------------------
    def select_params(self, params: Mapping[Hashable, Any]) -> dict[Hashable, Any]:
        """The blocks of ``params`` this network uses, checked to be present."""
        if not isinstance(params, Mapping):
            raise TypeError(
                f"params must be a mapping from block name to block, got {type(params).__name__}."
            )
        missing = [p for p in self._param_names if p not in params]
        if missing:
            users = {p: [layer.name for layer in self._layers if p in map(block_of, layer.params)] for p in missing}
            detail = "; ".join(f"block {p!r} used by layer(s) {u!r}" for p, u in users.items())
            raise KeyError(f"Missing parameter block(s): {detail}. Add them to the params mapping.")
        theta = {p: params[p] for p in self._param_names}
        self._check_rows(theta)
        return theta

    def _check_rows(self, theta: Mapping[Hashable, Any]) -> None:
        """Every Row(block, i) exists (JAX would clamp an index out of range silently)."""
        for block, (index, layer) in _largest_rows(self._layers, "params").items():
            _check_stacked(theta[block], f"parameter block {block!r}", Row(block, index), layer)

    def check_inputs(self, inputs: tuple[Any, ...]) -> None:
        """The right number of inputs, and every Row of a stacked input within its leading axis."""
        if len(inputs) != len(self._inputs):
            raise TypeError(
                f"The network has {len(self._inputs)} input(s) {list(self._inputs)!r} but was called "
                f"with {len(inputs)}: call net(params, {', '.join(map(str, self._inputs))})."
            )
        given = dict(zip(self._inputs, inputs))
        for name, (index, layer) in _largest_rows(self._layers, "reads").items():
            _check_stacked(given[name], f"network input {name!r}", Row(name, index), layer)

    def states(self, params: Mapping[Hashable, Any], *inputs: Any) -> dict[Hashable, Any]:
        """All states by name, inputs included: the plain forward substitution U = Φ(U, θ)."""
        self.check_inputs(inputs)
        theta = self.select_params(params)
        rows = self._read_rows(theta)
        states: dict[Hashable, Any] = dict(zip(self._inputs, inputs))
        input_rows = _rows_read(self._layers, "reads", states)
        for layer in self._layers:
            inputs_i = tuple(input_rows[r] if isinstance(r, Row) else states[r] for r in layer.reads)
            states[layer.name] = call_layer(layer, layer_theta(layer, theta, rows), inputs_i)
        return states

    def _read_rows(self, theta: Mapping[Hashable, Any]) -> dict[Row, Any]:
        """Every ``Row`` of a parameter block the layers use."""
        return _rows_read(self._layers, "params", theta)

    def __call__(self, params: Mapping[Hashable, Any], *inputs: Any) -> Any:
        """The output state(s). Differentiated by the solve inside ``grad_by_solve``."""
        return _call(self, params, inputs)

    def pick_outputs(self, states: Mapping[Hashable, Any]) -> Any:
        """What a call returns, from all states by name (a [`Stack`][linbackprop.Stack] stacked leaf by leaf)."""
        outs = tuple(stack_states(item, [states[n] for n in item.names]) if isinstance(item, Stack)
                     else states[item] for item in self._output_spec)
        return outs[0] if self._single_output else outs


def stack_states(stack: Stack, values: list[Any]) -> Any:
    """The states of ``stack`` stacked along a new leading axis, leaf by leaf."""
    structures = [jax.tree.structure(v) for v in values]
    shapes = [[(tuple(jnp.shape(x)), jnp.result_type(x)) for x in jax.tree.leaves(v)] for v in values]
    for name, st, sh in zip(stack.names, structures, shapes):
        if st != structures[0] or sh != shapes[0]:
            raise ValueError(
                f"{stack!r}: state {name!r} ({st}, {sh}) differs in structure, shape or dtype from "
                f"{stack.names[0]!r} ({structures[0]}, {shapes[0]}); a Stack needs states of one shape.")
    return jax.tree.map(lambda *xs: jnp.stack(xs), *values)


def _rows_read(layers: tuple[Layer, ...], field: str, stacked: Mapping[Hashable, Any]) -> dict[Row, Any]:
    """Every ``Row`` the layers name in ``field`` ("params" or "reads"), read from its stacked
    value in one pass (``take``: one kernel however many rows, where static slices would compile
    one kernel each)."""
    used: dict[Hashable, set[int]] = {}
    for layer in layers:
        for p in getattr(layer, field):
            if isinstance(p, Row):
                used.setdefault(p.block, set()).add(p.index)
    out = {}
    for block, indices in used.items():
        indices = sorted(indices)
        out.update((Row(block, i), v) for i, v in zip(indices, take(stacked[block], indices)))
    return out


def _used_by_rows(layers: tuple[Layer, ...], field: str) -> frozenset:
    """The blocks (``field="params"``) or network inputs (``"reads"``) that layers use by rows,
    checked to be used by rows only."""
    by_rows: dict[Hashable, Hashable] = {}  # name -> a layer using its rows
    whole: dict[Hashable, Hashable] = {}  # name -> a layer using it whole
    for layer in layers:
        for p in getattr(layer, field):
            (by_rows if isinstance(p, Row) else whole).setdefault(block_of(p), layer.name)
    for name in by_rows.keys() & whole.keys():
        if field == "params":
            what, how, verb, fix = "Parameter block", "used", "use", "give the two uses different blocks"
        else:
            what, how, verb, fix = "Network input", "read", "read", "pass it as two inputs"
        raise GraphError(
            f"{what} {name!r} is {how} whole by layer {whole[name]!r} and by rows (Row({name!r}, i)) by "
            f"layer {by_rows[name]!r}: {verb} it one way only, or {fix}.")
    return frozenset(by_rows)


def _largest_rows(layers: tuple[Layer, ...], field: str) -> dict[Hashable, tuple[int, Hashable]]:
    """Per stacked block or input named by ``Row`` in ``field``: the largest row index and a layer
    that uses it."""
    used: dict[Hashable, tuple[int, Hashable]] = {}
    for layer in layers:
        for r in getattr(layer, field):
            if isinstance(r, Row) and r.index >= used.get(r.block, (-1, None))[0]:
                used[r.block] = (r.index, layer.name)
    return used


def _check_stacked(tree: Any, what: str, row: Row, layer: Hashable) -> None:
    """``tree`` (a stacked block or input) has row ``row.index`` in every leaf, and as many rows in each."""
    shapes = [tuple(getattr(leaf, "shape", ())) for leaf in jax.tree.leaves(tree)]
    if not shapes or any(len(sh) == 0 or sh[0] <= row.index for sh in shapes):
        verb = "reads" if what.startswith("network input") else "uses"
        raise ValueError(f"Layer {layer!r} {verb} {row!r}, but {what} has leaf shapes {shapes}: a stacked "
                         "value needs a leading axis longer than every row index used.")
    if len({sh[0] for sh in shapes}) > 1:
        raise ValueError(f"Stacked {what} has leaves with different leading axes {shapes}: every leaf needs "
                         "the same number of rows.")


def _plain_call(net: Network, params: Mapping[Hashable, Any], inputs: tuple[Any, ...]) -> Any:
    return net.pick_outputs(net.states(params, *inputs))


# How a network call runs. The transforms, a layer above, install theirs (``set_call``): inside them
# the call is differentiated by the solve. The graph itself knows nothing of solving.
_call: Callable[[Network, Mapping[Hashable, Any], tuple[Any, ...]], Any] = _plain_call


def set_call(call: Callable[[Network, Mapping[Hashable, Any], tuple[Any, ...]], Any]) -> None:
    """Install the function that ``Network.__call__`` runs (the transforms' solve-aware call)."""
    global _call
    _call = call


def label(name: Hashable) -> str:
    """A state's, layer's or block's name as text (``W[3]`` for ``Row("W", 3)``)."""
    if isinstance(name, Row):
        return f"{label(name.block)}[{name.index}]"
    return name if isinstance(name, str) else repr(name)


def layer_theta(layer: Layer, theta: Mapping[Hashable, Any], rows: Mapping[Row, Any] | None = None) -> tuple[Any, ...]:
    """The ``theta`` tuple that ``layer.fn`` receives (``rows``: rows of stacked blocks already read)."""
    return tuple(rows[p] if rows and isinstance(p, Row) else resolve(p, theta) for p in layer.params)


def call_layer(layer: Layer, theta: tuple[Any, ...], inputs: tuple[Any, ...]) -> Any:
    """``layer.fn(theta, *inputs)`` with errors that name the layer."""
    try:
        out = layer.fn(theta, *inputs)
    except Exception as err:
        if not _reraisable(err):
            raise
        shapes = ", ".join(_describe(x) for x in inputs)
        pshapes = ", ".join(f"{p!r}: {_describe(t)}" for p, t in zip(layer.params, theta))
        raise type(err)(
            f"Layer {layer.name!r} failed: {err}\n  reads {list(layer.reads)!r} with shapes "
            f"[{shapes}]; params {{{pshapes}}}."
        ) from err
    leaves = jax.tree.leaves(out)
    bad = [leaf for leaf in leaves if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype"))
           and not isinstance(leaf, (bool, int, float, complex))]
    if not leaves or bad:
        what = f"a leaf of type {type(bad[0]).__name__} ({bad[0]!r:.60})" if bad else f"no arrays ({out!r:.60})"
        raise TypeError(f"Layer {layer.name!r} returned {what}: a layer must return an array or a pytree "
                        f"of arrays (its state). Check the return statement of {getattr(layer.fn, '__name__', 'fn')}.")
    return out


def _reraisable(err: Exception) -> bool:
    try:
        type(err)("probe")
    except Exception:
        return False
    return True


def _describe(x: Any) -> str:
    leaves = jax.tree.leaves(x)
    if len(leaves) == 1 and leaves[0] is x:
        return f"{getattr(x, 'dtype', type(x).__name__)}{list(getattr(x, 'shape', ()))}"
    return str(jax.tree.map(lambda v: f"{getattr(v, 'dtype', type(v).__name__)}{list(getattr(v, 'shape', ()))}", x))
