"""A fault soak on the fault rig (``support/fault_rig.py``): rounds of engine use, each after a
fault drawn at random, for a bounded time. After every round, with the engine idle, Dynamo's
``overlap_scores`` must equal the engine's resident set for every prompt within
:data:`~support.fault_rig.CONVERGE_S`, and the relay must have lost no batch, counted every
restart it saw and every malformed payload it was sent, and no other bad frame but those a
throttled clear skipped.

``KVBRIDGE_SOAK_S`` bounds the run [60 s], ``KVBRIDGE_SOAK_SEED`` draws the faults [0]. A
failure names its seed, round and the faults before it, so the same seed replays it; a longer
soak is ``KVBRIDGE_SOAK_S=1800 KVBRIDGE_SOAK_SEED=7 ./scripts/test tests/test_fault_soak.py``.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import pytest

from tests.support.fault_rig import BLOCK_SIZE, PROMPTS, Rig, dropping, relay_samples
from tests.support.rebind import listener_gone

SOAK_S = float(os.environ.get("KVBRIDGE_SOAK_S", "60"))
SEED = int(os.environ.get("KVBRIDGE_SOAK_SEED", "0"))
MALFORMED = b"\x93\xc1\xc1\xc1"
"""A payload no vLLM release decodes (0xc1 is never used in msgpack)."""


class Soak:
    """The rig, and what the running relay must have counted by now."""

    def __init__(self, rig: Rig, rng: random.Random) -> None:
        self.rig = rig
        self.rng = rng
        self.malformed_in_engine = 0
        """Malformed payloads the engine process holds in its replay buffer."""
        self.malformed_seen = 0
        """Malformed payloads the running relay has been sent, live or replayed."""
        self.restarts_seen = 0
        """Engine restarts the running relay has seen."""

    def use(self) -> None:
        self.rig.use(self.rng.sample(PROMPTS, self.rng.randint(1, 8)))

    def start_relay(self) -> None:
        """A new relay: it replays the engine from 0, its counters from 0."""
        self.rig.start_relay()
        self.malformed_seen = self.malformed_in_engine
        self.restarts_seen = 0

    def new_engine(self) -> None:
        """A new engine process. A running relay counts it as a restart if the old one sent
        anything: a stream with nothing delivered since its last clear needs no other."""
        old = self.rig.engine
        sent_any = old.total_published > 0 or self.malformed_in_engine > 0
        old.close()
        listener_gone(self.rig.engine_port)
        self.rig.engine = self.rig.new_engine()
        self.malformed_in_engine = 0
        if self.rig.relay is not None:
            self.restarts_seen += sent_any
            assert self.rig.engine.wait_for_subscribers(timeout=10)

    def check(self) -> None:
        """With the engine idle: Dynamo right for every prompt, the relay's counts exact.
        (Restarts faster than the relay's clear rate suspend the stream, and what it skips
        meanwhile is counted ``throttled``: the start-over replays it, so that count is not
        fixed, but a batch lost that way would be counted lost.)"""
        self.rig.converge()
        assert self.rig.relay is not None
        counted = (
            "kvbridge_lost_batches_total",
            "kvbridge_restarts_total",
            "kvbridge_bad_frames_total",
        )
        counts = {
            (name, reason): value
            for (name, labels), value in relay_samples(self.rig.relay).items()
            if name in counted
            and (reason := dict(labels).get("reason", "")) != "throttled"
            and value
        }
        expected = {
            ("kvbridge_restarts_total", ""): self.restarts_seen,
            ("kvbridge_bad_frames_total", "schema"): self.malformed_seen,
        }
        assert counts == {key: value for key, value in expected.items() if value}


def relay_killed(soak: Soak) -> None:
    """kill -9 of the relay while the engine is used, then a new relay on the same ports."""
    soak.rig.kill_relay()
    soak.use()
    soak.start_relay()


def relay_frozen(soak: Soak) -> None:
    """The relay stopped (SIGSTOP) while the engine is used, then let go."""
    assert soak.rig.relay is not None
    pid = soak.rig.relay.process.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        soak.use()
    finally:
        os.kill(pid, signal.SIGCONT)


def engine_replaced(soak: Soak) -> None:
    """A new engine process (nothing cached, seq from 0), then used."""
    soak.new_engine()
    soak.use()


def engine_replaced_idle(soak: Soak) -> None:
    """A new engine process that publishes nothing."""
    soak.new_engine()


def dynamo_replaced(soak: Soak) -> None:
    """A new SelectionService (an empty index) while the engine is used."""
    soak.rig.stop_dynamo()
    soak.use()
    soak.rig.start_dynamo()


def batches_dropped(soak: Soak) -> None:
    """A fifth of the engine's batches never reach the relay (its replay buffer keeps them)."""
    publisher = soak.rig.engine._publisher
    dropping(soak.rig, lambda _: soak.rng.random() < 0.2)
    try:
        soak.use()
    finally:
        del publisher.publish  # the class's own again
    # A batch that goes out (a new block stored), after which the relay sees the last gap.
    soak.rig.engine.generate(PROMPTS[0], max_tokens=BLOCK_SIZE + 1)


def malformed_payloads(soak: Soak) -> None:
    """Payloads that do not decode, in sequence among the engine's batches."""
    for _ in range(soak.rng.randint(1, 3)):
        soak.rig.engine._publisher.publish(MALFORMED)
        soak.malformed_in_engine += 1
        soak.malformed_seen += 1
    soak.use()


def cache_reset(soak: Soak) -> None:
    """The engine's prefix cache reset (``AllBlocksCleared``), then used."""
    soak.rig.engine.reset_prefix_cache()
    soak.use()


def engine_used(soak: Soak) -> None:
    """No fault."""
    soak.use()


FAULTS: list[Callable[[Soak], None]] = [
    relay_killed,
    relay_frozen,
    engine_replaced,
    engine_replaced_idle,
    dynamo_replaced,
    batches_dropped,
    malformed_payloads,
    cache_reset,
    engine_used,
]


@pytest.mark.timeout(SOAK_S + 300)  # the suite's per-test bound is for tests of fixed length
def test_fault_soak(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    with ExitStack() as stack:
        # A replay buffer no soak fills: a relay started late finds every batch from 0.
        soak = Soak(Rig(stack, tmp_path, engine_buffer=1_000_000), rng)
        soak.start_relay()
        soak.rig.start_dynamo()
        soak.use()
        soak.check()
        done: list[str] = []
        deadline = time.monotonic() + SOAK_S
        while time.monotonic() < deadline or len(done) < len(FAULTS):
            fault = rng.choice(FAULTS) if len(done) >= len(FAULTS) else FAULTS[len(done)]
            done.append(fault.__name__)
            try:
                fault(soak)
                soak.check()
            except AssertionError as error:
                raise AssertionError(
                    f"seed {SEED}, round {len(done)} ({fault.__name__}, after "
                    f"{done[-6:-1]}): {error}; relay log: {soak.rig.log_dir}"
                ) from error
