"""SelectionClient: a real Dynamo SelectionService on a loop of its own, and its router weights.

The scenario is the one a Serve router meets with back-to-back requests: worker 1 holds prompts
P0 and P1, worker 2 holds P2 (12 blocks of 32 tokens each, published by SimulatedEngines over
ZMQ), and a reservation for P0 on worker 1 is still active. With Dynamo's default weights the
active request's 12 decode blocks cost as much as recomputing P1's 12 cached blocks, and P1 goes
to worker 2; with ``prefill_load_scale=2`` the cached blocks win.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvbridge.adapters.selection_client import TUNING_ENV, SelectionClient
from kvbridge.testing import SimulatedEngine

BLOCK = 32
PROMPT = 12 * BLOCK + 5


@pytest.fixture
def engines() -> Iterator[tuple[SimulatedEngine, SimulatedEngine]]:
    with (
        SimulatedEngine(block_size=BLOCK, num_blocks=64) as one,
        SimulatedEngine(block_size=BLOCK, num_blocks=64) as two,
    ):
        yield one, two


def prompts() -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(3, 259) for _ in range(PROMPT)] for _ in range(3)]


def pick_after_active_request(
    client: SelectionClient, engines: tuple[SimulatedEngine, SimulatedEngine]
) -> tuple[int, int]:
    """(worker, overlap tokens) Dynamo selects for P1 while P0 is reserved on worker 1."""
    for worker_id, engine in enumerate(engines, start=1):
        client.call_sync(
            "upsert_worker",
            {
                "worker_id": worker_id,
                "model_name": "m",
                "endpoint": f"w{worker_id}",
                "block_size": BLOCK,
                "kv_events_endpoint": engine.endpoint,
            },
        )
    for engine in engines:
        assert engine.wait_for_subscribers(1)
    time.sleep(0.05)
    p0, p1, p2 = prompts()
    engines[0].generate(p0, 4)
    engines[0].generate(p1, 4)
    engines[1].generate(p2, 4)

    def select(tokens: list[int]) -> dict[str, Any]:
        result: dict[str, Any] = client.call_sync(
            "select", {"token_ids": tokens, "model_name": "m", "allowed_worker_ids": [1, 2]}
        )
        return result

    # Both workers' streams are indexed on their own; wait for each, not for one of them.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(
        select(prompt)["overlap"]["gpu"] >= 12 * BLOCK for prompt in (p1, p2)
    ):
        time.sleep(0.01)
    assert select(p1)["worker_id"] == 1, "P1 is cached on worker 1 only"
    reserved = client.call_sync(
        "select_and_reserve",
        {"token_ids": p0, "model_name": "m", "selection_id": "p0", "allowed_worker_ids": [1, 2]},
    )
    assert reserved["worker_id"] == 1
    assert client.active_reservations() == 1
    picked = select(p1)
    client.call_sync("free_reservation", "p0")
    assert client.active_reservations() == 0
    return picked["worker_id"], picked["overlap"]["gpu"]


def test_default_weights_count_an_active_request_against_the_cache(
    engines: tuple[SimulatedEngine, SimulatedEngine],
) -> None:
    with SelectionClient() as client:
        assert pick_after_active_request(client, engines) == (2, 0)


def test_prefill_load_scale_makes_the_cache_win(
    engines: tuple[SimulatedEngine, SimulatedEngine],
) -> None:
    os.environ.pop(TUNING_ENV["prefill_load_scale"], None)
    with SelectionClient(tuning={"prefill_load_scale": 2.0}) as client:
        assert TUNING_ENV["prefill_load_scale"] not in os.environ  # set only while created
        assert pick_after_active_request(client, engines) == (1, 12 * BLOCK)


def test_unknown_weight_is_refused() -> None:
    with pytest.raises(ValueError) as error:
        SelectionClient(tuning={"prefil_load_scale": 2.0})
    assert str(error.value) == (
        "unknown Dynamo router weight 'prefil_load_scale' (known: decode_active_request_weight, "
        "host_cache_hit_weight, overlap_score_credit, overlap_score_credit_decay, "
        "prefill_load_scale)"
    )


def test_calls_from_another_loop_and_after_close() -> None:
    import asyncio

    client = SelectionClient()
    record = client.call_sync(
        "upsert_worker",
        {
            "worker_id": 9,
            "model_name": "m",
            "endpoint": "w9",
            "block_size": 16,
            "kv_events_endpoint": "tcp://127.0.0.1:1",
        },
    )
    assert record["lifecycle"] == "schedulable"
    deleted = asyncio.run(client.call("delete_worker", 9))
    assert deleted["lifecycle"] == "unschedulable"
    client.close()
    client.close()
    with pytest.raises(RuntimeError, match="the selection client is closed"):
        client.call_sync("delete_worker", 9)
