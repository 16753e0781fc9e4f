"""The forward-Laplacian lift of a Network: each state U becomes (U, ∇U, ΔU) with respect to the
coordinates x of one input, each layer propagating the three from its own function.

With Φ a layer and its inputs V = (v, ∇v, Δv) (∇ along the coordinates e_1 … e_d),

    U = Φ(v),   ∇U·e_k = DΦ[∇v·e_k],   ΔU = DΦ[Δv] + Σ_k D²Φ[∇v·e_k, ∇v·e_k]

(the chain rule twice): d + 1 directional derivatives and d second ones, from nested
``jax.jvp`` of the layer function. The lifted network is a Network like any other: its
parameters are the original blocks, each used three times per layer (on U, on ∇U, on ΔU) —
the weight sharing a physics-informed network's operator consists of, which the solve, the
Gauss–Newton products and K-FAC ("expand") handle as they handle an RNN's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp

from ._layer import GraphError, Layer, Row
from ._network import Network


def forward_laplacian(net: Network, coordinates: Hashable | None = None,
                      second: tuple[float, ...] | None = None) -> Network:
    r"""``net`` with every state lifted to ``(U, ∇U, ΔU)`` w.r.t. the input ``coordinates`` (the
    first input by default), a [B, d] batch of points x: the lifted network takes the same
    inputs and returns ``(u, grad, lap)`` per output, ``grad`` with a trailing axis of length d
    ($\partial u/\partial x_k$) and ``lap`` shaped like u ($\sum_k \partial^2 u/\partial x_k^2$). Other inputs are
    constants. With ``second=(c_1, …, c_d)``, ``lap`` is the chosen second derivatives
    $\sum_k c_k \partial^2 u/\partial x_k^2$ instead: ``second=(1, 0)`` on points (x, t) gives
    $u_{xx}$ beside $(u_x, u_t)$ — what Burgers' $u_t + u u_x - \nu u_{xx}$ reads.

    $$U = \Phi(\theta, v), \qquad \nabla U = D\Phi[\nabla v], \qquad
    \Delta U = D\Phi[\Delta v] + \sum_k D^2\Phi[\partial_k v, \partial_k v]$$

    per layer from its own function (nested ``jax.jvp``), starting from (x, I, 0). Each layer
    must act on each example alone (a dense layer, a norm over features; not a batch norm): the
    derivatives are taken for all points at once. The lifted layers keep their names and
    parameter blocks, so ``grad_by_solve``, ``gauss_newton``, ``kfac_factors`` and the optax
    transforms apply as to any Network: a physics-informed network's loss ½‖Δu + f‖² is a loss
    of its outputs.

    Args:
        net: the network; each layer acting on each example alone.
        coordinates: the input holding the [B, d] points (the first input if None).
        second: the weights $c_k$ of the second derivatives summed into ``lap`` (None: all ones,
            the Laplacian); their length is d.

    Returns:
        The lifted [`Network`][linbackprop.Network]: the same inputs, ``(u, grad, lap)`` per
            output.

    Raises:
        GraphError: ``coordinates`` not an input, a layer reading rows of them or no state that
            depends on them, or an output that is an input.
        ValueError: (when called) coordinates that are not a [B, d] batch of points.

    Examples:
        >>> import jax.numpy as jnp, linbackprop as lbp
        >>> squares = lambda th, x: jnp.sum(x ** 2, -1, keepdims=True) * th[0]
        >>> net = lbp.Network([lbp.Layer("u", squares, ("x",), ("a",))], ["x"], "u")
        >>> lifted = lbp.forward_laplacian(net)
        >>> u, grad, lap = lifted({"a": jnp.array(3.0)}, jnp.array([[1.0, 2.0]]))
        >>> u.tolist(), grad.tolist(), lap.tolist()        # 3|x|²: 6x, and Δ = 3 · 2 · 2
        ([[15.0]], [[[6.0, 12.0]]], [[12.0]])
    """
    coordinates = net.inputs[0] if coordinates is None else coordinates
    if coordinates not in net.inputs:
        raise GraphError(f"forward_laplacian(coordinates={coordinates!r}): not an input of the network; its inputs "
                         f"are {list(net.inputs)!r}.")
    start = ("forward_laplacian", coordinates)
    if any(layer.name == start for layer in net.layers):
        raise GraphError(f"forward_laplacian: a layer is already named {start!r}; rename it.")
    lifted = {start, *(layer.name for layer in net.layers)}
    weights = None if second is None else tuple(float(c) for c in second)
    layers = [Layer(start, _lift_coordinates if weights is None else _coordinates_of(len(weights)), (coordinates,))]
    for layer in net.layers:
        for read in layer.reads:
            if isinstance(read, Row) and read.block == coordinates:
                raise GraphError(f"forward_laplacian: layer {layer.name!r} reads {read!r}, a row of the coordinates; "
                                 "the coordinates must be one [B, d] state.")
        reads = tuple(start if read == coordinates else read for read in layer.reads)
        mask = tuple(not isinstance(read, Row) and read in lifted for read in reads)
        if not any(mask):
            raise GraphError(f"forward_laplacian: layer {layer.name!r} reads no state that depends on the coordinates "
                             f"{coordinates!r}; make it read them or a layer that does.")
        layers.append(Layer(layer.name, _lifted(layer.fn, mask, weights), reads, layer.params))
    spec = net.output_spec
    for item in spec:
        for name in getattr(item, "names", (item,)):
            if name in net.inputs:
                raise GraphError(f"forward_laplacian: output {name!r} is an input, not a layer; lift layers only.")
    return Network(layers, net.inputs, spec[0] if net.single_output else list(spec))


def _lift_coordinates(theta: tuple, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(x, ∇x, Δx) = (x, I, 0) for points x of shape [B, d]."""
    del theta
    if jnp.ndim(x) != 2:
        raise ValueError(f"forward_laplacian: the coordinates must be a [B, d] batch of points, got shape "
                         f"{jnp.shape(x)}.")
    eye = jnp.broadcast_to(jnp.eye(x.shape[-1], dtype=x.dtype), (*x.shape, x.shape[-1]))
    return x, eye, jnp.zeros_like(x)


@functools.lru_cache(maxsize=64)
def _coordinates_of(d: int) -> Callable:
    """`_lift_coordinates` that checks the points have the d coordinates ``second=`` weights."""

    def lift(theta: tuple, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        if jnp.ndim(x) == 2 and x.shape[-1] != d:
            raise ValueError(f"forward_laplacian(second=...): {d} weights for points of {x.shape[-1]} coordinates.")
        return _lift_coordinates(theta, x)

    return lift


@functools.lru_cache(maxsize=1024)
def _lifted(fn: Callable, mask: tuple[bool, ...], weights: tuple[float, ...] | None = None) -> Callable:
    """The layer function on lifted inputs (triples where ``mask`` is True, constants elsewhere);
    ``weights``: c_k of the second derivatives summed (None: all ones). Cached: one original
    function gives one lifted function (kinds stay merged)."""

    def lifted(theta: tuple, *inputs: Any) -> tuple[Any, Any, Any]:
        values = [v[0] if m else v for v, m in zip(inputs, mask)]
        at = [n for n, m in enumerate(mask) if m]

        def phi(*varying: Any) -> Any:
            full = list(values)
            for n, v in zip(at, varying):
                full[n] = v
            return fn(theta, *full)

        primal = tuple(values[n] for n in at)
        grads = tuple(inputs[n][1] for n in at)
        laps = tuple(inputs[n][2] for n in at)
        out, first = jax.jvp(phi, primal, laps)
        if all(mask):  # every input lifted: the d directions folded into the batch
            grad, second = _along_directions_as_examples(phi, primal, grads, weights)
        else:  # a constant input may or may not carry the batch: the directions vmapped
            def along(tangent: tuple) -> tuple[Any, Any]:
                return jax.jvp(lambda *v: jax.jvp(phi, v, tangent)[1], primal, tangent)

            grad, second = jax.vmap(along, in_axes=-1, out_axes=-1)(grads)
            second = jax.tree.map(lambda s: _summed(s, -1, weights), second)
        lap = jax.tree.map(jnp.add, first, second)
        return out, grad, lap

    lifted.__name__ = f"laplacian_of_{getattr(fn, '__name__', 'layer')}"
    return lifted


def _summed(a: jax.Array, axis: int, weights: tuple[float, ...] | None) -> jax.Array:
    """Σ_k a_k along ``axis``, or Σ_k c_k a_k with the weights c."""
    if weights is None:
        return jnp.sum(a, axis=axis)
    return jnp.tensordot(jnp.moveaxis(a, axis, -1), jnp.asarray(weights, a.dtype), axes=1)


def _along_directions_as_examples(phi: Callable, primal: tuple, grads: tuple,
                                  weights: tuple[float, ...] | None = None) -> tuple[Any, Any]:
    """(DΦ[∂_k v])_k with a trailing axis k, and Σ_k D²Φ[∂_k v, ∂_k v], for a Φ that acts on each
    example alone: the d directions become d copies of the batch, [d·B, ...], and one nested
    ``jax.jvp`` takes them all. The same numbers as ``jax.vmap`` over k, but every product stays
    a plain batched one: vmapped over a trailing axis, the reverse pass of the nested jvp
    compiled to products XLA:CPU runs slowly (the 2-64-1 Poisson PINN's value and gradient:
    6.2 ms against 1.0 ms; the numbers are in the training guide)."""
    d = jax.tree.leaves(grads)[0].shape[-1]
    fold = lambda a: jnp.moveaxis(a, -1, 0).reshape(d * a.shape[0], *a.shape[1:-1])
    copies = lambda a: jnp.broadcast_to(a, (d, *a.shape)).reshape(d * a.shape[0], *a.shape[1:])
    tangents = jax.tree.map(fold, grads)
    grad, second = jax.jvp(lambda *v: jax.jvp(phi, v, tangents)[1], jax.tree.map(copies, primal), tangents)
    split = lambda a: a.reshape(d, a.shape[0] // d, *a.shape[1:])
    return (jax.tree.map(lambda a: jnp.moveaxis(split(a), 0, -1), grad),
            jax.tree.map(lambda a: _summed(split(a), 0, weights), second))
