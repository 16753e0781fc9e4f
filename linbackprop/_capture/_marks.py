"""Marking the calls that are layers: for the duration of a capture, each call of a ``layers=``
class (its ``__call__`` patched; nnx and linen modules with their state in and out) or of an
`layer` function is a ``jax.jit`` named ``linbackprop_layer<k>``, found again in the jaxpr.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend.core import Literal

from .._options import current

MARK = "linbackprop_layer"


# -- marking the calls ------------------------------------------------------------------------------
class Capturing:
    """The state of one capture while ``fun`` is traced: the display name of each marked call in
    order, the depth of marked calls being traced (a layer inside a layer is part of it), the
    `layer` functions called, and those the capture's ``layers=`` names. It is the settings'
    ``capture`` field, a context value JAX keys its caches on (by identity): a ``jax.jit`` of the
    user's traced outside this capture is traced again inside it, with its layer calls marked."""

    def __init__(self, named: Sequence[Callable] = (), classes: Sequence[type] = ()):
        self.calls: list[str] = []
        self.inside = 0
        self.functions: set = set()
        self.named: frozenset = frozenset(named)
        self.classes: frozenset = frozenset(classes)  # the layers= classes of this capture
        self.seen: set = set()  # those whose instances were called


def capturing() -> Capturing | None:
    """The capture being traced, or None."""
    return current().capture


def layer(fn: Callable) -> Callable:
    """Mark a plain JAX function as a layer: inside ``fun`` of a transform given ``layers=`` that
    names it (or any transform's ``layers=`` naming it), each call ``fn(...)`` is one layer of the
    network found; elsewhere it is ``fn`` itself.

    Args:
        fn: a pure function of parameters and states, ``fn(params, *states)``.

    Returns:
        ``fn`` marked (``functools.wraps``): the same function outside a capture.

    Examples:
        >>> import jax.numpy as jnp, linbackprop as lbp
        >>> @lbp.layer
        ... def dense(W, x):
        ...     return jnp.tanh(x @ W)
        >>> loss = lambda p, x: jnp.sum(dense(p["W2"], dense(p["W1"], x)) ** 2)
        >>> p, x = {"W1": jnp.eye(2), "W2": jnp.eye(2)}, jnp.ones((3, 2))
        >>> cap = lbp.capture(loss, p, x, layers=dense)
        >>> len(cap.net.layers), cap.net.param_names
        (2, ("['W1']", "['W2']"))
    """

    @functools.wraps(fn)
    def marked(*args: Any, **kwargs: Any) -> Any:
        # a layer only where the capture's layers= names it: elsewhere fn itself (part of the glue or the loss)
        state = capturing()
        if state is None or state.inside or marked not in state.named:
            return fn(*args, **kwargs)
        state.functions.add(marked)
        return _opaque(lambda: fn(*args, **kwargs), getattr(fn, "__name__", "layer"))

    marked.__linbackprop_layer__ = fn
    return marked


def _opaque(call: Callable[[], Any], name: str) -> Any:
    """``call()`` as one equation of the trace (the values it closes over, traced, become the
    equation's operands)."""
    return _opaque_with_args(call, (), name)


def _nnx_call(method: Callable, self: Any, args: tuple, kwargs: dict) -> Any:
    """An nnx module's call, opaque: its parameters go in as operands, and of the rest of its state
    (RNG keys and counts, batch statistics) the leaves the call reads; the leaves it changes (an
    RNG count advanced by dropout) come out and are written back, as nnx does. A leaf neither read
    nor changed (a dropout's stream in eval mode) is no operand: the layer does not read it."""
    nnx = sys.modules["flax.nnx"]
    graphdef, params, rest = nnx.split(self, nnx.Param, ...)
    leaves, treedef = jax.tree.flatten(rest)

    def call(params: Any, chosen: Sequence[int], values: Sequence[Any], changed: Sequence[int] | None) -> Any:
        full = list(leaves)
        for i, v in zip(chosen, values):
            full[i] = v
        module = nnx.merge(graphdef, params, jax.tree.unflatten(treedef, full))
        out = method(module, *args, **kwargs)
        after = jax.tree.leaves(nnx.split(module, nnx.Param, ...)[2])
        return out, after if changed is None else [after[i] for i in changed]

    everything = range(len(leaves))
    state = capturing()
    state.inside += 1  # a probe: which leaves the call reads and which it changes
    try:
        probe = jax.make_jaxpr(lambda p, v: call(p, everything, v, None))(params, leaves).jaxpr
    finally:
        state.inside -= 1
    leaf_vars = probe.invars[len(jax.tree.leaves(params)):]
    read_vars = {a for e in probe.eqns for a in e.invars if not isinstance(a, Literal)}
    after_vars = probe.outvars[len(probe.outvars) - len(leaves):]
    changed = [i for i, (v, o) in enumerate(zip(leaf_vars, after_vars)) if o is not v]
    chosen = [i for i, v in enumerate(leaf_vars) if v in read_vars or i in changed]
    out, new = _opaque_with_args(lambda p, v: call(p, chosen, v, changed), (params, [leaves[i] for i in chosen]),
                                 type(self).__name__)
    full = list(leaves)
    for i, v in zip(changed, new):
        full[i] = v
    nnx.update(self, jax.tree.unflatten(treedef, full))
    return out


def _linen_call(method: Callable, module: Any, args: tuple, kwargs: dict) -> Any:
    """A bound linen module's call, opaque: the mutable collections it writes (``batch_stats``
    under ``mutable=["batch_stats"]``, sown intermediates) come out of the call and are written
    into the scope's variables in place, as the call would have written them."""
    scope = module.scope

    def call() -> Any:
        out = method(module, *args, **kwargs)
        return out, dict(scope.mutable_variables())

    out, after = _opaque(call, type(module).__name__)
    _assign(scope.mutable_variables(), after)
    return out


def _assign(target: dict, values: dict) -> None:
    """``values`` written into the nested dicts of ``target`` in place (the scopes of the
    submodules hold references to them)."""
    for k, v in values.items():
        if isinstance(v, dict) and isinstance(target.get(k), dict):
            _assign(target[k], v)
        else:
            target[k] = v


def _opaque_with_args(call: Callable, args: tuple, name: str) -> Any:
    """``call(*args)`` as one equation of the trace: a ``jax.jit`` named after the call's index."""
    state = capturing()
    index = len(state.calls)
    state.calls.append(name)

    def traced(*a: Any) -> Any:
        state.inside += 1
        try:
            return call(*a)
        finally:
            state.inside -= 1

    traced.__name__ = traced.__qualname__ = f"{MARK}{index}"
    return jax.jit(traced)(*args)


class Patched:
    """For the duration of a capture, the ``__call__`` of each class in ``classes`` makes an
    opaque call where the capture being traced (in this thread) names the class. Captures in
    several threads at once share one patch per class, counted under a lock: the last to finish
    restores the class's own ``__call__``, so no interleaving leaves a class patched, and each
    capture marks only its own classes' calls."""

    def __init__(self, entries: tuple[Any, ...]):
        self.classes = [e for e in entries if isinstance(e, type)]
        self.functions = [e for e in entries if not isinstance(e, type)]
        for f in self.functions:
            if not hasattr(f, "__linbackprop_layer__"):
                raise TypeError(f"layers= takes classes (whose instances' calls are layers) and functions decorated "
                                f"with @lbp.layer; {f!r} is neither: decorate it, `@lbp.layer def "
                                f"{getattr(f, '__name__', 'f')}(...)`, or name its class.")

    def __enter__(self) -> Patched:
        for cls in self.classes:
            if "__call__" not in vars(cls) and not any("__call__" in vars(b) for b in cls.__mro__[1:-1]):
                raise TypeError(f"layers= names {cls.__qualname__}, which has no __call__: name a class whose "
                                "instances are called (or decorate a function with @lbp.layer).")
        with _PATCH_LOCK:
            for cls in self.classes:
                if cls in _PATCHES:
                    _PATCHES[cls][1] += 1
                else:
                    _PATCHES[cls] = [vars(cls).get("__call__", _MISSING), 1]
                    cls.__call__ = _patched_call(cls, cls.__call__)
        return self

    def __exit__(self, *exc: Any) -> None:
        with _PATCH_LOCK:
            for cls in self.classes:
                entry = _PATCHES[cls]
                entry[1] -= 1
                if entry[1] == 0:
                    del _PATCHES[cls]
                    if entry[0] is _MISSING:
                        del cls.__call__
                    else:
                        cls.__call__ = entry[0]


def _patched_call(cls: type, original: Callable) -> Callable:
    """``cls.__call__`` that makes an opaque call inside a capture that names ``cls``."""
    nnx = sys.modules.get("flax.nnx")
    linen = sys.modules.get("flax.linen")
    is_nnx = nnx is not None and issubclass(cls, nnx.Module)
    is_linen = linen is not None and issubclass(cls, linen.Module)

    def patched(module: Any, *args: Any, **kwargs: Any) -> Any:
        state = capturing()
        if state is None or state.inside or cls not in state.classes:  # not this capture's layer
            return original(module, *args, **kwargs)
        state.seen.add(cls)
        if is_nnx:
            return _nnx_call(original, module, args, kwargs)
        if is_linen and module.scope is not None:
            return _linen_call(original, module, args, kwargs)
        return _opaque(lambda: original(module, *args, **kwargs), type(module).__name__)

    return patched


# the classes patched now: class -> [its own __call__ (or _MISSING), how many captures use the patch]
_PATCHES: dict[type, list] = {}
_PATCH_LOCK = threading.Lock()
_MISSING = object()
