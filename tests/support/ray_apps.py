"""Ray Serve apps for the router tests: replicas whose engine is a SimulatedEngine, and a local
Ray session to run them in.

Replicas import this module by name, so :func:`ray_session` puts ``tests/`` on the workers'
``PYTHONPATH``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import ray
from ray import serve

from kvbridge.ray_integration import KVEventsReplica
from kvbridge.testing import SimulatedEngine

__all__ = ["SimulatedReplica", "ray_session"]

TESTS = Path(__file__).resolve().parents[1]


@contextmanager
def ray_session() -> Iterator[None]:
    """A fresh local Ray (2 CPUs, no dashboard) with Serve shut down and Ray stopped after."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=256 * 1024 * 1024,
        logging_level="WARNING",
        runtime_env={"env_vars": {"PYTHONPATH": str(TESTS), "RAY_USAGE_STATS_ENABLED": "0"}},
    )
    try:
        yield
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


class SimulatedReplica(KVEventsReplica):
    """A Serve replica whose engine is a :class:`~kvbridge.testing.SimulatedEngine` with a GPU
    pool and a self-describing CPU tier, publishing to the replica's relay."""

    def __init__(self, *, block_size: int, num_blocks: int, cpu_blocks: int | None) -> None:
        super().__init__(block_size=block_size, host="127.0.0.1")
        config = self.kv_events_config()
        self.engine = SimulatedEngine(
            config["endpoint"],
            replay_endpoint=config["replay_endpoint"],
            bind=None,  # vLLM's rule: a loopback endpoint connects to the relay, which binds
            block_size=block_size,
            num_blocks=num_blocks,
            cpu_blocks=cpu_blocks,
            self_describing=cpu_blocks is not None,
        )
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.actor_name = ray.get_runtime_context().get_actor_name()
        self._lock = (
            threading.Lock()
        )  # the engine is not thread-safe; Serve may run calls in threads

    def __call__(
        self, prompt_token_ids: list[int] | None = None, max_tokens: int = 4, **_: Any
    ) -> dict[str, Any]:
        """Run a request; the answer says where it ran and what it found cached."""
        if prompt_token_ids is None:  # a request without tokens: nothing for the engine to do
            return {"replica": self.replica_id, "actor": self.actor_name}
        with self._lock:
            completion = self.engine.generate(prompt_token_ids, max_tokens)
        return {
            "replica": self.replica_id,
            "actor": self.actor_name,
            "output": completion.output_token_ids,
            "gpu_hit": completion.num_cached_tokens,
            "cpu_hit": completion.num_external_tokens,
        }

    def __del__(self) -> None:
        self.engine.close()
        super().__del__()
