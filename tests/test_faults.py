"""Fault injection end to end, on the fault rig (``support/fault_rig.py``): a simulated vLLM
engine, a ``kvbridge relay`` subprocess and a real Dynamo 1.6.1 ``SelectionService``.

Each scenario breaks something, leaves the engine idle and then requires Dynamo's
``overlap_scores`` for every prompt to equal the engine's true resident set (the leading blocks
of the prompt the engine holds on its GPU) within 3 s, with the relay's counters exact.
"""

from __future__ import annotations

import itertools
import os
import random
import signal
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from kvbridge.adapters.ports import free_port_range
from tests.support.fault_rig import (
    BLOCK_SIZE,
    PROMPTS,
    WORKER,
    Rig,
    dropping,
    relay_samples,
)
from tests.support.rebind import listener_gone
from tests.support.relay_process import wait_tcp_peers
from tests.support.selection_harness import SelectionHarness


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    with ExitStack() as stack:
        yield Rig(stack, tmp_path)


def test_relay_kill_and_restart_10_cycles(rig: Rig) -> None:
    """kill -9 of the relay, then a new relay on the same ports, 10 times, the engine used in
    between and idle after each restart. The restarted relay catches up from the engine's
    replay buffer; Dynamo reconnects late, misses that burst and the opening clear, sees the
    gap on a heartbeat and asks for a replay older than the new relay's buffer: the answer is
    a snapshot, a clear then every resident block."""
    rig.start_relay()
    rig.start_dynamo()
    rig.use(PROMPTS[:20])
    rig.converge()
    rng = random.Random(1)
    for cycle in range(10):
        rig.kill_relay()
        rig.use(rng.sample(PROMPTS, 8))  # while nobody relays
        rig.start_relay()
        rig.converge()
        assert rig.metric("kvbridge_lost_batches_total") == 0, cycle
        assert rig.metric("kvbridge_restarts_total") == 0, cycle
        assert rig.metric("kvbridge_replays_total") == 1, cycle  # the start-up replay from 0
        rig.use(rng.sample(PROMPTS, 4))
        rig.converge()


def test_engine_restart_as_a_new_process(rig: Rig) -> None:
    """The engine process is replaced (nothing cached, sequence from 0) while the relay and
    Dynamo stay up: the relay sees the sequence go back, clears the worker downstream, replays
    the new engine from 0 and Dynamo follows."""
    rig.start_relay()
    rig.start_dynamo()
    rig.use(PROMPTS[:20])
    rig.converge()
    rig.engine.close()
    rig.engine = rig.new_engine()
    assert rig.engine.wait_for_subscribers(timeout=10)
    rig.use(PROMPTS[30:33])
    rig.converge()
    assert rig.metric("kvbridge_restarts_total") == 1
    assert rig.metric("kvbridge_lost_batches_total") == 0
    assert rig.metric("kvbridge_gaps_total") == 0


def test_engine_restart_that_stays_idle(rig: Rig) -> None:
    """The engine process is replaced and the new one publishes nothing. Once the relay's SUB
    is connected to it, the relay checks the publisher without waiting for a batch (the new
    process's replay of the old last seq is empty), clears the worker downstream, and Dynamo
    holds none of the old engine's blocks."""
    rig.start_relay()
    rig.start_dynamo()
    rig.use(PROMPTS[:20])
    rig.converge()
    assert sum(map(rig.truth, PROMPTS)) > 0
    rig.engine.close()
    listener_gone(rig.engine_port)
    rig.engine = rig.new_engine()
    assert sum(map(rig.truth, PROMPTS)) == 0
    rig.converge()
    assert rig.metric("kvbridge_disconnects_total") == 1
    assert rig.metric("kvbridge_reconnect_checks_total") == 1
    assert rig.metric("kvbridge_restarts_total") == 1
    assert rig.metric("kvbridge_lost_batches_total") == 0


def test_engine_restart_whose_sequence_passed_the_old_last(rig: Rig) -> None:
    """The relay is frozen (SIGSTOP) while the engine is replaced, and the new process
    publishes more batches than the old one did before the relay can reconnect: its sequence
    continues past the old last, so only the drop shows the restart. The relay checks the
    publisher after the reconnect (the new engine's batch at the old last seq is other bytes),
    clears the worker downstream and replays the new engine from 0."""
    relay = rig.start_relay()
    rig.start_dynamo()
    rig.use(PROMPTS[:6])
    rig.converge()
    old_last = rig.engine.total_published - 1
    os.kill(relay.process.pid, signal.SIGSTOP)
    try:
        rig.engine.close()
        rig.engine = rig.new_engine()
        rig.use(PROMPTS[20:])
        assert rig.engine.total_published > old_last + 1
    finally:
        os.kill(relay.process.pid, signal.SIGCONT)
    assert rig.engine.wait_for_subscribers(timeout=10)
    rig.use(PROMPTS[:2])
    rig.converge()
    assert rig.metric("kvbridge_disconnects_total") == 1
    assert rig.metric("kvbridge_reconnect_checks_total") == 1
    assert rig.metric("kvbridge_restarts_total") == 1
    assert rig.metric("kvbridge_gaps_total") == 0  # a restart, replayed from 0: not a gap
    assert rig.metric("kvbridge_lost_batches_total") == 0
    # Every batch of both processes taken in once: the new one's through the replay from 0,
    # but for its live batches that the replay had not reached yet.
    relay_in = relay_samples(relay)[("kvbridge_batches_total", frozenset({("direction", "in")}))]
    assert relay_in == old_last + 1 + rig.engine.total_published
    assert rig.metric("kvbridge_replayed_batches_total") >= rig.engine.total_published - 2


def _runs(decisions: list[bool]) -> int:
    """Maximal runs of dropped batches that a delivered batch follows."""
    return sum(1 for a, b in itertools.pairwise(decisions) if a and not b)


def test_engine_replay_buffer_shorter_than_the_gap(tmp_path: Path) -> None:
    """60 batches never reach the relay and the engine's replay buffer holds 30: the relay
    counts the 29 it cannot recover (the 30th is the live one), clears the worker downstream
    and keeps what the engine's hashes stand for. With the engine idle Dynamo holds no stale
    block; after one use of each prompt (re-anchored by its stores) it is right again."""
    with ExitStack() as stack:
        rig = Rig(stack, tmp_path, engine_buffer=30)
        rig.start_relay()
        rig.start_dynamo()
        rig.use(PROMPTS[:20])
        rig.converge()
        before = rig.engine.total_published
        decisions = dropping(rig, lambda n: n < 60)
        rng = random.Random(2)
        while len(decisions) < 61:
            rig.engine.generate(rng.choice(PROMPTS))
        dropped = sum(decisions)
        assert dropped == 60
        assert rig.metric("kvbridge_gaps_total") == 1
        assert rig.metric("kvbridge_lost_batches_total") == dropped - 29
        assert rig.metric("kvbridge_restarts_total") == 0
        assert rig.engine.total_published > before
        # No stale block: Dynamo never claims more than the engine holds.
        assert all(seen <= true for _, seen, true in rig.wrong())
        for prompt in PROMPTS:
            rig.engine.generate(prompt, max_tokens=BLOCK_SIZE + 1)
        rig.converge()


def test_ten_percent_dropped_on_each_hop(rig: Rig) -> None:
    """10% of the engine's batches never reach the relay (each run of them is one gap the relay
    replays), and 10% of the relay's messages never reach Dynamo (a lossy proxy in between;
    Dynamo replays from the relay)."""
    rig.start_relay()
    proxy = _LossyProxy(rig.publish, free_port_range(1), loss=0.1, seed=3)
    rig.stack.callback(proxy.close)
    rig.publish, relay_publish = proxy.endpoint, rig.publish
    rig.start_dynamo()
    rig.publish = relay_publish
    rng = random.Random(4)
    decisions = dropping(rig, lambda n: rng.random() < 0.1)
    rig.use(PROMPTS)
    rig.use(PROMPTS[::3])
    decisions.append(False)  # the last batch goes out, so that the last run is seen
    rig.engine._publisher.publish = type(rig.engine._publisher).publish.__get__(  # type: ignore[method-assign]
        rig.engine._publisher
    )
    rig.engine.generate(PROMPTS[0], max_tokens=BLOCK_SIZE + 1)
    rig.converge()
    runs = _runs(decisions)
    assert runs > 0 and proxy.dropped > 0
    assert rig.metric("kvbridge_gaps_total") == runs
    assert rig.metric("kvbridge_replays_total") == 1 + runs
    assert rig.metric("kvbridge_lost_batches_total") == 0
    assert rig.metric("kvbridge_restarts_total") == 0
    assert rig.metric("kvbridge_duplicate_batches_total") == runs


def test_dynamo_consumer_restarted(rig: Rig) -> None:
    """Dynamo's SelectionService is replaced by a new one (an empty index, no watermark) while
    the engine goes on: the new listener's first message is past 0, it asks for a replay from
    0, older than the relay's buffer, and gets a snapshot."""
    rig.start_relay()
    rig.start_dynamo()
    rig.use(PROMPTS[:20])
    rig.converge()
    for cycle in range(3):
        rig.stop_dynamo()
        rig.use(PROMPTS[10 * cycle : 10 * cycle + 15])
        rig.start_dynamo()
        rig.converge()
    assert rig.metric("kvbridge_gaps_total") == 0
    assert rig.metric("kvbridge_lost_batches_total") == 0


def test_a_consumer_that_never_reads(rig: Rig) -> None:
    """A SUB on the relay's output that never reads (its queue full at once) does not stop
    the relay or Dynamo: the PUB drops for that peer alone."""
    import zmq

    rig.start_relay()
    context = zmq.Context()
    stalled = context.socket(zmq.SUB)
    stalled.setsockopt(zmq.RCVHWM, 1)
    stalled.setsockopt(zmq.RCVBUF, 4096)
    stalled.setsockopt(zmq.SUBSCRIBE, b"")
    stalled.connect(rig.publish)
    rig.stack.callback(context.term)
    rig.stack.callback(stalled.close, 0)
    rig.start_dynamo()
    wait_tcp_peers(int(rig.publish.rsplit(":", 1)[1]), 2, timeout=10)
    for _ in range(3):
        rig.use(PROMPTS)
    rig.converge()
    assert rig.metric("kvbridge_lost_batches_total") == 0
    assert rig.metric("kvbridge_gaps_total") == 0


class _LossyProxy:
    """SUB from ``upstream``, PUB on ``port``: forwards each message but a ``loss`` share."""

    def __init__(self, upstream: str, port: int, *, loss: float, seed: int) -> None:
        import threading

        import zmq

        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.dropped = 0
        self._context = zmq.Context()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.connect(upstream)
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(self.endpoint)
        self._rng = random.Random(seed)
        self._loss = loss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        wait_tcp_peers(int(upstream.rsplit(":", 1)[1]), 1, timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sub.poll(50):
                continue
            frames = self._sub.recv_multipart()
            if self._rng.random() < self._loss:
                self.dropped += 1
                continue
            self._pub.send_multipart(frames)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sub.close(0)
        self._pub.close(0)
        self._context.term()


def test_heartbeat_reveals_a_gap_while_idle_and_a_new_listener_gets_a_snapshot(
    tmp_path: Path,
) -> None:
    """An in-process relay, so that its output counters can be read. The relay's output drops
    every message of 3 requests and the engine goes idle: Dynamo only learns of the gap from a heartbeat (an
    empty batch with the next seq), replays it from the relay's buffer and is right. Then a
    new listener asks for a replay from 0, older than the buffer: one snapshot."""
    from kvbridge.adapters.relay import Relay

    with ExitStack() as stack:
        rig = Rig(stack, tmp_path)
        relay = Relay(
            [rig.engine.source(WORKER)],
            block_size=BLOCK_SIZE,
            publish=rig.publish,
            publish_replay=rig.replay,
            buffer_steps=10_000,
            merge_bytes=0,  # a message per batch: the dropped ones are counted below
        )
        stack.callback(relay.close)
        relay.start()
        assert rig.engine.wait_for_subscribers(timeout=10)
        rig.start_dynamo()
        rig.use(PROMPTS[:5])
        rig.converge()
        assert relay.output_stats.snapshots == 1  # this listener's first replay, from 0

        (output,) = relay.outputs.values()
        original = output.publish
        dropping = True
        dropped: list[int] = []

        def publish(payload: bytes, *, seq: int | None = None, send: bool = True) -> int:
            used = original(payload, seq=seq, send=send and not dropping)
            if dropping:
                dropped.append(used)
            return used

        output.publish = publish  # type: ignore[method-assign]
        beats = relay.output_stats.heartbeats
        published = rig.engine.total_published
        rig.use(PROMPTS[5:8])
        assert SelectionHarness.wait_for(
            lambda: relay.stats.batches_in == rig.engine.total_published
        )
        dropping = False
        assert len(dropped) >= rig.engine.total_published - published > 0
        rig.converge()
        assert relay.output_stats.heartbeats > beats
        assert relay.output_stats.snapshots == 1  # the gap was in the buffer
        assert relay.stats.batches_out == rig.engine.total_published
        assert relay.subscriber.stats.gaps == 0

        rig.stop_dynamo()
        rig.start_dynamo()
        rig.converge()
        assert relay.output_stats.snapshots == 2
        assert relay.output_stats.opened == 1
