"""``DynamoLLMRouter``'s relay hop, with no Serve and no vLLM in the way: real ZMQ, a real
Dynamo ``SelectionService`` (the router's ``RoutingState``) and ``SimulatedEngine`` replicas that
advertise raw streams the way Ray Serve LLM's ``LLMServer`` does (``kv_event_metadata``).

The hop turns each raw advert into the advert of a relay in this process, and the registry only
ever sees the relay's loopback endpoints; engines whose hashes Dynamo cannot use as they are
(bytes digests, a per-engine hash seed) are still routed by their cached prefix.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("ray.serve")

from support.polling import wait_until
from support.relay_faults import inject_step_fault, stopped

from kvbridge.adapters.relay import Relay
from kvbridge.ray_integration import RoutingState, read_advert, worker_id_for
from kvbridge.ray_integration.advert import RAY_LLM_STATS_KEY, ROUTING_STATS_KEY
from kvbridge.ray_integration.llm_router import _RelayedRouting
from kvbridge.ray_integration.relay_hop import RELAY_RETRY_S, RelayHop, relay_hop
from kvbridge.testing import SimulatedEngine

BLOCK = 16
PROMPT = [1000 + i for i in range(BLOCK * 6)]  # 6 full blocks
OTHER = [5000 + i for i in range(BLOCK * 4)]


def ray_llm_stats(engine: SimulatedEngine, *, replay: bool = True) -> dict[str, Any]:
    """Routing stats as Ray Serve LLM's LLMServer reports them for ``engine``."""
    metadata: dict[str, Any] = {
        "endpoint": engine.endpoint,
        "block_size": engine.block_size,
        "dp_rank": engine.dp_rank,
        "max_num_batched_tokens": 2048,
    }
    if replay:
        metadata["replay_endpoint"] = engine.replay_endpoint
    return {RAY_LLM_STATS_KEY: metadata}


@pytest.fixture
def engines() -> Iterator[tuple[SimulatedEngine, SimulatedEngine]]:
    # Different hashes for the same tokens: A publishes 32-byte digests, B another seed's u64s.
    a = SimulatedEngine(block_size=BLOCK, bytes_hashes=True, bind=True)
    b = SimulatedEngine(block_size=BLOCK, hash_seed="replica-b", bind=True)
    yield a, b
    a.close()
    b.close()


@pytest.fixture
def hop() -> Iterator[RelayHop]:
    hop = RelayHop()
    yield hop
    hop.close()


def test_raw_advert_becomes_the_relays(
    hop: RelayHop, engines: tuple[SimulatedEngine, SimulatedEngine]
) -> None:
    a, b = engines
    stats_a, stats_b = ray_llm_stats(a), ray_llm_stats(b, replay=False)
    canonical = {ROUTING_STATS_KEY: {"endpoints": {0: "tcp://10.0.0.9:7000"}, "block_size": BLOCK}}
    out = hop.translate({"ra": stats_a, "rb": stats_b, "rc": canonical, "rd": None}, complete=True)
    assert out["rc"] is canonical  # kvbridge's own adverts pass as they are
    assert out["rd"] is None
    advert_a, advert_b = read_advert(out["ra"]), read_advert(out["rb"])
    assert advert_a is not None and advert_b is not None
    assert advert_a.canonical and advert_b.canonical
    assert advert_a == hop.endpoints("ra")
    for advert, engine in ((advert_a, a), (advert_b, b)):
        assert advert.block_size == BLOCK
        assert list(advert.endpoints) == [0]
        assert advert.endpoints[0].startswith("tcp://127.0.0.1:")
        assert advert.endpoints[0] != engine.endpoint
    assert list(advert_a.replay_endpoints) == [0]
    assert advert_a.replay_endpoints[0].startswith("tcp://127.0.0.1:")
    assert advert_b.replay_endpoints == {0: advert_b.replay_endpoints[0]}  # the relay's own
    relay = hop.relay("ra")
    assert relay is not None
    assert [source.worker_id for source in relay.outputs] == [worker_id_for("ra")]
    assert hop.started == 2

    # The same stats object gives the same answer object (the registry's identity check).
    again = hop.translate({"ra": stats_a, "rb": stats_b}, complete=False)
    assert again["ra"] is out["ra"] and again["rb"] is out["rb"]
    # An equal advert in a new dict keeps the relay.
    same = hop.translate({"ra": dict(stats_a), "rb": stats_b}, complete=False)
    assert same["ra"] is out["ra"]
    assert hop.started == 2

    # A changed advert (the replica's engine restarted elsewhere) replaces the relay.
    moved = {RAY_LLM_STATS_KEY: {**stats_a[RAY_LLM_STATS_KEY], "endpoint": b.endpoint}}
    replaced = hop.translate({"ra": moved, "rb": stats_b}, complete=True)
    assert replaced["ra"] != out["ra"]
    assert (hop.started, hop.closed) == (3, 1)
    # A replica no longer listed loses its relay, and a dead one too.
    hop.translate({"rb": stats_b}, complete=True)
    assert hop.relay("ra") is None and hop.closed == 2
    hop.forget("rb")
    assert hop.relay("rb") is None and hop.closed == 3


def test_invalid_raw_advert_passes_to_the_registry(hop: RelayHop) -> None:
    bad = {RAY_LLM_STATS_KEY: {"endpoint": "tcp://127.0.0.1:1", "block_size": 0}}
    assert hop.translate({"r": bad}, complete=True)["r"] is bad
    assert hop.started == 0


def test_hop_lives_on_the_routing_state() -> None:
    state = RoutingState("llm#hop", block_size=BLOCK)
    try:
        assert relay_hop(state) is relay_hop(state)
    finally:
        relay_hop(state).close()
        state.close()


def test_relayed_replicas_route_by_their_cached_prefix(
    engines: tuple[SimulatedEngine, SimulatedEngine],
) -> None:
    """Both engines register through their relays; each prompt goes to the engine that cached
    it, with its full device overlap, whatever hashes the engine publishes."""
    a, b = engines
    state = RoutingState("llm#route", block_size=BLOCK)
    hop = relay_hop(state)
    replicas = {"ra": ray_llm_stats(a), "rb": ray_llm_stats(b)}
    try:
        registering = state.sync(hop.translate(replicas, complete=True), complete=True)
        assert registering is not None
        registering.result(10)
        ready = state.ready_workers(["ra", "rb"])
        assert sorted(ready.values()) == ["ra", "rb"]
        # Cached before the relays' Dynamo subscribed: the relay's replay on start brings them.
        a.generate(PROMPT)
        b.generate(OTHER)

        async def choose(request_id: str, tokens: list[int]) -> tuple[str, int]:
            choice = await state.choose(request_id, tokens, ready)
            state.release(request_id)
            return ready[choice.worker_id], choice.overlap.device

        expected = {"prompt": ("ra", 6), "other": ("rb", 4)}

        def indexed() -> bool:
            got = {
                "prompt": asyncio.run(choose("probe-a", PROMPT)),
                "other": asyncio.run(choose("probe-b", OTHER)),
            }
            return got == expected

        deadline = time.monotonic() + 10
        while not indexed():
            assert time.monotonic() < deadline, "Dynamo never indexed both relayed workers"
            time.sleep(0.05)
        for i in range(5):
            assert asyncio.run(choose(f"p{i}", [*PROMPT, 7, 7, 7])) == ("ra", 6)
            assert asyncio.run(choose(f"o{i}", OTHER[: BLOCK * 2])) == ("rb", 2)
        for replica in ("ra", "rb"):
            relay = hop.relay(replica)
            assert relay is not None and relay.stats.batches_in >= 1
        assert state.stats.registry.registered == 2
    finally:
        hop.close()
        state.close()


def test_dynamo_alone_misses_what_the_relay_routes(
    engines: tuple[SimulatedEngine, SimulatedEngine],
) -> None:
    """The same raw adverts registered as they are (what Ray's own KVAwareRouter does) and
    through the hop, side by side: Dynamo alone cannot index A's bytes digests, so A's prompt
    finds no overlap there, and the relayed state finds all 6 blocks."""
    a, b = engines
    raw = RoutingState("llm#raw", block_size=BLOCK)
    relayed = RoutingState("llm#relayed", block_size=BLOCK)
    hop = relay_hop(relayed)
    replicas = {"ra": ray_llm_stats(a), "rb": ray_llm_stats(b)}
    try:
        for state, stats in ((raw, replicas), (relayed, hop.translate(replicas, complete=True))):
            registering = state.sync(stats, complete=True)
            assert registering is not None
            registering.result(10)
        time.sleep(0.5)  # Dynamo's listeners connect to the raw PUBs (no replay from them)
        a.generate(PROMPT)
        b.generate(OTHER)

        async def overlap(state: RoutingState, request_id: str) -> int:
            ready = state.ready_workers(["ra", "rb"])
            choice = await state.choose(request_id, PROMPT, {worker_id_for("ra"): "ra"})
            state.release(request_id)
            assert ready
            return choice.overlap.device

        deadline = time.monotonic() + 10
        while asyncio.run(overlap(relayed, "probe")) != 6:
            assert time.monotonic() < deadline, "the relayed state never indexed A"
            time.sleep(0.05)
        time.sleep(0.5)
        assert asyncio.run(overlap(raw, "raw")) == 0
        assert asyncio.run(overlap(relayed, "relayed")) == 6
    finally:
        hop.close()
        raw.close()
        relayed.close()


def test_package_import_does_not_load_vllm() -> None:
    code = (
        "import sys, kvbridge.ray_integration, kvbridge.ray_integration.llm_router;"
        "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('ray.serve.llm')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def broken(relay: Relay) -> Relay:
    """``relay`` after a fault injected into its step has ended its thread."""
    inject_step_fault(relay)
    return stopped(relay)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_relay_that_stopped_is_replaced(
    engines: tuple[SimulatedEngine, SimulatedEngine],
) -> None:
    """A replica's relay in the router stops on an error. Serve syncs the replicas only when
    they change, so the router looks for failed relays before each request
    (``resync_failed_relays``): the replica is relayed anew on new ports, Dynamo re-registers
    it on the new advert, and what the engine cached before and after reaches Dynamo through
    the new relay. A relay that fails again is replaced only after the replica's back-off."""
    a, _ = engines
    state = RoutingState("llm#failed", block_size=BLOCK)
    hop = relay_hop(state)
    routing = _RelayedRouting(state, hop)
    ready = {worker_id_for("ra"): "ra"}

    async def overlap(request_id: str, tokens: list[int]) -> int:
        choice = await state.choose(request_id, tokens, ready)
        state.release(request_id)
        return choice.overlap.device

    def indexed(tokens: list[int], blocks: int) -> None:
        wait_until(
            lambda: asyncio.run(overlap("probe", tokens)) == blocks,
            lambda: time.sleep(0.05),
            lambda: f"Dynamo never indexed {blocks} blocks",
            timeout=10,
        )

    try:
        routing.sync({"ra": ray_llm_stats(a)}, complete=True).result(10)
        a.generate(PROMPT)
        indexed(PROMPT, 6)
        assert routing.resync_failed_relays() is None  # nothing failed
        first = broken(hop.relay("ra"))  # type: ignore[arg-type]
        routing.resync_failed_relays().result(10)
        relay = hop.relay("ra")
        assert relay is not None and relay is not first and relay.failure is None
        assert (hop.started, hop.closed, hop.failed) == (2, 1, 1)
        assert state.stats.relays_replaced == 1  # and Ray's metric
        assert state.stats.registry.registered == 2  # the new advert registered again
        a.generate(OTHER)
        indexed(PROMPT, 6)  # through the new relay's replay from 0
        indexed(OTHER, 4)  # and live

        broken(relay)
        assert not hop.needs_resync()  # within the replica's back-off
        assert routing.resync_failed_relays() is None
        wait_until(hop.needs_resync, lambda: time.sleep(0.05), timeout=RELAY_RETRY_S + 5)
        routing.resync_failed_relays().result(10)
        assert (hop.started, hop.closed, hop.failed) == (3, 2, 2)
        assert state.stats.relays_replaced == 2  # and Ray's metric
        indexed(OTHER, 4)
    finally:
        hop.close()
        state.close()
