"""The subscriber over real sockets on 127.0.0.1: gap replay, losses, restarts, bad frames,
bind/connect (acceptance 2, 3, 6 and the vLLM bind rule).

A :class:`Publisher` stands in for a vLLM engine; :class:`Relay` with an in-process
``TieredIndex`` consumes it, and the result is compared with the lossless index built from the
same payloads without any socket (``tests/support/reference.py``).

Exact counters need a deterministic interleaving, so most tests publish in lock step: after each
*delivered* batch they step the relay until it has seen that seq. A replay therefore happens
while the publisher's ring buffer ends at the live batch that revealed the gap, and vLLM's replay
protocol (every buffered batch from the requested seq on) returns that live batch too: each gap
costs one replay that delivers the dropped run *plus* the live batch, whose live copy is then a
duplicate.

The wire format and replay protocol: README.md, "The relay in front of Dynamo".
"""

from __future__ import annotations

import contextlib
import math
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from copy import deepcopy
from typing import Any

import pytest
import structlog
import zmq
from support.log_fields import log_fields
from support.polling import (
    TIMEOUT,
    poll_for,
    poll_until,
    receive,
    shape,
    wait_until,
)
from support.rebind import bound_again, engine_on, listener_gone
from support.reference import dump_rows, index_of, overlaps
from support.relay_faults import fault
from support.relayed import (
    BS,
    LOCAL,
    deliver,
    engine_publisher,
    port_of,
    relayed,
    restarted_in_place,
    six_prompts,
    spy,
    suspend_after_two_losses,
)
from support.scripted_replays import ScriptedReplays

from kvbridge import TieredIndex
from kvbridge.adapters.pipeline import IndexSink, StreamPipeline
from kvbridge.adapters.ports import free_port_range
from kvbridge.adapters.publisher import Publisher
from kvbridge.adapters.relay import Relay
from kvbridge.adapters.replay_protocol import answer_frames, parse_request
from kvbridge.adapters.source import Message, Source, StreamReset
from kvbridge.adapters.stream_state import StreamState
from kvbridge.adapters.stream_stats import BadFrame, PipelineStats, SubscriberStats
from kvbridge.adapters.subscriber import (
    DEFAULT_MAX_GAP,
    MAX_FRAME_BYTES,
    Subscriber,
)
from kvbridge.cli.watch_view import COLUMNS, WatchView
from kvbridge.schemas.vllm import Event
from kvbridge.testing.events import TS0, encoded, removed, stored
from kvbridge.testing.vllm_hashes import block_hashes
from kvbridge.testing.workload import seeded_stream

# --------------------------------------------------------------------------- helpers


def runs_of(drops: set[int]) -> int:
    """Runs of consecutive dropped seqs."""
    return sum(1 for seq in drops if seq - 1 not in drops)


def assert_same_index(index: TieredIndex, reference: TieredIndex, prompts: list[list[int]]) -> None:
    assert dump_rows(index) == dump_rows(reference)
    assert overlaps(index, prompts) == overlaps(reference, prompts)


# --------------------------------------------------------------------------- 1. recovery

N = 300


@pytest.mark.parametrize("replay_topic_frame", [True, False], ids=["0.26+", "legacy"])
def test_dropped_batches_are_replayed_and_the_index_is_lossless(
    ctx: zmq.Context[zmq.Socket[bytes]], replay_topic_frame: bool
) -> None:
    stream = seeded_stream(7, N, block_size=BS, clear_at=150)
    payloads = stream.payloads
    # 10% dropped, seeded; seq 0 and the last one delivered (a drop at the very end would never
    # be noticed, and a first message past 0 is tested on its own).
    drops = set(random.Random(2024).sample(range(1, N - 1), N // 10))
    runs = runs_of(drops)
    assert (len(drops), runs) == (30, 26)  # the pattern has runs longer than one

    with relayed(ctx, replay_topic_frame=replay_topic_frame) as (
        publisher,
        source,
        relay,
        index,
        _,
    ):
        for seq, payload in enumerate(payloads):
            assert publisher.publish(payload, send=seq not in drops) == seq
            if seq not in drops:
                deliver(relay, source, seq)
        stats = deepcopy(relay.subscriber.stats)
        relay_stats = deepcopy(relay.stats)

    assert stats == SubscriberStats(
        messages=N - len(drops),
        gaps=runs,
        replays=runs,
        replayed=len(drops) + runs,  # each replay also returns the live batch ...
        duplicates=runs,  # ... whose live copy is then skipped
    )
    assert relay.subscriber.stats.lost == 0
    assert relay_stats == PipelineStats(batches_in=N)

    reference = index_of(payloads, worker_id=1, block_size=BS)
    assert_same_index(index, reference, stream.prompts)
    # The comparison is not vacuous: many prompts are cached, on both tiers.
    found = overlaps(index, stream.prompts)
    assert sum(1 for o in found if o) > 50
    assert any(o and o[1, 0][1] > o[1, 0][0] for o in found)


def test_gap_longer_than_the_replay_buffer_clears_the_worker(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    a, b, c = list(range(1, 17)), list(range(100, 112)), list(range(200, 208))
    d, e, f = list(range(300, 308)), list(range(400, 404)), list(range(500, 508))
    g, h = list(range(600, 612)), list(range(700, 704))
    c_child = [*c, 220, 221, 222, 223]
    ha, hb, hc, hf, hcc = (block_hashes(p, BS) for p in (a, b, c, f, c_child))
    batches: list[list[Event]] = [
        [stored(ha, a), stored(hb, b)],  # 0
        [stored(hc, c), stored(ha, a, medium="CPU")],  # 1
        [removed([x]) for x in reversed(ha)],  # 2 lost: A leaves the GPU
        [stored(block_hashes(d, BS), d)],  # 3 lost
        [removed([hb[-1]]), removed(ha, medium="CPU")],  # 4 lost: A leaves the CPU
        [stored(block_hashes(e, BS), e)],  # 5 lost
        [stored(hf, f)],  # 6 dropped, still in the buffer
        [stored(block_hashes(g, BS), g), stored(hcc[-1:], c_child[-4:], parent=hc[-1])],  # 7
        [removed([hf[-1]]), stored(block_hashes(h, BS), h)],  # 8
    ]
    payloads = [encoded(events, ts=TS0 + step) for step, events in enumerate(batches)]
    prompts = [a, b, c, d, e, f, g, h, c_child]

    with relayed(ctx, buffer_steps=2) as (publisher, source, relay, index, seen):
        for seq in (0, 1):
            publisher.publish(payloads[seq])
            deliver(relay, source, seq)
        assert overlaps(index, [a, b, c]) == [
            {(1, 0): (4, 4, 4)},
            {(1, 0): (3, 3, 3)},
            {(1, 0): (2, 2, 2)},
        ]
        for seq in range(2, 7):
            publisher.publish(payloads[seq], send=False)
        for seq in (7, 8):
            publisher.publish(payloads[seq])
            deliver(relay, source, seq)
        stats = deepcopy(relay.subscriber.stats)

    # Batches 2-5 aged out of the two-batch buffer; 6 and 7 came back through the replay.
    assert shape(seen) == [
        (0, False),
        (1, False),
        ("lost", 4),
        (6, True),
        (7, True),
        (8, False),
    ]
    assert stats == SubscriberStats(messages=4, gaps=1, replays=1, replayed=2, duplicates=1, lost=4)
    # Nothing stale: A, removed in lost batches, is gone, and so is everything else stored
    # before the loss, except what the engine showed it still holds: batch 7 stores C's child
    # under C's last block, so C is announced again with it. The index is the one the batches
    # after the loss point build, with C's chain stored together with its child.
    c_again = [stored(block_hashes(g, BS), g), stored([*hc, *hcc[-1:]], c_child)]
    after_loss = index_of(
        [payloads[6], encoded(c_again, ts=TS0 + 7), payloads[8]], worker_id=1, block_size=BS
    )
    assert_same_index(index, after_loss, prompts)
    assert overlaps(index, prompts) == [
        {},
        {},
        {(1, 0): (2, 2, 2)},  # C, re-learned from its child
        {},
        {},
        {(1, 0): (1, 1, 1)},  # F: its last block was removed in batch 8
        {(1, 0): (3, 3, 3)},
        {(1, 0): (1, 1, 1)},
        {(1, 0): (3, 3, 3)},  # C's child, with C re-learned from it
    ]


def relay_after_unsent(
    ctx: zmq.Context[zmq.Socket[bytes]], payloads: list[bytes], unsent: int, *, replay: bool
) -> tuple[Source, list[Message | StreamReset], SubscriberStats, TieredIndex]:
    """Publish the first ``unsent`` payloads without sending them (the subscriber's first
    message is past 0), then the rest in lock step, into a relay with an index: the source,
    what the relay's subscriber handed out, its stats and the index."""
    with relayed(ctx, replay=replay) as (publisher, source, relay, index, seen):
        for seq in range(unsent):
            publisher.publish(payloads[seq], send=False)
        for seq in range(unsent, len(payloads)):
            publisher.publish(payloads[seq])
            deliver(relay, source, seq)
        return source, seen, deepcopy(relay.subscriber.stats), index


def test_first_message_past_zero_replays_from_zero(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    stream = seeded_stream(11, 7, block_size=BS)
    payloads = stream.payloads
    _, seen, stats, index = relay_after_unsent(ctx, payloads, 5, replay=True)

    assert shape(seen) == [*((seq, True) for seq in range(6)), (6, False)]
    assert stats == SubscriberStats(messages=2, replays=1, replayed=6, duplicates=1)
    assert_same_index(index, index_of(payloads, worker_id=1, block_size=BS), stream.prompts)
    assert any(overlaps(index, stream.prompts))


def test_first_message_past_zero_without_replay_is_a_loss(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    stream = seeded_stream(12, 5, block_size=BS)
    payloads = stream.payloads
    source, seen, stats, index = relay_after_unsent(ctx, payloads, 3, replay=False)
    assert source.replay_endpoint is None

    assert shape(seen) == [("lost", 3), (3, False), (4, False)]
    assert stats == SubscriberStats(messages=2, lost=3)
    after_loss = index_of(payloads[3:], worker_id=1, block_size=BS)
    assert_same_index(index, after_loss, stream.prompts)


def test_replay_socket_that_never_answers_times_out_into_a_loss(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    payloads = [encoded([stored(block_hashes([i] * 4, BS), [i] * 4)], ts=TS0 + i) for i in range(4)]
    publisher, served = engine_publisher(ctx, replay=False)
    source = Source(served.endpoint, f"tcp://127.0.0.1:{free_port_range(1)}", 1)  # nobody serves it
    with publisher, Subscriber([source], context=ctx, replay_timeout=0.3) as subscriber:
        assert publisher.wait_for_subscribers(timeout=TIMEOUT)
        publisher.publish(payloads[0])
        assert shape(receive(subscriber, 1)) == [(0, False)]
        publisher.publish(payloads[1], send=False)
        publisher.publish(payloads[2])
        started = time.monotonic()
        items = receive(subscriber, 1)
        waited = time.monotonic() - started
        publisher.publish(payloads[3])
        items += receive(subscriber, 1)
        stats = deepcopy(subscriber.stats)

    assert shape(items) == [("lost", 1), (2, False), (3, False)]
    assert items[0] == StreamReset(source, "lost", 1)
    assert [item.payload for item in items[1:] if isinstance(item, Message)] == payloads[2:]
    assert stats == SubscriberStats(messages=3, gaps=1, replays=1, replay_timeouts=1, lost=1)
    assert waited >= 0.3


def test_a_replay_that_goes_unanswered_holds_up_its_own_source_only(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """While one source waits for a replay that no one answers, the others are read as usual;
    the waiting source's own messages come after the timeout, in their order."""
    payloads = [encoded([stored(block_hashes([i] * 4, BS), [i] * 4)], ts=TS0 + i) for i in range(6)]
    quiet, served = engine_publisher(ctx, replay=False)
    waiting = Source(served.endpoint, f"tcp://127.0.0.1:{free_port_range(1)}", 1)  # no one serves
    other, other_source = engine_publisher(ctx)
    arrived: dict[tuple[bool, int], float] = {}
    """When each batch came out, by (from the waiting source, seq)."""
    with (
        quiet,
        other,
        Subscriber([waiting, other_source], context=ctx, replay_timeout=1.5) as subscriber,
    ):
        assert quiet.wait_for_subscribers(timeout=TIMEOUT)
        assert other.wait_for_subscribers(timeout=TIMEOUT)
        quiet.publish(payloads[0])
        other.publish(payloads[0])
        items = receive(subscriber, 2)
        quiet.publish(payloads[1], send=False)
        quiet.publish(payloads[2])  # a gap: its replay is never answered
        quiet.publish(payloads[3])
        began = time.monotonic()
        for seq in (1, 2, 3):
            other.publish(payloads[seq])
        deadline = began + TIMEOUT
        while len(arrived) < 5:
            assert time.monotonic() < deadline, (arrived, subscriber.stats)
            for item in subscriber.poll(20):
                items.append(item)
                if isinstance(item, Message):
                    arrived[item.source == waiting, item.seq] = time.monotonic() - began
        stats = deepcopy(subscriber.stats)

    assert [seq for from_waiting, seq in arrived if from_waiting] == [2, 3]
    assert max(arrived[False, seq] for seq in (1, 2, 3)) < 1.0
    assert arrived[True, 2] >= 1.5
    assert [shape([item]) for item in items if not isinstance(item, Message)] == [[("lost", 1)]]
    assert stats == SubscriberStats(messages=7, gaps=1, replays=1, replay_timeouts=1, lost=1)


def test_sources_whose_replays_time_out_cannot_take_every_slot(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """Two slots (``max_replays=2``), two sources whose replay endpoints time out (shown once,
    at start-up) and a healthy one: when all three meet a gap at once, the failing sources
    share one slot, and the healthy one's replay is answered without waiting for theirs."""
    payloads = [encoded([stored(block_hashes([i] * 4, BS), [i] * 4)], ts=TS0 + i) for i in range(3)]
    dead = [engine_publisher(ctx, replay=False) for _ in range(2)]
    healthy, healthy_source = engine_publisher(ctx)
    ports = free_port_range(2)  # replay endpoints no one serves
    sources = [
        Source(served.endpoint, f"tcp://127.0.0.1:{ports + i}", i + 1)
        for i, (_, served) in enumerate(dead)
    ] + [Source(healthy_source.endpoint, healthy_source.replay_endpoint, 3)]
    publishers = [publisher for publisher, _ in dead] + [healthy]
    arrived: dict[int, float] = {}
    with contextlib.ExitStack() as stack:
        for publisher in publishers:
            stack.enter_context(publisher)
        subscriber = stack.enter_context(
            Subscriber(
                sources, context=ctx, replay_timeout=0.3, replay_on_start=True, max_replays=2
            )
        )
        stats = subscriber.stats
        deadline = time.monotonic() + TIMEOUT
        while stats.replay_timeouts < 2 or stats.replays < 3:  # start-up: two time out
            assert time.monotonic() < deadline, stats
            subscriber.poll(20)
        time.sleep(0.3)  # their back-offs pass
        for publisher in publishers:
            assert publisher.wait_for_subscribers(timeout=TIMEOUT)
            publisher.publish(payloads[0], seq=0)
            publisher.publish(payloads[1], seq=1, send=False)
            publisher.publish(payloads[2], seq=2)  # a gap on every source
        time.sleep(0.1)  # all in ZMQ's queues, for one poll
        began = time.monotonic()
        while len(arrived) < 3:
            assert time.monotonic() < deadline, (arrived, stats)
            for item in subscriber.poll(20):
                if isinstance(item, Message) and item.seq == 2:
                    arrived[item.source.worker_id] = time.monotonic() - began
        final = deepcopy(stats)

    assert arrived[3] < 0.3 <= min(arrived[1], arrived[2])
    assert max(arrived[1], arrived[2]) >= 0.6  # one after the other, in one slot
    assert (final.replays, final.replay_timeouts, final.lost) == (6, 4, 2)


def test_after_a_replay_timeout_the_source_is_not_asked_again_until_its_back_off_passes(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """A replay holds up its source until it is answered or times out. After a timeout, the
    gaps of that source within the back-off (the timeout, doubled after each further timeout
    in a row) are lost at once, without asking; after it, the endpoint is asked again: first
    for the repair of the losses (from batch 1), which times out too, so that the third gap
    falls within the next back-off."""
    payloads = [encoded([stored(block_hashes([i] * 4, BS), [i] * 4)], ts=TS0 + i) for i in range(7)]
    publisher, served = engine_publisher(ctx, replay=False)
    source = Source(served.endpoint, f"tcp://127.0.0.1:{free_port_range(1)}", 1)  # nobody serves it
    waited = []
    with (
        structlog.testing.capture_logs() as logs,
        publisher,
        Subscriber([source], context=ctx, replay_timeout=1.0) as subscriber,
    ):
        assert publisher.wait_for_subscribers(timeout=TIMEOUT)
        publisher.publish(payloads[0])
        items = receive(subscriber, 1)
        for seq in (1, 3, 5):
            if seq == 5:
                time.sleep(1.0)  # the back-off after the first timeout passes
            publisher.publish(payloads[seq], send=False)
            publisher.publish(payloads[seq + 1])
            started = time.monotonic()
            items += receive(subscriber, 1)
            waited.append(time.monotonic() - started)
        stats = deepcopy(subscriber.stats)

    gaps = [item for seq in (2, 4, 6) for item in (("lost", 1), (seq, False))]
    assert shape(items) == [(0, False), *gaps]
    assert stats == SubscriberStats(
        messages=4, gaps=3, replays=2, replays_skipped=2, replay_timeouts=2, lost=3
    )
    assert waited[0] >= 1.0 and waited[2] >= 1.0  # the second wait is the repair's
    assert waited[1] < 1.0
    backoffs = [
        (line["seconds"], line["timeouts_in_a_row"])
        for line in logs
        if line["event"] == "replays skipped after a timeout"
    ]
    assert backoffs == [(1.0, 1), (2.0, 2)]


def test_a_restart_ends_the_replay_back_off(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """The timeouts of an engine say nothing of the process that replaces it: after a restart,
    the new process's replay endpoint is asked at once, within the old one's back-off."""
    payloads = [encoded([stored(block_hashes([i] * 4, BS), [i] * 4)], ts=TS0 + i) for i in range(5)]
    publisher = Publisher(LOCAL, bind=True, replay_endpoint=LOCAL, context=ctx)  # not serving
    source = Source(f"tcp://*:{port_of(publisher.endpoint)}", publisher.replay_endpoint, 1)
    with publisher, Subscriber([source], context=ctx, replay_timeout=1.0) as subscriber:
        assert publisher.wait_for_subscribers(timeout=TIMEOUT)
        publisher.publish(payloads[0])
        items = receive(subscriber, 1)
        publisher.publish(payloads[1], send=False)
        publisher.publish(payloads[2])
        items += receive(subscriber, 1)  # its replay times out: a back-off of 1 s
        publisher.start_replay_thread()  # the new process serves its replays
        publisher.restart()
        publisher.publish(payloads[3], send=False)
        publisher.publish(payloads[4])
        items += receive(subscriber, 2)
        stats = deepcopy(subscriber.stats)

    assert shape(items) == [
        (0, False),
        ("lost", 1),
        (2, False),
        ("restart", 0),
        (0, True),
        (1, True),
    ]
    assert stats == SubscriberStats(
        messages=3,
        gaps=1,
        replays=2,
        replayed=2,
        replay_timeouts=1,
        lost=1,
        restarts=1,
        duplicates=1,  # the live copy of the new process's batch 1
    )


def test_a_restart_that_finds_no_clear_token_ends_the_replay_back_off_too(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """A restart met while the clears are spent suspends the stream; when it is released and
    starts over, the new process's replay endpoint is asked although the old one's back-off
    still runs, so what the new process sent meanwhile is replayed, not lost. A gap after that
    is replayed as usual."""
    payloads = [encoded([stored(block_hashes([i] * 4, BS), [i] * 4)], ts=TS0 + i) for i in range(4)]
    publisher = Publisher(LOCAL, bind=True, replay_endpoint=LOCAL, context=ctx)  # not serving
    source = Source(f"tcp://*:{port_of(publisher.endpoint)}", publisher.replay_endpoint, 1)
    with (
        publisher,
        Subscriber(
            [source], context=ctx, replay_timeout=1.0, clear_burst=1, clear_interval=0.5
        ) as subscriber,
    ):
        stats = subscriber.stats
        assert publisher.wait_for_subscribers(timeout=TIMEOUT)
        publisher.publish(payloads[0])
        items = receive(subscriber, 1)
        publisher.publish(payloads[1], send=False)
        publisher.publish(payloads[2])
        items += receive(subscriber, 1)  # a timeout, a back-off of 1 s, the one clear spent
        publisher.start_replay_thread()  # the new process serves its replays
        publisher.restart()
        publisher.publish(payloads[3])  # its batch 0: a restart, and no token for its clear
        items += poll_until(
            subscriber,
            lambda: stats.bad_frames[BadFrame.THROTTLED] and stats.replayed == 1,
        )  # until the token is back (0.5 s), it is cleared and its batch 0 replayed
        for payload in payloads[:3]:  # batches 1-3, which the subscriber misses
            publisher.publish(payload, send=False)
        publisher.publish(payloads[3])  # batch 4: past the old process's last, replayed
        items += receive(subscriber, 4)
        final = deepcopy(stats)

    assert shape(items) == [
        (0, False), ("lost", 1), (2, False), ("restart", 0), *((seq, True) for seq in range(5)),
    ]  # fmt: skip
    assert [item.payload for item in items[-5:] if isinstance(item, Message)] == [
        payloads[3],
        *payloads,
    ]
    assert final == SubscriberStats(
        messages=4,
        gaps=2,
        replays=3,
        replayed=5,
        duplicates=1,
        replay_timeouts=1,
        lost=1,
        restarts=1,
        bad_frames=Counter({BadFrame.THROTTLED: 1}),
    )


def test_an_engine_replaced_while_its_stream_is_suspended_is_replayed_from_0(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """A stream suspended by a loss whose connection drops meanwhile may come back from a new
    process, whose sequence is already past the old one's: its start-over, on release, checks
    the publisher first, and a new process's batches are replayed from 0, not from the old
    loss (a buffer of two batches: what it no longer holds counts as lost)."""
    base = free_port_range(2)
    source = Source(f"tcp://*:{base}", f"tcp://*:{base + 1}", 1)

    engine = engine_on(ctx, base, buffer_steps=2)
    first = engine()
    with Subscriber([source], context=ctx, clear_burst=1, clear_interval=2.0) as subscriber:
        stats = subscriber.stats
        assert first.wait_for_subscribers(timeout=TIMEOUT)
        items = suspend_after_two_losses(subscriber, first, source, 3)  # batches 1-3 and 5-7
        first.close()
        listener_gone(base)
        items += poll_until(subscriber, lambda: stats.disconnects)
        second = bound_again(engine)
        with second:
            for seq in range(10):
                second.publish(b"new %d" % seq, send=False)
            assert second.wait_for_subscribers(timeout=TIMEOUT)
            items += poll_until(subscriber, lambda: subscriber.last_seq(source) == 9)
            second.publish(b"new 10")
            items += poll_until(subscriber, lambda: subscriber.last_seq(source) == 10)
        final = deepcopy(stats)

    assert shape(items) == [
        (0, False),
        ("lost", 2),
        (3, True),
        (4, True),
        ("lost", 0),
        (8, True),
        (9, True),
        (10, False),
    ]
    assert [item.payload for item in items[-2:] if isinstance(item, Message)] == [
        b"new 9",
        b"new 10",
    ]
    assert final == SubscriberStats(
        messages=4,
        gaps=2,
        replays=4,
        replayed=4,
        duplicates=1,
        lost=10,
        resyncs=1,
        disconnects=1,
        reconnect_checks=1,
        bad_frames=Counter({BadFrame.THROTTLED: 1}),
    )


def test_the_watch_counts_per_worker_what_a_start_over_lost(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """A loss that finds no clear token suspends the stream, and its release clears the worker
    with a ``"lost"`` reset of 0 batches: how many are lost is known only when the stream
    starts over, from the replay the release asks for. The watch's lost cell for the worker
    says what the subscriber's total says, the start-over's loss included (a buffer of two
    batches), not only the resets' 2."""
    publisher, source = engine_publisher(ctx, buffer_steps=2)
    payloads = [encoded([], ts=TS0 + seq) for seq in range(10)]
    with (
        publisher,
        Relay([source], block_size=BS, context=ctx, clear_burst=1, clear_interval=2.0) as relay,
    ):
        view = WatchView(relay)
        subscriber = relay.subscriber
        items = spy(subscriber)
        assert publisher.wait_for_subscribers(timeout=TIMEOUT)

        def published(seqs: range, live: int, done: Callable[[], bool]) -> None:
            for seq in seqs:
                publisher.publish(payloads[seq], send=False)
            publisher.publish(payloads[live])
            wait_until(done, lambda: view.poll(20), lambda: (shape(items), subscriber.stats))

        published(range(0), 0, lambda: subscriber.last_seq(source) == 0)
        # 1..3 lost on the way; the replay still holds 3 and 4: 1 and 2 lost, the token spent
        published(range(1, 4), 4, lambda: subscriber.last_seq(source) == 4)
        # 5..7 lost, and no token is left: suspended, then released; the start-over replays 7
        # and 8 (the buffer holds them): 5 and 6 lost
        published(range(5, 8), 8, lambda: subscriber.last_seq(source) == 8)
        published(range(0), 9, lambda: subscriber.last_seq(source) == 9)
        rows, footer = view.rows(), view.footer()
        lost = subscriber.lost_batches(source)

    assert shape(items) == [
        (0, False),
        ("lost", 2),
        (3, True),
        (4, True),
        ("lost", 0),
        (7, True),
        (8, True),
        (9, False),
    ]
    assert lost == subscriber.stats.lost == 4
    assert rows[0][COLUMNS.index("lost")] == "4"
    assert " | lost 4 | " in footer[0]


@contextmanager
def _replaced_and_released(
    subscriber: Subscriber,
    source: Source,
    first: Publisher,
    engine: Callable[[], Publisher],
    items: list[Message | StreamReset],
) -> Iterator[tuple[Publisher, SubscriberStats]]:
    """Close ``first`` and bind its successor from ``engine``: the subscriber's catch-up finds
    no clear token and suspends the stream, then releases it when the token is back. Yields
    the successor (open until the block ends) and the counts while suspended; what the
    subscriber delivered meanwhile goes onto ``items``."""
    stats = subscriber.stats
    first.close()
    listener_gone(int(source.endpoint.rsplit(":", 1)[1]))
    items += poll_until(subscriber, lambda: stats.disconnects)
    with bound_again(engine) as second:
        assert second.wait_for_subscribers(timeout=TIMEOUT)
        items += poll_until(subscriber, lambda: subscriber.suspended(source))
        suspended = deepcopy(stats)
        items += poll_until(subscriber, lambda: not subscriber.suspended(source))
        yield second, suspended


@pytest.mark.parametrize(
    ("serve", "unsent", "expected", "checked", "counts", "released"),
    [
        (
            True,
            5,  # seq 5: the buffer keeps 4 and 5, 0..3 lost
            [("lost", 4), (4, True), (5, True), ("restart", 0)],
            [True, True],
            {"duplicates": 1, "replays": 2, "replayed": 2, "lost": 4},
            {"replays": 1},  # the release's replay from 0: the new process holds nothing yet
        ),
        (
            False,
            1,  # seq 1: 0 is asked for, unanswered, lost
            [("lost", 1), (1, False), ("restart", 0)],
            [True, False],
            {"replays": 2, "replay_timeouts": 2, "lost": 1},
            {"replays": 1, "replay_timeouts": 1},  # the release's replay from 0, unanswered
        ),
    ],
    ids=["new process", "unanswered"],
)
def test_a_restart_found_by_the_catch_up_waits_for_a_clear_token(
    ctx: zmq.Context[zmq.Socket[bytes]],
    serve: bool,
    unsent: int,
    expected: list[tuple[object, ...]],
    checked: list[bool],
    counts: dict[str, int],
    released: dict[str, int],
) -> None:
    """With one clear allowed every 3 s and that one spent on a loss at the stream's start,
    the catch-up after a drop finds a new, idle process (its replay of the old last is empty),
    or gets no answer: the stream is suspended, not cleared at once, and its clear goes out
    when the token is back, although nothing more is published (the restart is counted then,
    with the clear). The clear is the restart the check found: unchecked if it went
    unanswered, as the immediate one would have been. The release then asks for the new
    process's batches from 0: none yet, or no answer."""
    base = free_port_range(2)
    source = Source(f"tcp://*:{base}", f"tcp://*:{base + 1}", 1)

    engine = engine_on(ctx, base, serve=serve, buffer_steps=2)
    first = engine()
    with Subscriber(
        [source], context=ctx, replay_timeout=0.3, clear_burst=1, clear_interval=3.0
    ) as subscriber:
        stats = subscriber.stats
        for _ in range(unsent):
            first.publish(VALID, send=False)
        assert first.wait_for_subscribers(timeout=TIMEOUT)
        first.publish(VALID)  # the loss at the start spends the token
        items = receive(subscriber, sum(isinstance(item[0], int) for item in expected))
        with _replaced_and_released(subscriber, source, first, engine, items) as (_, suspended):
            stream = subscriber._by_source[source]
            items += poll_until(subscriber, lambda: not subscriber._replays.waiting(stream))
        final = deepcopy(stats)

    assert shape(items) == expected
    assert [item.checked for item in items if isinstance(item, StreamReset)] == checked
    counts |= {"messages": 1, "disconnects": 1, "reconnect_checks": 1}
    assert suspended == SubscriberStats(**counts)
    after = {key: counts.get(key, 0) + released.get(key, 0) for key in counts | released}
    assert final == SubscriberStats(**after, restarts=1)


@pytest.mark.parametrize("max_gap", [DEFAULT_MAX_GAP, 2], ids=["default max_gap", "max_gap 2"])
def test_a_released_unanswered_check_counts_only_the_batches_after_the_last(
    ctx: zmq.Context[zmq.Socket[bytes]], max_gap: int
) -> None:
    """An unanswered check that found no clear token suspends the stream; the clear goes out
    when the token is back. When the same process then goes on at 4, two batches after the
    last delivered (1), only 2 and 3 count as lost: the replay from 0 that the release asks
    for finds nothing (unanswered), and the start-over's is skipped in the back-off that
    began, but 0 and 1 were delivered before the clear if the process is the same. The loss
    is within ``max_gap`` by what counts (2), not by what the replay was asked for (4)."""
    base = free_port_range(2)
    source = Source(f"tcp://*:{base}", f"tcp://*:{base + 1}", 1)
    engine = engine_on(ctx, base, serve=False)
    first = engine()
    with (
        Subscriber(
            [source],
            context=ctx,
            replay_timeout=0.3,
            clear_burst=1,
            clear_interval=3.0,
            max_gap=max_gap,
        ) as subscriber,
        structlog.testing.capture_logs() as logs,
    ):
        stats = subscriber.stats
        first.publish(VALID, send=False)
        assert first.wait_for_subscribers(timeout=TIMEOUT)
        first.publish(VALID)  # 1: the loss of 0 at the start spends the token
        items = receive(subscriber, 1)
        with _replaced_and_released(subscriber, source, first, engine, items) as (second, _):
            for _ in range(4):
                second.publish(b"", send=False)
            second.publish(VALID)  # 4
            items += receive(subscriber, 1)
        final, lost_here = deepcopy(stats), subscriber.lost_batches(source)

    assert shape(items) == [("lost", 1), (1, False), ("restart", 0), (4, False)]
    assert [item.checked for item in items if isinstance(item, StreamReset)] == [True, False]
    losses = [
        {key: line[key] for key in ("first", "count", "at_most") if key in line}
        for line in logs
        if line["event"] == "batches lost"
    ]
    assert losses == [{"first": 0, "count": 1}, {"first": 2, "count": 2, "at_most": 4}]
    assert lost_here == 3
    assert final == SubscriberStats(
        messages=2,
        disconnects=1,
        reconnect_checks=1,
        replays=3,
        replay_timeouts=3,
        replays_skipped=1,
        restarts=1,
        lost=3,
    )


UNANSWERED_AT_3 = {
    "messages": 4,
    "disconnects": 1,
    "reconnect_checks": 1,
    "replays": 1,
    "replay_timeouts": 1,
    "replays_skipped": 2,
    "restarts": 1,
}
"""The counts of a stream that delivered batches 0-2, dropped, and went on at 3 with a
publisher check that went unanswered: the check timed out, and both replays from 0 (the
catch-up's and batch 3's) fell within the back-off it began."""


@pytest.mark.parametrize(
    ("unsent", "after"),
    [(3, []), (1, [("lost", 1)])],
    ids=["after the last", "a new process"],
)
def test_an_unanswered_publisher_check_is_not_asked_again_at_once(
    ctx: zmq.Context[zmq.Socket[bytes]], unsent: int, after: list[tuple[str, int]]
) -> None:
    """After a drop, the publisher check of a replay endpoint that does not answer cannot tell
    a new process from the same one: the worker is cleared as for a new process, but its
    replays from 0 (the catch-up's when the SUB is connected again, then the first message's)
    fall within the back-off the unanswered check began (skipped), not another timeout.

    If the next batch follows the last one delivered (3), none counts as lost: 0-2 were
    delivered if the process is the same, and no clear but the restart's goes out. If it is
    at or below the last (1), the process is new, and the batches before it are lost, as
    after any restart."""
    base = free_port_range(2)
    source = Source(f"tcp://*:{base}", f"tcp://*:{base + 1}", 1)

    engine = engine_on(ctx, base, serve=False)
    first = engine()
    with Subscriber([source], context=ctx, replay_timeout=0.3) as subscriber:
        stats = subscriber.stats
        assert first.wait_for_subscribers(timeout=TIMEOUT)
        for _ in range(3):
            first.publish(VALID)
        items = receive(subscriber, 3)
        first.close()
        listener_gone(base)
        items += poll_until(subscriber, lambda: stats.disconnects)
        with bound_again(engine) as second:
            for _ in range(unsent):
                second.publish(VALID, send=False)
            assert second.wait_for_subscribers(timeout=TIMEOUT)
            second.publish(VALID)
            items += receive(subscriber, 1)
        final = deepcopy(stats)

    assert shape(items) == [
        (0, False),
        (1, False),
        (2, False),
        ("restart", 0),
        *after,
        (unsent, False),
    ]
    assert final == SubscriberStats(**UNANSWERED_AT_3, lost=sum(lost for _, lost in after))


@pytest.mark.parametrize(
    ("unsent", "max_gap", "lost", "logged"),
    [
        (3, DEFAULT_MAX_GAP, 0, []),
        (5, DEFAULT_MAX_GAP, 2, [{"first": 3, "count": 2, "at_most": 5}]),
        (5, 1, 0, []),
    ],
    ids=["next", "loss", "past max_gap"],
)
def test_an_unanswered_publisher_check_keeps_the_chains_of_a_process_that_goes_on(
    ctx: zmq.Context[zmq.Socket[bytes]],
    unsent: int,
    max_gap: int,
    lost: int,
    logged: list[dict[str, int]],
) -> None:
    """A check that goes unanswered cannot tell the same process going on from a new one. The
    worker is cleared as for a new process, and only once: not again for the batches the
    back-off keeps from being replayed from 0. Of those, only the ones after the last batch
    delivered count as lost (the same process delivered the others before the clear), and,
    as in a resync, none past ``max_gap``. What its engine hashes stand for is kept: the same
    process's next store, on a chain it holds, announces that chain again, and the whole
    conversation is found downstream, not only its new turn."""
    base = free_port_range(2)
    source = Source(f"tcp://*:{base}", f"tcp://*:{base + 1}", 1)
    prefix, turn = list(range(12)), list(range(100, 104))
    hashes = block_hashes(prefix + turn, BS)
    engine = engine_on(ctx, base, serve=False)
    first = engine()
    index = TieredIndex(BS)
    pipeline = StreamPipeline(BS, sinks=[IndexSink(index)])
    seen: list[Message | StreamReset] = []
    with (
        Subscriber([source], context=ctx, replay_timeout=0.3, max_gap=max_gap) as subscriber,
        structlog.testing.capture_logs() as logs,
    ):
        stats = subscriber.stats

        def feed(seq: int) -> None:
            def step() -> None:
                for item in subscriber.poll(20):
                    seen.append(item)
                    pipeline.feed(item)

            wait_until(lambda: subscriber.last_seq(source) == seq, step, lambda: shape(seen))

        assert first.wait_for_subscribers(timeout=TIMEOUT)
        first.publish(encoded([stored(hashes[:3], prefix)], ts=TS0))
        first.publish(encoded([removed([hashes[2]])], ts=TS0 + 1))
        first.publish(encoded([stored(hashes[2:3], prefix[8:], parent=hashes[1])], ts=TS0 + 2))
        feed(2)
        before = overlaps(index, [prefix + turn])
        first.close()
        listener_gone(base)
        seen += poll_until(subscriber, lambda: stats.disconnects)
        with bound_again(engine) as second:
            for _ in range(unsent):
                second.publish(b"", send=False)  # the same process's sequence goes on
            assert second.wait_for_subscribers(timeout=TIMEOUT)
            second.publish(encoded([stored(hashes[3:], turn, parent=hashes[2])], ts=TS0 + 3))
            feed(unsent)
        final = deepcopy(stats)

    normalizer = pipeline.workers[1].normalizer
    assert before == [{(1, 0): (3, 3, 3)}]
    assert overlaps(index, [prefix + turn, prefix]) == [{(1, 0): (4, 4, 4)}, {(1, 0): (3, 3, 3)}]
    assert (normalizer.reanchored_blocks, dict(normalizer.stats)) == (3, {})
    assert shape(seen) == [(0, False), (1, False), (2, False), ("restart", 0), (unsent, False)]
    assert [item.checked for item in seen if isinstance(item, StreamReset)] == [False]
    losses = [
        {key: line[key] for key in ("first", "count", "at_most")}
        for line in logs
        if line["event"] == "batches lost"
    ]
    assert losses == logged
    assert final == SubscriberStats(**UNANSWERED_AT_3, lost=lost)


def _answer_cut_short(router: zmq.Socket[bytes], payloads: list[bytes], upto: int) -> None:
    """Answer a replay request waiting on ``router`` (a test's own ROUTER, in place of an
    engine's) with the batches of ``payloads`` from the seq asked for up to ``upto``, and no
    end marker: an answer that stops part way, as a ROUTER's does for a peer it cannot send
    to. Nothing if no request waits."""
    if not router.poll(0):
        return
    request = parse_request(router.recv_multipart())
    assert request is not None
    identity, start = request
    for seq in range(start, upto):
        router.send_multipart(answer_frames(identity, b"", seq, payloads[seq], topic_frame=True))


@pytest.mark.parametrize("path", ["start-up", "catch-up"])
def test_a_replay_answer_cut_short_clears_the_stream_after_what_it_delivered(
    ctx: zmq.Context[zmq.Socket[bytes]], path: str
) -> None:
    """A replay without a live batch to reach (the start-up replay from 0, or the catch-up
    after a drop) whose answer stops part way: batch 2, which removed the block batch 0
    stored, never comes. Once the replay times out, what came is delivered and the stream is
    cleared after it (a ``"lost"`` reset of an unknown number of batches), so that the block
    does not stay downstream until the engine's next batch shows the gap."""
    base = free_port_range(2)
    source = Source(f"tcp://*:{base}", f"tcp://*:{base + 1}", 1)
    a, b = ([k] * BS for k in (1, 2))
    payloads = [
        encoded([stored(block_hashes(a, BS), a)], ts=TS0),
        encoded([stored(block_hashes(b, BS), b)], ts=TS0 + 1),
        encoded([removed(block_hashes(a, BS))], ts=TS0 + 2),
    ]
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(f"tcp://127.0.0.1:{base + 1}")

    def engine(first_seq: int = 0) -> Publisher:  # its replays are the test's ROUTER's
        return Publisher(f"tcp://127.0.0.1:{base}", bind=True, context=ctx, first_seq=first_seq)

    first = engine()
    start_up = path == "start-up"
    with Subscriber(
        [source], context=ctx, replay_timeout=0.3, replay_on_start=start_up
    ) as subscriber:
        stats = subscriber.stats
        items: list[Message | StreamReset] = []

        def step() -> None:
            items.extend(subscriber.poll(20))
            _answer_cut_short(router, payloads, upto=2)

        if start_up:
            for payload in payloads:
                first.publish(payload, send=False)
        else:
            assert first.wait_for_subscribers(timeout=TIMEOUT)
            for payload in payloads[:2]:
                first.publish(payload)
            items += receive(subscriber, 2)
            first.close()
            listener_gone(base)
            items += poll_until(subscriber, lambda: stats.disconnects)
            first = bound_again(lambda: engine(first_seq=2))
            first.publish(payloads[2], send=False)  # the same process goes on, unheard
        wait_until(lambda: stats.replay_timeouts == 1, step, lambda: shape(items))
        final = deepcopy(stats)
        first.close()
    router.close()

    if start_up:
        assert shape(items) == [(0, True), (1, True), ("lost", 0)]
        assert final == SubscriberStats(replays=1, replay_timeouts=1, replayed=2)
    else:  # the check's answer from 1: batch 1 again, the same bytes, so the same process
        assert shape(items) == [(0, False), (1, False), ("lost", 0)]
        assert final == SubscriberStats(
            messages=2, disconnects=1, reconnect_checks=1, replays=1, replay_timeouts=1
        )


# --------------------------------------------------------------------------- 2. restart


def test_restart_clears_the_worker_at_the_first_new_message(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    a, b, c, d = (list(range(k * 100, k * 100 + 12)) for k in range(1, 5))
    before = [encoded([stored(block_hashes(p, BS), p)], ts=TS0 + i) for i, p in enumerate((a, b))]
    after = [
        encoded([stored(block_hashes(p, BS), p)], ts=TS0 + 10 + i) for i, p in enumerate((c, d))
    ]
    with relayed(ctx) as (publisher, source, relay, index, seen):
        for payload in before:
            deliver(relay, source, publisher.publish(payload))
        assert overlaps(index, [a, b]) == [{(1, 0): (3, 3, 3)}] * 2

        publisher.restart()
        assert publisher.publish(after[0]) == 0
        deliver(relay, source, 0)
        # One message after the restart, the old blocks are gone and the new ones indexed.
        assert relay.subscriber.stats.restarts == 1
        assert overlaps(index, [a, b, c]) == [{}, {}, {(1, 0): (3, 3, 3)}]

        deliver(relay, source, publisher.publish(after[1]))
        stats = deepcopy(relay.subscriber.stats)

    assert shape(seen) == [(0, False), (1, False), ("restart", 0), (0, False), (1, False)]
    assert stats == SubscriberStats(messages=4, restarts=1)
    assert_same_index(index, index_of(after, worker_id=1, block_size=BS), [a, b, c, d])


def test_live_copies_of_replayed_batches_are_duplicates_not_restarts(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    stream = seeded_stream(5, 5, block_size=BS)
    payloads = stream.payloads
    with relayed(ctx) as (publisher, source, relay, index, seen):
        deliver(relay, source, publisher.publish(payloads[0]))
        # Batch 1 dropped, then 2-4 published before the relay looks: the replay that batch 2
        # triggers returns 1-4, so the live 2, 3 and 4 arrive after their replayed copies.
        publisher.publish(payloads[1], send=False)
        for payload in payloads[2:]:
            publisher.publish(payload)
        wait_until(lambda: relay.subscriber.stats.messages >= 4, lambda: relay.step(20))
        stats = deepcopy(relay.subscriber.stats)
        batches_in = relay.stats.batches_in

    assert shape(seen) == [(0, False), *((seq, True) for seq in range(1, 5))]
    assert stats == SubscriberStats(messages=4, gaps=1, replays=1, replayed=4, duplicates=3)
    assert batches_in == 5
    assert_same_index(index, index_of(payloads, worker_id=1, block_size=BS), stream.prompts)


def test_restart_after_a_replay_is_still_a_restart(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """A replay earlier in the stream must not turn a later restart into "duplicates"."""
    a, b, c, d = (list(range(k * 100, k * 100 + 12)) for k in range(1, 5))
    payloads = [
        encoded([stored(block_hashes(p, BS), p)], ts=TS0 + i) for i, p in enumerate((a, b, c, d))
    ]
    with relayed(ctx) as (publisher, source, relay, index, seen):
        deliver(relay, source, publisher.publish(payloads[0]))
        publisher.publish(payloads[1], send=False)
        deliver(relay, source, publisher.publish(payloads[2]))  # replays 1 and 2
        assert overlaps(index, [a, b, c]) == [{(1, 0): (3, 3, 3)}] * 3

        publisher.restart()
        assert publisher.publish(payloads[3]) == 0
        wait_until(lambda: relay.subscriber.stats.messages >= 3, lambda: relay.step(20))
        relay.step(50)
        stats = deepcopy(relay.subscriber.stats)

    assert shape(seen)[-2:] == [("restart", 0), (0, False)]
    assert stats.restarts == 1
    assert stats.duplicates == 1  # the live copy of batch 2 only
    assert overlaps(index, [a, b, c, d]) == [{}, {}, {}, {(1, 0): (3, 3, 3)}]


def test_a_drop_before_anything_was_delivered_is_caught_up_from_0(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """The catch-up after a drop replays a stream that has delivered nothing (since it began, or
    since a restart's clear) from 0, as its first message past 0 would have it replayed: here
    the engine publishes two batches while the connection is down and then stays idle. The
    peer the SUB connects to is a bare PUB, closed and bound again to drop the connection; the
    replay endpoint is the engine's."""
    base = free_port_range(1)
    engine = Publisher(LOCAL, bind=True, replay_endpoint=LOCAL, context=ctx)
    engine.start_replay_thread()
    source = Source(f"tcp://*:{base}", engine.replay_endpoint, 1)

    def peer() -> zmq.Socket[bytes]:
        socket = ctx.socket(zmq.PUB)
        socket.bind(f"tcp://127.0.0.1:{base}")
        return socket

    first = peer()
    with engine, Subscriber([source], context=ctx) as subscriber:
        stats = subscriber.stats
        items = poll_for(subscriber, 0.3)  # connected, nothing to read
        first.close(linger=0)
        listener_gone(base)
        items += poll_until(subscriber, lambda: stats.disconnects)
        engine.publish(VALID)
        engine.publish(VALID)
        second = bound_again(peer)
        items += poll_until(subscriber, lambda: stats.replayed == 2)
        second.close(linger=0)
        final = deepcopy(stats)
    assert shape(items) == [(0, True), (1, True)]
    assert final == SubscriberStats(disconnects=1, replays=1, replayed=2)


def test_a_catch_up_from_0_is_asked_within_a_back_off_begun_before_its_drop(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """A drop ends the source's replay back-off, but a replay asked of the old connection can
    still time out after it and begin one. The catch-up of a stream that has delivered nothing
    since a restart's clear then asks for its replay from 0 all the same: here the second
    process is found by the catch-up's check, and the replay from 0 that follows its clear is
    never answered; the connection drops while that replay waits, and a third process, which
    holds a batch the stream never heard, stays quiet. Once the replay has timed out, the third
    process's batch is replayed at once, not left unindexed until it sends again. That answer
    ends the back-off: the third process's gap right after is replayed, not lost. The engines
    are bare PUBs; their replay endpoint is the test's own ROUTER, which answers every request
    but the second."""
    answers = {1: [b"second 0"], 3: [b"third 0"], 4: [b"third 1"]}
    replays = ScriptedReplays(ctx, free_port_range(2), answers)
    with Subscriber([replays.source], context=ctx, replay_timeout=2.0) as subscriber:
        stats = subscriber.stats
        items, step = replays.first_batch(subscriber)
        replays.replace(stats, step)  # checked: a new process; its replay from 0 (request 2) waits
        wait_until(lambda: replays.requests == 2, step)
        third = replays.replace(stats, step)
        assert stats.replay_timeouts == 0  # the drop came first
        wait_until(lambda: stats.replayed == 1, step, lambda: (shape(items), stats), timeout=4.0)
        for seq in range(3):  # batch 1 missed: a gap, 2 s at most after the timeout
            third.publish(b"third %d" % seq, send=seq == 2)
        source = replays.source
        wait_until(lambda: subscriber.last_seq(source) == 2, step, lambda: (shape(items), stats))
        final = deepcopy(stats)
    replays.close()

    assert shape(items) == [(0, False), ("restart", 0), (0, True), (1, True), (2, False)]
    assert [item.payload for item in items if isinstance(item, Message)] == [
        b"first 0",
        b"third 0",
        b"third 1",
        b"third 2",
    ]
    assert final == SubscriberStats(
        messages=2,
        gaps=1,
        restarts=1,
        disconnects=2,
        reconnect_checks=1,
        replays=4,
        replayed=2,
        replay_timeouts=1,
    )


def test_a_stream_suspended_then_quiet_is_cleared_once_a_clear_is_allowed(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """An engine that restarts more often than clears are allowed (3, then one every
    ``interval``) suspends its stream. If it then goes quiet, its worker is cleared as soon as
    a clear token is back, not when it next sends (which may be never): the index does not
    keep the blocks of the process before. Nor does it wait for that message to start the
    stream over: the new process's batches the suspension skipped are replayed at once, and
    their blocks indexed. Its next message follows them. (The interval is long enough for the
    four restarts to land before a token is back, even on a slow machine.)"""
    interval = 3.0
    prompts, payloads = six_prompts()
    with relayed(ctx, clear_interval=interval) as (publisher, source, relay, index, seen):
        stats = relay.subscriber.stats
        deliver(relay, source, publisher.publish(payloads[0]))
        first_restart = time.monotonic()  # the bucket is full (3 tokens) until this one
        restarted_in_place(relay, publisher, payloads[1:5])
        # The fourth restart found no token: skipped, and the index still holds what the
        # engine held before it.
        assert relay.subscriber.suspended(source)
        assert overlaps(index, prompts[3:5]) == [{(1, 0): (3, 3, 3)}, {}]

        wait_until(
            lambda: overlaps(index, prompts[3:4]) == [{}],
            lambda: relay.step(20),
            lambda: "the quiet suspended worker was never cleared",
        )
        cleared_after = time.monotonic() - first_restart
        assert not relay.subscriber.suspended(source)
        wait_until(
            lambda: overlaps(index, prompts[4:5]) == [{(1, 0): (3, 3, 3)}],
            lambda: relay.step(20),
            lambda: "the batch the suspension skipped was not replayed while the engine is quiet",
        )

        deliver(relay, source, publisher.publish(payloads[5]))
        final = deepcopy(stats)

    # Four clears from a bucket of three take one interval's refill.
    assert cleared_after >= interval
    restart, new_life = ("restart", 0), (0, False)
    assert shape(seen) == [
        (0, False), *[restart, new_life] * 3, restart, (0, True), (1, False)
    ]  # fmt: skip
    assert final == SubscriberStats(
        messages=6,
        restarts=4,
        replays=1,
        replayed=1,
        bad_frames=Counter({BadFrame.THROTTLED: 1}),
    )
    assert overlaps(index, prompts) == [{}] * 4 + [{(1, 0): (3, 3, 3)}] * 2


def test_a_stream_suspended_by_a_loss_is_released_with_a_loss_reset(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """A stream suspended because a loss found no clear token is the same process going on:
    its release is a ``"lost"`` reset, which keeps the worker's block identities, so the next
    store on a chain from before the suspension announces the chain again (a ``"restart"``
    reset would make that store an orphan, and the chain would be missed until vLLM stores
    it anew)."""
    interval = 3.0
    prompt = list(range(1000, 1016))
    hashes = block_hashes(prompt, BS)
    others = [list(range(k * 100, k * 100 + 8)) for k in range(1, 5)]
    batches = [encoded([stored(hashes[:3], prompt[:12])], ts=TS0)]
    for k, other in enumerate(others):
        batches += [
            encoded([], ts=TS0 + 2 * k + 1),
            encoded([stored(block_hashes(other, BS), other)], ts=TS0 + 2 * k + 2),
        ]
    extension = encoded([stored(hashes[3:], prompt[12:], parent=hashes[2])], ts=TS0 + 9)
    with relayed(ctx, replay=False, clear_interval=interval) as (
        publisher,
        source,
        relay,
        index,
        seen,
    ):
        stats = relay.subscriber.stats
        deliver(relay, source, publisher.publish(batches[0]))
        for seq in range(1, 9, 2):  # four losses: three clear tokens, then none
            publisher.publish(batches[seq], send=False)
            publisher.publish(batches[seq + 1])
            wait_until(
                lambda n=(seq + 3) // 2: stats.messages >= n, lambda: relay.step(20), lambda: stats
            )
        assert relay.subscriber.suspended(source)
        wait_until(
            lambda: not relay.subscriber.suspended(source),
            lambda: relay.step(20),
            lambda: "the suspended stream was never released",
        )
        deliver(relay, source, publisher.publish(extension))
        final = deepcopy(stats)
        reanchored = relay.workers[1].normalizer.reanchored_blocks

    lost_one = ("lost", 1)
    assert shape(seen) == [
        (0, False), lost_one, (2, False), lost_one, (4, False), lost_one, (6, False),
        ("lost", 0), (9, False),
    ]  # fmt: skip
    assert final == SubscriberStats(
        messages=6, gaps=4, lost=5, resyncs=1, bad_frames=Counter({BadFrame.THROTTLED: 1})
    )
    assert reanchored == 3
    assert overlaps(index, [prompt, *others]) == [{(1, 0): (4, 4, 4)}] + [{}] * 4


def test_a_released_stream_replays_what_its_suspension_skipped_that_the_buffer_holds(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """A stream suspended by a loss starts over as soon as it is released, without waiting
    for its next message, with the run of skipped batches the engine's replay buffer still
    holds, up to the last it holds; the rest count as lost. Three losses spend the clear tokens
    (a buffer of two batches, three batches unsent each time), the fourth suspends the stream
    at batch 13: on release the buffer holds 15 and 16, and 13 and 14 are lost. The next
    message, 17, follows them in order."""
    interval = 3.0
    prompts = [list(range(k * 100, k * 100 + 8)) for k in range(18)]
    payloads = [
        encoded([stored(block_hashes(p, BS), p)], ts=TS0 + i) for i, p in enumerate(prompts)
    ]
    with relayed(ctx, clear_interval=interval, buffer_steps=2) as (
        publisher,
        source,
        relay,
        index,
        seen,
    ):
        stats = relay.subscriber.stats
        deliver(relay, source, publisher.publish(payloads[0]))
        for first in range(1, 17, 4):
            for seq in range(first, first + 3):
                publisher.publish(payloads[seq], send=False)
            publisher.publish(payloads[first + 3])
            if first < 13:
                deliver(relay, source, first + 3)  # its replay answered
        wait_until(
            lambda: stats.bad_frames[BadFrame.THROTTLED], lambda: relay.step(20), lambda: stats
        )
        assert relay.subscriber.suspended(source)
        wait_until(
            lambda: not relay.subscriber.suspended(source),
            lambda: relay.step(20),
            lambda: "the suspended stream was never released",
        )
        deliver(relay, source, publisher.publish(payloads[17]))
        final = deepcopy(stats)

    rounds = [[("lost", 2), (first + 2, True), (first + 3, True)] for first in (1, 5, 9)]
    assert shape(seen) == [
        (0, False), *rounds[0], *rounds[1], *rounds[2], ("lost", 0), (15, True), (16, True),
        (17, False),
    ]  # fmt: skip
    assert final == SubscriberStats(
        messages=6,
        gaps=4,
        replays=5,
        replayed=8,
        duplicates=3,
        lost=8,
        resyncs=1,
        bad_frames=Counter({BadFrame.THROTTLED: 1}),
    )
    assert overlaps(index, prompts) == [{}] * 15 + [{(1, 0): (2, 2, 2)}] * 3


def sequenced(subscriber: Subscriber, source: Source, seq: int) -> list[Message | StreamReset]:
    """The sequencer's items for a valid message ``seq`` of ``source``, taken as if just
    received, at the time the test chooses; for a source without a replay endpoint, which
    never waits for an answer."""
    result = subscriber._sequencer.receive(
        subscriber._by_source[source], [b"", seq.to_bytes(8, "big"), VALID]
    )
    if isinstance(result, list):
        return list(result)
    with pytest.raises(StopIteration) as done:
        next(result)
    return list(done.value.value)


@pytest.mark.parametrize(
    ("seq", "reason", "lost", "counted"),
    [(9, "lost", 7, "resyncs"), (1, "restart", 2, "restarts")],
    ids=["on", "back"],
)
def test_a_message_that_finds_the_token_back_starts_over_as_its_suspension_was(
    ctx: zmq.Context[zmq.Socket[bytes]], seq: int, reason: str, lost: int, counted: str
) -> None:
    """The message path of a release (the token came back after the poll looked): a stream
    suspended by a loss resyncs with a ``"lost"`` reset, unless its sequence went back since,
    which is a new process: a ``"restart"`` reset, counted as a restart. What the suspension
    skipped counts as lost (no replay endpoint here): batches 3-8 of the same process, or
    batch 0 of the new one."""
    source = Source(f"tcp://127.0.0.1:{free_port_range(1)}", None, 1)
    with Subscriber([source], context=ctx, clear_burst=1, clear_interval=0.2) as subscriber:
        stream = subscriber._by_source[source]
        items = []
        for sent in (0, 2, 5):  # a loss (one token), then one that finds none
            items += sequenced(subscriber, source, sent)
        assert stream.suspended
        time.sleep(0.25)
        items += sequenced(subscriber, source, seq)
        stats = deepcopy(subscriber.stats)
    assert shape(items) == [(0, False), ("lost", 1), (2, False), (reason, 0), (seq, False)]
    assert stats == SubscriberStats(
        messages=4, gaps=2, lost=lost, bad_frames=Counter({BadFrame.THROTTLED: 1}), **{counted: 1}
    )


def test_a_long_poll_ends_when_a_suspended_stream_may_be_released(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """A poll waits no longer than the next timer of a stream: a suspension is released when
    its clear token is back (0.3 s after the loss that found none), not when a minute-long
    poll of a quiet source ends. The poll that finds the token back ends the wait; the next
    one sends the clear."""
    interval = 0.3
    source = Source(f"tcp://127.0.0.1:{free_port_range(1)}", None, 1)
    with Subscriber([source], context=ctx, clear_burst=1, clear_interval=interval) as subscriber:
        items = []
        for sent in (0, 2, 5):  # a loss (one token), then one that finds none
            items += sequenced(subscriber, source, sent)
        suspended_at = time.monotonic()
        assert subscriber.suspended(source)
        assert subscriber.poll(60_000) == []
        waited = time.monotonic() - suspended_at
        items += subscriber.poll(0)
        assert not subscriber.suspended(source)
        stats = deepcopy(subscriber.stats)
    assert interval - 0.05 <= waited < 5.0
    assert shape(items) == [(0, False), ("lost", 1), (2, False), ("lost", 0)]
    assert stats == SubscriberStats(
        messages=3, gaps=2, lost=1, resyncs=1, bad_frames=Counter({BadFrame.THROTTLED: 1})
    )


def test_a_new_process_found_after_a_throttled_loss_clear_is_logged_not_counted_twice(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """A stream suspended by a loss is cleared at a poll once a token is back (a resync). When
    its next message goes back, the publisher is a new process: its batches from 0 are
    replayed (here lost, as no one serves replays), and the restart is logged, but the clear
    it took was counted already: no restart is counted for it."""
    source = Source(f"tcp://127.0.0.1:{free_port_range(1)}", None, 1)
    with (
        structlog.testing.capture_logs() as logs,
        Subscriber([source], context=ctx, clear_burst=1, clear_interval=0.2) as subscriber,
    ):
        items = [item for seq in (0, 2, 5) for item in sequenced(subscriber, source, seq)]
        assert subscriber.suspended(source)  # the loss at 5 found no token
        time.sleep(0.25)
        items += subscriber.poll(20)  # the token is back: cleared at once
        released = deepcopy(subscriber.stats)
        items += sequenced(subscriber, source, 1)
        stats = deepcopy(subscriber.stats)
    assert shape(items) == [(0, False), ("lost", 1), (2, False), ("lost", 0), (1, False)]
    throttled = Counter({BadFrame.THROTTLED: 1})
    assert released == SubscriberStats(messages=3, gaps=2, lost=1, resyncs=1, bad_frames=throttled)
    assert stats == SubscriberStats(messages=4, gaps=2, lost=2, resyncs=1, bad_frames=throttled)
    assert log_fields(logs, "publisher restarted", "seq", "last", "counted") == [(1, 2, "resync")]


def test_a_jump_after_a_throttled_restart_counts_a_resync(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """A restart that waited for a token counts a restart when the stream starts over; a jump
    the stream takes later is a resync, not another restart of what was suspended before."""
    source = Source(f"tcp://127.0.0.1:{free_port_range(1)}", None, 1)
    with Subscriber(
        [source], context=ctx, clear_burst=1, clear_interval=0.2, max_gap=10
    ) as subscriber:
        items = [item for seq in (0, 1, 0, 0) for item in sequenced(subscriber, source, seq)]
        assert subscriber.suspended(source)  # the second restart found no token
        time.sleep(0.25)
        items += sequenced(subscriber, source, 1)  # the new process's batch 0 skipped: lost
        restarted = deepcopy(subscriber.stats)
        time.sleep(0.25)
        items += sequenced(subscriber, source, 20)  # a jump
        items += sequenced(subscriber, source, 21)  # the stream goes on from it
        stats = deepcopy(subscriber.stats)
    assert shape(items) == [
        (0, False), (1, False), ("restart", 0), (0, False), ("restart", 0), (1, False),
        ("restart", 0), (21, False),
    ]  # fmt: skip
    throttled = Counter({BadFrame.THROTTLED: 1})
    assert restarted == SubscriberStats(messages=5, restarts=2, lost=1, bad_frames=throttled)
    jumped = throttled | Counter({BadFrame.SEQ_JUMP: 1})
    assert stats == SubscriberStats(messages=7, restarts=2, lost=1, resyncs=1, bad_frames=jumped)


# --------------------------------------------------------------------------- 3. bad frames

VALID = encoded([stored(block_hashes([7] * 4, BS), [7] * 4)], ts=TS0)


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        ([b"", (1).to_bytes(8, "big"), b"x" * 2048], BadFrame.OVERSIZED),
        ([b"x" * 2048, (1).to_bytes(8, "big"), VALID], BadFrame.OVERSIZED),
        ([b"t", b"x"], BadFrame.FRAME_COUNT),
        ([b"", (1).to_bytes(8, "big"), VALID, b"extra"], BadFrame.FRAME_COUNT),
        ([b"", (1).to_bytes(7, "big"), VALID], BadFrame.BAD_SEQ),
        ([b"", (1).to_bytes(9, "big"), VALID], BadFrame.BAD_SEQ),
        ([b"", b"\xff" * 8, VALID], BadFrame.BAD_SEQ),
    ],
    ids=[
        "oversized-payload",
        "oversized-topic",
        "2-frames",
        "4-frames",
        "7-byte-seq",
        "9-byte-seq",
        "end-marker-seq",
    ],
)
def test_bad_frame_is_counted_and_skipped(
    ctx: zmq.Context[zmq.Socket[bytes]], frames: list[bytes], reason: BadFrame
) -> None:
    publisher, source = engine_publisher(ctx)
    with publisher, Subscriber([source], context=ctx, max_frame_bytes=1024) as subscriber:
        assert publisher.wait_for_subscribers(timeout=TIMEOUT)
        publisher.publish(VALID)
        publisher.send_frames(frames)
        publisher.publish(VALID)
        items = receive(subscriber, 2)
        subscriber.poll(50)
        stats = deepcopy(subscriber.stats)

    assert shape(items) == [(0, False), (1, False)]
    assert [item.frames for item in items if isinstance(item, Message)] == [
        [b"", (seq).to_bytes(8, "big"), VALID] for seq in (0, 1)
    ]
    assert stats == SubscriberStats(messages=2, bad_frames=Counter({reason: 1}))


def test_a_first_message_at_the_replay_end_marker_is_a_bad_frame(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """A sequence frame of 2**64 - 1 is the replay protocol's end marker, which no batch can
    have: as the first message of a stream it is skipped as ``bad_seq``, not taken as a stream
    that starts far past 0 (a resync there, then a restart at the next real batch)."""
    publisher, source = engine_publisher(ctx)
    with publisher, Subscriber([source], context=ctx) as subscriber:
        assert publisher.wait_for_subscribers(timeout=TIMEOUT)
        publisher.send_frames([b"", b"\xff" * 8, VALID])
        publisher.publish(VALID)
        items = receive(subscriber, 1)
        subscriber.poll(50)
        stats = deepcopy(subscriber.stats)

    assert shape(items) == [(0, False)]
    assert stats == SubscriberStats(messages=1, bad_frames=Counter({BadFrame.BAD_SEQ: 1}))


def test_every_kind_of_bad_frame_in_one_stream(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    publisher, source = engine_publisher(ctx)
    with publisher, Subscriber([source], context=ctx, max_frame_bytes=1024) as subscriber:
        assert publisher.wait_for_subscribers(timeout=TIMEOUT)
        for bad in (
            [b"", (0).to_bytes(8, "big"), b"x" * 1025],
            [b"t", b"x"],
            [b"a", b"b", b"c", b"d"],
            [b"", b"\x00" * 4, VALID],
        ):
            publisher.send_frames(bad)
            publisher.publish(VALID)
        items = receive(subscriber, 4)
        stats = deepcopy(subscriber.stats)

    assert shape(items) == [(seq, False) for seq in range(4)]
    assert stats == SubscriberStats(
        messages=4,
        bad_frames=Counter({BadFrame.OVERSIZED: 1, BadFrame.FRAME_COUNT: 2, BadFrame.BAD_SEQ: 1}),
    )


# --------------------------------------------------------------------------- 4. bind / connect


def test_specific_host_makes_the_subscriber_bind(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    port = free_port_range(1)
    source = Source(f"tcp://127.0.0.1:{port}", worker_id=2)
    assert source.subscriber_binds
    with (
        Subscriber([source], context=ctx) as subscriber,
        Publisher(f"tcp://127.0.0.1:{port}", bind=False, context=ctx) as publisher,
    ):
        assert publisher.endpoint == f"tcp://127.0.0.1:{port}"
        assert publisher.wait_for_subscribers(timeout=TIMEOUT)
        assert poll_for(subscriber) == []
        publisher.publish(VALID)
        publisher.publish(VALID)
        items = receive(subscriber, 2)
        stats = deepcopy(subscriber.stats)
    assert shape(items) == [(0, False), (1, False)]
    assert all(isinstance(item, Message) and item.source == source for item in items)
    assert stats == SubscriberStats(messages=2)


def test_wildcard_host_makes_the_subscriber_connect_to_localhost(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    port = free_port_range(1)
    source = Source(f"tcp://*:{port}", worker_id=2)
    assert not source.subscriber_binds
    # Bound on 127.0.0.1 only: the subscriber can only have connected to 127.0.0.1.
    with (
        Publisher(f"tcp://127.0.0.1:{port}", bind=True, context=ctx) as publisher,
        Subscriber([source], context=ctx) as subscriber,
    ):
        assert publisher.wait_for_subscribers(timeout=TIMEOUT)
        publisher.publish(VALID)
        items = receive(subscriber, 1)
    assert shape(items) == [(0, False)]
    assert Counter(type(item) for item in items) == {Message: 1}


def test_a_waiting_poll_ends_when_another_thread_wakes_it(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """A loop's poll sees a stop, or work another thread queued for it, at once: a poll of a
    minute returns empty as soon as ``wakeup.wake()`` is called. Wake-ups sent before a poll
    are all taken by it, so that the next poll waits its timeout again. Once the subscriber is
    closed, a wake-up does nothing."""
    source = Source(f"tcp://127.0.0.1:{free_port_range(1)}", worker_id=2)
    subscriber = Subscriber([source], context=ctx)
    polls: list[list[Message | StreamReset]] = []
    thread = threading.Thread(target=lambda: polls.append(subscriber.poll(60_000)))
    thread.start()
    subscriber.wakeup.wake()
    thread.join(TIMEOUT)
    assert not thread.is_alive() and polls == [[]]
    subscriber.wakeup.wake()
    subscriber.wakeup.wake()
    assert subscriber.poll(60_000) == []
    started = time.monotonic()
    assert subscriber.poll(300) == []
    assert time.monotonic() - started >= 0.25, "a wake-up was left for the next poll"
    subscriber.close()
    subscriber.wakeup.wake()
    subscriber.close()


@pytest.mark.parametrize("max_frame_bytes", [0, MAX_FRAME_BYTES + 1])
def test_max_frame_bytes_must_fit_zmq(
    ctx: zmq.Context[zmq.Socket[bytes]], max_frame_bytes: int
) -> None:
    """MAXMSGSIZE, max_frame_bytes plus a margin, is a signed 64-bit option."""
    with pytest.raises(ValueError) as raised:
        Subscriber([], context=ctx, max_frame_bytes=max_frame_bytes)
    assert str(raised.value) == (
        f"max_frame_bytes must be in [1, {2**63 - 1 - 64 * 1024}], got {max_frame_bytes}"
    )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"replay_timeout": 0.0}, "replay_timeout must be in [0.001, {max}] seconds, got 0.0"),
        ({"replay_timeout": -1.0}, "replay_timeout must be in [0.001, {max}] seconds, got -1.0"),
        ({"replay_timeout": math.nan}, "replay_timeout must be in [0.001, {max}] seconds, got nan"),
        ({"replay_timeout": math.inf}, "replay_timeout must be in [0.001, {max}] seconds, got inf"),
        (
            {"clear_interval": -1.0},
            "clear_interval must be in [0, {max}] seconds (0: clears are not rate-limited), "
            "got -1.0",
        ),
        (
            {"clear_interval": math.nan},
            "clear_interval must be in [0, {max}] seconds (0: clears are not rate-limited), "
            "got nan",
        ),
    ],
    ids=[
        "timeout-0",
        "timeout-negative",
        "timeout-nan",
        "timeout-inf",
        "interval-negative",
        "interval-nan",
    ],
)
def test_replay_timeout_and_clear_interval_are_checked(
    ctx: zmq.Context[zmq.Socket[bytes]], options: dict[str, float], message: str
) -> None:
    """A timeout of 0 would time every replay out at once and never back off; a NaN would
    compare false everywhere and turn the clear rate limit off."""
    with pytest.raises(ValueError) as raised:
        Subscriber([], context=ctx, **options)
    assert str(raised.value) == message.format(max=threading.TIMEOUT_MAX)


@pytest.mark.parametrize("worker_id", [1, 2], ids=["same source", "another worker"])
def test_a_source_given_twice_is_refused(
    ctx: zmq.Context[zmq.Socket[bytes]], worker_id: int
) -> None:
    """Two SUB sockets on one publisher and topic would deliver each batch twice: once per
    worker, or twice to one. A different topic on the same publisher is another stream."""
    endpoint = f"tcp://*:{free_port_range(1)}"
    source = Source(endpoint, worker_id=1)
    again = Source(endpoint, worker_id=worker_id)
    with pytest.raises(ValueError) as raised:
        Subscriber([source, again], context=ctx)
    assert str(raised.value) == f"source {endpoint} (topic '') is given twice"
    other_topic = Source(endpoint, worker_id=worker_id, topic="kv@1")
    with Subscriber([source, other_topic], context=ctx, monitor=False) as subscriber:
        assert subscriber.sources == [source, other_topic]


def test_what_a_poll_that_raised_had_taken_comes_with_the_next(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """The sequencing of batch 2 raises (a test double of a bug: no input is known to make it
    raise). Batches 0 and 1, taken by the same poll, come with the next poll, not lost; batch
    2, read off its socket, is a gap of batch 3 and replayed (the answer brings 3 as well)."""
    base = free_port_range(2)
    source = Source(f"tcp://*:{base}", f"tcp://*:{base + 1}", 1)
    with (
        engine_on(ctx, base)() as engine,
        Subscriber([source], context=ctx) as subscriber,
    ):
        receive_one = subscriber._sequencer.receive

        def receive_with_a_bug(stream: StreamState, frames: list[bytes]) -> Any:
            if int.from_bytes(frames[1], "big") == 2:
                fault()
            return receive_one(stream, frames)

        subscriber._sequencer.receive = receive_with_a_bug  # type: ignore[method-assign]
        assert engine.wait_for_subscribers(timeout=TIMEOUT)
        for _ in range(3):
            engine.publish(VALID)
        time.sleep(0.2)  # all three wait on the SUB: one poll takes them
        with pytest.raises(RuntimeError, match="injected fault"):
            subscriber.poll(int(TIMEOUT * 1000))
        engine.publish(VALID)
        items = receive(subscriber, 4)
        stats = deepcopy(subscriber.stats)
    assert shape(items) == [(0, False), (1, False), (2, True), (3, True)]
    assert stats == SubscriberStats(messages=3, gaps=1, replays=1, replayed=2, duplicates=1)


def test_a_bound_subscriber_checks_each_new_peer(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """A bound SUB keeps what its peer had sent before it dropped, and reading it checks that
    peer (its replay socket is gone with it: unanswered, a restart). A new, idle process that
    connects next is checked too, once its handshake is in: its empty replay shows a new
    process, and the worker is cleared again without a batch from it."""
    port = free_port_range(2)
    source = Source(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}", 1)
    assert source.subscriber_binds

    def engine() -> Publisher:
        made = Publisher(
            source.endpoint, bind=False, replay_endpoint=source.replay_endpoint, context=ctx
        )
        made.start_replay_thread()
        return made

    with Subscriber([source], context=ctx, replay_timeout=0.3) as subscriber:
        stats = subscriber.stats
        first = engine()
        assert first.wait_for_subscribers(timeout=TIMEOUT)
        items = poll_for(subscriber)
        for _ in range(5):
            first.publish(VALID)
        items += receive(subscriber, 5)
        for _ in range(3):
            first.publish(VALID)  # 5-7: queued on the SUB when the peer goes
        time.sleep(0.2)
        first.close()
        time.sleep(0.2)  # the drop is seen before they are read
        items += poll_until(subscriber, lambda: subscriber.last_seq(source) == 7)
        time.sleep(0.4)  # past the back-off of the unanswered check
        with bound_again(engine) as second:
            assert second.wait_for_subscribers(timeout=TIMEOUT)

            def step() -> None:
                items.extend(subscriber.poll(20))

            wait_until(lambda: shape(items).count(("restart", 0)) == 2, step, lambda: stats)
        final = deepcopy(stats)

    assert shape(items) == [
        *((seq, False) for seq in range(5)),
        ("restart", 0),
        (5, False),
        (6, False),
        (7, False),
        ("restart", 0),
    ]
    # The first restart is an unanswered check's (the peer's replay socket went with it), the
    # second a new process's empty replay. Batch 5 follows the last before the unanswered
    # check: nothing counts as lost (0-4 were delivered if the process is the same).
    # Past its back-off the unanswered replay from 0 is asked again, to repair the stream: the
    # new process's empty answer shows there is nothing to repair (the fourth replay).
    checked = [item.checked for item in items if isinstance(item, StreamReset)]
    assert checked == [False, True]
    assert final == SubscriberStats(
        messages=8,
        disconnects=1,
        reconnect_checks=2,
        replays=4,
        replay_timeouts=1,
        replays_skipped=1,
        restarts=2,
    )
