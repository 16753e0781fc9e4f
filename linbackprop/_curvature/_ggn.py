"""The exact diagonal of the generalised Gauss–Newton matrix and its K-FAC factors: each
example's block of H factored, its columns back-substituted for all examples at once.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._engine import ParamFactors
from .._graph import Stack
from .._outer import weighted_square_sum
from .._settings import Engine
from ._per_example import Calls
from ._split import Split, normalise_argnums, on_model


def diag_ggn(fun: Callable, argnums: int | Sequence[int] = 0, *, engine: Engine = "auto", samples: int | None = None,
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
        return on_model(lambda f, a: diag_ggn(f, a, engine=engine, samples=samples, key=key), fun, argnums, layers)
    nums, single = normalise_argnums(argnums)

    def run(*args: Any) -> Any:
        calls, examples = _hessian_blocks(fun, args, nums, engine, "diag_ggn")
        parts, total = _squares(calls, examples)
        diag = total(_over_columns(parts, examples, samples, key, "diag_ggn"))
        return diag[0] if single else diag

    return run


def ggn_factor(fun: Callable, argnums: int | Sequence[int] = 0, *, rank: int | None = None, engine: Engine = "auto",
               layers: Any = None) -> Callable:
    """K with G = Kᵀ K from per-example Jacobian rows, shaped like the arguments ``argnums``
    names with a leading axis of r·B rows (r per example, B examples):

        G = Σ_b J_b* H_b J_b = Σ_b Σ_k (J_b* √λ_bk s_bk)(J_b* √λ_bk s_bk)ᵀ,   H_b = Σ_k λ_bk s_bk s_bkᵀ

    ``fun`` returns a scalar loss that is a sum (or mean) over examples, so that H is block
    diagonal (each example's C × C block factored by ``eigh``, as in [`diag_ggn`][linbackprop.diag_ggn]); row
    (k, b) is example b's gradient of the k-th column of its factor: one back substitution for
    all examples per k, then ℳ per example. ``rank=r`` keeps each example's r largest
    eigenvalues: exact where each example has at most r residuals — a least-squares loss
    ½ Σ_b ‖r_b‖² with one residual per example (a physics-informed network's ½ (Δu + f)² at each
    point) has rank 1, and its rows are then the residuals' Jacobian rows. H's negative part is
    dropped (exact for squared error and softmax cross-entropy).

    With R = r·B rows, (G + λI)⁻¹ g is a P × P solve from KᵀK or, where R < P, the R × R
    Woodbury solve (g − Kᵀ(λI + KKᵀ)⁻¹K g)/λ: [`scale_by_gauss_newton`][linbackprop.scale_by_gauss_newton] takes the
    rows as ``update(..., rows=K)`` (exact energy natural gradient, ENGD). About r + 1 gradients.
    Layers that mix examples raise a ``ValueError``.

    Examples:
        >>> import jax.numpy as jnp, linbackprop as lbp
        >>> net = lbp.Network([lbp.Layer("y", lambda th, x: x @ th[0], ("x",), ("W",))], ["x"], "y")
        >>> loss = lambda p, x: 0.5 * jnp.sum(net(p, x) ** 2)
        >>> K = lbp.ggn_factor(loss, rank=1)({"W": jnp.ones((2, 1))}, jnp.array([[1.0, 0.0], [0.0, 2.0]]))["W"]
        >>> K.shape, K[:, :, 0].tolist()                          # the examples' Jacobian rows: x_b
        ((2, 2, 1), [[1.0, 0.0], [0.0, 2.0]])
    """
    if layers is not None:
        return on_model(lambda f, a: ggn_factor(f, a, rank=rank, engine=engine), fun, argnums, layers)
    nums, single = normalise_argnums(argnums)
    if rank is not None and (not isinstance(rank, int) or rank < 1):
        raise ValueError(f"ggn_factor(rank={rank!r}): a positive int (the residuals per example), or None for all.")

    def run(*args: Any) -> Any:
        calls, examples = _hessian_blocks(fun, args, nums, engine, "ggn_factor")
        batches = examples.by_call(examples.batches)
        rows = []
        lams, vecses = examples.eigen()
        for g, (group, lam, vecs) in enumerate(zip(examples.groups, lams, vecses)):
            coords = lam.shape[1]
            keep = coords if rank is None else min(rank, coords)
            for k in range(coords - keep, coords):  # eigh's order is ascending: the largest last
                s = [vecs[:, :, k] * jnp.sqrt(jnp.maximum(lam[:, k], 0.0))[:, None] if h == g
                     else jnp.zeros(x.shape, x.dtype) for h, x in enumerate(lams)]
                adjoints = calls.adjoints(examples.unflatten(s), batches)
                rows.append(calls.per_example(adjoints, examples.batches[g], only=group))
        out = jax.tree.map(lambda *r: jnp.concatenate(r, axis=0), *rows)
        return out[0] if single else out

    return run


class Kronecker(NamedTuple):
    """K-FAC factors of one parameter leaf W: its block of G ≈ left ⊗ right, W read row-major as
    a [left.shape[-1], right.shape[-1]] matrix (a dense layer's W of shape [in, out] in u @ W:
    left the input side, [in, in], right the output side, [out, out]; a ``Row``-stacked block
    has one pair per row, stacked on a leading axis). With its bias in the block (a
    [`BiasOf`][linbackprop.BiasOf] at the bias) the input side has one more row and column:
    [W; b] is the matrix. For symmetric factors
    (left ⊗ right)⁻¹ vec(X) = vec(left⁻¹ X right⁻¹): K-FAC's preconditioned gradient.

    Examples:
        >>> import jax.numpy as jnp, linbackprop as lbp
        >>> f = lbp.Kronecker(left=jnp.diag(jnp.array([1.0, 2.0])), right=jnp.array([[4.0]]))
        >>> (jnp.linalg.solve(f.left, jnp.ones((2, 1))) @ jnp.linalg.inv(f.right)).ravel().tolist()
        [0.25, 0.125]
    """

    left: jax.Array
    right: jax.Array


@dataclasses.dataclass(frozen=True)
class BiasOf:
    """What [`kfac_factors`][linbackprop.kfac_factors] gives at a bias that shares its weight's
    Kronecker block: the weight's factors carry a column of ones for it (kfac-jax's and
    curvlinops' joint block). With W of shape [in, out] in ``x @ W + b``, the block is the
    [in + 1, out] matrix [W; b] (the bias's row last), read row-major: ``left`` has the ones
    column (``side="left"``: A = (1/N) Σ [x, 1]ᵀ[x, 1]), ``right`` is Γ. Where the weight is
    the product's left operand (``W @ x``, W [out, in]) the block is [W, b] and ``side`` is
    "right". No arrays: a static pytree node (``jax.tree.map`` passes over it).

    Attributes:
        weight: the weight leaf's path in the differentiated arguments
            (``jax.tree_util.keystr`` of it, as ``jax.tree_util.tree_flatten_with_path`` gives).
        side: which factor of the weight's pair has the bias's row and column, last.

    Examples:
        >>> import jax.numpy as jnp, linbackprop as lbp
        >>> dense = lambda th, x: jnp.tanh(x @ th[0] + th[1])
        >>> net = lbp.Network([lbp.Layer("y", dense, ("x",), ("W", "b"))], ["x"], "y")
        >>> loss = lambda p, x: 0.5 * jnp.sum(net(p, x) ** 2)
        >>> f = lbp.kfac_factors(loss)({"W": jnp.zeros((2, 1)), "b": jnp.zeros(1)}, jnp.array([[1.0, 2.0]]))
        >>> f["b"], f["W"].left.tolist()             # [x, 1]ᵀ[x, 1] for x = (1, 2)
        (BiasOf(weight="['W']", side='left'), [[1.0, 2.0, 1.0], [2.0, 4.0, 2.0], [1.0, 2.0, 1.0]])
    """

    weight: str
    side: Literal["left", "right"]


jax.tree_util.register_static(BiasOf)


def kfac_factors(fun: Callable, argnums: int | Sequence[int] = 0, *, engine: Engine = "auto",
                 samples: int | None = None, key: jax.Array | None = None, layers: Any = None,
                 approximation: Literal["expand", "reduce"] = "expand") -> Callable:
    """K-FAC factors of G = J* H J, shaped like the arguments ``argnums`` names: a
    [`Kronecker`][linbackprop.Kronecker] pair at each parameter leaf whose every use is a dense product (its
    per-example cotangent x_bᵀ δ_b, a ``dot_general`` of one example's operands, contracted
    positions of a sequence summed); a bias added after such a product (its cotangent Σ_t δ_t,
    x W + b) joins its weight's block, as in kfac-jax and curvlinops: the weight's λ-free factor
    is A = (1/N) Σ [x, 1]ᵀ[x, 1] (a column of zeros for uses without the bias) and the bias's
    entry is a [`BiasOf`][linbackprop.BiasOf] naming the weight. Every other leaf (norm scales
    and shifts, a gather, a bias shared by two products) gets its exact GGN diagonal, shaped
    like the leaf, from the same back substitutions (as [`diag_ggn`][linbackprop.diag_ggn] would
    give it: no second curvature pass).

        G_W ≈ A ⊗ Γ,   A = (1/N) Σ_b Σ_t x_btᵀ x_bt,   Γ = Σ_k Σ_b Σ_t λ_bk δ_btkᵀ δ_btk

    over the examples b, the layers and positions t that use W (N terms: K-FAC "expand", for
    shared weights, RNNs and tied embeddings alike) and the columns of each example's factored H
    (as [`diag_ggn`][linbackprop.diag_ggn]: λ_bk, s_bk from ``eigh``, δ_bk from one back substitution for all
    examples per k; with ``samples=M`` and a PRNG ``key``, M sampled columns instead). Exact for
    one example and one use. ``approximation="reduce"`` (Eschenhagen et al. 2023) sums each
    example's R uses first, x̄_b = Σ_t x_bt and δ̄_bk = Σ_t δ_btk:

        A = (1/(B R²)) Σ_b x̄_bᵀ x̄_b,   Γ = Σ_k Σ_b λ_bk δ̄_bkᵀ δ̄_bk

    — for a weight shared where the loss is one term per example (pooled sequences, a PINN's
    operator), as "expand" is for one term per use. ``fun`` returns a scalar loss that is a sum (or mean) over examples;
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
    if approximation not in ("expand", "reduce"):
        raise ValueError(f"kfac_factors(approximation={approximation!r}): use 'expand' (every use of a weight a "
                         "term) or 'reduce' (each example's uses summed first).")
    if layers is not None:
        return on_model(lambda f, a: kfac_factors(f, a, engine=engine, samples=samples, key=key,
                                                  approximation=approximation), fun, argnums, layers)
    nums, single = normalise_argnums(argnums)

    def run(*args: Any) -> Any:
        calls, examples = _hessian_blocks(fun, args, nums, engine, "kfac_factors")
        if any(None in place for place in calls.placement):
            raise NotImplementedError(
                "kfac_factors needs each differentiated argument leaf to be one parameter block of the network "
                "calls, as it is (here parameters are transformed before a network uses them); use diag_ggn or "
                "gauss_newton for such parameters.")
        batches = examples.by_call(examples.batches)
        maps = [ParamFactors(plan, prim, batches[call], reduce=approximation == "reduce")
                for plan, prim, call in zip(calls.plans, calls.stored, calls.solved)]
        paths, treedef = jax.tree_util.tree_flatten_with_path(calls.diff)
        keys = [jax.tree_util.keystr(path[1:] if single else path) for path, _ in paths]
        where = [functools.partial(_placed, plan, theta, place)
                 for plan, theta, place in zip(calls.plans, calls.thetas, calls.placement)]
        factored, joint = _agreed(maps, where, calls.placement)
        # the other leaves' GGN diagonal from the same back substitutions (no second curvature pass)
        squares = _squares(calls, examples) if len(factored) + len(joint) < len(paths) else None

        def share(s: list, weights: list) -> tuple:
            lams = calls.adjoints(examples.unflatten(s), batches)
            by_call = examples.by_call(weights)
            parts = [m.parts(lam_c, by_call[call]) for m, lam_c, call in zip(maps, lams, calls.solved)]
            return parts, None if squares is None else squares[0](s, weights, lams)

        summed, summed_squares = _over_columns(share, examples, samples, key, "kfac_factors")
        result: list[Any] = ([None] * len(paths) if squares is None
                             else list(jax.tree.leaves(squares[1](summed_squares))))
        terms: dict[int, list[Kronecker]] = {}
        for m, part, placed in zip(maps, summed, where):
            for g, pairs in m.total(part).items():
                for leaf, pair in enumerate(pairs):
                    if pair is None:
                        continue
                    for row, at in placed(g, leaf).items():
                        if at in factored:
                            term = Kronecker(*(pair if row is None else (f[row] for f in pair)))
                            terms.setdefault(at, []).append(term)
        for at, found in terms.items():  # a leaf several calls use: a pair per call (a term each)
            result[at] = found[0] if len(found) == 1 else tuple(found)
        for bias, (weight, side) in joint.items():
            result[bias] = BiasOf(keys[weight], side)
        out = tuple(jax.tree.unflatten(treedef, result))
        return out[0] if single else out

    return run


def _agreed(maps: list, where: list, placement: list) -> tuple[set[int], dict[int, tuple[int, str]]]:
    """Which argument leaves get Kronecker terms (those that every call using them factors), and
    which are biases joined to a weight's block (bias → (weight, side)): where every call that
    uses either joins them, on the same side; elsewhere the calls' joint columns are dropped."""
    users: dict[int, set[int]] = {}
    for c, place in enumerate(placement):
        for at in place:
            users.setdefault(at, set()).add(c)
    factored_by: dict[int, set[int]] = {}
    claims: dict[int, set] = {}
    for c, (m, placed) in enumerate(zip(maps, where)):
        for key in m.layouts:
            weights = placed(*key)
            for at in weights.values():
                factored_by.setdefault(at, set()).add(c)
            if key in m.joint:
                (bias_key, row_map), side = m.joint[key], "left" if m.layouts[key][0] else "right"
                biases = placed(*bias_key)
                for row, at in weights.items():
                    claims.setdefault(at, set()).add((biases[None if row is None else row_map[row]], side, c))
    factored = {at for at, by in factored_by.items() if by == users[at]}
    joint = {}
    for weight in factored:
        found = claims.get(weight, set())
        pairs = {(bias, side) for bias, side, _ in found}
        if len(pairs) == 1 and {c for *_, c in found} == users[weight]:
            (bias, side), = pairs
            if users[bias] == users[weight] and bias not in factored:
                joint[bias] = (weight, side)
    kept = {(weight, bias) for bias, (weight, _) in joint.items()}
    for m, placed in zip(maps, where):  # a call's joint column no other call agrees with
        for key in list(m.joint):
            (bias_key, row_map) = m.joint[key]
            weights, biases = placed(*key), placed(*bias_key)
            if any((at, biases[None if row is None else row_map[row]]) not in kept or at not in factored
                   for row, at in weights.items()):
                m.drop_joint(key)
    return factored, joint


def _squares(calls: Calls, examples: Examples) -> tuple[Callable, Callable]:
    """The GGN diagonal's share of one column of H's factor and its total:
    ``share(s, weights[, lams])`` (per group; ``lams`` the calls' adjoints of s, computed where
    not given) and ``total``. As matrix products where each argument leaf is a parameter block
    of the calls as it is and the calls that share one have different examples (`ParamSquares`:
    the calls' squares add up); else from the per-example gradients, squared, group by group."""
    batches = examples.by_call(examples.batches)
    groups_of: dict[int, list[int]] = {}
    for call, place in zip(calls.solved, calls.placement):
        for at in place:
            groups_of.setdefault(at, []).append(examples.of_call(call))
    separable = (all(None not in place for place in calls.placement)
                 and all(len(set(gs)) == len(gs) for gs in groups_of.values()))
    adjoints = lambda s, lams: calls.adjoints(examples.unflatten(s), batches) if lams is None else lams
    if separable:
        parts, total = calls.squares(batches)
        return (lambda s, weights, lams=None: parts(adjoints(s, lams), examples.by_call(weights))), total

    def share(s: list, weights: list, lams: list | None = None) -> Any:
        lams = adjoints(s, lams)
        out = None
        for group, batch, w in zip(examples.groups, examples.batches, weights):
            part = jax.tree.map(lambda g, w=w: weighted_square_sum(g, w), calls.per_example(lams, batch, only=group))
            out = part if out is None else jax.tree.map(jnp.add, out, part)
        return out

    return share, lambda acc: acc


def _placed(plan: Any, theta: Any, place: list[int], g: int, leaf: int) -> dict:
    """Row → index among the differentiated arguments' leaves, for a parameter group's leaf: a
    stacked block's factors are its own (rows stacked: row None); in a group of blocks row r is
    block r's."""
    position = {id(x): n for n, x in enumerate(jax.tree.leaves(theta))}
    group = plan.param_groups[g]
    diff = [n for n, d in enumerate(group.diff_leaves) if d]
    rows = [(None, group.names[0])] if group.stacked_rows is not None else list(enumerate(group.names))
    return {row: place[position[id(jax.tree.leaves(theta[name])[diff[leaf]])]] for row, name in rows}


class Examples(NamedTuple):
    """The examples of ``fun``'s network calls and each one's block of H, factored. Calls whose
    outputs all have the same batch size share their examples (row b of every call is example
    b: one group); calls of different batch sizes (a PINN's interior and boundary points) each
    have their own examples, the groups' in call order. Per group: its calls (positions among
    all calls), B_g, and each example's C_g × C_g block of H [B_g, C_g, C_g]; ``unflatten``
    maps one [B_g, C_g] matrix per group to cotangents of all the calls' outputs."""

    groups: list[list[int]]
    batches: list[int]
    blocks: list[jax.Array]
    unflatten: Callable

    def eigen(self) -> tuple[list[jax.Array], list[jax.Array]]:
        """Per group, H_b = Σ_k λ_bk s_bk s_bkᵀ: eigenvalues [B_g, C_g] and eigenvectors
        [B_g, C_g, C_g] (``eigh``: exact for indefinite H)."""
        pairs = [jnp.linalg.eigh(h) for h in self.blocks]
        return [lam for lam, _ in pairs], [vecs for _, vecs in pairs]

    def roots(self) -> list[jax.Array]:
        """Per group, R_b [B_g, C_g, C_g] with R_b R_bᵀ = H_b's positive part: Cholesky of
        H_b + δ_b I, the eigendecomposition only where a block that matters is indefinite — a
        batch of small Cholesky factorisations costs a fraction of as many ``eigh``. The shift
        δ_b = C ε · max_b' diag H_b' + C √ε · max diag H_b is round-off at the batch's scale and
        at the example's. A block below √ε of the batch's scale (an example whose softmax has
        saturated: H_b of 10⁻¹² computed with larger errors) is noise to a sampled estimate:
        where its Cholesky fails it takes the square root of its diagonal's positive part."""
        out = []
        for h in self.blocks:
            coords = h.shape[-1]
            eps = jnp.finfo(h.dtype).eps
            diagonal = jnp.diagonal(h, axis1=1, axis2=2)
            largest = jnp.max(diagonal, axis=1)
            shift = coords * eps * jnp.max(largest) + coords * jnp.sqrt(eps) * largest + jnp.finfo(h.dtype).tiny
            chol = jnp.linalg.cholesky(h + shift[:, None, None] * jnp.eye(coords, dtype=h.dtype))
            ok = jnp.all(jnp.isfinite(chol), axis=(1, 2))
            negligible = largest <= jnp.sqrt(eps) * jnp.max(largest)
            fallback = jax.vmap(jnp.diag)(jnp.sqrt(jnp.maximum(diagonal, 0.0)))

            def positive_part(h=h) -> jax.Array:
                lam, vecs = jnp.linalg.eigh(h)
                return vecs * jnp.sqrt(jnp.maximum(lam, 0.0))[:, None, :]

            cheap = lambda chol=chol, ok=ok, fallback=fallback: jnp.where(ok[:, None, None], chol, fallback)
            out.append(jax.lax.cond(jnp.all(ok | negligible), cheap, positive_part))
        return out

    def of_call(self, call: int) -> int:
        """The group of a call (its position among all calls)."""
        return next(g for g, members in enumerate(self.groups) if call in members)

    def by_call(self, per_group: list) -> list:
        """A per-group list as one entry per call (position among all calls)."""
        return [per_group[self.of_call(c)] for c in range(sum(len(g) for g in self.groups))]


def _hessian_blocks(fun: Callable, args: tuple, nums: tuple[int, ...], engine: str, name: str
                    ) -> tuple[Calls, Examples]:
    """The forward pass of ``fun``'s network calls with residuals (`Calls`) and their examples
    with H's blocks factored (`Examples`). H is taken block diagonal over the examples: ``fun``
    is a sum (or mean) of terms that each read one example of one call — what the transforms
    built on this assume."""
    split = Split(fun, args, nums, False)
    calls = Calls(split, engine)
    loss = lambda o: split.loss(o, *split.diff)[0]
    if jnp.ndim(loss(calls.outs)) != 0:
        raise ValueError(f"{name} needs fun to return a scalar loss (a sum or mean over examples).")
    sizes = [_batch_of(calls, name, only=c) for c in range(len(calls.nets))]
    if not sizes:
        raise ValueError(f"{name} needs at least one network call with an output.")
    groups = [list(range(len(sizes)))] if len(set(sizes)) == 1 else [[c] for c in range(len(sizes))]
    batches = [sizes[g[0]] for g in groups]
    flats = [_by_example(calls, b, name, only=g) for g, b in zip(groups, batches)]
    leaves, treedef = jax.tree.flatten(calls.outs)
    owner = [c for c, out in enumerate(calls.outs) for _ in jax.tree.leaves(out)]  # each leaf's call

    def unflatten(per_group: list) -> Any:
        out = [jnp.zeros(np.shape(x), jnp.result_type(x)) for x in leaves]
        for (_, back), group, flat in zip(flats, groups, per_group):
            part = jax.tree.leaves(back(flat))
            at = iter(part)
            for n, c in enumerate(owner):
                if c in group:
                    out[n] = next(at)
        return treedef.unflatten(out)

    _, hvp = jax.linearize(jax.grad(loss), calls.outs)
    blocks = []
    for g, (group, batch, (flat, _)) in enumerate(zip(groups, batches, flats)):
        coords = flat.shape[1]
        basis = jnp.broadcast_to(jnp.eye(coords, dtype=flat.dtype)[:, None, :], (coords, batch, coords))
        zeros = [jnp.zeros((b, f.shape[1]), f.dtype) for b, (f, _) in zip(batches, flats)]

        def column(e, g=g, group=group, batch=batch, zeros=zeros):
            return _by_example(calls, batch, name, hvp(unflatten([e if i == g else z for i, z in enumerate(zeros)])),
                               only=group)[0]

        h = jnp.moveaxis(jax.vmap(column)(basis), 0, 2)  # [C(j), B, C(i)] → [B, i, j]
        blocks.append((h + jnp.swapaxes(h, 1, 2)) / 2)
    return calls, Examples(groups, batches, blocks, unflatten)


def _over_columns(share: Callable, examples: Examples, samples: int | None, key: Any, name: str) -> Any:
    """Σ_k share(s_k, w_k) over H's factor, s_k and w_k one [B_g, C_g] matrix and one [B_g]
    vector per group of examples: the eigenvectors s_k with weights λ_k (exact; a group with
    fewer coordinates than k gives zeros), or with ``samples=M`` the mean over M samples s =
    H_b^{1/2} z, z ~ N(0, I), weights 1 (H's positive part: unbiased where H is positive
    semi-definite). One column (or sample) after another: a vmapped solve over the C columns has
    buffers C times as large, which outgrow the caches (slower: docs/performance.md)."""
    coords = max(h.shape[1] for h in examples.blocks)

    def summed(one: Callable, ks: jax.Array) -> Any:
        init = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(one, ks[0]))
        return jax.lax.scan(lambda acc, k: (jax.tree.map(jnp.add, acc, one(k)), None), init, ks)[0]

    def column(k: jax.Array) -> Any:
        s = [jnp.where(k < v.shape[2], v[:, :, jnp.minimum(k, v.shape[2] - 1)], 0) for v in vecs]
        w = [jnp.where(k < x.shape[1], x[:, jnp.minimum(k, x.shape[1] - 1)], 0) for x in lam]
        return share(s, w)

    if samples is None:
        lam, vecs = examples.eigen()
        return summed(column, jnp.arange(coords))
    if key is None:
        raise ValueError(f"{name}(samples=M) needs a PRNG key: {name}(fun, samples=M, key=jax.random.key(0)).")
    roots = examples.roots()  # H_b⁺ = root rootᵀ
    ones = [jnp.ones((r.shape[0],), r.dtype) for r in roots]

    def sample(k: jax.Array) -> Any:
        keys = jax.random.split(k, len(roots))
        return share([jnp.einsum("bij,bj->bi", r, jax.random.normal(kk, r.shape[:2], r.dtype))
                      for r, kk in zip(roots, keys)], ones)

    return jax.tree.map(lambda d: d / samples, summed(sample, jax.random.split(key, samples)))


def _batch_of(calls: Calls, name: str, only: int | None = None) -> int:
    """The batch: the leading axis of the first output state (axis 1 of a Stack) of the calls, or
    of call ``only``; ``name``: the transform asking (for its errors)."""
    for c, (net, outs) in enumerate(zip(calls.nets, calls.outs)):
        if only is not None and c != only:
            continue
        for item, value in zip(net.output_spec, (outs,) if net.single_output else outs):
            for leaf in jax.tree.leaves(value):
                return int(np.shape(leaf)[1 if isinstance(item, Stack) else 0])
    raise ValueError(f"{name} needs at least one network call with an output.")


def _by_example(calls: Calls, batch: int, name: str, outs: Any = None, only: list[int] | None = None
                ) -> tuple[jax.Array, Callable]:
    """The outputs of the calls ``only`` names (all by default) as [B, C] (each leaf's batch axis
    first: axis 0 of a state, axis 1 of a Stack), and the map back from such a matrix to those
    calls' output leaves (a flat list, in order)."""
    outs = calls.outs if outs is None else outs
    members = range(len(calls.nets)) if only is None else only
    leaves = [x for c in members for x in jax.tree.leaves(outs[c])]
    axes = _batch_axes(calls, batch, name, members)
    moved = [jnp.moveaxis(x, ax, 0).reshape(batch, -1) for x, ax in zip(leaves, axes)]
    sizes = np.cumsum([m.shape[1] for m in moved])[:-1]
    shapes = [jnp.moveaxis(x, ax, 0).shape for x, ax in zip(leaves, axes)]

    def unflatten(flat):
        parts = jnp.split(flat, sizes, axis=1)
        return [jnp.moveaxis(p.reshape(s), 0, ax) for p, s, ax in zip(parts, shapes, axes)]

    return jnp.concatenate(moved, axis=1), unflatten


def _batch_axes(calls: Calls, batch: int, name: str, members: Any = None) -> list[int]:
    axes = []
    for c, (net, outs) in enumerate(zip(calls.nets, calls.outs)):
        if members is not None and c not in members:
            continue
        items = (outs,) if net.single_output else outs
        for item, value in zip(net.output_spec, items):
            ax = 1 if isinstance(item, Stack) else 0
            for leaf in jax.tree.leaves(value):
                if np.ndim(leaf) <= ax or np.shape(leaf)[ax] != batch:
                    raise ValueError(f"{name}: an output of {net!r} has shape {np.shape(leaf)}, without the "
                                     f"batch ({batch}) on axis {ax}; every state's leading axis must be the batch.")
                axes.append(ax)
    return axes
