"""The parts of a network: a layer, a row of a stacked block, a stack of states, the graph's
error, and calling one layer with errors that name it.

U_i = Φ_i(S_i(θ), U_j for j in reads(i)): a [`Layer`][linbackprop.Layer] is one Φ_i with the
names it reads and the parameter blocks S_i it selects; the graph that orders them is
``_network.Network``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np


def is_array_leaf(x: Any) -> bool:
    """An array, an abstract array, a tracer or a Python number: what a state, an input or a block holds."""
    return (isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct, bool, int, float, complex))
            or hasattr(x, "aval"))


def not_an_array(x: Any, where: str) -> TypeError:
    """The error for a leaf ``x`` of what ``where`` names that is not an array."""
    return TypeError(f"{where} has a leaf of type {type(x).__name__} ({x!r}); states, inputs and "
                     "parameter blocks must be arrays or pytrees of arrays.")


def check_array_leaves(tree: Any, where: str) -> None:
    """A clear error for a leaf of ``tree`` (``where`` names it) that is not an array."""
    for x in jax.tree.leaves(tree):
        if not is_array_leaf(x):
            raise not_an_array(x, where)


class GraphError(ValueError):
    """An invalid network graph, raised at [`Network`][linbackprop.Network] construction.

    A ``ValueError``: the message names the layer or state at fault and what to change.

    Attributes:
        args: ``(message,)``, as every exception's.

    Examples:
        >>> import linbackprop as lbp
        >>> lbp.Network([lbp.Layer("a", lambda th, u: u, ("a",))], inputs=["x"], outputs="a")
        Traceback (most recent call last):
        ...
        linbackprop._graph._layer.GraphError: Layer 'a' reads itself: a cycle. A layer reads earlier states only.
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
    r"""One layer $U_{\text{name}}$ = ``fn(theta, *inputs)`` of a [`Network`][linbackprop.Network].

    Args:
        name: any hashable, unique among the network's inputs and layers.
        fn: ``fn(theta, *inputs) -> state``; ``theta`` is the tuple of the parameter blocks named
            in ``params`` (in that order), ``inputs`` the states named in ``reads``.
        reads: names of the states this layer reads (network inputs or other layers).
        params: names of the parameter blocks this layer uses ($S_i$ of the seed). A block may be
            shared by several layers, or appear twice in one layer. ``Row(name, i)`` names row i
            of a stacked block.

    Attributes:
        name: as given.
        fn: as given.
        reads: as given, a tuple.
        params: as given, a tuple.

    Raises:
        TypeError: ``fn`` is not callable, ``reads`` or ``params`` is a single string or not a
            sequence, a `Row` has no non-negative int index, or a name is not hashable.

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
