"""The relay hop of :class:`~kvbridge.ray_integration.llm_router.DynamoLLMRouter`: replicas'
raw vLLM adverts turned into adverts of kvbridge relays running in the router's process.

Ray Serve LLM's engines advertise their raw streams. The router never registers them with
Dynamo as they are: :class:`RelayHop` runs one :class:`~kvbridge.adapters.relay.Relay` per
replica, subscribed to the replica's stream (and its replay socket), and registers the relay's
loopback endpoints instead. A relay that stops on an error (:attr:`Relay.failure
<kvbridge.adapters.relay.Relay.failure>`) is replaced, so that Dynamo never indexes a stream
that stopped moving (see :meth:`RelayHop.translate`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Final, cast

import structlog

from kvbridge._backoff import doubling_backoff_s
from kvbridge.adapters.endpoints import tcp_address
from kvbridge.adapters.relay import Relay
from kvbridge.adapters.source import Source
from kvbridge.ray_integration.advert import KVEventsAdvert, read_advert
from kvbridge.ray_integration.routing import RoutingState, worker_id_for

__all__ = ["HOP_KEY", "RELAY_RETRY_MAX_S", "RELAY_RETRY_S", "RelayHop", "relay_hop"]

log = structlog.get_logger("kvbridge.ray.llm_router")

RELAY_HOST: Final = "127.0.0.1"
"""Where the router-side relays publish: loopback, for the router's own Dynamo only."""

HOP_KEY: Final = "kvbridge_relay_hop"
"""The relay hop's key on its :class:`RoutingState` (:meth:`RoutingState.attachment`)."""
RELAY_RETRY_S: Final = 1.0
"""A replica whose relay failed has its next failed relay replaced this long after, at the
earliest; doubled after each further failure of that replica's relays."""
RELAY_RETRY_MAX_S: Final = 60.0


class _Relayed:
    """One replica's raw advert, the relay that republishes it, and the advert Dynamo gets."""

    __slots__ = ("advert", "raw", "relay", "stats")

    def __init__(self, raw: KVEventsAdvert, relay: Relay, advert: KVEventsAdvert) -> None:
        self.raw = raw
        self.relay = relay
        self.advert = advert
        self.stats: dict[str, Any] = advert.routing_stats()


class RelayHop:
    """Turns replicas' raw vLLM adverts into adverts of kvbridge relays running in this process.

    :meth:`translate` maps ``{replica id: routing stats}`` as Serve reports them to the stats the
    registry should see: a raw advert (Ray Serve LLM's ``kv_event_metadata``) becomes a
    canonical advert naming the loopback endpoints of a relay that subscribes to the raw stream
    (started on first sight, replaced when the advert changes, closed when the replica leaves);
    anything else passes unchanged. The same input object maps to the same output object, so
    the registry's check for unchanged stats (by identity) stays cheap.

    Args:
        host: the address the relays publish on (loopback by default).
        on_replaced: called for each relay found stopped on an error and replaced (the
            router's count and metric).
    """

    def __init__(
        self, host: str = RELAY_HOST, *, on_replaced: Callable[[], None] | None = None
    ) -> None:
        self.host = host
        self._on_replaced = on_replaced
        self._lock = threading.Lock()
        self._relayed: dict[str, _Relayed] = {}
        self._seen: dict[str, tuple[Mapping[str, Any], Mapping[str, Any]]] = {}
        self.started = 0
        """Relays started (a replica whose advert changed, or whose relay failed, counts
        again)."""
        self.closed = 0
        self.failed = 0
        """Relays found stopped on an error: each is closed, and its replica relayed anew."""
        self._failures: dict[str, tuple[int, float]] = {}
        """Per replica, its relays replaced after a failure, and when the next failed one may
        be replaced (``time.monotonic()``)."""

    def translate(
        self, replicas: Mapping[str, Mapping[str, Any] | None], *, complete: bool
    ) -> dict[str, Mapping[str, Any] | None]:
        """The stats to register for ``replicas``; with ``complete`` (every replica of the
        deployment is listed), the relays of replicas not listed are closed. A relay that
        stopped on an error is replaced by a new one, on new ports: the registry sees a new
        advert, so the router's Dynamo drops the stalled stream and subscribes to the new."""
        out: dict[str, Mapping[str, Any] | None] = {}
        stale: list[Relay] = []
        try:
            with self._lock:
                self._drop_failed(stale)
                for replica_id, stats in replicas.items():
                    seen = self._seen.get(replica_id)
                    if stats is not None and seen is not None and seen[0] is stats:
                        out[replica_id] = seen[1]
                        continue
                    translated, replaced = self._translate(replica_id, stats)
                    if replaced is not None:
                        stale.append(replaced)
                    if stats is not None:
                        self._seen[replica_id] = (stats, translated)  # type: ignore[assignment]
                    out[replica_id] = translated
                if complete:
                    for replica_id in [r for r in self._seen if r not in replicas]:
                        del self._seen[replica_id]
                    for replica_id in [r for r in self._relayed if r not in replicas]:
                        stale.append(self._relayed.pop(replica_id).relay)
                        self._failures.pop(replica_id, None)
        finally:
            self._close(stale)
        return out

    def needs_resync(self) -> bool:
        """Whether a relay stopped on an error and may be replaced now: Serve syncs the
        replicas only when they or their stats change, which a relay's failure does not."""
        now = time.monotonic()
        with self._lock:
            return any(self._replaceable(r, relayed, now) for r, relayed in self._relayed.items())

    def _replaceable(self, replica_id: str, relayed: _Relayed, now: float) -> bool:
        _, retry_at = self._failures.get(replica_id, (0, 0.0))
        return relayed.relay.failure is not None and now >= retry_at

    def _drop_failed(self, stale: list[Relay]) -> None:
        """Take out the relays that stopped on an error, so that their replicas are relayed
        anew, on new ports: the registry sees a new advert, and Dynamo drops the stalled
        stream for the new one. A replica's failed relay is replaced :data:`RELAY_RETRY_S`
        after the last replacement at the earliest, doubled after each, up to
        :data:`RELAY_RETRY_MAX_S`: a fault that comes back (say, with the replay from 0)
        does not take the router's loop."""
        now = time.monotonic()
        for replica_id, relayed in list(self._relayed.items()):
            if not self._replaceable(replica_id, relayed, now):
                continue
            failures = self._failures.get(replica_id, (0, 0.0))[0] + 1
            wait = doubling_backoff_s(RELAY_RETRY_S, failures, RELAY_RETRY_MAX_S)
            self._failures[replica_id] = (failures, now + wait)
            self.failed += 1
            if self._on_replaced is not None:
                self._on_replaced()
            log.warning(
                "relay stopped, replaced", replica=replica_id, exc_info=relayed.relay.failure
            )
            stale.append(self._relayed.pop(replica_id).relay)
            self._seen.pop(replica_id, None)

    def forget(self, replica_id: str) -> None:
        """Close the relay of a replica that died."""
        with self._lock:
            self._seen.pop(replica_id, None)
            relayed = self._relayed.pop(replica_id, None)
            self._failures.pop(replica_id, None)
        self._close([] if relayed is None else [relayed.relay])

    def endpoints(self, replica_id: str) -> KVEventsAdvert | None:
        """The advert registered for ``replica_id`` in place of its raw one, if relayed."""
        with self._lock:
            relayed = self._relayed.get(replica_id)
        return None if relayed is None else relayed.advert

    def relay(self, replica_id: str) -> Relay | None:
        """The relay of ``replica_id``, if it has one (for its stats)."""
        with self._lock:
            relayed = self._relayed.get(replica_id)
        return None if relayed is None else relayed.relay

    def close(self) -> None:
        """Close every relay. Idempotent."""
        with self._lock:
            relays = [relayed.relay for relayed in self._relayed.values()]
            self._relayed.clear()
            self._seen.clear()
            self._failures.clear()
        self._close(relays)

    def _translate(
        self, replica_id: str, stats: Mapping[str, Any] | None
    ) -> tuple[Mapping[str, Any] | None, Relay | None]:
        try:
            raw = read_advert(stats)
        except ValueError:
            return stats, None  # the registry rejects it, and counts why
        if raw is None or raw.canonical:
            return stats, None
        current = self._relayed.get(replica_id)
        if current is not None and current.raw == raw:
            return current.stats, None
        relayed = self._start(replica_id, raw)
        self._relayed[replica_id] = relayed
        return relayed.stats, None if current is None else current.relay

    def _start(self, replica_id: str, raw: KVEventsAdvert) -> _Relayed:
        worker_id = worker_id_for(replica_id)
        # The advert names the node's address of a socket vLLM binds (tcp://*): connect to it.
        sources = [
            Source(
                endpoint=raw.endpoints[rank],
                replay_endpoint=raw.replay_endpoints.get(rank),
                worker_id=worker_id,
                bind=False,
            )
            for rank in raw.dp_ranks
        ]
        endpoints: dict[int, str] = {}
        replays: dict[int, str] = {}
        relays: list[Relay] = []
        # One relay per rank: each output gets its own ephemeral ports (a relay offsets the
        # ports of several sources from one base, which an ephemeral port cannot give).
        for rank, source in zip(raw.dp_ranks, sources, strict=True):
            relay = Relay(
                [source],
                block_size=raw.block_size,
                publish=tcp_address(self.host, "*"),
                publish_replay=tcp_address(self.host, "*"),
                replay_on_start=source.replay_endpoint is not None,
            )
            relays.append(relay)
            endpoint, replay = relay.endpoints(source)
            endpoints[rank] = endpoint
            if replay is not None:
                replays[rank] = replay
        if len(relays) != 1:
            for relay in relays:
                relay.close()
            raise ValueError(f"replica {replica_id}: one dp rank per replica, got {raw.dp_ranks}")
        relay = relays[0]
        relay.start()
        self.started += 1
        advert = KVEventsAdvert(
            endpoints=endpoints,
            block_size=raw.block_size,
            replay_endpoints=replays,
            canonical=True,
        )
        log.info(
            "relaying a raw vLLM stream",
            replica=replica_id,
            raw=raw.endpoints,
            relayed=endpoints,
            block_size=raw.block_size,
        )
        return _Relayed(raw, relay, advert)

    def _close(self, relays: list[Relay]) -> None:
        for relay in relays:
            relay.close()
            with self._lock:
                self.closed += 1


def relay_hop(state: RoutingState) -> RelayHop:
    """The hop of ``state``'s deployment in this process (created on first use).

    Kept on the state (:meth:`RoutingState.attached`), not in a module global: Ray pickles
    the router's module by value, which copies its globals.
    """
    # Another copy of this module may have made it: the same class by value, not by identity.
    return cast(
        RelayHop, state.attached(HOP_KEY, lambda: RelayHop(on_replaced=state.relay_replaced))
    )
