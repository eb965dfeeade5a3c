"""A fault rig: a simulated vLLM engine, a ``kvbridge relay`` subprocess and a real Dynamo
1.6.1 ``SelectionService`` registered on the relay's endpoints, on 127.0.0.1 ports below the
ephemeral range (``kvbridge.adapters.ports``). Each part can be broken and replaced; Dynamo's
``overlap_scores`` for every prompt must then come to equal the engine's true resident set
(:meth:`Rig.converge`)."""

from __future__ import annotations

import os
import random
import signal
import time
import urllib.error
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from kvbridge.adapters.ports import free_port_range
from kvbridge.testing import SimulatedEngine
from tests.support.relay_process import RelayProcess, Samples, wait_tcp_peers
from tests.support.selection_harness import SelectionHarness

__all__ = [
    "BLOCK_SIZE",
    "CONVERGE_S",
    "PROMPTS",
    "WORKER",
    "Rig",
    "dropping",
    "relay_samples",
    "wait_relay_in",
]

BLOCK_SIZE = 4
WORKER = 7
CONVERGE_S = 3.0
"""The bound: with the engine idle, Dynamo is right for every prompt within this."""


def _prompts(count: int = 40, seed: int = 0) -> list[list[int]]:
    """Prompts that share prefixes (8 families), 3-9 blocks long, not block-aligned."""
    rng = random.Random(seed)
    families = [[rng.randrange(1, 30_000) for _ in range(4 * BLOCK_SIZE)] for _ in range(8)]
    prompts = []
    for i in range(count):
        head = families[i % len(families)][: BLOCK_SIZE * rng.randrange(1, 5)]
        tail = [rng.randrange(1, 30_000) for _ in range(BLOCK_SIZE * rng.randrange(1, 5) + 1)]
        prompts.append(head + tail)
    return prompts


PROMPTS = _prompts()


class Rig:
    """An engine (in-process, its PUB and replay ROUTER bound on fixed low ports), a relay
    subprocess that can be killed and started again on the same ports, and a Dynamo
    ``SelectionService`` that can be replaced."""

    def __init__(self, stack: ExitStack, log_dir: Path, *, engine_buffer: int = 10_000) -> None:
        self.stack = stack
        self.log_dir = log_dir
        base = free_port_range(5)
        self.engine_port, self.engine_replay_port = base, base + 1
        self.publish = f"tcp://127.0.0.1:{base + 2}"
        self.replay = f"tcp://127.0.0.1:{base + 3}"
        self.metrics_port = base + 4
        self.engine_buffer = engine_buffer
        self.engine = self.new_engine()
        self.relay: RelayProcess | None = None
        self.runs = 0
        self.harness: SelectionHarness | None = None
        stack.callback(self._close)

    def new_engine(self) -> SimulatedEngine:
        """A fresh engine process stand-in on the same ports (nothing cached, seq from 0)."""
        return SimulatedEngine(
            f"tcp://127.0.0.1:{self.engine_port}",
            replay_endpoint=f"tcp://127.0.0.1:{self.engine_replay_port}",
            num_blocks=48,
            block_size=BLOCK_SIZE,
            buffer_steps=self.engine_buffer,
        )

    def start_relay(self) -> RelayProcess:
        self.runs += 1
        self.relay = RelayProcess(
            [
                "--source",
                f"tcp://*:{self.engine_port}",
                "--source-replay",
                f"tcp://*:{self.engine_replay_port}",
                "--worker-id",
                str(WORKER),
                "--publish",
                self.publish,
                "--publish-replay",
                self.replay,
                "--block-size",
                str(BLOCK_SIZE),
            ],
            metrics_port=self.metrics_port,
            log_path=self.log_dir / f"relay-{self.runs}.log",
        )
        assert self.engine.wait_for_subscribers(timeout=10)
        return self.relay

    def kill_relay(self) -> None:
        assert self.relay is not None
        os.kill(self.relay.process.pid, signal.SIGKILL)
        self.relay.process.wait(5)
        self.relay.close()
        self.relay = None

    def start_dynamo(self) -> SelectionHarness:
        harness = self.harness = SelectionHarness()
        record = harness.add_worker(
            WORKER,
            block_size=BLOCK_SIZE,
            endpoints={0: self.publish},
            replay_endpoint=self.replay,
        )
        assert record["lifecycle"] == "schedulable", record
        wait_tcp_peers(int(self.publish.rsplit(":", 1)[1]), 1, timeout=10)
        return harness

    def stop_dynamo(self) -> None:
        if self.harness is not None:
            self.harness.close()
            self.harness = None

    def use(self, prompts: list[list[int]]) -> None:
        for prompt in prompts:
            self.engine.generate(prompt)

    def truth(self, prompt: list[int]) -> int:
        """Leading blocks of ``prompt`` the engine holds on its GPU."""
        resident = set(self.engine.resident_hashes("GPU"))
        count = 0
        for block_hash in self.engine.block_hashes(prompt):
            if block_hash not in resident:
                break
            count += 1
        return count

    def wrong(self) -> list[tuple[int, int, int]]:
        """``(prompt index, Dynamo's device blocks, the engine's)`` for every prompt where they
        differ."""
        assert self.harness is not None
        out = []
        for i, prompt in enumerate(PROMPTS):
            seen = self.harness.overlap(prompt).get((WORKER, 0), (0, 0, 0))[0]
            true = self.truth(prompt)
            if seen != true:
                out.append((i, seen, true))
        return out

    def converge(self, timeout: float = CONVERGE_S) -> float:
        """Seconds until Dynamo is right for every prompt; fails after ``timeout``."""
        start = time.monotonic()
        while (wrong := self.wrong()) and time.monotonic() - start < timeout:
            time.sleep(0.05)
        assert not wrong, f"{len(wrong)} of {len(PROMPTS)} prompts wrong: {wrong[:8]}"
        return time.monotonic() - start

    def metric(self, name: str) -> float:
        assert self.relay is not None
        return relay_samples(self.relay).get((name, frozenset()), 0.0)

    def _close(self) -> None:
        self.stop_dynamo()
        if self.relay is not None:
            self.relay.close()
        self.engine.close()


def dropping(rig: Rig, drop: Callable[[int], bool]) -> list[bool]:
    """Make the engine's PUB drop the batches ``drop(n)`` picks (the n-th batch from now); they
    stay in its replay buffer. After each batch that does go out, wait until the relay has taken
    in every batch published so far (so that each run of drops is one gap, recovered alone).
    Returns the decisions, in order."""
    publisher = rig.engine._publisher
    original = publisher.publish
    decisions: list[bool] = []

    def publish(payload: bytes, *, seq: int | None = None, send: bool = True) -> int:
        dropped = drop(len(decisions))
        decisions.append(dropped)
        used = original(payload, seq=seq, send=send and not dropped)
        if not dropped:
            wait_relay_in(rig, rig.engine.total_published)
        return used

    publisher.publish = publish  # type: ignore[method-assign]
    return decisions


def wait_relay_in(rig: Rig, count: int, timeout: float = 5.0) -> None:
    """Until the relay has taken in (or counted as lost) ``count`` batches."""
    relay = rig.relay
    assert relay is not None
    deadline = time.monotonic() + timeout
    while True:
        scraped = relay_samples(relay)
        taken = scraped.get(("kvbridge_batches_total", frozenset({("direction", "in")})), 0.0)
        taken += scraped.get(("kvbridge_lost_batches_total", frozenset()), 0.0)
        if taken >= count:
            return
        assert time.monotonic() < deadline, (taken, count)
        time.sleep(0.005)


def relay_samples(relay: RelayProcess) -> Samples:
    """The relay's metrics. Its exporter reads the normalizer while the relay's thread may be
    using it (pyo3's "Already mutably borrowed", a 500): such a scrape is retried."""
    for _ in range(50):
        try:
            return relay.metrics()
        except urllib.error.HTTPError as error:
            if error.code != 500:
                raise
            time.sleep(0.01)
    raise AssertionError("the relay's metrics kept failing")
