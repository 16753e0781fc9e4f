"""``gauss_newton``: the value, the gradient and G = J* H J of ``fun`` from one forward pass —
``jax.linearize`` of its network calls in solve mode (J; J* its transpose), or, with
``factors=`` / ``diagonal=``, the one pass of `_one_pass` that also gives K-FAC's factors and
the GGN diagonal.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp

from .._capture import rewrite
from .._options import Engine, ParamProducts, Schedule
from .._solve import solve_mode
from ._one_pass import check_one_pass, run_one_pass
from ._operator import GaussNewton, structure_of, value_function
from ._split import OnArguments, Split, add_trees, normalise_argnums


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

    **In one pass** (``factors=True`` and/or ``diagonal=True``): the value, the gradient, G,
    K-FAC's factors ``G.factors`` and the GGN diagonal ``G.diagonal`` come from ONE forward pass
    with residuals and one back substitution over [the gradient's cotangent, H's columns]
    (right-hand sides of the same ℒ*: one vmapped substitution off CPU; on CPU, where XLA's
    batched products measured slower, K + 1 substitutions of the same stored pass one after
    another), where ``gauss_newton`` and ``kfac_factors`` apart make two forward passes. ``G.value``
    is the loss; [`kfac`][linbackprop.kfac]'s ``update(grad, state, params, curvature=G)`` takes
    the factors, the value and ``value_fn=G.value_at`` from it. The networks' inputs must be data
    (as for ``kfac_factors``), and the residuals are kept (no ``remat`` or ``checkpoints``).

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
        factors: also K-FAC's factors, ``G.factors`` (what
            [`kfac_factors`][linbackprop.kfac_factors] gives with the same ``samples``, ``key``
            and ``approximation``), from the same pass.
        diagonal: also diag G, ``G.diagonal`` (what [`diag_ggn`][linbackprop.diag_ggn] gives
            with the same ``samples`` and ``key``), from the same pass.
        samples: with ``factors`` or ``diagonal``: None (H's exact columns) or M sampled
            columns per example.
        key: the PRNG key of the samples (a fresh one each step).
        approximation: the factors' ``"expand"`` or ``"reduce"``, as ``kfac_factors``.

    Returns:
        A function of ``fun``'s arguments returning ``(value, grad, G)``: ``G`` a
            [`GaussNewton`][linbackprop.GaussNewton] (``mv``, ``gram``, ``todense()``,
            ``factor()``), a pytree that a jitted function may return.

    Raises:
        ValueError: a loss that calls no network (name the layers with ``layers=``); ``samples``
            or ``key`` without ``factors`` or ``diagonal``; ``remat`` or ``checkpoints`` with
            them; ``samples`` without ``key``, or ``key`` without ``samples``.

    Examples:
        >>> import jax.numpy as jnp, linbackprop as lbp
        >>> layer = lbp.Layer("y", lambda th, x: x @ th[0], ("x",), ("W",))
        >>> net = lbp.Network([layer], ["x"], "y")
        >>> loss = lambda p, x: 0.5 * jnp.sum(net(p, x) ** 2)
        >>> value, grad, G = lbp.gauss_newton(loss)({"W": jnp.ones((2, 1))}, jnp.eye(2))
        >>> G.todense().tolist()          # J* J for the linear model: x*x = I
        [[1.0, 0.0], [0.0, 1.0]]
        >>> _, _, G = lbp.gauss_newton(loss, factors=True)({"W": jnp.ones((2, 1))}, jnp.eye(2))
        >>> G.factors["W"].left.tolist(), float(G.value)   # A = (1/2) Σ x xᵀ, ½ Σ ‖x W‖²
        ([[0.5, 0.0], [0.0, 0.5]], 1.0)
    """
    nums, single = normalise_argnums(argnums)
    settings = dict(remat=remat, checkpoints=checkpoints, schedule=schedule, param_products=param_products,
                    engine=engine)
    in_one_pass = check_one_pass(factors, diagonal, samples, key, approximation, remat, checkpoints)

    def run(*args: Any) -> tuple[Any, Any, GaussNewton]:
        if in_one_pass:
            return run_one_pass(fun, args, nums, single, has_aux, layers, engine, factors, diagonal, samples, key,
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
        G = GaussNewton(jvp, vjp, hvp, single, structure_of(grad[0] if single else grad), structure_of(outs),
                        value_function(split), value)
        value = (value, aux) if has_aux else value
        return value, grad[0] if single else grad, G

    return run
