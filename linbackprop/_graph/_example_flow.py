"""Which example each value reads: a proof, from the program, that examples stay apart.

Per-example gradients, their norms, clipping and every transform that takes the loss's Hessian
block diagonal over the examples rest on one fact about a function: output b reads example b
alone. That fact is decided here for every value of the data, by reading the function's jaxpr —
never by evaluating it.

Every element of every value gets a *code*: `FREE` (it reads none of the labelled inputs: data,
parameters, constants — whatever their values), an example's id ``e ≥ 0`` (it reads that
example's labelled elements and free values, nothing else), `SUMMED` (a sum of terms each of
which reads one example: f = Σ_e f_e(x_e) + c, the form whose Hessian is block diagonal), or
`MIXED` (anything else). The labelled inputs carry the ids (an output's row b: id b). Each
equation maps its operands' codes to its results' codes by what the operation does with
elements — the same facts JAX's batching rules encode:

- elementwise operations combine the codes at each position (a sum keeps `SUMMED`, a product
  with a free value keeps it, anything nonlinear of a sum is `MIXED`);
- operations that move elements (reshape, transpose, slices, concatenation, padding, gathers
  and dynamic slices whose indices are known at trace time: ``jnp.arange``, literals) move
  the codes the same way — they are applied to the code arrays;
- a gather or dynamic slice whose indices are data (unknown until run time) may read any
  element along the indexed axes: the codes there are combined, so ``out[partner]`` reads
  every example (`MIXED`), while ``logits[jnp.arange(B), labels]`` and ``take_along_axis``
  read example b's row (the batch index is known, the class index is data);
- reductions combine along their axes (a sum into `SUMMED`, a maximum into `MIXED` where two
  examples meet); contractions (``dot_general``, convolutions) likewise per output element;
- control flow is followed: nested jits, custom derivatives and checkpoints inline, ``cond``
  joins its branches (an index that reads an example reaches every result), ``scan`` and
  ``while`` iterate their carry to a fixed point;
- any other operation combines every code of its operands into each result element: an
  operation this module does not know never separates examples.

Values computed from literals, ``iota`` and concrete integer constants alone are carried along
(per element: known or not), which is what tells a gather's known batch index from its data
index. Nothing is drawn at random and no user value is evaluated: the result holds for every
value the program can see. Where it says `MIXED`, `Flow.combined_at` names the operations that first
mixed examples, with the user's line.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal

from ._example_codes import (
    ADDITIVE,
    CALLS,
    CODE,
    CUMULATIVE,
    ELEMENTWISE,
    FREE,
    KNOWN_LIMIT,
    LINEAR_UNARY,
    MIXED,
    PASS_THROUGH,
    SINGLE_REDUCTIONS,
    SUMMED,
    WINDOWS,
    convolution,
    dot_general,
    full_codes,
    join_add,
    join_either,
    join_single,
    known_constant,
    move,
    nonlinear,
    reduce,
    unary_elementwise,
    whole,
    window,
)
from ._example_codes import div as _div
from ._example_codes import mul as _mul
from ._jaxprs import bind_equation


class Flow(NamedTuple):
    """What `example_flow` found: per output leaf its codes (an int array of its shape), and in
    program order ``(code, operation)`` where an operation first gave `MIXED` (a result reading
    several examples at once, from operands that did not) or `SUMMED` (a sum of terms of
    different examples — what a mean loss is, and what a per-example loss must not be), each
    operation as the primitive and the user's line."""

    codes: list[np.ndarray]
    combined_at: list[tuple[int, str]]

    def where(self, summed: bool = True) -> str:
        """The operations that mixed examples (and, with ``summed``, summed them), in words."""
        found = [at for code, at in self.combined_at if code == MIXED or summed]
        return ("; the operation(s) that combine examples: " + ", ".join(found[:3])) if found else ""


def example_flow(fn: Callable | Any, args: Sequence[Any], labels: Sequence[np.ndarray | None]) -> Flow:
    """The codes of ``fn``'s output leaves, ``fn`` traced once at ``args``' shapes (arrays,
    avals or ``jax.ShapeDtypeStruct``s) — or ``fn`` a ``ClosedJaxpr`` already traced there
    (several labellings of one program: ``args`` then unused); ``labels``: per leaf of ``args``
    (flat), its codes (an int array of its shape: each element's example id, or `FREE`), or
    None: free. What ``fn`` closes over is free (data, parameters, constants); a closed-over
    concrete integer array's values are known (a gather by them moves codes exactly)."""
    closed = fn if hasattr(fn, "jaxpr") and hasattr(fn, "consts") else jax.make_jaxpr(fn)(*args)
    jaxpr = closed.jaxpr
    state = _State()
    for v, c in zip(jaxpr.constvars, closed.consts):
        state.codes[v] = None
        state.known[v] = known_constant(c)
    for v, lab in zip(jaxpr.invars, labels):
        state.codes[v] = None if lab is None or not np.any(np.asarray(lab) != FREE) else np.asarray(lab, CODE)
    state.run(jaxpr)
    codes = [full_codes(state.code(v), v.aval.shape) for v in jaxpr.outvars]
    return Flow(codes, state.combined_at)


def _summary(eqn: Any) -> str:
    try:
        from jax._src import source_info_util  # the user's line of an equation: JAX keeps it private
        where = source_info_util.summarize(eqn.source_info)
    except Exception:  # pragma: no cover - another JAX layout
        where = "?"
    return f"{eqn.primitive.name} at {where}"


class _State:
    """Codes (None: all free) and known values ((values, known mask) or None) of variables."""

    def __init__(self) -> None:
        self.codes: dict = {}
        self.known: dict = {}
        self.combined_at: list[tuple[int, str]] = []  # (MIXED or SUMMED, the operation), in order

    def code(self, v: Any) -> np.ndarray | None:
        return None if isinstance(v, Literal) else self.codes.get(v)

    def known_of(self, v: Any) -> tuple[np.ndarray, np.ndarray] | None:
        if isinstance(v, Literal):
            values = np.asarray(v.val)
            return values, np.ones(values.shape, bool)
        return self.known.get(v)

    def run(self, jaxpr: Any) -> None:
        for eqn in jaxpr.eqns:
            ins = [self.code(v) for v in eqn.invars]
            if all(c is None for c in ins) and eqn.primitive.name not in CALLS:
                outs = [None] * len(eqn.outvars)  # reads no example: so does its result
            else:
                outs = self.rule(eqn, ins)
                outs = [None if o is None or not np.any(o != FREE) else np.asarray(o, CODE) for o in outs]
                for code in (MIXED, SUMMED):
                    if not any(c is not None and np.any(c == code) for c in ins) and \
                            any(o is not None and np.any(o == code) for o in outs):
                        self.combined_at.append((code, _summary(eqn)))
            for v, o in zip(eqn.outvars, outs):
                self.codes[v] = o
            self._carry_known(eqn)

    def run_inner(self, closed: Any, ins: list, knowns: list | None = None) -> tuple[list, list]:
        """A nested jaxpr's output codes from its inputs' (a call, a branch, a loop's body), and
        what is known of its outputs' values from what is known of its inputs'."""
        jaxpr = getattr(closed, "jaxpr", closed)
        consts = getattr(closed, "consts", ())
        inner = _State()
        for v, c in zip(jaxpr.constvars, consts):
            inner.codes[v], inner.known[v] = None, known_constant(c)
        for n, (v, c) in enumerate(zip(jaxpr.invars, ins)):
            inner.codes[v] = c
            if knowns is not None and knowns[n] is not None:
                inner.known[v] = knowns[n]
        inner.run(jaxpr)
        self.combined_at.extend(c for c in inner.combined_at if c not in self.combined_at)
        return [inner.code(v) for v in jaxpr.outvars], [inner.known_of(v) for v in jaxpr.outvars]

    # the rules: operands' codes -> results' codes

    def rule(self, eqn: Any, ins: list) -> list:
        name = eqn.primitive.name
        shapes = [tuple(v.aval.shape) for v in eqn.outvars]
        full = [full_codes(c, v.aval.shape) for c, v in zip(ins, eqn.invars)]
        p = eqn.params
        if name in CALLS and CALLS[name] is not None and p.get(CALLS[name]) is not None:
            knowns = [self.known_of(v) for v in eqn.invars]
            inner = p[CALLS[name]]
            offset = len(eqn.invars) - len(getattr(inner, "jaxpr", inner).invars)
            codes, known = self.run_inner(inner, ins[offset:], knowns[offset:])
            self.known.update((v, k) for v, k in zip(eqn.outvars, known) if k is not None)
            return codes
        if name in ELEMENTWISE:
            return [self._elementwise(name, eqn, full, shapes[0])] * len(shapes)
        if name == "random_wrap":  # a key from its data's trailing axes
            trailing = len(eqn.params["impl"].key_shape)
            return [reduce(full[0], range(full[0].ndim - trailing, full[0].ndim), additive=False)]
        if name in ("random_unwrap", "random_bits", "random_split"):  # each key's draws follow the key
            extra = len(shapes[0]) - full[0].ndim
            return [np.broadcast_to(full[0].reshape(full[0].shape + (1,) * extra), shapes[0])]
        if name in PASS_THROUGH and len(eqn.invars) == len(eqn.outvars):
            return list(ins)
        structural = self._structural(eqn, full)
        if structural is not None:
            return structural
        if name == "reduce_sum":
            return [reduce(full[0], p["axes"], additive=True)]
        if name in SINGLE_REDUCTIONS:
            return [reduce(full[0], p["axes"], additive=False)]
        if name == "reduce":
            dims = p["dimensions"]
            joined = full[0]
            for x in full[1:]:
                joined = join_single(joined, x)
            return [reduce(joined, dims, additive=False)] * len(shapes)
        if name in CUMULATIVE:
            along = reduce(full[0], (p["axis"],), additive=CUMULATIVE[name], keepdims=True)
            return [np.broadcast_to(along, shapes[0])]
        if name in ("sort", "top_k"):
            axis = p.get("dimension", p.get("axis", -1))
            joined = full[0]
            for x in full[1:]:
                joined = join_single(joined, x)
            along = reduce(joined, (axis,), additive=False, keepdims=True)
            return [np.broadcast_to(along, s) for s in shapes]
        if name == "dot_general":
            return [dot_general(full[0], full[1], p["dimension_numbers"], shapes[0])]
        if name == "conv_general_dilated":
            return [convolution(full[0], ins, p, shapes[0])]
        if name in WINDOWS:
            return [window(full[0], p, shapes[0], WINDOWS[name])]
        if name == "cond":
            return self._cond(eqn, ins)
        if name == "scan":
            return self._scan(eqn, ins)
        if name == "while":
            return self._while(eqn, ins)
        if unary_elementwise(eqn):
            return [self._elementwise(name, eqn, full, shapes[0])]
        return [np.full(s, whole(ins), CODE) for s in shapes]  # unknown to this module: every code meets

    def _elementwise(self, name: str, eqn: Any, full: list, shape: tuple) -> np.ndarray:
        if name in ADDITIVE:
            return np.broadcast_to(join_add(full[0], full[1]), shape)
        if name == "mul":
            return np.broadcast_to(_mul(full[0], full[1]), shape)
        if name == "div":
            return np.broadcast_to(_div(full[0], full[1]), shape)
        if name in LINEAR_UNARY or (name == "convert_element_type" and _inexact(eqn.invars[0]) and
                                     _inexact(eqn.outvars[0])):
            return np.broadcast_to(full[0], shape)
        if name == "select_n":
            pred, cases = full[0], full[1:]
            out = cases[0]
            for c in cases[1:]:
                out = join_either(out, c)
            return np.broadcast_to(np.where(pred == FREE, out, join_single(pred, out)), shape)
        out = full[0]
        for x in full[1:]:
            out = join_single(out, x)
        return np.broadcast_to(nonlinear(out), shape)

    def _structural(self, eqn: Any, full: list) -> list | None:
        """The operations that move elements: their codes moved the same way (None: not one)."""
        name, p = eqn.primitive.name, eqn.params
        moved = move(name, p, full, [tuple(v.aval.shape) for v in eqn.outvars])
        if moved is not None:
            return moved
        if name == "gather":
            return [self._gather(eqn, full)]
        if name == "dynamic_slice":
            return [self._dynamic_slice(eqn, full)]
        if name == "dynamic_update_slice":
            starts = [self.known_of(v) for v in eqn.invars[2:]]
            if all(k is not None and k[1].all() for k in starts):
                with jax.ensure_compile_time_eval():
                    out = jax.lax.dynamic_update_slice(full[0], full[1], [int(k[0]) for k in starts])
                return [np.asarray(out, CODE)]
            return None
        return None

    def _gather(self, eqn: Any, full: list) -> np.ndarray:
        operand, p = full[0], eqn.params
        dims = p["dimension_numbers"]
        shape = tuple(eqn.outvars[0].aval.shape)
        known = self.known_of(eqn.invars[1])
        indices_aval = eqn.invars[1].aval
        columns = indices_aval.shape[-1] if indices_aval.ndim else 0
        if known is None:
            values = np.zeros(indices_aval.shape, np.int64)
            column_known = [False] * columns
        else:
            values = np.where(known[1], known[0], 0).astype(np.int64)
            column_known = [bool(known[1][..., k].all()) for k in range(columns)]
        for k, d in enumerate(dims.start_index_map):
            if not column_known[k]:  # data indices: the value may come from anywhere along d
                operand = np.broadcast_to(reduce(operand, (d,), additive=False, keepdims=True), operand.shape)
                values[..., k] = 0
        with jax.ensure_compile_time_eval():
            out = jax.lax.gather(jnp.asarray(operand), jnp.asarray(values, jnp.int32), dims, p["slice_sizes"],
                                 mode=p["mode"], fill_value=FREE, indices_are_sorted=False, unique_indices=False)
        out = np.asarray(out, CODE)
        index_codes = full[1]
        if np.any(index_codes != FREE):  # which element is read depends on an example: it reads that one too
            per = reduce(index_codes, (index_codes.ndim - 1,), additive=False) if columns else index_codes
            for d in sorted(dims.offset_dims):
                per = np.expand_dims(per, d)
            out = join_single(out, np.broadcast_to(per, shape))
        return out

    def _dynamic_slice(self, eqn: Any, full: list) -> np.ndarray:
        operand = full[0]
        starts = []
        for d, v in enumerate(eqn.invars[1:]):
            k = self.known_of(v)
            if k is None or not k[1].all():
                operand = np.broadcast_to(reduce(operand, (d,), additive=False, keepdims=True), operand.shape)
                starts.append(0)
            else:
                starts.append(int(k[0]))
        with jax.ensure_compile_time_eval():
            out = np.asarray(jax.lax.dynamic_slice(jnp.asarray(operand), starts, eqn.params["slice_sizes"]), CODE)
        index = whole(full[1:])
        return out if index == FREE else join_single(out, np.asarray(index, CODE))

    def _cond(self, eqn: Any, ins: list) -> list:
        index, operands = ins[0], ins[1:]
        out = None
        for branch in eqn.params["branches"]:
            got = [full_codes(c, v.aval.shape) for c, v in zip(self.run_inner(branch, operands)[0], eqn.outvars)]
            out = got if out is None else [join_either(a, b) for a, b in zip(out, got)]
        if index is not None and np.any(index != FREE):  # which branch runs depends on an example
            which = whole([index])
            out = [join_single(o, np.asarray(which, CODE)) for o in out]
        return out

    def _scan(self, eqn: Any, ins: list) -> list:
        p = eqn.params
        n_consts, n_carry = scan_counts(p)
        consts, carry, xs = ins[:n_consts], ins[n_consts:n_consts + n_carry], ins[n_consts + n_carry:]
        xs_vars = eqn.invars[n_consts + n_carry:]
        slices = [None if c is None else reduce(full_codes(c, v.aval.shape), (0,), additive=False)
                  for c, v in zip(xs, xs_vars)]
        carry_vars = eqn.invars[n_consts:n_consts + n_carry]
        state = [full_codes(c, v.aval.shape) for c, v in zip(carry, carry_vars)]
        for _ in range(16):  # the carry's codes to a fixed point (the lattice is shallow)
            outs = self.run_inner(p["jaxpr"], [*consts, *state, *slices])[0]
            new = [join_either(s, full_codes(o, s.shape)) for s, o in zip(state, outs[:n_carry])]
            if all(np.array_equal(a, b) for a, b in zip(new, state)):
                break
            state = new
        else:
            state = [np.full(s.shape, MIXED, CODE) for s in state]
        ys = [np.broadcast_to(full_codes(o, v.aval.shape[1:]), v.aval.shape)
              for o, v in zip(outs[n_carry:], eqn.outvars[n_carry:])]
        return [*state, *ys]

    def _while(self, eqn: Any, ins: list) -> list:
        p = eqn.params
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        cond_consts, body_consts, carry = ins[:nc], ins[nc:nc + nb], ins[nc + nb:]
        state = [full_codes(c, v.aval.shape) for c, v in zip(carry, eqn.invars[nc + nb:])]
        for _ in range(16):
            outs = self.run_inner(p["body_jaxpr"], [*body_consts, *state])[0]
            new = [join_either(s, full_codes(o, s.shape)) for s, o in zip(state, outs)]
            if all(np.array_equal(a, b) for a, b in zip(new, state)):
                break
            state = new
        else:
            state = [np.full(s.shape, MIXED, CODE) for s in state]
        pred = self.run_inner(p["cond_jaxpr"], [*cond_consts, *state])[0][0]
        if pred is not None and np.any(pred != FREE):  # how many steps run depends on an example
            which = np.asarray(whole([pred]), CODE)
            state = [join_single(s, which) for s in state]
        return state

    # values known at trace time (index arithmetic)

    def _carry_known(self, eqn: Any) -> None:
        name = eqn.primitive.name
        if name in CALLS or len(eqn.outvars) != 1:  # a call's: from its program, as it ran (`rule`)
            return
        out = eqn.outvars[0]
        dtype = out.aval.dtype
        if not (jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.bool_)) or \
                np.prod(out.aval.shape, dtype=np.int64) > KNOWN_LIMIT:
            return
        if self.code(out) is not None:
            return
        knowns = [self.known_of(v) for v in eqn.invars]
        if name == "iota" or (knowns and all(k is not None and k[1].all() for k in knowns)):
            try:
                with jax.ensure_compile_time_eval():
                    values = np.asarray(bind_equation(eqn, [jnp.asarray(k[0]) for k in knowns]))
            except Exception:  # anything that cannot run on plain arrays here: unknown
                return
            self.known[out] = values, np.ones(values.shape, bool)
            return
        if not knowns or all(k is None for k in knowns):
            return
        # partly known: elements move (or combine elementwise), and so does what is known of them
        filled = [np.zeros(v.aval.shape, v.aval.dtype) if k is None else np.where(k[1], k[0], 0).astype(k[0].dtype)
                  for k, v in zip(knowns, eqn.invars)]
        masks = [np.zeros(v.aval.shape, bool) if k is None else k[1] for k, v in zip(knowns, eqn.invars)]
        if name in ELEMENTWISE:
            mask = np.broadcast_to(np.logical_and.reduce([np.broadcast_to(m, out.aval.shape) for m in masks]),
                                   out.aval.shape)
        else:
            moved = move(name, eqn.params, masks, [tuple(out.aval.shape)], fill=False)
            if moved is None:
                return
            mask = moved[0]
        try:
            with jax.ensure_compile_time_eval():
                values = np.asarray(bind_equation(eqn, [jnp.asarray(f) for f in filled]))
        except Exception:
            return
        self.known[out] = values, np.asarray(mask, bool)


def _inexact(v: Any) -> bool:
    return jnp.issubdtype(v.aval.dtype, jnp.inexact)


def scan_counts(params: dict) -> tuple[int, int]:
    """A ``scan``'s numbers of constants and carried values (JAX ≥ 0.12 keeps them as the
    operands' groups, one marker per leaf)."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    groups = params["ft_in"]
    groups = groups.unpack() if hasattr(groups, "unpack") else groups
    return len(groups[0]), len(groups[1])
