"""Curvature in one pass: the value, the gradient, G's products, K-FAC's factors and the GGN
diagonal of a loss from one forward pass with residuals kept and one back substitution batched
over [the gradient's cotangent, H's sampled (or exact) columns] — right-hand sides of the same
ℒ* (the seed's point: the substitution takes many at once).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .._capture import rewrite
from .._engine import param_adjoint
from .._options import current
from ._examples import all_columns, ggn_squares, hessian_blocks
from ._kfac import FactorSums, biases_named_in
from ._operator import GaussNewton, structure_of, value_function
from ._split import OnArguments, Split, add_trees


class OnePass(NamedTuple):
    """What `one_pass` gives: the loss's ``value`` and ``aux``, ``grad`` (a tuple per
    differentiated argument), J and J* as pytree functions (``jvp(*v)`` the calls' output
    tangents, ``vjp(c)`` a tuple per argument), H's product ``hvp`` on the outputs, the outputs
    ``outs``, and ``factors`` / ``diagonal`` (None where not asked for)."""

    value: jax.Array
    aux: Any
    grad: tuple
    jvp: jax.tree_util.Partial
    vjp: jax.tree_util.Partial
    hvp: Callable
    outs: tuple
    factors: Any
    diagonal: Any


def one_pass(split: Split, engine: str, single: bool, *, factors: bool, diagonal: bool, samples: int | None,
             key: jax.Array | None, approximation: str) -> OnePass:
    r"""One forward pass of the split function's network calls (`Calls`, residuals kept), the
    loss's gradient w.r.t. their outputs g = ∂ℓ/∂(outputs), and one back substitution of the
    stored pass over K + 1 right-hand sides: [E* g, E* s_1, …, E* s_K] with s_k H's columns (K = M
    samples per example with ``samples=M``, or every eigenvector of each example's block,
    weighted by its eigenvalue) — vmapped where the policy's ``batched_products_pay`` says so
    (off CPU), one column after another on CPU, where XLA's batched products measured slower.
    Then

    $$\nabla_\theta J = ℳ Λ_0 + \partial_\theta \ell, \qquad
    \Gamma = \tfrac1K \sum_k \sum_b w_{kb}\, \delta_{bk}^T \delta_{bk}, \qquad
    \operatorname{diag} G = \tfrac1K \sum_k \sum_b w_{kb} (J_b^* s_{bk})^2$$

    from Λ_0 and Λ_1 … Λ_K (1/K for samples only); A from the stored forward pass. The same
    columns as [`kfac_factors`][linbackprop.kfac_factors] and
    [`diag_ggn`][linbackprop.diag_ggn] for the same key (they take them one after another)."""
    calls, examples = hessian_blocks(split, engine, "gauss_newton")
    sums = FactorSums(calls, examples, approximation, single) if factors else None
    squares = ggn_squares(calls, examples) if diagonal else None
    diff = split.diff
    (value, aux), grads = jax.value_and_grad(lambda o, *d: split.loss(o, *d), tuple(range(1 + len(diff))),
                                             has_aux=True)(calls.outs, *diff)
    s, w, scale = all_columns(examples, samples, key, "gauss_newton")
    columns = jax.vmap(examples.unflatten)(s)
    batches = examples.by_call(examples.batches)
    adjoints = lambda o: calls.adjoints(o, batches)
    if current().policy.batched_products_pay(jax.default_backend()):  # one substitution, K + 1 columns
        rhs = jax.tree.map(lambda g, c: jnp.concatenate([g[None].astype(c.dtype), c]), grads[0], columns)
        lams = jax.vmap(adjoints)(rhs)
        first, rest = jax.tree.map(lambda x: x[0], lams), jax.tree.map(lambda x: x[1:], lams)
    else:  # on CPU XLA's batched products are slower than K + 1 plain ones: one after another
        # (one column, the usual K-FAC sample, runs as it is: XLA:CPU's convolutions are several
        # times slower inside a loop's body than outside it)
        single_column = jax.tree.leaves(columns)[0].shape[0] == 1
        rest = (jax.tree.map(lambda x: x[None], adjoints(jax.tree.map(lambda x: x[0], columns))) if single_column
                else jax.lax.map(adjoints, columns))
        first = adjoints(grads[0])
    network = calls.arguments([param_adjoint(plan, prim, lam)
                               for plan, prim, lam in zip(calls.plans, calls.stored, first)])
    grad = tuple(add_trees(g, m) for g, m in zip(grads[1:], network))

    def share(s_k: list, w_k: list, lam_k: list) -> tuple:
        return (None if sums is None else sums.share(s_k, w_k, lam_k),
                None if squares is None else squares[0](s_k, w_k, lam_k))

    summed = jax.tree.map(lambda x: jnp.sum(x, 0) if scale is None else jnp.sum(x, 0) / scale,
                          jax.vmap(share)(s, w, rest))
    found_factors = None if sums is None else sums.assemble(*summed[0])
    found_diagonal = None
    if squares is not None:
        found_diagonal = squares[1](summed[1])
        found_diagonal = found_diagonal[0] if single else found_diagonal
    return OnePass(value, aux, grad, _closed(calls.output_tangents, *diff), _closed(calls.transpose, calls.outs),
                   examples.hvp, calls.outs, found_factors, found_diagonal)


def _closed(fn: Callable, *example: Any) -> jax.tree_util.Partial:
    """``fn`` as a pytree function: its jaxpr, with what it closes over (the stored forward pass,
    tracers under ``jax.jit``) as the Partial's leaves, so that G can cross ``jax.jit``."""
    closed, shape = jax.make_jaxpr(fn, return_shape=True)(*example)
    return jax.tree_util.Partial(functools.partial(_evaluated, closed.jaxpr, jax.tree.structure(shape)),
                                 tuple(closed.consts))


def _evaluated(jaxpr: Any, out_tree: Any, consts: tuple, *args: Any) -> Any:
    return jax.tree.unflatten(out_tree, jax.core.eval_jaxpr(jaxpr, list(consts), *jax.tree.leaves(args)))


def check_one_pass(factors: bool, diagonal: bool, samples: int | None, key: Any, approximation: str, remat: bool,
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
    if samples is None and key is not None:
        raise ValueError("gauss_newton(factors=True / diagonal=True, key=...) without samples=: with no samples= the "
                         "factors and the diagonal come from every exact column of H (one back substitution per "
                         "output coordinate), and the key draws nothing. Pass samples=1 for K-FAC's sampled "
                         "estimator (one column per example, as lbp.kfac uses), or drop key= for the exact columns.")
    if remat or checkpoints is not None:
        raise ValueError("gauss_newton(factors=True / diagonal=True) keeps every layer's residuals (its factors "
                         "are formed from them in one pass): drop remat= and checkpoints=, or call "
                         "gauss_newton(remat=...) and kfac_factors / diag_ggn apart.")
    return True


def run_one_pass(fun: Callable, args: tuple, nums: tuple, single: bool, has_aux: bool, layers: Any, engine: str,
                  factors: bool, diagonal: bool, samples: int | None, key: Any, approximation: str) -> tuple:
    """``gauss_newton(factors=True / diagonal=True)``: value, gradient and G with its factors and
    diagonal from one forward pass and one batched back substitution (`one_pass`)."""
    if layers is None:
        split, found = Split(fun, args, nums, has_aux), None
    else:  # the model as it is, its layers also run on one example (as kfac_factors and diag_ggn)
        found = rewrite(fun, args, nums, layers, per_example="gauss_newton(factors=True / diagonal=True)")

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
            kfac = biases_named_in(found.gradient(kfac, single))
        if diag is not None:
            diag = found.gradient(diag, single)
    G = GaussNewton(jvp, vjp, done.hvp, single, structure_of(grad[0] if single else grad), structure_of(done.outs),
                    value_function(split), done.value, kfac, diag)
    value = (done.value, aux) if has_aux else done.value
    return value, grad[0] if single else grad, G
