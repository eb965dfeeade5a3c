"""The router's state: Dynamo's ``SelectionService``, the replica registry, the reservations and
the decisions (the registry and the reservations have modules of their own, and so do the forms
of the service's requests and answers, :mod:`~kvbridge.ray_integration.selection_forms`).

This lives outside the router's module because Ray pickles a request router's module *by
value*: a service kept in the router's module would be copied into each process that unpickles
the router, and the copies would not share registrations or reservations. Every router instance
in a process finds the same :class:`RoutingState` for its deployment through
:func:`~kvbridge.ray_integration.routing_states.routing_state`.

A decision's service calls (``select_and_reserve``, and ``overlap_scores`` for a retry's
ranking) are made on the router's own loop, as a direct ``await`` of the service's future under
a timeout: Dynamo's answer then comes back with one thread switch (its thread to the router's
loop), where a round trip through another loop took three, about 0.2 ms of a 0.8 ms decision
(docs/benchmarks.md). A service that does not answer in time delays a decision by at most that
timeout, and Serve's loop never blocks on it: the call only converts the request (a few hundred
integers in the precomputed form) before it returns its future. Registrations and frees, which
no decision waits for, run on the :class:`~kvbridge.adapters.selection_client.SelectionClient`'s own
loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import structlog

from kvbridge.adapters.logs import LogLimiter
from kvbridge.adapters.selection_client import SelectionClient, SelectionServiceError
from kvbridge.ray_integration.decisions import Choice, Decision, NoChoice, Release, RouterStats
from kvbridge.ray_integration.registry import WorkerRegistry, worker_id_for
from kvbridge.ray_integration.reservations import Reservation, Reservations
from kvbridge.ray_integration.router_metrics import RouterMetrics
from kvbridge.ray_integration.selection_forms import (
    pick_overlap,
    precomputed_prompt,
    ranking,
    stored_blocks,
)

__all__ = [
    "Choice",
    "NoChoice",
    "RouterStats",
    "RoutingState",
    "worker_id_for",
]

log = structlog.get_logger("kvbridge.ray.router")


class RoutingState:
    """Dynamo's view of one deployment's replicas, in one process: the service, its
    :class:`~kvbridge.ray_integration.registry.WorkerRegistry`, the
    :class:`~kvbridge.ray_integration.reservations.Reservations` of the requests in flight, and
    the decisions.

    Args:
        deployment: a name for logs and metrics.
        block_size: the engines' block size; ``None`` pins the first replica's.
        model_name: Dynamo's model name for the deployment.
        select_timeout_s: how long a decision may wait for Dynamo before the fallback.
        reservation_ttl_s: a reservation whose completion never arrives is freed after this.
        indexer_threads: the service's indexer threads.
        tuning: Dynamo's router weights (see :data:`kvbridge.adapters.selection_client.TUNING_ENV`).
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
        self.model_name = model_name
        self.select_timeout_s = select_timeout_s
        self.client = SelectionClient(indexer_threads=indexer_threads, tuning=tuning)
        self.stats = RouterStats()
        self.metrics = RouterMetrics(deployment)
        self.registry = WorkerRegistry(
            self.client, self.stats.registry, block_size=block_size, model_name=model_name
        )
        self.held = Reservations(
            self.client,
            self.stats.registry,
            ttl_s=reservation_ttl_s,
            model_name=model_name,
            token_check=None if token_check_delay_s is None else self._check_tokens,
            token_check_delay_s=token_check_delay_s or 0.0,
            registered=self.registry.is_current,
        )
        self._lock = threading.Lock()
        self._attached: dict[str, Any] = {}
        self._warn = LogLimiter(log.warning)

    def attached(self, key: str, make: Callable[[], Any]) -> Any:
        """What a router class keeps per deployment and process under ``key`` (a relay hop, a
        tokenizer), made by ``make()`` on first use. It lives on the state, not in the router's
        module, because Ray copies that module's globals (a lock there would not even pickle).
        """
        with self._lock:
            if key not in self._attached:
                self._attached[key] = make()
            return self._attached[key]

    def relay_replaced(self) -> None:
        """Count a router-side relay that stopped on an error and was replaced
        (:attr:`RouterStats.relays_replaced`, and Ray's metric)."""
        self.stats.relays_replaced += 1
        self.metrics.record_relay_replaced()

    def attachment(self, key: str) -> Any | None:
        """What :meth:`attached` keeps under ``key``, if anything made it yet."""
        with self._lock:
            return self._attached.get(key)

    # ------------------------------------------------------------------ registry

    @property
    def block_size(self) -> int | None:
        """The engines' block size (pinned by the first advert if not given)."""
        return self.registry.block_size

    def sync(
        self, replicas: Mapping[str, Mapping[str, Any] | None], *, complete: bool
    ) -> concurrent.futures.Future[None] | None:
        """Bring Dynamo's workers in line with ``replicas`` (see :meth:`WorkerRegistry.sync
        <kvbridge.ray_integration.registry.WorkerRegistry.sync>`)."""
        return self.registry.sync(replicas, complete=complete)

    def forget(self, replica_id: str) -> concurrent.futures.Future[None] | None:
        """Deregister a replica now (its actor died)."""
        return self.registry.forget(replica_id)

    @property
    def registry_version(self) -> int:
        """Changes whenever :meth:`ready_workers` may answer differently for the same replicas."""
        return self.registry.registry_version

    def ready_workers(self, replica_ids: Sequence[str]) -> dict[int, str]:
        """``{worker_id: replica_id}`` of the given replicas that Dynamo has registered."""
        return self.registry.ready_workers(replica_ids)

    # ------------------------------------------------------------------ decisions

    async def choose(
        self,
        request_id: str,
        token_ids: Sequence[int],
        workers: Mapping[int, str],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        started: float | None = None,
    ) -> Choice:
        """Dynamo's pick among ``workers`` ({worker_id: replica_id}), reserved until
        :meth:`release`, for a prompt of ``token_ids`` under ``lora_name`` and ``cache_salt``
        (both hashed into its blocks, as vLLM and the relay do). ``started`` (a
        ``time.perf_counter()``) is when the decision began, for its latency.

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
        self.held.expire(time.monotonic())
        held = self.held.get(request_id)
        if held is not None and held.choice.worker_id in workers:
            self.stats.outcomes["repeat"] += 1
            return await self._ranked(request_id, held, workers)
        if held is not None:  # its pick left the candidates: Dynamo picks anew
            self.held.cancel(request_id, Release.RESELECTED)
        if not workers:
            raise NoChoice("no_workers")
        selection_id = self.held.selection_id(request_id)
        assert self.block_size is not None  # pinned when the first worker registered
        prompt = precomputed_prompt(
            token_ids, self.block_size, lora_name, self.model_name, cache_salt
        )
        request = {**prompt, "selection_id": selection_id, "allowed_worker_ids": list(workers)}
        # Shielded: a selection that answers after the timeout (or after the caller was
        # cancelled) has reserved load, which Reservations.free_late frees.
        future = asyncio.ensure_future(self._select(request))
        try:
            choice = await asyncio.wait_for(asyncio.shield(future), self.select_timeout_s)
        except TimeoutError:
            future.add_done_callback(self.held.free_late)
            timeout_s = self.select_timeout_s
            late = functools.partial(self._answered_late, request_id, started, timeout_s)
            future.add_done_callback(late)
            raise NoChoice("timeout", f"no answer in {timeout_s} s") from None
        except asyncio.CancelledError:
            future.add_done_callback(self.held.free_late)
            raise
        except (SelectionServiceError, ValueError) as error:
            raise NoChoice("service_error", str(error)) from None
        replica_id = workers.get(choice.worker_id)  # Dynamo picks among them
        booked_on = None if replica_id is None else self.registry.worker(replica_id)
        self.held.hold(request_id, choice, prompt, booked_on)
        latency = time.perf_counter() - started
        self._record(request_id, replica_id, choice, None, latency)
        return choice

    async def _select(self, request: dict[str, Any]) -> Choice:
        """Select and reserve, one call."""
        # A free and a selection submitted after it run concurrently in the service; without
        # this wait the selection may still count the freed request's load.
        freeing = [asyncio.wrap_future(future) for future in self.held.in_flight()]
        if freeing:
            await asyncio.wait(freeing)
        answer = await self.client.service.select_and_reserve(request)
        worker_id, dp_rank = int(answer["worker_id"]), int(answer["dp_rank"])
        assert self.block_size is not None
        overlap = pick_overlap(answer, self.block_size)
        return Choice(request["selection_id"], worker_id, dp_rank, [[worker_id]], overlap)

    async def _ranked(
        self, request_id: str, held: Reservation, workers: Mapping[int, str]
    ) -> Choice:
        """``held``'s choice with the other ``workers`` ranked by their overlap credit with the
        request's prompt (asked of Dynamo once per request); if Dynamo does not answer within
        the selection timeout, the others form one group, balanced by queue length."""
        if len(held.choice.ranking) > 1:
            return held.choice
        scores: Mapping[str, Any] | None = None
        try:
            scores = await asyncio.wait_for(
                self.client.service.overlap_scores(held.prompt), self.select_timeout_s
            )
        except (TimeoutError, SelectionServiceError, ValueError) as error:
            log.warning("overlap_scores failed; others unranked", error=str(error))
        ranked = ranking(held.choice.worker_id, workers, scores)
        choice = dataclasses.replace(held.choice, ranking=ranked)
        self.held.rerank(request_id, held, choice)
        return choice

    def _answered_late(
        self, request_id: str, started: float, timeout_s: float, future: asyncio.Future[Choice]
    ) -> None:
        """Log when a selection that outlived its timeout did answer, or how it ended: whether
        Dynamo was slow or never answered is what an operator needs to know of a timeout."""
        error = None
        if future.cancelled():
            error = "cancelled"
        elif (exception := future.exception()) is not None:
            error = str(exception)
        self._warn(
            "selection ended after its timeout",
            "late",
            deployment=self.deployment,
            request_id=request_id,
            # to the microsecond: a timeout can be that short, and Dynamo's answer that fast
            after_s=round(time.perf_counter() - started, 6),
            timeout_s=timeout_s,
            error=error,
        )

    def fallback(self, request_id: str, reason: str, latency_s: float, detail: str = "") -> None:
        """Count a request routed without Dynamo, and log why (a few lines a minute at most
        for each reason)."""
        self._record(request_id, None, None, reason, latency_s)
        self._warn(
            "request routed without Dynamo",
            reason,
            deployment=self.deployment,
            request_id=request_id,
            reason=reason,
            detail=detail or None,
        )

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
        """Serve placed the request on ``replica_id``: the reservation follows it there, or is
        freed if Dynamo has not registered that replica (or not yet)."""
        worker = self.registry.worker(replica_id)
        if worker is None or not worker.ready:
            self.held.cancel(request_id, Release.UNREGISTERED)
        else:
            self.held.move(request_id, worker)

    def release(self, request_id: str) -> None:
        """Free the request's reservation (its attempt completed). Idempotent."""
        self.held.release(request_id)

    def cancelled(self, request_id: str) -> None:
        """The caller gave the request up before Serve placed it: free its reservation, which
        no placement or completion would free before its time to live. Idempotent."""
        self.held.cancel(request_id)

    @property
    def reservations(self) -> int:
        """Reservations this state holds and has not freed."""
        return len(self.held)

    async def _check_tokens(self, prompt: dict[str, Any], worker_id: int) -> None:
        """Count whether ``worker_id``'s engine stored ``prompt`` as the router hashed it
        (:attr:`RouterStats.token_checks`): its overlap in Dynamo's index, which the engine's
        own token ids fed, against the prompt's full blocks."""
        scores = await self.client.service.overlap_scores(prompt)
        seen = stored_blocks(scores, worker_id)
        full = len(prompt["block_hashes"])
        outcome = "confirmed" if seen >= full else "partial" if seen else "unconfirmed"
        self.stats.token_checks[outcome] += 1
        self.metrics.record_token_check(outcome)

    def close(self) -> None:
        self.held.cancel_checks()  # on the service's loop, before it stops
        self.client.close()
