"""The replica side: a relay next to the engine, and the advert the router reads.

A deployment class derives from :class:`KVEventsReplica`, calls its ``__init__`` first, and then
starts its engine with :meth:`KVEventsReplica.vllm_engine_kwargs` (or just the
:meth:`KVEventsReplica.kv_events_config`). Events leave the replica already canonical: the relay
normalises them in the replica's process (hash rewriting, tiers, ref-counts, placeholder
resolution) and republishes them on the node's address, where the router's Dynamo subscribes.
"""

from __future__ import annotations

from typing import Any

import ray
import structlog

from kvbridge.adapters.endpoints import tcp_address
from kvbridge.adapters.relay import Relay
from kvbridge.adapters.source import Source
from kvbridge.ray_integration.advert import KVEventsAdvert
from kvbridge.ray_integration.engine_config import (
    KVEventPorts,
    kv_events_config,
    vllm_engine_kwargs,
)

__all__ = ["KVEventsReplica"]

log = structlog.get_logger("kvbridge.ray.replica")


class KVEventsReplica:
    """Base class of a Ray Serve deployment whose engine publishes vLLM KV events.

    Picks free ports for the engine and the relay, starts a :class:`~kvbridge.adapters.relay.Relay`
    on a background thread, and advertises the relay's endpoints, the block size and the dp ranks
    through ``record_routing_stats``, which :class:`~kvbridge.ray_integration.DynamoKVRouter`
    reads. Its ``check_health`` fails once the relay has stopped on an error.

    Args:
        block_size: the engine's tokens per KV block.
        dp_size: data-parallel ranks of the engine (one event stream each).
        dp_start_rank: the first rank's number.
        host: the address the relay publishes on; the node's IP by default.
        topic: vLLM's ``KVEventsConfig.topic``.
    """

    def __init__(
        self,
        *,
        block_size: int,
        dp_size: int = 1,
        dp_start_rank: int = 0,
        host: str | None = None,
        topic: str = "",
    ) -> None:
        if dp_size <= 0:
            raise ValueError(f"dp_size must be positive, got {dp_size}")
        self.kv_block_size = block_size
        self.kv_topic = topic
        self.kv_host: str = host or ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        self.kv_ports = KVEventPorts.allocate(dp_size)
        ports = self.kv_ports
        sources = [
            Source(
                endpoint=f"tcp://127.0.0.1:{ports.engine + offset}",
                replay_endpoint=f"tcp://127.0.0.1:{ports.engine_replay + offset}",
                topic=topic,
            )
            for offset in range(dp_size)
        ]
        self.kv_relay = Relay(
            sources,
            block_size=block_size,
            publish=tcp_address(self.kv_host, ports.relay),
            publish_replay=tcp_address(self.kv_host, ports.relay_replay),
            topic=topic,
        )
        published = {
            dp_start_rank + offset: self.kv_relay.endpoints(source)
            for offset, source in enumerate(sources)
        }
        self.kv_advert = KVEventsAdvert(
            endpoints={rank: endpoint for rank, (endpoint, _) in published.items()},
            replay_endpoints={rank: str(replay) for rank, (_, replay) in published.items()},
            block_size=block_size,
        )
        self.kv_relay.start()
        log.info("relay started", endpoints=self.kv_advert.endpoints, block_size=block_size)

    def kv_events_config(self) -> dict[str, Any]:
        """vLLM's ``kv_events_config``: publish to this replica's relay."""
        return kv_events_config(self.kv_ports, topic=self.kv_topic)

    def vllm_engine_kwargs(self, **engine_kwargs: Any) -> dict[str, Any]:
        """vLLM engine arguments for this replica; see
        :func:`kvbridge.ray_integration.engine_config.vllm_engine_kwargs`."""
        return vllm_engine_kwargs(
            self.kv_ports, block_size=self.kv_block_size, topic=self.kv_topic, **engine_kwargs
        )

    def check_health(self) -> None:
        """Serve calls this every ``health_check_period_s``. A replica whose relay stopped on
        an error is unhealthy, so that Serve replaces it, rather than the router's Dynamo
        indexing a stream that no longer moves. A deployment that defines its own
        ``check_health`` must call this one too: Serve calls only the one it finds."""
        failure = self.kv_relay.failure
        if failure is not None:
            raise RuntimeError(f"the KV-event relay stopped: {failure!r}") from failure

    def record_routing_stats(self) -> dict[str, Any]:
        """Serve polls this; the router registers the replica from it."""
        return self.kv_advert.routing_stats()

    def close_kv_events(self) -> None:
        """Stop the relay and close its sockets. Idempotent."""
        self.kv_relay.close()

    def __del__(self) -> None:
        # Serve calls __del__ when it shuts a replica down gracefully.
        if hasattr(self, "kv_relay"):
            self.close_kv_events()
