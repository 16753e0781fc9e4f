"""How a Network call runs: one frozen value of options, the function that solves a call (none:
plain JAX code), and the handler a curvature transform splits a function with (none: the call runs).

All three are context values that JAX keys its caches on (``jax.make_user_context``: part of
jit's key and of the trace context), so ``grad_by_solve(jax.jit(f))`` traces ``f`` again in solve
mode instead of reusing a plain trace, a function traced with one set of options is not reused
for another, and a jit traced while a function was being split is not reused outside the split.
A transform enters the solve once (`solving_with`, naming the function that solves a call);
``Network.__call__`` reads the handler and the solver (`call_handler`, `solver`), everything below
reads `current` once, where JAX calls in (a network call, its JVP rule), and passes it down.
Nothing is installed at import: the graph, the layer below the solve, learns how to call from
these values alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, Literal, get_args

import jax

from ._policy import POLICY, Policy

Engine = Literal["auto", "loop", "unrolled"]
Schedule = Literal["even", "nested"]
ParamProducts = Literal["auto", "after", "in_loop"]
ENGINES: tuple[str, ...] = get_args(Engine)
SCHEDULES: tuple[str, ...] = get_args(Schedule)
PARAM_PRODUCTS: tuple[str, ...] = get_args(ParamProducts)


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}.")


@dataclasses.dataclass(frozen=True)
class Settings:
    """The options of a solve (see ``grad_by_solve`` for the public ones).

    Attributes:
        engine: how the substitutions run: ``lax.fori_loop`` s over kinds, straight-line code, or
            chosen from the shapes.
        remat: keep only the states; re-linearise each layer in the substitutions and products.
        checkpoints: states kept by checkpointed calls (0: every state).
        schedule: how checkpointed calls place their states.
        param_products: where ℳΛ (and ℳ* h) is formed.
        forward_only: ``jvp_by_solve``, whose tangents are never transposed: one fused forward sweep.
        products: the calls are linearised once for many products with their Jacobians
            (``gauss_newton``; the checkpoint memory rule counts them).
        segments: the calls traced are segments of a checkpointed call (memory was asked for).
        policy: the thresholds of the measured rules (`Policy`). Not an option of the transforms:
            each transform takes the policy in force where it is called (`using` injects one).
        capture: the state of the capture being traced (`_capture`'s ``Capturing``, compared by
            identity; None: none). Part of jit's key: a ``jax.jit`` of the user's around the
            model, traced before without capturing, is traced again with its layer calls marked.
    """

    engine: Engine = "auto"
    remat: bool = False
    checkpoints: int = 0
    schedule: Schedule = "even"
    param_products: ParamProducts = "auto"
    forward_only: bool = False
    products: bool = False
    segments: bool = False
    policy: Policy = POLICY
    capture: Any = None

    def __post_init__(self) -> None:
        _check_choice("param_products", self.param_products, PARAM_PRODUCTS)
        _check_choice("engine", self.engine, ENGINES)
        _check_choice("schedule", self.schedule, SCHEDULES)
        k = self.checkpoints
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise ValueError(f"checkpoints must be a positive int (the number of states kept) or None, got {k!r}.")
        object.__setattr__(self, "remat", bool(self.remat))

    @classmethod
    def of(cls, *, checkpoints: int | None = None, schedule: str = "even", **options: Any) -> Settings:
        """Settings from a transform's keywords (``checkpoints=None``: every state kept)."""
        if schedule != "even" and checkpoints is None:
            raise ValueError(f"schedule={schedule!r} places checkpoints: give their number, checkpoints=k.")
        if checkpoints is not None and (not isinstance(checkpoints, int) or isinstance(checkpoints, bool)
                                        or checkpoints < 1):
            raise ValueError(f"checkpoints must be a positive int (the number of states kept) or None, "
                             f"got {checkpoints!r}.")
        return cls(checkpoints=checkpoints or 0, schedule=schedule, **options)

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)


def context_value(default: Any) -> Any:
    """A value keyed into JAX's caches (``jax.make_user_context``: JAX ≥ 0.10, as required)."""
    return jax.make_user_context(default)


NetworkCall = Callable[[Any, Any, tuple[Any, ...]], Any]
"""How a Network call runs instead of plainly: ``call(net, params, inputs)``."""

_SOLVER = context_value(None)  # the NetworkCall that solves (the transforms'), or None: plain JAX code
_HANDLER = context_value(None)  # the NetworkCall marking calls for the curvature split, or None
_SETTINGS = context_value(Settings())


def solving() -> bool:
    """True inside grad_by_solve / value_and_grad_by_solve / jvp_by_solve, where a Network call
    is differentiated by the solve (elsewhere it is plain JAX code).

    Returns:
        Whether the code running now is traced inside one of the transforms.

    Examples:
        >>> import linbackprop as lbp
        >>> seen = []
        >>> _ = lbp.grad_by_solve(lambda x: seen.append(lbp.solving()) or x * x)(1.0)
        >>> lbp.solving(), seen
        (False, [True])
    """
    return _SOLVER.value is not None


def solver() -> NetworkCall | None:
    """The function that runs a Network call in solve mode (None outside the transforms)."""
    return _SOLVER.value


def call_handler() -> NetworkCall | None:
    """The handler every Network call goes to instead (`calls_handled`), or None."""
    return _HANDLER.value


@contextlib.contextmanager
def calls_handled(handler: NetworkCall | None) -> Iterator[None]:
    """Inside, every Network call ``net(params, *inputs)`` is ``handler(net, params, inputs)``
    instead (which runs with no handler: calling ``net`` there is the ordinary call, solved or
    plain as around it). The curvature transforms' split marks a function's network calls this way
    to find them in its jaxpr (`_capture.NetworkCalls`)."""
    with _HANDLER(handler):
        yield


def current() -> Settings:
    """The settings of the solve being traced (the defaults outside every transform)."""
    return _SETTINGS.value


@contextlib.contextmanager
def solving_with(settings: Settings, call: NetworkCall) -> Iterator[None]:
    """Network calls solved by ``call`` (the transforms' ``network_call``), with ``settings`` (all
    of them: nothing of an enclosing transform's options leaks in), under the policy and capture
    in force."""
    around = current()
    with _SOLVER(call), _SETTINGS(settings.replace(policy=around.policy, capture=around.capture)):
        yield


@contextlib.contextmanager
def plain() -> Iterator[None]:
    """Network calls as plain JAX code inside (a loss's value at other parameters, where nothing
    is differentiated: no plan, no solve), whatever transform is around."""
    with _SOLVER(None):
        yield


@contextlib.contextmanager
def using(settings: Settings) -> Iterator[None]:
    """``settings`` for what is traced inside, solving or not as around it."""
    with _SETTINGS(settings):
        yield


@contextlib.contextmanager
def settings_changed(**changes: Any) -> Iterator[None]:
    """The current settings with ``changes`` (a checkpointed call's segments: ``segments=True``;
    a capture: ``capture=state``)."""
    with _SETTINGS(current().replace(**changes)):
        yield
