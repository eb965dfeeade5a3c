"""LoRA-aware routing, with no Serve in the way: ``RoutingState`` (the router's state) over a
real Dynamo SelectionService fed by two real relays.

Worker A's engine cached a prompt under the LoRA adapter ``sql``; worker B's cached the same
tokens for the base model. The LoRA name changes every block hash (Dynamo seeds tokens_hash with
it), so the router must ask with the request's LoRA name to find A, and without one to find B.
Ray Serve LLM's own KV router does not pass LoRA names to Dynamo.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("ray.serve")


from kvbridge.adapters.publisher import Publisher
from kvbridge.adapters.relay import Relay
from kvbridge.adapters.source import Source
from kvbridge.ray_integration import KVEventsAdvert, RoutingState
from kvbridge.ray_integration.engine_config import KVEventPorts
from kvbridge.schemas.vllm import BlockStored
from kvbridge.testing.events import encoded

BLOCK = 4
TOKENS = list(range(100, 124))  # 6 blocks


class RelayedWorker:
    """An engine-side PUB, a relay that canonicalises its stream, and the relay's advert."""

    def __init__(self) -> None:
        ports = KVEventPorts.allocate()
        self.engine = Publisher(f"tcp://127.0.0.1:{ports.engine}", bind=True)
        self.relay = Relay(
            [Source(self.engine.endpoint, bind=False)],
            block_size=BLOCK,
            publish=f"tcp://127.0.0.1:{ports.relay}",
            publish_replay=f"tcp://127.0.0.1:{ports.relay_replay}",
        )
        self.relay.start()
        self.advert = KVEventsAdvert(
            endpoints={0: f"tcp://127.0.0.1:{ports.relay}"},
            replay_endpoints={0: f"tcp://127.0.0.1:{ports.relay_replay}"},
            block_size=BLOCK,
        )

    def store(self, lora_name: str | None) -> None:
        """The engine caches TOKENS (its own hashes: 1..6, offset per adapter)."""
        base = 1000 if lora_name else 1
        event = BlockStored(
            [base + i for i in range(6)],
            None,
            TOKENS,
            BLOCK,
            None,
            "GPU",
            lora_name,
            [None] * 6,
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        )
        assert self.engine.wait_for_subscribers(1)
        time.sleep(0.05)
        self.engine.publish(encoded([event]))

    def close(self) -> None:
        self.relay.close()
        self.engine.close()


@pytest.fixture
def workers() -> Iterator[tuple[RelayedWorker, RelayedWorker]]:
    a, b = RelayedWorker(), RelayedWorker()
    yield a, b
    a.close()
    b.close()


def test_lora_name_reaches_dynamo(workers: tuple[RelayedWorker, RelayedWorker]) -> None:
    a, b = workers
    state = RoutingState("lora#test", block_size=BLOCK)
    try:
        registering = state.sync(
            {"replica-a": a.advert.routing_stats(), "replica-b": b.advert.routing_stats()},
            complete=True,
        )
        assert registering is not None
        registering.result(10)
        ready = state.ready_workers(["replica-a", "replica-b"])
        assert sorted(ready.values()) == ["replica-a", "replica-b"]
        a.store("sql")
        b.store(None)

        async def choose(request_id: str, lora_name: str | None) -> tuple[str, int]:
            choice = await state.choose(request_id, TOKENS, ready, lora_name=lora_name)
            state.release(request_id)
            return ready[choice.worker_id], choice.overlap.device

        def indexed() -> bool:
            with_lora = asyncio.run(choose("probe-a", "sql"))
            without = asyncio.run(choose("probe-b", None))
            return with_lora == ("replica-a", 6) and without == ("replica-b", 6)

        deadline = time.monotonic() + 5
        while not indexed():
            assert time.monotonic() < deadline, "Dynamo never indexed both workers"
            time.sleep(0.05)
        assert asyncio.run(choose("r1", "sql")) == ("replica-a", 6)
        assert asyncio.run(choose("r2", None)) == ("replica-b", 6)
        assert asyncio.run(choose("r3", "other-adapter"))[1] == 0
        time.sleep(0.1)
        assert state.client.active_reservations() == 0
    finally:
        state.close()
