"""Per-example quantities: one forward pass and one back substitution serve every example (the
leading axis of every state is the batch), then ℳ is applied to each example's rows alone —
per-example gradients, their norms (ghost norms where the shapes allow), and the checks that
the inputs are data (the layers' and losses' checks: `_separation`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal

from .._engine import ParamSquares, back_substitution, depending, param_adjoint, param_adjoint_per_example
from .._graph import Network, Stack
from .._options import Engine, current
from .._plan import Plan, current_plan
from .._solve import output_tangents, outputs_of, prepare, solve_mode
from ._ghost import ParamNorms, ghost_squares, weighted_by_example
from ._separation import check_losses_keep_examples_apart, check_per_example
from ._split import Split, add_trees, normalise_argnums, on_model


# -- per-example quantities ---------------------------------------------------------------------
class Calls:
    """One forward pass of ``fun``'s network calls with residuals kept (their plans and stored
    linearisations), the map from the differentiated arguments to each call's parameter blocks,
    and the calls' outputs."""

    def __init__(self, split: Split, engine: str):
        self.plans: list[Plan] = []
        self.nets: list[Network] = []  # every call's network, in call order
        self.solved: list[int] = []  # the calls that use a parameter (have a plan), by position
        self.placement: list[list[int | None]] = []  # per solved call, per θ leaf: the argument leaf it is
        self.policy = current().policy  # the calls' (read where the model calls in)

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
                settings = current()  # where the model calls in (under solve_mode)
                current_plan(live, theta, tuple(inputs), settings.engine, settings.policy)  # anew where changed
                plan, prim = prepare(live, jax.lax.stop_gradient(theta), tuple(jax.lax.stop_gradient(inputs)),
                                     settings)
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
        # (call, first example, examples) per call where the calls' batches differ (examples in call order)
        self.spans: list[tuple[int, int, int]] | None = None
        _check_inputs_independent(split)
        for call, out in enumerate(self.outs):
            kinds = {str(jnp.result_type(x)) for x in jax.tree.leaves(out)
                     if not jnp.issubdtype(jnp.result_type(x), jnp.inexact)}
            if kinds:
                raise ValueError(
                    f"Network call {call} returns integer outputs ({', '.join(sorted(kinds))}) besides its states: "
                    "a layer that draws random numbers (nnx.Dropout in training mode, its RNG count advanced "
                    "by each call). Per-example gradients, their norms, clipping, the GGN diagonal, K-FAC "
                    "factors and ggn_factor take each example's curvature from one deterministic pass: "
                    "call model.eval() (or build the dropout with deterministic=True) for them; gauss_newton "
                    "and the gradients take dropout as it is.")

    def batches(self) -> list[int]:
        """Each call's batch: the leading axis of its first output leaf (axis 1 of a Stack)."""
        out = []
        for net, outs in zip(self.nets, self.outs):
            sizes = [int(np.shape(leaf)[1 if isinstance(item, Stack) else 0])
                     for item, value in zip(net.output_spec, (outs,) if net.single_output else outs)
                     for leaf in jax.tree.leaves(value)]
            out.append(sizes[0] if sizes else 0)
        return out

    def batch_axes(self) -> list[list[int]]:
        """Per call, each output leaf's batch axis (1 in a Stack, 0 elsewhere), in leaf order."""
        return [[1 if isinstance(item, Stack) else 0
                 for item, value in zip(net.output_spec, (outs,) if net.single_output else outs)
                 for _ in jax.tree.leaves(value)] for net, outs in zip(self.nets, self.outs)]

    def call_names(self) -> list[str]:
        return [f"call {c}: a Network of {len(net.layers)} layers reading {list(net.inputs)}, batch {b}"
                for c, (net, b) in enumerate(zip(self.nets, self.batches()))]

    def adjoints(self, g_outs: tuple, batch: int | Sequence[int]) -> list[list[Any]]:
        """Λ of each call: one back substitution ℒ*Λ = E* g for all examples at once; ``g_outs``:
        cotangents of the calls' outputs; ``batch``: the batch, or each call's (checks the
        per-example assumption on the way)."""
        lams = []
        for plan, call, prim in zip(self.plans, self.solved, self.stored):
            check_per_example(plan, batch if isinstance(batch, int) else batch[call])
            lams.append(back_substitution(plan, prim, self._rhs(plan, self.nets[call], g_outs[call])))
        return lams

    def per_example(self, lams: list, batch: int, examples: Any = None, only: Sequence[int] | None = None) -> tuple:
        """J* g split by example from the calls' adjoints Λ (`adjoints`): per differentiated
        argument, a pytree with a leading axis of the examples (all, or those indexed by
        ``examples``), from every call or those ``only`` names (positions among all calls: the
        calls whose examples these are; the others add nothing)."""
        n = batch if examples is None else len(examples)
        theta_cts = []
        for plan, prim, theta, lam, call in zip(self.plans, self.stored, self.thetas, lams, self.solved):
            if only is not None and call not in only:
                theta_cts.append(jax.tree.map(lambda x: jnp.zeros((n, *np.shape(x)), jnp.result_type(x)), theta))
                continue
            unpack = self._unpack(plan, theta)
            bufs = param_adjoint_per_example(plan, prim, lam, batch, examples)
            theta_cts.append(jax.vmap(lambda b, unpack=unpack: unpack(b)[0])(bufs) if jax.tree.leaves(bufs) else
                             jax.tree.map(lambda x: jnp.zeros((n, *np.shape(x)), jnp.result_type(x)), theta))
        if not jax.tree.leaves(theta_cts):  # no network uses a differentiated parameter
            return tuple(jax.tree.map(lambda x: jnp.zeros((n, *np.shape(x)), jnp.result_type(x)), d)
                         for d in self.diff)
        return jax.vmap(lambda cts: self.vjp(cts))(theta_cts)

    def squares(self, batch: int | Sequence[int]) -> tuple[Callable, Callable]:
        """Σ_k Σ_b w_kb (J_b* g_k)², elementwise, per differentiated argument, in two parts:
        ``parts(lams, weights)`` for one k (from the calls' adjoints Λ_k), added up over k by the
        caller, and ``total(parts)`` once (outer products' λ-free factors and matrix products are
        formed there, once: `ParamSquares`). Only where each argument leaf is one parameter
        block of one call, as it is (`placed`: squares then commute with the map from the
        arguments to the blocks; an argument leaf used by several calls of different examples adds
        their squares). ``batch``: the batch, or each call's; ``weights`` of ``parts``: w_k, or
        each call's."""
        per_call = lambda x: [x if isinstance(batch, int) else x[call] for call in self.solved]
        maps = [ParamSquares(plan, prim, b) for plan, prim, b in zip(self.plans, self.stored, per_call(batch))]

        def parts(lams: list, weights: jax.Array | Sequence[jax.Array]) -> list:
            ws = [weights] * len(maps) if isinstance(batch, int) else per_call(weights)
            return [m.parts(lam, w) for m, lam, w in zip(maps, lams, ws)]

        def total(parts: list) -> tuple:
            leaves, treedef = jax.tree.flatten(self.diff)
            result = [jnp.zeros(np.shape(x), jnp.result_type(x)) for x in leaves]
            for m, part, plan, theta, place in zip(maps, parts, self.plans, self.thetas, self.placement):
                for n, sq in zip(place, jax.tree.leaves(self._unpack(plan, theta)(m.total(part))[0])):
                    result[n] = result[n] + sq.astype(result[n].dtype)
            return tuple(jax.tree.unflatten(treedef, result))

        return parts, total

    def ghost(self, batch: int) -> list[ParamNorms] | None:
        """Per call, its `ParamNorms` (ghost norms and the weighted sum from each layer's
        per-example operands); None where an argument leaf is not one block of one call
        (`placed`: cross terms between calls or computed blocks)."""
        if not self.placed:
            return None
        return [ParamNorms(plan, prim, batch) for plan, prim in zip(self.plans, self.stored)]

    def weighted(self, lams: list, weights: jax.Array) -> tuple:
        """Σ_b w_b J_b* g_b per differentiated argument: ℳ of Λ with example b's rows scaled by
        w_b (`weighted_by_example`: the adjoints of Σ_b w_b ℓ_b)."""
        return self.arguments([param_adjoint(plan, prim, weighted_by_example(lam, weights))
                               for plan, prim, lam in zip(self.plans, self.stored, lams)])

    def arguments(self, buffers: list) -> tuple:
        """Per differentiated argument, its cotangent from each call's parameter-layout buffers."""
        theta_cts = [self._unpack(plan, theta)(bufs)[0] for plan, theta, bufs in zip(self.plans, self.thetas, buffers)]
        if not jax.tree.leaves(theta_cts):  # no network uses a differentiated parameter
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


def _check_inputs_independent(split: Split) -> None:
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
    if reaches_outputs(closed.jaxpr):
        raise NotImplementedError(
            "Per-example gradients, their norms and the GGN diagonal need the networks' inputs to be data: "
            "here an input of a Network call depends on the differentiated arguments (an input in argnums, or "
            "one network fed by another's output). Make it one Network (its layers may read any earlier "
            "state), or use jax.jacrev / jax.vmap(jax.grad) of the per-example loss.")


def reaches_outputs(jaxpr: Any) -> bool:
    """Whether any output of ``jaxpr`` depends on any of its inputs (every equation counted as
    depending on all its operands: conservative)."""
    live = depending(jaxpr, [True] * len(jaxpr.invars))
    return any(not isinstance(v, Literal) and v in live for v in jaxpr.outvars)


def per_example_setup(fun: Callable, args: tuple, nums: tuple[int, ...], engine: str) -> tuple:
    """For per-example losses ``fun``: the split, the calls' forward pass, the losses as a function
    of (outputs, *arguments), the batch size and the calls' adjoints Λ (one back substitution each)."""
    split = Split(fun, args, nums, False)
    calls = Calls(split, engine)
    losses = lambda outs, *d: per_example_losses(split, outs, d)
    batch = jnp.shape(losses(calls.outs, *split.diff))[0]
    g_outs = jax.grad(lambda o: jnp.sum(losses(o, *split.diff)))(calls.outs)
    sizes = calls.batches()
    if len(set(sizes)) <= 1:  # one batch: row b of every call is example b
        lams = calls.adjoints(g_outs, batch)  # checks the layers first
        check_losses_keep_examples_apart(losses, calls.outs, calls.batch_axes(), split.diff, [0] * len(sizes))
        return split, calls, losses, batch, lams
    if sum(sizes) != batch:
        raise ValueError(f"Per-example quantities of network calls with different batches take each call's "
                         f"examples as examples, in call order: fun must return {sum(sizes)} losses "
                         f"(jnp.concatenate of each call's), it returned {batch}; the calls: "
                         f"{'; '.join(calls.call_names())}.")
    starts = np.cumsum([0, *sizes])[:-1]
    calls.spans = [(c, int(start), size) for c, (start, size) in enumerate(zip(starts, sizes))]
    lams = calls.adjoints(g_outs, sizes)  # checks the layers first
    check_losses_keep_examples_apart(losses, calls.outs, calls.batch_axes(), split.diff,
                                     [int(start) for start in starts])
    return split, calls, losses, batch, lams


def per_example_losses(split: Split, outs: tuple, diff: tuple) -> jax.Array:
    losses = split.loss(outs, *diff)[0]
    if jnp.ndim(losses) != 1:
        raise ValueError(f"Per-example gradients need fun to return one loss per example, shape (B,); it returned "
                         f"shape {jnp.shape(losses)}.")
    return losses


def per_example_grads(fun: Callable, argnums: int | Sequence[int] = 0, *, engine: Engine = "auto",
                      layers: Any = None) -> Callable:
    """The gradient of each example's loss, stacked on a leading axis — ``jax.jacrev(fun)``.

    ``fun`` returns per-example losses, shape (B,), and the leading axis of every network state
    (and of every row read of a stacked input) is the batch. One forward pass and ONE back
    substitution ℒ*Λ = ∇_U Σ_b ℓ_b serve every example (row b of Λ is example b's adjoint, since
    ℓ_b sees only row b of the outputs); then ℳ is applied to each example's rows alone,
    (∂Φ_i/∂θ)* Λ_i[b] — the layer's VJP on one example — and shared and ``Row`` blocks sum the
    contributions of every layer that uses them. Terms of ``fun`` that use the arguments
    directly are added per example (``jax.jacrev`` of them). Network calls with different
    batches (a PINN's interior and boundary points) each bring their own examples: ``fun``
    returns the losses of all of them, each call's in call order (``jnp.concatenate``), and
    each loss reads one example of one call. Layers that mix examples (batch
    statistics, attention across the batch) raise a ``ValueError``; networks whose inputs depend
    on the differentiated arguments raise ``NotImplementedError``.

    Args:
        fun: the per-example losses, shape (B,), of the arguments.
        argnums: the argument(s) to differentiate.
        engine: ``"loop"``, ``"unrolled"`` or ``"auto"``.
        layers: the classes or ``@lbp.layer`` functions whose calls are the layers of a model
            written as it is; the gradients come back in the argument's own type.

    Returns:
        A function of ``fun``'s arguments returning, per differentiated argument, its per-example
            gradients: each leaf with a leading axis of B.

    Raises:
        ValueError: layers that mix examples, a state without the batch on its leading axis,
            or ``fun`` returning a number of losses other than the calls' examples.
        NotImplementedError: a network input that depends on the differentiated arguments.

    Examples:
        >>> import jax.numpy as jnp, linbackprop as lbp
        >>> layer = lbp.Layer("y", lambda th, x: x @ th[0], ("x",), ("w",))
        >>> net = lbp.Network([layer], ["x"], "y")
        >>> losses = lambda p, x: net(p, x)[:, 0] ** 2 / 2
        >>> x = jnp.array([[1.0, 0.0], [0.0, 2.0]])
        >>> g = lbp.per_example_grads(losses)({"w": jnp.ones((2, 1))}, x)
        >>> g["w"].squeeze(-1).tolist()    # example b: (x_b·w) x_b
        [[1.0, 0.0], [0.0, 4.0]]
    """
    if layers is not None:
        return on_model(lambda f, a: per_example_grads(f, a, engine=engine), fun, argnums, layers)
    nums, single = normalise_argnums(argnums)

    def run(*args: Any) -> Any:
        split, calls, losses, batch, lams = per_example_setup(fun, args, nums, engine)
        if calls.spans is None:
            through_networks = calls.per_example(lams, batch)
        else:  # each call's examples in turn
            through_networks = jax.tree.map(lambda *parts: jnp.concatenate(parts), *[
                calls.per_example(lams, size, only=[call]) for call, _, size in calls.spans])
        direct = jax.jacrev(lambda *d: losses(calls.outs, *d), argnums=tuple(range(len(nums))))(*split.diff)
        grads = tuple(add_trees(a, b) for a, b in zip(direct, through_networks))
        return grads[0] if single else grads

    return run


def per_example_grad_norms(fun: Callable, argnums: int | Sequence[int] = 0, *, engine: Engine = "auto",
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

    Args:
        fun: the per-example losses, shape (B,), of the arguments.
        argnums: the argument(s) whose gradients the norms are over (together).
        engine: ``"loop"``, ``"unrolled"`` or ``"auto"``.
        chunk: the examples per chunk where per-example gradients are formed.
        layers: the classes or ``@lbp.layer`` functions whose calls are the layers of a model
            written as it is.

    Returns:
        A function of ``fun``'s arguments returning the (B,) norms.

    Raises:
        ValueError: as [`per_example_grads`][linbackprop.per_example_grads].

    Examples:
        >>> import jax.numpy as jnp, linbackprop as lbp
        >>> layer = lbp.Layer("y", lambda th, x: x @ th[0], ("x",), ("w",))
        >>> net = lbp.Network([layer], ["x"], "y")
        >>> losses = lambda p, x: net(p, x)[:, 0] ** 2 / 2
        >>> x = jnp.array([[1.0, 0.0], [0.0, 2.0]])
        >>> lbp.per_example_grad_norms(losses)({"w": jnp.ones((2, 1))}, x).tolist()
        [1.0, 4.0]
    """
    if layers is not None:
        return on_model(lambda f, a: per_example_grad_norms(f, a, engine=engine, chunk=chunk), fun, argnums, layers,
                         to_arguments=False)
    nums, _ = normalise_argnums(argnums)

    def run(*args: Any) -> jax.Array:
        split, calls, losses, batch, lams = per_example_setup(fun, args, nums, engine)
        return jnp.sqrt(squared_grad_norms(split, calls, losses, batch, lams, chunk))

    return run


def squared_grad_norms(split: Split, calls: Calls, losses: Callable, batch: int, lams: list,
                       chunk: int = 16) -> jax.Array:
    """(B,) squared per-example gradient norms after the one back substitution: ghost norms
    (`ghost_norms`) where they apply; otherwise the per-example gradients formed ``chunk``
    examples at a time (``lax.map``), keeping only their norms."""
    ghost = ghost_norms(split, calls, losses, batch)
    if ghost is not None:
        return ghost_squares(ghost, lams, batch, calls.policy)
    size = min(chunk, batch)
    starts = np.arange(0, batch, size)
    argnums = tuple(range(len(split.diff)))

    def chunk_squares(start):
        examples = jnp.minimum(start + jnp.arange(size), batch - 1)
        if calls.spans is None:
            through = calls.per_example(lams, batch, examples)
        else:  # each example from its call: the others' rows masked out
            through = None
            for call, first, n in calls.spans:
                local = examples - first
                inside = (local >= 0) & (local < n)
                mask = lambda x, inside=inside: jnp.where(inside.reshape((-1,) + (1,) * (x.ndim - 1)), x, 0)
                part = jax.tree.map(mask, calls.per_example(lams, n, jnp.clip(local, 0, n - 1), only=[call]))
                through = part if through is None else add_trees(through, part)
        direct = jax.vmap(lambda b: jax.grad(lambda *d: losses(calls.outs, *d)[b], argnums=argnums)(*split.diff))(
            examples)
        total = add_trees(direct, through)
        return sum(jnp.sum(jnp.reshape(x, (size, -1)).astype(jnp.result_type(float)) ** 2, axis=1)
                   for x in jax.tree.leaves(total))

    return jax.lax.map(chunk_squares, jnp.asarray(starts)).reshape(-1)[:batch]


def ghost_norms(split: Split, calls: Calls, losses: Callable, batch: int) -> list[ParamNorms] | None:
    """The calls' `ParamNorms` where ``fun`` reaches the arguments only through its networks and
    each argument leaf is one block of one call (`Calls.ghost`); else None."""
    if calls.spans is not None or reaches_outputs(jax.make_jaxpr(lambda *d: losses(calls.outs, *d))(*split.diff).jaxpr):
        return None  # (calls of different batches: the per-example gradients, chunk by chunk)
    return calls.ghost(batch)
