"""grad_by_solve, value_and_grad_by_solve, jvp_by_solve: JAX's transforms, with every Network
call differentiated by the linear solve (`_call`: the call's JVP rule is the forward substitution
ℒ Z = ℳ* h + E₀ dU₀, whose transpose is the back substitution).

Because everything is a JVP rule plus transposition, jit, vmap, jvp-of-grad (Hessian-vector
products) and jax.hessian all compose. Outside these transforms a Network call is plain JAX code,
so ``jax.grad`` of the same function is the independent reference. A transform enters the solve
mode with its settings, both context values in jit's key (`_options._settings`), so
``grad_by_solve(jax.jit(f))`` traces ``f`` again instead of reusing a plain trace.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax

from .._capture import rewrite
from .._options import Engine, ParamProducts, Schedule, Settings, solving_with
from ._call import network_call


def solve_mode(fun: Callable, settings: Settings | None = None, /, **options: Any) -> Callable:
    """``fun`` run with Network calls differentiated by the solve (any JAX transform of it, e.g.
    ``jax.linearize``, then uses the solve's rules), with ``settings`` (or ``Settings.of(**options)``:
    the keywords of grad_by_solve, and ``products``: linearised once for many products, which the
    memory rule for checkpoints counts)."""
    return _in_solve_mode(fun, fun, Settings.of(**options) if settings is None else settings)


def _in_solve_mode(transformed: Callable, fun: Callable, settings: Settings) -> Callable:
    @functools.wraps(fun)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with solving_with(settings, network_call):
            return transformed(*args, **kwargs)

    return wrapped


def grad_by_solve(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False, *,
                  remat: bool = False, checkpoints: int | None = None, schedule: Schedule = "even",
                  param_products: ParamProducts = "auto", engine: Engine = "auto", layers: Any = None,
                  **grad_kwargs: Any) -> Callable:
    """Drop-in for ``jax.grad``: every Network call in ``fun`` is differentiated by the solve.

    For a loss J(θ) = ℓ(U(θ), θ) the gradient is ∇_θJ = ℳ Λ + ∇_θℓ, where Λ solves the adjoint
    equation ℒ* Λ = ∇_Uℓ by back substitution (one solve for every parameter direction).
    Network inputs may be differentiated too (``argnums``); several networks, repeated calls and
    direct uses of the parameters (regularisers) add up.

    With ``remat=True`` the forward pass keeps only the states U; the back substitution and ℳ
    re-linearise each layer from its inputs (one more forward evaluation, less memory).

    With ``checkpoints=k`` the forward pass keeps only k states (those where ⌈N/(k+1)⌉-layer
    segments meet, besides inputs and outputs); in reverse mode each segment's states are
    recomputed just before its back substitution. Memory O(k + N/k) states (k ≈ √N: O(√N)),
    time at most one forward pass more. Segments that repeat (an RNN, ``Row``-stacked blocks) run
    as one ``lax.scan``, so the program does not grow with k. ``schedule="nested"`` spends the k
    states on levels of segments within segments instead (d levels of k/d states, d chosen from
    the shapes to keep least; the guide "Sequences and memory" shows how): at most k states kept plus a short
    leaf segment, each layer evaluated d + 1 times — memory like k and recomputations growing like
    log N, the trade-off of the binomial (revolve) schedule; the default ``"even"`` is faster
    where its O(k + N/k) fits. Checkpointing never costs memory:
    where it is not predicted (from the shapes) to keep at most half of what the call keeps
    without, or a pessimistic bound says it may keep more — every state an output, one
    checkpoint, stacked weights larger than the states — the call runs without it.

    ``param_products`` says where ℳΛ is formed: ``"after"`` the back substitution, for all layers
    of a kind at once (one batched product: off the sequential path), or ``"in_loop"``, layer by
    layer inside it, from the same linearisation as the ℒ* block. ``"auto"`` (default) is
    ``"after"`` where the loop runs latency-bound steps (small states), and ``"in_loop"`` with
    ``remat=True`` (it saves re-linearising every layer once more), when the solve is unrolled
    (little to batch) or when steps are compute-bound (batching saves no time, costs memory).
    With ``checkpoints``, short unrolled segments whose layers share their blocks form ℳΛ after
    their substitution whatever ``param_products`` says (it keeps less memory there).

    ``engine``: ``"loop"`` runs the substitutions as ``lax.fori_loop``s over the layers (compiled
    once per kind of layer), ``"unrolled"`` as straight-line code; ``"auto"`` (default) loops when
    kinds repeat (at least 6 layers and 2 per kind on average), else unrolls.

    Args:
        fun: the function to differentiate, as for ``jax.grad``: a scalar of its arguments, the
            Network calls in it differentiated by the solve (elsewhere JAX's own rules).
        argnums: the argument(s) to differentiate, as ``jax.grad``'s.
        has_aux: ``fun`` returns ``(value, aux)``; the gradient comes with ``aux``.
        remat: keep only the states in the forward pass; re-linearise each layer in the back
            substitution.
        checkpoints: keep about this many states; segments between them recomputed.
        schedule: ``"even"`` (segments of equal length) or ``"nested"`` (levels of segments).
        param_products: where ℳΛ is formed: ``"after"``, ``"in_loop"`` or ``"auto"``.
        engine: ``"loop"``, ``"unrolled"`` or ``"auto"``.
        layers: differentiate a model as it is written (a flax nnx, linen or equinox module, a
            plain JAX function): the classes or ``@lbp.layer`` functions whose calls are the
            layers; the gradient comes back in the argument's own type (as ``nnx.grad``,
            ``eqx.filter_grad``). The guide "Your flax / equinox model" shows how.
        **grad_kwargs: passed to ``jax.grad`` (``holomorphic``, ``allow_int``, ``reduce_axes``).

    Returns:
        A function of ``fun``'s arguments returning the gradient (with ``aux`` if ``has_aux``),
            shaped like the differentiated arguments, as ``jax.grad(fun, argnums, has_aux)`` would.

    Raises:
        ValueError: ``layers=`` that finds no call, or a model it cannot take as it is (the
            message names the call and the fix).
        TypeError: ``layers=`` that is neither a class nor an ``@lbp.layer`` function.

    Examples:
        >>> import jax, jax.numpy as jnp, linbackprop as lbp
        >>> layer = lbp.Layer("y", lambda th, x: jnp.tanh(x @ th[0]), ("x",), ("W",))
        >>> net = lbp.Network([layer], inputs=["x"], outputs="y")
        >>> loss = lambda p, x: jnp.sum(net(p, x) ** 2)
        >>> p, x = {"W": jnp.ones((3, 2))}, jnp.ones((4, 3))
        >>> g = lbp.grad_by_solve(loss)(p, x)
        >>> bool(jnp.allclose(g["W"], jax.grad(loss)(p, x)["W"]))
        True
    """
    settings = Settings.of(remat=remat, checkpoints=checkpoints, schedule=schedule, param_products=param_products,
                           engine=engine)
    if layers is not None:
        return _with_layers(fun, argnums, has_aux, layers, settings, grad_kwargs, with_value=False)
    return _in_solve_mode(jax.grad(fun, argnums=argnums, has_aux=has_aux, **grad_kwargs), fun, settings)


def value_and_grad_by_solve(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False, *,
                            remat: bool = False, checkpoints: int | None = None, schedule: Schedule = "even",
                            param_products: ParamProducts = "auto", engine: Engine = "auto", layers: Any = None,
                            **grad_kwargs: Any) -> Callable:
    """Drop-in for ``jax.value_and_grad``, differentiating Network calls by the solve
    (``remat``, ``checkpoints``, ``schedule``, ``param_products`` and ``engine`` as in
    [`grad_by_solve`][linbackprop.grad_by_solve]).

    Args:
        fun: the scalar function, as for ``jax.value_and_grad``.
        argnums: the argument(s) to differentiate.
        has_aux: ``fun`` returns ``(value, aux)``.
        remat: keep only the states; re-linearise in the back substitution.
        checkpoints: keep about this many states, recomputing the segments between them.
        schedule: ``"even"`` or ``"nested"`` checkpoints.
        param_products: where ℳΛ is formed: ``"after"``, ``"in_loop"`` or ``"auto"``.
        engine: ``"loop"``, ``"unrolled"`` or ``"auto"``.
        layers: the classes or ``@lbp.layer`` functions whose calls are the layers of a model
            written as it is (see [`grad_by_solve`][linbackprop.grad_by_solve]).
        **grad_kwargs: passed to ``jax.value_and_grad``.

    Returns:
        A function of ``fun``'s arguments returning ``(value, gradient)`` (``((value, aux),
            gradient)`` with ``has_aux``).

    Raises:
        ValueError: as [`grad_by_solve`][linbackprop.grad_by_solve].

    Examples:
        >>> import jax.numpy as jnp, linbackprop as lbp
        >>> layer = lbp.Layer("y", lambda th, x: x * th[0], ("x",), ("a",))
        >>> net = lbp.Network([layer], ["x"], "y")
        >>> value, grads = lbp.value_and_grad_by_solve(lambda p: net(p, 2.0))({"a": 3.0})
        >>> float(value), float(grads["a"])
        (6.0, 2.0)
    """
    settings = Settings.of(remat=remat, checkpoints=checkpoints, schedule=schedule, param_products=param_products,
                           engine=engine)
    if layers is not None:
        return _with_layers(fun, argnums, has_aux, layers, settings, grad_kwargs, with_value=True)
    return _in_solve_mode(jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux, **grad_kwargs), fun, settings)


def _with_layers(fun: Callable, argnums: int | Sequence[int], has_aux: bool, layers: Any, settings: Settings,
                 grad_kwargs: dict, with_value: bool) -> Callable:
    """grad_by_solve / value_and_grad_by_solve of a model as it is: ``fun`` traced with the calls
    of ``layers`` as the layers of a network (``_capture.rewrite``), differentiated by the solve,
    and the gradient given back in each argument's own type (an nnx module's Param state, an
    equinox module, the pytree); an nnx module's other state (RNG counts) is updated as nnx.grad
    updates it."""
    single = isinstance(argnums, int)
    nums = (argnums,) if single else tuple(argnums)

    @functools.wraps(fun)
    def run(*args: Any) -> Any:
        found = rewrite(fun, args, nums, layers)

        def split_aux(*parts: Any) -> tuple:
            result, states = found.fun(*parts)
            value, aux = result if has_aux else (result, None)
            return value, (aux, states)

        grad = jax.value_and_grad(split_aux, tuple(range(len(nums))), has_aux=True, **grad_kwargs)
        (value, (aux, states)), grads = _in_solve_mode(grad, split_aux, settings)(*found.args)
        found.write_back(states)
        grads = found.gradient(grads, single)
        if with_value:
            return ((value, aux) if has_aux else value), grads
        return (grads, aux) if has_aux else grads

    return run


def jvp_by_solve(fun: Callable, primals: Sequence[Any], tangents: Sequence[Any], has_aux: bool = False, *,
                 engine: Engine = "auto", layers: Any = None) -> tuple:
    """Drop-in for ``jax.jvp``: Network calls are differentiated by forward substitution
    ℒ Z = ℳ* h (+ the input tangents), first layer to last (``engine`` as in
    [`grad_by_solve`][linbackprop.grad_by_solve]).

    Row i of the substitution needs only layer i's linearisation, so it runs inside the forward
    loop (one JVP per layer, nothing stored). Reverse mode of the result (``jax.grad`` of it)
    differentiates that loop with JAX's rules; for gradients use [`grad_by_solve`][linbackprop.grad_by_solve], whose
    forward rule stays a transposable linear solve.

    Args:
        fun: the function, as for ``jax.jvp``.
        primals: its arguments.
        tangents: one tangent per argument, shaped like it.
        has_aux: ``fun`` returns ``(out, aux)``; ``aux`` comes back third.
        engine: ``"loop"``, ``"unrolled"`` or ``"auto"``.
        layers: the classes or ``@lbp.layer`` functions whose calls are the layers of a model
            written as it is.

    Returns:
        ``(fun(*primals), the tangent of the output)``, as ``jax.jvp`` (and ``aux`` with
            ``has_aux``).

    Examples:
        >>> import jax.numpy as jnp, linbackprop as lbp
        >>> layer = lbp.Layer("y", lambda th, x: x * th[0], ("x",), ("a",))
        >>> net = lbp.Network([layer], ["x"], "y")
        >>> y, dy = lbp.jvp_by_solve(lambda p: net(p, 2.0), ({"a": 3.0},), ({"a": 1.0},))
        >>> float(y), float(dy)
        (6.0, 2.0)
    """
    if layers is not None:
        found = rewrite(fun, tuple(primals), tuple(range(len(primals))), layers)
        rest = found.args[-1]
        leaves = [list(a.leaves_of(t)) for a, t in zip(found.arguments, tangents)]
        inner = lambda *diffs: found.fun(*diffs, rest)[0]
        with solving_with(Settings(engine=engine, forward_only=True), network_call):
            return jax.jvp(inner, tuple(found.args[:-1]), tuple(leaves), has_aux=has_aux)
    with solving_with(Settings(engine=engine, forward_only=True), network_call):
        return jax.jvp(fun, primals, tangents, has_aux=has_aux)
