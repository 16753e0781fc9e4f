"""Marking the calls that are layers: for the duration of a capture, each call of a ``layers=``
class (its ``__call__`` patched; its framework's adapter marks it: nnx and linen modules with
their state in and out) or of an
`layer` function is a ``jax.jit`` named ``linbackprop_layer<k>``, found again in the jaxpr.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax

from .._frameworks import Adapter, Marking, adapter_of_class
from .._options import current

MARK = "linbackprop_layer"


def marked_index(eqn: Any, mark: str = MARK) -> int | None:
    """The call's position where ``eqn`` is a marked call (a ``jax.jit`` named ``mark<k>``: a
    layer's, or with `_network_calls.NETWORK_MARK` a network's), else None."""
    if eqn.primitive.name not in ("pjit", "jit"):
        return None
    name = str(eqn.params.get("name", ""))
    return int(name[len(mark):]) if name.startswith(mark) and name[len(mark):].isdigit() else None


def marks_in(jaxpr: Any, mark: str = MARK) -> list[int]:
    """The marked calls made anywhere in ``jaxpr`` (nested jaxprs included), by position."""
    found = []
    for eqn in jaxpr.eqns:
        k = marked_index(eqn, mark)
        if k is not None:
            found.append(k)
            continue
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += marks_in(sub, mark)
    return found


def contains_marks(jaxpr: Any, mark: str = MARK) -> bool:
    """Whether ``jaxpr`` makes a marked call anywhere."""
    return bool(marks_in(jaxpr, mark))


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


class _CaptureMarking(Marking):
    """What an adapter marks a module's call with: this capture's opaque calls and probes."""

    def opaque(self, call: Callable, args: tuple, name: str) -> Any:
        return _opaque_with_args(call, args, name)

    @contextlib.contextmanager
    def probing(self) -> Iterator[None]:
        state = capturing()
        state.inside += 1
        try:
            yield
        finally:
            state.inside -= 1


_MARKING = _CaptureMarking()


def _patched_call(cls: type, original: Callable) -> Callable:
    """``cls.__call__`` that makes an opaque call inside a capture that names ``cls`` (its
    framework's adapter marks it: nnx and linen modules with their state in and out)."""
    adapter = adapter_of_class(cls) or Adapter()

    def patched(module: Any, *args: Any, **kwargs: Any) -> Any:
        state = capturing()
        if state is None or state.inside or cls not in state.classes:  # not this capture's layer
            return original(module, *args, **kwargs)
        state.seen.add(cls)
        return adapter.layer_call(original, module, args, kwargs, _MARKING)

    return patched


# the classes patched now: class -> [its own __call__ (or _MISSING), how many captures use the patch]
_PATCHES: dict[type, list] = {}
_PATCH_LOCK = threading.Lock()
_MISSING = object()
