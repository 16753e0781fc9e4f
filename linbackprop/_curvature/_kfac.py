"""K-FAC's factors of the generalised Gauss–Newton matrix: a Kronecker pair per dense weight (its
bias in its block), per call of the loss that uses it, and the other leaves' GGN diagonal, from
the same back substitutions as the diagonal's.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import jax

from .._engine import ParamFactors
from .._options import Engine
from ._calls import Calls
from ._examples import Examples, ggn_squares, hessian_blocks, over_columns
from ._split import Split, normalise_argnums, on_model


class Kronecker(NamedTuple):
    """K-FAC factors of one parameter leaf W: its block of G ≈ left ⊗ right, W read row-major as
    a [left.shape[-1], right.shape[-1]] matrix (a dense layer's W of shape [in, out] in u @ W:
    left the input side, [in, in], right the output side, [out, out]; a ``Row``-stacked block
    has one pair per row, stacked on a leading axis). With its bias in the block (a
    [`BiasOf`][linbackprop.BiasOf] at the bias) the input side has one more row and column:
    [W; b] is the matrix. For symmetric factors
    (left ⊗ right)⁻¹ vec(X) = vec(left⁻¹ X right⁻¹): K-FAC's preconditioned gradient.

    Attributes:
        left: the input-side factor, [..., n, n] (a leading axis per ``Row``).
        right: the output-side factor, [..., m, m].

    Examples:
        >>> import jax.numpy as jnp, linbackprop as lbp
        >>> f = lbp.Kronecker(left=jnp.diag(jnp.array([1.0, 2.0])), right=jnp.array([[4.0]]))
        >>> step = jnp.linalg.solve(f.left, jnp.ones((2, 1))) @ jnp.linalg.inv(f.right)
        >>> step.ravel().tolist()
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

    The block is decided here, once: ``leaf`` is the weight's position among the result's leaves
    (flattened with pairs, tuples of pairs, markers and None as leaves: the gradient's order),
    which the optimizers read; ``weight`` names it for people. An optimizer handed another tree
    (a part of the result) finds ``leaves`` differ from its tree's and refuses.

    Attributes:
        weight: the weight leaf's path in the differentiated arguments
            (``jax.tree_util.keystr`` of it, as ``jax.tree_util.tree_flatten_with_path`` gives).
        side: which factor of the weight's pair has the bias's row and column, last.
        leaf: the weight's index among the result's leaves.
        leaves: how many leaves the result has.

    Examples:
        >>> import jax.numpy as jnp, linbackprop as lbp
        >>> dense = lambda th, x: jnp.tanh(x @ th[0] + th[1])
        >>> net = lbp.Network([lbp.Layer("y", dense, ("x",), ("W", "b"))], ["x"], "y")
        >>> loss = lambda p, x: 0.5 * jnp.sum(net(p, x) ** 2)
        >>> params = {"W": jnp.zeros((2, 1)), "b": jnp.zeros(1)}
        >>> f = lbp.kfac_factors(loss)(params, jnp.array([[1.0, 2.0]]))
        >>> f["b"], f["W"].left.tolist()             # [x, 1]ᵀ[x, 1] for x = (1, 2)
        (BiasOf(weight="['W']", side='left', leaf=0, leaves=2), [[1.0, 2.0, 1.0], [2.0, 4.0, 2.0], [1.0, 2.0, 1.0]])
    """

    weight: str
    side: Literal["left", "right"]
    leaf: int
    leaves: int


jax.tree_util.register_static(BiasOf)


def kfac_factors(fun: Callable, argnums: int | Sequence[int] = 0, *, engine: Engine = "auto",
                 samples: int | None = None, key: jax.Array | None = None, layers: Any = None,
                 approximation: Literal["expand", "reduce"] = "expand") -> Callable:
    r"""K-FAC factors of G = J* H J, shaped like the arguments ``argnums`` names: a
    [`Kronecker`][linbackprop.Kronecker] pair at each parameter leaf whose every use is a dense product (its
    per-example cotangent $x_b^T \delta_b$, a ``dot_general`` of one example's operands, contracted
    positions of a sequence summed); a bias added after such a product (its cotangent $\sum_t \delta_t$,
    x W + b) joins its weight's block, as in kfac-jax and curvlinops: the weight's λ-free factor
    is A = (1/N) Σ [x, 1]ᵀ[x, 1] (a column of zeros for uses without the bias) and the bias's
    entry is a [`BiasOf`][linbackprop.BiasOf] naming the weight. A convolution's kernel
    (``lax.conv_general_dilated``: flax's and equinox's ``Conv`` alike; any strides, padding,
    dilations, spatial rank) is such a product too, of the patches its window reads ($x_{bt}$ the
    patch at output position t, in the kernel's layout; Grosse & Martens' KFC) with the output
    cotangents: its block is [kernel; bias] read as a [patch size (+ 1), channels] matrix.
    Convolutions with feature groups (depthwise) and kernels whose output-channel axis is
    neither first nor last are not: their kernels get the diagonal. Every other leaf (norm scales
    and shifts, a gather, a bias shared by two products) gets its exact GGN diagonal, shaped
    like the leaf, from the same back substitutions (as [`diag_ggn`][linbackprop.diag_ggn] would
    give it: no second curvature pass).

    $$G_W \approx A \otimes \Gamma, \qquad A = \frac1N \sum_b \sum_t x_{bt}^T x_{bt}, \qquad
    \Gamma = \sum_k \sum_b \sum_t \lambda_{bk} \delta_{btk}^T \delta_{btk}$$

    over the examples b, the layers and positions t that use W (N terms: K-FAC "expand", for
    shared weights, RNNs and tied embeddings alike) and the columns of each example's factored H
    (as [`diag_ggn`][linbackprop.diag_ggn]: $\lambda_{bk}$, $s_{bk}$ from ``eigh``, $\delta_{bk}$ from one back
    substitution for all
    examples per k; with ``samples=M`` and a PRNG ``key``, M sampled columns instead). Exact for
    one example and one use. ``approximation="reduce"`` (Eschenhagen et al. 2023) sums each
    example's R uses first, $\bar x_b = \sum_t x_{bt}$ and $\bar\delta_{bk} = \sum_t \delta_{btk}$:

    $$A = \frac{1}{B R^2} \sum_b \bar x_b^T \bar x_b, \qquad
    \Gamma = \sum_k \sum_b \lambda_{bk} \bar\delta_{bk}^T \bar\delta_{bk}$$

    — for a weight shared where the loss is one term per example (pooled sequences, a PINN's
    operator), as "expand" is for one term per use. ``fun`` returns a scalar loss that is a sum (or mean) over examples;
    each argument leaf must be one parameter block as it is (not transformed before the network
    uses it). Layers that mix examples raise a ``ValueError``.

    Args:
        fun: the scalar loss, a sum or mean over examples, of the arguments; a loss of several
            terms calling the network separately gets a pair per term.
        argnums: the argument(s) whose factors are formed.
        engine: ``"loop"``, ``"unrolled"`` or ``"auto"``.
        samples: None (exact columns of H) or M sampled columns per example.
        key: the PRNG key of the samples (needed with ``samples``). Give each step a fresh one
            (``jax.random.fold_in(key, step)``): with one key for every step the same columns
            are drawn at every step, and the averaged factors keep their error instead of
            averaging it out.
        layers: the classes or ``@lbp.layer`` functions whose calls are the layers of a model
            written as it is.
        approximation: ``"expand"`` (each use a term) or ``"reduce"`` (each example's uses
            summed first).

    Returns:
        A function of ``fun``'s arguments returning, shaped like them, per leaf a
            [`Kronecker`][linbackprop.Kronecker] pair (a tuple of pairs, one per term of a loss with
            several calls), a [`BiasOf`][linbackprop.BiasOf] for a bias in its weight's block, or
            the leaf's GGN diagonal.

    Raises:
        ValueError: layers that mix examples, a state without the batch first, a loss that
            calls no network, or an unknown ``approximation``.

    Examples:
        >>> import jax.numpy as jnp, linbackprop as lbp
        >>> layer = lbp.Layer("y", lambda th, x: x @ th[0], ("x",), ("W",))
        >>> net = lbp.Network([layer], ["x"], "y")
        >>> loss = lambda p, x: 0.5 * jnp.sum(net(p, x) ** 2)
        >>> f = lbp.kfac_factors(loss)({"W": jnp.ones((2, 1))}, jnp.array([[1.0, 2.0]]))["W"]
        >>> f.left.tolist(), f.right.tolist()                   # one example: exact, x xᵀ ⊗ 1
        ([[1.0, 2.0], [2.0, 4.0]], [[1.0]])
    """
    if approximation not in ("expand", "reduce"):
        raise ValueError(f"kfac_factors(approximation={approximation!r}): use 'expand' (every use of a weight a "
                         "term) or 'reduce' (each example's uses summed first).")
    if layers is not None:
        found = on_model(lambda f, a: kfac_factors(f, a, engine=engine, samples=samples, key=key,
                                                   approximation=approximation), fun, argnums, layers,
                         name="kfac_factors")
        return lambda *args: biases_named_in(found(*args))
    nums, single = normalise_argnums(argnums)

    def run(*args: Any) -> Any:
        calls, examples = hessian_blocks(Split(fun, args, nums, False), engine, "kfac_factors")
        sums = FactorSums(calls, examples, approximation, single)
        return sums.assemble(*over_columns(sums.share, examples, samples, key, "kfac_factors"))

    return run


class FactorSums:
    """K-FAC's factors as sums over the columns of H's factor, for `kfac_factors` (one column
    after another) and the one-pass `gauss_newton` (all columns in one batched back
    substitution): ``share(s, weights, lams)`` is one column's part (the Γ terms, and the other
    leaves' GGN squares), ``assemble(summed, summed_squares)`` the result shaped like the
    arguments — the Kronecker pairs (A formed once there), the bias markers, the diagonals."""

    def __init__(self, calls: Calls, examples: Examples, approximation: str, single: bool):
        if any(None in place for place in calls.placement):
            raise NotImplementedError(
                "kfac_factors needs each differentiated argument leaf to be one parameter block of the network "
                "calls, as it is (here parameters are transformed before a network uses them); use diag_ggn or "
                "gauss_newton for such parameters.")
        self.calls, self.examples, self.single = calls, examples, single
        self.batches = examples.by_call(examples.batches)
        self.maps = [ParamFactors(plan, prim, self.batches[call], reduce=approximation == "reduce")
                     for plan, prim, call in zip(calls.plans, calls.stored, calls.solved)]
        paths, self.treedef = jax.tree_util.tree_flatten_with_path(calls.diff)
        self.count = len(paths)
        self.keys = [jax.tree_util.keystr(path[1:] if single else path) for path, _ in paths]
        self.where = [functools.partial(_placed, plan, theta, place)
                      for plan, theta, place in zip(calls.plans, calls.thetas, calls.placement)]
        self.factored, self.joint = _agreed(self.maps, self.where, calls.placement)
        # the other leaves' GGN diagonal from the same back substitutions (no second curvature pass)
        self.squares = (ggn_squares(calls, examples) if len(self.factored) + len(self.joint) < len(paths)
                        else None)

    def share(self, s: list, weights: list, lams: list | None = None) -> tuple:
        """One column's parts: its Γ terms per call, and its GGN squares (None where every leaf
        is factored); ``lams`` the calls' adjoints of ``s`` (computed where not given)."""
        if lams is None:
            lams = self.calls.adjoints(self.examples.unflatten(s), self.batches)
        by_call = self.examples.by_call(weights)
        parts = [m.parts(lam_c, by_call[call]) for m, lam_c, call in zip(self.maps, lams, self.calls.solved)]
        return parts, None if self.squares is None else self.squares[0](s, weights, lams)

    def assemble(self, summed: list, summed_squares: Any) -> Any:
        """The factors shaped like the arguments from the columns' summed parts."""
        result: list[Any] = ([None] * self.count if self.squares is None
                             else list(jax.tree.leaves(self.squares[1](summed_squares))))
        terms: dict[int, list[Kronecker]] = {}
        for m, part, placed in zip(self.maps, summed, self.where):
            for g, pairs in m.total(part).items():
                for leaf, pair in enumerate(pairs):
                    if pair is None:
                        continue
                    for row, at in placed(g, leaf).items():
                        if at in self.factored:
                            term = Kronecker(*(pair if row is None else (f[row] for f in pair)))
                            terms.setdefault(at, []).append(term)
        for at, found in terms.items():  # a leaf several calls use: a pair per call (a term each)
            result[at] = found[0] if len(found) == 1 else tuple(found)
        for bias, (weight, side) in self.joint.items():
            result[bias] = BiasOf(self.keys[weight], side, weight, len(result))
        out = tuple(jax.tree.unflatten(self.treedef, result))
        return out[0] if self.single else out


def is_factor(x: Any) -> bool:
    """A leaf of ``kfac_factors``' result: a pair, a tuple of pairs (terms), a bias marker, None
    (the optimizers read the factors' tree with it)."""
    return x is None or isinstance(x, (Kronecker, BiasOf)) or (
        isinstance(x, tuple) and len(x) > 0 and all(isinstance(t, Kronecker) for t in x))


def biases_named_in(result: Any) -> Any:
    """``layers=``: the factors were found for the captured network's arguments (a list of
    leaves per argument, so a bias names its weight "[a][i]"); name the weight by its path in
    the result, the model's own tree (an ``nnx.State``, a module), as the gradient's paths read.
    The leaves keep their order, so each weight's index stands."""
    paths, treedef = jax.tree_util.tree_flatten_with_path(result, is_leaf=is_factor)
    renamed = [dataclasses.replace(x, weight=jax.tree_util.keystr(paths[x.leaf][0])) if isinstance(x, BiasOf) else x
               for _, x in paths]
    return jax.tree.unflatten(treedef, renamed)


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


def _placed(plan: Any, theta: Any, place: list[int], g: int, leaf: int) -> dict:
    """Row → index among the differentiated arguments' leaves, for a parameter group's leaf: a
    stacked block's factors are its own (rows stacked: row None); in a group of blocks row r is
    block r's."""
    position = {id(x): n for n, x in enumerate(jax.tree.leaves(theta))}
    group = plan.param_groups[g]
    diff = [n for n, d in enumerate(group.diff_leaves) if d]
    rows = [(None, group.names[0])] if group.stacked_rows is not None else list(enumerate(group.names))
    return {row: place[position[id(jax.tree.leaves(theta[name])[diff[leaf]])]] for row, name in rows}
