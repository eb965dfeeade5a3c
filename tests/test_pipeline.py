"""The worker-stream pipeline every consumer shares: bad frames, per-source resets, uncleared
sources, one normalizer per worker, and its sinks.

Streams come from real :class:`Publisher` sockets on 127.0.0.1 through a real
:class:`Subscriber`, so resets are the ones the subscriber itself raises (an engine restart, a
first message past 0 without a replay socket); the index is the real Dynamo-backed
:class:`TieredIndex`. Tests of the pipeline's own branches feed it items directly.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence

import msgspec
import pytest
import structlog
import zmq
from support.reference import dump_rows

from kvbridge import TieredIndex
from kvbridge.adapters.capture import FrameRecord
from kvbridge.adapters.pipeline import (
    EventSink,
    IndexSink,
    PublisherSink,
    StreamPipeline,
    record_source,
)
from kvbridge.adapters.publisher import Publisher
from kvbridge.adapters.source import Message, Source, StreamReset
from kvbridge.adapters.stream_stats import BadFrame, PipelineStats
from kvbridge.adapters.subscriber import Subscriber
from kvbridge.normalizers.batch import NormalizedBatch
from kvbridge.schemas import TieredEvent, decode_batch
from kvbridge.schemas.vllm import Event
from kvbridge.testing.events import encoded, removed, stored

BS = 4
LOCAL = "tcp://127.0.0.1:0"
TIMEOUT = 5.0

A, B, C, D = ([10 * k + i for i in range(BS)] for k in range(1, 5))
"""Token blocks: A+B and C+D are two-block prompts."""

SOURCE = Source("tcp://*:1", None, 1)
"""A source for the tests that feed the pipeline directly."""


# --------------------------------------------------------------------------- helpers


class Recorder:
    """A sink that keeps what it was given, in order."""

    def __init__(self) -> None:
        self.seen: list[tuple[Source, list[TieredEvent], float]] = []

    def apply(self, batch: NormalizedBatch, source: Source, ts: float, /) -> None:
        self.seen.append((source, list(batch.events), ts))

    def shapes(self) -> list[tuple[int, list[tuple[int, int, str]]]]:
        """Each delivery as (source worker, [(worker, rank, kind)]), kind stored/removed/cleared."""
        return [
            (source.worker_id, [(e.worker_id, e.dp_rank, _kind(e)) for e in events])
            for source, events, _ in self.seen
        ]


def _kind(event: TieredEvent) -> str:
    data = event.event.data
    if data == "cleared":
        return "cleared"
    return "stored" if data.stored is not None else "removed"


CLEARS = 4
"""A rank's clear is one event per tier."""


def store(*blocks: list[int], hashes: Sequence[int], medium: str = "GPU") -> Event:
    return stored(list(hashes), [t for block in blocks for t in block], medium=medium)


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


class Engines:
    """Bound publishers on 127.0.0.1, one per source, and a subscriber that connects to all."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], workers: Sequence[int]) -> None:
        self.publishers = [Publisher(LOCAL, bind=True, context=ctx) for _ in workers]
        self.sources = [
            Source(f"tcp://*:{pub.endpoint.rsplit(':', 1)[1]}", None, worker)
            for pub, worker in zip(self.publishers, workers, strict=True)
        ]
        self.subscriber = Subscriber(self.sources, context=ctx)
        for pub in self.publishers:
            assert pub.wait_for_subscribers(timeout=TIMEOUT)

    def send(self, pipeline: StreamPipeline, index: int, data: bytes, **kwargs: bool) -> None:
        """Publish on source ``index`` and feed the pipeline until that batch came through."""
        seq = self.publishers[index].publish(data, **kwargs)
        if kwargs.get("send", True):
            self.pump(pipeline, self.sources[index], seq)

    def pump(self, pipeline: StreamPipeline, source: Source, seq: int) -> list[object]:
        items: list[object] = []
        deadline = time.monotonic() + TIMEOUT
        while self.subscriber.last_seq(source) != seq:
            assert time.monotonic() < deadline, f"seq {seq} never arrived"
            for item in self.subscriber.poll(20):
                items.append(item)
                pipeline.feed(item)
        return items

    def close(self) -> None:
        self.subscriber.close()
        for pub in self.publishers:
            pub.close()


MakeEngines = Callable[..., Engines]


@pytest.fixture
def engines(ctx: zmq.Context[zmq.Socket[bytes]]) -> Iterator[MakeEngines]:
    opened: list[Engines] = []

    def make(*workers: int) -> Engines:
        opened.append(Engines(ctx, workers))
        return opened[-1]

    yield make
    for rig in opened:
        rig.close()


def overlap(index: TieredIndex, tokens: list[int]) -> dict[tuple[int, int], tuple[int, int, int]]:
    return {k: (o.device, o.host_pinned, o.disk) for k, o in index.overlap(tokens).items()}


# --------------------------------------------------------------------------- bad frames


@pytest.mark.parametrize(
    "bad",
    [
        b"",
        b"\xc1",
        msgspec.msgpack.encode({"ts": 0.0}),
        msgspec.msgpack.encode([time.time(), [{"type": "Bogus"}], 0]),
        msgspec.msgpack.encode([time.time(), [["BlockStored", [1, 2], None, [1], 4]], 0]),
    ],
    ids=["empty", "not-msgpack", "map", "unknown-event", "too-few-tokens"],
)
def test_a_bad_frame_is_counted_logged_and_skipped_leaving_state_unchanged(
    engines: MakeEngines, bad: bytes
) -> None:
    rig = engines(1)
    index = TieredIndex(BS)
    pipeline = StreamPipeline(BS, sinks=[IndexSink(index)])
    rig.send(pipeline, 0, encoded([store(A, B, hashes=[1, 2])]))
    worker = pipeline.workers[1]
    before = (dump_rows(index), Counter(worker.normalizer.dropped), dict(worker.ranks), worker.lag)

    with structlog.testing.capture_logs() as logs:
        rig.send(pipeline, 0, bad)

    after = (dump_rows(index), Counter(worker.normalizer.dropped), dict(worker.ranks), worker.lag)
    assert after == before
    assert pipeline.stats == PipelineStats(batches_in=2, bad_frames=Counter({BadFrame.SCHEMA: 1}))
    [entry] = [entry for entry in logs if entry["event"] == "bad frame skipped"]
    assert entry["stream"] == rig.sources[0].endpoint
    assert entry["seq"] == 1
    assert entry["reason"] == "schema"
    assert entry["error"]
    # The stream goes on: the next batch, removing block 2, applies as if the bad one never was.
    rig.send(pipeline, 0, encoded([removed([2])]))
    assert overlap(index, A + B) == {(1, 0): (1, 1, 1)}
    assert worker.normalizer.stats == Counter()


# --------------------------------------------------------------------------- resets


def test_a_source_reset_clears_exactly_the_ranks_that_source_delivered(
    engines: MakeEngines,
) -> None:
    # Worker 1 has two sources: the first delivers ranks 0 and 2, the second rank 1. Worker 2
    # has a rank 0 of its own.
    rig = engines(1, 1, 2)
    index = TieredIndex(BS)
    recorder = Recorder()
    pipeline = StreamPipeline(BS, sinks=[IndexSink(index), recorder])
    first, second, _ = rig.sources
    rig.send(pipeline, 0, encoded([store(A, B, hashes=[1, 2])], dp_rank=0))
    rig.send(pipeline, 0, encoded([store(A, B, hashes=[1, 2])], dp_rank=2))
    rig.send(pipeline, 1, encoded([store(A, B, hashes=[1, 2])], dp_rank=1))
    rig.send(pipeline, 2, encoded([store(A, B, hashes=[1, 2])], dp_rank=0))
    assert pipeline.workers[1].ranks == {first: {0, 2}, second: {1}}
    assert set(overlap(index, A + B)) == {(1, 0), (1, 1), (1, 2), (2, 0)}

    # The first engine restarts: its seq goes back to 0, which the subscriber turns into a reset.
    rig.publishers[0].restart()
    recorder.seen.clear()
    items = rig.pump(pipeline, first, rig.publishers[0].publish(encoded([store(C, hashes=[3])])))
    assert [type(item) for item in items] == [StreamReset, Message]

    assert recorder.shapes() == [
        (1, [(1, 0, "cleared")] * CLEARS),
        (1, [(1, 2, "cleared")] * CLEARS),
        (1, [(1, 0, "stored")]),
    ]
    assert overlap(index, A + B) == {key: (2, 2, 2) for key in [(1, 1), (2, 0)]}
    assert overlap(index, C) == {(1, 0): (1, 1, 1)}
    assert pipeline.workers[1].ranks == {first: {0}, second: {1}}


def test_an_uncleared_source_clears_its_rank_before_its_first_batch(engines: MakeEngines) -> None:
    index = TieredIndex(BS)
    # A previous run left worker 1's rank 1 in the index (a relay that restarted, say).
    earlier = StreamPipeline(BS, sinks=[IndexSink(index)])
    earlier.feed_batch(
        Source("tcp://*:1", None, 1), encoded([store(A, B, hashes=[1, 2])], dp_rank=1), 0
    )
    assert overlap(index, A + B) == {(1, 1): (2, 2, 2)}

    rig = engines(1)
    recorder = Recorder()
    pipeline = StreamPipeline(BS, sinks=[IndexSink(index), recorder])
    [source] = rig.sources
    # The engine's seq 0 never arrives and there is no replay socket: the subscriber resets the
    # source before any batch has named its rank.
    rig.send(pipeline, 0, encoded([store(C, hashes=[3])], dp_rank=1), send=False)
    items = rig.pump(
        pipeline, source, rig.publishers[0].publish(encoded([store(D, hashes=[4])], dp_rank=1))
    )
    assert [type(item) for item in items] == [StreamReset, Message]
    assert items[0] == StreamReset(source, "lost", 1)

    # The clear and the batch go out together: one delivery, one canonical payload.
    assert recorder.shapes() == [(1, [(1, 1, "cleared")] * CLEARS + [(1, 1, "stored")])]
    assert overlap(index, A + B) == {}
    assert overlap(index, D) == {(1, 1): (1, 1, 1)}
    worker = pipeline.workers[1]
    assert worker.uncleared == set()
    assert worker.ranks == {source: {1}}

    # Only the first batch is preceded by a clear.
    recorder.seen.clear()
    rig.send(pipeline, 0, encoded([store(A, hashes=[1])], dp_rank=1))
    assert recorder.shapes() == [(1, [(1, 1, "stored")])]


def test_a_bad_first_frame_of_an_uncleared_source() -> None:
    """A bad frame changes nothing, not even the clear the source owes: that goes out with the
    source's first good batch, whatever the bad frames looked like."""
    source = Source("tcp://*:1", None, 1)
    recorder = Recorder()
    pipeline = StreamPipeline(BS, sinks=[recorder])
    pipeline.feed(StreamReset(source, "lost", 3))
    assert recorder.seen == []
    assert pipeline.workers[1].uncleared == {source}

    pipeline.feed(Message(source, 3, b"", b"\xc1", 0))
    assert recorder.seen == []
    assert pipeline.workers[1].uncleared == {source}

    bad_event = msgspec.msgpack.encode([time.time(), [{"type": "Bogus"}], 2])
    pipeline.feed(Message(source, 4, b"", bad_event, 0))
    assert recorder.seen == []
    assert pipeline.workers[1].uncleared == {source}
    assert pipeline.workers[1].ranks == {}
    assert pipeline.stats.bad_frames[BadFrame.SCHEMA] == 2

    pipeline.feed(Message(source, 5, b"", encoded([store(A, hashes=[1])], dp_rank=2), 0))
    assert recorder.shapes() == [(1, [(1, 2, "cleared")] * CLEARS + [(1, 2, "stored")])]
    assert pipeline.workers[1].uncleared == set()
    assert pipeline.workers[1].ranks == {source: {2}}


UNCHECKED = StreamReset(SOURCE, "restart", checked=False)
"""A restart taken from a publisher check that went unanswered."""


@pytest.mark.parametrize(
    ("resets", "extension"),
    [
        ([UNCHECKED], "reanchored"),
        ([UNCHECKED, StreamReset(SOURCE, "lost", 3)], "reanchored"),
        ([UNCHECKED, StreamReset(SOURCE, "restart")], "reanchored"),
        ([StreamReset(SOURCE, "lost", 3), StreamReset(SOURCE, "restart")], "reanchored"),
        ([StreamReset(SOURCE, "restart")], "dropped"),
        ([StreamReset(SOURCE, "restart"), StreamReset(SOURCE, "lost", 3)], "dropped"),
        ([StreamReset(SOURCE, "restart"), UNCHECKED], "dropped"),
    ],
    ids=[
        "unchecked",
        "unchecked, lost",
        "unchecked, resync",
        "lost, restart",
        "restart",
        "restart, lost",
        "restart, unchecked",
    ],
)
def test_resets_before_a_batch_clear_once_and_keep_what_the_first_kept(
    resets: list[StreamReset], extension: str
) -> None:
    """A restart the publisher check could not confirm keeps the worker's identities, as a
    loss does, so the chain A+B is announced again by a store that extends it; a checked
    restart forgets them, so that store's parent is unknown. A reset that follows another
    before any batch (the loss or the resync of the batches a restart's replay could not
    deliver) clears nothing again and keeps what the first kept."""
    recorder = Recorder()
    pipeline = StreamPipeline(BS, sinks=[recorder])
    pipeline.feed(Message(SOURCE, 0, b"", encoded([store(A, B, hashes=[1, 2])]), 0))
    for reset in resets:
        pipeline.feed(reset)
    pipeline.feed(Message(SOURCE, 4, b"", encoded([stored([3], C, parent=2)]), 0))

    reanchored = extension == "reanchored"
    assert recorder.shapes() == [
        (1, [(1, 0, "stored")]),
        (1, [(1, 0, "cleared")] * CLEARS),
        *([(1, [(1, 0, "stored")])] if reanchored else []),
    ]
    stored_blocks = [
        [len(e.event.data.stored.blocks) for e in events if e.event.data != "cleared"]
        for _, events, _ in recorder.seen
    ]
    assert stored_blocks == [[2], [], *([[3]] if reanchored else [])]
    normalizer = pipeline.workers[1].normalizer
    assert normalizer.reanchored_blocks == (2 if reanchored else 0)
    assert dict(normalizer.stats) == ({} if reanchored else {"orphan_parent": 1})


# --------------------------------------------------------------------------- shared normalizer


def test_two_sources_of_one_worker_share_its_normalizer(engines: MakeEngines) -> None:
    rig = engines(1, 1, 2)
    index = TieredIndex(BS)
    pipeline = StreamPipeline(BS, sinks=[IndexSink(index)])
    first, second, other = rig.sources
    assert pipeline.add_source(first) is pipeline.add_source(second)
    assert pipeline.add_source(first) is not pipeline.add_source(other)

    # The first source stores A+B on the GPU; the second sends CPU placeholders (no tokens) for
    # the same engine hashes, and later removes one from the GPU. Both resolve only through the
    # state the first source's batch left in the worker's normalizer.
    rig.send(pipeline, 0, encoded([store(A, B, hashes=[1, 2])]))
    rig.send(pipeline, 1, encoded([stored([1], [], medium="CPU"), stored([2], [], medium="CPU")]))
    rig.send(pipeline, 1, encoded([removed([2])]))
    assert overlap(index, A + B) == {(1, 0): (1, 2, 2)}
    assert pipeline.workers[1].normalizer.stats == Counter()

    # Worker 2 has its own: the same hashes mean nothing there.
    rig.send(pipeline, 2, encoded([removed([2])]))
    assert pipeline.workers[2].normalizer.stats == Counter({"unknown_block": 1})


# --------------------------------------------------------------------------- sinks and inputs


class _PayloadsOnly:
    """Stands in for a batch that has its payloads and no events (a native normalizer that
    encoded for a publisher only): fails if a sink asks for events."""

    def __init__(self, payloads: list[bytes]) -> None:
        self.payloads = payloads

    def __len__(self) -> int:
        return len(self.payloads)

    def canonical_payloads(self, ts: float) -> list[bytes]:
        return self.payloads

    @property
    def events(self) -> list[TieredEvent]:
        raise AssertionError("the publisher sink asked for events")


def test_the_publisher_sink_republishes_canonical_payloads(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    publisher = Publisher(LOCAL, bind=True, context=ctx, first_seq=1000)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(publisher.endpoint)
    try:
        assert publisher.wait_for_subscribers(timeout=TIMEOUT)
        source = Source("tcp://*:1", None, 7)
        stats = PipelineStats()
        sink: EventSink = PublisherSink(publisher, stats)
        pipeline = StreamPipeline(BS, stats=stats)
        pipeline.add_source(source, sink)
        pipeline.add_source(Source("tcp://*:2", None, 7))  # no sink: nothing published for it
        engine_hash = 0xDEAD_BEEF
        pipeline.feed_batch(source, encoded([store(A, hashes=[engine_hash])], dp_rank=3), 0)
        pipeline.feed_batch(
            Source("tcp://*:2", None, 7), encoded([store(B, hashes=[9])], dp_rank=4), 0
        )

        assert sub.poll(int(TIMEOUT * 1000))
        _, seq, data = sub.recv_multipart()
        assert int.from_bytes(seq, "big") == 1000
        batch = decode_batch(data)
        assert batch.data_parallel_rank == 3
        [event] = batch.events
        assert event.token_ids == A
        assert event.block_hashes != [engine_hash]  # the canonical hash, not the engine's
        assert not sub.poll(200)
        assert stats == PipelineStats(batches_in=2, batches_out=1)

        # The sink builds no events: it only asks for payloads.
        canonical = pipeline.workers[7].normalizer.process(
            encoded([store(C, hashes=[5])], dp_rank=3)
        )
        payloads = _PayloadsOnly(canonical.canonical_payloads(time.time()))
        sink.apply(payloads, source, time.time())  # type: ignore[arg-type]
        assert decode_batch(sub.recv_multipart()[2]).events[0].token_ids == C
    finally:
        sub.close(0)
        publisher.close()


def test_capture_records_payloads_and_decoded_batches_index_the_same() -> None:
    batches = [
        encoded([store(A, B, hashes=[1, 2])]),
        encoded([stored([1, 2], [], medium="CPU")]),
        encoded([removed([2])]),
    ]
    records = [
        FrameRecord(i, "replay:tcp://*:5557" if i == 1 else "tcp://*:5557", 3, [b"", bytes(8), p])
        for i, p in enumerate(batches)
    ]
    assert {record_source(record) for record in records} == {Source("tcp://*:5557", None, 3)}
    indexes = []
    for decoded in (False, True):
        index = TieredIndex(BS)
        pipeline = StreamPipeline(BS, sinks=[IndexSink(index)])
        for record in records:
            pipeline.feed_record(
                record, decoded=decode_batch(record.frames[2]) if decoded else None
            )
        assert pipeline.workers[3].ranks == {Source("tcp://*:5557", None, 3): {0}}
        indexes.append(dump_rows(index))
    assert indexes[0] == indexes[1]
    assert indexes[0]["device"] != indexes[0]["host_pinned"]
