"""``fun`` rewritten around the network found: `rewrite` traces it with the calls marked and
returns it as a function of the differentiated leaves (an nnx module's, an equinox module's,
a pytree's) around one Network call, with each argument's gradient in its own type; `capture`.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend.core import Literal

from .._frameworks import split_argument
from .._graph import FREE, MIXED, Constant, Stack, example_flow, row_codes
from .._options import settings_changed
from ._marks import Capturing, Patched
from ._program import NETWORKS, Capture, Program, at_any_batch, build, shared_value


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
    """``arg`` split as its framework splits it (`_frameworks.split_argument`), its leaves named."""
    split = split_argument(arg)
    names = lambda paths: [prefix + _path(p) for p, _ in paths]
    extra = {} if split.leaves_of is None else {"leaves_of": split.leaves_of}
    return _Argument([leaf for _, leaf in split.paths], names(split.paths), split.treedef,
                     [leaf for _, leaf in split.rest_paths], split.rebuild,
                     lambda g, treedef=split.treedef: jax.tree.unflatten(treedef, g), split.state_out,
                     split.write_back, rest_names=names(split.rest_paths), **extra)


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


def _program(flat: Callable, diff: list, rest: list, entries: tuple, names: list, rest_names: list,
             unbatched: frozenset[str] = frozenset()) -> tuple[Program, Any, list[bool]]:
    """The Program of ``flat(diff, rest)`` traced with the calls of ``entries`` marked (cached per
    captured jaxpr), the shape of its result, and which leaves of ``rest`` are raw PRNG keys
    (`_raw_keys`); ``unbatched`` as `build` takes it."""
    patched = Patched(entries)
    state = Capturing(patched.functions, patched.classes)
    with patched, settings_changed(capture=state):  # its own jit key (Settings.capture)
        closed, shape = jax.make_jaxpr(flat, return_shape=True)(diff, rest)
    calls, functions = tuple(state.calls), state.functions
    never = [c.__qualname__ for c in patched.classes if c not in state.seen]
    never += [getattr(f, "__qualname__", repr(f)) for f in patched.functions if f not in functions]
    if never:
        raise ValueError(f"layers= names {', '.join(never)}, but fun never called it (no instance's call, no "
                         "call of the function): check what fun calls (a subclass or a wrapper is another class), "
                         "or leave it out of layers=.")
    # the data arguments' names are the inputs' (a Program from another function with the same jaxpr
    # names them otherwise, and the one-example trace, not cached with it, would not match)
    key = (str(closed.jaxpr), tuple(Constant(c) for c in closed.consts), tuple(names), tuple(rest_names), calls,
           unbatched)
    program = shared_value(key, lambda: build(closed, len(diff), names, calls, rest_names, unbatched), NETWORKS)
    return program, shape, _raw_keys(closed.jaxpr, closed.jaxpr.invars[len(diff):])


def _raw_keys(jaxpr: Any, variables: list) -> list[bool]:
    """Which of ``variables`` are raw PRNG keys, from how they flow: each reaches a ``random_wrap``
    (followed into nested jaxprs: jits, scans, the marked calls) whose key data is its leading
    axis — a uint32 [2] key of threefry, whatever the batch. A raw key per example ([B, 2]) keeps
    its leading axis for the examples."""
    wrapped: set = set()

    def visit(jaxpr: Any, watched: dict) -> None:  # watched: variable -> the index of the argument it is
        for eqn in jaxpr.eqns:
            operands = [(n, watched[v]) for n, v in enumerate(eqn.invars)
                        if not isinstance(v, Literal) and v in watched]
            if not operands:
                continue
            if eqn.primitive.name == "random_wrap":
                key_axes = len(eqn.params["impl"].key_shape)
                wrapped.update(i for n, i in operands if n == 0 and eqn.invars[0].aval.ndim == key_axes)
            for inner in _sub_jaxprs(eqn):
                offset = len(eqn.invars) - len(inner.invars)  # cond: its index comes first
                visit(inner, {inner.invars[n - offset]: i for n, i in operands if n >= offset})

    visit(jaxpr, {v: i for i, v in enumerate(variables)})
    return [i in wrapped for i in range(len(variables))]


def _sub_jaxprs(eqn: Any) -> list:
    """The jaxprs an equation calls whose inputs are its operands in order (or after a leading
    index, as ``cond``'s branches)."""
    found = []
    for value in eqn.params.values():
        for item in value if isinstance(value, tuple | list) else (value,):
            inner = getattr(item, "jaxpr", item)
            if hasattr(inner, "invars") and hasattr(inner, "eqns") and len(inner.invars) in (
                    len(eqn.invars), len(eqn.invars) - 1):
                found.append(inner)
    return found


def _data_among(flat: Callable, diff: list, rest: list, candidates: list[bool], batch: int) -> list[bool]:
    """Which of the ``candidates`` (the arguments not differentiated whose leading axis is the
    batch) are the data: proved from ``fun``'s program (`example_flow`), each candidate's rows
    numbered as the examples in turn — data where ``fun`` reads it, and each per-example
    result (a leading axis of the batch) reads row b of it at row b alone, every other result a
    sum of per-example terms, for every value. A frozen parameter whose leading axis happens
    to equal the batch (a 2 × 2 matrix at batch 2, an embedding table or class weights with as
    many rows as examples) is read as a table, not by row: no data. Where no candidate is read
    by row, every candidate (the checks that follow say what mixes the examples)."""
    where = [n for n, c in enumerate(candidates) if c]
    if not where:
        return candidates
    aval = lambda x: jax.ShapeDtypeStruct(np.shape(x), jax.numpy.result_type(x))
    diff_avals, rest_avals = [aval(x) for x in diff], [aval(x) for x in rest]
    program, shape = jax.make_jaxpr(flat, return_shape=True)(diff_avals, rest_avals)  # one trace, each labelling
    n_results = len(jax.tree.leaves(shape[0]))
    chosen = [False] * len(candidates)
    for n in where:
        labels = [None] * len(diff) + [row_codes(np.shape(x)) if m == n else None for m, x in enumerate(rest)]
        results = example_flow(program, (), labels).codes[:n_results]
        read = any(np.any(c != FREE) for c in results)
        chosen[n] = read and all(_read_by_row(c, batch) for c in results)
    return chosen if any(chosen) else candidates


def _read_by_row(codes: np.ndarray, batch: int) -> bool:
    """Whether a result's codes say it reads the examples one by one: row b of a per-example
    result (its leading axis the batch) example b alone, any other result a sum of such terms."""
    if codes.ndim and codes.shape[0] == batch:
        return bool(np.all((codes == FREE) | (codes == row_codes(codes.shape))))
    return not np.any(codes == MIXED)


def _at_one_example(program: Program, raw_keys: list[bool], flat: Callable, diff: list, rest: list,
                    entries: tuple, names: list, rest_names: list, n_other: int,
                    name: str = "the per-example transforms") -> Program:
    """``program`` whose layers also run on one example: ``fun`` traced again with each data
    argument whose leading axis is the batch (that of the first output state, axis 1 of a
    `Stack`) sliced to one example — but a raw PRNG key (``raw_keys``, from how it flows) — and
    each layer given both programs (`at_any_batch`)."""
    # the batch: the leading axis of the first output state (axis 1 of a Stack of states)
    axis = 1 if isinstance(program.net.output_spec[0], Stack) else 0
    first = program.output_vars[0][0].aval.shape[axis:]
    if not first or first[0] == 1:
        return program  # no batch axis (the transform says so), or one example already
    batch = first[0]
    first_other = len(rest) - n_other  # the nnx modules' other state comes first: not data
    # data: an argument whose leading axis is the batch, unless that axis is a raw key's data
    candidates = [n >= first_other and bool(np.ndim(x)) and np.shape(x)[0] == batch and not key
                  for n, (x, key) in enumerate(zip(rest, raw_keys))]
    chosen = _data_among(flat, diff, rest, candidates, batch)
    one = [jax.ShapeDtypeStruct((1, *np.shape(x)[1:]), x.dtype) if s else x for x, s in zip(rest, chosen)]
    try:
        one_program = _program(flat, diff, one, entries, names, rest_names)[0]
    except (TypeError, ValueError, IndexError) as error:
        cut = [name for name, s in zip(rest_names, chosen) if s][:6]
        raise ValueError(
            f"layers=: fun is traced again on one example for {name}, each argument whose "
            f"leading axis is the batch ({batch}: {cut}) sliced to its first row, and fun fails there "
            f"({type(error).__name__}: {str(error).splitlines()[0][:200]}). A model that writes the batch "
            f"size into its program (h.reshape({batch}, -1)) or indexes the batch needs it from the "
            "operand (h.reshape(h.shape[0], -1)); or use jax.jacrev / jax.vmap(jax.grad) of a per-example "
            "loss.") from error
    # an input of the same shape on one example as on the batch is no data (a frozen parameter's
    # value) even where its leading axis is the batch: fed whole (`FromUnbatched`)
    shapes = lambda p: {n: tuple(a.aval.shape) for n, a in zip(p.net.inputs, p.input_atoms) if hasattr(a, "aval")}
    one_shapes = shapes(one_program)
    whole = frozenset(n for n, s in shapes(program).items() if s[:1] == (batch,) and one_shapes.get(n) == s)
    if whole:
        program = _program(flat, diff, rest, entries, names, rest_names, whole)[0]
        one_program = _program(flat, diff, one, entries, names, rest_names, whole)[0]
    key = ("at any batch", program, one_program)
    return shared_value(key, lambda: at_any_batch(program, one_program), NETWORKS)


def rewrite(fun: Callable, args: tuple, argnums: tuple[int, ...], layers: Any, per_example: bool | str = False
            ) -> Rewritten:
    """Trace ``fun(*args)`` with the calls of ``layers`` made opaque, find the network, and
    return ``fun`` as a function of the differentiated leaves around one call of it.
    ``per_example``: its layers also run on one example (`at_any_batch`), as the per-example
    transforms evaluate them (a string: the transform's name, which its errors give)."""
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
    program, shape, raw_keys = _program(flat, diff, rest, tuple(entries), names, rest_names)
    if per_example:
        program = _at_one_example(program, raw_keys, flat, diff, rest, tuple(entries), names, rest_names,
                                  n_other=len(traced_pos), name=per_example if isinstance(per_example, str)
                                  else "the per-example transforms")
    out_def = jax.tree.structure(shape)

    def rewritten(*parts: Any) -> tuple:
        *diffs, rest_leaves = parts
        outs = program.run([leaf for d in diffs for leaf in d] + list(rest_leaves))
        return jax.tree.unflatten(out_def, outs)

    if program.one is not None:  # the same on one example's data (the per-example transforms' heads)
        def on_one_example(*parts: Any) -> tuple:
            *diffs, rest_leaves = parts
            outs = program.one.run([leaf for d in diffs for leaf in d] + list(rest_leaves))
            return jax.tree.unflatten(out_def, outs)

        rewritten.__linbackprop_one_example__ = on_one_example

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

    Args:
        fun: the model and its loss, as a transform would differentiate it.
        *args: ``fun``'s arguments (arrays, modules, pytrees).
        layers: the classes (whose instances' calls are layers) and ``@lbp.layer`` functions
            whose calls are the layers; one or a sequence.
        argnums: the argument(s) whose leaves are the parameter blocks.

    Returns:
        A [`Capture`][linbackprop.Capture]: ``net``, ``params`` and ``inputs``.

    Raises:
        ValueError: ``layers`` whose calls ``fun`` never makes, or a model the capture cannot
            take as it is (the message names the call and the fix).
        TypeError: ``layers`` that is neither a class nor an ``@lbp.layer`` function.

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
