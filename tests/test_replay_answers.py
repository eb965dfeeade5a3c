"""Replay answers that no :class:`Publisher` gives, from a scripted replay endpoint: a ROUTER
socket on 127.0.0.1 that the test reads each request from and answers by hand, in vLLM's
protocol (``kvbridge.adapters.replay_protocol``), when and with what it chooses.

The engine is a :class:`Publisher` without a replay socket of its own; the subscriber connects
to both, as to a vLLM engine.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from copy import deepcopy
from typing import Any

import pytest
import zmq
from support.polling import TIMEOUT, poll_until, receive, shape
from support.rebind import bound_again, engine_on, listener_gone

from kvbridge.adapters.endpoints import MAX_HWM
from kvbridge.adapters.ports import free_port_range
from kvbridge.adapters.publisher import Publisher
from kvbridge.adapters.replay_protocol import answer_frames, end_frames, parse_request
from kvbridge.adapters.source import Message, Source, StreamReset
from kvbridge.adapters.stream_stats import BadFrame, SubscriberStats
from kvbridge.adapters.subscriber import MAXMSGSIZE_MARGIN, Subscriber

HUGE = b"z" * (1024 + MAXMSGSIZE_MARGIN + 1)
"""A batch past the ``MAXMSGSIZE`` of a subscriber whose ``max_frame_bytes`` is 1,024: ZMQ
refuses it by dropping the connection."""


class ScriptedReplay:
    """A bound ROUTER that answers only what the test tells it to. As vLLM's before 0.33, it
    drops what its peer's queues cannot take: past ``SNDHWM`` (and the kernel's buffers and
    the peer's ``RCVHWM``), a message is not sent (:attr:`dropped`)."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], port: int) -> None:
        self.socket = ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full queue raises: counted, not sent
        self.socket.setsockopt(zmq.SNDHWM, 3000)
        self.socket.bind(f"tcp://127.0.0.1:{port}")
        self.dropped = 0

    def request(self) -> tuple[bytes, int]:
        """The next request: the asker's identity and the first seq it asks for."""
        assert self.socket.poll(int(TIMEOUT * 1000)), "no replay request came"
        parsed = parse_request(self.socket.recv_multipart())
        assert parsed is not None
        return parsed

    def answer(self, identity: bytes, batches: list[tuple[int, bytes]], pace: int = 0) -> None:
        """``batches`` as (seq, payload), then the end marker, in vLLM 0.26's layout; with
        ``pace``, 10 ms after every ``pace`` batches, so that ZMQ's I/O threads move what
        the queues on the way can take before more comes."""
        frames = [
            answer_frames(identity, b"", seq, payload, topic_frame=True) for seq, payload in batches
        ]
        for sent, message in enumerate([*frames, end_frames(identity, topic_frame=True)], 1):
            try:
                self.socket.send_multipart(message, zmq.NOBLOCK)
            except zmq.Again:
                self.dropped += 1
            if pace and sent % pace == 0:
                time.sleep(0.01)

    def close(self) -> None:
        self.socket.close(0)


@pytest.fixture
def base() -> int:
    """Two free ports: the engine's, and its replay socket's on the next."""
    return free_port_range(2)


@pytest.fixture
def replay(ctx: zmq.Context[zmq.Socket[bytes]], base: int) -> Iterator[ScriptedReplay]:
    scripted = ScriptedReplay(ctx, base + 1)
    yield scripted
    scripted.close()


def engine_without_replay(ctx: zmq.Context[zmq.Socket[bytes]], base: int) -> Publisher:
    return Publisher(f"tcp://127.0.0.1:{base}", bind=True, context=ctx)


@contextmanager
def gap_of(
    ctx: zmq.Context[zmq.Socket[bytes]], base: int, **options: Any
) -> Iterator[tuple[Publisher, Subscriber, Source, list[Message | StreamReset]]]:
    """An engine without a replay socket on ``base``, and a subscriber (with ``options``) to
    it and to the replay endpoint on ``base + 1``, once the engine's batch 0 came through:
    the engine, the subscriber, its source and what it delivered so far."""
    source = Source(f"tcp://*:{base}", f"tcp://*:{base + 1}", 1)
    with (
        engine_without_replay(ctx, base) as engine,
        Subscriber([source], context=ctx, **options) as subscriber,
    ):
        assert engine.wait_for_subscribers(timeout=TIMEOUT)
        engine.publish(b"batch 0")
        yield engine, subscriber, source, receive(subscriber, 1)


def test_a_hole_in_a_replay_answer_is_a_loss_at_its_place(
    ctx: zmq.Context[zmq.Socket[bytes]], base: int, replay: ScriptedReplay
) -> None:
    """A gap of 1..3 answered with 1 and 3 only (2 aged out, or dropped on its way): 1 and 3
    are delivered, and a ``"lost"`` reset goes out between them, where the missing batch's
    removals would have been."""
    with gap_of(ctx, base) as (engine, subscriber, _, items):
        engine.publish(b"batch 4", seq=4)
        items += subscriber.poll(int(TIMEOUT * 1000))  # the gap's request goes out
        identity, start = replay.request()
        assert start == 1
        replay.answer(identity, [(1, b"batch 1"), (3, b"batch 3"), (4, b"batch 4")])
        items += receive(subscriber, 3)
        stats = deepcopy(subscriber.stats)

    assert shape(items) == [(0, False), (1, True), ("lost", 1), (3, True), (4, True)]
    assert [item.payload for item in items if isinstance(item, Message)] == [
        b"batch 0",
        b"batch 1",
        b"batch 3",
        b"batch 4",
    ]
    assert stats == SubscriberStats(messages=2, gaps=1, replays=1, replayed=3, duplicates=1, lost=1)


def test_a_drop_while_the_start_up_replay_is_awaited_checks_the_publisher(
    ctx: zmq.Context[zmq.Socket[bytes]], base: int, replay: ScriptedReplay
) -> None:
    """The engine goes away while the stream's first replay is unanswered; the answer then
    brings batches 0..2. A new process binds the same ports, its batches 0..3 buffered and
    none sent live: its sequence continues the old one's, so only the publisher check (batch 2
    replayed, other bytes), made once the SUB is connected again, shows a restart. Its batches
    are replayed from 0, and its first live batch, 4, continues them."""
    source = Source(f"tcp://*:{base}", f"tcp://*:{base + 1}", 1)
    first = engine_without_replay(ctx, base)
    with Subscriber(
        [source], context=ctx, replay_timeout=TIMEOUT, replay_on_start=True
    ) as subscriber:
        stats = subscriber.stats
        assert first.wait_for_subscribers(timeout=TIMEOUT)
        items = subscriber.poll(0)  # the start-up replay, from 0
        identity, start = replay.request()
        assert start == 0
        first.close()
        listener_gone(base)
        items += poll_until(subscriber, lambda: stats.disconnects > 0)
        replay.answer(identity, [(seq, b"old %d" % seq) for seq in range(3)])
        items += receive(subscriber, 3)
        replay.close()
        with bound_again(engine_on(ctx, base)) as second:
            for seq in range(4):
                second.publish(b"new %d" % seq, send=False)
            assert second.wait_for_subscribers(timeout=TIMEOUT)
            items += receive(subscriber, 4)
            second.publish(b"new 4")
            items += receive(subscriber, 1)
        final = deepcopy(stats)

    assert shape(items) == [
        (0, True),
        (1, True),
        (2, True),
        ("restart", 0),
        (0, True),
        (1, True),
        (2, True),
        (3, True),
        (4, False),
    ]
    assert [item.payload for item in items[4:] if isinstance(item, Message)] == [
        b"new 0",
        b"new 1",
        b"new 2",
        b"new 3",
        b"new 4",
    ]
    assert final == SubscriberStats(
        messages=1,
        disconnects=1,
        reconnect_checks=1,
        replays=3,
        replayed=7,
        restarts=1,
    )


def test_a_large_answer_waits_whole_between_two_polls(
    ctx: zmq.Context[zmq.Socket[bytes]], base: int, replay: ScriptedReplay
) -> None:
    """An answer of 8,000 batches of 4 KiB, from a replay endpoint that drops what its peer's
    queues cannot take (3,000 messages its own), sent while the subscriber does not poll (its
    consumer is busy): the DEALER's queue holds the whole answer (``replay_max_messages`` + 1
    messages, whatever ``rcvhwm``), so nothing is lost."""
    source = Source(f"tcp://*:{base}", f"tcp://*:{base + 1}", 1)
    count = 8000
    with (
        engine_without_replay(ctx, base) as engine,
        Subscriber(
            [source], context=ctx, rcvhwm=100, replay_max_messages=10_000, replay_timeout=TIMEOUT
        ) as subscriber,
    ):
        assert engine.wait_for_subscribers(timeout=TIMEOUT)
        engine.publish(b"batch 0")
        items = receive(subscriber, 1)
        engine.publish(b"batch %d" % (count + 1), seq=count + 1)
        items += subscriber.poll(int(TIMEOUT * 1000))  # the gap's request goes out
        identity, start = replay.request()
        assert start == 1
        replay.answer(identity, [(seq, b"%6d" % seq * 682) for seq in range(1, count + 1)], 100)
        assert replay.dropped == 0  # (the subscriber is not polled while it is sent)
        items += poll_until(subscriber, lambda: subscriber.last_seq(source) == count + 1)
        stats = deepcopy(subscriber.stats)

    assert shape(items) == [
        (0, False),
        *((seq, True) for seq in range(1, count + 1)),
        (count + 1, False),
    ]
    assert [len(item.payload) for item in items[1:-1] if isinstance(item, Message)] == [
        4092
    ] * count
    assert stats == SubscriberStats(messages=2, gaps=1, replays=1, replayed=count)


@pytest.mark.parametrize(
    ("options", "hwm"),
    [
        ({}, 100_001),
        ({"rcvhwm": 100, "replay_max_messages": 10}, 100),
        ({"rcvhwm": 0}, 0),
        ({"replay_max_messages": 2**40}, MAX_HWM),
    ],
    ids=["default", "rcvhwm larger", "unbounded", "capped"],
)
def test_a_replay_dealer_has_room_for_a_whole_answer(
    ctx: zmq.Context[zmq.Socket[bytes]], options: dict[str, int], hwm: int
) -> None:
    """The DEALER's ``RCVHWM``: the subscriber's, or the answer's bound and its end marker if
    that is more; 0 (no bound) stays 0, and nothing goes past what ZMQ takes."""
    with Subscriber([], context=ctx, **options) as subscriber:
        assert subscriber.replay_client.answer_hwm == hwm


@pytest.mark.parametrize("engine_idle", [False, True], ids=["on release", "at batch 8"])
def test_a_start_over_replays_only_the_run_after_the_last_hole(
    ctx: zmq.Context[zmq.Socket[bytes]], base: int, replay: ScriptedReplay, engine_idle: bool
) -> None:
    """A stream suspended by a loss (its one clear token spent on the loss before) starts
    over once released, from a replay from the loss, 3, which answers 3, 5, 6 and 7: only the
    run after the hole is delivered, since the missing 4 could have removed a block that 3
    stored; 3 and 4 count as lost. The release asks for it at once, and the run ends at the
    last batch the engine holds, 7. If that answer holds nothing yet (the engine had sent
    nothing since), the next live batch, 8, starts the stream over with the run that reaches
    it."""
    source = Source(f"tcp://*:{base}", f"tcp://*:{base + 1}", 1)
    held = [(seq, b"batch %d" % seq) for seq in (3, 5, 6, 7)]
    with (
        engine_without_replay(ctx, base) as engine,
        Subscriber([source], context=ctx, clear_burst=1, clear_interval=2.0) as subscriber,
    ):
        stats = subscriber.stats
        assert engine.wait_for_subscribers(timeout=TIMEOUT)
        engine.publish(b"batch 0")
        items = receive(subscriber, 1)
        # Two losses (the replay answers nothing: aged out): the first spends the token and
        # goes on, the second finds none and suspends the stream.
        went_on = (lambda: subscriber.last_seq(source) == 2, lambda: subscriber.suspended(source))
        for missing, done in zip((1, 3), went_on, strict=True):
            engine.publish(b"batch %d" % (missing + 1), seq=missing + 1)
            items += subscriber.poll(int(TIMEOUT * 1000))  # the gap's request goes out
            identity, start = replay.request()
            assert start == missing
            replay.answer(identity, [])
            items += poll_until(subscriber, done)
        items += poll_until(subscriber, lambda: stats.resyncs)  # released: the token is back
        identity, start = replay.request()  # the release's
        assert start == 3
        replay.answer(identity, [] if engine_idle else held)
        if engine_idle:
            engine.publish(b"batch 8", seq=8)
            # Read once the release's answer is in: the start-over's request goes out.
            items += poll_until(subscriber, lambda: stats.messages == 4)
            identity, start = replay.request()
            assert start == 3
            replay.answer(identity, [*held, (8, b"batch 8")])
        else:
            items += poll_until(subscriber, lambda: subscriber.last_seq(source) == 7)
            engine.publish(b"batch 8", seq=8)
        items += poll_until(subscriber, lambda: subscriber.last_seq(source) == 8)
        final = deepcopy(stats)

    assert shape(items) == [
        (0, False),
        ("lost", 1),
        (2, False),
        ("lost", 0),
        (5, True),
        (6, True),
        (7, True),
        (8, False),
    ]
    assert final == SubscriberStats(
        messages=4,
        gaps=2,
        replays=4 if engine_idle else 3,
        replayed=3,
        lost=3,
        resyncs=1,
        bad_frames=Counter({BadFrame.THROTTLED: 1}),
    )


def test_a_batch_past_maxmsgsize_in_the_engines_buffer_is_asked_past(
    ctx: zmq.Context[zmq.Socket[bytes]], base: int
) -> None:
    """Batch 1 is past ``MAXMSGSIZE``: ZMQ refuses it live, dropping the SUB's connection, and
    again in the publisher check's replay, dropping the DEALER's. The replay is asked again
    from batch 2, so the batches after the refused one that the engine holds (2 and 3, never
    sent live) come through: batch 1 alone is lost, and counted ``refused``."""
    source = Source(f"tcp://*:{base}", f"tcp://*:{base + 1}", 1)
    with (
        engine_on(ctx, base)() as engine,
        Subscriber([source], context=ctx, max_frame_bytes=1024) as subscriber,
    ):
        assert engine.wait_for_subscribers(timeout=TIMEOUT)
        engine.publish(b"batch 0")
        items = receive(subscriber, 1)
        engine.publish(HUGE)
        for seq in (2, 3):
            engine.publish(b"batch %d" % seq, send=False)
        items += poll_until(subscriber, lambda: subscriber.last_seq(source) == 3)
        engine.publish(b"batch 4")
        items += receive(subscriber, 1)
        stats = deepcopy(subscriber.stats)

    assert shape(items) == [(0, False), ("lost", 1), (2, True), (3, True), (4, False)]
    assert [item.payload for item in items if isinstance(item, Message)] == [
        b"batch 0",
        b"batch 2",
        b"batch 3",
        b"batch 4",
    ]
    assert stats == SubscriberStats(
        messages=2,
        gaps=1,
        disconnects=1,
        reconnect_checks=1,
        replays=2,
        replayed=2,
        lost=1,
        bad_frames=Counter({BadFrame.REFUSED: 1}),
    )


def test_refused_batches_in_a_gaps_answer_are_losses_at_their_place(
    ctx: zmq.Context[zmq.Socket[bytes]], base: int, replay: ScriptedReplay
) -> None:
    """A gap of 1..4 whose answer holds two batches past ``MAXMSGSIZE``, 2 and 4 (the last
    before the live batch that showed the gap). Each refusal drops the DEALER's connection,
    and the replay is asked again from the batch after it, on a new connection: 1 and 3 are
    delivered, with a ``"lost"`` reset at the place of each refused batch."""
    with gap_of(ctx, base, max_frame_bytes=1024) as (engine, subscriber, source, items):
        engine.publish(b"batch 5", seq=5)
        items += subscriber.poll(int(TIMEOUT * 1000))  # the gap's request goes out
        asked = []
        for answer in ([(1, b"batch 1"), (2, HUGE), (3, b"batch 3")], [(3, b"batch 3"), (4, HUGE)]):
            identity, start = replay.request()
            asked.append(start)
            replay.answer(identity, answer)
            items += poll_until(subscriber, lambda: replay.socket.poll(0))  # asked again
        identity, start = replay.request()
        asked.append(start)
        replay.answer(identity, [(5, b"batch 5")])
        items += poll_until(subscriber, lambda: subscriber.last_seq(source) == 5)
        stats = deepcopy(subscriber.stats)

    assert asked == [1, 3, 5]
    assert shape(items) == [(0, False), (1, True), ("lost", 1), (3, True), ("lost", 1), (5, True)]
    assert stats == SubscriberStats(
        messages=2,
        gaps=1,
        replays=3,
        replayed=3,
        duplicates=1,
        lost=2,
        bad_frames=Counter({BadFrame.REFUSED: 2}),
    )


def test_a_replay_endpoint_gone_mid_answer_is_no_refusal(
    ctx: zmq.Context[zmq.Socket[bytes]], base: int, replay: ScriptedReplay
) -> None:
    """The replay endpoint closes after the first batch of its answer. ZMQ drops the DEALER's
    connection as it does for a refused batch, but then tries to connect again: the answer
    times out as any unanswered one, and no batch is taken for refused."""
    with gap_of(ctx, base, max_frame_bytes=1024, replay_timeout=1.0) as (
        engine,
        subscriber,
        source,
        items,
    ):
        engine.publish(b"batch 5", seq=5)
        items += subscriber.poll(int(TIMEOUT * 1000))  # the gap's request goes out
        identity, start = replay.request()
        assert start == 1
        replay.socket.send_multipart(answer_frames(identity, b"", 1, b"batch 1", topic_frame=True))
        time.sleep(0.2)
        replay.close()
        items += poll_until(subscriber, lambda: subscriber.last_seq(source) == 5)
        stats = deepcopy(subscriber.stats)

    assert shape(items) == [(0, False), (1, True), ("lost", 3), (5, False)]
    assert stats == SubscriberStats(
        messages=2, gaps=1, replays=1, replayed=1, replay_timeouts=1, lost=3
    )


def test_a_refusal_after_the_replay_endpoint_came_up_late_is_asked_past(
    ctx: zmq.Context[zmq.Socket[bytes]], base: int
) -> None:
    """The replay endpoint binds 300 ms after the gap's request: ZMQ's first attempts to
    connect fail (reconnect attempts, as for an engine gone), then the handshake completes and
    the answer holds a refused batch, 2. The handshake starts the watch afresh: the refusal is
    seen, and 3..5 are asked for again."""
    with gap_of(ctx, base, max_frame_bytes=1024) as (engine, subscriber, source, items):
        engine.publish(b"batch 5", seq=5)
        items += subscriber.poll(100)  # the gap's request goes out, to no one yet
        time.sleep(0.3)
        replay = ScriptedReplay(ctx, base + 1)
        try:
            asked = []
            for answer in ([1, 2, 3], [3, 4, 5]):
                items += poll_until(subscriber, lambda: replay.socket.poll(0))
                identity, start = replay.request()
                asked.append(start)
                replay.answer(identity, [(n, HUGE if n == 2 else b"batch %d" % n) for n in answer])
            items += poll_until(subscriber, lambda: subscriber.last_seq(source) == 5)
            stats = deepcopy(subscriber.stats)
        finally:
            replay.close()

    assert asked == [1, 3]
    assert shape(items) == [(0, False), (1, True), ("lost", 1), (3, True), (4, True), (5, True)]
    assert stats == SubscriberStats(
        messages=2,
        gaps=1,
        replays=2,
        replayed=4,
        duplicates=1,
        lost=1,
        bad_frames=Counter({BadFrame.REFUSED: 1}),
    )


def test_a_replay_endpoint_of_another_socket_type_is_no_refusal(
    ctx: zmq.Context[zmq.Socket[bytes]], base: int
) -> None:
    """The replay endpoint given is a PUB: it fails the DEALER's handshake and drops the
    connection, without the reconnect attempt that shows an engine gone. With no handshake
    before it, the drop is no refusal: the answer times out, and no batch is counted."""
    source = Source(f"tcp://*:{base}", f"tcp://*:{base + 1}", 1)
    wrong = ctx.socket(zmq.PUB)
    wrong.setsockopt(zmq.LINGER, 0)
    wrong.bind(f"tcp://127.0.0.1:{base + 1}")
    with (
        engine_without_replay(ctx, base) as engine,
        Subscriber([source], context=ctx, max_frame_bytes=1024, replay_timeout=1.0) as subscriber,
    ):
        assert engine.wait_for_subscribers(timeout=TIMEOUT)
        engine.publish(b"batch 0")
        items = receive(subscriber, 1)
        engine.publish(b"batch 5", seq=5)
        items += poll_until(subscriber, lambda: subscriber.last_seq(source) == 5)
        stats = deepcopy(subscriber.stats)
    wrong.close(0)

    assert shape(items) == [(0, False), ("lost", 4), (5, False)]
    assert stats == SubscriberStats(messages=2, gaps=1, replays=1, replay_timeouts=1, lost=4)


def test_two_refusals_before_any_frame_cut_the_answer(
    ctx: zmq.Context[zmq.Socket[bytes]], base: int, replay: ScriptedReplay
) -> None:
    """The engine no longer holds the gap's start, 1: the first batch it holds, 100, is
    refused before any frame. That refusal is taken to be of 1, and 2 on is asked for; the
    engine answers with 100 again, refused again before any frame: the answer is cut there
    (asking on would cost a request per batch the engine no longer holds). 1..101 are lost."""
    with gap_of(ctx, base, max_frame_bytes=1024) as (engine, subscriber, source, items):
        engine.publish(b"batch 102", seq=102)
        asked = []
        for _ in range(2):
            items += poll_until(subscriber, lambda: replay.socket.poll(0))
            identity, start = replay.request()
            asked.append(start)
            replay.answer(identity, [(100, HUGE), (101, b"batch 101")])
        items += poll_until(subscriber, lambda: subscriber.last_seq(source) == 102)
        stats = deepcopy(subscriber.stats)

    assert asked == [1, 2]
    assert shape(items) == [(0, False), ("lost", 101), (102, False)]
    assert stats == SubscriberStats(
        messages=2, gaps=1, replays=2, lost=101, bad_frames=Counter({BadFrame.REFUSED: 2})
    )


def test_a_refusal_past_the_last_seq_there_is_cuts_the_answer(
    ctx: zmq.Context[zmq.Socket[bytes]], base: int, replay: ScriptedReplay
) -> None:
    """A replay answers the last seq there is (2**64 - 2), then a batch ZMQ refuses: there is
    no batch after it to ask for. The answer is cut there, and every poll goes on without an
    error (the refused DEALER is no longer polled)."""
    with gap_of(ctx, base, max_frame_bytes=1024) as (engine, subscriber, _, items):
        engine.publish(b"batch 3", seq=3)
        items += subscriber.poll(int(TIMEOUT * 1000))  # the gap's request goes out
        identity, start = replay.request()
        assert start == 1
        replay.answer(identity, [(2**64 - 2, b"last"), (2, HUGE)])
        items += poll_until(subscriber, lambda: subscriber.stats.bad_frames[BadFrame.REFUSED])
        for _ in range(3):
            items += subscriber.poll(50)
        stats = deepcopy(subscriber.stats)

    # The answer's batch far past the gap is a resync there (see the subscriber's "limits");
    # the live batch 3 after it is then a late copy.
    assert shape(items) == [(0, False), ("restart", 0), (2**64 - 2, True)]
    assert stats == SubscriberStats(
        messages=2,
        gaps=1,
        replays=1,
        replayed=1,
        duplicates=1,
        resyncs=1,
        bad_frames=Counter({BadFrame.REFUSED: 1}),
    )


def test_a_replay_endpoint_gone_for_good_does_not_stall_the_subscriber(
    base: int,
) -> None:
    """After a replay answered, its endpoint goes away for good. ZMQ reports a reconnect
    attempt for a DEALER that is still open at every try (here every millisecond), and its
    I/O thread stops every socket of the context once a monitor's queue is full. The DEALER
    was closed with its answer: 3 s later a live batch still comes through."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    context.setsockopt(zmq.RECONNECT_IVL, 1)
    source = Source(f"tcp://*:{base}", f"tcp://*:{base + 1}", 1)
    replay = ScriptedReplay(context, base + 1)
    try:
        with (
            engine_without_replay(context, base) as engine,
            Subscriber([source], context=context) as subscriber,
        ):
            assert engine.wait_for_subscribers(timeout=TIMEOUT)
            engine.publish(b"batch 0")
            items = receive(subscriber, 1)
            engine.publish(b"batch 2", seq=2)
            items += subscriber.poll(int(TIMEOUT * 1000))  # the gap's request goes out
            identity, _ = replay.request()
            replay.answer(identity, [(1, b"batch 1"), (2, b"batch 2")])
            items += poll_until(subscriber, lambda: subscriber.last_seq(source) == 2)
            replay.close()
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline:
                items += subscriber.poll(100)
            engine.publish(b"batch 3")
            items += receive(subscriber, 1)
    finally:
        replay.close()
        context.destroy(linger=0)

    assert shape(items) == [(0, False), (1, True), (2, True), (3, False)]
