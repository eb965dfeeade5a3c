"""Ray Serve integration: requests routed by Dynamo's KV router, replicas that relay their events.

* :class:`DynamoKVRouter`: a Serve ``RequestRouter`` that asks Dynamo's ``SelectionService``.
* :class:`DynamoLLMRouter`: the same for Ray Serve LLM (``ray.serve.llm``), whose engines'
  raw streams it relays through kvbridge; imported on first use, since ``ray.serve.llm`` loads
  vLLM.
* :class:`KVEventsReplica`: the base of a deployment whose engine publishes KV events; runs a
  relay next to the engine and advertises it to the router.
* :func:`vllm_engine_kwargs`, :func:`engine_env`, :class:`KVEventPorts`: the engine settings.

This is the only part of kvbridge that imports Ray (``pip install 'kvbridge[ray]'``).
"""

try:
    import ray.serve  # noqa: F401
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "kvbridge.ray_integration needs Ray Serve: pip install 'kvbridge[ray]'"
    ) from error

from typing import TYPE_CHECKING, Any

from kvbridge.ray_integration.advert import ROUTING_STATS_KEY, KVEventsAdvert, read_advert
from kvbridge.ray_integration.engine_config import (
    KVEventPorts,
    engine_env,
    kv_events_config,
    vllm_engine_kwargs,
)
from kvbridge.ray_integration.kv_router import DynamoKVRouter, deployment_key
from kvbridge.ray_integration.replica import KVEventsReplica
from kvbridge.ray_integration.routing import RouterStats, RoutingState, worker_id_for
from kvbridge.ray_integration.routing_states import find_routing_state

if TYPE_CHECKING:
    from kvbridge.ray_integration.kv_router import DynamoKVRouter as DynamoLLMRouter  # noqa: F401

__all__ = [
    "ROUTING_STATS_KEY",
    "DynamoKVRouter",
    "KVEventPorts",
    "KVEventsAdvert",
    "KVEventsReplica",
    "RouterStats",
    "RoutingState",
    "deployment_key",
    "engine_env",
    "find_routing_state",
    "kv_events_config",
    "read_advert",
    "vllm_engine_kwargs",
    "worker_id_for",
]


def __getattr__(name: str) -> Any:
    # DynamoLLMRouter imports ray.serve.llm, which loads vLLM: only when asked for (and not in
    # __all__, so that `import *` works where ray.serve.llm cannot be imported).
    if name == "DynamoLLMRouter":
        from kvbridge.ray_integration import llm_router

        return llm_router.DynamoLLMRouter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
