"""The subscriber's input bounds over real sockets on 127.0.0.1: a per-poll budget shared
round-robin by the sources, frames refused by ZMQ past ``MAXMSGSIZE``, sequence jumps, clears
rate-limited per source, and log lines limited per stream and reason (issue 10, input side).

A :class:`Publisher` stands in for each engine; the subscriber never decodes a payload, so
the payloads are arbitrary bytes.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from copy import deepcopy
from typing import Any

import pytest
import structlog
import zmq
from support.polling import poll_until, wait_until
from support.rebind import bound_again, engine_on, listener_gone

from kvbridge.adapters.logs import DEFAULT_BURST
from kvbridge.adapters.ports import free_port_range
from kvbridge.adapters.publisher import Publisher
from kvbridge.adapters.source import Message, Source, StreamReset
from kvbridge.adapters.stream_stats import BadFrame, SubscriberStats
from kvbridge.adapters.subscriber import DEFAULT_CLEAR_BURST, MAXMSGSIZE_MARGIN, Subscriber

LOCAL = "tcp://127.0.0.1:0"
TIMEOUT = 10.0


def engine(ctx: zmq.Context[zmq.Socket[bytes]], worker_id: int = 1) -> tuple[Publisher, Source]:
    """A publisher without a replay socket and the Source that connects to it."""
    publisher = Publisher(LOCAL, bind=True, context=ctx)
    port = publisher.endpoint.rsplit(":", 1)[1]
    return publisher, Source(f"tcp://*:{port}", None, worker_id)


@contextmanager
def subscribed(
    ctx: zmq.Context[zmq.Socket[bytes]], **options: Any
) -> Iterator[tuple[Publisher, Subscriber]]:
    """One engine (:func:`engine`) and a :class:`Subscriber` to it with ``options``, once the
    engine sees the subscription; both closed on exit."""
    publisher, source = engine(ctx)
    with publisher, Subscriber([source], context=ctx, **options) as subscriber:
        assert publisher.wait_for_subscribers(timeout=TIMEOUT)
        yield publisher, subscriber


def messages(stats: SubscriberStats) -> int:
    return stats.messages


def drain(
    subscriber: Subscriber, until: int, count: Callable[[SubscriberStats], int] = messages
) -> list[Message | StreamReset]:
    """Poll until ``count(subscriber.stats)`` reaches ``until``."""
    return poll_until(subscriber, lambda: count(subscriber.stats) >= until, timeout=TIMEOUT)


def queued(subscriber: Subscriber, socket_count: int) -> None:
    """Wait until ZMQ has everything published queued on the subscriber's side."""
    time.sleep(0.5)


# --------------------------------------------------------------------------- 1. budget


def test_a_fast_source_does_not_starve_a_slow_one(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    (fast, fast_source), (slow, slow_source) = engine(ctx, 1), engine(ctx, 2)
    with (
        fast,
        slow,
        Subscriber(
            [fast_source, slow_source], context=ctx, poll_budget=300, source_budget=200
        ) as subscriber,
    ):
        assert fast.wait_for_subscribers(timeout=TIMEOUT)
        assert slow.wait_for_subscribers(timeout=TIMEOUT)
        for _ in range(5000):
            fast.publish(b"f")
        for _ in range(10):
            slow.publish(b"s")
        time.sleep(0.5)  # all of it queued in the SUB sockets
        first = subscriber.poll(100)
        by_source = Counter(item.source.worker_id for item in first)
        # The slow source's 10 came out in the first poll, the fast one's were capped.
        assert by_source == {1: 200, 2: 10}
        second = subscriber.poll(100)
        assert Counter(item.source.worker_id for item in second) == {1: 200}
        rest = drain(subscriber, 5010)
        stats = deepcopy(subscriber.stats)

    seqs = [item.seq for item in [*first, *second, *rest] if isinstance(item, Message)]
    assert sorted(seqs) == sorted([*range(5000), *range(10)])
    assert stats == SubscriberStats(messages=5010)  # RCVHWM (10,000) held the backlog: nothing shed


def test_the_poll_budget_is_shared_round_robin(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    engines = [engine(ctx, worker) for worker in range(8)]
    sources = [source for _, source in engines]
    with Subscriber(sources, context=ctx, poll_budget=100, source_budget=1000) as subscriber:
        for publisher, _ in engines:
            assert publisher.wait_for_subscribers(timeout=TIMEOUT)
            for _ in range(1000):
                publisher.publish(b"x")
        time.sleep(0.5)
        served: Counter[int] = Counter()
        for _ in range(16):
            for item in subscriber.poll(100):
                served[item.source.worker_id] += 1
        for publisher, _ in engines:
            publisher.close()
    # 16 polls of 100 messages, in rounds of 32 per source, resuming where the last one
    # stopped: every source got its share, within one round.
    assert sum(served.values()) == 1600
    assert max(served.values()) - min(served.values()) <= 32, served


# --------------------------------------------------------------------------- 2. frame size


def test_a_frame_past_maxmsgsize_is_refused_and_the_subscriber_reconnects(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    with subscribed(ctx, max_frame_bytes=1024) as (publisher, subscriber):
        publisher.publish(b"ok")  # 0
        drain(subscriber, 1)
        publisher.publish(b"y" * 1500)  # 1: received, counted oversized
        drain(subscriber, 1, lambda stats: stats.bad_frames[BadFrame.OVERSIZED])
        publisher.publish(b"z" * (1024 + MAXMSGSIZE_MARGIN + 1))  # 2: refused by ZMQ
        drain(subscriber, 1, lambda stats: stats.disconnects)
        deadline = time.monotonic() + TIMEOUT
        items: list[Message | StreamReset] = []
        while subscriber.stats.messages < 2:  # until the reconnected SUB gets one
            assert time.monotonic() < deadline, subscriber.stats
            publisher.publish(b"ok")
            items.extend(subscriber.poll(50))
        stats = deepcopy(subscriber.stats)

    # The stream goes on after the refused frame: the publisher is checked (without a replay
    # socket it is taken as the same), and the gap is counted lost. (A poll can end early, on
    # the new SUB's handshake, so the last poll may bring more than one batch.)
    reset, *batches = items
    assert isinstance(reset, StreamReset)
    assert isinstance(items[1], Message) and items[1].seq >= 3
    assert [item.seq for item in batches if isinstance(item, Message)] == list(
        range(items[1].seq, items[1].seq + len(batches))
    )
    assert stats == SubscriberStats(
        messages=1 + len(batches),
        disconnects=1,
        reconnect_checks=1,
        gaps=1,
        lost=items[1].seq - 1,
        bad_frames=Counter({BadFrame.OVERSIZED: 1}),
    )


def test_a_drop_in_the_same_poll_as_its_sockets_messages(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """A batch queued on the SUB when ZMQ refuses the next frame: one poll finds the SUB and
    its monitor ready, and the SUB is replaced before its messages are read. The subscriber
    reads only sockets it still holds (the old one's queue is a gap of the new one)."""
    with subscribed(ctx, max_frame_bytes=1024) as (publisher, subscriber):
        publisher.publish(b"ok")  # 0
        drain(subscriber, 1)
        for _ in range(50):
            publisher.publish(b"ok")  # 1-50: queued on the SUB
        publisher.publish(b"z" * (1024 + MAXMSGSIZE_MARGIN + 1))  # 51: refused by ZMQ
        time.sleep(0.5)
        assert subscriber.poll(0) == []
        assert subscriber.stats == SubscriberStats(messages=1, disconnects=1)
        deadline = time.monotonic() + TIMEOUT
        while subscriber.stats.messages < 2:  # until the reconnected SUB gets one
            assert time.monotonic() < deadline, subscriber.stats
            publisher.publish(b"ok")
            items = subscriber.poll(50)
        stats = deepcopy(subscriber.stats)
    reset, *batches = items
    assert isinstance(reset, StreamReset) and isinstance(items[1], Message)
    assert [item.seq for item in batches if isinstance(item, Message)] == list(
        range(items[1].seq, items[1].seq + len(batches))
    )
    assert stats == SubscriberStats(
        messages=1 + len(batches), disconnects=1, reconnect_checks=1, gaps=1, lost=items[1].seq - 1
    )


@pytest.mark.parametrize(
    ("buffered", "expected", "stats"),
    [
        (
            [b"batch %d" % n for n in range(7)],
            [(5, b"batch 5"), (6, b"batch 6")],
            SubscriberStats(
                messages=5, disconnects=1, reconnect_checks=1, gaps=1, replays=1, replayed=2
            ),
        ),
        (
            [b"other %d" % n for n in range(5)],
            ["restart", *((n, b"other %d" % n) for n in range(5))],
            SubscriberStats(
                messages=5, disconnects=1, reconnect_checks=1, replays=2, restarts=1, replayed=5
            ),
        ),
        (
            [],
            ["restart"],
            SubscriberStats(messages=5, disconnects=1, reconnect_checks=1, replays=2, restarts=1),
        ),
    ],
    ids=["same publisher", "new process", "new process, idle"],
)
def test_a_reconnect_checks_whether_the_publisher_is_the_same(
    ctx: zmq.Context[zmq.Socket[bytes]],
    buffered: list[bytes],
    expected: list[object],
    stats: SubscriberStats,
) -> None:
    """The engine's socket goes away after seq 4 and a publisher comes back on the same ports,
    and sends nothing live: what it buffered arrives once the SUB is connected again (the
    catch-up), not at its next batch. The sequence cannot tell a reconnect from a new process
    that has published as many batches; the replay of seq 4 can. The same bytes (a reconnect):
    the batches the drop cost, 5 and 6. Other bytes, or none (a new process, idle or not): a
    restart, replayed from 0."""
    base = free_port_range(2)
    source = Source(f"tcp://*:{base}", f"tcp://*:{base + 1}", 1)

    publisher = engine_on(ctx, base)
    first = publisher()
    with Subscriber([source], context=ctx) as subscriber:
        assert first.wait_for_subscribers(timeout=TIMEOUT)
        for n in range(5):
            first.publish(b"batch %d" % n)
        drain(subscriber, 5)
        first.close()
        listener_gone(base)
        drain(subscriber, 1, lambda stats: stats.disconnects)
        with bound_again(publisher) as second:
            for payload in buffered:
                second.publish(payload, send=False)
            assert second.wait_for_subscribers(timeout=TIMEOUT)
            items: list[Message | StreamReset] = []

            def step() -> None:
                items.extend(subscriber.poll(20))

            wait_until(lambda: len(items) >= len(expected), step, lambda: items, timeout=TIMEOUT)
            for _ in range(10):  # and nothing more
                step()
        final = deepcopy(subscriber.stats)

    assert [
        (item.seq, item.payload) if isinstance(item, Message) else item.reason for item in items
    ] == expected
    assert final == stats


# --------------------------------------------------------------------------- 3. sequences


def test_a_jump_past_max_gap_is_bad_input_and_a_stream_that_moved_is_resynced(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    with subscribed(ctx, max_gap=1000) as (publisher, subscriber):
        for seq in (0, 1, 2**40, 2, 2**62, 2**62 + 1, 2**62 + 2):
            publisher.publish(b"x", seq=seq)
        items = drain(subscriber, 7)
        stats = deepcopy(subscriber.stats)

    shape = [(i.seq,) if isinstance(i, Message) else (i.reason, i.lost_batches) for i in items]
    assert shape == [(0,), (1,), (2,), ("restart", 0), (2**62 + 1,), (2**62 + 2,)]
    assert stats == SubscriberStats(
        messages=7, resyncs=1, bad_frames=Counter({BadFrame.SEQ_JUMP: 2})
    )


def test_a_first_batch_far_past_zero_is_a_resync_not_a_loss(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    first = time.time_ns() // 1000  # where a relay's output starts
    with subscribed(ctx) as (publisher, subscriber):
        publisher.publish(b"x", seq=first)
        publisher.publish(b"x")
        items = drain(subscriber, 2)
        stats = deepcopy(subscriber.stats)
    assert [getattr(i, "seq", "reset") for i in items] == ["reset", first, first + 1]
    assert stats == SubscriberStats(messages=2, resyncs=1)


@pytest.mark.parametrize("high", [2**64 - 2, 10_000], ids=["any-seq", "within-max-gap"])
def test_random_sequence_numbers_make_a_bounded_number_of_clears(
    ctx: zmq.Context[zmq.Socket[bytes]], high: int
) -> None:
    rng = random.Random(high)
    started = time.monotonic()
    with subscribed(ctx) as (publisher, subscriber):
        for _ in range(5000):
            publisher.publish(b"x", seq=rng.randrange(0, high))
        items = drain(subscriber, 5000)
        items += subscriber.poll(50)
        stats = deepcopy(subscriber.stats)
    elapsed = time.monotonic() - started

    clears = sum(isinstance(item, StreamReset) for item in items)
    delivered = sum(isinstance(item, Message) for item in items)
    print(f"\nrandom seqs < {high}: {clears} clears in {elapsed:.1f} s, {stats}")
    # At most clear_burst, then one a second (clear_interval), per source.
    assert clears <= DEFAULT_CLEAR_BURST + elapsed + 1
    # A loss's clear names what it lost; a release's (a restart or a resync) names nothing.
    assert clears == stats.restarts + stats.resyncs + sum(
        isinstance(i, StreamReset) and i.reason == "lost" and i.lost_batches > 0 for i in items
    )
    # Every message is accounted for exactly once.
    assert stats.messages == 5000
    bad = stats.bad_frames
    assert delivered + stats.duplicates + bad[BadFrame.SEQ_JUMP] + bad[BadFrame.THROTTLED] == 5000
    assert stats.lost < 10_000 * 5000  # never 10**22


# --------------------------------------------------------------------------- 4. logs


def test_100k_garbage_frames_write_a_bounded_number_of_short_lines(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    with structlog.testing.capture_logs() as lines, subscribed(ctx) as (publisher, subscriber):
        for seq in range(100_000):
            publisher.send_frames([b"t", seq.to_bytes(8, "big")])  # two frames: frame_count
            if seq % 5000 == 0:
                subscriber.poll(0)  # keep the SUB queue under its high-water mark
        drain(subscriber, 100_000, lambda stats: stats.bad_frames[BadFrame.FRAME_COUNT])
        stats = deepcopy(subscriber.stats)

    assert stats == SubscriberStats(bad_frames=Counter({BadFrame.FRAME_COUNT: 100_000}))
    assert len(lines) <= DEFAULT_BURST
    assert all(len(repr(line)) < 2048 for line in lines)
