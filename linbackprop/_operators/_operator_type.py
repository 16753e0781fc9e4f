"""The one operator type, `LinearOperator` (products, adjoint, solve where invertible, dense
matrix, blocks), and `Block`, one block of an operator as a linear map with its adjoint
(`IdentityBlock`: ℒ's diagonal, which solves by returning its right-hand side).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree


class LinearOperator(abc.ABC):
    r"""A linear map between spaces of named vectors: the one operator type of linbackprop, in the
    spirit of lineax's ``AbstractLinearOperator``. ℒ, ℳ, their adjoints and each of their blocks
    are ``LinearOperator`` objects:

    - ``mv(x)``: the product; ``T``: the adjoint (``op.T.T`` acts as ``op``);
    - ``solve(b)``: x with ``op.mv(x) == b``, where ``op`` is invertible (ℒ and ℒ* by forward and
      back substitution, the identity blocks); elsewhere a ``NotImplementedError`` that says so;
    - ``todense()``: the dense matrix (tiny networks), inputs and outputs flattened in C order;
    - ``pattern``: a bool array, True where a block is stored; ``block(i, j)``: one block.

    Attributes:
        T: the adjoint operator.
        pattern: a bool array over the blocks, True where one is stored.

    Examples:
        >>> import jax.numpy as jnp, linbackprop as lbp
        >>> net = lbp.Network([lbp.Layer(1, lambda th, x: x @ th[0], (0,), ("W",)),
        ...                    lbp.Layer(2, lambda th, u: 2.0 * u, (1,))],
        ...                   inputs=[0], outputs=2)
        >>> lin = lbp.linearize(net, {"W": jnp.eye(2)}, jnp.ones((1, 2)))
        >>> ops = (lin.L, lin.M.T, lin.L.block(2, 1))
        >>> all(isinstance(op, lbp.LinearOperator) for op in ops)
        True
        >>> lin.L.block(2, 1).todense().tolist()             # −∂Φ₂/∂U₁ = −2 I
        [[-2.0, -0.0], [-0.0, -2.0]]
    """

    @abc.abstractmethod
    def mv(self, x: Any) -> Any:
        """The product of the operator with ``x``.

        Args:
            x: a vector of the operator's domain, a pytree shaped as its columns (a dict over
                states or blocks for ℒ and ℳ, the parameters' tree for G).

        Returns:
            The product, shaped as the operator's rows.
        """

    @property
    @abc.abstractmethod
    def T(self) -> LinearOperator:  # noqa: N802 - the mathematical name
        """The adjoint."""

    def solve(self, b: Any) -> Any:
        """x with ``self.mv(x) == b``; only invertible operators have one.

        Args:
            b: a right-hand side shaped as the operator's rows.

        Returns:
            x, shaped as its columns.

        Raises:
            NotImplementedError: the operator is not invertible (ℳ, ℳ*, off-diagonal blocks).
        """
        name = getattr(self, "symbol", type(self).__name__)
        raise NotImplementedError(f"{name} is not invertible: only ℒ, ℒ* (lin.L, lin.L.T) and identity blocks "
                                  "have solve.")

    @abc.abstractmethod
    def todense(self) -> jax.Array:
        """The dense matrix."""

    @property
    @abc.abstractmethod
    def pattern(self) -> np.ndarray:
        """True where a block is stored."""

    @abc.abstractmethod
    def block(self, i: Hashable, j: Hashable) -> LinearOperator:
        """Block (i, j).

        Args:
            i: the block row's name (a state, or a parameter block for ℳ).
            j: the block column's name.

        Returns:
            The block as an operator of its own (with ``mv``, ``T``, ``todense``).

        Raises:
            KeyError: the block is not stored (zero), or a single block's operator is asked for
                another.
        """


def dense_matrix(fn: Callable[[Any], Any], example: Any) -> jax.Array:
    """The matrix of the linear ``fn`` at inputs shaped like ``example`` (flattened, C order)."""
    flat, unravel = ravel_pytree(example)
    return jax.jit(jax.jacfwd(lambda v: ravel_pytree(fn(unravel(v)))[0]))(jnp.zeros_like(flat))


class Block(LinearOperator):
    r"""One block of ℒ or ℳ*: a linear map together with its adjoint (as in the seed).

    ``block.mv(x)`` applies the block, ``block.T.mv(y)`` its adjoint: for ℒ block (i, j),
    $-\partial\Phi_i/\partial U_j$ and its transpose; for ℳ block (k, i),
    $\Lambda_i \mapsto (\partial\Phi_i/\partial\theta_k)^* \Lambda_i$ and $\partial\Phi_i/\partial\theta_k$.

    Attributes:
        T: the adjoint block.
        pattern: a 1 × 1 bool array (one stored block).

    Examples:
        >>> import jax.numpy as jnp, linbackprop as lbp
        >>> net = lbp.Network([lbp.Layer(1, lambda th, x: x @ th[0], (0,), ("W",)),
        ...                    lbp.Layer(2, lambda th, u: 2.0 * u, (1,))],
        ...                   inputs=[0], outputs=2)
        >>> lin = lbp.linearize(net, {"W": jnp.eye(2)}, jnp.ones((1, 2)))
        >>> lin.L.block(2, 1).mv(jnp.ones((1, 2))).tolist()   # −∂Φ₂/∂U₁ = −2 I
        [[-2.0, -2.0]]
        >>> lin.L.block(2, 1).T.mv(jnp.ones((1, 2))).tolist()
        [[-2.0, -2.0]]
    """

    def __init__(self, symbol: str, row: Hashable, col: Hashable, fn: Callable, adjoint: Callable,
                 col_example: Any, row_example: Any):
        self.symbol, self.row, self.col = symbol, row, col
        self._fn, self._adjoint = fn, adjoint
        self._col_example, self._row_example = col_example, row_example

    def mv(self, x: Any) -> Any:
        return self._fn(x)

    @property
    def T(self) -> Block:  # noqa: N802 - the mathematical name
        symbol = self.symbol[:-1] if self.symbol.endswith("′") else self.symbol + "′"
        return type(self)(symbol, self.col, self.row, self._adjoint, self._fn, self._row_example, self._col_example)

    def todense(self) -> jax.Array:
        return dense_matrix(self.mv, self._col_example)

    @property
    def pattern(self) -> np.ndarray:
        return np.ones((1, 1), dtype=bool)

    def block(self, i: Hashable, j: Hashable) -> Block:
        if (i, j) != (self.row, self.col):
            raise KeyError(f"{self!r} has the single block ({self.row!r}, {self.col!r}), not ({i!r}, {j!r}).")
        return self

    def __repr__(self) -> str:
        return f"{self.symbol}[{self.row!r}, {self.col!r}]"


class IdentityBlock(Block):
    """A diagonal block of ℒ: the identity, which solves by returning its right-hand side."""

    def solve(self, b: Any) -> Any:
        return b
