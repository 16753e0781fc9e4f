"""ℳΛ split by example, and what the curvature quantities sum over the examples without forming
it: the per-example parameter cotangents (`param_adjoint_per_example`), one member's
per-example VJP (`member_vjp`), the squares of the GGN diagonal (`ParamSquares`) and the
K-FAC factors (`ParamFactors`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._plan import Group, Kind, Plan, analyse_kind, rebuilt_vjp
from ._loop import layer_arguments, own_residuals
from ._outer_factors import OuterFactors
from ._outer_products import SquareSums, weighted_square_sum
from ._rows import Primal, read_rows, scatter_add


def _per_example_param_cts(plan: Plan, prim: Primal, kind: Kind, lam: list[Any], batch: int, examples: Any) -> tuple:
    """Per parameter slot of ``kind``: [members, examples, ...] cotangents (∂Φ_i/∂θ)* Λ_i[b], each
    the layer's VJP on example b alone."""
    n = kind.size
    lam_k = read_rows(lam[kind.out_group], kind.by_member.out[:n])
    theta, inputs = layer_arguments(plan, kind, prim, np.arange(n))
    out_group = plan.state_groups[kind.out_group]
    param_groups = [plan.param_groups[g] for g in kind.param_groups]
    leaves, tree = jax.tree.flatten(inputs)  # each [n, ...]: the members stacked
    rows = jax.tree.leaves(tuple(plan.state_groups[g].row_avals() for g in kind.read_groups))
    batched = [bool(a.ndim) and a.shape[0] == batch for a in rows]
    if examples is not None:  # the members' rows of those examples: axis 1 (axis 0: the members)
        leaves = [jnp.take(x, examples, axis=1) if b else x for x, b in zip(leaves, batched)]
        lam_k = jax.tree.map(lambda x: jnp.take(x, examples, axis=1), lam_k)

    example = _example_vjp(kind, out_group, param_groups, tree, batched)
    member = lambda theta, leaves, lam_i: jax.vmap(example, in_axes=(None, [0 if b else None for b in batched], 0))(
        theta, leaves, lam_i)
    return jax.vmap(member)(theta, leaves, lam_k)


def _example_vjp(kind: Kind, out_group: Group, param_groups: list[Group], tree: Any, batched: list[bool]) -> Callable:
    """(θ, one example's input leaves, its Λ row) ↦ the member's parameter cotangents per slot:
    the layer's VJP on that example alone (``batched`` inputs get their batch axis back)."""
    def example(theta, leaves_b, lam_b):
        one = tree.unflatten([x[None] if b else x for x, b in zip(leaves_b, batched)])
        _, vjp = jax.vjp(lambda th: kind.fn(th, *one), theta)
        cts = vjp(out_group.full_tangent(jax.tree.map(lambda x: x[None], lam_b)))[0]
        return tuple(g.tangent(ct) for g, ct in zip(param_groups, cts))

    return example


def param_adjoint_per_example(plan: Plan, prim: Primal, lam: list[Any], batch: int,
                              examples: Any = None) -> list[Any]:
    """ℳ Λ split by example: parameter-layout buffers with a leading axis of ``batch``, row b the
    sum over layers of (∂Φ_i/∂θ)* Λ_i restricted to example b.

    The leading axis of every state (and of the rows of stacked inputs) is the batch: a layer's
    output for example b depends only on its inputs' row b (callers check it), so its parameter
    cotangent splits into one term per example — the VJP of the layer on that example alone
    (inputs and Λ_i of one row) — vmapped over the examples and over the kind's members.
    ``examples``: the indices of the examples wanted (default: all ``batch``).
    """
    wanted = batch if examples is None else len(examples)
    out = [jax.tree.map(lambda z: jnp.zeros((wanted, *z.shape), z.dtype), g.zeros(plan.unrolled, tangent=True))
           for g in plan.param_groups]
    for kind in plan.kinds:
        if lam[kind.out_group] is None or not kind.param_groups:
            continue
        cts = _per_example_param_cts(plan, prim, kind, lam, batch, examples)
        for p, (g, ct) in enumerate(zip(kind.param_groups, cts)):  # ct: [members, examples, ...]
            idx = kind.by_member.params[:kind.size, p]
            out[g] = jax.vmap(lambda o, c, idx=idx: scatter_add(o, idx, c), in_axes=(0, 1))(out[g], ct)
    return out


def param_kinds(plan: Plan) -> list[Kind]:
    """The kinds with parameters whose output has a (co)tangent: those ℳ has blocks for."""
    return [k for k in plan.kinds if k.param_groups and plan.state_groups[k.out_group].differentiable]


def tangent_leaves(group: Group) -> int:
    """How many leaves a row of ``group`` has in the tangent layout."""
    return jax.tree.structure(group.row_avals(tangent=True)).num_leaves


def exclusive_groups(plan: Plan) -> set[int]:
    """The parameter groups each of whose rows one layer uses (no shared block among them): their
    rows' per-example quantities are the members' own, vmapped over the kind."""
    uses: dict[tuple[int, int], int] = {}
    for kind in plan.kinds:
        for p, g in enumerate(kind.param_groups):
            for row in kind.by_member.params[:kind.size, p]:
                uses[(g, int(row))] = uses.get((g, int(row)), 0) + 1
    return {g for g in range(len(plan.param_groups)) if all(n <= 1 for (gg, _), n in uses.items() if gg == g)}


def member_vjp(plan: Plan, prim: Primal, kind: Kind, batch: int) -> tuple:
    """One member's per-example VJP as a function of flat leaves (θ, one example's data, its Λ
    row) giving its parameter cotangent leaves; their example shapes; which of them are Λ (the
    adjoint: last); the kind's θ and data leaves (members stacked) with the vmap axes of the
    data over the examples; zeros shaped like one example's Λ leaves (for what ignores them).

    The data are the member's inputs and, where the forward pass stored the kind's residuals
    and the layer linearised on one example has the same residuals (`_example_residuals`), its
    stored residuals and output: the VJP is then rebuilt from them, as the back substitution's
    is, and what the curvature quantities read of it (a dense layer's δ = λ ⊙ tanh′, say) is not
    computed again from the layer's inputs. Elsewhere (remat, residuals that do not split by
    example) the layer is linearised again on each example."""
    theta, inputs = layer_arguments(plan, kind, prim, np.arange(kind.size))
    out_group = plan.state_groups[kind.out_group]
    param_groups = [plan.param_groups[g] for g in kind.param_groups]
    leaves, tree = jax.tree.flatten(inputs)
    rows = jax.tree.leaves(tuple(plan.state_groups[g].row_avals() for g in kind.read_groups))
    batched = [bool(r.ndim) and r.shape[0] == batch for r in rows]
    th_leaves, th_tree = jax.tree.flatten(theta)
    lam_tree = jax.tree.structure(out_group.row_avals(tangent=True))
    lam_avals = jax.tree.leaves(out_group.row_avals(tangent=True))
    nt, nx = len(th_leaves), len(leaves)
    stored = _example_residuals(plan, prim, kind, batch, theta, inputs, batched)
    if stored is None:
        example_vjp = _example_vjp(kind, out_group, param_groups, tree, batched)
        per_example = lambda *flat: jax.tree.leaves(example_vjp(
            th_tree.unflatten(flat[:nt]), list(flat[nt:nt + nx]), lam_tree.unflatten(flat[nt + nx:])))
        data, data_batched = leaves, batched
    else:
        linearisation, own, own_batched, outs = stored
        no, nout = len(own), len(outs)

        def per_example(*flat):
            one = lambda xs, bs: [x[None] if b else x for x, b in zip(xs, bs)]
            at = nt + nx
            vjp = rebuilt_vjp(*linearisation, tuple(one(flat[at:at + no], own_batched)), th_tree.unflatten(flat[:nt]),
                              tree.unflatten(one(flat[nt:at], batched)),
                              out_group.treedef.unflatten([x[None] for x in flat[at + no:at + no + nout]]))
            lam = lam_tree.unflatten(flat[at + no + nout:])
            cts = vjp(out_group.full_tangent(jax.tree.map(lambda x: x[None], lam)))[0]
            return jax.tree.leaves(tuple(g.tangent(ct) for g, ct in zip(param_groups, cts)))

        data, data_batched = [*leaves, *own, *outs], [*batched, *own_batched, *[True] * nout]
    one = lambda x, lead: jax.ShapeDtypeStruct(x.shape[lead:], x.dtype)
    example = [one(x, 1) for x in th_leaves] + [one(x, 2 if b else 1) for x, b in zip(data, data_batched)]
    example += [one(a, 1) for a in lam_avals]
    axes = [None] * nt + [0 if b else None for b in data_batched]
    varying = [False] * (nt + len(data)) + [True] * len(lam_avals)
    lam_zeros = [jnp.zeros(a.shape[1:], a.dtype) for a in lam_avals]
    return per_example, example, varying, th_leaves, data, axes, lam_zeros


def _example_residuals(plan: Plan, prim: Primal, kind: Kind, batch: int, theta: tuple, inputs: tuple,
                       batched: list[bool]) -> tuple | None:
    """Where the VJP of one member on one example can be rebuilt from the stored residuals: the
    layer linearised abstractly on one example (`analyse_kind`: its residuals' structure), the
    kind's stored residuals [members, ...] with whether each has the batch on its leading axis,
    and the members' outputs [members, B, ...]. None under remat, or where the linearisation on
    one example differs from the stored one (other equations, other residuals, a residual whose
    batch axis is not its first): those layers are linearised again per example."""
    if prim.residuals is None:
        return None
    members = np.arange(kind.size)
    theta_avals = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype, weak_type=x.weak_type), theta)
    leaves, tree = jax.tree.flatten(inputs)
    input_avals = tree.unflatten([jax.ShapeDtypeStruct((1, *x.shape[2:]) if b else x.shape[1:], x.dtype,
                                                       weak_type=x.weak_type) for x, b in zip(leaves, batched)])
    try:
        _, treedef, sources, own_avals, kept, recipes, probe = analyse_kind(kind.layers[0], theta_avals, input_avals)
    except Exception:  # the layer fails on one example: check_per_example says why
        return None
    same = (sources == kind.res_sources and kept == kind.kept and recipes.keys() == kind.recipes.keys()
            and [e.primitive for e in probe.jaxpr.eqns] == [e.primitive for e in kind.probe.jaxpr.eqns])
    if not same:
        return None
    own = own_residuals(prim, kind, members)
    own_batched = []
    for stored, alone in zip(own, own_avals):  # stored: [members, ...]
        shape = stored.shape[1:]
        if batch > 1 and tuple(alone.shape) == (1, *shape[1:]) and shape[:1] == (batch,):
            own_batched.append(True)
        elif tuple(alone.shape) == shape:  # the same for every example (a weight's transpose), or B = 1
            own_batched.append(batch == 1 and shape[:1] == (1,))
        else:
            return None
    outs = jax.tree.leaves(read_rows(prim.states[kind.out_group], kind.by_member.out[:kind.size]))
    return (treedef, sources, kept, recipes), tuple(own), own_batched, outs


class ParamSquares:
    """Σ_k Σ_b w_kb (ℳ Λ_k restricted to example b)², elementwise, in the parameter layout (no
    batch axis): what the GGN diagonal sums over its adjoints Λ_k. `parts` takes one (Λ_k,
    w_k); the caller adds the parts up over k and calls `total` once.

    Where a row of a block is used by one layer only, its per-example cotangents are squared and
    summed over the examples as they are formed (no [batch, parameters] buffer), and an outer
    product a_bᵀ δ_kb keeps Σ_k w_k δ_k² in its part: (a²)ᵀ(·) is one matrix product at the end
    (`SquareSums`). Rows used by several layers (shared blocks) first add the layers'
    contributions per example, then square, per k."""

    def __init__(self, plan: Plan, prim: Primal, batch: int):
        self.plan, self.prim, self.batch = plan, prim, batch
        self.exclusive = exclusive_groups(plan)
        self.kinds = param_kinds(plan)
        self.members = [self._members(kind) for kind in self.kinds]

    def _members(self, kind: Kind) -> tuple:
        """The kind's θ and input leaves (members stacked), their vmap axes, the
        `SquareSums` of one member's per-example VJP, and zeros for its Λ leaves."""
        per_example, example, varying, th_leaves, leaves, axes, lam_zeros = member_vjp(
            self.plan, self.prim, kind, self.batch)
        squared = [g in self.exclusive for g in kind.param_groups
                   for _ in range(tangent_leaves(self.plan.param_groups[g]))]
        return th_leaves, leaves, axes, SquareSums(per_example, example, squared, varying), lam_zeros

    def parts(self, lam: list[Any], weights: jax.Array) -> tuple[list, list]:
        """One adjoint's share: per kind, its members' `SquareSums.parts` of the leaves of
        unshared rows (None for shared ones); per shared group, its squares (complete)."""
        plan = self.plan
        shared = {g: jax.tree.map(lambda z: jnp.zeros((self.batch, *z.shape), z.dtype),
                                  plan.param_groups[g].zeros(plan.unrolled, tangent=True))
                  for g in range(len(plan.param_groups)) if g not in self.exclusive}
        kinds = []
        for kind, (th, xs, axes, sums, _) in zip(self.kinds, self.members):
            lam_k = jax.tree.leaves(read_rows(lam[kind.out_group], kind.by_member.out[:kind.size]))
            parts = jax.vmap(lambda th, xs, lm, sums=sums, axes=axes: sums.parts(
                [*th, *xs, *lm], [*axes, *[0] * len(lm)], weights))(th, xs, lam_k)
            kept, at = [], 0
            for p, g in enumerate(kind.param_groups):
                tree = jax.tree.structure(plan.param_groups[g].row_avals(tangent=True))
                leaves, at = parts[at:at + tree.num_leaves], at + tree.num_leaves
                if g in self.exclusive:
                    kept.extend(leaves)
                    continue
                kept.extend([None] * tree.num_leaves)  # [members, batch, ...]: summed over layers, then squared
                ct = tree.unflatten(leaves)
                idx = kind.by_member.params[:kind.size, p]
                shared[g] = jax.vmap(lambda o, c, idx=idx: scatter_add(o, idx, c), in_axes=(0, 1))(shared[g], ct)
            kinds.append(kept)
        squares = {g: jax.tree.map(lambda x: weighted_square_sum(x, weights), acc) for g, acc in shared.items()}
        return kinds, [squares.get(g) for g in range(len(plan.param_groups))]

    def total(self, parts: tuple[list, list]) -> list[Any]:
        """The parameter-layout squares from parts summed over the adjoints."""
        plan = self.plan
        kinds, squares = parts
        out = [g.zeros(plan.unrolled, tangent=True) if sq is None else sq
               for g, sq in zip(plan.param_groups, squares)]
        for kind, (th, xs, axes, sums, zeros), kept in zip(self.kinds, self.members, kinds):
            done = jax.vmap(lambda th, xs, part, sums=sums, axes=axes: sums.total(
                part, [*th, *xs, *zeros], [*axes, *[None] * len(zeros)]))(th, xs, kept)
            at = 0
            for p, g in enumerate(kind.param_groups):
                grp = plan.param_groups[g]
                tree = jax.tree.structure(grp.row_avals(tangent=True))
                if g in self.exclusive:
                    ct = tree.unflatten(done[at:at + tree.num_leaves])
                    out[g] = scatter_add(out[g], kind.by_member.params[:kind.size, p], ct)
                at += tree.num_leaves
        return out


class ParamFactors:
    """K-FAC factors in the parameter layout, from the adjoints Λ_k and weights w_k of the GGN's
    columns (`parts` for one, added up over k by the caller; `total` once).

    Per parameter group and leaf whose every use is a product x_bᵀ y_b of one example's operands
    (a dense layer; positions of a sequence summed), the rows' factors (A/N, Γ) stacked — A = Σ
    x_bᵀ x_b over the examples and every layer (and position) using the row, Γ = Σ_k Σ_b w_kb
    y_kbᵀ y_kb, N the number of (example, layer, position) terms — in the order of the leaf's axes
    (`OuterFactors`): the GGN block of a row ≈ left ⊗ right. None elsewhere. A row used by
    several layers sums their factors (K-FAC "expand" for shared weights). A weight whose bias
    is added after its product (`joint`: weight → bias) has one block with it: x̃ = [x, 1] in A
    (the bias's row last), as kfac-jax and curvlinops.

    With ``reduce`` (K-FAC "reduce", Eschenhagen et al. 2023), each example's operands are summed
    over every use of the row first — layers, positions and terms, R per example — and then
    squared: A = (1/(B R²)) Σ_b x̄_bᵀ x̄_b, Γ = Σ_k Σ_b w_kb ȳ_kbᵀ ȳ_kb."""

    def __init__(self, plan: Plan, prim: Primal, batch: int, reduce: bool = False):
        self.plan, self.prim, self.batch, self.reduce = plan, prim, batch, reduce
        self.kinds = param_kinds(plan)
        self.members = []
        layouts: dict[tuple[int, int], Any] = {}
        for kind in self.kinds:
            per_example, example, varying, th, xs, axes, zeros = member_vjp(plan, prim, kind, batch)
            factors = OuterFactors(per_example, example, varying)
            self.members.append((th, xs, axes, factors, zeros))
            for n, (_, g, leaf) in enumerate(self._leaves(kind)):
                found = factors.layout(n) if factors.factored(n) else None
                layouts[(g, leaf)] = found if layouts.get((g, leaf), found) == found else None
        self.layouts = {key: lay for key, lay in layouts.items() if lay is not None}
        self.joint = self._joint_biases()

    def _joint_biases(self) -> dict[tuple[int, int], tuple[tuple[int, int], dict[int, int]]]:
        """Weight (group, leaf) → its bias's (group, leaf) and the map from the weight's rows to
        the bias's, where every layer that uses either uses both, as weight and bias of one
        product (`OuterFactors.biases`), on rows that pair one to one (a stacked block with a
        stacked bias row by row): its factors then have the bias's column of ones. Elsewhere the
        column is dropped and the bias keeps its own curvature."""
        plan = self.plan
        rows_of: dict[tuple[int, int], dict[int, set]] = {}  # weight → its rows → the bias rows paired
        bias_of: dict[tuple[int, int], set] = {}
        paired_uses: dict[tuple[int, int], int] = {}  # (group, leaf) → members using it in a pairing
        uses: dict[tuple[int, int], int] = {}  # (group, leaf) → members using it
        for kind, (*_, factors, _) in zip(self.kinds, self.members):
            leaves = self._leaves(kind)
            for _, g, leaf in leaves:
                uses[(g, leaf)] = uses.get((g, leaf), 0) + kind.size
            for m, (n, _) in factors.biases.items():
                (slot_w, *weight), (slot_b, *bias) = leaves[m], leaves[n]
                weight, bias = tuple(weight), tuple(bias)
                bias_of.setdefault(weight, set()).add(bias)
                for key in (weight, bias):
                    paired_uses[key] = paired_uses.get(key, 0) + kind.size
                members = kind.by_member.params[:kind.size]
                for r_w, r_b in zip(members[:, slot_w], members[:, slot_b]):
                    rows_of.setdefault(weight, {}).setdefault(int(r_w), set()).add(int(r_b))
        joint = {}
        for weight, biases in bias_of.items():
            if len(biases) != 1 or weight not in self.layouts:
                continue
            (bias,) = biases
            gw, gb = plan.param_groups[weight[0]], plan.param_groups[bias[0]]
            row_map = rows_of[weight]
            one_to_one = (all(len(b) == 1 for b in row_map.values())
                          and len({next(iter(b)) for b in row_map.values()}) == len(row_map))
            real_rows = set(range(gw.rows)) - ({gw.rows - 1} if gw.pad else set())
            stacked_alike = (gw.stacked_rows is None) == (gb.stacked_rows is None)
            if (one_to_one and stacked_alike and set(row_map) == real_rows and uses[weight] == paired_uses[weight]
                    and uses[bias] == paired_uses[bias]
                    and (gw.stacked_rows is None or all(b == {r} for r, b in row_map.items()))):
                joint[weight] = (bias, {r: next(iter(b)) for r, b in row_map.items()})
        for kind, (*_, factors, _) in zip(self.kinds, self.members):
            leaves = self._leaves(kind)
            for m in list(factors.biases):
                if tuple(leaves[factors.biases[m][0]][1:]) != joint.get(tuple(leaves[m][1:]), (None,))[0]:
                    factors.drop_bias(m)
        return joint

    def drop_joint(self, weight: tuple[int, int]) -> None:
        """The weight (group, leaf)'s factors without its bias's column (another call using it
        does not join them)."""
        self.joint.pop(weight, None)
        for kind, (*_, factors, _) in zip(self.kinds, self.members):
            leaves = self._leaves(kind)
            for m in list(factors.biases):
                if tuple(leaves[m][1:]) == weight:
                    factors.drop_bias(m)

    def _leaves(self, kind: Kind) -> list[tuple[int, int, int]]:
        """(slot, group, leaf) of each cotangent leaf of a member of ``kind``, in order."""
        return [(p, g, leaf) for p, g in enumerate(kind.param_groups)
                for leaf in range(tangent_leaves(self.plan.param_groups[g]))]

    def _gathered(self, per_member: list) -> dict[tuple[int, int], jax.Array]:
        """Per factored (group, leaf): the members' Gram matrices (or, reducing, their examples'
        summed operands) added into their rows."""
        out: dict[tuple[int, int], jax.Array] = {}
        for kind, per_kind in zip(self.kinds, per_member):
            for n, (slot, g, leaf) in enumerate(self._leaves(kind)):
                if (g, leaf) not in self.layouts:
                    continue
                value = per_kind[n]
                buf = out.get((g, leaf), jnp.zeros((self.plan.param_groups[g].rows, *value.shape[1:]), value.dtype))
                out[(g, leaf)] = scatter_add(buf, kind.by_member.params[:kind.size, slot], value)
        return out

    def parts(self, lam: list[Any], weights: jax.Array) -> dict[tuple[int, int], jax.Array]:
        """One adjoint's Σ_b w_b y_bᵀ y_b per factored (group, leaf), rows stacked (reducing:
        Σ_b w_b ȳ_bᵀ ȳ_b of the rows' summed operands)."""
        per_member = []
        for kind, (th, xs, axes, factors, _) in zip(self.kinds, self.members):
            lam_k = jax.tree.leaves(read_rows(lam[kind.out_group], kind.by_member.out[:kind.size]))
            def one(th, xs, lm, f=factors, axes=axes):
                args, in_axes = [*th, *xs, *lm], [*axes, *[0] * len(lm)]
                return f.example_sums(args, in_axes, adjoint=True) if self.reduce else f.parts(args, in_axes, weights)

            per_member.append(jax.vmap(one)(th, xs, lam_k))
        gathered = self._gathered(per_member)
        if self.reduce:
            return {key: jnp.einsum("rbi,b,rbj->rij", s, weights.astype(s.dtype), s) for key, s in gathered.items()}
        return gathered

    def total(self, parts: dict[tuple[int, int], jax.Array]) -> dict[int, list]:
        """Per parameter group, per leaf: (left, right) with rows stacked, or None."""
        per_member, counts = [], {}
        for kind, (th, xs, axes, factors, zeros) in zip(self.kinds, self.members):
            def one(th, xs, f=factors, axes=axes, zeros=zeros):
                args, in_axes = [*th, *xs, *zeros], [*axes, *[None] * len(zeros)]
                return f.example_sums(args, in_axes, adjoint=False) if self.reduce else f.total(args, in_axes)

            per_member.append(jax.vmap(one)(th, xs))
            for n, (slot, g, leaf) in enumerate(self._leaves(kind)):
                if (g, leaf) in self.layouts:
                    rows = counts.setdefault((g, leaf), np.zeros(self.plan.param_groups[g].rows, np.int64))
                    np.add.at(rows, kind.by_member.params[:kind.size, slot], factors.count(n, self.batch))
        fixed = self._gathered(per_member)
        if self.reduce:  # (1/(B R²)) Σ_b x̄_bᵀ x̄_b with R = N/B uses per example: B/N² of the Gram
            fixed = {key: jnp.einsum("rbi,rbj->rij", s, s) for key, s in fixed.items()}
            counts = {key: n.astype(np.float64) ** 2 / self.batch for key, n in counts.items()}
        out: dict[int, list] = {}
        for g, group in enumerate(self.plan.param_groups):
            out[g] = []
            for leaf in range(tangent_leaves(group)):
                if (g, leaf) not in self.layouts:
                    out[g].append(None)
                    continue
                fixed_first = self.layouts[(g, leaf)][0]
                a = fixed[(g, leaf)] / np.maximum(counts[(g, leaf)], 1).reshape(-1, 1, 1).astype(np.float64)
                a = a.astype(fixed[(g, leaf)].dtype)
                out[g].append((a, parts[(g, leaf)]) if fixed_first else (parts[(g, leaf)], a))
        return out
