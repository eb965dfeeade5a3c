"""The router's state: Dynamo's ``SelectionService``, the replica registry and the reservations.

This lives in a module of its own because Ray pickles a request router's module *by value*: a
service kept in the router's module would be copied into each process that unpickles the router,
and the copies would not share registrations or reservations. Functions and classes of this
module pickle by reference, so every router instance in a process finds the same
:class:`RoutingState` for its deployment through :func:`routing_state`.

A decision's service calls (``select_and_reserve``, and ``overlap_scores`` for a retry's
ranking) are made on the router's own loop, as a direct ``await`` of the service's future under
a timeout: Dynamo's answer then comes back with one thread switch (its thread to the router's
loop), where a round trip through another loop took three, about 0.2 ms of a 0.8 ms decision
(docs/benchmarks.md). A service that does not answer in time delays a decision by at most that
timeout, and Serve's loop never blocks on it: the call only converts the request (a few hundred
integers in the precomputed form) before it returns its future. Registrations and frees, which
no decision waits for, run on the :class:`~kvbridge.adapters.selection.SelectionClient`'s own
loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import itertools
import threading
import time
from array import array
from collections import Counter, OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import structlog

from kvbridge.adapters.dynamo import Overlap
from kvbridge.adapters.selection import SelectionClient, SelectionServiceError
from kvbridge.normalizers.hashing import block_seed, sequence_hashes, tokens_hash
from kvbridge.ray_integration.advert import KVEventsAdvert, read_advert
from kvbridge.ray_integration.metrics import RouterMetrics

__all__ = [
    "Choice",
    "NoChoice",
    "RouterStats",
    "RoutingState",
    "close_routing_states",
    "find_routing_state",
    "routing_state",
    "worker_id_for",
]

log = structlog.get_logger("kvbridge.ray.router")

TIER_CREDIT: Final = (1.0, 0.75, 0.25)
"""Dynamo's credit per matched block on device, host and disk (its default weights)."""

_DECISION_LOG: Final = 10_000


def worker_id_for(replica_id: str) -> int:
    """The Dynamo worker id of a replica: BLAKE2b-64 of its unique id, big-endian.

    Stable across router processes and restarts, and the same id Ray Serve LLM's own KV router
    derives, so both can share a Dynamo deployment.
    """
    digest = hashlib.blake2b(replica_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class NoChoice(Exception):
    """Dynamo gave no answer; ``reason`` says why (the fallback counter's label)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(frozen=True)
class Choice:
    """Dynamo's pick for one request, and the other workers ranked by their overlap."""

    selection_id: str
    worker_id: int
    dp_rank: int
    ranking: list[list[int]]
    """Groups of worker ids, best first: the pick alone, then (once Serve asks again for the
    same request, see :meth:`RoutingState.choose`) the others by overlap credit, equal credit
    in one group, so that Serve balances among them by queue length."""
    overlap: Overlap
    """The picked worker's overlap, in blocks (cumulative over tiers)."""


@dataclass(frozen=True)
class Decision:
    """One routing decision, for :attr:`RouterStats.decisions`."""

    request_id: str
    replica_id: str | None
    worker_id: int | None
    dp_rank: int | None
    overlap: Overlap | None
    fallback: str | None
    latency_s: float


@dataclass
class RouterStats:
    """What the router did, in this process (the same figures go to Ray's metrics)."""

    outcomes: Counter[str] = field(default_factory=Counter)
    """``dynamo``, ``fallback`` and ``repeat`` (a retry of a request already reserved)."""
    fallbacks: Counter[str] = field(default_factory=Counter)
    """By reason: ``no_tokens``, ``no_workers``, ``timeout``, ``service_error``."""
    overlap_blocks: Counter[str] = field(default_factory=Counter)
    """Sum of the picked workers' overlap by tier: ``device``, ``host_pinned``, ``disk``."""
    registry: Counter[str] = field(default_factory=Counter)
    """``registered``, ``deregistered``, ``rejected:<why>``, ``freed``, ``late_freed`` (after a
    timeout), ``moved`` (to the replica Serve used), ``expired``, ``free_failed``."""
    decisions: deque[Decision] = field(default_factory=lambda: deque(maxlen=_DECISION_LOG))
    token_checks: Counter[str] = field(default_factory=Counter)
    """After each completed request, whether the engine reported storing the prompt the router
    hashed (Dynamo's index, fed by the engine's own token ids, read for the serving worker):
    ``confirmed`` (every full block), ``partial`` (a leading part: evicted since, or token ids
    that diverge midway), ``unconfirmed`` (none: the router's token ids are not the engine's,
    so every decision for such prompts finds zero hits). Prompts without a full block are not
    checked."""


@dataclass
class _Worker:
    replica_id: str
    worker_id: int
    advert: KVEventsAdvert
    ready: bool = False


@dataclass
class _Reservation:
    choice: Choice
    created: float
    prompt: dict[str, Any]


class RoutingState:
    """Dynamo's view of one deployment's replicas, in one process.

    Args:
        deployment: a name for logs and metrics.
        block_size: the engines' block size; ``None`` pins the first replica's.
        model_name: Dynamo's model name for the deployment.
        select_timeout_s: how long a decision may wait for Dynamo before the fallback.
        reservation_ttl_s: a reservation whose completion never arrives is freed after this.
        indexer_threads: the service's indexer threads.
        tuning: Dynamo's router weights (see :data:`kvbridge.adapters.selection.TUNING_ENV`).
        token_check_delay_s: how long after a request completed its prompt is looked up (see
            :attr:`RouterStats.token_checks`): time for the engine's events to reach Dynamo.
            ``None``: no checks.
    """

    def __init__(
        self,
        deployment: str,
        *,
        block_size: int | None = None,
        model_name: str = "default",
        select_timeout_s: float = 1.0,
        reservation_ttl_s: float = 3600.0,
        indexer_threads: int | None = None,
        tuning: Mapping[str, float] | None = None,
        token_check_delay_s: float | None = 0.5,
    ) -> None:
        self.deployment = deployment
        self.token_check_delay_s = token_check_delay_s
        self.block_size = block_size
        self.model_name = model_name
        self.select_timeout_s = select_timeout_s
        self.reservation_ttl_s = reservation_ttl_s
        self.client = SelectionClient(indexer_threads=indexer_threads, tuning=tuning)
        self.stats = RouterStats()
        self.metrics = RouterMetrics(deployment)
        self._lock = threading.Lock()
        self._workers: dict[str, _Worker] = {}
        self._rejected: dict[str, str] = {}
        self._seen_stats: dict[str, Mapping[str, Any]] = {}
        self._freeing: set[concurrent.futures.Future[Any]] = set()
        """Frees submitted and not yet applied: a selection waits for them (see _select)."""
        self._checking: set[concurrent.futures.Future[None]] = set()
        """Token checks waiting for their delay or for Dynamo (see _check_tokens)."""
        self._reservations: OrderedDict[str, _Reservation] = OrderedDict()
        self._selection_ids = itertools.count()
        self._registry_lock: asyncio.Lock | None = None
        self._version = 0
        """Bumped whenever the set of ready workers may have changed (see registry_version)."""

    # ------------------------------------------------------------------ registry

    def sync(
        self, replicas: Mapping[str, Mapping[str, Any] | None], *, complete: bool
    ) -> concurrent.futures.Future[None] | None:
        """Bring Dynamo's workers in line with ``replicas`` ({replica id: routing stats}).

        Registers replicas whose advert is new or changed; with ``complete`` (the full set of
        replicas) also deregisters the ones not listed. Returns the future of the service
        calls, or ``None`` when nothing changes.
        """
        upserts: list[_Worker] = []
        deletes: list[_Worker] = []
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
                worker = _Worker(replica_id, worker_id_for(replica_id), advert)
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
            self._reject(replica_id, "invalid_advert", str(error))
            return None
        if advert is None:
            return None
        if self.block_size is None:
            self.block_size = advert.block_size
        if advert.block_size != self.block_size:
            self._reject(
                replica_id,
                "block_size",
                f"replica block size {advert.block_size}, router {self.block_size}",
            )
            return None
        self._rejected.pop(replica_id, None)
        return advert

    def _reject(self, replica_id: str, reason: str, detail: str) -> None:
        if self._rejected.get(replica_id) == reason:
            return
        self._rejected[replica_id] = reason
        self.stats.registry[f"rejected:{reason}"] += 1
        log.warning("replica not registered", replica=replica_id, reason=reason, detail=detail)

    async def _apply_registry(self, upserts: list[_Worker], deletes: list[_Worker]) -> None:
        if self._registry_lock is None:
            self._registry_lock = asyncio.Lock()
        async with self._registry_lock:
            for worker in deletes:
                try:
                    await self.client.service.delete_worker(worker.worker_id)
                except SelectionServiceError as error:
                    log.warning("delete_worker failed", replica=worker.replica_id, error=str(error))
                self.stats.registry["deregistered"] += 1
                log.info("replica deregistered", replica=worker.replica_id)
            for worker in upserts:
                record = await self.client.service.upsert_worker(self._worker_record(worker))
                with self._lock:
                    worker.ready = self._workers.get(worker.replica_id) is worker
                    self._version += 1
                self.stats.registry["registered"] += 1
                log.info(
                    "replica registered",
                    replica=worker.replica_id,
                    worker_id=worker.worker_id,
                    endpoints=worker.advert.endpoints,
                    lifecycle=record.get("lifecycle"),
                    not_schedulable=record.get("not_schedulable_reasons"),
                )

    def _worker_record(self, worker: _Worker) -> dict[str, Any]:
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

    # ------------------------------------------------------------------ decisions

    async def choose(
        self,
        request_id: str,
        token_ids: Sequence[int],
        workers: Mapping[int, str],
        *,
        lora_name: str | None = None,
        started: float | None = None,
    ) -> Choice:
        """Dynamo's pick among ``workers`` ({worker_id: replica_id}), reserved until
        :meth:`release`. ``started`` (a ``time.perf_counter()``) is when the decision began,
        for its latency.

        A decision is one Dynamo call, ``select_and_reserve``, whose answer carries the pick's
        overlap by tier; its ranking is the pick alone. Serve asks again at once, without a
        backoff, when the pick is full or rejects the request (the router sets
        ``should_backoff``, and Serve sleeps only from the second retry on): a request that
        already holds a reservation on one of ``workers`` gets the same pick then, followed by
        the other workers ranked by their overlap (:meth:`_ranked`). So the ``overlap_scores``
        call that ranking needs is made only for a request whose pick could not take it.

        Raises:
            NoChoice: no worker, a timeout, or a service error.
        """
        started = time.perf_counter() if started is None else started
        self._expire(time.monotonic())
        with self._lock:
            held = self._reservations.get(request_id)
        if held is not None and held.choice.worker_id in workers:
            self.stats.outcomes["repeat"] += 1
            return await self._ranked(request_id, held, workers)
        if not workers:
            raise NoChoice("no_workers")
        selection_id = f"{request_id}:{next(self._selection_ids)}"
        prompt = self._prompt(token_ids, lora_name)
        request = {**prompt, "selection_id": selection_id, "allowed_worker_ids": list(workers)}
        # Shielded: a selection that answers after the timeout (or after the caller was
        # cancelled) has reserved load, which _free_late frees.
        future = asyncio.ensure_future(self._select(request))
        try:
            choice = await asyncio.wait_for(asyncio.shield(future), self.select_timeout_s)
        except TimeoutError:
            future.add_done_callback(self._free_late)
            raise NoChoice("timeout", f"no answer in {self.select_timeout_s} s") from None
        except asyncio.CancelledError:
            future.add_done_callback(self._free_late)
            raise
        except (SelectionServiceError, ValueError) as error:
            raise NoChoice("service_error", str(error)) from None
        with self._lock:
            self._reservations[request_id] = _Reservation(choice, time.monotonic(), prompt)
        latency = time.perf_counter() - started
        self._record(request_id, workers.get(choice.worker_id), choice, None, latency)
        return choice

    def _prompt(self, token_ids: Sequence[int], lora_name: str | None) -> dict[str, Any]:
        """The prompt in Dynamo's precomputed form: its blocks hashed here.

        Dynamo converts a token list on the calling thread with the GIL held (about 0.4 ms for
        8k tokens, some 50 ns a token), where hashing the blocks here from the packed ids
        costs about 0.1 ms; the precomputed form is also what a moved reservation and the
        ranking's ``overlap_scores`` take. Token ids from :func:`prompt_tokens` come packed
        already (an ``array("I")``, the little-endian u32s Dynamo hashes on every supported
        host, as :func:`kvbridge.normalizers.hashing.pack_tokens` assumes too): their bytes
        are hashed block by block with no copy. kvbridge's hashes are Dynamo's bit for bit
        (tests/test_hashing.py), LoRA name included.
        """
        assert self.block_size is not None  # pinned when the first worker registered
        if not (isinstance(token_ids, array) and token_ids.typecode == "I"):
            token_ids = array("I", token_ids)
        packed = memoryview(token_ids).cast("B")
        width = 4 * self.block_size
        seed = block_seed(lora_name)
        blocks = [
            tokens_hash(packed[start : start + width], seed)
            for start in range(0, len(packed) - width + 1, width)
        ]
        return {
            "block_hashes": _as_i64(blocks),
            "sequence_hashes": _as_i64(sequence_hashes(blocks)),
            "isl_tokens": len(token_ids),
            "model_name": self.model_name,
        }

    async def _select(self, request: dict[str, Any]) -> Choice:
        """Select and reserve, one call."""
        # A free and a selection submitted after it run concurrently in the service; without
        # this wait the selection may still count the freed request's load.
        with self._lock:
            freeing = [asyncio.wrap_future(future) for future in self._freeing]
        if freeing:
            await asyncio.wait(freeing)
        answer = await self.client.service.select_and_reserve(request)
        worker_id, dp_rank = int(answer["worker_id"]), int(answer["dp_rank"])
        return Choice(
            request["selection_id"], worker_id, dp_rank, [[worker_id]], self._overlap(answer)
        )

    def _overlap(self, answer: Mapping[str, Any]) -> Overlap:
        """The pick's overlap in blocks, from ``select_and_reserve``'s answer (in tokens).

        ``gpu``, ``cpu`` and ``disk`` are the picked worker's matched tokens, cumulative over
        the tiers, as ``overlap_scores``' ``device_blocks``, ``host_pinned_blocks`` and
        ``disk_blocks`` count them in blocks: in Dynamo 1.6.1 the two agreed on every pick of
        a workload with host-pinned-only prefixes and of a worker with two dp ranks, and
        ``tests/test_ray_router.py``'s CPU-tier assertions hold on these figures. ``dp`` gives
        the device figure of each dp rank of the worker; the picked rank's is the one to report.
        """
        assert self.block_size is not None
        tokens = answer["overlap"]
        device = int(tokens.get("dp", {}).get(str(answer["dp_rank"]), tokens["gpu"]))
        return Overlap(
            device // self.block_size,
            int(tokens["cpu"]) // self.block_size,
            int(tokens["disk"]) // self.block_size,
        )

    async def _ranked(
        self, request_id: str, held: _Reservation, workers: Mapping[int, str]
    ) -> Choice:
        """``held``'s choice with the other ``workers`` ranked by their overlap credit with the
        request's prompt (asked of Dynamo once per request); if Dynamo does not answer within
        the selection timeout, the others form one group, balanced by queue length."""
        if len(held.choice.ranking) > 1:
            return held.choice
        picked = held.choice.worker_id
        credit: dict[int, float] = {}
        try:
            scores = await asyncio.wait_for(
                self.client.service.overlap_scores(held.prompt), self.select_timeout_s
            )
        except (TimeoutError, SelectionServiceError, ValueError) as error:
            log.warning("overlap_scores failed; others unranked", error=str(error))
        else:
            for entry in scores["workers"]:
                tiers = Overlap(
                    int(entry["device_blocks"]),
                    int(entry["host_pinned_blocks"]),
                    int(entry["disk_blocks"]),
                )
                wid = int(entry["worker_id"])
                credit[wid] = max(credit.get(wid, 0.0), _credit(tiers))
        others = sorted((w for w in workers if w != picked), key=lambda w: -credit.get(w, 0.0))
        ranking = [[picked]] + [
            list(group) for _, group in itertools.groupby(others, lambda w: credit.get(w, 0.0))
        ]
        choice = dataclasses.replace(held.choice, ranking=ranking)
        with self._lock:
            if self._reservations.get(request_id) is held:
                self._reservations[request_id] = dataclasses.replace(held, choice=choice)
        return choice

    def _free_late(self, future: asyncio.Future[Choice]) -> None:
        """A selection that answered after its timeout reserved load nobody will use: free it."""
        if future.cancelled() or future.exception() is not None:
            return
        self._free(future.result().selection_id, "late_freed")

    def fallback(self, request_id: str, reason: str, latency_s: float) -> None:
        """Count a request routed without Dynamo."""
        self._record(request_id, None, None, reason, latency_s)

    def _record(
        self,
        request_id: str,
        replica_id: str | None,
        choice: Choice | None,
        fallback: str | None,
        latency_s: float,
    ) -> None:
        if choice is None:
            assert fallback is not None
            self.stats.outcomes["fallback"] += 1
            self.stats.fallbacks[fallback] += 1
        else:
            self.stats.outcomes["dynamo"] += 1
            overlap = choice.overlap
            self.stats.overlap_blocks["device"] += overlap.device
            self.stats.overlap_blocks["host_pinned"] += overlap.host_pinned
            self.stats.overlap_blocks["disk"] += overlap.disk
        self.metrics.record(choice.overlap if choice else None, fallback, latency_s)
        self.stats.decisions.append(
            Decision(
                request_id=request_id,
                replica_id=replica_id,
                worker_id=choice.worker_id if choice else None,
                dp_rank=choice.dp_rank if choice else None,
                overlap=choice.overlap if choice else None,
                fallback=fallback,
                latency_s=latency_s,
            )
        )

    # ------------------------------------------------------------------ reservations

    def routed(self, request_id: str, replica_id: str) -> None:
        """Serve placed the request on ``replica_id``. If that is not Dynamo's pick (the pick was
        full and Serve took a replica of a lower rank), move the reservation there, so that
        Dynamo books the load where it is."""
        with self._lock:
            held = self._reservations.get(request_id)
            worker = self._workers.get(replica_id)
            if held is None or worker is None or held.choice.worker_id == worker.worker_id:
                return
            selection_id = f"{request_id}:{next(self._selection_ids)}"
            moved = Choice(
                selection_id,
                worker.worker_id,
                worker.advert.dp_ranks[0],
                held.choice.ranking,
                Overlap(0, 0, 0),
            )
            self._reservations[request_id] = _Reservation(moved, held.created, held.prompt)
        self._free(held.choice.selection_id, "moved")
        request: dict[str, Any] = {
            "selection_id": selection_id,
            "model_name": self.model_name,
            "worker_id": moved.worker_id,
            "dp_rank": moved.dp_rank,
            "sequence_hashes": held.prompt["sequence_hashes"],
            "isl_tokens": held.prompt["isl_tokens"],
        }
        self.client.submit("create_reservation", request)

    def release(self, request_id: str) -> None:
        """Free the request's reservation (its attempt completed). Idempotent."""
        with self._lock:
            held = self._reservations.pop(request_id, None)
        if held is not None:
            self._free(held.choice.selection_id, "freed")
            self._check_tokens(held)

    def _check_tokens(self, held: _Reservation) -> None:
        """Count whether the serving worker's engine stored ``held``'s prompt, as the router
        tokenized it (:attr:`RouterStats.token_checks`), once its events had time to arrive."""
        full = len(held.prompt["block_hashes"])
        delay = self.token_check_delay_s
        if delay is None or full == 0:
            return
        worker_id = held.choice.worker_id

        async def check() -> None:
            await asyncio.sleep(delay)
            scores = await self.client.service.overlap_scores(held.prompt)
            seen = max(
                (
                    int(entry["host_pinned_blocks"])
                    for entry in scores["workers"]
                    if int(entry["worker_id"]) == worker_id
                ),
                default=0,
            )
            outcome = "confirmed" if seen >= full else "partial" if seen else "unconfirmed"
            self.stats.token_checks[outcome] += 1
            self.metrics.record_token_check(outcome)

        def done(future: concurrent.futures.Future[None]) -> None:
            with self._lock:
                self._checking.discard(future)
            if not future.cancelled() and future.exception() is not None:
                log.warning("token check failed", error=str(future.exception()))

        with contextlib.suppress(RuntimeError):  # the client closed: nothing left to check
            future = self.client.run(check())
            with self._lock:
                self._checking.add(future)
            future.add_done_callback(done)

    @property
    def reservations(self) -> int:
        """Reservations this state holds and has not freed."""
        with self._lock:
            return len(self._reservations)

    def _expire(self, now: float) -> None:
        expired: list[str] = []
        with self._lock:
            while self._reservations:
                request_id, held = next(iter(self._reservations.items()))
                if now - held.created < self.reservation_ttl_s:
                    break
                del self._reservations[request_id]
                expired.append(held.choice.selection_id)
        for selection_id in expired:
            self._free(selection_id, "expired")

    def _free(self, selection_id: str, outcome: str) -> None:
        def done(future: concurrent.futures.Future[Any]) -> None:
            with self._lock:
                self._freeing.discard(future)
            if future.cancelled() or future.exception() is not None:
                self.stats.registry["free_failed"] += 1
                log.warning("free_reservation failed", selection_id=selection_id)
            else:
                self.stats.registry[outcome] += 1

        future = self.client.submit("free_reservation", selection_id)
        with self._lock:
            self._freeing.add(future)
        future.add_done_callback(done)

    def close(self) -> None:
        with self._lock:
            checking = list(self._checking)
        for future in checking:  # cancelled on the service's loop before it stops
            future.cancel()
        self.client.close()


def _as_i64(values: list[int]) -> list[int]:
    """u64 hashes as the signed i64 values Dynamo's precomputed form takes."""
    return array("q", array("Q", values).tobytes()).tolist()


def _credit(overlap: Overlap) -> float:
    device, host, disk = overlap.device, overlap.host_pinned, overlap.disk
    return (
        TIER_CREDIT[0] * device + TIER_CREDIT[1] * (host - device) + TIER_CREDIT[2] * (disk - host)
    )


_STATES: dict[str, RoutingState] = {}
_STATES_LOCK = threading.Lock()


def routing_state(deployment: str, **options: Any) -> RoutingState:
    """The process's :class:`RoutingState` for ``deployment``, created on first use with
    ``options`` (later callers share it, whatever options they pass)."""
    with _STATES_LOCK:
        state = _STATES.get(deployment)
        if state is None:
            state = _STATES[deployment] = RoutingState(deployment, **options)
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
    for state in states:
        state.close()
