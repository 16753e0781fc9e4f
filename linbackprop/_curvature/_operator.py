"""The Gauss–Newton operator G = J* H J: products on the linearisation stored by one forward pass
— one forward substitution, one product with H, one back substitution and ℳ — as a pytree that
can cross ``jax.jit`` (its leaves the stored residuals), with what one pass also gave (the loss,
K-FAC's factors, the GGN diagonal).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from .._graph import replicated_result, stack_trees
from .._operators import LinearOperator
from .._options import current, plain
from ._split import Split


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
    gram = sum(jax.lax.dot_general(j, hj, ((tuple(range(1, j.ndim)),) * 2, ((), ())),
                                   **replicated_result(j, tuple(range(1, j.ndim))))
               for j, hj in zip(jax.tree.leaves(outs), jax.tree.leaves(curved)))
    return (gram + gram.T) / 2


def value_function(split: Split) -> jax.tree_util.Partial:
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


def structure_of(tree: Any) -> tuple:
    """(treedef, ((shape, dtype) per leaf)): a pytree's structure, static (an operator's aux data)."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((tuple(np.shape(x)), jnp.result_type(x)) for x in leaves)


@jax.jit
def _factor(G: GaussNewton) -> Any:
    h = G.hessian()
    eigenvalues, vectors = jnp.linalg.eigh((h + h.T) / 2)
    return G.root_apply(vectors * jnp.sqrt(jnp.maximum(eigenvalues, 0.0)))
