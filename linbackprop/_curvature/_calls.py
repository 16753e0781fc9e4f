"""The network calls of a split function: one forward pass of each with residuals kept, the map
from the differentiated arguments to each call's blocks, one back substitution per call for every
example at once (`Calls.adjoints`), and ℳ applied to each example's rows (`Calls.per_example`).
The networks' inputs are checked to be data (`reaches_outputs`).
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
from .._options import current
from .._plan import Plan, current_plan
from .._solve import output_tangents, outputs_of, prepare, solve_mode, stored_tangents
from ._ghost import ParamNorms, weighted_by_example
from ._separation import check_per_example
from ._split import Split


class Calls:
    """One forward pass of ``fun``'s network calls with residuals kept (their plans and stored
    linearisations), the map from the differentiated arguments to each call's parameter blocks,
    and the calls' outputs."""

    def __init__(self, split: Split, engine: str):
        self.plans: list[Plan] = []
        self.nets: list[Network] = []  # every call's network, in call order
        self.solved: list[int] = []  # the calls that use a parameter (have a plan), by position
        self.placement: list[list[int | None]] = []  # per solved call, per θ leaf: the argument leaf it is
        self.settings: list = []  # per solved call, the settings it was made with (its solve variant's)
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
                self.settings.append(settings)
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
                    "call model.eval() (or build the dropout with deterministic=True) for them (and for "
                    "gauss_newton(factors=True / diagonal=True), built on the same pass); gauss_newton without "
                    "them and the gradients take dropout as it is.")

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
            lams.append(back_substitution(plan, prim, self._rhs(plan, self.nets[call], g_outs[call]),
                                              grads=None, compact=False, every_row=False))
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

    def output_tangents(self, *tangents: Any) -> tuple:
        """J v: the calls' output tangents (as `outs`) for tangents of the differentiated
        arguments — the linear map to each call's blocks (the transpose of `vjp`), then each
        call's ℒ Z = ℳ* h on its stored forward pass as the call's linear solve (`stored_tangents`:
        the solve variant a Network call's JVP takes, whose transpose is its back substitution)."""
        thetas = jax.linear_transpose(self.vjp, self.thetas)(tuple(tangents))[0]
        out = [jax.tree.map(jnp.zeros_like, o) for o in self.outs]
        for plan, prim, settings, theta, call in zip(self.plans, self.stored, self.settings, thetas, self.solved):
            found = stored_tangents(plan, prim, settings, theta)
            out[call] = found[0] if self.nets[call].single_output else found
        return tuple(out)

    def transpose(self, cotangents: tuple) -> tuple:
        """J* c per differentiated argument, for cotangents ``c`` of the calls' outputs:
        `output_tangents`' transpose (each call's back substitution and ℳ)."""
        return jax.linear_transpose(self.output_tangents, *self.diff)(tuple(cotangents))

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


