"""What a replica tells the router about its KV events, through Serve's routing stats.

A :class:`KVEventsAdvert` names the replica's canonical event streams (one per dp rank, from the
relay next to its engine) and its block size. The router reads it from
``RunningReplica.routing_stats`` and registers the replica with Dynamo. It also reads the
``kv_event_metadata`` that Ray Serve LLM's own engines advertise (one raw vLLM stream), so the
router works with those replicas too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import msgspec

__all__ = ["ROUTING_STATS_KEY", "KVEventsAdvert", "read_advert"]

ROUTING_STATS_KEY: Final = "kvbridge_kv_events"
"""The key of the advert in a replica's routing stats."""

RAY_LLM_STATS_KEY: Final = "kv_event_metadata"
"""Ray Serve LLM's key: ``{endpoint, replay_endpoint, block_size, dp_rank, ...}``."""


class KVEventsAdvert(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One replica's KV-event streams.

    Attributes:
        endpoints: ``{dp_rank: PUB address}`` of the streams to subscribe to.
        block_size: tokens per block of the engine.
        replay_endpoints: ``{dp_rank: replay ROUTER address}``.
        canonical: the streams are kvbridge's canonical streams (relayed), not raw vLLM ones.
    """

    endpoints: dict[int, str]
    block_size: int
    replay_endpoints: dict[int, str] = {}
    canonical: bool = True

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ValueError("endpoints must name at least one dp rank")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")

    @property
    def dp_ranks(self) -> list[int]:
        return sorted(self.endpoints)

    def routing_stats(self) -> dict[str, Any]:
        """The dict a replica returns from ``record_routing_stats``."""
        return {ROUTING_STATS_KEY: msgspec.to_builtins(self)}


class _RayLLMMetadata(msgspec.Struct):
    endpoint: str
    block_size: int
    dp_rank: int = 0
    replay_endpoint: str | None = None


def read_advert(stats: Mapping[str, Any] | None) -> KVEventsAdvert | None:
    """The advert in a replica's routing stats, or ``None`` if it has none (yet).

    Raises:
        ValueError: the stats hold an advert that does not validate (the message says why).
    """
    if not stats:
        return None
    try:
        if ROUTING_STATS_KEY in stats:
            return msgspec.convert(stats[ROUTING_STATS_KEY], KVEventsAdvert, strict=False)
        if RAY_LLM_STATS_KEY in stats:
            raw = msgspec.convert(stats[RAY_LLM_STATS_KEY], _RayLLMMetadata, strict=False)
            replay = {} if raw.replay_endpoint is None else {raw.dp_rank: raw.replay_endpoint}
            return KVEventsAdvert(
                endpoints={raw.dp_rank: raw.endpoint},
                block_size=raw.block_size,
                replay_endpoints=replay,
                canonical=False,
            )
    except (msgspec.ValidationError, ValueError) as error:
        raise ValueError(f"invalid KV-events advert: {error}") from None
    return None
