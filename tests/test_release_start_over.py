"""A suspended stream's release starts it over at once, from the engine's replay
(``StartOver.released``), and what comes after that start-over: another restart of
the engine, and a drop while the stream was suspended. The tests of the release itself (its
clear, its run, its losses) are with the subscriber's in ``test_subscriber.py`` and
``test_replay_answers.py``."""

from __future__ import annotations

from collections import Counter
from copy import deepcopy

import zmq
from support.polling import TIMEOUT, poll_until, receive, shape, wait_until
from support.rebind import bound_again, engine_on, listener_gone
from support.reference import overlaps
from support.relayed import deliver, relayed, restarted_in_place, six_prompts
from support.scripted_replays import ScriptedReplays

from kvbridge.adapters.ports import free_port_range
from kvbridge.adapters.source import Message, Source
from kvbridge.adapters.stream_stats import BadFrame, SubscriberStats
from kvbridge.adapters.subscriber import Subscriber


def test_a_restart_after_a_released_streams_start_over_is_a_restart(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """Four restarts in place (the sequence back to 0, no drop) spend the clear tokens and
    suspend the stream; its release replays the fourth process's batch 0, which its live copy
    had been skipped for. The engine then restarts again, its new batch 0 the next message: a
    restart, not a late copy of the replayed batch 0, so the fourth process's block goes and the
    fifth's is indexed once its clear is allowed. (Taken for a copy, the fourth's block would
    stay, and the fifth's batch would be dropped uncounted.)"""
    interval = 3.0
    prompts, payloads = six_prompts()
    with relayed(ctx, clear_interval=interval) as (publisher, source, relay, index, _):
        stats = relay.subscriber.stats
        deliver(relay, source, publisher.publish(payloads[0]))
        restarted_in_place(relay, publisher, payloads[1:5])
        assert relay.subscriber.suspended(source)
        wait_until(
            lambda: overlaps(index, prompts[4:5]) == [{(1, 0): (3, 3, 3)}],
            lambda: relay.step(20),
            lambda: "the release did not replay the fourth process's batch",
            timeout=interval + TIMEOUT,
        )
        publisher.restart()  # in place again, while quiet
        assert publisher.publish(payloads[5]) == 0
        wait_until(lambda: stats.messages == 6, lambda: relay.step(20), lambda: stats)
        assert stats.duplicates == 0
        wait_until(
            lambda: overlaps(index, prompts[4:6]) == [{}, {(1, 0): (3, 3, 3)}],
            lambda: relay.step(20),
            lambda: ("the fourth process's block stayed, or the fifth's is missing", stats),
            timeout=2 * interval + TIMEOUT,
        )
        assert stats.restarts == 5


def test_a_release_after_a_drop_replays_a_quiet_new_process(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """The engine is replaced twice: the first new process spends the one clear token, the
    second suspends the stream. A third replaces it while the stream is suspended (a drop,
    whose catch-up waits for the suspension), sends two batches that the stream misses and goes
    quiet. The release replays them from 0 at once: the drop needs no publisher check, since a
    restart's start-over takes everything from 0 of whatever process is there."""
    base = free_port_range(2)
    source = Source(f"tcp://*:{base}", f"tcp://*:{base + 1}", 1)
    engine = engine_on(ctx, base)
    first = engine()
    with Subscriber([source], context=ctx, clear_burst=1, clear_interval=3.0) as subscriber:
        stats = subscriber.stats
        assert first.wait_for_subscribers(timeout=TIMEOUT)
        first.publish(b"first 0")
        items = receive(subscriber, 1)
        previous = first
        for drops, tag in enumerate((b"second", b"third"), start=1):
            previous.close()
            listener_gone(base)
            items += poll_until(subscriber, lambda n=drops: stats.disconnects == n)
            previous = bound_again(engine)
            previous.publish(tag + b" 0", send=False)
            assert previous.wait_for_subscribers(timeout=TIMEOUT)
            if drops == 1:  # a restart, its clear the token, then its batch replayed from 0
                # (closed before that answer, the engine leaves its replay to time out)
                items += poll_until(subscriber, lambda: stats.restarts == stats.replayed == 1)
            else:  # no token left: suspended
                items += poll_until(subscriber, lambda: subscriber.suspended(source))
        previous.close()
        listener_gone(base)
        items += poll_until(subscriber, lambda: stats.disconnects == 3)
        with bound_again(engine) as fourth:
            fourth.publish(b"fourth 0", send=False)
            fourth.publish(b"fourth 1", send=False)
            assert fourth.wait_for_subscribers(timeout=TIMEOUT)
            items += poll_until(subscriber, lambda: not subscriber.suspended(source))
            items += poll_until(subscriber, lambda: subscriber.last_seq(source) == 1)

    delivered = [item.payload for item in items if isinstance(item, Message)]
    assert delivered == [b"first 0", b"second 0", b"fourth 0", b"fourth 1"]
    assert stats.restarts == 2


def test_a_release_past_max_gap_asks_for_no_replay(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """With ``max_gap`` 3 and a replay buffer of two batches, the loss of 1 and 2 spends the one
    clear token, and that of 5 and 6 suspends the stream, whose live 8, 9 and 10 are skipped.
    Released, the stream has skipped past ``max_gap`` from the loss (10 - 5): as for a jump,
    its start-over replays nothing, and no replay is asked for on release. Its next message,
    11, goes on."""
    base = free_port_range(2)
    source = Source(f"tcp://*:{base}", f"tcp://*:{base + 1}", 1)
    with (
        engine_on(ctx, base, buffer_steps=2)() as engine,
        Subscriber(
            [source], context=ctx, clear_burst=1, clear_interval=3.0, max_gap=3
        ) as subscriber,
    ):
        stats = subscriber.stats
        assert engine.wait_for_subscribers(timeout=TIMEOUT)
        engine.publish(b"batch 0")
        items = receive(subscriber, 1)
        for seq in (1, 2, 3):
            engine.publish(b"batch %d" % seq, send=False)
        engine.publish(b"batch 4")
        items += poll_until(subscriber, lambda: subscriber.last_seq(source) == 4)
        for seq in (5, 6, 7):
            engine.publish(b"batch %d" % seq, send=False)
        engine.publish(b"batch 8")
        items += poll_until(subscriber, lambda: subscriber.suspended(source))
        for seq in (9, 10):
            engine.publish(b"batch %d" % seq)
        items += poll_until(subscriber, lambda: stats.bad_frames[BadFrame.THROTTLED] == 3)
        assert stats.replays == 2
        items += poll_until(subscriber, lambda: stats.resyncs == 1, timeout=2 * TIMEOUT)
        engine.publish(b"batch 11")
        items += poll_until(subscriber, lambda: subscriber.last_seq(source) == 11)

    assert stats.replays == 2
    assert [item.seq for item in items if isinstance(item, Message)] == [0, 3, 4, 11]


def test_a_release_before_the_reconnect_leaves_the_catch_up_to_the_handshake(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """A loss suspends the stream from 3; then its SUB's connection drops while the engine and
    its replay socket go on (the PUB unbound), and the release comes before the SUB is
    connected again: it checks the publisher (the same) and delivers 4. Batch 5, sent while no
    SUB is connected, is taken by the catch-up that follows the handshake, not left until the
    engine sends again."""
    base = free_port_range(2)
    source = Source(f"tcp://*:{base}", f"tcp://*:{base + 1}", 1)
    address = f"tcp://127.0.0.1:{base}"
    with (
        engine_on(ctx, base)() as engine,
        Subscriber([source], context=ctx, clear_burst=1, clear_interval=2.0) as subscriber,
    ):
        stats = subscriber.stats
        assert engine.wait_for_subscribers(timeout=TIMEOUT)
        engine.publish(b"batch 0")
        items = receive(subscriber, 1)
        engine.publish(b"batch 2", seq=2)  # 1 never was: a loss, its clear the token
        items += poll_until(subscriber, lambda: subscriber.last_seq(source) == 2)
        engine.publish(b"batch 4", seq=4)  # 3 never was: no token, suspended from 3
        items += poll_until(subscriber, lambda: subscriber.suspended(source))
        # The engine's PUB socket replaced (a test double of a connection lost while the
        # engine goes on): the SUB's connection drops, the replay buffer and socket stay.
        assert engine._pub is not None
        engine._pub.close(0)
        listener_gone(base)
        engine._pub = ctx.socket(zmq.PUB)
        items += poll_until(subscriber, lambda: stats.disconnects == 1)
        items += poll_until(
            subscriber, lambda: subscriber.last_seq(source) == 4, timeout=2 * TIMEOUT
        )
        engine.publish(b"batch 5")  # no SUB connected: the PUB drops it
        engine._pub.bind(address)
        items += poll_until(subscriber, lambda: subscriber.last_seq(source) == 5)

    delivered = [(item.seq, item.payload) for item in items if isinstance(item, Message)]
    assert delivered == [(0, b"batch 0"), (2, b"batch 2"), (4, b"batch 4"), (5, b"batch 5")]
    assert (stats.lost, stats.restarts, stats.reconnect_checks) == (2, 0, 2)


def test_a_drop_during_a_released_streams_replay_starts_it_over_within_the_back_off(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """The engine is replaced twice: the first new process spends the one clear token, the
    second suspends the stream. Its release asks for the replay to start over from, which is
    never answered; the connection drops while it waits, and a third process, which holds a
    batch the stream never heard, stays quiet. The replay's timeout, after the drop, begins a
    back-off, but the drop's catch-up still starts the stream over from the third process's
    replay: the timeout said nothing of it, and no later catch-up would come. The engines are
    bare PUBs; their replay endpoint is the test's own ROUTER, which answers every request but
    the fourth, the release's."""
    # batch 0 of the process there, by request: two checks, a replay from 0, the release's
    answers = {1: [b"second 0"], 2: [b"second 0"], 3: [b"third 0"], 5: [b"fourth 0"]}
    replays = ScriptedReplays(ctx, free_port_range(2), answers)
    source = replays.source
    with Subscriber(
        [source], context=ctx, clear_burst=1, clear_interval=2.0, replay_timeout=1.0
    ) as subscriber:
        stats = subscriber.stats
        items, step = replays.first_batch(subscriber)
        replays.replace(stats, step)  # a restart, its clear the token, its batch replayed from 0
        wait_until(lambda: stats.replayed == 1, step)
        replays.replace(stats, step)  # no token left: suspended until the release asks
        wait_until(lambda: subscriber.suspended(source), step)
        wait_until(lambda: replays.requests == 4, step, timeout=2.0 + TIMEOUT)
        replays.replace(stats, step)
        assert stats.replay_timeouts == 0  # the drop came first
        wait_until(lambda: stats.replayed == 2, step, lambda: (shape(items), stats), timeout=3.0)
        final = deepcopy(stats)
    replays.close()

    assert [item.payload for item in items if isinstance(item, Message)] == [
        b"first 0",
        b"second 0",
        b"fourth 0",
    ]
    assert shape(items) == [(0, False), ("restart", 0), (0, True), ("restart", 0), (0, True)]
    assert final == SubscriberStats(
        messages=1,
        restarts=2,
        disconnects=3,
        reconnect_checks=2,
        replays=5,
        replayed=2,
        replay_timeouts=1,
        bad_frames=Counter(),
    )
