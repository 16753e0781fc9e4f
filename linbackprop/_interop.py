"""Models from flax (nnx, linen) and equinox as layers.

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

flax and equinox are optional: nothing here imports them; a model is recognised by the modules
its own code has already imported.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any

import jax


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


def functional(model: Any, variables: Any = None, *, method: str | None = None,
               rng_streams: tuple[str, ...] = ("dropout",)) -> Functional:
    """Split a flax or equinox model into the arrays to differentiate and a pure function of them.

    - **equinox** ``eqx.Module``: the inexact (floating) arrays, as ``eqx.partition`` with
      ``eqx.is_inexact_array`` gives them; the rest is held fixed.
    - **flax nnx** ``nnx.Module``: its ``nnx.Param`` state (``nnx.split(model, nnx.Param, ...)``);
      other state (batch statistics) is held fixed at its value now. A module whose call draws
      random numbers from its RNG streams (``nnx.Dropout``) raises in ``layer`` — the mask would
      be the same at every call — and runs in ``keyed_layer`` / ``apply(..., key=key)``, which
      reseed stream n with ``jax.random.fold_in(key, n)`` (streams sorted by name; as
      ``nnx.reseed``) before the call: a fresh key per step, a fresh mask.
    - **flax linen** ``nn.Module`` with its ``variables``: ``variables["params"]``; other
      collections are held fixed. ``apply`` is ``module.apply``; with ``key``, the RNG streams
      ``rng_streams`` get ``jax.random.fold_in(key, n)`` (``module.apply(..., rngs=...)``).

    ``method`` names a method to call instead of ``__call__``. Stacked models (``filter_vmap``,
    ``nnx.vmap``, ``jax.vmap(module.init)``) split the same way; pass ``Row`` s of ``params`` to
    ``layer``.

    Args:
        model: an ``eqx.Module``, an ``nnx.Module`` or a linen ``nn.Module``.
        variables: the linen module's variables (``module.init(...)``); None for the others.
        method: the method to call instead of ``__call__``.
        rng_streams: the linen RNG streams a ``key`` seeds.

    Returns:
        A [`Functional`][linbackprop.Functional]: ``apply``, ``params``, ``rebuild``, ``layer``,
            ``keyed_layer``.

    Raises:
        TypeError: a model of none of these kinds, or a linen module without ``variables``.

    The example needs equinox (``pip install 'linbackprop[equinox]'``).

    Examples:
        >>> import equinox as eqx, jax, jax.numpy as jnp, linbackprop as lbp
        >>> mlp = lbp.functional(eqx.nn.MLP(4, 4, 16, 2, key=jax.random.PRNGKey(0)))
        >>> net = lbp.Network([lbp.Layer("y", mlp.layer, ("x",), ("mlp",))], ["x"], "y")
        >>> loss = lambda p, x: jnp.sum(net(p, x) ** 2)
        >>> grads = lbp.grad_by_solve(loss)({"mlp": mlp.params}, jnp.ones(4))
        >>> type(grads["mlp"]).__name__, grads["mlp"].layers[0].weight.shape
        ('MLP', (16, 4))
    """
    eqx, nnx, linen = (sys.modules.get(m) for m in ("equinox", "flax.nnx", "flax.linen"))
    if eqx is not None and isinstance(model, eqx.Module):
        _no_variables(model, variables)
        params, static = eqx.partition(model, eqx.is_inexact_array)

        def apply_equinox(p: Any, *args: Any, **kwargs: Any) -> Any:
            return _method(eqx.combine(p, static), method)(*args, **kwargs)

        return Functional(_named(apply_equinox, model), params, lambda p: eqx.combine(p, static))
    if nnx is not None and isinstance(model, nnx.Module):
        _no_variables(model, variables)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def apply_nnx(p: Any, *args: Any, key: Any = None, **kwargs: Any) -> Any:
            # fresh Variables for the fixed state: a call may mutate them (an RNG count), and
            # nnx forbids mutating, inside a trace, Variables made outside it
            fixed = jax.tree.map(lambda x: x, rest)
            module = nnx.merge(graphdef, p, fixed)
            if key is not None:
                tags = sorted({stream.key.tag for _, stream in nnx.iter_graph(module)
                               if isinstance(stream, nnx.RngStream)})
                nnx.reseed(module, policy="match_shape",
                           **{tag: jax.random.fold_in(key, n) for n, tag in enumerate(tags)})
            counts = lambda: jax.tree.leaves(nnx.state(module, nnx.RngCount))
            before = counts()
            out = _method(module, method)(*args, **kwargs)
            if key is None and any(a is not b for a, b in zip(before, counts())):  # a stream advanced
                raise TypeError(_needs_key(model, "model.eval() before functional()"))
            return out

        return Functional(_named(apply_nnx, model), params, lambda p: nnx.merge(graphdef, p, rest))
    if linen is not None and isinstance(model, linen.Module):
        if variables is None or "params" not in variables:
            raise TypeError(f"functional({type(model).__name__}) is a linen module: pass its variables too, "
                            "functional(module, module.init(key, x)) — they must hold a 'params' collection.")
        rest = {k: v for k, v in variables.items() if k != "params"}
        kw = {} if method is None else {"method": method}

        def apply_linen(p: Any, *args: Any, key: Any = None, **kwargs: Any) -> Any:
            rngs = {} if key is None else {"rngs": {s: jax.random.fold_in(key, n) for n, s in enumerate(rng_streams)}}
            try:
                return model.apply({"params": p, **rest}, *args, **kw, **rngs, **kwargs)
            except Exception as err:
                if key is None and type(err).__name__ == "InvalidRngError":  # flax's: a stream was asked for
                    raise TypeError(f"{_needs_key(model, 'deterministic=True in the call')}\n({err})") from err
                raise

        return Functional(_named(apply_linen, model), variables["params"], lambda p: {"params": p, **rest})
    raise TypeError(f"functional() takes an equinox Module, a flax nnx Module or a flax linen Module (with its "
                    f"variables), got {type(model).__module__}.{type(model).__qualname__}. A plain function of "
                    "its parameters needs no wrapping: use fn(theta, *states) as the layer function.")


def _needs_key(model: Any, deterministic: str) -> str:
    return (f"functional({type(model).__name__}): its call draws random numbers (dropout), but a layer function is "
            "pure: every call would draw the same mask. Pass a PRNG key: Layer(name, blocks.keyed_layer, "
            "reads=(key_input, *states), ...) with a fresh key per step (a network input, or Row(keys, i) of "
            f"jax.random.split(step_key, n) for n layers), or apply(params, x, key=key); or {deterministic} for a "
            "deterministic call.")


def _no_variables(model: Any, variables: Any) -> None:
    if variables is not None:
        raise TypeError(f"functional({type(model).__name__}, variables): only linen modules take variables; "
                        "equinox and nnx modules hold their own arrays.")


def _named(apply: Callable[..., Any], model: Any) -> Callable[..., Any]:
    """``apply`` named after the model's class: the name its layers show (plot_network, errors)."""
    apply.__name__ = apply.__qualname__ = type(model).__name__
    return apply


def _method(module: Any, method: str | None) -> Callable[..., Any]:
    return module if method is None else getattr(module, method)
