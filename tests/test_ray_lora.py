"""LoRA- and salt-aware routing, with no Serve in the way: ``RoutingState`` (the router's state)
over a real Dynamo SelectionService fed by two real relays.

Worker A's engine cached a prompt under the LoRA adapter ``sql`` (or a cache salt); worker B's
cached the same tokens for the base model, unsalted. The LoRA name and the salt change every
block hash (Dynamo seeds tokens_hash with them, and so does the relay), so the router must ask
with the request's LoRA name or salt to find A, and without one to find B. Ray Serve LLM's own
KV router does not pass LoRA names to Dynamo.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve")


from kvbridge.adapters.publisher import Publisher
from kvbridge.adapters.relay import Relay
from kvbridge.adapters.source import Source
from kvbridge.ray_integration import KVEventsAdvert, RoutingState
from kvbridge.ray_integration.decisions import Release
from kvbridge.ray_integration.engine_config import KVEventPorts
from kvbridge.ray_integration.prompt import prompt_cache_salt, prompt_tokens
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

    def store(self, lora_name: str | None, cache_salt: str | None = None) -> None:
        """The engine caches TOKENS (its own hashes: 1..6, offset per adapter or salt), a
        salt in the first block's extra keys, as vLLM puts it there."""
        base = 1000 if lora_name or cache_salt else 1
        extra_keys: list[list[object] | None] = [None] * 6
        if cache_salt is not None:
            extra_keys[0] = [cache_salt]
        event = BlockStored(
            [base + i for i in range(6)],
            None,
            TOKENS,
            BLOCK,
            None,
            "GPU",
            lora_name,
            extra_keys,
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


def register_both(state: RoutingState, a: RelayedWorker, b: RelayedWorker) -> dict[int, str]:
    """Register both workers with ``state``'s Dynamo: ``{worker id: replica id}``."""
    registering = state.sync(
        {"replica-a": a.advert.routing_stats(), "replica-b": b.advert.routing_stats()},
        complete=True,
    )
    assert registering is not None
    registering.result(10)
    ready = state.ready_workers(["replica-a", "replica-b"])
    assert sorted(ready.values()) == ["replica-a", "replica-b"]
    return ready


def wait_for(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 5
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_lora_name_reaches_dynamo(workers: tuple[RelayedWorker, RelayedWorker]) -> None:
    a, b = workers
    state = RoutingState("lora#test", block_size=BLOCK)
    try:
        ready = register_both(state, a, b)
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

        wait_for(indexed, "Dynamo never indexed both workers")
        assert asyncio.run(choose("r1", "sql")) == ("replica-a", 6)
        assert asyncio.run(choose("r2", None)) == ("replica-b", 6)
        assert asyncio.run(choose("r3", "other-adapter"))[1] == 0
        time.sleep(0.1)
        assert state.client.active_reservations() == 0
    finally:
        state.close()


@pytest.mark.parametrize(
    ("engine_salt", "request_salt"),
    [("tenant-1", "tenant-1"), ("dynamo-cache-salt:tenant-1", "tenant-1")],
    ids=["plain", "dynamo-prefixed in the blocks"],
)
@pytest.mark.parametrize("where", ["kwargs", "dict body", "request object"])
def test_cache_salt_reaches_dynamo(
    workers: tuple[RelayedWorker, RelayedWorker], engine_salt: str, request_salt: str, where: str
) -> None:
    """A salted prefix is found only by a request with the same salt, read from the handle
    call's keyword arguments or from the body (a dict or a request object), with Dynamo's
    prefix or without it; the same tokens unsalted are found only without one."""
    a, b = workers
    state = RoutingState("salt#test", block_size=BLOCK)

    def call(salt: str | None) -> tuple[list[object], dict[str, object]]:
        body: dict[str, object] = {"prompt": TOKENS}
        if salt is not None:
            body["cache_salt"] = salt
        if where == "kwargs":
            return [], {"prompt_token_ids": TOKENS} | ({} if salt is None else {"cache_salt": salt})
        if where == "dict body":
            return [body], {}
        return [SimpleNamespace(**body)], {}

    async def choose(request_id: str, salt: str | None) -> tuple[str, int]:
        args, kwargs = call(salt)
        tokens = prompt_tokens(args, kwargs)
        assert tokens is not None
        choice = await state.choose(
            request_id, tokens, ready, cache_salt=prompt_cache_salt(args, kwargs)
        )
        state.release(request_id)
        return ready[choice.worker_id], choice.overlap.device

    try:
        ready = register_both(state, a, b)
        a.store(None, cache_salt=engine_salt)
        b.store(None)

        def indexed() -> bool:
            salted = asyncio.run(choose("probe-a", request_salt))
            unsalted = asyncio.run(choose("probe-b", None))
            return (salted, unsalted) == (("replica-a", 6), ("replica-b", 6))

        wait_for(indexed, "Dynamo never indexed both workers")
        assert asyncio.run(choose("r1", "dynamo-cache-salt:" + request_salt)) == ("replica-a", 6)
        assert asyncio.run(choose("r2", "")) == ("replica-b", 6)  # empty: no salt
        assert asyncio.run(choose("r3", "tenant-2"))[1] == 0
        time.sleep(0.1)
        assert state.client.active_reservations() == 0
    finally:
        state.close()


def test_prompt_cache_salt_reads_what_vllm_takes() -> None:
    """The keyword argument wins over the body; a salt that is not a non-empty string (after
    Dynamo's prefix) is none."""
    body = {"prompt": TOKENS, "cache_salt": "from-body"}
    assert prompt_cache_salt([body], {"cache_salt": "from-kwargs"}) == "from-kwargs"
    assert prompt_cache_salt([body], {}) == "from-body"
    assert prompt_cache_salt([SimpleNamespace(cache_salt="obj")], {}) == "obj"
    assert prompt_cache_salt([], {}) is None
    assert prompt_cache_salt([{"prompt": TOKENS}], {}) is None
    assert prompt_cache_salt([body], {"cache_salt": None}) is None
    assert prompt_cache_salt([{"cache_salt": 7}], {}) is None
    assert prompt_cache_salt([{"cache_salt": "dynamo-cache-salt:"}], {}) is None
    assert prompt_cache_salt([{"cache_salt": "dynamo-cache-salt:x"}], {}) == "x"


def test_a_moved_reservation_completed_at_once_is_freed_in_dynamo(
    workers: tuple[RelayedWorker, RelayedWorker],
) -> None:
    """Dynamo picked A, and Serve placed the request on B (A was full, a lower rank): the
    reservation moves to B, a ``create_reservation`` on its way to Dynamo. The request
    completes at once: its free waits for that create, which it would otherwise overtake in
    the service, failing and leaving B's booking in Dynamo for good."""
    a, b = workers
    state = RoutingState("completion#test", block_size=BLOCK)
    try:
        ready = register_both(state, a, b)
        a.store(None)

        def picked_a() -> bool:
            choice = asyncio.run(state.choose("probe", TOKENS, ready))
            state.release("probe")
            return ready[choice.worker_id] == "replica-a" and choice.overlap.device == 6

        wait_for(picked_a, "Dynamo never indexed A")
        while state.held.in_flight():  # the probes' frees, counted when applied
            time.sleep(0.05)
        releases = Counter(state.stats.registry.releases)
        asyncio.run(state.choose("r1", TOKENS, ready))
        state.routed("r1", "replica-b")
        state.release("r1")
        assert state.reservations == 0
        expected = Counter({Release.MOVED: 1, Release.FREED: 1})
        # Frees are counted when Dynamo has applied them.
        wait_for(
            lambda: state.stats.registry.releases - releases == expected, str(state.stats.registry)
        )
        assert state.client.active_reservations() == 0
    finally:
        state.close()
