"""Repairs over real sockets on 127.0.0.1: a loss whose replay went unanswered is delivered
again once the engine's replay answers with it (``kvbridge/adapters/repairs.py``).

A :class:`Publisher` stands in for a vLLM engine whose replay socket is bound but not served
at first (a busy or slow engine): the relay's replay from 0 times out, and the first batches
are lost. Its replay thread then starts, and the relay's next poll past the back-off repairs
the stream. The index is compared with the lossless one built from the same payloads without
a socket (``tests/support/reference.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from copy import deepcopy
from pathlib import Path

import structlog
import zmq
from support.log_fields import log_fields
from support.polling import TIMEOUT, poll_for, poll_until, receive, shape, wait_until
from support.rebind import bound_again, engine_on, listener_gone
from support.reference import dump_rows, index_of, overlaps
from support.relayed import (
    BS,
    Relayed,
    deliver,
    engine_publisher,
    relayed,
    suspend_after_two_losses,
)

from kvbridge.adapters.capture import CaptureReader, CaptureWriter
from kvbridge.adapters.pipeline import IndexSink, StreamPipeline
from kvbridge.adapters.ports import free_port_range
from kvbridge.adapters.repairs import REPAIR_TRIES
from kvbridge.adapters.source import Message, Source
from kvbridge.adapters.stream_stats import SubscriberStats
from kvbridge.adapters.subscriber import Subscriber
from kvbridge.adapters.tiered_index import TieredIndex
from kvbridge.testing.workload import seeded_stream

TIMEOUT_S = 1.0
"""The relay's replay timeout, and so its first back-off: longer than publishing the stream
takes, so that no repair is asked for before the engine serves its replays."""
UNSENT = 6
"""Batches published before the relay's first message, which its replay from 0 must fetch."""


def publish_after_a_lost_start(rig: Relayed, payloads: list[bytes]) -> None:
    """The first :data:`UNSENT` payloads only into the engine's buffer, then the rest in lock
    step: the relay's replay from 0 times out, and those batches are lost."""
    for payload in payloads[:UNSENT]:
        rig.publisher.publish(payload, send=False)
    for seq in range(UNSENT, len(payloads)):
        rig.publisher.publish(payloads[seq])
        deliver(rig.relay, rig.source, seq)


def step_until(rig: Relayed, done: Callable[[], bool]) -> None:
    """Step the relay until ``done()``."""
    wait_until(done, lambda: rig.relay.step(20), lambda: rig.relay.subscriber.stats)


def test_a_start_whose_replay_timed_out_is_repaired_once_the_engine_answers(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """The relay starts while the engine's replay socket does not answer: the first batches
    are lost, and the stores that chain on them are dropped (their parents are unknown), so
    the index misses prompts the engine holds. Then the engine publishes two batches the relay
    does not get (their removals among them), goes idle, and answers its replays. Past the
    back-off the stream is cleared, delivered again from 0, and the two batches after its last
    come with the answer: the index is the lossless one, and the stream goes on from there
    without a duplicate or another clear."""
    stream = seeded_stream(21, 40, block_size=BS)
    payloads = stream.payloads
    unseen = len(payloads) - 3  # the batches the relay does not get: 37 and 38
    with (
        structlog.testing.capture_logs() as logs,
        relayed(ctx, serve=False, replay_timeout=TIMEOUT_S) as rig,
    ):
        publish_after_a_lost_start(rig, payloads[:unseen])
        before = deepcopy(rig.relay.subscriber.stats)
        lossy = dump_rows(rig.index)
        dropped = dict(rig.relay.workers[1].normalizer.stats)
        for payload in payloads[unseen:-1]:
            rig.publisher.publish(payload, send=False)
        rig.publisher.start_replay_thread()
        step_until(rig, lambda: rig.relay.subscriber.stats.repairs == 1)
        repaired = deepcopy(rig.relay.subscriber.stats)
        rows, found = dump_rows(rig.index), overlaps(rig.index, stream.prompts)
        rig.publisher.publish(payloads[-1])
        deliver(rig.relay, rig.source, len(payloads) - 1)
        time.sleep(0.2)
        rig.relay.step(20)  # nothing more is repaired
        final = deepcopy(rig.relay.subscriber.stats)
        after = dump_rows(rig.index)

    live = unseen - UNSENT
    assert before == SubscriberStats(messages=live, replays=1, replay_timeouts=1, lost=UNSENT)
    assert lossy != dump_rows(index_of(payloads[:unseen], worker_id=1, block_size=BS))
    assert dropped.get("orphan_parent", 0) > 0  # the loss did cost the index
    assert shape(rig.seen) == [
        ("lost", UNSENT),
        *((seq, False) for seq in range(UNSENT, unseen)),
        ("repair", 0),
        *((seq, True) for seq in range(len(payloads) - 1)),
        (len(payloads) - 1, False),
    ]
    tail = len(payloads) - 1 - unseen
    assert repaired == SubscriberStats(
        messages=live, replays=2, replay_timeouts=1, lost=UNSENT, replayed=tail, repairs=1
    )
    assert final == SubscriberStats(
        messages=live + 1, replays=2, replay_timeouts=1, lost=UNSENT, replayed=tail, repairs=1
    )
    reference = index_of(payloads[:-1], worker_id=1, block_size=BS)
    assert rows == dump_rows(reference)
    assert found == overlaps(reference, stream.prompts) and sum(1 for o in found if o) > 5
    assert after == dump_rows(index_of(payloads, worker_id=1, block_size=BS))
    assert log_fields(logs, "stream repaired", "first", "last") == [(0, unseen - 1)]


def test_a_long_poll_ends_when_a_repair_is_due(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """A repair waits for the replay back-off and a clear token, not for a message: a
    subscriber polled a minute at a time over an idle engine (a relay's heartbeats would cut
    its polls short) starts it when the back-off ends, and has it done well within the
    minute."""
    payloads = seeded_stream(23, 12, block_size=BS).payloads
    with relayed(ctx, serve=False, replay_timeout=TIMEOUT_S) as rig:
        publish_after_a_lost_start(rig, payloads)
        rig.publisher.start_replay_thread()
        started = time.monotonic()
        while rig.relay.subscriber.stats.repairs == 0 and time.monotonic() - started < 20:
            rig.relay.subscriber.poll(60_000)  # ends early on other events too: polled again
        took = time.monotonic() - started
        stats = deepcopy(rig.relay.subscriber.stats)
    assert took < 10.0
    assert stats == SubscriberStats(
        messages=len(payloads) - UNSENT,
        replays=2,
        replay_timeouts=1,
        lost=UNSENT,
        repairs=1,
    )
    assert shape(rig.seen)[-len(payloads) - 1 :] == [
        ("repair", 0),
        *((seq, True) for seq in range(len(payloads))),
    ]


def test_a_capture_of_a_repaired_stream_builds_what_the_relay_built(
    ctx: zmq.Context[zmq.Socket[bytes]], tmp_path: Path
) -> None:
    """What the subscriber handed out across a loss and its repair, written to a capture as
    ``kvbridge record`` writes it, resets included, and read back through a pipeline: the same
    index and the same drop counts as the relay's. (Without the reset records the repaired
    batches would be applied a second time over the first.)"""
    payloads = seeded_stream(21, 40, block_size=BS).payloads
    path = tmp_path / "repaired.kvcap"
    with relayed(ctx, serve=False, replay_timeout=TIMEOUT_S) as rig:
        publish_after_a_lost_start(rig, payloads)
        rig.publisher.start_replay_thread()
        step_until(rig, lambda: rig.relay.subscriber.stats.repairs == 1)
        relayed_rows = dump_rows(rig.index)
        relayed_drops = dict(rig.relay.workers[1].normalizer.stats)
        with CaptureWriter(path) as capture:
            for item in rig.seen:
                capture.write_item(item)
        written = (capture.count, capture.resets)

    index = TieredIndex(BS)
    pipeline = StreamPipeline(BS, sinks=[IndexSink(index)])
    for record in CaptureReader(path):
        pipeline.feed_record(record)
    assert written == (len(payloads) - UNSENT + len(payloads), 2)  # live, repaired; lost, repair
    assert [r.reset.reason for r in CaptureReader(path) if r.reset] == ["lost", "repair"]
    assert (
        dump_rows(index)
        == relayed_rows
        == dump_rows(index_of(payloads, worker_id=1, block_size=BS))
    )
    assert dict(pipeline.workers[1].normalizer.stats) == relayed_drops
    assert relayed_drops.get("orphan_parent", 0) > 0  # the loss, before its repair


def test_a_later_loss_the_engine_still_holds_is_repaired_when_the_earliest_is_gone(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """Two losses whose replays go unanswered: batches 0-5 at the start and batch 20. By the
    time the engine answers, its buffer (12 batches) holds 18-29: not the first loss, but the
    second. The stream is repaired from 18: a clear, then 18-29 again; the loss of 0-5 alone
    stays lost, and the chains through batch 20 are known again."""
    stream = seeded_stream(24, 30, block_size=BS)
    payloads = stream.payloads
    second = 20
    with (
        structlog.testing.capture_logs() as logs,
        relayed(ctx, serve=False, buffer_steps=12, replay_timeout=TIMEOUT_S) as rig,
    ):
        publish_after_a_lost_start(rig, payloads[:second])
        rig.publisher.publish(payloads[second], send=False)
        for seq in range(second + 1, len(payloads)):
            rig.publisher.publish(payloads[seq])
            deliver(rig.relay, rig.source, seq)
        before = overlaps(rig.index, stream.prompts)
        rig.publisher.start_replay_thread()
        step_until(rig, lambda: rig.relay.subscriber.stats.repairs == 1)
        after = overlaps(rig.index, stream.prompts)
        stats = deepcopy(rig.relay.subscriber.stats)

    held = len(payloads) - 12
    assert shape(rig.seen) == [
        ("lost", UNSENT),
        *((seq, False) for seq in range(UNSENT, second)),
        ("lost", 1),
        *((seq, False) for seq in range(second + 1, len(payloads))),
        ("repair", 0),
        *((seq, True) for seq in range(held, len(payloads))),
    ]
    assert (stats.lost, stats.repairs, stats.replayed) == (UNSENT + 1, 1, 0)
    assert log_fields(logs, "stream repaired", "first", "last", "not_restored") == [
        (held, len(payloads) - 1, f"0-{held - 1}")
    ]
    # Prompt 10's chain runs through batch 20: found whole again. Prompt 5's is longer on the
    # device tier than before; the rest reach back to blocks only the lost batches 0-5 hold.
    reference = overlaps(index_of(payloads, worker_id=1, block_size=BS), stream.prompts)
    assert [i for i, (o, r) in enumerate(zip(before, reference, strict=True)) if o == r] == [11]
    assert [i for i, (o, r) in enumerate(zip(after, reference, strict=True)) if o == r] == [10, 11]
    assert (before[5], after[5], reference[5]) == (
        {(1, 0): (0, 2, 2)},
        {(1, 0): (2, 2, 2)},
        {(1, 0): (4, 4, 4)},
    )


def test_a_loss_the_engine_no_longer_holds_is_not_repaired(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """The engine answers at last, but its buffer no longer holds the first lost batch: nothing
    is cleared, the repair is given up, and it is not asked for again."""
    stream = seeded_stream(22, 20, block_size=BS)
    payloads = stream.payloads
    with (
        structlog.testing.capture_logs() as logs,
        relayed(ctx, serve=False, buffer_steps=4, replay_timeout=TIMEOUT_S) as rig,
    ):
        publish_after_a_lost_start(rig, payloads)
        rows = dump_rows(rig.index)
        rig.publisher.start_replay_thread()
        step_until(rig, lambda: rig.relay.subscriber.stats.replays == 2)
        time.sleep(2 * TIMEOUT_S)  # past the back-off: not asked again
        rig.relay.step(20)
        final = deepcopy(rig.relay.subscriber.stats)
        after = dump_rows(rig.index)

    live = len(payloads) - UNSENT
    assert shape(rig.seen) == [("lost", UNSENT), *((seq, False) for seq in range(UNSENT, 20))]
    assert final == SubscriberStats(messages=live, replays=2, replay_timeouts=1, lost=UNSENT)
    assert after == rows
    assert log_fields(logs, "loss not repairable", "first", "last") == [(0, 19)]


def test_a_repair_that_goes_unanswered_is_given_up_after_its_tries(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """An engine whose replay socket never answers: the repair of its lost start is tried once
    per back-off (each try a timeout that doubles the back-off), :data:`REPAIR_TRIES` times,
    then given up; the source is not asked again, and nothing is cleared."""
    payloads = seeded_stream(23, 4, block_size=BS).payloads
    publisher, source = engine_publisher(ctx, serve=False)
    timeout = 0.05
    with (
        structlog.testing.capture_logs() as logs,
        publisher,
        Subscriber([source], context=ctx, replay_timeout=timeout) as subscriber,
    ):
        assert publisher.wait_for_subscribers(timeout=TIMEOUT)
        for payload in payloads[:3]:
            publisher.publish(payload, send=False)
        publisher.publish(payloads[3])
        items = receive(subscriber, 1)
        stats = subscriber.stats
        tries = sum(timeout * 2**n for n in range(REPAIR_TRIES + 1))  # back-offs and timeouts
        items += poll_for(subscriber, 2 * tries)
        final = deepcopy(stats)

    assert shape(items) == [("lost", 3), (3, False)]
    attempts = 1 + REPAIR_TRIES  # the start's replay, then the repair's tries
    assert final == SubscriberStats(messages=1, replays=attempts, replay_timeouts=attempts, lost=3)
    assert log_fields(logs, "loss not repairable", "first", "last", "why") == [(0, 3, "unanswered")]


def test_a_new_process_found_as_a_suspended_stream_starts_over_is_not_repaired(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """An engine whose replay never answers loses batches 1-2 (a repair from 1 waits), then
    4-5, which find no clear token: the stream is suspended. The engine is replaced by a new
    process, found as the stream starts over on its release: its batches are replayed from 0,
    and the old process's repair is dropped, since a repair from 1 would clear the new one's
    batch 0."""
    base = free_port_range(2)
    source = Source(f"tcp://*:{base}", f"tcp://*:{base + 1}", 1)
    first = engine_on(ctx, base, serve=False)()
    with Subscriber(
        [source], context=ctx, clear_burst=1, clear_interval=2.0, replay_timeout=0.2
    ) as subscriber:
        stats = subscriber.stats
        assert first.wait_for_subscribers(timeout=TIMEOUT)
        items = suspend_after_two_losses(subscriber, first, source, 2)  # batches 1-2 and 4-5
        first.close()
        listener_gone(base)
        items += poll_until(subscriber, lambda: stats.disconnects)
        with bound_again(engine_on(ctx, base)) as second:
            for seq in range(10):
                second.publish(b"new %d" % seq, send=False)
            assert second.wait_for_subscribers(timeout=TIMEOUT)
            # Released: the drop ended the back-off, so the publisher is checked and the new
            # process replayed from 0 at once.
            items += poll_until(subscriber, lambda: subscriber.last_seq(source) == 9)
            second.publish(b"new 10")
            items += poll_until(subscriber, lambda: subscriber.last_seq(source) == 10)
            items += poll_for(subscriber, 2.5)  # past the back-off and a new token: no repair
        final = deepcopy(stats)

    assert shape(items) == [
        (0, False),
        ("lost", 2),
        (3, False),
        ("lost", 0),
        *((seq, True) for seq in range(10)),
        (10, False),
    ]
    replayed = [item.payload for item in items if isinstance(item, Message) and item.replayed]
    assert replayed == [b"new %d" % seq for seq in range(10)]
    assert final.repairs == 0
