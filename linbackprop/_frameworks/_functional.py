"""What every framework's adapter makes of a model: `Functional` (its arrays, a pure function of
them, the module rebuilt, the layer functions), and the helpers the adapters share.

A layer function is pure: ``fn(theta, *states)`` with ``theta`` the tuple of its parameter
blocks. A module is not: it holds its arrays. [`functional`][linbackprop.functional] splits a module once into the
arrays to differentiate — in the framework's own pytree (an ``eqx.Module`` with ``None`` where
equinox keeps static fields, an ``nnx.State``, a linen ``params`` dict) — and a pure function of
them, so that gradients come back in that pytree and go straight into optax:

    blocks = lbp.functional(model)                                 # model(x) == blocks.apply(blocks.params, x)
    layer = lbp.Layer("h", blocks.layer, ("x",), ("blocks",))     # its one block: blocks.params
    grads = lbp.grad_by_solve(loss)({"blocks": blocks.params}, x)  # grads["blocks"]: same pytree

Stacked blocks (``eqx.filter_vmap`` or ``nnx.vmap`` over an init function, ``jax.vmap`` over a
linen ``init``) split the same way: every array gains a leading axis, and ``Row("blocks", i)``
hands row i — one block's arrays — to ``blocks.layer``, which rebuilds one block from it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol


@dataclasses.dataclass(frozen=True, eq=False)
class Functional:
    """A module split into its arrays and a pure function of them (see [`functional`][linbackprop.functional]).

    Attributes:
        apply: ``apply(params, *args, **kwargs)`` is ``model(*args, **kwargs)`` with ``params``
            in place of the model's own arrays (or one row of them, for a stacked model).
        params: the arrays to differentiate, in the framework's pytree.
        rebuild: ``rebuild(params)`` is the model with these arrays (equinox, nnx: a module;
            linen: the variables dict for ``module.apply``) — e.g. after training.
        layer: ``layer(theta, *states) = apply(theta[0], *states)``: a layer function whose one
            parameter block is ``params`` or a ``Row`` of them. One object per split, so the
            layers built from it are one kind of layer. A module that draws random numbers
            (dropout) raises here: a layer function is pure, so its mask would be the same at
            every call.
        keyed_layer: ``keyed_layer(theta, key, *states) = apply(theta[0], *states, key=key)``: the
            layer function of a module that draws random numbers, from ``key`` (a PRNG key read
            as the layer's first state: a network input with a fresh key per step, or a ``Row``
            of ``jax.random.split(step_key, n)`` for n layers).

    Any pure function of parameters works the same way.

    Examples:
        >>> import jax.numpy as jnp, linbackprop as lbp
        >>> f = lbp.Functional(lambda p, x: x @ p["W"], {"W": jnp.eye(2)}, lambda p: p)
        >>> net = lbp.Network([lbp.Layer("y", f.layer, ("x",), ("W",))], ["x"], "y")
        >>> net({"W": f.params}, jnp.ones((1, 2)))
        Array([[1., 1.]], dtype=float32)
    """

    apply: Callable[..., Any]
    params: Any
    rebuild: Callable[[Any], Any]
    layer: Callable[..., Any] = dataclasses.field(init=False, repr=False)
    keyed_layer: Callable[..., Any] = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        apply = self.apply

        def layer(theta: tuple, *states: Any) -> Any:
            return apply(theta[0], *states)

        def keyed_layer(theta: tuple, key: Any, *states: Any) -> Any:
            return apply(theta[0], *states, key=key)

        for fn in (layer, keyed_layer):
            fn.__name__ = fn.__qualname__ = getattr(apply, "__name__", "module")
        object.__setattr__(self, "layer", layer)
        object.__setattr__(self, "keyed_layer", keyed_layer)


def needs_key(model: Any, deterministic: str) -> str:
    return (f"functional({type(model).__name__}): its call draws random numbers (dropout), but a layer function is "
            "pure: every call would draw the same mask. Pass a PRNG key: Layer(name, blocks.keyed_layer, "
            "reads=(key_input, *states), ...) with a fresh key per step (a network input, or Row(keys, i) of "
            f"jax.random.split(step_key, n) for n layers), or apply(params, x, key=key); or {deterministic} for a "
            "deterministic call.")


def no_variables(model: Any, variables: Any) -> None:
    if variables is not None:
        raise TypeError(f"functional({type(model).__name__}, variables): only linen modules take variables; "
                        "equinox and nnx modules hold their own arrays.")


def named(apply: Callable[..., Any], model: Any) -> Callable[..., Any]:
    """``apply`` named after the model's class: the name its layers show (plot_network, errors)."""
    apply.__name__ = apply.__qualname__ = type(model).__name__
    return apply


def method_of(module: Any, method: str | None) -> Callable[..., Any]:
    return module if method is None else getattr(module, method)


@dataclasses.dataclass(frozen=True, eq=False)
class ArgumentSplit:
    """A model handed to a transform as an argument (``layers=``), split as its framework splits
    it: the leaves to differentiate and the rest it holds, each with its path, and how to rebuild
    the model, read its state after a call and write that state back into the caller's model."""

    paths: list  # (path, leaf) of the leaves to differentiate
    treedef: Any
    rebuild: Callable[[list, list], Any]  # (differentiated leaves, rest leaves) -> the model
    rest_paths: list = dataclasses.field(default_factory=list)  # (path, leaf) of the rest (nnx: RNG, statistics)
    state_out: Callable[[Any], list] | None = None  # the model after a call -> its rest leaves
    write_back: Callable[[list], None] | None = None  # rest leaves -> the caller's model updated
    leaves_of: Callable[[Any], list] | None = None  # a tangent (or like value) -> its differentiated leaves


class Marking(Protocol):
    """What the capture lends an adapter to mark a module's call as one layer: ``opaque(call,
    args, name)`` makes ``call(*args)`` one equation of the trace (its arguments its operands),
    ``probing()`` traces inside it without marking the calls it makes."""

    def opaque(self, call: Callable, args: tuple, name: str) -> Any: ...

    def probing(self) -> AbstractContextManager[None]: ...


class Adapter:
    """One framework's knowledge, in one place: whether a value or class is its module, the
    module as a `Functional`, the module as a differentiated argument, and its call marked as a
    layer with its state in and out. The framework is never imported here: a model is recognised
    by the modules its own code has already imported (``module`` names it in ``sys.modules``).
    This base is what anything else is: a pytree, a class whose call is marked as it is."""

    name: str = ""
    module: str = ""  # the framework's module in sys.modules ("equinox", "flax.nnx", "flax.linen")

    def base(self) -> type | None:
        """The framework's module class where its code is imported, else None."""
        import sys

        lib = sys.modules.get(self.module)
        return None if lib is None else lib.Module

    def owns(self, value: Any) -> bool:
        base = self.base()
        return base is not None and isinstance(value, base)

    def owns_class(self, cls: type) -> bool:
        base = self.base()
        return base is not None and issubclass(cls, base)

    def functional(self, model: Any, variables: Any, method: str | None, rng_streams: tuple[str, ...]) -> Functional:
        """The model as a `Functional` (a framework's; here, for anything else, the reason why not)."""
        raise TypeError(f"functional() takes an equinox Module, a flax nnx Module or a flax linen Module (with its "
                        f"variables), got {type(model).__module__}.{type(model).__qualname__}. A plain function of "
                        "its parameters needs no wrapping: use fn(theta, *states) as the layer function.")

    def split(self, arg: Any) -> ArgumentSplit:
        """The argument as its framework splits it (by default a pytree: every leaf)."""
        return plain_split(arg)

    def layer_call(self, original: Callable, module: Any, args: tuple, kwargs: dict, marking: Marking) -> Any:
        """``original(module, *args, **kwargs)`` as one layer of the trace (by default the call
        alone: the module's arrays it reads become the equation's operands)."""
        return marking.opaque(lambda: original(module, *args, **kwargs), (), type(module).__name__)


def plain_split(arg: Any) -> ArgumentSplit:
    """A pytree argument: every leaf differentiated."""
    import jax

    paths, treedef = jax.tree_util.tree_flatten_with_path(arg)
    return ArgumentSplit(paths, treedef, lambda d, r: jax.tree.unflatten(treedef, d))
