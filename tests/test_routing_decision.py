"""``RoutingState.choose``: one Dynamo call per decision, and the ranking when Serve asks again.

Three ``SimulatedEngine`` replicas, registered with the state's real Dynamo ``SelectionService``:
A has cached all 6 blocks of the prompt, B its first 3, C nothing. The first answer is Dynamo's
pick alone, with the pick's overlap by tier taken from ``select_and_reserve``; Serve asks again
for the same request when the pick is full, and that answer ranks the others by their overlap.
When there is no answer, the reason is counted and logged with what the service said, and a
selection that outlived its timeout is logged again when it ends, with how late it was.
"""

from __future__ import annotations

import asyncio
import time
from array import array
from collections import Counter
from collections.abc import Iterator

import msgspec
import pytest
import structlog

pytest.importorskip("ray.serve")

from kvbridge.ray_integration import KVEventsAdvert, RoutingState, worker_id_for
from kvbridge.ray_integration.decisions import NoChoice
from kvbridge.ray_integration.reservations import Release
from kvbridge.schemas import Overlap
from kvbridge.testing import SimulatedEngine

BLOCK = 16
PROMPT = [300 + i for i in range(BLOCK * 6)]
REPLICAS = ("ra", "rb", "rc")
TOKEN_CHECK_DELAY_S = 0.5
"""RoutingState's default: a completed request's tokens are checked this long after."""
NO_ENDPOINTS = "no endpoints available to route work"
"""Dynamo's error for a selection among worker ids it does not know."""


@pytest.fixture
def state() -> Iterator[RoutingState]:
    engines = [SimulatedEngine(block_size=BLOCK) for _ in REPLICAS]
    state = RoutingState("decision#test", block_size=BLOCK)
    try:
        stats = {
            replica: KVEventsAdvert(
                endpoints={0: engine.endpoint}, block_size=BLOCK
            ).routing_stats()
            for replica, engine in zip(REPLICAS, engines, strict=True)
        }
        registering = state.sync(stats, complete=True)
        assert registering is not None
        registering.result(10)
        for engine in engines:
            assert engine.wait_for_subscribers(1)
        time.sleep(0.2)
        engines[0].generate(PROMPT)
        engines[1].generate(PROMPT[: BLOCK * 3])
        workers = state.ready_workers(REPLICAS)
        deadline = time.monotonic() + 10
        while asyncio.run(_device_overlap(state, workers)) != 6:
            assert time.monotonic() < deadline, "Dynamo never indexed A's prompt"
            time.sleep(0.05)
        yield state
    finally:
        state.close()
        for engine in engines:
            engine.close()


async def _device_overlap(state: RoutingState, workers: dict[int, str]) -> int:
    choice = await state.choose("probe", PROMPT, workers)
    state.release("probe")
    return choice.overlap.device


def test_first_answer_is_the_pick_and_a_repeat_ranks_the_others(state: RoutingState) -> None:
    workers = state.ready_workers(REPLICAS)
    a, b, c = (worker_id_for(replica) for replica in REPLICAS)

    async def decide() -> None:
        first = await state.choose("request", array("I", PROMPT), workers)
        assert (first.worker_id, first.ranking) == (a, [[a]])
        assert first.overlap == Overlap(6, 6, 6)
        # Serve asks again (the pick is full): same pick, same reservation, the others ranked.
        again = await state.choose("request", PROMPT, workers)
        assert again.selection_id == first.selection_id
        assert again.ranking == [[a], [b], [c]]
        assert again.overlap == first.overlap
        assert await state.choose("request", PROMPT, workers) == again  # ranked once

    asyncio.run(decide())
    assert state.stats.outcomes["repeat"] == 2
    assert state.reservations == 1
    assert state.client.active_reservations() == 1
    state.release("request")
    deadline = time.monotonic() + 5
    while state.client.active_reservations():
        assert time.monotonic() < deadline, "the reservation was never freed"
        time.sleep(0.01)


def test_a_request_placed_on_an_unregistered_replica_frees_its_reservation(
    state: RoutingState,
) -> None:
    """Serve placed the request on a replica Dynamo has not registered (its last resort when
    every registered one is full): the booking on Dynamo's pick is freed, counted
    ``unregistered``, since Dynamo cannot move it to a worker it does not know. The completion
    that follows frees nothing more."""
    workers = state.ready_workers(REPLICAS)
    while state.held.in_flight():  # the fixture's probes' frees, counted when applied
        time.sleep(0.01)
    releases = Counter(state.stats.registry.releases)
    asyncio.run(state.choose("request", PROMPT, workers))
    assert state.client.active_reservations() == 1
    state.routed("request", "not-registered")
    assert state.reservations == 0
    state.release("request")
    deadline = time.monotonic() + 5
    while state.client.active_reservations() or state.held.in_flight():
        assert time.monotonic() < deadline, "the reservation was never freed"
        time.sleep(0.01)
    assert state.stats.registry.releases - releases == Counter({Release.UNREGISTERED: 1})


def test_a_retry_whose_pick_left_the_candidates_is_picked_anew(state: RoutingState) -> None:
    """Serve asks again for a request whose pick is no longer a candidate: Dynamo picks anew
    among the candidates, and the old booking is freed, counted ``reselected``, while its
    worker is registered. A deregistered worker's bookings went with it in Dynamo: none is
    freed then (the free would fail, counted ``free_failed``), counted ``deregistered``."""
    workers = state.ready_workers(REPLICAS)
    a = worker_id_for(REPLICAS[0])

    def settled() -> None:
        deadline = time.monotonic() + 5
        while state.held.in_flight():  # frees are counted when Dynamo has applied them
            assert time.monotonic() < deadline, "a free never settled"
            time.sleep(0.01)

    settled()
    releases = Counter(state.stats.registry.releases)
    assert asyncio.run(state.choose("request", PROMPT, workers)).worker_id == a
    others = {worker: replica for worker, replica in workers.items() if worker != a}
    second = asyncio.run(state.choose("request", PROMPT, others))
    assert second.worker_id in others
    settled()
    assert state.stats.registry.releases - releases == Counter({Release.RESELECTED: 1})
    assert (state.reservations, state.client.active_reservations()) == (1, 1)

    forgetting = state.forget(others.pop(second.worker_id))
    assert forgetting is not None
    forgetting.result(10)
    third = asyncio.run(state.choose("request", PROMPT, others))
    assert list(others) == [third.worker_id]
    settled()
    gone = Counter({Release.RESELECTED: 1, Release.DEREGISTERED: 1})
    assert state.stats.registry.releases - releases == gone
    assert state.stats.registry.free_failed == 0
    assert (state.reservations, state.client.active_reservations()) == (1, 1)


def test_a_booking_on_a_worker_registered_anew_is_not_freed(state: RoutingState) -> None:
    """A replica whose advert changed is registered anew with Dynamo (deleted, then added), which
    drops its bookings: the completion of a request booked before sends no free, which would
    fail (``free_failed``) and log a warning, and is counted ``deregistered``. Its tokens are not
    checked against a registration that is gone."""
    workers = state.ready_workers(REPLICAS)
    a = worker_id_for(REPLICAS[0])
    time.sleep(TOKEN_CHECK_DELAY_S + 0.3)  # the fixture's probes' frees and token checks
    releases = Counter(state.stats.registry.releases)
    checks = Counter(state.stats.token_checks)
    assert asyncio.run(state.choose("request", PROMPT, {a: REPLICAS[0]})).worker_id == a
    advert = state.registry.worker(REPLICAS[0])
    assert advert is not None
    moved = msgspec.structs.replace(advert.advert, replay_endpoints={0: "tcp://127.0.0.1:1"})
    registering = state.sync({REPLICAS[0]: moved.routing_stats()}, complete=False)
    assert registering is not None
    registering.result(10)
    assert state.client.active_reservations() == 0  # gone with the old registration
    state.release("request")
    time.sleep(TOKEN_CHECK_DELAY_S + 0.3)  # when a check would have run
    assert state.stats.registry.releases - releases == Counter({Release.DEREGISTERED: 1})
    assert state.stats.registry.free_failed == 0
    assert state.stats.token_checks == checks
    assert state.ready_workers(REPLICAS) == workers  # registered anew, same worker ids


def test_no_answer_is_counted_and_logged_with_why(state: RoutingState) -> None:
    workers = state.ready_workers(REPLICAS)

    async def decide(request_id: str, allowed: dict[int, str]) -> NoChoice:
        with pytest.raises(NoChoice) as raised:
            await state.choose(request_id, PROMPT, allowed)
        state.fallback(request_id, raised.value.reason, 0.001, raised.value.detail)
        return raised.value

    async def run() -> tuple[NoChoice, NoChoice]:
        # A worker id Dynamo never registered: the service refuses the selection.
        refused = await decide("ghost", {1: "ghost"})
        # No selection meets a 1 us timeout; Dynamo's answer comes later, on this loop, and
        # its reservation is freed.
        state.select_timeout_s = 1e-6
        try:
            late = await decide("slow", workers)
        finally:
            state.select_timeout_s = 1.0
        deadline = time.monotonic() + 5
        while state.stats.registry.releases[Release.LATE_FREED] != 1:
            assert time.monotonic() < deadline, "the late reservation was never freed"
            await asyncio.sleep(0.01)
        return refused, late

    with structlog.testing.capture_logs() as lines:
        refused, late = asyncio.run(run())

    assert (refused.reason, refused.detail) == ("service_error", NO_ENDPOINTS)
    assert (late.reason, late.detail) == ("timeout", "no answer in 1e-06 s")
    assert state.stats.fallbacks == {"service_error": 1, "timeout": 1}
    fallbacks = [line for line in lines if line["event"] == "request routed without Dynamo"]
    assert [(line["request_id"], line["reason"], line["detail"]) for line in fallbacks] == [
        ("ghost", "service_error", NO_ENDPOINTS),
        ("slow", "timeout", "no answer in 1e-06 s"),
    ]
    assert {line["deployment"] for line in fallbacks} == {"decision#test"}
    (ended,) = [line for line in lines if line["event"] == "selection ended after its timeout"]
    assert (ended["request_id"], ended["timeout_s"], ended["error"]) == ("slow", 1e-6, None)
    assert 0 < ended["after_s"] < 5
    assert state.client.active_reservations() == 0
