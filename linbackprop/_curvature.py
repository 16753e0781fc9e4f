"""Curvature from the operators: Gauss–Newton products, per-example gradients and their norms,
the exact diagonal of the generalised Gauss–Newton matrix and its K-FAC factors.

In ``fun`` the Network calls are the model and the rest is the loss ℓ of their outputs (and of
the arguments directly). With J = E ℒ⁻¹ ℳ* (E picks the outputs) and H the Hessian of ℓ w.r.t.
the outputs,

    G = J* H J,     G v = ℳ ℒ⁻* E* H E ℒ⁻¹ ℳ* v

is one forward substitution, one product with H, one back substitution and ℳ, all on the
linearisation stored by one forward pass (no forward pass per product). Per-example quantities
use that the leading axis of every state is the batch: one back substitution serves every
example, and ℳ is applied to each example's rows alone.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal
from jax.flatten_util import ravel_pytree

from ._capture import rewrite
from ._engine import ParamFactors, ParamSquares, back_substitution, param_adjoint, param_adjoint_per_example
from ._ghost import ParamNorms, weighted_by_example
from ._graph import Network, Stack
from ._operators import LinearOperator
from ._outer import weighted_square_sum
from ._plan import Plan, current_plan, differentiable_dtype
from ._settings import current
from ._transforms import calls_intercepted, output_tangents, outputs_of, prepare, solve_mode


def normalise_argnums(argnums: int | Sequence[int]) -> tuple[tuple[int, ...], bool]:
    if isinstance(argnums, int):
        return (argnums,), True
    return tuple(argnums), False


class _Split:
    """``fun`` at ``args`` as model and loss: ``model(*diff)`` the tuple of its network calls'
    outputs (in call order), ``loss(outs, *diff)`` its value (and aux) with each call's output
    replaced by ``outs[k]``; ``diff`` the arguments named by ``argnums``."""

    def __init__(self, fun: Callable, args: tuple, argnums: tuple[int, ...], has_aux: bool):
        self.fun, self.args, self.argnums, self.has_aux = fun, args, argnums, has_aux
        self.diff = tuple(args[i] for i in argnums)

    def args_with(self, diff: tuple) -> list:
        full = list(self.args)
        for i, d in zip(self.argnums, diff):
            full[i] = d
        return full

    def run(self, handler: Callable, diff: tuple) -> Any:
        with calls_intercepted(handler):
            return self.fun(*self.args_with(diff))

    def model(self, *diff: Any) -> tuple:
        recorded = []

        def record(net, params, inputs):
            out = net(params, *inputs)
            recorded.append(out)
            return out

        self.run(record, diff)
        return tuple(recorded)

    def loss(self, outs: tuple, *diff: Any) -> tuple[Any, Any]:
        replay = iter(outs)
        result = self.run(lambda net, params, inputs: next(replay), diff)
        return result if self.has_aux else (result, None)


def add_trees(a: Any, b: Any) -> Any:
    return jax.tree.map(lambda x, y: x + y.astype(x.dtype), a, b)


# -- the Gauss–Newton operator ------------------------------------------------------------------
@jax.tree_util.register_pytree_node_class
class GaussNewton(LinearOperator):
    """G = J* H J on parameter-shaped pytrees (the arguments ``argnums`` names), from one stored
    linearisation: ``mv(v)`` is J v (a forward substitution and ℳ*), H (J v) (the loss's Hessian
    w.r.t. the outputs, linearised once) and J* (a back substitution and ℳ). Symmetric:
    ``G.T`` is ``G``. A pytree (its leaves are the stored residuals), so it can cross ``jax.jit``.
    Made by [`gauss_newton`][linbackprop.gauss_newton].

    Examples:
        >>> import jax.numpy as jnp, linbackprop as lbp
        >>> net = lbp.Network([lbp.Layer("y", lambda th, x: 2.0 * x @ th[0], ("x",), ("w",))], ["x"], "y")
        >>> _, _, G = lbp.gauss_newton(lambda p, x: 0.5 * jnp.sum(net(p, x) ** 2))({"w": jnp.ones(2)}, jnp.eye(2))
        >>> G.mv({"w": jnp.array([1.0, 0.0])})["w"].tolist(), G.T is G      # J*J = 4 I
        ([4.0, 0.0], True)
    """

    symbol = "G"

    def __init__(self, jvp: Callable, vjp: Callable, hvp: Callable, single: bool, example: Any):
        self._jvp, self._vjp, self._hvp = jvp, vjp, hvp
        self._single, self._example = single, example

    def tree_flatten(self) -> tuple[tuple, tuple]:
        return (self._jvp, self._vjp, self._hvp), (self._single, self._example)

    @classmethod
    def tree_unflatten(cls, aux: tuple, children: tuple) -> GaussNewton:
        return cls(*children, *aux)

    def mv(self, v: Any) -> Any:
        """G v."""
        return _gauss_newton_mv(self, v)

    def apply(self, v: Any) -> Any:
        vs = (v,) if self._single else tuple(v)
        out = self._vjp(self._hvp(self._jvp(*vs)))
        return out[0] if self._single else tuple(out)

    @property
    def T(self) -> GaussNewton:  # noqa: N802 - the mathematical name
        return self

    def todense(self) -> jax.Array:
        """The dense matrix over the arguments flattened in order (``ravel_pytree``); tiny networks."""
        treedef, leaves = self._example
        zeros = jax.tree.unflatten(treedef, [jnp.zeros(s, d) for s, d in leaves])
        flat, unravel = ravel_pytree(zeros)
        basis = jnp.eye(flat.size, dtype=flat.dtype)
        return jax.vmap(lambda e: ravel_pytree(self.mv(unravel(e)))[0])(basis).T  # G symmetric: rows = columns

    @property
    def pattern(self) -> np.ndarray:
        """G couples every pair of parameters that reach a common output: dense, one block."""
        return np.ones((1, 1), dtype=bool)

    def block(self, i: Any, j: Any) -> GaussNewton:
        if (i, j) != (0, 0):
            raise KeyError(f"G is one dense block (0, 0), not ({i!r}, {j!r}).")
        return self

    def __repr__(self) -> str:
        return "G = J* H J (Gauss–Newton)"


_gauss_newton_mv = jax.jit(lambda G, v: G.apply(v))


def gauss_newton(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False, *,
                 remat: bool = False, checkpoints: int | None = None, schedule: str = "even",
                 param_products: str = "auto", engine: str = "auto", layers: Any = None) -> Callable:
    """``(value, grad, G)`` of ``fun`` at its arguments: value and gradient as
    [`value_and_grad_by_solve`][linbackprop.value_and_grad_by_solve], and the generalised Gauss–Newton matrix

        G = J* H J,   J = ∂(network outputs)/∂θ = E ℒ⁻¹ ℳ*,   H = ∂²ℓ/∂(outputs)²

    as a [`GaussNewton`][linbackprop.GaussNewton] operator on pytrees shaped like the arguments ``argnums`` names.
    The Network calls in ``fun`` are the model; everything else in ``fun`` is the loss ℓ of their
    outputs. ``G.mv(v)`` runs one forward substitution, one product with H, one back substitution
    and ℳ on the linearisation stored by the one forward pass made here: no forward pass per
    product. It works under ``jax.jit``, so
    ``jax.scipy.sparse.linalg.cg(lambda v: G.mv(v) + lam * v, grad)`` inside a jitted step is a
    Gauss–Newton / Levenberg–Marquardt step.

    For squared error and for softmax cross-entropy on logits (any loss that is a negative
    log-likelihood of an exponential family in its natural parameters) G equals the Fisher
    information matrix. Terms of ``fun`` that use the arguments directly (a weight decay
    λ‖θ‖²) are in ``value`` and ``grad`` but not in G: H is the Hessian w.r.t. the outputs with
    the arguments held fixed; add their curvature yourself (2λ I for that weight decay).
    ``G.T`` is ``G``; ``G.todense()`` for tiny networks. ``remat``, ``checkpoints``, ``schedule``
    and ``engine`` as in [`grad_by_solve`][linbackprop.grad_by_solve] (checkpoints only where they save memory with the
    products counted: each product keeps a parameter-sized cotangent of the segments' scan), with
    the same rule for ``param_products="auto"``: ℳ* h and ℳΛ batched after the loops where steps
    are latency-bound, formed in the loops (from the same linearisation of each layer as the
    substitutions) where they are compute-bound or with remat.

    Examples:
        >>> import jax.numpy as jnp, linbackprop as lbp
        >>> net = lbp.Network([lbp.Layer("y", lambda th, x: x @ th[0], ("x",), ("W",))], ["x"], "y")
        >>> loss = lambda p, x: 0.5 * jnp.sum(net(p, x) ** 2)
        >>> value, grad, G = lbp.gauss_newton(loss)({"W": jnp.ones((2, 1))}, jnp.eye(2))
        >>> G.todense().tolist()          # J* J for the linear model: x*x = I
        [[1.0, 0.0], [0.0, 1.0]]
    """
    nums, single = normalise_argnums(argnums)
    settings = dict(remat=remat, checkpoints=checkpoints, schedule=schedule, param_products=param_products,
                    engine=engine)

    def run(*args: Any) -> tuple[Any, Any, GaussNewton]:
        if layers is None:
            split, found = _Split(fun, args, nums, has_aux), None
        else:  # the model as it is: its network found, G on the arguments' own types
            found = rewrite(fun, args, nums, layers)
            split = _Split(lambda *parts: found.fun(*parts)[0], found.args, tuple(range(len(nums))), has_aux)
        outs, jvp = jax.linearize(solve_mode(split.model, **settings, products=True), *split.diff)
        loss_args = tuple(range(1 + len(nums)))
        (value, aux), grads = jax.value_and_grad(split.loss, loss_args, has_aux=True)(outs, *split.diff)
        vjp = jax.linear_transpose(jvp, *split.diff)
        grad = tuple(add_trees(g, m) for g, m in zip(grads[1:], vjp(grads[0])))
        _, hvp = jax.linearize(jax.grad(lambda o: split.loss(o, *split.diff)[0]), outs)
        if found is not None:
            grad = found.gradient(grad, False)
            on = _OnArguments(found.arguments)
            jvp, vjp = jax.tree_util.Partial(on.jvp, jvp), jax.tree_util.Partial(on.vjp, vjp)
        leaves, treedef = jax.tree.flatten(grad[0] if single else grad)
        example = (treedef, tuple((tuple(np.shape(x)), jnp.result_type(x)) for x in leaves))
        G = GaussNewton(jvp, vjp, hvp, single, example)
        value = (value, aux) if has_aux else value
        return value, grad[0] if single else grad, G

    return run


class _OnArguments:
    """J and J* of a captured model on its arguments' own types (nnx.State, an equinox module, a
    pytree) instead of the flat leaves the network's blocks are."""

    def __init__(self, arguments: tuple):
        self.arguments = arguments

    def jvp(self, jvp: Callable, *vs: Any) -> Any:
        return jvp(*[list(a.leaves_of(v)) for a, v in zip(self.arguments, vs)])

    def vjp(self, vjp: Callable, cotangent: Any) -> tuple:
        return tuple(a.gradient(list(g)) for a, g in zip(self.arguments, vjp(cotangent)))


def _on_model(transform: Callable, fun: Callable, argnums: int | Sequence[int], layers: Any,
              to_arguments: bool = True) -> Callable:
    """``transform`` (a per-example or curvature transform taking ``(fun, argnums)``) of a model
    as it is: its network found with ``layers=`` (``_capture.rewrite``), the result given back in
    the arguments' own types (``to_arguments``: params-shaped results)."""
    nums, single = normalise_argnums(argnums)

    def run(*args: Any) -> Any:
        found = rewrite(fun, args, nums, layers)
        result = transform(lambda *parts: found.fun(*parts)[0], tuple(range(len(nums))))(*found.args)
        return found.gradient(result, single) if to_arguments else result

    return run


# -- per-example quantities ---------------------------------------------------------------------
class _Calls:
    """One forward pass of ``fun``'s network calls with residuals kept (their plans and stored
    linearisations), the map from the differentiated arguments to each call's parameter blocks,
    and the calls' outputs."""

    def __init__(self, split: _Split, engine: str):
        self.plans: list[Plan] = []
        self.nets: list[Network] = []  # every call's network, in call order
        self.solved: list[int] = []  # the calls that use a parameter (have a plan), by position
        self.placement: list[list[int | None]] = []  # per solved call, per θ leaf: the argument leaf it is

        def route(*diff):
            thetas, stored, outputs = [], [], []
            position = {id(leaf): n for n, leaf in enumerate(jax.tree.leaves(diff))}

            def forward(net, params, inputs):
                net.check_inputs(inputs)
                self.nets.append(net)
                live = net.live
                if live is None:  # outputs are inputs only: no parameter is used, J is zero there
                    out = net.pick_outputs(dict(zip(net.inputs, inputs)))
                    outputs.append(out)
                    return out
                theta = {p: net.select_params(params)[p] for p in live.param_names}
                current_plan(live, theta, tuple(inputs), current().engine)  # anew where a layer's computation changed
                plan, prim = prepare(live, jax.lax.stop_gradient(theta), tuple(jax.lax.stop_gradient(inputs)))
                outs = outputs_of(plan, prim.states)
                thetas.append(theta)
                self.placement.append([position.get(id(leaf)) for leaf in jax.tree.leaves(theta)])
                stored.append(prim)
                self.solved.append(len(self.nets) - 1)
                self.plans.append(plan)
                out = outs[0] if net.single_output else outs
                outputs.append(out)
                return out

            split.run(forward, diff)
            return thetas, (stored, outputs)

        self.diff = split.diff
        self.thetas, self.vjp, (self.stored, outs) = jax.vjp(solve_mode(route, engine=engine), *split.diff,
                                                             has_aux=True)
        self.outs = tuple(outs)  # every call's outputs, as the call returned them
        _check_inputs_independent(split)

    def adjoints(self, g_outs: tuple, batch: int) -> list[list[Any]]:
        """Λ of each call: one back substitution ℒ*Λ = E* g for all examples at once; ``g_outs``:
        cotangents of the calls' outputs (checks the per-example assumption on the way)."""
        lams = []
        for plan, call, prim in zip(self.plans, self.solved, self.stored):
            _check_per_example(plan, batch)
            lams.append(back_substitution(plan, prim, self._rhs(plan, self.nets[call], g_outs[call])))
        return lams

    def per_example(self, lams: list, batch: int, examples: Any = None) -> tuple:
        """J* g split by example from the calls' adjoints Λ (`adjoints`): per differentiated
        argument, a pytree with a leading axis of the examples (all, or those indexed by ``examples``)."""
        n = batch if examples is None else len(examples)
        theta_cts = []
        for plan, prim, theta, lam in zip(self.plans, self.stored, self.thetas, lams):
            unpack = self._unpack(plan, theta)
            bufs = param_adjoint_per_example(plan, prim, lam, batch, examples)
            theta_cts.append(jax.vmap(lambda b, unpack=unpack: unpack(b)[0])(bufs))
        if not theta_cts:  # no network uses a parameter
            return tuple(jax.tree.map(lambda x: jnp.zeros((n, *np.shape(x)), jnp.result_type(x)), d)
                         for d in self.diff)
        return jax.vmap(lambda cts: self.vjp(cts))(theta_cts)

    def squares(self, batch: int) -> tuple[Callable, Callable]:
        """Σ_k Σ_b w_kb (J_b* g_k)², elementwise, per differentiated argument, in two parts:
        ``parts(lams, weights)`` for one k (from the calls' adjoints Λ_k), added up over k by the
        caller, and ``total(parts)`` once (outer products' λ-free factors and matrix products are
        formed there, once: `ParamSquares`). Only where each argument leaf is one parameter
        block of one call, as it is (`placed`: squares then commute with the map from the
        arguments to the blocks)."""
        maps = [ParamSquares(plan, prim, batch) for plan, prim in zip(self.plans, self.stored)]

        def parts(lams: list, weights: jax.Array) -> list:
            return [m.parts(lam, weights) for m, lam in zip(maps, lams)]

        def total(parts: list) -> tuple:
            leaves, treedef = jax.tree.flatten(self.diff)
            result = [jnp.zeros(np.shape(x), jnp.result_type(x)) for x in leaves]
            for m, part, plan, theta, place in zip(maps, parts, self.plans, self.thetas, self.placement):
                for n, sq in zip(place, jax.tree.leaves(self._unpack(plan, theta)(m.total(part))[0])):
                    result[n] = result[n] + sq.astype(result[n].dtype)
            return tuple(jax.tree.unflatten(treedef, result))

        return parts, total

    def squared_norms(self, lams: list, batch: int) -> jax.Array | None:
        """(B,) squared norms of the per-example gradients through the calls (`ParamNorms`: ghost
        norms where cotangents are sums of outer products); None where an argument leaf is not one
        block of one call (`placed`: cross terms between calls or computed blocks)."""
        if not self.placed:
            return None
        total = jnp.zeros((batch,), jnp.result_type(float))
        for plan, prim, lam in zip(self.plans, self.stored, lams):
            total = total + ParamNorms(plan, prim, batch).squared(lam)
        return total

    def weighted(self, lams: list, weights: jax.Array) -> tuple:
        """Σ_b w_b J_b* g_b per differentiated argument: ℳ of Λ with example b's rows scaled by w_b
        (`weighted_by_example`: the adjoints of Σ_b w_b ℓ_b without a second back substitution)."""
        theta_cts = []
        for plan, prim, theta, lam in zip(self.plans, self.stored, self.thetas, lams):
            buffers = param_adjoint(plan, prim, weighted_by_example(lam, weights))
            theta_cts.append(self._unpack(plan, theta)(buffers)[0])
        if not theta_cts:  # no network uses a parameter
            return tuple(jax.tree.map(lambda x: jnp.zeros(np.shape(x), jnp.result_type(x)), d) for d in self.diff)
        return self.vjp(theta_cts)

    @property
    def placed(self) -> bool:
        """Whether each argument leaf is one parameter block of one call, as it is."""
        used = [n for call in self.placement for n in call]
        return None not in used and len(set(used)) == len(used)

    @staticmethod
    def _unpack(plan: Plan, theta: dict) -> Callable:
        """Parameter-layout buffers back to a call's blocks {name: block} (the transpose of packing)."""
        return jax.linear_transpose(lambda th: plan.pack_params(th, tangent=True), jax.eval_shape(lambda: theta))

    @staticmethod
    def _rhs(plan: Plan, net: Network, g: Any) -> list[Any]:
        """The back substitution's right-hand side E* g from cotangents of a call's outputs."""
        g = (g,) if net.single_output else tuple(g)
        z_example = jax.eval_shape(lambda: [grp.zeros(plan.unrolled, tangent=True) for grp in plan.state_groups])
        return jax.linear_transpose(lambda z: output_tangents(plan, z), z_example)(g)[0]


def _check_inputs_independent(split: _Split) -> None:
    """Per-example quantities treat the networks' inputs as data: raise where an input depends on
    the differentiated arguments (a network fed by another's output, an input in ``argnums``)."""
    def inputs_of(*diff):
        found = []

        def record(net, params, inputs):  # traced only: the plain call, so outputs depend on what they read
            found.append(inputs)
            return net.pick_outputs(net.states(params, *inputs))

        split.run(record, diff)
        return found

    closed = jax.make_jaxpr(inputs_of)(*split.diff)
    if _reaches_outputs(closed.jaxpr):
        raise NotImplementedError(
            "Per-example gradients, their norms and the GGN diagonal need the networks' inputs to be data: "
            "here an input of a Network call depends on the differentiated arguments (an input in argnums, or "
            "one network fed by another's output). Make it one Network (its layers may read any earlier "
            "state), or use jax.jacrev / jax.vmap(jax.grad) of the per-example loss.")


def _reaches_outputs(jaxpr: Any) -> bool:
    """Whether any output of ``jaxpr`` depends on any of its inputs (every equation counted as
    depending on all its operands: conservative)."""
    live = {v for v in jaxpr.invars}
    for eqn in jaxpr.eqns:
        if any(not isinstance(v, Literal) and v in live for v in eqn.invars):
            live.update(eqn.outvars)
    return any(not isinstance(v, Literal) and v in live for v in jaxpr.outvars)


_checked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _check_per_example(plan: Plan, batch: int) -> None:
    """Raise where a kind of layer mixes examples: its output for one example is not the output
    for that example alone (batch statistics, attention across the batch). Checked once per plan
    and batch size on random data, at trace time."""
    done = _checked.setdefault(plan, set())
    if batch in done:
        return
    rng = np.random.default_rng(0)

    def sample(aval):
        if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.prng_key):  # keys: a dropout mask must not mix either
            keys = jax.random.split(jax.random.key(0, impl=jax.random.key_impl(jax.random.key(0))), max(1, aval.size))
            return keys[: aval.size].reshape(aval.shape)
        if not differentiable_dtype(aval.dtype):
            return jnp.asarray(rng.integers(0, 2, aval.shape), aval.dtype)
        return jnp.asarray(rng.standard_normal(aval.shape), aval.dtype)

    with jax.ensure_compile_time_eval():
        for kind in plan.kinds:
            theta_avals = tuple(plan.param_groups[g].row_avals() for g in kind.param_groups)
            input_avals = tuple(plan.state_groups[g].row_avals() for g in kind.read_groups)
            theta = jax.tree.map(sample, theta_avals)
            leaves, tree = jax.tree.flatten(jax.tree.map(sample, input_avals))
            batched = [bool(np.ndim(x)) and np.shape(x)[0] == batch for x in leaves]
            outs = jax.tree.leaves(kind.out_aval)
            if not any(batched) or not all(len(o.shape) and o.shape[0] == batch for o in outs):
                names = [layer.name for layer in kind.layers][:4]
                raise ValueError(
                    f"Layer(s) {names!r}: per-example gradients, their norms and the GGN diagonal need the batch "
                    f"({batch} examples) on the leading axis of every state; these layers read "
                    f"{[tuple(np.shape(x)) for x in leaves]} and return {[tuple(o.shape) for o in outs]}. Put the "
                    "batch first, or use jax.jacrev / jax.vmap(jax.grad) of a per-example loss.")
            whole = kind.fn(theta, *tree.unflatten(leaves))

            def alone_fn(ls, kind=kind, theta=theta, tree=tree, batched=batched):
                one = tree.unflatten([x[None] if b else x for x, b in zip(ls, batched)])
                return jax.tree.map(lambda o: o[0], kind.fn(theta, *one))

            alone = jax.vmap(alone_fn, in_axes=([0 if b else None for b in batched],))(leaves)
            for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(alone)):
                a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
                if a64.shape != b64.shape or not np.allclose(a64, b64, rtol=1e-3, atol=1e-3 * (1 + np.abs(a64).max())):
                    names = [layer.name for layer in kind.layers][:4]
                    raise ValueError(
                        f"Layer(s) {names!r} mix examples: their output for one example is not what they give for "
                        "that example alone (batch statistics, attention or normalisation across the batch, or a "
                        "leading axis that is not the batch). Per-example gradients, their norms and the GGN "
                        "diagonal assume the leading axis of every state is the batch; compute those with "
                        "jax.jacrev or jax.vmap(jax.grad) of a per-example loss instead.")
    done.add(batch)


def per_example_setup(fun: Callable, args: tuple, nums: tuple[int, ...], engine: str) -> tuple:
    """For per-example losses ``fun``: the split, the calls' forward pass, the losses as a function
    of (outputs, *arguments), the batch size and the calls' adjoints Λ (one back substitution each)."""
    split = _Split(fun, args, nums, False)
    calls = _Calls(split, engine)
    losses = lambda outs, *d: _per_example_losses(split, outs, d)
    batch = jnp.shape(losses(calls.outs, *split.diff))[0]
    g_outs = jax.grad(lambda o: jnp.sum(losses(o, *split.diff)))(calls.outs)
    return split, calls, losses, batch, calls.adjoints(g_outs, batch)


def _per_example_losses(split: _Split, outs: tuple, diff: tuple) -> jax.Array:
    losses = split.loss(outs, *diff)[0]
    if jnp.ndim(losses) != 1:
        raise ValueError(f"Per-example gradients need fun to return one loss per example, shape (B,); it returned "
                         f"shape {jnp.shape(losses)}.")
    return losses


def per_example_grads(fun: Callable, argnums: int | Sequence[int] = 0, *, engine: str = "auto",
                      layers: Any = None) -> Callable:
    """The gradient of each example's loss, stacked on a leading axis — ``jax.jacrev(fun)``.

    ``fun`` returns per-example losses, shape (B,), and the leading axis of every network state
    (and of every row read of a stacked input) is the batch. One forward pass and ONE back
    substitution ℒ*Λ = ∇_U Σ_b ℓ_b serve every example (row b of Λ is example b's adjoint, since
    ℓ_b sees only row b of the outputs); then ℳ is applied to each example's rows alone,
    (∂Φ_i/∂θ)* Λ_i[b] — the layer's VJP on one example — and shared and ``Row`` blocks sum the
    contributions of every layer that uses them. Terms of ``fun`` that use the arguments
    directly are added per example (``jax.jacrev`` of them). Layers that mix examples (batch
    statistics, attention across the batch) raise a ``ValueError``; networks whose inputs depend
    on the differentiated arguments raise ``NotImplementedError``.

    Examples:
        >>> import jax.numpy as jnp, linbackprop as lbp
        >>> net = lbp.Network([lbp.Layer("y", lambda th, x: x @ th[0], ("x",), ("w",))], ["x"], "y")
        >>> losses = lambda p, x: net(p, x)[:, 0] ** 2 / 2
        >>> g = lbp.per_example_grads(losses)({"w": jnp.ones((2, 1))}, jnp.array([[1.0, 0.0], [0.0, 2.0]]))
        >>> g["w"].squeeze(-1).tolist()    # example b: (x_b·w) x_b
        [[1.0, 0.0], [0.0, 4.0]]
    """
    if layers is not None:
        return _on_model(lambda f, a: per_example_grads(f, a, engine=engine), fun, argnums, layers)
    nums, single = normalise_argnums(argnums)

    def run(*args: Any) -> Any:
        split, calls, losses, batch, lams = per_example_setup(fun, args, nums, engine)
        through_networks = calls.per_example(lams, batch)
        direct = jax.jacrev(lambda *d: losses(calls.outs, *d), argnums=tuple(range(len(nums))))(*split.diff)
        grads = tuple(add_trees(a, b) for a, b in zip(direct, through_networks))
        return grads[0] if single else grads

    return run


def per_example_grad_norms(fun: Callable, argnums: int | Sequence[int] = 0, *, engine: str = "auto",
                           chunk: int = 16, layers: Any = None) -> Callable:
    """The (B,) Euclidean norms of the per-example gradients (over every argument ``argnums``
    names), as ``jnp.linalg.norm`` of [`per_example_grads`][linbackprop.per_example_grads]
    flattened — without forming the per-example gradients. After the one back substitution, a
    block whose per-example cotangent is a sum of outer products Σ_t a_t δ_tᵀ (dense layers, a
    weight shared along a sequence or by several layers) gets its squared norm as the ghost norm
    Σ_{t,s} (a_t·a_s)(δ_t·δ_s) (or the product formed once per example, whichever the shapes make
    cheaper); other blocks' cotangents are formed per example and squared. Where ``fun`` uses the
    arguments outside its networks too, or an argument leaf is more than one block, the
    per-example gradients are formed ``chunk`` examples at a time (``lax.map``), keeping only
    their norms. For DP-SGD clipping: [`clipped_grad`][linbackprop.clipped_grad].

    Examples:
        >>> import jax.numpy as jnp, linbackprop as lbp
        >>> net = lbp.Network([lbp.Layer("y", lambda th, x: x @ th[0], ("x",), ("w",))], ["x"], "y")
        >>> losses = lambda p, x: net(p, x)[:, 0] ** 2 / 2
        >>> lbp.per_example_grad_norms(losses)({"w": jnp.ones((2, 1))}, jnp.array([[1.0, 0.0], [0.0, 2.0]])).tolist()
        [1.0, 4.0]
    """
    if layers is not None:
        return _on_model(lambda f, a: per_example_grad_norms(f, a, engine=engine, chunk=chunk), fun, argnums, layers,
                         to_arguments=False)
    nums, _ = normalise_argnums(argnums)

    def run(*args: Any) -> jax.Array:
        split, calls, losses, batch, lams = per_example_setup(fun, args, nums, engine)
        return jnp.sqrt(squared_grad_norms(split, calls, losses, batch, lams, chunk))

    return run


def squared_grad_norms(split: _Split, calls: _Calls, losses: Callable, batch: int, lams: list,
                       chunk: int = 16) -> jax.Array:
    """(B,) squared per-example gradient norms after the one back substitution: ghost norms
    (`_Calls.squared_norms`) where ``fun`` reaches the arguments only through its networks and each
    argument leaf is one block of one call; otherwise the per-example gradients formed ``chunk``
    examples at a time (``lax.map``), keeping only their norms."""
    direct_terms = _reaches_outputs(jax.make_jaxpr(lambda *d: losses(calls.outs, *d))(*split.diff).jaxpr)
    squares = None if direct_terms else calls.squared_norms(lams, batch)
    if squares is not None:
        return squares
    size = min(chunk, batch)
    starts = np.arange(0, batch, size)
    argnums = tuple(range(len(split.diff)))

    def chunk_squares(start):
        examples = jnp.minimum(start + jnp.arange(size), batch - 1)
        through = calls.per_example(lams, batch, examples)
        direct = jax.vmap(lambda b: jax.grad(lambda *d: losses(calls.outs, *d)[b], argnums=argnums)(*split.diff))(
            examples)
        total = add_trees(direct, through)
        return sum(jnp.sum(jnp.reshape(x, (size, -1)).astype(jnp.result_type(float)) ** 2, axis=1)
                   for x in jax.tree.leaves(total))

    return jax.lax.map(chunk_squares, jnp.asarray(starts)).reshape(-1)[:batch]


def diag_ggn(fun: Callable, argnums: int | Sequence[int] = 0, *, engine: str = "auto", samples: int | None = None,
             key: jax.Array | None = None, layers: Any = None) -> Callable:
    """The exact diagonal of G = J* H J, shaped like the arguments ``argnums`` names (or, with
    ``samples=M`` and a PRNG ``key``, a Monte Carlo estimate from M back substitutions instead of C).

    ``fun`` returns a scalar loss that is a sum (or mean) of per-example terms, so that H is block
    diagonal over the examples (the leading axis of every state is the batch). Each example's
    block H_b (C × C over its C output coordinates: C products with H, all examples at once) is
    factored H_b = Σ_k λ_bk s_bk s_bkᵀ (``eigh``: exact for indefinite H too), and

        diag G = Σ_b Σ_k λ_bk (J_b* s_bk)²

    where J_b* s is ℳ on example b's rows of Λ = ℒ⁻* E* s: one back substitution for all examples
    per k (C in all, one after another: measured faster than one vmapped solve), then ℳ per
    example. Where a layer's per-example parameter cotangent is an outer product (dense layers:
    W̄_bk = a_bᵀ δ_bk), Σ_k Σ_b λ_bk W̄_bk² is one matrix product (a²)ᵀ(Σ_k λ_k δ_k²) after the
    C substitutions (BackPACK forms one per k); other cotangents are formed per example and
    squared. About C/3 + 2 gradients for dense layers (C back substitutions and one forward pass).
    Layers that mix examples raise a ``ValueError``.

    The estimate draws z ~ N(0, I) per example and sample and back-substitutes s = H_b^{1/2} z
    (H_b's positive part: unbiased where H is positive semi-definite, as for squared error and
    softmax cross-entropy): diag G ≈ (1/M) Σ_m Σ_b (J_b* s_bm)². Cheaper than the exact
    diagonal when the outputs have many coordinates (a language model's vocabulary).

    Examples:
        >>> import jax.numpy as jnp, linbackprop as lbp
        >>> net = lbp.Network([lbp.Layer("y", lambda th, x: x @ th[0], ("x",), ("W",))], ["x"], "y")
        >>> loss = lambda p, x: 0.5 * jnp.sum(net(p, x) ** 2)
        >>> lbp.diag_ggn(loss)({"W": jnp.ones((2, 1))}, jnp.array([[1.0, 0.0], [0.0, 2.0]]))["W"].tolist()
        [[1.0], [4.0]]
    """
    if layers is not None:
        return _on_model(lambda f, a: diag_ggn(f, a, engine=engine, samples=samples, key=key), fun, argnums, layers)
    nums, single = normalise_argnums(argnums)

    def run(*args: Any) -> Any:
        calls, batch, unflatten, lam, vecs = _hessian_blocks(fun, args, nums, engine, "diag_ggn")
        if calls.placed:
            parts, total = calls.squares(batch)
            share = lambda s, weights: parts(calls.adjoints(unflatten(s), batch), weights)
        else:  # arguments mapped to the blocks: per-example gradients, squared
            total = lambda acc: acc
            share = lambda s, weights: jax.tree.map(lambda g: weighted_square_sum(g, weights),
                                                    calls.per_example(calls.adjoints(unflatten(s), batch), batch))

        diag = total(_over_columns(share, lam, vecs, samples, key, "diag_ggn"))
        return diag[0] if single else diag

    return run


class Kronecker(NamedTuple):
    """K-FAC factors of one parameter leaf W: its block of G ≈ left ⊗ right, W read row-major as
    a [left.shape[-1], right.shape[-1]] matrix (a dense layer's W of shape [in, out] in u @ W:
    left the input side, [in, in], right the output side, [out, out]; a ``Row``-stacked block
    has one pair per row, stacked on a leading axis). For symmetric factors
    (left ⊗ right)⁻¹ vec(X) = vec(left⁻¹ X right⁻¹): K-FAC's preconditioned gradient.

    Examples:
        >>> import jax.numpy as jnp, linbackprop as lbp
        >>> f = lbp.Kronecker(left=jnp.diag(jnp.array([1.0, 2.0])), right=jnp.array([[4.0]]))
        >>> (jnp.linalg.solve(f.left, jnp.ones((2, 1))) @ jnp.linalg.inv(f.right)).ravel().tolist()
        [0.25, 0.125]
    """

    left: jax.Array
    right: jax.Array


def kfac_factors(fun: Callable, argnums: int | Sequence[int] = 0, *, engine: str = "auto",
                 samples: int | None = None, key: jax.Array | None = None, layers: Any = None) -> Callable:
    """K-FAC factors of G = J* H J, shaped like the arguments ``argnums`` names: a
    [`Kronecker`][linbackprop.Kronecker] pair at each parameter leaf whose every use is a dense product (its
    per-example cotangent x_bᵀ δ_b, a ``dot_general`` of one example's operands, contracted
    positions of a sequence summed), None at other leaves (biases, norms: ``diag_ggn`` gives
    their diagonal).

        G_W ≈ A ⊗ Γ,   A = (1/N) Σ_b Σ_t x_btᵀ x_bt,   Γ = Σ_k Σ_b Σ_t λ_bk δ_btkᵀ δ_btk

    over the examples b, the layers and positions t that use W (N terms: K-FAC "expand", for
    shared weights, RNNs and tied embeddings alike) and the columns of each example's factored H
    (as [`diag_ggn`][linbackprop.diag_ggn]: λ_bk, s_bk from ``eigh``, δ_bk from one back substitution for all
    examples per k; with ``samples=M`` and a PRNG ``key``, M sampled columns instead). Exact for
    one example and one use. ``fun`` returns a scalar loss that is a sum (or mean) over examples;
    each argument leaf must be one parameter block as it is (not transformed before the network
    uses it). Layers that mix examples raise a ``ValueError``.

    Examples:
        >>> import jax.numpy as jnp, linbackprop as lbp
        >>> net = lbp.Network([lbp.Layer("y", lambda th, x: x @ th[0], ("x",), ("W",))], ["x"], "y")
        >>> loss = lambda p, x: 0.5 * jnp.sum(net(p, x) ** 2)
        >>> f = lbp.kfac_factors(loss)({"W": jnp.ones((2, 1))}, jnp.array([[1.0, 2.0]]))["W"]
        >>> f.left.tolist(), f.right.tolist()                   # one example: exact, x xᵀ ⊗ 1
        ([[1.0, 2.0], [2.0, 4.0]], [[1.0]])
    """
    if layers is not None:
        return _on_model(lambda f, a: kfac_factors(f, a, engine=engine, samples=samples, key=key), fun, argnums,
                         layers)
    nums, single = normalise_argnums(argnums)

    def run(*args: Any) -> Any:
        calls, batch, unflatten, lam, vecs = _hessian_blocks(fun, args, nums, engine, "kfac_factors")
        if not calls.placed:
            raise NotImplementedError(
                "kfac_factors needs each differentiated argument leaf to be one parameter block of one network "
                "call, as it is (here parameters are transformed or shared between calls before the network "
                "uses them); use diag_ggn or gauss_newton for such parameters.")
        maps = [ParamFactors(plan, prim, batch) for plan, prim in zip(calls.plans, calls.stored)]
        share = lambda s, weights: [m.parts(lam_c, weights)
                                    for m, lam_c in zip(maps, calls.adjoints(unflatten(s), batch))]
        summed = _over_columns(share, lam, vecs, samples, key, "kfac_factors")
        leaves, treedef = jax.tree.flatten(calls.diff)
        result: list[Any] = [None] * len(leaves)
        for m, part, plan, theta, place in zip(maps, summed, calls.plans, calls.thetas, calls.placement):
            position = {id(leaf): n for n, leaf in enumerate(jax.tree.leaves(theta))}
            for g, pairs in m.total(part).items():
                group = plan.param_groups[g]
                diff = [n for n, d in enumerate(group.diff_leaves) if d]
                # a stacked block's factors are its own (rows stacked); a group of blocks: row r is block r's
                rows = [(None, group.names[0])] if group.stacked_rows is not None else list(enumerate(group.names))
                for leaf, pair in enumerate(pairs):
                    if pair is None:
                        continue
                    for row, name in rows:
                        at = place[position[id(jax.tree.leaves(theta[name])[diff[leaf]])]]
                        result[at] = Kronecker(*(pair if row is None else (f[row] for f in pair)))
        out = tuple(jax.tree.unflatten(treedef, result))
        return out[0] if single else out

    return run


def _hessian_blocks(fun: Callable, args: tuple, nums: tuple[int, ...], engine: str, name: str) -> tuple:
    """The forward pass of ``fun``'s network calls with residuals (`_Calls`), the batch, the
    map from [B, C] matrices to the calls' outputs, and each example's C × C block of H
    factored: eigenvalues [B, C] and eigenvectors [B, C, C] (``eigh``: exact for indefinite H)."""
    split = _Split(fun, args, nums, False)
    calls = _Calls(split, engine)
    loss = lambda o: split.loss(o, *split.diff)[0]
    if jnp.ndim(loss(calls.outs)) != 0:
        raise ValueError(f"{name} needs fun to return a scalar loss (a sum or mean over examples).")
    batch = _batch_of(calls)
    flat_outs, unflatten = _by_example(calls, batch)
    _, hvp = jax.linearize(jax.grad(loss), calls.outs)
    coords = flat_outs.shape[1]
    basis = jnp.broadcast_to(jnp.eye(coords, dtype=flat_outs.dtype)[:, None, :], (coords, batch, coords))
    columns = jax.vmap(lambda e: _by_example(calls, batch, hvp(unflatten(e)))[0])(basis)  # [C(j), B, C(i)]
    h = jnp.moveaxis(columns, 0, 2)  # [B, i, j]
    lam, vecs = jnp.linalg.eigh((h + jnp.swapaxes(h, 1, 2)) / 2)
    return calls, batch, unflatten, lam, vecs


def _over_columns(share: Callable, lam: jax.Array, vecs: jax.Array, samples: int | None, key: Any,
                  name: str) -> Any:
    """Σ_k share(s_k, w_k) over H's factor: the eigenvectors s_k with weights λ_k (exact), or with
    ``samples=M`` the mean over M samples s = H_b^{1/2} z, z ~ N(0, I), weights 1 (H's positive
    part: unbiased where H is positive semi-definite). One column (or sample) after another: as
    one vmapped solve over the C columns the GGN diagonal took 1.4× longer (12 residual layers,
    width 128, batch 256, C = 10: the batched substitution's buffers outgrow the caches)."""
    batch, coords = lam.shape

    def summed(one: Callable, ks: jax.Array) -> Any:
        init = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(one, ks[0]))
        return jax.lax.scan(lambda acc, k: (jax.tree.map(jnp.add, acc, one(k)), None), init, ks)[0]

    if samples is None:
        return summed(lambda k: share(vecs[:, :, k], lam[:, k]), jnp.arange(coords))
    if key is None:
        raise ValueError(f"{name}(samples=M) needs a PRNG key: {name}(fun, samples=M, key=jax.random.key(0)).")
    root = vecs * jnp.sqrt(jnp.maximum(lam, 0.0))[:, None, :]  # H_b⁺ = root rootᵀ
    ones = jnp.ones((batch,), lam.dtype)
    sample = lambda k: jnp.einsum("bij,bj->bi", root, jax.random.normal(k, (batch, coords), lam.dtype))
    return jax.tree.map(lambda d: d / samples, summed(lambda k: share(sample(k), ones), jax.random.split(key, samples)))


def _batch_of(calls: _Calls) -> int:
    """The batch: the leading axis of the first output state (axis 1 of a Stack)."""
    for net, outs in zip(calls.nets, calls.outs):
        for item, value in zip(net.output_spec, (outs,) if net.single_output else outs):
            for leaf in jax.tree.leaves(value):
                return int(np.shape(leaf)[1 if isinstance(item, Stack) else 0])
    raise ValueError("diag_ggn needs at least one network call with an output.")


def _by_example(calls: _Calls, batch: int, outs: Any = None) -> tuple[jax.Array, Callable]:
    """The calls' outputs as [B, C] (each leaf's batch axis first: axis 0 of a state, axis 1 of a
    Stack), and the map back from such a matrix to outputs."""
    outs = calls.outs if outs is None else outs
    leaves, treedef = jax.tree.flatten(outs)
    axes = _batch_axes(calls, batch)
    moved = [jnp.moveaxis(x, ax, 0).reshape(batch, -1) for x, ax in zip(leaves, axes)]
    sizes = np.cumsum([m.shape[1] for m in moved])[:-1]
    shapes = [jnp.moveaxis(x, ax, 0).shape for x, ax in zip(leaves, axes)]

    def unflatten(flat):
        parts = jnp.split(flat, sizes, axis=1)
        return treedef.unflatten([jnp.moveaxis(p.reshape(s), 0, ax) for p, s, ax in zip(parts, shapes, axes)])

    return jnp.concatenate(moved, axis=1), unflatten


def _batch_axes(calls: _Calls, batch: int) -> list[int]:
    axes = []
    for net, outs in zip(calls.nets, calls.outs):
        items = (outs,) if net.single_output else outs
        for item, value in zip(net.output_spec, items):
            ax = 1 if isinstance(item, Stack) else 0
            for leaf in jax.tree.leaves(value):
                if np.ndim(leaf) <= ax or np.shape(leaf)[ax] != batch:
                    raise ValueError(f"diag_ggn: an output of {net!r} has shape {np.shape(leaf)}, without the "
                                     f"batch ({batch}) on axis {ax}; every state's leading axis must be the batch.")
                axes.append(ax)
    return axes
