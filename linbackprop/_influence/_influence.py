"""Training-data attribution: which training examples made the model say this.

The influence of training example i on a query's measure f_q (Koh & Liang 2017; Grosse et al.
2023) is

    S[q, i] = ∇f_q(θ)ᵀ (G + λI)⁻¹ ∇ℓ_i(θ),

G the GGN of the mean training loss (1/N) Σ ℓ_i. Both gradients are what this library's
per-example transforms give — every weight of any DAG, a shared, tied or recurrent weight's
gradient summed over its uses — and G's approximations are its curvature transforms: the
diagonal (`diag_ggn`), K-FAC's factors (`kfac_factors`), the rows of its factor (`ggn_factor`:
EK-FAC's refit and the exact G). `fit` forms the approximation once; `scores` preconditions the
query gradients and multiplies them with the training gradients a chunk at a time.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp

from .._curvature import (
    BiasOf,
    diag_ggn,
    ggn_factor,
    is_factor,
    kfac_factors,
    per_example_grad_norms,
    per_example_grads,
    per_example_products,
)
from .._curvature import Kronecker as KroneckerPair
from .._optim import Diagonal, blocks_of
from .._solve import jvp_by_solve
from ._chunks import chunked, concatenated, example_count, summed
from ._curvatures import (
    DenseCurvature,
    DiagonalCurvature,
    EigenCurvature,
    Identity,
    dense_curvature,
    eigen_curvature,
    flattened,
    refitted,
)

Method = Literal["identity", "diagonal", "kfac", "ekfac", "exact"]
METHODS = ("identity", "diagonal", "kfac", "ekfac", "exact")
DEFAULT_DAMPING = 0.1  # × the approximation's mean eigenvalue (kronfluence's default)
CHUNK_BYTES = 2**28  # batch_size=None: what one chunk's per-example gradients (or the fit's rows) may take
Curvature = Identity | DiagonalCurvature | EigenCurvature | DenseCurvature


def influence(losses: Callable, argnums: int = 0, *, method: Method = "ekfac", damping: float | None = None,
              samples: int | None = None, key: jax.Array | None = None, layers: Any = None,
              batch_size: int | None = None) -> Influence:
    r"""Influence functions: the scores of training examples on queries,

    $$S_{qi} = \nabla f_q(\theta)^T (G + \lambda I)^{-1} \nabla \ell_i(\theta),$$

    G the generalised Gauss–Newton matrix of the mean training loss $\frac1N \sum_i \ell_i$ (the
    Fisher for squared error and softmax cross-entropy): H's exact columns, or ``samples=M``
    sampled with ``key``. ``method`` picks its approximation:

    - ``"identity"``: G + λI replaced by I — gradient dot products (no damping).
    - ``"diagonal"``: G's exact diagonal ([`diag_ggn`][linbackprop.diag_ggn]).
    - ``"kfac"``: A ⊗ Γ per weight, its bias in its block ([`kfac_factors`][linbackprop.kfac_factors]);
      other leaves by their diagonal.
    - ``"ekfac"``: K-FAC's eigenbases with the eigenvalues refitted, $s = \operatorname{diag}
      (Q^T G Q)$, from every example's gradients of H's columns (George et al. 2018) — a shared
      weight's gradient summed over its uses before it is squared.
    - ``"exact"``: G itself, P × P, eigendecomposed: small models, the reference.

    λ = ``damping``, or 0.1 × the approximation's mean eigenvalue (kronfluence's default).
    Every weight ``per_example_grads`` differentiates is covered: dense and convolution layers,
    weights shared by layers, tied, or used along a sequence, and ``layers=`` models (flax nnx
    and linen, equinox). Layers that mix examples raise, as in the per-example transforms.

    Args:
        losses: ``losses(params, *train) -> (N,)``, each training example's loss.
        argnums: which argument of ``losses`` (and of ``measure``) is the parameters; the
            others are data with a leading axis of examples.
        method: ``"identity"``, ``"diagonal"``, ``"kfac"``, ``"ekfac"`` or ``"exact"``.
        damping: λ, or None for 0.1 × the mean eigenvalue of the approximation.
        samples: M sampled columns of each example's H for the diagonal and K-FAC's factors
            (EK-FAC refits from the exact columns); None for the exact columns.
        key: the PRNG key of the samples.
        layers: the classes or ``@lbp.layer`` functions whose calls are the layers of a model
            written as it is.
        batch_size: go through the training and query examples this many at a time (memory
            bounded by it); None: as many as keep a chunk's per-example gradients (in the
            fit, its rows of G's factor: C per example) within 256 MiB.

    Returns:
        An [`Influence`][linbackprop.Influence]: ``.fit(params, *train)`` forms the curvature.

    Raises:
        ValueError: an unknown method, a damping that is not positive, damping with
            ``"identity"``, ``samples`` without ``key`` or with ``"exact"``, a batch size
            that is not a positive int.

    Examples:
        >>> import jax.numpy as jnp, linbackprop as lbp
        >>> layer = lbp.Layer("y", lambda th, x: x @ th[0], ("x",), ("w",))
        >>> net = lbp.Network([layer], ["x"], "y")
        >>> losses = lambda p, x, y: 0.5 * (net(p, x)[:, 0] - y) ** 2
        >>> x, y = jnp.array([[1.0, 0.0], [0.0, 2.0]]), jnp.array([0.0, 1.0])
        >>> fit = lbp.influence(losses, method="identity").fit({"w": jnp.ones((2, 1))}, x, y)
        >>> fit.self_scores({"w": jnp.ones((2, 1))}, x, y).tolist()    # ‖∇ℓ_i‖²
        [1.0, 4.0]
    """
    if method not in METHODS:
        raise ValueError(f"influence(method={method!r}): use one of {', '.join(map(repr, METHODS))}.")
    if not isinstance(argnums, int) or isinstance(argnums, bool):
        raise TypeError(f"influence(argnums={argnums!r}): one argument position; put several parameter "
                        "pytrees in one (a tuple or dict) and name its position.")
    if damping is not None and method == "identity":
        raise ValueError("influence(method='identity', damping=...): the identity method replaces G + λI by I; "
                         "drop damping, or choose a method with a curvature.")
    if damping is not None and not isinstance(damping, jax.Array) and not float(damping) > 0:
        raise ValueError(f"influence(damping={damping!r}): a positive λ, or None for 0.1 × the mean eigenvalue.")
    if samples is not None and (not isinstance(samples, int) or samples < 1 or key is None):
        raise ValueError(f"influence(samples={samples!r}): a positive int of H's columns per example, with a PRNG "
                         "key= to draw them.")
    if samples is not None and method in ("identity", "exact"):
        raise ValueError(f"influence(method={method!r}, samples=...): samples apply to the diagonal and K-FAC's "
                         "factors; the exact G uses H's exact columns.")
    if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"influence(batch_size={batch_size!r}): a positive number of examples, or None.")
    return Influence(losses, argnums, method, damping, samples, key, layers, batch_size)


def _with_params(params: Any, data: tuple, argnums: int) -> tuple:
    return (*data[:argnums], params, *data[argnums:])


@dataclasses.dataclass(frozen=True)
class Influence:
    """Influence functions of ``losses`` with one method, before the fit: see
    [`influence`][linbackprop.influence]. ``fit(params, *train)`` forms the training set's
    curvature (``jax.jit(attr.fit)`` too: the result is a pytree).

    Attributes:
        losses: the per-example training losses, ``losses(params, *train) -> (N,)``.
        argnums: the position of the parameters among their arguments.
        method: the approximation of G.
        damping: λ, or None for the default.
        samples: sampled columns of H per example, or None.
        key: the PRNG key of the samples.
        layers: the layers of a model written as it is, or None.
        batch_size: examples per chunk, or None.

    Examples:
        >>> import jax.numpy as jnp, linbackprop as lbp
        >>> layer = lbp.Layer("y", lambda th, x: x @ th[0], ("x",), ("w",))
        >>> net = lbp.Network([layer], ["x"], "y")
        >>> losses = lambda p, x, y: 0.5 * (net(p, x)[:, 0] - y) ** 2
        >>> attr = lbp.influence(losses, method="exact", damping=1.0)
        >>> x, y = jnp.array([[1.0, 0.0], [0.0, 2.0]]), jnp.array([0.0, 1.0])
        >>> fit = attr.fit({"w": jnp.ones((2, 1))}, x, y)     # G = diag(1/2, 2)
        >>> jnp.round(fit.curvature.values, 4).tolist(), float(fit.damping)   # its eigenvalues
        ([0.5, 2.0], 1.0)
    """

    losses: Callable
    argnums: int
    method: str
    damping: float | None
    samples: int | None
    key: jax.Array | None
    layers: Any
    batch_size: int | None

    def _grads(self, fun: Callable) -> Callable:
        return per_example_grads(fun, self.argnums, layers=self.layers)

    def fit(self, params: Any, *train: Any) -> InfluenceFit:
        """The training set's curvature at ``params`` (G of the mean of ``losses`` over
        ``train``), decomposed once; λ fixed (given, or the default from it).

        Args:
            params: the parameters (``losses``' argument ``argnums``).
            *train: the training data, arrays (or pytrees) with a leading axis N.

        Returns:
            The [`InfluenceFit`][linbackprop.InfluenceFit].
        """
        n = example_count(train, "train")
        example = self._example_gradient(params, train)
        per_example = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(example))
        chunk = self.batch_size or max(1, CHUNK_BYTES // per_example)  # the scores' chunks
        try:
            curvature = self._curvature(params, train, n, example, self._fit_chunk(params, train, per_example))
        except ValueError as error:  # the curvature transform's own message, and whose call it was
            error.add_note(f"(while lbp.influence(method={self.method!r}) fitted the training set's curvature)")
            raise
        damping = jnp.zeros(()) if self.method == "identity" else (
            DEFAULT_DAMPING * curvature.mean_eigenvalue() if self.damping is None else jnp.asarray(self.damping))
        return InfluenceFit(curvature, damping, self.losses, self.argnums, self.layers, chunk, n)

    def _fit_chunk(self, params: Any, train: tuple, per_example: int) -> int | None:
        """The fit's examples per chunk: ``batch_size``, or where the fit forms G's factor's rows
        (EK-FAC's refit, the exact G: C rows of P per example, twice while they are joined) as
        many as keep them within CHUNK_BYTES; the other fits form no per-example gradient."""
        if self.batch_size is not None or self.method not in ("ekfac", "exact"):
            return self.batch_size
        one = tuple(jax.tree.map(lambda x: x[:1], train))
        factor = ggn_factor(self._mean_loss(1), self.argnums, layers=self.layers)
        rows = jax.tree.leaves(jax.eval_shape(lambda *c: factor(*_with_params(params, c, self.argnums)), *one))
        return max(1, CHUNK_BYTES // (2 * rows[0].shape[0] * per_example))

    def _mean_loss(self, n: int) -> Callable:
        return lambda *args: jnp.sum(self.losses(*args)) / n  # each chunk's share of the mean over all n

    def _key(self, index: jax.Array) -> jax.Array | None:
        return None if self.key is None else jax.random.fold_in(self.key, index)

    def _curvature(self, params: Any, train: tuple, n: int, example: Any, size: int | None) -> Curvature:
        mean = self._mean_loss(n)
        at = lambda chunk: _with_params(params, chunk, self.argnums)
        if self.method == "identity":
            return Identity()
        if self.method == "diagonal":
            return DiagonalCurvature(summed(lambda i, *c: diag_ggn(mean, self.argnums, samples=self.samples,
                                                                   key=self._key(i), layers=self.layers)(*at(c)),
                                            train, size, "train"))
        if self.method == "exact":
            def gram(_, *chunk):
                rows = flattened(ggn_factor(mean, self.argnums, layers=self.layers)(*at(chunk)))
                return rows.T @ rows
            leaves, treedef = jax.tree.flatten(example)
            return dense_curvature(summed(gram, train, size, "train"), treedef,
                                   tuple(jnp.shape(x) for x in leaves))
        factors = self._factors(params, train, n, size)
        blocks = blocks_of(example, factors, None, f"influence(method={self.method!r})")
        for block in blocks:
            if not isinstance(block.curvature, Diagonal) and len(block.curvature) > 1:
                path = jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(example)[0][block.leaf][0])
                raise NotImplementedError(
                    f"influence(method={self.method!r}): the weight {path} has {len(block.curvature)} Kronecker "
                    "terms (the losses call its network more than once per example); use method='diagonal' "
                    "or 'exact'.")
        curvature = eigen_curvature(blocks, jax.tree.structure(example))
        if self.method == "kfac":
            return curvature
        refit = summed(lambda _, *c: refitted(curvature, ggn_factor(mean, self.argnums, layers=self.layers)(*at(c))),
                       train, size, "train")
        values = [v if r is None else r for v, r in zip(curvature.values, refit)]
        return dataclasses.replace(curvature, values=values)

    def _factors(self, params: Any, train: tuple, n: int, size: int | None) -> Any:
        """K-FAC's factors over all of ``train``: each chunk's A weighted by its share of the
        examples (A is a mean over the examples a call sees), Γ and the diagonals summed (the
        chunk's loss carries 1/n already)."""
        mean = self._mean_loss(n)
        parts = chunked(lambda i, *c: kfac_factors(mean, self.argnums, samples=self.samples, key=self._key(i),
                                                   layers=self.layers)(*_with_params(params, c, self.argnums)),
                        train, size, "train")

        def combine(*stacks: Any) -> Any:
            first = stacks[0]
            if isinstance(first, KroneckerPair):
                return KroneckerPair(sum(jnp.sum(s.left, axis=0) * (m / n) for s, (_, m) in zip(stacks, parts)),
                                     sum(jnp.sum(s.right, axis=0) for s in stacks))
            if isinstance(first, tuple):  # one pair per term: `_curvature` refuses them, naming the weight
                return tuple(combine(*terms) for terms in zip(*stacks))
            if first is None or isinstance(first, BiasOf):
                return first  # the block, decided by kfac_factors
            return sum(jnp.sum(s, axis=0) for s in stacks)

        return jax.tree.map(combine, *[stacked for stacked, _ in parts], is_leaf=is_factor)

    def _example_gradient(self, params: Any, train: tuple) -> Any:
        """Zeros shaped as one example's gradient, in the gradient's own tree (an nnx.State for an
        nnx model): the layout every curvature reads the gradients by."""
        one = tuple(jax.tree.map(lambda x: x[:1], train))
        shapes = jax.eval_shape(lambda *c: self._grads(self.losses)(*_with_params(params, c, self.argnums)), *one)
        return jax.tree.map(lambda s: jnp.zeros(s.shape[1:], s.dtype), shapes)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["curvature", "damping"],
                   meta_fields=["losses", "argnums", "layers", "batch_size", "examples"])
@dataclasses.dataclass(frozen=True)
class InfluenceFit:
    """The training set's curvature, fitted: scores of training examples on queries. A pytree
    (``jax.jit(attr.fit)`` returns one).

    Examples:
        >>> import jax.numpy as jnp, linbackprop as lbp
        >>> layer = lbp.Layer("y", lambda th, x: x @ th[0], ("x",), ("w",))
        >>> net = lbp.Network([layer], ["x"], "y")
        >>> losses = lambda p, x, y: 0.5 * (net(p, x)[:, 0] - y) ** 2
        >>> x, y = jnp.array([[1.0, 0.0], [0.0, 2.0]]), jnp.array([0.0, 1.0])
        >>> p = {"w": jnp.ones((2, 1))}
        >>> fit = lbp.influence(losses, method="diagonal", damping=1.0).fit(p, x, y)
        >>> fit.scores(losses, p, (x, y), (x, y)).tolist()   # ∇ℓ_qᵀ (diag G + I)⁻¹ ∇ℓ_i
        [[0.6666666865348816, 0.0], [0.0, 1.3333333730697632]]

    Attributes:
        curvature: the approximation of G, decomposed.
        damping: λ (0 for the identity method).
        examples: N, the training examples it was fitted on.
        batch_size: the examples per chunk of the scores (``influence``'s, or the default's).
    """

    curvature: Curvature
    damping: jax.Array
    losses: Callable
    argnums: int
    layers: Any
    batch_size: int
    examples: int

    def with_damping(self, damping: float | jax.Array) -> InfluenceFit:
        """The same fit with another λ (a damping sweep without fitting again).

        Args:
            damping: the new λ.

        Returns:
            The [`InfluenceFit`][linbackprop.InfluenceFit] with it.
        """
        if isinstance(self.curvature, Identity):
            raise ValueError("InfluenceFit.with_damping: the identity method has no damping.")
        return dataclasses.replace(self, damping=jnp.asarray(damping))

    def _grads(self, fun: Callable, params: Any, data: tuple) -> Any:
        return per_example_grads(fun, self.argnums, layers=self.layers)(*_with_params(params, data, self.argnums))

    def _preconditioned(self, per_example: Any) -> Any:
        return jax.vmap(lambda g: self.curvature.apply(g, self.damping))(per_example)

    def scores(self, measure: Callable, params: Any, query: tuple, train: tuple, *,
               by: Literal["gradients", "ghost", "forward"] = "gradients") -> jax.Array:
        r"""$S_{qi} = \nabla f_q(\theta)^T (G + \lambda I)^{-1} \nabla \ell_i(\theta)$, shape (Q, N).

        The query gradients are preconditioned a chunk at a time, $v_q = (G + \lambda I)^{-1}
        \nabla f_q$; then ``by="gradients"`` forms each training chunk's per-example gradients
        (one back substitution, [chunk, P]) and multiplies; ``by="ghost"`` never forms a
        training gradient: after the one back substitution (Λ) each layer's parameter tangent
        along $v_q$ ($ℳ^* v_q$, no substitution) is contracted with Λ example by example
        (for a dense layer $\sum_t a_t^T V_q \delta_t$); ``by="forward"`` forms none either:
        $S_{qi}$ is the directional derivative of $\ell_i$ along $v_q$, the forward
        substitution $ℒZ = ℳ^* v_q$ over the training chunk for all of a chunk's queries at
        once ([`jvp_by_solve`][linbackprop.jvp_by_solve]), a forward pass per chunk. The last
        two hold a state-shaped tangent per query instead of P numbers per training example.

        Args:
            measure: ``measure(params, *query) -> (Q,)``, one value per query (its loss, a
                margin, a log-likelihood).
            params: the parameters (as ``fit`` had them).
            query: the queries' data, a tuple of arrays with a leading axis Q.
            train: the training data, as ``fit`` had it: a tuple with a leading axis N.
            by: ``"gradients"``, ``"ghost"`` or ``"forward"`` (above).

        Returns:
            The (Q, N) scores.
        """
        n = example_count(train, "train")
        if n != self.examples:
            raise ValueError(f"InfluenceFit.scores: train has {n} examples, the fit {self.examples}; pass the "
                             "training data the curvature was fitted on.")
        if by not in ("gradients", "ghost", "forward"):
            raise ValueError(f"InfluenceFit.scores(by={by!r}): 'gradients' (per-example training gradients, "
                             "multiplied), 'ghost' (the parameter tangents contracted with the adjoints) or "
                             "'forward' (directional derivatives): the last two form no training gradient.")

        def query_rows(*q: Any) -> jax.Array:
            v = self._preconditioned(self._grads(measure, params, q))  # [q, ...] like the gradient
            if by == "ghost":
                products = per_example_products(self.losses, self.argnums, layers=self.layers)
                return concatenated(lambda *t: products(v, *_with_params(params, t, self.argnums)), train,
                                    self.batch_size, "train", axis=1)
            if by == "forward":
                along = lambda t: jax.vmap(lambda v_q: self._directional(params, t, v_q))(v)
                return concatenated(lambda *t: along(t), train, self.batch_size, "train", axis=1)
            flat = flattened(v)
            return concatenated(lambda *t: flat @ flattened(self._grads(self.losses, params, t)).T, train,
                                self.batch_size, "train", axis=1)

        return concatenated(query_rows, query, self.batch_size, "query", axis=0)

    def _directional(self, params: Any, train: tuple, tangent: Any) -> jax.Array:
        """(N,): each training loss's derivative along ``tangent`` (the forward substitution)."""
        at = lambda p: self.losses(*_with_params(p, train, self.argnums))
        return jvp_by_solve(at, (params,), (tangent,), layers=self.layers)[1]

    def self_scores(self, params: Any, *train: Any) -> jax.Array:
        r"""$s_i = \nabla \ell_i(\theta)^T (G + \lambda I)^{-1} \nabla \ell_i(\theta)$, shape (N,): how
        much each training example influences itself (large for mislabelled and atypical
        examples). For the identity method the squared gradient norms, without forming the
        gradients (ghost norms).

        Args:
            params: the parameters (as ``fit`` had them).
            *train: the training data, as ``fit`` had it (a leading axis N).

        Returns:
            The (N,) self-influences, ``batch_size`` examples at a time.
        """
        if isinstance(self.curvature, Identity):
            norms = per_example_grad_norms(self.losses, self.argnums, layers=self.layers)
            return concatenated(lambda *t: norms(*_with_params(params, t, self.argnums)) ** 2, train,
                                self.batch_size, "train")

        def chunk(*t: Any) -> jax.Array:
            g = self._grads(self.losses, params, t)
            return jnp.sum(flattened(g) * flattened(self._preconditioned(g)), axis=1)

        return concatenated(chunk, train, self.batch_size, "train")
