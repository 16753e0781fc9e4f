"""The options of a solve and how a Network call runs: the first layer, importing nothing of
linbackprop.

Modules: `_policy` (`Policy`: every measured threshold a rule of the solve uses, each naming its
benchmark) and `_settings` (`Settings`, one frozen value of a solve's options, and the three
context values JAX keys its caches on: the settings, the function that solves a Network call and
the handler a curvature transform splits a function with).
"""

from ._policy import POLICY, Policy
from ._settings import (
    Engine,
    ParamProducts,
    Schedule,
    Settings,
    call_handler,
    calls_handled,
    current,
    plain,
    settings_changed,
    solver,
    solving,
    solving_with,
)

__all__ = [
    "POLICY", "Engine", "ParamProducts", "Policy", "Schedule", "Settings", "call_handler", "calls_handled",
    "current", "plain", "settings_changed", "solver", "solving", "solving_with",
]
