"""Which replicas Dynamo knows: each replica's advert, read from the routing stats Serve hands
the router, becomes a worker of the ``SelectionService``, and leaves it when the replica goes.

One of the parts of a :class:`~kvbridge.ray_integration.routing.RoutingState`; the service calls
run on the :class:`~kvbridge.adapters.selection_client.SelectionClient`'s loop, which no
decision waits for.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from kvbridge.adapters.selection_client import SelectionClient, SelectionServiceError
from kvbridge.ray_integration.advert import KVEventsAdvert, read_advert
from kvbridge.ray_integration.decisions import RegistryStats, Rejection

__all__ = ["Worker", "WorkerRegistry", "worker_id_for"]

log = structlog.get_logger("kvbridge.ray.router")


def worker_id_for(replica_id: str) -> int:
    """The Dynamo worker id of a replica: BLAKE2b-64 of its unique id, big-endian.

    Stable across router processes and restarts, and the same id Ray Serve LLM's own KV router
    derives, so both can share a Dynamo deployment.
    """
    digest = hashlib.blake2b(replica_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


@dataclass
class Worker:
    """A replica as Dynamo's worker: ``ready`` once the service has registered it."""

    replica_id: str
    worker_id: int
    advert: KVEventsAdvert
    ready: bool = False


class WorkerRegistry:
    """The replicas of one deployment registered with Dynamo, in one process.

    Args:
        client: the deployment's selection service.
        counts: where registrations, deregistrations and rejections are counted (the
            router's :attr:`~kvbridge.ray_integration.decisions.RouterStats.registry`).
        block_size: the engines' block size; ``None`` pins the first advert's.
        model_name: Dynamo's model name for the deployment.
    """

    def __init__(
        self,
        client: SelectionClient,
        counts: RegistryStats,
        *,
        block_size: int | None,
        model_name: str,
    ) -> None:
        self.client = client
        self.counts = counts
        self.block_size = block_size
        self.model_name = model_name
        self._lock = threading.Lock()
        self._workers: dict[str, Worker] = {}
        self._rejected: dict[str, Rejection] = {}
        self._seen_stats: dict[str, Mapping[str, Any]] = {}
        self._registry_lock: asyncio.Lock | None = None
        self._version = 0
        """Bumped whenever the set of ready workers may have changed (see registry_version)."""

    def worker(self, replica_id: str) -> Worker | None:
        """The replica's worker, registered or on its way."""
        with self._lock:
            return self._workers.get(replica_id)

    def sync(
        self, replicas: Mapping[str, Mapping[str, Any] | None], *, complete: bool
    ) -> concurrent.futures.Future[None] | None:
        """Bring Dynamo's workers in line with ``replicas`` ({replica id: routing stats}).

        Registers replicas whose advert is new or changed; with ``complete`` (the full set of
        replicas) also deregisters the ones not listed. Returns the future of the service
        calls, or ``None`` when nothing changes.
        """
        upserts: list[Worker] = []
        deletes: list[Worker] = []
        with self._lock:
            for replica_id, stats in replicas.items():
                # Serve hands over a new dict when a replica's stats change.
                if stats is not None and self._seen_stats.get(replica_id) is stats:
                    continue
                if stats is not None:
                    self._seen_stats[replica_id] = stats
                advert = self._advert(replica_id, stats)
                current = self._workers.get(replica_id)
                if advert is None or (current is not None and current.advert == advert):
                    continue
                if current is not None:
                    deletes.append(current)
                worker = Worker(replica_id, worker_id_for(replica_id), advert)
                self._workers[replica_id] = worker
                upserts.append(worker)
            if complete:
                for replica_id in [r for r in self._seen_stats if r not in replicas]:
                    del self._seen_stats[replica_id]
                for replica_id in [r for r in self._workers if r not in replicas]:
                    deletes.append(self._workers.pop(replica_id))
                for replica_id in [r for r in self._rejected if r not in replicas]:
                    del self._rejected[replica_id]
            if upserts or deletes:
                self._version += 1
        if not upserts and not deletes:
            return None
        return self.client.run(self._apply_registry(upserts, deletes))

    def forget(self, replica_id: str) -> concurrent.futures.Future[None] | None:
        """Deregister a replica now (its actor died)."""
        with self._lock:
            worker = self._workers.pop(replica_id, None)
            self._rejected.pop(replica_id, None)
            self._seen_stats.pop(replica_id, None)
            self._version += 1
        if worker is None:
            return None
        return self.client.run(self._apply_registry([], [worker]))

    def is_current(self, worker: Worker) -> bool:
        """Whether ``worker`` is still its replica's registration: not deregistered, nor
        replaced by a new one after the replica's advert changed."""
        with self._lock:
            return self._workers.get(worker.replica_id) is worker

    @property
    def registry_version(self) -> int:
        """Changes whenever :meth:`ready_workers` may answer differently for the same replicas,
        so that a router can keep its answer for a candidate list until then."""
        return self._version

    def ready_workers(self, replica_ids: Sequence[str]) -> dict[int, str]:
        """``{worker_id: replica_id}`` of the given replicas that Dynamo has registered."""
        with self._lock:
            return {
                worker.worker_id: replica_id
                for replica_id in replica_ids
                if (worker := self._workers.get(replica_id)) is not None and worker.ready
            }

    def _advert(self, replica_id: str, stats: Mapping[str, Any] | None) -> KVEventsAdvert | None:
        try:
            advert = read_advert(stats)
        except ValueError as error:
            self._reject(replica_id, Rejection.INVALID_ADVERT, str(error))
            return None
        if advert is None:
            return None
        if self.block_size is None:
            self.block_size = advert.block_size
        if advert.block_size != self.block_size:
            self._reject(
                replica_id,
                Rejection.BLOCK_SIZE,
                f"replica block size {advert.block_size}, router {self.block_size}",
            )
            return None
        self._rejected.pop(replica_id, None)
        return advert

    def _reject(self, replica_id: str, reason: Rejection, detail: str) -> None:
        if self._rejected.get(replica_id) == reason:
            return
        self._rejected[replica_id] = reason
        self.counts.rejected[reason] += 1
        log.warning(
            "replica not registered", replica=replica_id, reason=reason.value, detail=detail
        )

    async def _apply_registry(self, upserts: list[Worker], deletes: list[Worker]) -> None:
        if self._registry_lock is None:
            self._registry_lock = asyncio.Lock()
        async with self._registry_lock:
            for worker in deletes:
                try:
                    await self.client.service.delete_worker(worker.worker_id)
                except SelectionServiceError as error:
                    log.warning("delete_worker failed", replica=worker.replica_id, error=str(error))
                self.counts.deregistered += 1
                log.info("replica deregistered", replica=worker.replica_id)
            for worker in upserts:
                record = await self.client.service.upsert_worker(self._worker_record(worker))
                with self._lock:
                    worker.ready = self._workers.get(worker.replica_id) is worker
                    self._version += 1
                self.counts.registered += 1
                log.info(
                    "replica registered",
                    replica=worker.replica_id,
                    worker_id=worker.worker_id,
                    endpoints=worker.advert.endpoints,
                    lifecycle=record.get("lifecycle"),
                    not_schedulable=record.get("not_schedulable_reasons"),
                )

    def _worker_record(self, worker: Worker) -> dict[str, Any]:
        advert = worker.advert
        ranks = advert.dp_ranks
        record: dict[str, Any] = {
            "worker_id": worker.worker_id,
            "model_name": self.model_name,
            "endpoint": f"ray://{worker.replica_id}",
            "block_size": advert.block_size,
            "data_parallel_start_rank": ranks[0],
            "data_parallel_size": len(ranks),
            "kv_events_endpoints": dict(advert.endpoints),
        }
        # Dynamo 1.6 serves replays only to a worker with one dp rank.
        if len(ranks) == 1 and ranks[0] in advert.replay_endpoints:
            record["replay_endpoint"] = advert.replay_endpoints[ranks[0]]
        return record
