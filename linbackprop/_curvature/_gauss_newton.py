"""The Gauss–Newton operator G = J* H J of ``fun``: products on the linearisation stored by one
forward pass — one forward substitution, one product with H, one back substitution and ℳ.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from .._capture import rewrite
from .._graph import stack_trees
from .._operators import LinearOperator
from .._options import Engine, ParamProducts, Schedule, current, plain
from .._solve import solve_mode
from ._kfac import biases_named_in
from ._one_pass import one_pass
from ._split import OnArguments, Split, add_trees, normalise_argnums


# -- the Gauss–Newton operator ------------------------------------------------------------------
@jax.tree_util.register_pytree_node_class
class GaussNewton(LinearOperator):
    """G = J* H J on parameter-shaped pytrees (the arguments ``argnums`` names), from one stored
    linearisation: ``mv(v)`` is J v (a forward substitution and ℳ*), H (J v) (the loss's Hessian
    w.r.t. the outputs, linearised once) and J* (a back substitution and ℳ). Symmetric:
    ``G.T`` is ``G``. A pytree (its leaves are the stored residuals), so it can cross ``jax.jit``.
    Made by [`gauss_newton`][linbackprop.gauss_newton].

    Attributes:
        T: G itself (G is symmetric).
        size: the number of parameters, P.
        outputs: the number of output coordinates C (every network output's entries): H is
            C × C and the rank of G is at most C.
        pattern: a 1 × 1 bool array: G is one dense block.

    Examples:
        >>> import jax.numpy as jnp, linbackprop as lbp
        >>> layer = lbp.Layer("y", lambda th, x: 2.0 * x @ th[0], ("x",), ("w",))
        >>> net = lbp.Network([layer], ["x"], "y")
        >>> loss = lambda p, x: 0.5 * jnp.sum(net(p, x) ** 2)
        >>> _, _, G = lbp.gauss_newton(loss)({"w": jnp.ones(2)}, jnp.eye(2))
        >>> G.mv({"w": jnp.array([1.0, 0.0])})["w"].tolist(), G.T is G      # J*J = 4 I
        ([4.0, 0.0], True)
    """

    symbol = "G"

    def __init__(self, jvp: Callable, vjp: Callable, hvp: Callable, single: bool, example: Any, outputs: Any,
                 value: Callable | None = None, loss: jax.Array | None = None, factors: Any = None,
                 diagonal: Any = None):
        self._jvp, self._vjp, self._hvp, self._value = jvp, vjp, hvp, value
        self._single, self._example, self._outputs = single, example, outputs
        self._loss, self._factors, self._diagonal = loss, factors, diagonal

    def tree_flatten(self) -> tuple[tuple, tuple]:
        return ((self._jvp, self._vjp, self._hvp, self._value, self._loss, self._factors, self._diagonal),
                (self._single, self._example, self._outputs))

    @property
    def value(self) -> jax.Array | None:
        """The loss at the point G was made at (its aux left out): what an optimizer's
        Levenberg–Marquardt step compares f(θ + u) with."""
        return self._loss

    @property
    def factors(self) -> Any:
        """K-FAC's factors from the same pass (``gauss_newton(..., factors=True)``): what
        [`kfac_factors`][linbackprop.kfac_factors] gives with the same ``samples`` and ``key``;
        None otherwise."""
        return self._factors

    @property
    def diagonal(self) -> Any:
        """diag G from the same pass (``gauss_newton(..., diagonal=True)``): what
        [`diag_ggn`][linbackprop.diag_ggn] gives with the same ``samples`` and ``key``; None
        otherwise."""
        return self._diagonal

    def value_at(self, params: Any) -> jax.Array:
        """The loss G was made from, on the same batch, at other values of the differentiated
        arguments: what an optimizer's Levenberg–Marquardt step measures, f(θ + u).

        ``value_fn=G.value_at`` gives it to [`kfac`][linbackprop.kfac] and
        [`scale_by_gauss_newton`][linbackprop.scale_by_gauss_newton], so a model made by
        ``layers=`` (an ``nnx.Optimizer`` hands the transform a pure ``nnx.State``) needs no
        split and merge.

        Args:
            params: the new values, shaped as the gradient (any pytree with the same leaves in
                the same order: an ``nnx.State`` with or without its Variables, an equinox
                module filtered to its arrays, a dict; for several ``argnums`` a tuple).

        Returns:
            The scalar loss (its aux left out where ``has_aux``).

        Raises:
            ValueError: ``params`` whose leaves are not the arguments' (count or shapes).

        Examples:
            >>> import jax.numpy as jnp, linbackprop as lbp
            >>> layer = lbp.Layer("y", lambda th, x: x @ th[0], ("x",), ("w",))
            >>> net = lbp.Network([layer], ["x"], "y")
            >>> loss = lambda p, x: 0.5 * jnp.sum(net(p, x) ** 2)
            >>> _, _, G = lbp.gauss_newton(loss)({"w": jnp.ones(2)}, jnp.eye(2))
            >>> float(G.value_at({"w": jnp.array([3.0, 4.0])}))  # ½ ‖(3, 4)‖²
            12.5
        """
        shapes = self._example[1]
        leaves = jax.tree.leaves(params)
        if [jnp.shape(x) for x in leaves] != [tuple(s) for s, _ in shapes]:
            raise ValueError(f"GaussNewton.value_at: params has leaves of shapes {[jnp.shape(x) for x in leaves]}, "
                             f"the differentiated arguments {[tuple(s) for s, _ in shapes]}; pass values shaped as "
                             "the gradient (for an equinox module, eqx.filter(model, eqx.is_inexact_array)).")
        return self._value([jnp.asarray(x, d) for x, (_, d) in zip(leaves, shapes)])

    @classmethod
    def tree_unflatten(cls, aux: tuple, children: tuple) -> GaussNewton:
        jvp, vjp, hvp, value, loss, factors, diagonal = children
        return cls(jvp, vjp, hvp, *aux, value, loss, factors, diagonal)

    def mv(self, v: Any) -> Any:
        """G v, jitted (one forward substitution, H, one back substitution and ℳ).

        Args:
            v: a vector shaped as the differentiated arguments (a tuple of them for several
                ``argnums``).

        Returns:
            G v, shaped as ``v``.
        """
        return _gauss_newton_mv(self, v)

    def apply(self, v: Any) -> Any:
        """G v as `mv`, traced where it is called (inside a jit of yours: no jit of its own).

        Args:
            v: a vector shaped as the differentiated arguments.

        Returns:
            G v, shaped as ``v``.
        """
        vs = (v,) if self._single else tuple(v)
        out = self._vjp(self._hvp(self._jvp(*vs)))
        return out[0] if self._single else tuple(out)

    def gram(self, vectors: Sequence[Any]) -> jax.Array:
        r"""The k × k matrix $[v_i^T G v_j]$ of k parameter-shaped vectors, from forward products only:

        $$v_i^T G v_j = (J v_i)^T H (J v_j)$$

        — k products J v with the stored linearisation (forward substitutions: on CPU one per
        vector, elsewhere one ``vmap``-batched for all k; ``python benchmarks/profile.py gram``),
        then k products with H on the outputs; no back substitution. What K-FAC's step size and
        momentum need (``lbp.kfac``: Δᵀ G Δ, Δᵀ G δ, δᵀ G δ).

        Args:
            vectors: k pytrees shaped like the arguments G acts on (for several ``argnums``,
                tuples of them).

        Returns:
            The symmetric [k, k] matrix.

        Examples:
            >>> import jax.numpy as jnp, linbackprop as lbp
            >>> layer = lbp.Layer("y", lambda th, x: x @ th[0], ("x",), ("w",))
            >>> net = lbp.Network([layer], ["x"], "y")
            >>> loss = lambda p, x: 0.5 * jnp.sum(net(p, x) ** 2)
            >>> _, _, G = lbp.gauss_newton(loss)({"w": jnp.ones(2)}, jnp.eye(2))
            >>> u, v = {"w": jnp.array([1.0, 0.0])}, {"w": jnp.array([1.0, 2.0])}
            >>> G.gram([u, v]).tolist()  # G = I
            [[1.0, 1.0], [1.0, 5.0]]
        """
        return _gram(self, tuple(vectors))

    @property
    def T(self) -> GaussNewton:  # noqa: N802 - the mathematical name
        return self

    @property
    def size(self) -> int:
        """The number of parameters: G is ``size`` × ``size``."""
        return int(sum(np.prod(shape, dtype=np.int64) for shape, _ in self._example[1]))

    @property
    def outputs(self) -> int:
        """The number of output coordinates C (every network output's entries): H is C × C and
        the rank of G is at most C."""
        return int(sum(np.prod(shape, dtype=np.int64) for shape, _ in self._outputs[1]))

    def factor(self) -> Any:
        r"""K with G = Kᵀ K: C rows shaped like the arguments, stacked on a leading axis of length
        C = ``outputs``. With H = V diag(h) Vᵀ (``eigh`` of the dense C × C Hessian of the loss
        w.r.t. the outputs, C products with H), row c is $J^*(\sqrt{h_c}\, v_c)$: C back substitutions and ℳ,
        all at once (``vmap``). H's negative part is dropped ($h_c < 0 \to 0$): exact for squared
        error and softmax cross-entropy, whose H is positive semi-definite. For least squares
        ½‖r‖² the rows are the residuals' Jacobian rows (in H's eigenbasis). Where C is below the
        number of parameters, (G + λI)⁻¹ g is exact at a C × C solve (Woodbury's identity:
        [`scale_by_gauss_newton`][linbackprop.scale_by_gauss_newton]'s Woodbury path).

        Examples:
            >>> import jax.numpy as jnp, linbackprop as lbp
            >>> layer = lbp.Layer("y", lambda th, x: x @ th[0], ("x",), ("W",))
            >>> net = lbp.Network([layer], ["x"], "y")
            >>> loss = lambda p, x: 0.5 * jnp.sum(net(p, x) ** 2)
            >>> _, _, G = lbp.gauss_newton(loss)({"W": jnp.ones((2, 1))}, jnp.array([[1.0, 2.0]]))
            >>> K = G.factor()["W"]
            >>> K.shape, (K.reshape(1, 2).T @ K.reshape(1, 2)).tolist()  # x xᵀ
            ((1, 2, 1), [[1.0, 2.0], [2.0, 4.0]])
        """
        return _factor(self)

    def root_apply(self, basis: jax.Array) -> Any:
        """J* on the columns of ``basis``.

        Args:
            basis: [C, k], k vectors over the network calls' outputs flattened in order (C
                entries).

        Returns:
            k rows shaped like the differentiated arguments, stacked on a leading axis.
        """

        def one(column: jax.Array) -> Any:
            back = self._vjp(self._as_outputs(column))
            return back[0] if self._single else tuple(back)

        return jax.vmap(one, in_axes=1)(basis)

    def hessian(self) -> jax.Array:
        """H = ∂²ℓ/∂(outputs)², dense C × C over the outputs flattened in order (C products)."""
        column = lambda e: jnp.concatenate([jnp.ravel(x) for x in jax.tree.leaves(self._hvp(self._as_outputs(e)))])
        dtype = jnp.result_type(*[d for _, d in self._outputs[1]])
        return jax.vmap(column)(jnp.eye(self.outputs, dtype=dtype)).T

    def _as_outputs(self, flat: jax.Array) -> Any:
        """A vector over the outputs flattened in order, as the outputs' pytree."""
        treedef, shapes = self._outputs
        sizes = np.cumsum([int(np.prod(shape, dtype=np.int64)) for shape, _ in shapes])[:-1]
        parts = jnp.split(flat, sizes)
        return treedef.unflatten([p.reshape(shape).astype(d) for p, (shape, d) in zip(parts, shapes)])

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


@jax.jit
def _gram(G: GaussNewton, vectors: tuple) -> jax.Array:
    jvp = (lambda v: G._jvp(v)) if G._single else (lambda v: G._jvp(*v))
    if current().policy.batched_products_pay(jax.default_backend()):
        outs = jax.vmap(jvp)(stack_trees(vectors))  # [k, ...] per output leaf: one forward substitution for all k
        curved = jax.vmap(G._hvp)(outs)
    else:  # one substitution per vector, the results stacked as the vmap's
        each = [jvp(v) for v in vectors]
        outs, curved = stack_trees(each), stack_trees([G._hvp(o) for o in each])
    rows = lambda tree: jnp.concatenate([x.reshape(x.shape[0], -1) for x in jax.tree.leaves(tree)], axis=1)
    j, hj = rows(outs), rows(curved)
    gram = j @ hj.T
    return (gram + gram.T) / 2


def _value_function(split: Split) -> jax.tree_util.Partial:
    """The loss on the same batch as a function of the differentiated arguments' leaves, with
    whatever it closes over (the batch, integer labels, tracers under ``jax.jit``) made explicit
    operands — its jaxpr's constants — so that G stays a pytree that can cross ``jax.jit``
    (``jax.closure_convert`` hoists only floating values: integer labels would leak)."""
    diff_def = jax.tree.structure(split.diff)

    def value(leaves: list) -> jax.Array:
        result = split.fun(*split.args_with(jax.tree.unflatten(diff_def, leaves)))
        return result[0] if split.has_aux else result

    with plain():  # only the value: the network calls as plain JAX code, no plan, no solve
        closed = jax.make_jaxpr(value)(jax.tree.leaves(split.diff))
    return jax.tree_util.Partial(functools.partial(_evaluated, closed.jaxpr), tuple(closed.consts))


def _evaluated(jaxpr: Any, consts: tuple, leaves: list) -> jax.Array:
    return jax.core.eval_jaxpr(jaxpr, list(consts), *leaves)[0]


def _structure(tree: Any) -> tuple:
    """(treedef, ((shape, dtype) per leaf)): a pytree's structure, static (an operator's aux data)."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((tuple(np.shape(x)), jnp.result_type(x)) for x in leaves)


@jax.jit
def _factor(G: GaussNewton) -> Any:
    h = G.hessian()
    eigenvalues, vectors = jnp.linalg.eigh((h + h.T) / 2)
    return G.root_apply(vectors * jnp.sqrt(jnp.maximum(eigenvalues, 0.0)))


def gauss_newton(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False, *,
                 remat: bool = False, checkpoints: int | None = None, schedule: Schedule = "even",
                 param_products: ParamProducts = "auto", engine: Engine = "auto", layers: Any = None,
                 factors: bool = False, diagonal: bool = False, samples: int | None = None,
                 key: jax.Array | None = None, approximation: Literal["expand", "reduce"] = "expand") -> Callable:
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

    Args:
        fun: the scalar loss of the arguments; its Network calls are the model, the rest the
            loss ℓ of their outputs.
        argnums: the argument(s) G is over.
        has_aux: ``fun`` returns ``(value, aux)``; the first element comes back as that pair.
        remat: keep only the states; re-linearise in the substitutions.
        checkpoints: keep about this many states (where that saves memory with the products
            counted).
        schedule: ``"even"`` or ``"nested"`` checkpoints.
        param_products: where ℳ* h and ℳΛ are formed: ``"after"``, ``"in_loop"`` or ``"auto"``.
        engine: ``"loop"``, ``"unrolled"`` or ``"auto"``.
        layers: the classes or ``@lbp.layer`` functions whose calls are the layers of a model
            written as it is: G is the GGN of those calls' outputs (what follows the last call
            is the loss).

    Returns:
        A function of ``fun``'s arguments returning ``(value, grad, G)``: ``G`` a
            [`GaussNewton`][linbackprop.GaussNewton] (``mv``, ``gram``, ``todense()``,
            ``factor()``), a pytree that a jitted function may return.

    Raises:
        ValueError: a loss that calls no network (name the layers with ``layers=``).

    Examples:
        >>> import jax.numpy as jnp, linbackprop as lbp
        >>> layer = lbp.Layer("y", lambda th, x: x @ th[0], ("x",), ("W",))
        >>> net = lbp.Network([layer], ["x"], "y")
        >>> loss = lambda p, x: 0.5 * jnp.sum(net(p, x) ** 2)
        >>> value, grad, G = lbp.gauss_newton(loss)({"W": jnp.ones((2, 1))}, jnp.eye(2))
        >>> G.todense().tolist()          # J* J for the linear model: x*x = I
        [[1.0, 0.0], [0.0, 1.0]]
    """
    nums, single = normalise_argnums(argnums)
    settings = dict(remat=remat, checkpoints=checkpoints, schedule=schedule, param_products=param_products,
                    engine=engine)
    in_one_pass = _check_one_pass(factors, diagonal, samples, key, approximation, remat, checkpoints)

    def run(*args: Any) -> tuple[Any, Any, GaussNewton]:
        if in_one_pass:
            return _run_one_pass(fun, args, nums, single, has_aux, layers, engine, factors, diagonal, samples, key,
                                 approximation)
        if layers is None:
            split, found = Split(fun, args, nums, has_aux), None
        else:  # the model as it is: its network found, G on the arguments' own types
            found = rewrite(fun, args, nums, layers)

            def with_states(*parts: Any) -> tuple:  # an nnx module's other state after fun, as aux
                result, states = found.fun(*parts)
                value, aux = result if has_aux else (result, None)
                return value, (aux, states)

            split = Split(with_states, found.args, tuple(range(len(nums))), True)
        model = solve_mode(split.model, **settings, products=True)
        layout: dict = {}

        def differentiable(*diff: Any) -> tuple[list, list]:
            # integer outputs (an RNG count a dropout layer advances) have no tangent and no
            # curvature: J and H are over the floating ones, the others held as they are
            leaves, layout["tree"] = jax.tree.flatten(model(*diff))
            layout["floating"] = [jnp.issubdtype(jnp.result_type(x), jnp.inexact) for x in leaves]
            return ([x for x, f in zip(leaves, layout["floating"]) if f],
                    [x for x, f in zip(leaves, layout["floating"]) if not f])

        outs, jvp, held = jax.linearize(differentiable, *split.diff, has_aux=True)

        def loss(floating: list, *diff: Any) -> Any:
            rest, parts = iter(held), iter(floating)
            leaves = [next(parts) if f else next(rest) for f in layout["floating"]]
            return split.loss(jax.tree.unflatten(layout["tree"], leaves), *diff)

        loss_args = tuple(range(1 + len(nums)))
        (value, aux), grads = jax.value_and_grad(loss, loss_args, has_aux=True)(outs, *split.diff)
        vjp = jax.linear_transpose(jvp, *split.diff)
        grad = tuple(add_trees(g, m) for g, m in zip(grads[1:], vjp(grads[0])))
        _, hvp = jax.linearize(jax.grad(lambda o: loss(o, *split.diff)[0]), outs)
        if found is not None:
            aux, states = aux
            found.write_back(states)  # RNG counts advanced as nnx.grad advances them
            grad = found.gradient(grad, False)
            on = OnArguments(found.arguments)
            jvp, vjp = jax.tree_util.Partial(on.jvp, jvp), jax.tree_util.Partial(on.vjp, vjp)
        G = GaussNewton(jvp, vjp, hvp, single, _structure(grad[0] if single else grad), _structure(outs),
                        _value_function(split), value)
        value = (value, aux) if has_aux else value
        return value, grad[0] if single else grad, G

    return run


def _check_one_pass(factors: bool, diagonal: bool, samples: int | None, key: Any, approximation: str, remat: bool,
                    checkpoints: int | None) -> bool:
    """Whether ``gauss_newton`` runs in one pass (factors or the diagonal asked for), with its
    arguments checked."""
    if approximation not in ("expand", "reduce"):
        raise ValueError(f"gauss_newton(approximation={approximation!r}): use 'expand' (every use of a weight a "
                         "term) or 'reduce' (each example's uses summed first).")
    if not (factors or diagonal):
        if samples is not None or key is not None:
            raise ValueError("gauss_newton(samples=, key=) draw the columns of the K-FAC factors and the diagonal: "
                             "pass factors=True and/or diagonal=True with them.")
        return False
    if remat or checkpoints is not None:
        raise ValueError("gauss_newton(factors=True / diagonal=True) keeps every layer's residuals (its factors "
                         "are formed from them in one pass): drop remat= and checkpoints=, or call "
                         "gauss_newton(remat=...) and kfac_factors / diag_ggn apart.")
    return True


def _run_one_pass(fun: Callable, args: tuple, nums: tuple, single: bool, has_aux: bool, layers: Any, engine: str,
                  factors: bool, diagonal: bool, samples: int | None, key: Any, approximation: str) -> tuple:
    """``gauss_newton(factors=True / diagonal=True)``: value, gradient and G with its factors and
    diagonal from one forward pass and one batched back substitution (`one_pass`)."""
    if layers is None:
        split, found = Split(fun, args, nums, has_aux), None
    else:  # the model as it is, its layers also run on one example (as kfac_factors and diag_ggn)
        found = rewrite(fun, args, nums, layers, per_example=True)

        def with_states(*parts: Any) -> tuple:  # an nnx module's other state after fun, as aux
            result, states = found.fun(*parts)
            value, aux = result if has_aux else (result, None)
            return value, (aux, states)

        split = Split(with_states, found.args, tuple(range(len(nums))), True)
    done = one_pass(split, engine, single and found is None, factors=factors,
                    diagonal=diagonal, samples=samples, key=key, approximation=approximation)
    grad, jvp, vjp, aux, kfac, diag = done.grad, done.jvp, done.vjp, done.aux, done.factors, done.diagonal
    if found is not None:
        aux, states = aux
        found.write_back(states)
        grad = found.gradient(grad, False)
        on = OnArguments(found.arguments)
        jvp, vjp = jax.tree_util.Partial(on.jvp, jvp), jax.tree_util.Partial(on.vjp, vjp)
        if kfac is not None:
            kfac = biases_named_in(found.gradient(kfac, single), single)
        if diag is not None:
            diag = found.gradient(diag, single)
    G = GaussNewton(jvp, vjp, done.hvp, single, _structure(grad[0] if single else grad), _structure(done.outs),
                    _value_function(split), done.value, kfac, diag)
    value = (done.value, aux) if has_aux else done.value
    return value, grad[0] if single else grad, G
