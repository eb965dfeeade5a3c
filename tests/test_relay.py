"""``kvbridge relay`` end to end: a subprocess between vLLM-format publishers and a real, unmodified
``dynamo.llm.SelectionService``, over real sockets on 127.0.0.1.

1. Dynamo registered with the relay's endpoints indexes exactly what the engines hold, on every
   tier, for the streams its native decoder gets wrong (a second service registered directly on
   the engines' publishers shows the wrong numbers).
2. Dynamo recovers, through the relay's replay ROUTER, batches the relay published before the
   service existed.
3. Bad frames are counted by reason (relay metrics, ``kvbridge watch``) and the relay keeps
   serving.
4. The relay's Prometheus metrics after a stream with tiers, drops, a replayed gap and a restart.
5. A backlog goes out merged: one canonical batch holding the events of the queued ones.
6. The outputs of a worker with two dp ranks name each its own rank before any batch has.

The relay, its replay protocol and Dynamo's listener: README.md, "The relay in front of Dynamo"
and "Failure modes".
"""

from __future__ import annotations

import hashlib
import itertools
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import msgspec
import pytest
import structlog
import zmq
from support.ipv6 import requires_ipv6
from support.rebind import bound_again
from support.relay_faults import fault, inject_step_fault, stopped
from support.relay_process import RelayProcess, Samples, kvbridge_command, port_of, wait_tcp_peers
from support.selection_harness import Overlap, SelectionHarness

from kvbridge import Normalizer
from kvbridge.adapters import relay as relay_module
from kvbridge.adapters.endpoints import is_ipv6, tcp_address
from kvbridge.adapters.ports import free_port_range
from kvbridge.adapters.publisher import Publisher
from kvbridge.adapters.relay import DEFAULT_MERGE_BYTES, Relay
from kvbridge.adapters.replay_buffer import SNAPSHOT_ATTEMPTS
from kvbridge.adapters.replay_protocol import END_SEQ, parse_answer, request_frames
from kvbridge.adapters.socket_limits import DEFAULT_OUTPUT_HWM, OUTPUT_QUEUE_BYTES, output_hwm_for
from kvbridge.adapters.source import Source
from kvbridge.normalizers.batch import NormalizedBatch, merged_canonical_payloads
from kvbridge.schemas.vllm import Event
from kvbridge.testing.events import BLOCK_SIZE, TS0, encoded, placeholder, removed, stored

LOCAL = "tcp://127.0.0.1:0"


def digest(name: bytes) -> bytes:
    """A raw SHA-256 block hash, as vLLM sends it with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0."""
    return hashlib.sha256(name).digest()


def seq8(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


# --------------------------------------------------------------------------- the rig


class Rig:
    """vLLM-like source publishers (one per worker, each with a replay ROUTER) and a
    ``kvbridge relay`` subprocess republishing the ``i``-th of them on ``publish[i]`` with
    replays on ``replay[i]``, every socket on the loopback ``host`` (IPv4 or IPv6)."""

    def __init__(
        self,
        stack: ExitStack,
        log_dir: Path,
        worker_ids: Sequence[int],
        *,
        extra: Sequence[str] = (),
        buffer_steps: int = 10_000,
        host: str = "127.0.0.1",
    ) -> None:
        self.stack = stack
        self.log_dir = log_dir
        self.worker_ids = list(worker_ids)
        self.sources: list[Publisher] = []
        local = tcp_address(host, 0)
        for _ in worker_ids:
            source = stack.enter_context(
                Publisher(local, bind=True, replay_endpoint=local, buffer_steps=buffer_steps)
            )
            source.start_replay_thread()
            self.sources.append(source)
        count = len(worker_ids)
        base = free_port_range(2 * count + 1)
        self.publish = [tcp_address(host, base + i) for i in range(count)]
        self.replay = [tcp_address(host, base + count + i) for i in range(count)]
        wildcard = "::" if is_ipv6(local) else "*"
        self.metrics_port = base + 2 * count
        self.args: list[str] = []
        for worker_id, source in zip(worker_ids, self.sources, strict=True):
            assert source.replay_endpoint is not None
            # A wildcard host: the engine binds and the relay connects, as with vLLM's default.
            self.args += ["--source", tcp_address(wildcard, port_of(source.endpoint))]
            self.args += ["--source-replay", tcp_address(wildcard, port_of(source.replay_endpoint))]
            self.args += ["--worker-id", str(worker_id)]
        self.args += ["--publish", self.publish[0], "--publish-replay", self.replay[0]]
        self.args += ["--block-size", str(BLOCK_SIZE), *extra]
        self.runs = 0
        self.relay = self.start_relay()

    def start_relay(self) -> RelayProcess:
        """Start (or, once the previous one is closed, restart) the relay subprocess."""
        self.runs += 1
        self.relay = self.stack.enter_context(
            RelayProcess(
                self.args,
                metrics_port=self.metrics_port,
                log_path=self.log_dir / f"relay-{self.metrics_port}-{self.runs}.log",
            )
        )
        return self.relay

    def source(self, worker_id: int) -> Publisher:
        return self.sources[self.worker_ids.index(worker_id)]

    def register(self, harness: SelectionHarness, worker_id: int, *, replay: bool = True) -> None:
        """Register ``worker_id`` with the relay's output (and replay) endpoints, and wait until
        the service's SUB is connected to it."""
        index = self.worker_ids.index(worker_id)
        record = harness.add_worker(
            worker_id,
            block_size=BLOCK_SIZE,
            endpoints={0: self.publish[index]},
            replay_endpoint=self.replay[index] if replay else None,
        )
        assert record["lifecycle"] == "schedulable"

    def wait_connected(self, peers_per_output: int = 1, sources: int = 1) -> None:
        """Block until the relay (and ``sources - 1`` others) subscribe to every source and
        ``peers_per_output`` services subscribe to every relay output."""
        for source, publish in zip(self.sources, self.publish, strict=True):
            assert source.wait_for_subscribers(sources)
            wait_tcp_peers(port_of(publish), peers_per_output)


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as resources:
        yield resources


@pytest.fixture
def make_rig(stack: ExitStack, tmp_path: Path) -> Callable[..., Rig]:
    def make(
        worker_ids: Sequence[int],
        *,
        extra: Sequence[str] = (),
        buffer_steps: int = 10_000,
        host: str = "127.0.0.1",
    ) -> Rig:
        return Rig(stack, tmp_path, worker_ids, extra=extra, buffer_steps=buffer_steps, host=host)

    return make


@pytest.fixture
def harness(stack: ExitStack) -> SelectionHarness:
    return stack.enter_context(SelectionHarness())


def one_worker(
    make_rig: Callable[..., Rig], harness: SelectionHarness, **options: Any
) -> tuple[Rig, Publisher]:
    """A rig (made with ``options``) relaying worker 1, registered with ``harness`` and
    connected both ways: the rig and the worker's source."""
    rig = make_rig([1], **options)
    rig.register(harness, 1)
    rig.wait_connected()
    return rig, rig.source(1)


def blocks_samples(samples: Samples, name: str) -> dict[tuple[str, ...], float]:
    """A metric's samples as ``{label values in sorted label-name order: value}``."""
    return {
        tuple(value for _, value in sorted(labels)): value
        for (sample, labels), value in samples.items()
        if sample == name
    }


# --------------------------------------------------------------------------- 1. correctness


def test_relay_fixes_what_dynamo_gets_wrong(make_rig: Callable[..., Rig]) -> None:
    """Every stream below goes to the relay and, for comparison, straight to Dynamo.

    ``relay`` is a SelectionService registered with the relay's endpoints, ``native`` one
    registered with the engines' own publishers. Both have workers 1 and 2.
    """
    rig = make_rig([1, 2])
    with SelectionHarness() as relay, SelectionHarness() as native:
        for worker_id in (1, 2):
            rig.register(relay, worker_id)
            source = rig.source(worker_id)
            assert source.replay_endpoint is not None
            native.add_worker(
                worker_id,
                block_size=BLOCK_SIZE,
                endpoints={0: source.endpoint},
                replay_endpoint=source.replay_endpoint,
            )
        rig.wait_connected(sources=2)  # the relay and `native` subscribe to each engine
        sentinels = itertools.count(1)

        def publish(worker_id: int, *events: Event) -> None:
            rig.source(worker_id).publish(encoded(events))

        def sync(worker_id: int) -> None:
            """A one-block store of fresh tokens both services index: once both see it, they
            have processed everything published before it on that worker's stream."""
            n = next(sentinels)
            tokens = [900_000 + 4 * n + i for i in range(BLOCK_SIZE)]
            publish(worker_id, stored([10**15 + n], tokens))
            want = {(worker_id, 0): (1, 1, 1)}
            assert relay.wait_for(lambda: relay.overlap(tokens) == want), relay.overlap(tokens)
            assert native.wait_for(lambda: native.overlap(tokens) == want), native.overlap(tokens)

        def check(tokens: list[int], via_relay: Overlap, direct: Overlap) -> None:
            assert (relay.overlap(tokens), native.overlap(tokens)) == (via_relay, direct)

        # (a) Raw SHA-256 digests as block hashes. Dynamo rejects the whole batch ("data did
        # not match any variant of untagged enum BlockHashValue"); the relay indexes it.
        bytes_prompt = list(range(100, 112))
        a1, a2, a3 = digest(b"a1"), digest(b"a2"), digest(b"a3")
        publish(
            1,
            stored([a1, a2], bytes_prompt[:8]),
            stored([a3], bytes_prompt[8:], parent=a2),
        )
        sync(1)
        check(bytes_prompt, {(1, 0): (3, 3, 3)}, {})
        publish(1, removed([a3]))
        sync(1)
        check(bytes_prompt, {(1, 0): (2, 2, 2)}, {})

        # (b) OffloadingConnector placeholders (no tokens, block size 0, "CPU"): block 3
        # offloaded while on the GPU, blocks 3-4 evicted from the GPU, then block 4 offloaded
        # after its eviction. Dynamo drops placeholders ("Block size must be 4 tokens ... Block
        # size is: 0"); the relay resolves them through the engine hash.
        offload_prompt = list(range(200, 216))
        publish(1, stored([201, 202, 203, 204], offload_prompt))
        publish(1, placeholder([203]))
        publish(1, removed([203]), removed([204]))  # one BlockRemoved per GPU hash
        publish(1, placeholder([204]))
        sync(1)
        check(offload_prompt, {(1, 0): (2, 4, 4)}, {(1, 0): (2, 2, 2)})

        # (c) Mooncake / LMCache lower-case "cpu". Dynamo: unknown medium, dropped.
        lower_prompt = list(range(300, 312))
        publish(
            1,
            stored([301, 302], lower_prompt[:8]),
            stored([301, 302, 303], lower_prompt, medium="cpu"),
        )
        sync(1)
        check(lower_prompt, {(1, 0): (2, 3, 3)}, {(1, 0): (2, 2, 2)})

        # (d) Two engines hash the same tokens differently. Dynamo keeps the first writer's
        # hash per node: worker 2's extension fails ("Failed to find parent block") and its
        # removals silently do nothing. The relay rewrites both to the same canonical hashes.
        shared = list(range(400, 416))

        def workers(first: int, second: int) -> Overlap:
            return {(1, 0): (first,) * 3, (2, 0): (second,) * 3}

        publish(1, stored([401, 402, 403], shared[:12]))
        sync(1)
        publish(2, stored([501, 502, 503], shared[:12]))
        sync(2)
        check(shared, workers(3, 3), workers(3, 3))
        publish(2, stored([504], shared[12:], parent=503))
        sync(2)
        check(shared, workers(3, 4), workers(3, 3))
        publish(2, removed([504]), removed([503]))
        sync(2)
        check(shared, workers(3, 2), workers(3, 3))
        publish(1, removed([403]))
        sync(1)
        check(shared, workers(2, 2), workers(2, 3))

        # (e) Self-describing CPU chunks of 2 blocks over a shared prefix: the second chunk
        # re-announces block 2, then one chunk's copy of block 2 is evicted. Dynamo has no
        # reference counts and drops block 2 (the CPU prefix falls to 1 block); the relay keeps
        # it, since the other chunk still holds it.
        chunk_prompt = list(range(600, 612))
        publish(1, stored([601, 602], chunk_prompt[:8], medium="CPU"))
        publish(1, stored([602, 603], chunk_prompt[4:], parent=601, medium="CPU"))
        sync(1)
        check(chunk_prompt, {(1, 0): (0, 3, 3)}, {(1, 0): (0, 3, 3)})
        publish(1, removed([602], medium="CPU"))
        sync(1)
        check(chunk_prompt, {(1, 0): (0, 3, 3)}, {(1, 0): (0, 1, 1)})

        # Nothing else changed meanwhile.
        check(bytes_prompt, {(1, 0): (2, 2, 2)}, {})
        check(offload_prompt, {(1, 0): (2, 4, 4)}, {(1, 0): (2, 2, 2)})
        check(lower_prompt, {(1, 0): (2, 3, 3)}, {(1, 0): (2, 2, 2)})
    assert rig.relay.value("kvbridge_bad_frames_total", reason="schema") == 0
    assert rig.relay.value("kvbridge_lost_batches_total") == 0


# --------------------------------------------------------------------------- 2. relay replay


def test_dynamo_replays_from_the_relay(make_rig: Callable[..., Rig]) -> None:
    """Four batches go through the relay before any SelectionService exists. A service
    registered afterwards with the relay's publish and replay endpoints sees one live batch
    (seq > 0, so it replays from 0 over the relay's ROUTER) and then holds all five; one
    registered without the replay endpoint holds only the live one."""
    rig = make_rig([7], extra=["--merge-bytes", "0"])  # a message per batch: counted below
    rig.wait_connected(peers_per_output=0)
    source = rig.source(7)
    prompt = list(range(100, 112))
    source.publish(encoded([stored([11, 12], prompt[:8])]))
    source.publish(encoded([stored([13], prompt[8:], parent=12)]))
    source.publish(encoded([stored([12, 13], prompt[4:], parent=11, medium="CPU")]))
    source.publish(encoded([removed([13])]))
    assert rig.relay.wait_value("kvbridge_batches_total", 4, direction="out")

    with SelectionHarness() as with_replay, SelectionHarness() as without_replay:
        rig.register(with_replay, 7)
        rig.register(without_replay, 7, replay=False)
        rig.wait_connected(peers_per_output=2)
        later = list(range(500, 504))
        source.publish(encoded([stored([21], later)]))
        assert with_replay.wait_for(lambda: with_replay.overlap(later) == {(7, 0): (1, 1, 1)})
        assert without_replay.wait_for(lambda: without_replay.overlap(later) == {(7, 0): (1, 1, 1)})
        assert with_replay.overlap(prompt) == {(7, 0): (2, 3, 3)}
        assert without_replay.overlap(prompt) == {}
    assert rig.relay.value("kvbridge_batches_total", direction="out") == 5


@requires_ipv6
def test_every_socket_of_the_way_speaks_ipv6(make_rig: Callable[..., Rig]) -> None:
    """The engine binds ``[::1]`` (the relay is given ``tcp://[::]:PORT``, vLLM's wildcard, and
    connects to ``[::1]``), the relay publishes on ``[::1]``, and Dynamo subscribes there. Every
    socket of the way is IPv6: the engine's PUB and ROUTER, the relay's SUB, DEALER, PUB and
    ROUTER, Dynamo's SUB and DEALER. A batch the relay misses is replayed from the engine, and
    a service registered late replays the rest from the relay."""
    rig = make_rig([7], extra=["--merge-bytes", "0"], host="::1")
    assert rig.publish[0].startswith("tcp://[::1]:")
    rig.wait_connected(peers_per_output=0)
    source = rig.source(7)
    prompt = list(range(100, 112))
    source.publish(encoded([stored([11, 12], prompt[:8])]))
    source.publish(encoded([stored([13], prompt[8:], parent=12)]), send=False)  # a gap
    source.publish(encoded([stored([12, 13], prompt[4:], parent=11, medium="CPU")]))
    assert rig.relay.wait_value("kvbridge_batches_total", 3, direction="out")
    assert rig.relay.value("kvbridge_replayed_batches_total") == 2

    with SelectionHarness() as harness:
        rig.register(harness, 7)
        rig.wait_connected()
        later = list(range(500, 504))
        source.publish(encoded([stored([21], later)]))
        assert harness.wait_for(lambda: harness.overlap(later) == {(7, 0): (1, 1, 1)})
        assert harness.overlap(prompt) == {(7, 0): (3, 3, 3)}


# --------------------------------------------------------------------------- 3. bad frames


MAX_FRAME_BYTES = 256


def send_bad_frames(publisher: Publisher) -> None:
    """An oversized (otherwise valid) frame, a 2-frame message and an undecodable payload,
    then a valid batch storing two blocks of tokens 100-107."""
    big = encoded([stored(range(1000, 1020), range(80))])
    assert len(big) > MAX_FRAME_BYTES
    publisher.send_frames([b"", seq8(publisher.next_seq), big])
    publisher.send_frames([b"", seq8(publisher.next_seq)])
    assert publisher.publish(b"\xc1garbage") == 0
    assert publisher.publish(encoded([stored([1, 2], range(100, 108))])) == 1


def test_bad_frames_counted_and_relay_keeps_serving(
    make_rig: Callable[..., Rig], harness: SelectionHarness, stack: ExitStack, tmp_path: Path
) -> None:
    """(Dynamo alone, for comparison: it has no frame-size limit and indexes the oversized
    batch's 20 blocks, logs "Unexpected ZMQ frame count: 2", and skips the garbage as a
    repeated seq 0.)"""
    # `kvbridge watch` on a publisher of its own, started first to overlap the start-up costs.
    watched = stack.enter_context(Publisher(LOCAL, bind=True))
    watch_log = stack.enter_context((tmp_path / "watch.log").open("wb"))
    watch = subprocess.Popen(
        kvbridge_command(
            "watch",
            "--source",
            f"tcp://*:{port_of(watched.endpoint)}",
            "--block-size",
            str(BLOCK_SIZE),
            "--max-frame-bytes",
            str(MAX_FRAME_BYTES),
            "--duration",
            "2",
            "--interval",
            "1",
        ),
        stdout=subprocess.PIPE,
        stderr=watch_log,
        text=True,
    )
    stack.callback(lambda: watch.poll() is None and watch.kill())
    # Its 2 s count from its start-up: send as soon as it subscribes, then start the relay.
    assert watched.wait_for_subscribers(1, timeout=15)
    send_bad_frames(watched)

    rig, source = one_worker(make_rig, harness, extra=["--max-frame-bytes", str(MAX_FRAME_BYTES)])
    send_bad_frames(source)

    prompt = list(range(100, 108))
    assert harness.wait_for(lambda: harness.overlap(prompt) == {(1, 0): (2, 2, 2)})
    relay = rig.relay
    assert relay.wait_value("kvbridge_batches_total", 2, direction="in")
    samples = relay.metrics()
    assert blocks_samples(samples, "kvbridge_bad_frames_total") == {
        ("frame_count",): 1,
        ("oversized",): 1,
        ("schema",): 1,
    }
    assert blocks_samples(samples, "kvbridge_batches_total") == {("in",): 2, ("out",): 1}
    for name in ("gaps", "lost_batches", "restarts"):
        assert samples["kvbridge_" + name + "_total", frozenset()] == 0, name
    # One replay: the start-up replay from 0, which found nothing to deliver.
    assert samples["kvbridge_replays_total", frozenset()] == 1
    # The refused frame's tokens were never indexed.
    assert harness.overlap(list(range(80))) == {}

    out, _ = watch.communicate(timeout=15)
    assert watch.returncode == 0, (tmp_path / "watch.log").read_text()
    lines = out.strip().splitlines()
    assert lines[-3:] == [
        "batches 2 | gaps 0 | replays 0 (recovered 0) | lost 0 | restarts 0",
        "bad frames: frame_count=1, oversized=1, schema=1",
        "not forwarded: none",
    ], out
    # The worker row of the last render: worker 0 (no --worker-id), dp 0, 2 device blocks.
    row = lines[-5].split()
    assert row[:6] == ["0", "0", "2", "0", "0", "0"], out


# --------------------------------------------------------------------------- 4. metrics


def test_metrics_after_tiers_drops_gap_and_restart(
    make_rig: Callable[..., Rig], harness: SelectionHarness
) -> None:
    # a message per batch, so that the batches out are counted exactly below
    rig, source = one_worker(make_rig, harness, extra=["--merge-bytes", "0"])
    old = list(range(100, 112))
    new = list(range(200, 208))

    def publish(*events: Event, send: bool = True) -> int:
        return source.publish(encoded(events), send=send)

    publish(stored([1, 2, 3], old))  # stored device forwarded 3
    publish(stored([2, 3], old[4:], parent=1, medium="CPU"))  # stored host_pinned forwarded 2
    publish(removed([3]))  # removed device forwarded 1
    publish(stored([1], old[:4]))  # stored device duplicate_store 1
    assert publish(stored([9], range(900, 904), medium="FLOPPY")) == 4  # unknown_medium 1
    assert harness.wait_for(lambda: harness.overlap(old) == {(1, 0): (2, 3, 3)})

    # The engine restarts: the relay clears worker 1 on every tier (in Dynamo too, on a stream
    # whose sequence keeps increasing, while the engine's own went back to 0).
    source.restart()
    assert publish(stored([11, 12], new)) == 0  # stored device forwarded 2
    # seq 1 never reaches the relay; seq 2 opens a gap that the relay replays (1 and 2).
    assert publish(stored([12], new[4:], parent=11, medium="CPU"), send=False) == 1
    assert publish(removed([12])) == 2  # stored host_pinned 1, removed device 1
    assert harness.wait_for(lambda: harness.overlap(new) == {(1, 0): (1, 2, 2)})
    assert harness.overlap(old) == {}

    relay = rig.relay
    assert relay.wait_value("kvbridge_replayed_batches_total", 2)
    samples = relay.metrics()
    assert blocks_samples(samples, "kvbridge_blocks_total") == {
        # label values in name order: outcome, tier, type, worker
        ("forwarded", "device", "stored", "1"): 5,
        ("forwarded", "host_pinned", "stored", "1"): 3,
        ("forwarded", "device", "removed", "1"): 2,
        ("duplicate_store", "device", "stored", "1"): 1,
        ("unknown_medium", "unknown", "stored", "1"): 1,
    }
    assert blocks_samples(samples, "kvbridge_clears_total") == {
        (tier, "1"): 1 for tier in ("device", "host_pinned", "disk", "external")
    }
    assert blocks_samples(samples, "kvbridge_resident_blocks") == {
        # dp_rank, tier, worker
        ("0", "device", "1"): 1,
        ("0", "host_pinned", "1"): 1,
        ("0", "disk", "1"): 0,
        ("0", "external", "1"): 0,
    }
    counters = {
        name: samples[name, frozenset()]
        for name in (
            "kvbridge_gaps_total",
            "kvbridge_replays_total",
            "kvbridge_replayed_batches_total",
            "kvbridge_lost_batches_total",
            "kvbridge_restarts_total",
            "kvbridge_duplicate_batches_total",
        )
    }
    assert counters == {
        "kvbridge_gaps_total": 1,
        "kvbridge_replays_total": 2,  # the start-up replay from 0, then the gap
        "kvbridge_replayed_batches_total": 2,
        "kvbridge_lost_batches_total": 0,
        "kvbridge_restarts_total": 1,
        "kvbridge_duplicate_batches_total": 1,  # the live copy of seq 2
    }
    # 8 in: 5 before the restart, seqs 0, 1 (replayed) and 2 after; 7 out: the duplicate store and
    # the unknown medium produce nothing, the restart one AllBlocksCleared batch.
    assert blocks_samples(samples, "kvbridge_batches_total") == {("in",): 8, ("out",): 7}
    assert blocks_samples(samples, "kvbridge_bad_frames_total") == {}
    assert blocks_samples(samples, "kvbridge_unknown_fields_total") == {("1",): 0}
    lag = blocks_samples(samples, "kvbridge_lag_seconds")
    assert list(lag) == [("1",)]
    assert 0 <= lag["1",] < 5


def test_restart_after_a_replayed_gap_clears_the_worker(
    make_rig: Callable[..., Rig], harness: SelectionHarness
) -> None:
    """The other order of test 4's events: a gap replayed (seqs 1-2), then a restart."""
    rig, source = one_worker(make_rig, harness)
    old = list(range(100, 112))
    new = list(range(200, 204))
    source.publish(encoded([stored([1], old[:4])]))
    source.publish(encoded([stored([2], old[4:8], parent=1)]), send=False)
    source.publish(encoded([stored([3], old[8:], parent=2)]))  # gap: 1-2 replayed
    assert harness.wait_for(lambda: harness.overlap(old) == {(1, 0): (3, 3, 3)})

    source.restart()
    assert source.publish(encoded([stored([11], new)])) == 0
    relay = rig.relay

    def outcome() -> tuple[float, float]:
        return (
            relay.value("kvbridge_restarts_total"),
            relay.value("kvbridge_duplicate_batches_total"),
        )

    # Either a restart or one more duplicate (the live copy of seq 2 is the first one). Before
    # 061e8a2 the restarted engine's seq 0 (<= the last replayed seq) counted as a duplicate,
    # (0, 2), and its batches were dropped until its seq passed 2.
    assert harness.wait_for(lambda: sum(outcome()) == 2)
    assert outcome() == (1, 1)
    assert harness.wait_for(lambda: harness.overlap(new) == {(1, 0): (1, 1, 1)}, timeout=2)
    assert harness.overlap(old) == {}


# --------------------------------------------------------------------------- relay restarts


def test_relay_restart_with_lost_batches_clears_dynamo(
    make_rig: Callable[..., Rig], harness: SelectionHarness
) -> None:
    """The relay is restarted while the engine evicts a prefix, and the engine's replay buffer
    (2 batches) no longer reaches back to that eviction: the relay cannot know what was
    removed, so it must clear the worker in Dynamo rather than leave the prefix there."""
    rig, source = one_worker(make_rig, harness, buffer_steps=2)
    old = list(range(100, 108))
    later = [list(range(200 + 100 * i, 204 + 100 * i)) for i in range(3)]
    assert source.publish(encoded([stored([1, 2], old)])) == 0
    assert harness.wait_for(lambda: harness.overlap(old) == {(1, 0): (2, 2, 2)})

    rig.relay.close()
    assert source.publish(encoded([removed([1]), removed([2])])) == 1  # while it is down
    assert source.publish(encoded([stored([3], later[0])])) == 2
    assert source.publish(encoded([stored([4], later[1])])) == 3
    relay = rig.start_relay()
    wait_tcp_peers(port_of(source.endpoint), 1)
    wait_tcp_peers(port_of(rig.publish[0]), 1)
    # At start the relay replays from 0, gets 2 and 3 (the buffer holds two), and counts 0-1
    # lost: the worker is cleared in Dynamo before batch 2 is applied.
    assert source.publish(encoded([stored([5], later[2])])) == 4
    assert harness.wait_for(lambda: harness.overlap(later[2]) == {(1, 0): (1, 1, 1)})
    assert relay.value("kvbridge_lost_batches_total") == 2
    assert relay.value("kvbridge_replayed_batches_total") == 2
    assert harness.overlap(later[1]) == {(1, 0): (1, 1, 1)}
    assert harness.overlap(later[0]) == {(1, 0): (1, 1, 1)}  # batch 2, recovered at start
    assert harness.overlap(old) == {}  # actual: {(1, 0): (2, 2, 2)}, evicted long ago


# --------------------------------------------------------------------------- 5. merged backlog


def _backlog() -> list[bytes]:
    """Five batches of one engine: a chain stored, offloaded, partly removed, extended."""
    tokens = [list(range(BLOCK_SIZE * i, BLOCK_SIZE * (i + 1))) for i in range(4)]
    steps: list[list[Event]] = [
        [stored([11, 12], tokens[0] + tokens[1])],
        [stored([13], tokens[2], parent=12)],
        [stored([12, 13], tokens[1] + tokens[2], parent=11, medium="CPU")],
        [removed([13])],
        [stored([14], tokens[3], parent=12), removed([12, 13], medium="CPU")],
    ]
    return [encoded(events, ts=TS0 + step) for step, events in enumerate(steps)]


def _output_sub(
    ctx: zmq.Context[zmq.Socket[bytes]], relay: Relay, source: Source
) -> zmq.Socket[bytes]:
    """A SUB on ``source``'s relay output, every message, 5 s to receive one."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.connect(relay.endpoints(source)[0])
    return sub


def _backlog_batches() -> list[tuple[NormalizedBatch, float]]:
    """The backlog normalized one batch at a time by a fresh normalizer, each with the engine
    time the relay stamps it with."""
    normalizer = Normalizer(worker_id=1, block_size=BLOCK_SIZE)
    return [(normalizer.process(p, seq), TS0 + seq) for seq, p in enumerate(_backlog())]


def _events(payload: bytes) -> tuple[float, list[object], int]:
    ts, events, rank = msgspec.msgpack.decode(payload)
    return ts, events, rank


@pytest.mark.parametrize("merge_bytes", [DEFAULT_MERGE_BYTES, 1])
def test_a_backlog_goes_out_merged(merge_bytes: int) -> None:
    """Batches queued before the relay steps go out as one canonical batch with every event
    of theirs in order (those the same batches make one by one), stamped with the last one's
    time. With ``merge_bytes`` below a batch's size each batch is a message of its own, as the
    normalizer writes it."""
    payloads = _backlog()
    alone = [
        _events(canonical)
        for batch, ts in _backlog_batches()
        for canonical in batch.canonical_payloads(ts)
    ]
    base = free_port_range(2)
    ctx = zmq.Context()
    engine = Publisher(f"tcp://127.0.0.1:{base}", context=ctx, bind=True)
    source = Source(engine.endpoint, worker_id=1, bind=False)
    with (
        engine,
        Relay(
            [source],
            block_size=BLOCK_SIZE,
            publish=f"tcp://127.0.0.1:{base + 1}",
            heartbeat_s=None,
            context=ctx,
            merge_bytes=merge_bytes,
        ) as relay,
    ):
        out = _output_sub(ctx, relay, source)
        assert engine.wait_for_subscribers()
        wait_tcp_peers(base + 1, 1)
        for payload in payloads:
            engine.publish(payload)
        time.sleep(0.5)  # five small messages over loopback: all queued on the relay's SUB
        assert relay.step(1000) == len(payloads)
        received = [_events(out.recv_multipart()[-1]) for _ in range(relay.stats.batches_out)]
        out.setsockopt(zmq.RCVTIMEO, 200)
        with pytest.raises(zmq.Again):
            out.recv_multipart()
        out.close(linger=0)
    ctx.term()
    if merge_bytes == 1:
        assert received == alone
    else:
        merged_events = [event for _, events, _ in alone for event in events]
        assert received == [(TS0 + len(payloads) - 1, merged_events, 0)]
        assert len(merged_events) == 6  # one per input event: every one is forwarded


def test_two_outputs_each_merge_their_own_batches() -> None:
    """Batches of two engines queued interleaved go out as one merged batch per output, each
    with its own engine's events in order."""
    payloads = _backlog()
    base = free_port_range(4)
    ctx = zmq.Context()
    engines = [Publisher(f"tcp://127.0.0.1:{base + i}", context=ctx, bind=True) for i in (0, 1)]
    sources = [Source(e.endpoint, worker_id=i + 1, bind=False) for i, e in enumerate(engines)]
    with (
        engines[0],
        engines[1],
        Relay(
            sources,
            block_size=BLOCK_SIZE,
            publish=f"tcp://127.0.0.1:{base + 2}",
            heartbeat_s=None,
            context=ctx,
        ) as relay,
    ):
        outs = [_output_sub(ctx, relay, source) for source in sources]
        for engine in engines:
            assert engine.wait_for_subscribers()
        wait_tcp_peers(base + 2, 1)
        wait_tcp_peers(base + 3, 1)
        for payload in payloads:
            for engine in engines:
                engine.publish(payload)
        time.sleep(0.5)  # ten small messages over loopback: all queued on the relay's SUBs
        assert relay.step(1000) == 2 * len(payloads)
        assert relay.stats.batches_out == 2
        received = [_events(out.recv_multipart()[-1]) for out in outs]
        for out in outs:
            out.close(linger=0)
    ctx.term()
    (expected,) = merged_canonical_payloads(_backlog_batches(), DEFAULT_MERGE_BYTES)
    assert received == [_events(expected)] * 2


def test_merged_payloads_take_any_bound() -> None:
    """A bound past what the core counts in means none; a negative one is refused."""
    batches = _backlog_batches()
    unbounded = merged_canonical_payloads(batches, 2**70)
    assert len(unbounded) == 1
    assert unbounded == merged_canonical_payloads(batches, sys.maxsize)
    assert len(merged_canonical_payloads(batches, 0)) == len(batches)
    with pytest.raises(ValueError, match="max_bytes must be >= 0, got -1"):
        merged_canonical_payloads(batches, -1)


@pytest.mark.parametrize(
    ("merge_bytes", "hwm"),
    [
        (DEFAULT_MERGE_BYTES, 256),  # 16 MiB of merged payloads of up to 64 KiB
        (4096, 4096),
        (1678, 9998),
        (1677, DEFAULT_OUTPUT_HWM),  # never more than unmerged
        (0, DEFAULT_OUTPUT_HWM),  # a payload per batch, as an engine sends it
        (2 * OUTPUT_QUEUE_BYTES, 1),  # never 0, which ZMQ takes as no bound
    ],
)
def test_an_outputs_high_water_mark_bounds_its_merged_payloads_in_bytes(
    merge_bytes: int, hwm: int
) -> None:
    """A consumer that never reads holds at most ``SNDHWM`` payloads queued on its output, and a
    merged one is up to ``merge_bytes``: the high-water mark comes from the merge size, so
    that such a consumer costs the relay about 16 MiB an output, not 10,000 merged payloads
    (640 MiB at 64 KiB)."""
    assert OUTPUT_QUEUE_BYTES == 16 * 1024 * 1024
    assert output_hwm_for(merge_bytes) == hwm


@pytest.mark.parametrize(
    ("merge_bytes", "output_hwm", "hwm"),
    [(DEFAULT_MERGE_BYTES, None, 256), (0, None, DEFAULT_OUTPUT_HWM), (DEFAULT_MERGE_BYTES, 7, 7)],
)
def test_each_output_socket_has_the_relays_high_water_mark(
    merge_bytes: int, output_hwm: int | None, hwm: int
) -> None:
    """Every output's PUB socket has the high-water mark given, or else the one its merge size
    implies."""
    base = free_port_range(4)  # two sources, two outputs
    sources = [Source(f"tcp://127.0.0.1:{base + i}", worker_id=i + 1, bind=False) for i in (0, 1)]
    with Relay(
        sources,
        block_size=BLOCK_SIZE,
        publish=f"tcp://127.0.0.1:{base + 2}",
        heartbeat_s=None,
        merge_bytes=merge_bytes,
        output_hwm=output_hwm,
    ) as relay:
        assert [publisher.hwm for publisher in relay.outputs.values()] == [hwm, hwm]


@pytest.mark.parametrize(
    ("extra", "hwm"),
    [((), 256), (("--merge-bytes", "0"), DEFAULT_OUTPUT_HWM), (("--output-hwm", "5"), 5)],
)
def test_the_relay_command_sets_and_logs_each_outputs_high_water_mark(
    make_rig: Callable[..., Rig], extra: tuple[str, ...], hwm: int
) -> None:
    """``kvbridge relay`` takes ``--output-hwm`` or the one ``--merge-bytes`` implies, and its
    line for each output says what the socket has."""
    rig = make_rig([1, 2], extra=extra)

    def logged() -> list[str]:
        return re.findall(r"relaying .*\boutput_hwm=(\d+)", rig.relay.log())

    assert SelectionHarness.wait_for(lambda: len(logged()) == 2), rig.relay.log()
    assert logged() == [str(hwm)] * 2


# --------------------------------------------------------------------------- 6. dp ranks


def test_outputs_of_a_dp_engine_name_their_own_rank() -> None:
    """A worker with two dp ranks is two sources; before either publishes, output 1's opening
    clear, its heartbeats and its snapshot answer all name rank 1 (the source's rank by vLLM's
    port layout), so that none of them clears or re-announces rank 0 in Dynamo."""
    base = free_port_range(6)
    sources = [Source(f"tcp://127.0.0.1:{base + rank}", worker_id=7) for rank in (0, 1)]
    ctx = zmq.Context()
    with Relay(
        sources,
        block_size=BLOCK_SIZE,
        publish=f"tcp://127.0.0.1:{base + 2}",
        publish_replay=f"tcp://127.0.0.1:{base + 4}",
        heartbeat_s=0.2,
        context=ctx,
    ) as relay:
        opened = {source: relay.outputs[source].next_seq - 1 for source in sources}
        live = _output_sub(ctx, relay, sources[1])
        relay.start()

        def replay(source: Source, start: int) -> list[tuple[float, list[object], int]]:
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.RCVTIMEO, 5000)
            dealer.connect(relay.endpoints(source)[1] or "")
            dealer.send_multipart(request_frames(start))
            batches = []
            while (answer := parse_answer(dealer.recv_multipart(), b""))[1] != END_SEQ:
                batches.append(msgspec.msgpack.decode(answer[2]))
            dealer.close(linger=0)
            return batches

        for rank, source in enumerate(sources):
            assert replay(source, opened[source])[0][1:] == [[{"type": "AllBlocksCleared"}], rank]
        _, events, rank = msgspec.msgpack.decode(live.recv_multipart()[-1])
        assert (events, rank) == ([], 1), "a heartbeat of output 1"
        snapshot, *after = [batch[1:] for batch in replay(sources[1], 0)]
        assert snapshot == [[{"type": "AllBlocksCleared"}], 1], "a snapshot of output 1"
        assert all(batch == [[], 1] for batch in after), "heartbeats published since"
        assert relay.output_stats.snapshots == 1
        live.close(linger=0)
    ctx.term()


# --------------------------------------------------------------------------- 6b. snapshots


def _wait(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _replay_answer(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, start: int
) -> list[tuple[int, tuple[float, list[dict[str, Any]], int]]]:
    """``(seq, decoded batch)`` of each batch a replay request from ``start`` is answered with."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 5000)
    dealer.connect(endpoint)
    dealer.send_multipart(request_frames(start))
    answer = []
    while (frames := parse_answer(dealer.recv_multipart(), b""))[1] != END_SEQ:
        answer.append((int.from_bytes(frames[1], "big"), msgspec.msgpack.decode(frames[2])))
    dealer.close(linger=0)
    return answer


def _snapshot_relay(
    ctx: zmq.Context[zmq.Socket[bytes]], buffer_steps: int, heartbeat_s: float | None = None
) -> tuple[Publisher, Source, Relay]:
    base = free_port_range(3)
    engine = Publisher(f"tcp://127.0.0.1:{base}", context=ctx, bind=True)
    source = Source(engine.endpoint, worker_id=1, bind=False)
    relay = Relay(
        [source],
        block_size=BLOCK_SIZE,
        publish=f"tcp://127.0.0.1:{base + 1}",
        publish_replay=f"tcp://127.0.0.1:{base + 2}",
        buffer_steps=buffer_steps,
        heartbeat_s=heartbeat_s,
        merge_bytes=0,
        context=ctx,
    )
    return engine, source, relay


def test_a_snapshot_never_takes_the_seq_of_a_live_batch() -> None:
    """A snapshot of a source that named three dp ranks is three payloads, numbered from the
    seq asked for. Asked from two below the output's next seq (a buffer of one batch), they
    would reach that seq, which the next live batch then takes: a listener that applied the
    answer drops that batch as a duplicate, and its block is never indexed. The relay first
    publishes an empty batch to move its sequence past the snapshot's numbering."""
    ctx = zmq.Context()
    engine, source, relay = _snapshot_relay(ctx, buffer_steps=1)
    with engine, relay:
        output = relay.outputs[source]
        live = _output_sub(ctx, relay, source)
        relay.start()
        assert engine.wait_for_subscribers()
        for n, rank in enumerate((0, 1, 2), 1):
            engine.publish(encoded([stored([10 + rank], [rank] * 4)], dp_rank=rank))
            _wait(lambda: relay.stats.batches_in == n)  # noqa: B023 - waited on at once
        for _ in range(3):
            live.recv_multipart()
        next_seq = output.next_seq
        answer = _replay_answer(ctx, output.replay_endpoint or "", next_seq - 2)
        engine.publish(encoded([stored([99], [9] * 4)], dp_rank=0))
        after = [live.recv_multipart() for _ in range(2)]
        live.close(linger=0)
        heartbeats = relay.output_stats.heartbeats
    ctx.term()

    assert [seq - next_seq for seq, _ in answer] == [-2, -1, 0]
    assert [[event["type"] for event in batch[1]] + [batch[2]] for _, batch in answer] == [
        ["AllBlocksCleared", "BlockStored", rank] for rank in (0, 1, 2)
    ]
    (beat_seq, beat), (store_seq, store) = (
        (int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)) for _, seq, payload in after
    )
    assert (beat_seq - next_seq, beat[1:]) == (0, [[], 2]), "an empty batch moved the sequence"
    assert (store_seq - next_seq, [event["type"] for event in store[1]]) == (1, ["BlockStored"])
    assert heartbeats == 1


def test_a_relay_asleep_in_a_long_poll_is_woken_for_a_snapshot_and_to_stop() -> None:
    """The relay's thread sleeps in its subscriber's poll between batches. A snapshot request,
    queued by the replay thread, and :meth:`Relay.close` wake it rather than wait for the poll
    to time out: polling a minute at a time, the relay still answers a request older than its
    buffer with the snapshot (the replay thread gives up waiting after ``SNAPSHOT_TIMEOUT_S``,
    and the answer would be the buffer's last batch alone), and close ends its threads at
    once."""
    ctx = zmq.Context()
    before = set(threading.enumerate())
    engine, source, relay = _snapshot_relay(ctx, buffer_steps=1)
    with engine, relay:
        relay.start(timeout_ms=60_000)
        threads = set(threading.enumerate()) - before
        assert engine.wait_for_subscribers()
        engine.publish(encoded([stored([10], [1] * 4)]))
        engine.publish(encoded([stored([11], [2] * 4, parent=10)]))
        _wait(lambda: relay.stats.batches_in == 2)
        answer = _replay_answer(ctx, relay.outputs[source].replay_endpoint or "", 0)
        assert [event["type"] for _, batch in answer for event in batch[1]] == [
            "AllBlocksCleared",
            "BlockStored",
            "BlockStored",
        ]
        assert relay.output_stats.snapshots == 1
        assert sorted(thread.name for thread in threads) == ["kv-replays", "kvbridge-relay"]
        started = time.monotonic()
        relay.close()
        # Not woken, close would wait out the replay thread's poll (a second), then give the
        # relay's thread 5 s and close its sockets under it.
        assert time.monotonic() - started < 0.5
        assert [thread.name for thread in threads if thread.is_alive()] == []
    ctx.term()


def test_heartbeats_cap_the_relay_threads_poll() -> None:
    """An idle output's heartbeats are sent between polls: a relay started with a poll of a
    minute still polls half of ``heartbeat_s`` at most, and keeps its idle outputs beating."""
    ctx = zmq.Context()
    engine, _, relay = _snapshot_relay(ctx, buffer_steps=8, heartbeat_s=0.1)
    with engine, relay:
        relay.start(timeout_ms=60_000)
        _wait(lambda: relay.output_stats.heartbeats >= 3)
    ctx.term()


def test_a_relay_thread_still_busy_when_close_gives_up_keeps_its_sockets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``close`` waits a while for the relay's thread to stop. A thread still busy then (here a
    test double of a step that takes longer, which blocks) keeps the sockets, rather than have
    them closed under it (ZMQ sockets are not thread-safe, and libzmq may abort the process),
    and closes them itself when it ends; close logs that."""
    monkeypatch.setattr(relay_module, "_STOP_TIMEOUT_S", 0.2)
    ctx = zmq.Context()
    engine, source, relay = _snapshot_relay(ctx, buffer_steps=1)
    busy, release = threading.Event(), threading.Event()

    def blocking_step(timeout_ms: int = 100) -> int:
        busy.set()
        release.wait(10)
        return 0

    relay.step = blocking_step  # type: ignore[method-assign]
    output = relay.outputs[source]
    with engine:
        relay.start()
        assert busy.wait(10)
        with structlog.testing.capture_logs() as logs:
            relay.close()
        assert [line["event"] for line in logs if line["log_level"] == "warning"] == [
            "relay thread still busy; it closes its sockets when it ends"
        ]
        output.publish(encoded([]))  # still open
        release.set()
        _wait(lambda: _closed(output), timeout=10)
    ctx.term()


def _closed(publisher: Publisher) -> bool:
    try:
        publisher.publish(encoded([]), send=False)
    except RuntimeError as error:
        assert str(error) == "publisher is closed"
        return True
    return False


@pytest.mark.parametrize("held", [1, SNAPSHOT_ATTEMPTS], ids=["once", "every time"])
def test_a_snapshot_whose_point_left_the_buffer_is_taken_again(held: int) -> None:
    """The replay thread reads the buffer after the relay's thread took the snapshot; batches
    published between the two can push the snapshot's point out of a small buffer, and the
    answer would skip them. Here the replay thread is held after the first snapshot (as the OS
    could deschedule it) while three batches go out: the snapshot is taken again, and the
    answer holds every block. Held after every one, the last snapshot still goes out, with the
    buffer's batches after its point: a listener without one would hold no state at all."""
    ctx = zmq.Context()
    engine, source, relay = _snapshot_relay(ctx, buffer_steps=2)
    output = relay.outputs[source]
    provider = output.snapshot
    assert provider is not None
    points: list[int] = []
    taken, resume = threading.Event(), threading.Event()

    def held_once(start_seq: int) -> tuple[int, list[bytes]] | None:
        snapshot = provider(start_seq)
        assert snapshot is not None
        points.append(snapshot[0])
        if len(points) <= held:
            taken.set()
            resume.wait(5)
            resume.clear()
        return snapshot

    output.snapshot = held_once
    with engine, relay:
        relay.start()
        assert engine.wait_for_subscribers()
        published = 0

        def publish(block: int) -> None:
            nonlocal published
            engine.publish(encoded([stored([block], list(range(4 * block, 4 * block + 4)))]))
            published += 1
            _wait(lambda: relay.stats.batches_in == published)

        for block in (1, 2, 3):
            publish(block)
        answering = threading.Thread(
            target=lambda: answers.append(_replay_answer(ctx, output.replay_endpoint or "", 0))
        )
        answers: list[list[tuple[int, tuple[float, list[dict[str, Any]], int]]]] = []
        answering.start()
        for round_ in range(held):
            assert taken.wait(5)
            taken.clear()
            for block in range(100 + 3 * round_, 103 + 3 * round_):
                publish(block)
            resume.set()
        answering.join(10)
    ctx.term()

    assert [point - points[0] for point in points] == [3 * n for n in range(held + 1)][:3]
    (seq, (_, events, _)), *after = answers[0]
    assert seq == 0
    stored_blocks = [event["token_ids"][0] // 4 for event in events[1:]]
    if held == 1:
        assert after == []
        assert [event["type"] for event in events] == ["AllBlocksCleared"] + ["BlockStored"] * 6
        assert stored_blocks == [1, 2, 3, 100, 101, 102]
    else:  # the third snapshot, as of block 105, then what the buffer kept after it
        assert stored_blocks == [1, 2, 3, *range(100, 106)]
        assert [seq - points[-1] for seq, _ in after] == [1, 2]  # 106, at 0, was pushed out
        assert [batch[1][0]["token_ids"][0] // 4 for _, batch in after] == [107, 108]


def test_a_relay_that_cannot_bind_an_output_closes_what_it_opened() -> None:
    """Output 1's port is taken: the relay raises, and leaves nothing open behind it (output
    0's PUB and replay ROUTER, its subscriber's sockets), so that the same relay can be made
    once the port is free."""
    base = free_port_range(6)
    ctx = zmq.Context()
    sources = [Source(f"tcp://127.0.0.1:{base + rank}", worker_id=1) for rank in (0, 1)]
    relay_ports = {
        "block_size": BLOCK_SIZE,
        "publish": f"tcp://127.0.0.1:{base + 2}",
        "publish_replay": f"tcp://127.0.0.1:{base + 4}",
        "context": ctx,
    }
    squatter = ctx.socket(zmq.PUB)
    squatter.bind(f"tcp://127.0.0.1:{base + 3}")
    with pytest.raises(zmq.ZMQError, match="Address already in use"):
        Relay(sources, **relay_ports)
    squatter.close(linger=0)
    # ZMQ releases a closed socket's port in its I/O thread, after close returns.
    with bound_again(lambda: Relay(sources, **relay_ports)) as relay:
        assert [relay.endpoints(source) for source in sources] == [
            (f"tcp://127.0.0.1:{base + 2 + rank}", f"tcp://127.0.0.1:{base + 4 + rank}")
            for rank in (0, 1)
        ]
    ctx.destroy(linger=0)


# --------------------------------------------------------------------------- 7. a relay that stops


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_relay_whose_thread_stops_on_an_error_keeps_it() -> None:
    """A fault injected as a test double of a bug (the relay's step raises) ends the relay's
    thread; :attr:`Relay.failure` keeps the error for whoever watches the relay (a replica's
    health check), and closing the relay afterwards is clean."""
    ctx = zmq.Context()
    base = free_port_range(1)
    relay = Relay([Source(f"tcp://127.0.0.1:{base}")], block_size=BLOCK_SIZE, context=ctx)
    assert relay.failure is None
    inject_step_fault(relay)
    relay.start()
    assert repr(stopped(relay).failure) == "RuntimeError('injected fault')"
    relay.close()
    ctx.term()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_relay_whose_replay_thread_stops_on_an_error_says_so() -> None:
    """A fault injected as a test double of a bug in the thread that serves the outputs'
    replays (answering a request raises): the thread ends, and :attr:`Relay.failure` says so,
    since the relay no longer recovers its consumers' gaps."""
    ctx = zmq.Context()
    base = free_port_range(3)
    with Relay(
        [Source(f"tcp://127.0.0.1:{base}")],
        block_size=BLOCK_SIZE,
        publish=f"tcp://127.0.0.1:{base + 1}",
        publish_replay=f"tcp://127.0.0.1:{base + 2}",
        context=ctx,
    ) as relay:
        assert relay._replays is not None
        for replays in relay._replays._sockets.values():
            replays.serve = fault  # type: ignore[method-assign]
        assert relay.failure is None
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{base + 2}")
        dealer.send_multipart(request_frames(0))
        assert repr(stopped(relay).failure) == "RuntimeError('injected fault')"
        dealer.close(linger=0)
    ctx.term()
