"""How a network call's linear part is solved: one object per variant, chosen once by
`solve_variant` (`_choice`) from the plan, the settings and whether the parameters' tangents move,
and passed whole to the solve primitive (`_primitive`), which binds it as its parameter and asks
it for its solve, its transpose and its products. Nothing below the choice decides again.

The variants, one module each:

    StatesOnly     ℒ Z = E₀ dU₀                       no parameter tangent: ℳ never applied
    ParamsBefore   ℒ Z = ℳ* h + E₀ dU₀, ℳ* h batched per kind before the solve (the unrolled
                   engine); JAX transposes that product into ℳΛ after the back substitution
    ParamsInLoop   [[I, 0], [−ℳ*, ℒ]] (h, Z) = (h, E₀ dU₀): ℳ* h formed in the forward loop,
                   ℳΛ accumulated in the back substitution
    ParamsAfter    the same joint system, ℳ* h batched per kind before a compact loop and ℳΛ
                   after the back substitution, batched per kind
    InForwardSweep jvp_by_solve alone: the forward substitution inside the forward sweep, one
                   JVP per layer, nothing stored and nothing transposed

The layouts: ``compact`` (the loop engine: Z only at the rows read again, a chain carrying Z_i
from step to step; the unrolled engine keeps every row as a value XLA drops where unread). A
compact solve is x = P ℒ⁻¹ E Eᵀ b: b read at the input rows (E), the solution at the compact rows
(P; its pad row zero); transposed, Eᵀ ℒ⁻* Pᵀ. Each threshold is the `Policy`'s.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from collections.abc import Callable
from typing import Any, ClassVar

from .._engine import Primal, at_inputs, take_rows, without_pad
from .._options import Settings
from .._plan import Plan
from ._boundary import (
    anchor,
    input_tangents,
    instantiate,
    is_zero,
    output_tangents,
    outputs_of,
    prepare,
    zeros_made_with,
)


@dataclasses.dataclass(frozen=True, repr=False)
class SolveVariant(abc.ABC):
    """How one network call's linear part is solved (see the module's docstring).

    Attributes:
        plan: the call's plan (the engine's choice among them: ``plan.unrolled``).
    """

    plan: Plan

    @property
    def engine(self) -> str:
        """The engine the plan was made for: ``"loop"`` or ``"unrolled"``."""
        return "unrolled" if self.plan.unrolled else "loop"

    def __repr__(self) -> str:  # as printed in jaxprs
        net = self.plan.net
        return f"{type(self).__name__}({len(net.layers)} layers, outputs {list(net.outputs)!r}{self._extra()})"

    def _extra(self) -> str:
        return ""

    @abc.abstractmethod
    def jvp(self, theta: dict, inputs: tuple, dtheta: dict, dinputs: tuple,
            settings: Settings) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """The call's outputs and their tangents 𝒫 Z, ℒ Z = ℳ* h + E₀ dU₀ (the network call's
        JVP rule)."""

    def least_kept(self, states: int, residuals: int) -> int:
        """Bytes a call that stores its linearisation keeps at its least (``states``: one of every
        state; ``residuals``: the stored linearisation's) — the memory model's count: the
        states, the residuals and Λ at every row."""
        return 2 * states + residuals


@dataclasses.dataclass(frozen=True, repr=False)
class StoredSolve(SolveVariant):
    """A variant that stores the forward pass's linearisation and solves on it as the solve
    primitive (`_primitive`), which binds it as its parameter together with the pytree
    structures of the linearisation's and of b's leaves (``prim_tree``, ``b_tree``: None before
    the bind)."""

    prim_tree: Any = None
    b_tree: Any = None

    joint: ClassVar[bool] = False  # the system over (h, Z): b = (h, rhs)
    moves_params: ClassVar[bool] = False  # h enters the solve (ℳ* h formed)

    @property
    def compact(self) -> bool:
        """Z in the layout of ``plan.compact`` (the loop engine's)."""
        return False

    @property
    def layout(self) -> Plan:
        """The layout of Z."""
        return self.plan.compact if self.compact else self.plan

    @property
    def rhs_layout(self) -> Plan:
        """The layout of the right-hand side."""
        return self.layout

    def _extra(self) -> str:
        return (", joint" if self.joint else "") + (", compact" if self.compact else "")

    # What the solve primitive asks (flat trees in, flat trees out: ``_primitive._apply``).

    @abc.abstractmethod
    def solve(self, prim: Primal, b: Any, transposed: bool) -> Any:
        """x = A⁻¹ b (``transposed``: A⁻* b)."""

    @abc.abstractmethod
    def product(self, prim: Primal, x: Any, transposed: bool) -> Any:
        """A x (``transposed``: A* x) in the full layout: the product the JVP rule differentiates
        along a moving linearisation (a compact variant's rule moves to `in_full_layout` first)."""

    def in_full_layout(self) -> StoredSolve | None:
        """The same system with every row kept, for the JVP rule where the linearisation moves
        (Ȧ x needs the whole solution x); None where this one keeps every row."""
        return None

    def layouts(self, transposed: bool) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
        """(b -> the full-layout system's b, the full-layout system's solution -> x)."""
        raise AssertionError(f"{self!r} keeps every row")

    def reshapes(self, transposed: bool) -> bool:
        """Whether x is laid out otherwise than b (else x is shaped like b)."""
        return False

    # What the call's JVP rule and the curvature transforms run.

    @abc.abstractmethod
    def bind(self, prim: Primal, h: list[Any] | None, rhs: list[Any]) -> list[Any]:
        """Z (in ``layout``) with ℒ Z = rhs + ℳ* h (without h: ℒ Z = rhs), rhs in ``rhs_layout``:
        differentiable in (h, rhs) — its transpose the back substitution, with ℳΛ — and in the
        linearisation."""

    def stored_tangents(self, prim: Primal, dtheta: dict, dinputs: tuple) -> tuple[Any, ...]:
        """The output items' tangents 𝒫 Z on a stored forward pass ``prim``."""
        rhs = input_tangents(self.rhs_layout, dinputs)
        h = None
        if self.moves_params:  # groups without input tangents: zeros made in the linear program
            given = {self.rhs_layout.state_loc[name][0] for name, dx in zip(self.plan.net.inputs, dinputs)
                     if not is_zero(dx)}
            rhs = zeros_made_with(anchor(dtheta, dinputs), rhs, keep=given)
            h = self.plan.pack_params(instantiate(dtheta), tangent=True)
        # Parts of rhs built from symbolic zeros alone are constants: the solve's transpose gives
        # them no cotangent (see _primitive).
        return output_tangents(self.layout, self.bind(prim, h, rhs))

    def jvp(self, theta: dict, inputs: tuple, dtheta: dict, dinputs: tuple,
            settings: Settings) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """The forward pass with residuals, then the transposable solve (`stored_tangents`)."""
        prim = prepare(self.plan.net, theta, inputs, settings)[1]
        return outputs_of(self.plan, prim.states), self.stored_tangents(prim, dtheta, dinputs)


def _state_part(variant: StoredSolve, fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``fn`` applied to the state-layout part of a right-hand side or solution."""
    if variant.joint:
        return lambda b: (b[0], fn(b[1]))
    return fn


def compact_layouts(variant: StoredSolve, transposed: bool, rhs_full: bool = False
                    ) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
    """For a compact ``variant``, (its b -> the full system's b, the full system's solution -> its
    solution): the solve is P ℒ⁻¹ E Eᵀ b (transposed: Eᵀ ℒ⁻* Pᵀ b), with ``rhs_full`` (b read at
    every row) P ℒ⁻¹ b (transposed: ℒ⁻* Pᵀ b)."""
    zplan = variant.plan.compact
    to_full = functools.partial(take_rows, tables=zplan.to_compact)  # a compact row per full row
    to_compact = functools.partial(take_rows, tables=zplan.to_full)
    if transposed:  # Pᵀ b (the pad row is no row of the solution); Eᵀ at the input rows
        return (_state_part(variant, lambda b: to_full(without_pad(zplan, b))),
                _state_part(variant, lambda x: x if rhs_full else at_inputs(zplan, to_compact(x))))
    return (_state_part(variant, lambda b: b if rhs_full else to_full(at_inputs(zplan, b))),
            _state_part(variant, lambda x: without_pad(zplan, to_compact(x))))
