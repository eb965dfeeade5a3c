"""The process's routing states, one per deployment, shared by every router instance of the
deployment in the process.

Kept here, not in a router's module, because Ray pickles a request router's module *by value*:
a registry kept there would be copied into each process that unpickles the router. This module
pickles by reference, so there is one registry per process.
"""

from __future__ import annotations

import threading
from typing import Any

import structlog

from kvbridge.ray_integration.routing import RoutingState

__all__ = ["close_routing_states", "find_routing_state", "routing_state"]

log = structlog.get_logger("kvbridge.ray.router")

_STATES: dict[str, RoutingState] = {}
_OPTIONS: dict[str, list[dict[str, Any]]] = {}
"""Per deployment: the options its state was made with, then each other set asked for."""
_STATES_LOCK = threading.Lock()


def routing_state(deployment: str, **options: Any) -> RoutingState:
    """The process's :class:`RoutingState` for ``deployment``, created on first use with
    ``options``. Later callers share it: routers of the deployment's replicas in one process,
    and of a redeployment until the process restarts, since the routers of the old version
    may still be deciding. Options other than the state's are logged, once per set, as kept
    out."""
    with _STATES_LOCK:
        state = _STATES.get(deployment)
        if state is None:
            state = _STATES[deployment] = RoutingState(deployment, **options)
            _OPTIONS[deployment] = [options]
            return state
        seen = _OPTIONS[deployment]
        if options in seen:
            return state
        seen.append(options)
    log.warning(
        "router options differ from the deployment's routing state: its first options are kept "
        "until the process restarts",
        deployment=deployment,
        kept=seen[0],
        ignored=options,
    )
    return state


def find_routing_state(deployment: str) -> RoutingState | None:
    """The process's state for ``deployment`` (``"app#deployment"``), if a router made one."""
    with _STATES_LOCK:
        return _STATES.get(deployment)


def close_routing_states() -> None:
    """Shut down every state's service (e.g. between test runs in one process)."""
    with _STATES_LOCK:
        states = list(_STATES.values())
        _STATES.clear()
        _OPTIONS.clear()
    for state in states:
        state.close()
