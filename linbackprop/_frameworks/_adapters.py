"""The frameworks linbackprop knows, one adapter each (`_equinox`, `_nnx`, `_linen`; anything else
is a pytree): which one a model or a ``layers=`` class belongs to, and
[`functional`][linbackprop.functional].

flax and equinox are optional: nothing here imports them; a model is recognised by the modules
its own code has already imported.
"""

from __future__ import annotations

from typing import Any

from ._equinox import Equinox
from ._functional import Adapter, ArgumentSplit, Functional, plain_split
from ._linen import Linen
from ._nnx import Nnx

ADAPTERS: tuple[Adapter, ...] = (Equinox(), Nnx(), Linen())


def adapter_of(value: Any) -> Adapter | None:
    """The adapter of the framework whose module ``value`` is, or None."""
    return next((a for a in ADAPTERS if a.owns(value)), None)


def adapter_of_class(cls: type) -> Adapter | None:
    """The adapter of the framework whose module class ``cls`` is, or None."""
    return next((a for a in ADAPTERS if a.owns_class(cls)), None)


def split_argument(arg: Any) -> ArgumentSplit:
    """A transform's argument split as its framework splits it; a pytree's every leaf."""
    adapter = adapter_of(arg)
    return plain_split(arg) if adapter is None else adapter.split(arg)


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
    return (adapter_of(model) or Adapter()).functional(model, variables, method, rng_streams)
