"""Layers and networks: the static DAG U_i = Φ_i(S_i(θ), U_j for j in reads(i)).

A [`Network`][linbackprop.Network] only knows names and functions; shapes are looked at when it is called.
Called plainly it is ordinary JAX code (a Python loop over its layers in topological order),
so ``jax.grad`` of a function that calls it is the independent reference for the solve.
Inside [`grad_by_solve`][linbackprop.grad_by_solve] and friends the same call is differentiated by
solving with ℒ = I − D_UΦ instead (see ``_solve/_transforms.py``).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .._options import call_handler, calls_handled, solver
from ._buffers import stack_trees, take
from ._layer import GraphError, Layer, Row, Stack, block_of, call_layer, check_array_leaves, label, layer_theta

__all__ = ["Network", "stack_states"]


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
    r"""A static DAG of layers: $U_i = \Phi_i(S_i(\theta), U_j \text{ for } j \in \text{reads}(i))$.

    Args:
        layers: [`Layer`][linbackprop.Layer] objects in any order; they are sorted topologically (ties keep
            the order given).
        inputs: names of the input states ($U_0$ of the seed); several are allowed.
        outputs: a single name (``net(...)`` returns that state) or a sequence of names
            (``net(...)`` returns a tuple). A tuple that is itself the name of a state is that
            single name; write ``[name]`` for a 1-tuple of outputs. A [`Stack`][linbackprop.Stack] of names
            (alone or in the sequence) returns those states stacked on a new leading axis.

    Raises:
        GraphError: duplicate names, reads of unknown states, cycles (self-reads included),
            unknown outputs, a layer named like an input.

    Attributes:
        layers: the layers in topological order.
        order: their names, in that order (the block rows of ℒ after the inputs).
        inputs: the input states' names.
        outputs: the names of the states a call returns (a `Stack`'s names flattened in).
        output_spec: the outputs as given (names and `Stack` s).
        single_output: whether ``net(...)`` returns one item rather than a tuple.
        param_names: the parameter blocks the layers use, in order of first use (θ's blocks).
        stacked_blocks: the blocks some layer uses by `Row`.
        stacked_inputs: the inputs some layer reads by `Row`.
        live: the network without the layers that reach no output (None where every output is an
            input): what the solve runs.

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
        """The blocks of ``params`` this network uses, checked to be present.

        Args:
            params: a mapping from block name to block (more blocks than the network uses are fine).

        Returns:
            A dict of the blocks in ``param_names``.

        Raises:
            TypeError: ``params`` is not a mapping.
            KeyError: a block is missing (the error names the layers that use it).
            ValueError: a stacked block has fewer rows than a layer's `Row` asks for.
        """
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
        """The right number of inputs, and every Row of a stacked input within its leading axis.

        Args:
            inputs: the call's inputs, in the order of ``inputs``.

        Raises:
            TypeError: a different number of inputs.
            ValueError: a stacked input has fewer rows than a layer's `Row` asks for.
        """
        if len(inputs) != len(self._inputs):
            raise TypeError(
                f"The network has {len(self._inputs)} input(s) {list(self._inputs)!r} but was called "
                f"with {len(inputs)}: call net(params, {', '.join(map(str, self._inputs))})."
            )
        given = dict(zip(self._inputs, inputs))
        for name, (index, layer) in _largest_rows(self._layers, "reads").items():
            _check_stacked(given[name], f"network input {name!r}", Row(name, index), layer)

    def states(self, params: Mapping[Hashable, Any], *inputs: Any) -> dict[Hashable, Any]:
        """All states by name, inputs included: the plain forward substitution U = Φ(U, θ).

        Args:
            params: a mapping from block name to block.
            *inputs: the network's inputs.

        Returns:
            A dict from every state's name (inputs and layers) to its value.
        """
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
        """The output state(s). Differentiated by the solve inside ``grad_by_solve``.

        How the call runs is read from two context values (`_options._settings`), not installed: a
        curvature transform's handler splitting a function takes the call whole (and calls the
        network again inside, with no handler); otherwise, after the arguments are checked, the
        transforms' solver runs it in solve mode, or it is the plain forward substitution.
        """
        handler = call_handler()
        if handler is not None:
            with calls_handled(None):
                return handler(self, params, tuple(inputs))
        self.check_inputs(inputs)
        theta = self.select_params(params)
        for name, block in theta.items():
            check_array_leaves(block, f"Parameter block {name!r}")
        for name, x in zip(self._inputs, inputs):
            check_array_leaves(x, f"Network input {name!r}")
        solve = solver()
        if solve is None:
            return self.pick_outputs(self.states(theta, *inputs))
        return solve(self, theta, tuple(inputs))

    def pick_outputs(self, states: Mapping[Hashable, Any]) -> Any:
        """What a call returns, from all states by name (a [`Stack`][linbackprop.Stack] stacked leaf by leaf).

        Args:
            states: every state by name, as `states` returns them.

        Returns:
            The output state, or the tuple of outputs.
        """
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
    return stack_trees(values)


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
