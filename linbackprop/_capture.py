"""Networks found in models: ``layers=``, `capture` and `layer`.

Users have models, not Networks. With ``layers=`` naming which calls of ``fun`` are the layers
(classes whose instances' calls are layers, or functions decorated with `layer`), ``fun``
is traced once per shapes with each such call made opaque: a ``jax.jit`` of the call, named so
that it is found again (``linbackprop_layer<k>``). The jaxpr then shows the DAG directly:

- each marked call is a layer; its parameter blocks are the leaves of the differentiated
  arguments it reads (a leaf read by two calls, or by a call and the code around it, is shared),
  its states the values computed before it, its inputs the data;
- the code between the calls that computes what a later call reads (residual adds, norms,
  reshapes, an embedding lookup) is made of layers of its own (glue, one per run of equations
  between two calls);
- what follows — what no later call reads — is the loss ℓ of the network's outputs, as the code
  around a Network call is in ``grad_by_solve``.

The equations are split into three parts, evaluated in this order: before the network (data
preparation, terms of the arguments alone), the network (one ``Network`` call, differentiated
by the solve), after it (the loss). Layer functions are built from the jaxprs of the calls and
of the glue; equal programs (same jaxpr text, constants and reads) share one function object,
so that repeated blocks are one kind of layer and a Python loop over blocks does not grow the
program. The Network is cached per captured program: tracing ``fun`` again with the same shapes
finds the same Network, and the solve's caches hit.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import itertools
import sys
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Literal

from ._graph import Layer, Network, Row
from ._settings import context_value
from ._traced import Constant, bind_equation

MARK = "linbackprop_layer"


# -- marking the calls ------------------------------------------------------------------------------
class _Capturing(threading.local):
    def __init__(self) -> None:
        self.calls: list[str] | None = None  # while capturing: the display name of each marked call
        self.inside = 0  # depth of marked calls being traced (a layer inside a layer is part of it)
        self.functions: set = set()  # the @layer functions called while capturing


_CAPTURING = _Capturing()
# Each capture's own value in jit's key: a jax.jit of the user's around the model, traced before
# without capturing (by jax.grad of the same loss, say), is traced again, its calls then marked.
_CAPTURE_KEY = context_value(0)
_captures = itertools.count(1)


def layer(fn: Callable) -> Callable:
    """Mark a plain JAX function as a layer: inside ``fun`` of a transform given ``layers=`` that
    names it (or any transform's ``layers=`` naming it), each call ``fn(...)`` is one layer of the
    network found; elsewhere it is ``fn`` itself.

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
        if _CAPTURING.calls is None or _CAPTURING.inside:
            return fn(*args, **kwargs)
        _CAPTURING.functions.add(marked)
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
    _CAPTURING.inside += 1  # a probe: which leaves the call reads and which it changes
    try:
        probe = jax.make_jaxpr(lambda p, v: call(p, everything, v, None))(params, leaves).jaxpr
    finally:
        _CAPTURING.inside -= 1
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
    calls = _CAPTURING.calls
    index = len(calls)
    calls.append(name)

    def traced(*a: Any) -> Any:
        _CAPTURING.inside += 1
        try:
            return call(*a)
        finally:
            _CAPTURING.inside -= 1

    traced.__name__ = traced.__qualname__ = f"{MARK}{index}"
    return jax.jit(traced)(*args)


class _Patched:
    """For the duration of a capture, the ``__call__`` of each class in ``classes`` makes an
    opaque call; and which of them (and of the marked functions) were called."""

    def __init__(self, entries: tuple[Any, ...]):
        self.classes = [e for e in entries if isinstance(e, type)]
        self.functions = [e for e in entries if not isinstance(e, type)]
        for f in self.functions:
            if not hasattr(f, "__linbackprop_layer__"):
                raise TypeError(f"layers= takes classes (whose instances' calls are layers) and functions decorated "
                                f"with @lbp.layer; {f!r} is neither: decorate it, `@lbp.layer def "
                                f"{getattr(f, '__name__', 'f')}(...)`, or name its class.")
        self.saved: dict[type, Any] = {}
        self.seen: set[Any] = set()

    def __enter__(self) -> _Patched:
        nnx = sys.modules.get("flax.nnx")
        for cls in self.classes:
            if "__call__" not in vars(cls) and not any("__call__" in vars(b) for b in cls.__mro__[1:-1]):
                raise TypeError(f"layers= names {cls.__qualname__}, which has no __call__: name a class whose "
                                "instances are called (or decorate a function with @lbp.layer).")
            original = cls.__call__
            self.saved[cls] = vars(cls).get("__call__", _MISSING)
            is_nnx = nnx is not None and issubclass(cls, nnx.Module)
            linen = sys.modules.get("flax.linen")
            is_linen = linen is not None and issubclass(cls, linen.Module)

            def patched(module: Any, *args: Any, __original=original, __cls=cls, __nnx=is_nnx, __linen=is_linen,
                        **kwargs: Any) -> Any:
                if _CAPTURING.calls is None or _CAPTURING.inside:  # not capturing, or inside a marked call
                    return __original(module, *args, **kwargs)
                self.seen.add(__cls)
                if __nnx:
                    return _nnx_call(__original, module, args, kwargs)
                if __linen and module.scope is not None:
                    return _linen_call(__original, module, args, kwargs)
                return _opaque(lambda: __original(module, *args, **kwargs), type(module).__name__)

            cls.__call__ = patched
        return self

    def __exit__(self, *exc: Any) -> None:
        for cls, method in self.saved.items():
            if method is _MISSING:
                del cls.__call__
            else:
                cls.__call__ = method


_MISSING = object()


# -- the captured program -----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Capture:
    """A network found in a model by `capture`.

    Attributes:
        net: the ``Network`` found: its layers are the marked calls and the glue between them.
        params: its parameter blocks, ``{name: array}``, named by their paths in the
            differentiated argument (``jax.tree_util.keystr``).
        inputs: its inputs (the data it reads), in ``net.inputs`` order.

    Example:
        >>> import jax.numpy as jnp, linbackprop as lbp
        >>> dense = lbp.layer(lambda W, x: jnp.tanh(x @ W))
        >>> cap = lbp.capture(lambda p, x: jnp.sum(dense(p, x)), jnp.eye(2), jnp.ones((1, 2)), layers=dense)
        >>> bool(jnp.allclose(cap.net(cap.params, *cap.inputs)[0], jnp.tanh(1.0)))
        True
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

    def blocks(self, diff: Sequence[Any]) -> dict[Hashable, Any]:
        env = dict(zip(self.invars, diff))
        return {name: env[v] for name, v in zip(self.net.param_names, self.block_vars)}

    def _before(self, leaves: Sequence[Any]) -> dict[Any, Any]:
        """The values after the equations before the network, by variable."""
        env: dict[Any, Any] = dict(zip(self.constvars, self.consts))
        env.update(zip(self.invars, leaves))
        _evaluate(self.before, env)
        return env

    def run(self, leaves: Sequence[Any]) -> list[Any]:
        env = self._before(leaves)
        read = lambda a: a.val if isinstance(a, Literal) else env[a]
        inputs = [read(a) for a in self.input_atoms]
        outs = self.net({name: env[v] for name, v in zip(self.net.param_names, self.block_vars)}, *inputs)
        outs = (outs,) if self.net.single_output else outs
        for state, vars_ in zip(outs, self.output_vars):
            env.update(zip(vars_, state))
        _evaluate(self.after, env)
        return [read(a) for a in self.outvars]

    def inputs_of(self, leaves: Sequence[Any]) -> tuple[Any, ...]:
        env = self._before(leaves)
        return tuple(a.val if isinstance(a, Literal) else env[a] for a in self.input_atoms)


def _evaluate(eqns: Sequence[Any], env: dict) -> None:
    """Run equations in order in ``env`` (var -> value), as ``jax.core.eval_jaxpr`` does."""
    for eqn in eqns:
        outs = bind_equation(eqn, [a.val if isinstance(a, Literal) else env[a] for a in eqn.invars])
        env.update(zip(eqn.outvars, outs if eqn.primitive.multiple_results else [outs]))


class _NoInput:
    """The input of a network that reads no data (its every input differentiated): nothing reads it."""


def _marked_index(eqn: Any) -> int | None:
    if eqn.primitive.name not in ("pjit", "jit"):
        return None
    name = str(eqn.params.get("name", ""))
    return int(name[len(MARK):]) if name.startswith(MARK) and name[len(MARK):].isdigit() else None


def _contains_marks(jaxpr: Any) -> bool:
    for eqn in jaxpr.eqns:
        if _marked_index(eqn) is not None:
            return True
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            if _contains_marks(sub):
                return True
    return False


def _inline(jaxpr: Any, consts: Sequence[Any], rows: _Rows) -> tuple[list, list, list, list]:
    """The equations with unmarked ``jit`` s that hold marked calls inlined (a ``jax.jit`` the user
    put around part of the model): their equations take their place, and what read their outputs
    reads the inner values instead. Returns (eqns, constvars, consts, outvars)."""
    eqns: list = []
    constvars, consts = list(jaxpr.constvars), list(consts)
    rename: dict = {}
    fix = lambda atoms: [a if isinstance(a, Literal) else rename.get(a, a) for a in atoms]
    for eqn in jaxpr.eqns:
        eqn = eqn.replace(invars=fix(eqn.invars))
        if eqn.primitive.name == "scan" and _contains_marks(eqn.params["jaxpr"].jaxpr):
            sub, sub_constvars, sub_consts, outs = _unrolled_scan(eqn, rows)
            eqns += sub
            constvars += sub_constvars
            consts += sub_consts
            rename.update(zip(eqn.outvars, outs))
            continue
        if _marked_index(eqn) is None and eqn.primitive.name in ("pjit", "jit") and \
                _contains_marks(eqn.params["jaxpr"].jaxpr):
            inner = eqn.params["jaxpr"]
            sub, sub_constvars, sub_consts, sub_outvars = _inline(inner.jaxpr, inner.consts, rows)
            constvars += sub_constvars
            consts += sub_consts
            bound = dict(zip(inner.jaxpr.invars, eqn.invars))
            bind = lambda atoms: [a if isinstance(a, Literal) else bound.get(a, a) for a in atoms]
            eqns += [e.replace(invars=bind(e.invars)) for e in sub]
            rename.update(zip(eqn.outvars, bind(sub_outvars)))
            continue
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            if _contains_marks(sub):
                what = eqn.primitive.name
                raise NotImplementedError(
                    f"A layers= call runs inside `{what}` (a {what} of the model's code, e.g. jax.checkpoint, a "
                    "custom_jvp or a while loop), which capture cannot see through: call the layers outside it "
                    "(checkpoints=k of the transform recomputes segments instead), or build the Network by hand "
                    "(lbp.Network).")
        eqns.append(eqn)
    return eqns, constvars, consts, fix(jaxpr.outvars)


def _traced(fn: Callable, atoms: Sequence[Any], rows: _Rows) -> tuple[list, list, list, list]:
    """``fn`` traced at the avals of ``atoms`` and inlined (fresh variables), its inputs bound to
    ``atoms``: (eqns, constvars, consts, outvars)."""
    def fresh(*args: Any) -> Any:  # a new function object: JAX caches traces per function (same variables)
        return fn(*args)

    closed = jax.make_jaxpr(fresh)(*[jax.ShapeDtypeStruct(a.aval.shape, a.aval.dtype, weak_type=a.aval.weak_type)
                                     for a in atoms])
    eqns, constvars, consts, outvars = _inline(closed.jaxpr, closed.consts, rows)
    bound = dict(zip(closed.jaxpr.invars, atoms))
    bind = lambda xs: [a if isinstance(a, Literal) else bound.get(a, a) for a in xs]
    return [e.replace(invars=bind(e.invars)) for e in eqns], constvars, consts, bind(outvars)


@dataclasses.dataclass
class _Rows:
    """Rows of scanned-over arrays found while inlining. ``rows``: the variable a row is read as ->
    (the array, the row); a row of a differentiated leaf is a Row of its block in the layers that
    read it (a stack of blocks iterated by a scan: Row-stacked layers of one kind, as a hand-built
    network has them). ``chains``: every variable of the equations slicing a row -> the array."""

    rows: dict = dataclasses.field(default_factory=dict)
    chains: dict = dataclasses.field(default_factory=dict)


def _unrolled_scan(eqn: Any, found: _Rows) -> tuple[list, list, list, list]:
    """A ``lax.scan`` whose body makes marked calls, unrolled into one copy of the body per step
    (fresh variables), reading row t of each scanned-over array; the stacked outputs are stacked
    from the steps'. Returns (eqns, constvars, consts, outvars of the scan)."""
    params = eqn.params
    body, length, reverse = params["jaxpr"], params["length"], params["reverse"]
    if "num_consts" in params:
        n_consts, n_carry = params["num_consts"], params["num_carry"]
    else:  # JAX ≥ 0.12: the operands' groups (consts, carry, xs) as a flat tree, one marker per leaf
        groups = params["ft_in"]
        groups = groups.unpack() if hasattr(groups, "unpack") else groups
        n_consts, n_carry = len(groups[0]), len(groups[1])
    consts_in = list(eqn.invars[:n_consts])
    carry = list(eqn.invars[n_consts:n_consts + n_carry])
    xs = list(eqn.invars[n_consts + n_carry:])
    eqns, constvars, consts, ys = [], [], [], []
    run = jax.extend.core.jaxpr_as_fun(body)
    for t in (range(length - 1, -1, -1) if reverse else range(length)):
        rows = []
        if xs:
            sub, cv, cs, rows = _traced(lambda *a, t=t: [x[t] for x in a], xs, found)
            eqns += sub
            constvars += cv
            consts += cs
            source = {x: x for x in xs}
            for e in sub:  # which array each slicing equation reads a row of
                src = next((source[a] for a in e.invars if not isinstance(a, Literal) and a in source), None)
                for o in e.outvars:
                    source[o] = src
                    found.chains[o] = src
            for x, r in zip(xs, rows):
                found.rows[r] = (x, t)
        sub, cv, cs, outs = _traced(run, consts_in + carry + rows, found)
        eqns += sub
        constvars += cv
        consts += cs
        carry, step_ys = outs[:n_carry], outs[n_carry:]
        ys.append(step_ys)
    if reverse:
        ys.reverse()
    stacked = []
    if ys and ys[0]:
        sub, cv, cs, stacked = _traced(lambda *a: [jax.numpy.stack(a[k::len(ys[0])]) for k in range(len(ys[0]))],
                                       [y for step in ys for y in step], found)
        eqns += sub
        constvars += cv
        consts += cs
    return eqns, constvars, consts, carry + stacked


# -- from the jaxpr to a Network ----------------------------------------------------------------
_FUNCTIONS: collections.OrderedDict[Hashable, Callable] = collections.OrderedDict()
_NETWORKS: collections.OrderedDict[Hashable, Program] = collections.OrderedDict()
CACHED = 64


def _shared(key: Hashable, make: Callable[[], Any], cache: collections.OrderedDict) -> Any:
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


def _layer_fn(eqns: tuple, operands: tuple, outs: tuple, specs: tuple, name: str = "layer") -> Callable:
    """A layer function ``fn(theta, *states)`` running ``eqns`` with its operands taken from
    ``specs`` (per operand: ("param", k) | ("read", r, j) | ("input", r) | ("literal", value)):
    returns the tuple of ``outs``. Equal programs share one function object (one kind), named
    after the first call it was made for (``Attention``, ``glue``)."""
    def raw(*values: Any) -> tuple:
        env = dict(zip(operands, values))
        for eqn in eqns:
            if _marked_index(eqn) is not None:  # the call's own program, without its (numbered) jit
                args = [a.val if isinstance(a, Literal) else env[a] for a in eqn.invars]
                env.update(zip(eqn.outvars, jax.extend.core.jaxpr_as_fun(eqn.params["jaxpr"])(*args)))
            else:
                _evaluate([eqn], env)
        return tuple(a.val if isinstance(a, Literal) else env[a] for a in outs)

    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type) for v in operands]
    closed = jax.make_jaxpr(raw)(*avals)
    key = (str(closed.jaxpr), tuple(Constant(c) for c in closed.consts), specs)

    def make() -> Callable:
        program = closed

        def fn(theta: tuple, *states: Any) -> tuple:
            values = []
            for spec in specs:
                if spec[0] == "param":
                    values.append(theta[spec[1]])
                elif spec[0] == "read":
                    values.append(states[spec[1]][spec[2]])
                elif spec[0] == "input":
                    values.append(states[spec[1]])
                else:
                    values.append(spec[1])
            return tuple(jax.extend.core.jaxpr_as_fun(program)(*values))

        fn.__name__ = fn.__qualname__ = name
        fn.__linbackprop_captured__ = True  # replays a program traced at one batch (per-example checks say so)
        return fn

    return _shared(key, make, _FUNCTIONS)


def build(closed: ClosedJaxpr, n_diff: int, block_names: Sequence[Hashable], calls: Sequence[str],
          rest_names: Sequence[str] = ()) -> Program:
    """The Program of ``closed`` (``fun`` traced with its marked calls), whose first ``n_diff``
    invars are the differentiated leaves named ``block_names`` and the others the arrays named
    ``rest_names`` (the network's inputs are named after them: ``tokens``, or ``tokens.1`` for a
    value computed from ``tokens`` before the network)."""
    found = _Rows()
    eqns, constvars, consts, outvars = _inline(closed.jaxpr, closed.consts, found)
    invars = list(closed.jaxpr.invars)
    diff_vars = set(invars[:n_diff])
    block_of_var: dict = dict(zip(invars[:n_diff], block_names))
    for row, (source, t) in found.rows.items():  # rows of stacked blocks a scan iterates over: Row blocks
        if source in block_of_var:
            block_of_var[row] = Row(block_of_var[source], t)
    # the equations slicing those rows are no glue: the layers read the rows as Row blocks
    rows_of_blocks = {v for v, src in found.chains.items() if src in block_of_var and
                      not isinstance(block_of_var[src], Row)}
    diff_vars |= set(block_of_var)
    marked = [_marked_index(e) for e in eqns]
    if not any(m is not None for m in marked):
        raise ValueError("layers=: no call of the layers named was found in fun (check that fun calls them, "
                         "with the classes or @lbp.layer functions passed to layers=).")
    # which equations depend on a layer's output or a differentiated leaf, and which feed a layer
    moving: set = set(diff_vars)
    for e, m in zip(eqns, marked):
        if m is not None or any(a in moving for a in e.invars if not isinstance(a, Literal)):
            moving.update(e.outvars)
    feeds = [False] * len(eqns)
    needed: set = set()
    for n in range(len(eqns) - 1, -1, -1):
        e = eqns[n]
        if marked[n] is not None or any(o in needed for o in e.outvars):
            feeds[n] = True
            needed.update(a for a in e.invars if not isinstance(a, Literal))
    in_net = [m is not None or (feeds[n] and any(a in moving for a in e.invars if not isinstance(a, Literal))
                                and not all(o in rows_of_blocks for o in e.outvars))  # a Row: read as a block
              for n, (e, m) in enumerate(zip(eqns, marked))]
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
    origin = dict(zip(invars[n_diff:], rest_names))  # var -> the argument it is, or is computed from
    for e in before:
        sources = [origin[a] for a in e.invars if not isinstance(a, Literal) and a in origin]
        for o in e.outvars:
            first = sources[0] if sources else "input"
            origin.setdefault(o, first if isinstance(first, tuple) else ("from", first))
    # the network's nodes: each marked call, and each run of glue between them
    nodes: list[tuple[str, list]] = []
    seen_names = collections.Counter()  # a call's name, numbered in order (a scan's steps repeat one call)
    for e, inside, m in zip(eqns, in_net, marked):
        if not inside:
            continue
        if m is not None:
            nodes.append((f"{calls[m]}{seen_names[calls[m]]}", [e]))
            seen_names[calls[m]] += 1
        elif nodes and nodes[-1][0].startswith("glue"):
            nodes[-1][1].append(e)
        else:
            nodes.append((f"glue{sum(name.startswith('glue') for name, _ in nodes)}", [e]))
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
    inputs: dict = {}  # atom -> input name
    layers = []
    output_vars: dict[Hashable, list] = {}
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
                    specs.append(("param", params.index(block_of_var[a])))
                elif a in producer:
                    src, j = producer[a]
                    if src not in reads:
                        reads.append(src)
                    specs.append(("read", reads.index(src), j))
                else:  # data: a value computed before the network, an argument, a constant
                    if a not in inputs:
                        inputs[a] = _input_name(a, origin, {*inputs.values(), *(name for name, _ in nodes)})
                    if inputs[a] not in reads:
                        reads.append(inputs[a])
                    specs.append(("input", reads.index(inputs[a])))
        outs = [o for e in node_eqns for o in e.outvars if not isinstance(o, jax.extend.core.DropVar)]
        outs = [o for o in outs if o in used_later or readers[o] - {n}] or outs[:1]
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
        dummy = _NoInput()
        input_names, inputs = ["input"], {dummy: "input"}
        constvars, consts = [*constvars, dummy], [*consts, np.float32(0)]
    names = list(output_vars)
    net = Network(layers, inputs=input_names, outputs=names[0] if len(names) == 1 else names)
    block_vars = tuple(next(v for v, b in block_of_var.items() if not isinstance(b, Row) and b == p)
                       for p in net.param_names)
    return Program(net=net, before=before, after=after, invars=tuple(invars), constvars=tuple(constvars),
                   consts=tuple(consts), outvars=tuple(outvars), block_vars=block_vars,
                   input_atoms=tuple(inputs), output_vars=tuple(tuple(output_vars[n]) for n in names),
                   calls=tuple(calls))


# -- fun rewritten around the network found ----------------------------------------------------------
def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic)) or isinstance(x, jax.core.Tracer)


@dataclasses.dataclass(frozen=True, eq=False)
class _Argument:
    """One differentiated argument: its leaves to differentiate (with their block names), the
    rest it holds (an nnx module's other state), and how to rebuild it and its gradient."""

    leaves: list
    names: list
    treedef: Any
    rest: list  # arrays beside the differentiated ones (nnx: RNG streams, batch statistics)
    rebuild: Callable[[list, list], Any]  # (diff leaves, rest leaves) -> the argument for fun
    gradient: Callable[[list], Any]  # diff-shaped leaves -> the gradient as the framework gives it
    state_out: Callable[[Any], list] | None = None  # the argument after fun -> its rest leaves
    write_back: Callable[[list], None] | None = None  # rest leaves -> the caller's module updated
    leaves_of: Callable[[Any], list] = jax.tree.leaves  # a tangent (or like value) -> its diff leaves
    rest_names: list = dataclasses.field(default_factory=list)  # the rest's leaves by path (input names)


def _argument(arg: Any, prefix: str) -> _Argument:
    nnx, eqx = sys.modules.get("flax.nnx"), sys.modules.get("equinox")
    if nnx is not None and isinstance(arg, nnx.Module):
        graphdef, params, rest = nnx.split(arg, nnx.Param, ...)
        paths, treedef = jax.tree_util.tree_flatten_with_path(params)
        rest_paths, rest_def = jax.tree_util.tree_flatten_with_path(rest)
        rest_leaves = [leaf for _, leaf in rest_paths]

        def rebuild(d: list, r: list) -> Any:
            return nnx.merge(graphdef, jax.tree.unflatten(treedef, d), jax.tree.unflatten(rest_def, r))

        def state_out(module: Any) -> list:
            return jax.tree.leaves(nnx.split(module, nnx.Param, ...)[2])

        def write_back(r: list) -> None:
            nnx.update(arg, jax.tree.unflatten(rest_def, r))

        def leaves_of(t: Any) -> list:
            return jax.tree.leaves(nnx.split(t, nnx.Param, ...)[1] if isinstance(t, nnx.Module) else t)

        return _Argument([leaf for _, leaf in paths], [prefix + _path(p) for p, _ in paths], treedef, rest_leaves,
                         rebuild, lambda g: jax.tree.unflatten(treedef, g), state_out, write_back, leaves_of,
                         [prefix + _path(p) for p, _ in rest_paths])
    if eqx is not None and isinstance(arg, eqx.Module):
        diff, static = eqx.partition(arg, eqx.is_inexact_array)
        paths, treedef = jax.tree_util.tree_flatten_with_path(diff)
        return _Argument([leaf for _, leaf in paths], [prefix + _path(p) for p, _ in paths], treedef, [],
                         lambda d, r: eqx.combine(jax.tree.unflatten(treedef, d), static),
                         lambda g: jax.tree.unflatten(treedef, g),
                         leaves_of=lambda t: jax.tree.leaves(eqx.filter(t, eqx.is_inexact_array)))
    paths, treedef = jax.tree_util.tree_flatten_with_path(arg)
    return _Argument([leaf for _, leaf in paths], [prefix + _path(p) for p, _ in paths], treedef, [],
                     lambda d, r: jax.tree.unflatten(treedef, d), lambda g: jax.tree.unflatten(treedef, g))


def _parameter_name(fun: Callable, i: int) -> str:
    """The name of ``fun``'s i-th positional parameter (``tokens``), else ``args[i]``."""
    try:
        params = list(inspect.signature(fun).parameters.values())
    except (TypeError, ValueError):
        params = []
    if i < len(params) and params[i].kind in (params[i].POSITIONAL_ONLY, params[i].POSITIONAL_OR_KEYWORD):
        return params[i].name
    return f"args[{i}]"


def _leaf_names(arg: Any, name: str) -> list[str]:
    """The names of ``arg``'s leaves, as jax.tree.leaves orders them: ``name`` and their paths."""
    return [name + jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(arg)[0]]


def _path(path: tuple) -> str:
    """A block's name: its path in the argument, without nnx's trailing ``.value``."""
    if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name == "value":
        path = path[:-1]
    return jax.tree_util.keystr(path)


@dataclasses.dataclass(frozen=True, eq=False)
class Rewritten:
    """``fun`` at ``args`` as a function of flat leaves around one network call.

    ``fun(*diff, rest)`` (``diff``: a list of leaves per differentiated argument, ``rest``: every
    other array) returns ``(fun's result, states)``: states are the nnx modules' state after the
    call, for `write_back`. ``gradient(per_argument)`` maps leaf lists back to each
    argument's own gradient type (nnx.State, an equinox module, the pytree)."""

    fun: Callable
    args: tuple
    program: Program
    arguments: tuple

    def gradient(self, grads: Sequence[list], single: bool) -> Any:
        out = tuple(a.gradient(list(g)) for a, g in zip(self.arguments, grads))
        return out[0] if single else out

    def write_back(self, states: list) -> None:
        start = 0
        for a in self.arguments:
            if a.write_back is not None:
                a.write_back(states[start:start + len(a.rest)])
                start += len(a.rest)


def rewrite(fun: Callable, args: tuple, argnums: tuple[int, ...], layers: Any) -> Rewritten:
    """Trace ``fun(*args)`` with the calls of ``layers`` made opaque, find the network, and
    return ``fun`` as a function of the differentiated leaves around one call of it."""
    entries = layers if isinstance(layers, tuple | list) else (layers,)
    for i in argnums:
        if not 0 <= i < len(args):
            raise ValueError(f"argnums names argument {i}, but fun was called with {len(args)} arguments.")
    arguments = [_argument(args[i], "" if len(argnums) == 1 else f"[{i}]") for i in argnums]
    others = [(i, a) for i, a in enumerate(args) if i not in argnums]
    other_leaves, other_def = jax.tree.flatten([a for _, a in others])
    traced_pos = [n for n, leaf in enumerate(other_leaves) if _is_array(leaf)]
    rest = [leaf for a in arguments for leaf in a.rest] + [other_leaves[n] for n in traced_pos]
    other_names = [name for i, a in others for name in _leaf_names(a, _parameter_name(fun, i))]
    rest_names = [n for a in arguments for n in a.rest_names] + [other_names[n] for n in traced_pos]
    sizes = [len(a.leaves) for a in arguments]

    def flat(diff_leaves: list, rest_leaves: list) -> tuple:
        full: list = [None] * len(args)
        start, r = 0, 0
        for i, a, size in zip(argnums, arguments, sizes):
            full[i] = a.rebuild(diff_leaves[start:start + size], rest_leaves[r:r + len(a.rest)])
            start, r = start + size, r + len(a.rest)
        leaves = list(other_leaves)
        for n, value in zip(traced_pos, rest_leaves[r:]):
            leaves[n] = value
        for (i, _), value in zip(others, jax.tree.unflatten(other_def, leaves)):
            full[i] = value
        result = fun(*full)
        states = [leaf for i, a in zip(argnums, arguments) if a.state_out is not None for leaf in a.state_out(full[i])]
        return result, states

    diff = [leaf for a in arguments for leaf in a.leaves]
    names = [n for a in arguments for n in a.names]
    patched = _Patched(tuple(entries))
    saved = _CAPTURING.calls, _CAPTURING.functions
    _CAPTURING.calls, _CAPTURING.functions = [], set()
    try:
        with patched, _CAPTURE_KEY(next(_captures)):
            closed, shape = jax.make_jaxpr(flat, return_shape=True)(diff, rest)
        calls, functions = tuple(_CAPTURING.calls), _CAPTURING.functions
    finally:
        _CAPTURING.calls, _CAPTURING.functions = saved
    never = [c.__qualname__ for c in patched.classes if c not in patched.seen]
    never += [getattr(f, "__qualname__", repr(f)) for f in patched.functions if f not in functions]
    if never:
        raise ValueError(f"layers= names {', '.join(never)}, but fun never called it (no instance's call, no "
                         "call of the function): check what fun calls (a subclass or a wrapper is another class), "
                         "or leave it out of layers=.")
    key = (str(closed.jaxpr), tuple(Constant(c) for c in closed.consts), tuple(names), calls)
    program = _shared(key, lambda: build(closed, len(diff), names, calls, rest_names), _NETWORKS)
    out_def = jax.tree.structure(shape)

    def rewritten(*parts: Any) -> tuple:
        *diffs, rest_leaves = parts
        outs = program.run([leaf for d in diffs for leaf in d] + list(rest_leaves))
        return jax.tree.unflatten(out_def, outs)

    split = []
    start = 0
    for size in sizes:
        split.append(list(diff[start:start + size]))
        start += size
    return Rewritten(rewritten, (*split, rest), program, tuple(arguments))


def capture(fun: Callable, *args: Any, layers: Any, argnums: int | Sequence[int] = 0) -> Capture:
    """The network ``fun`` calls, found by tracing ``fun(*args)`` with the calls of ``layers``
    (classes, or functions decorated with [`layer`][linbackprop.layer]) as its layers.

    ``cap.net`` is an ``lbp.Network`` (inspect it, ``lbp.linearize(cap.net, cap.params,
    *cap.inputs)``, ``lbp.plot_network(cap.net)``); ``cap.params`` its blocks (the leaves of the
    arguments ``argnums`` names, by path) and ``cap.inputs`` its inputs at ``args``.

    Examples:
        >>> import jax, jax.numpy as jnp, linbackprop as lbp
        >>> @lbp.layer
        ... def block(p, h):
        ...     return h + jnp.tanh(h @ p["W"])
        >>> def loss(params, x):
        ...     for p in params:                    # a Python loop over the blocks
        ...         x = block(p, x)
        ...     return jnp.sum(x ** 2)
        >>> params = [{"W": 0.1 * jnp.eye(2)} for _ in range(3)]
        >>> cap = lbp.capture(loss, params, jnp.ones((4, 2)), layers=block)
        >>> [layer.name for layer in cap.net.layers], cap.net.param_names
        (['block0', 'block1', 'block2'], ("[0]['W']", "[1]['W']", "[2]['W']"))
    """
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    found = rewrite(fun, args, nums, layers)
    leaves = [leaf for d in found.args[:-1] for leaf in d] + list(found.args[-1])
    program = found.program
    return Capture(program.net, program.blocks(leaves), program.inputs_of(leaves))
