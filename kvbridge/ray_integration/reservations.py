"""The load Dynamo books for requests in flight, and what the router learns when they complete.

A decision reserves its pick in the ``SelectionService`` (``select_and_reserve``); the
reservation is held per request until Serve says the request completed, moved when Serve placed
the request on another replica, freed when a late answer reserved load nobody uses, and expired
after a TTL when no completion ever comes. On completion the router also checks its token ids
against the engine's (:meth:`Reservations.release`). One of the parts of a
:class:`~kvbridge.ray_integration.routing.RoutingState`; the frees and checks run on the
:class:`~kvbridge.adapters.selection_client.SelectionClient`'s loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from kvbridge.adapters.selection_client import SelectionClient
from kvbridge.ray_integration.decisions import Choice, RegistryStats, Release
from kvbridge.ray_integration.registry import Worker
from kvbridge.schemas import Overlap

__all__ = ["Reservation", "Reservations"]

log = structlog.get_logger("kvbridge.ray.router")


@dataclass
class Reservation:
    """One request's booked load: Dynamo's choice and the prompt, in the precomputed form."""

    choice: Choice
    created: float
    prompt: dict[str, Any]
    booking: concurrent.futures.Future[Any] | None = None
    """A moved reservation's ``create_reservation``, submitted and perhaps not yet applied:
    its free is sent once that is done, or the free could reach Dynamo first, fail, and leave
    the booking to stay for good."""
    worker: Worker | None = None
    """The registration the load is booked on: Dynamo drops a worker's bookings when it is
    deregistered, or registered anew after its advert changed, and then there is nothing to
    free (a free would fail)."""


class Reservations:
    """The reservations of one deployment's router in this process.

    Args:
        client: the deployment's selection service.
        counts: where the frees (by :class:`~kvbridge.ray_integration.decisions.Release`)
            and failed frees are counted (the router's registry stats).
        ttl_s: a reservation whose completion never arrives is freed after this.
        model_name: Dynamo's model name for the deployment.
        token_check: called with ``(prompt, worker_id)`` on the service's loop, ``delay_s``
            after each request completed (see :attr:`RouterStats.token_checks
            <kvbridge.ray_integration.decisions.RouterStats.token_checks>`); ``None``: no checks.
        registered: whether a registration is still the registry's (its bookings stand).
    """

    def __init__(
        self,
        client: SelectionClient,
        counts: RegistryStats,
        *,
        ttl_s: float,
        model_name: str,
        token_check: Callable[[dict[str, Any], int], Any] | None,
        token_check_delay_s: float,
        registered: Callable[[Worker], bool],
    ) -> None:
        self.client = client
        self.counts = counts
        self.ttl_s = ttl_s
        self.model_name = model_name
        self._token_check = token_check
        self._token_check_delay_s = token_check_delay_s
        self._registered = registered
        self._lock = threading.Lock()
        self._held: OrderedDict[str, Reservation] = OrderedDict()
        self._freeing: set[concurrent.futures.Future[Any]] = set()
        """Frees submitted and not yet applied: a selection waits for them (see in_flight)."""
        self._checking: set[concurrent.futures.Future[None]] = set()
        """Token checks waiting for their delay or for Dynamo."""
        self._selection_ids = itertools.count()

    def selection_id(self, request_id: str) -> str:
        """A new selection id for ``request_id`` (Dynamo's key of one reservation)."""
        return f"{request_id}:{next(self._selection_ids)}"

    def get(self, request_id: str) -> Reservation | None:
        with self._lock:
            return self._held.get(request_id)

    def hold(
        self, request_id: str, choice: Choice, prompt: dict[str, Any], worker: Worker | None
    ) -> None:
        """Keep the reservation of ``choice``, booked on ``worker``'s registration."""
        with self._lock:
            self._held[request_id] = Reservation(choice, time.monotonic(), prompt, worker=worker)

    def rerank(self, request_id: str, held: Reservation, choice: Choice) -> None:
        """Keep ``choice`` (``held``'s, ranked) unless the request's reservation changed since."""
        with self._lock:
            if self._held.get(request_id) is held:
                self._held[request_id] = dataclasses.replace(held, choice=choice)

    def move(self, request_id: str, worker: Worker) -> None:
        """Serve placed the request on ``worker_id``. If that is not Dynamo's pick (the pick was
        full and Serve took a replica of a lower rank), move the reservation there, so that
        Dynamo books the load where it is."""
        worker_id, dp_rank = worker.worker_id, worker.advert.dp_ranks[0]
        with self._lock:
            held = self._held.get(request_id)
            if held is None or held.choice.worker_id == worker_id:
                return
            selection_id = self.selection_id(request_id)
            moved = Choice(selection_id, worker_id, dp_rank, held.choice.ranking, Overlap(0, 0, 0))
            booking: concurrent.futures.Future[Any] = concurrent.futures.Future()
            self._held[request_id] = Reservation(moved, held.created, held.prompt, booking, worker)
        self._free_held(held, Release.MOVED)
        request: dict[str, Any] = {
            "selection_id": selection_id,
            "model_name": self.model_name,
            "worker_id": worker_id,
            "dp_rank": dp_rank,
            "sequence_hashes": held.prompt["sequence_hashes"],
            "isl_tokens": held.prompt["isl_tokens"],
        }
        created = self.client.submit("create_reservation", request)
        created.add_done_callback(lambda _: booking.set_result(None))

    def release(self, request_id: str) -> None:
        """Free the request's reservation (its attempt completed), then check its tokens.
        Idempotent."""
        with self._lock:
            held = self._held.pop(request_id, None)
        if held is None:
            return
        booked = self._free_held(held, Release.FREED)
        if booked and self._token_check is not None and held.prompt["block_hashes"]:
            self._check_later(held)

    def cancel(self, request_id: str, reason: Release = Release.CANCELLED) -> None:
        """Free the reservation of a request that will not run where it was booked: its caller
        gave it up before Serve placed it, Serve placed it where Dynamo books nothing, or its
        pick left the candidates and Dynamo picks anew. Its tokens are not checked.
        Idempotent."""
        with self._lock:
            held = self._held.pop(request_id, None)
        if held is not None:
            self._free_held(held, reason)

    def _check_later(self, held: Reservation) -> None:
        check, delay = self._token_check, self._token_check_delay_s
        assert check is not None

        async def later() -> None:
            await asyncio.sleep(delay)
            await check(held.prompt, held.choice.worker_id)

        def done(future: concurrent.futures.Future[None]) -> None:
            with self._lock:
                self._checking.discard(future)
            if not future.cancelled() and future.exception() is not None:
                log.warning("token check failed", error=str(future.exception()))

        with contextlib.suppress(RuntimeError):  # the client closed: nothing left to check
            future = self.client.run(later())
            with self._lock:
                self._checking.add(future)
            future.add_done_callback(done)

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def expire(self, now: float) -> None:
        """Free the reservations older than the TTL (``now`` from ``time.monotonic()``)."""
        expired: list[Reservation] = []
        with self._lock:
            while self._held:
                request_id, held = next(iter(self._held.items()))
                if now - held.created < self.ttl_s:
                    break
                del self._held[request_id]
                expired.append(held)
        for held in expired:
            self._free_held(held, Release.EXPIRED)

    def free_late(self, future: asyncio.Future[Choice]) -> None:
        """A selection that answered after its timeout reserved load nobody will use: free it."""
        if future.cancelled() or future.exception() is not None:
            return
        self.free(future.result().selection_id, Release.LATE_FREED)

    def _free_held(self, held: Reservation, outcome: Release) -> bool:
        """Free ``held``'s booking, after its ``create_reservation`` if that is still on its
        way (see :attr:`Reservation.booking`); the wait counts as a free in flight. A booking
        whose registration is gone went with it in Dynamo: nothing is sent, and it is counted
        ``deregistered``. Returns whether the registration stands."""
        if held.worker is not None and not self._registered(held.worker):
            self.counts.releases[Release.DEREGISTERED] += 1
            return False
        booking, selection_id = held.booking, held.choice.selection_id
        if booking is None or booking.done():
            self.free(selection_id, outcome)
            return True
        with self._lock:
            self._freeing.add(booking)

        def booked(done: concurrent.futures.Future[Any]) -> None:
            self.free(selection_id, outcome)
            with self._lock:
                self._freeing.discard(done)

        booking.add_done_callback(booked)
        return True

    def free(self, selection_id: str, outcome: Release) -> None:
        def done(future: concurrent.futures.Future[Any]) -> None:
            if future.cancelled() or future.exception() is not None:
                self.counts.free_failed += 1
                log.warning("free_reservation failed", selection_id=selection_id)
            else:
                self.counts.releases[outcome] += 1
            with self._lock:  # counted first: a free out of in_flight() is counted
                self._freeing.discard(future)

        future = self.client.submit("free_reservation", selection_id)
        with self._lock:
            self._freeing.add(future)
        future.add_done_callback(done)

    def in_flight(self) -> list[concurrent.futures.Future[Any]]:
        """The frees submitted and not yet applied. A free and a selection submitted after it
        run concurrently in the service: a selection waits for these, or it may still count a
        freed request's load."""
        with self._lock:
            return list(self._freeing)

    def cancel_checks(self) -> None:
        """Cancel the token checks still waiting (before the service's loop stops)."""
        with self._lock:
            checking = list(self._checking)
        for future in checking:
            future.cancel()
