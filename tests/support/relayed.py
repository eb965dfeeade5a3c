"""An engine publisher on 127.0.0.1 and a relay with an in-process index consuming it: the
rig of the subscriber's and the relay's tests over real sockets."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import zmq

from kvbridge import TieredIndex
from kvbridge.adapters.publisher import Publisher
from kvbridge.adapters.relay import Relay
from kvbridge.adapters.source import Message, Source, StreamReset
from kvbridge.adapters.stream_stats import BadFrame
from kvbridge.adapters.subscriber import (
    DEFAULT_CLEAR_INTERVAL_S,
    DEFAULT_REPLAY_TIMEOUT_S,
    Subscriber,
)
from kvbridge.testing.events import TS0, encoded, stored
from kvbridge.testing.vllm_hashes import block_hashes
from support.polling import TIMEOUT, poll_until, receive, wait_until

BS = 4
"""The block size of the relays made here."""
LOCAL = "tcp://127.0.0.1:0"


def port_of(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def engine_publisher(
    ctx: zmq.Context[zmq.Socket[bytes]],
    *,
    replay: bool = True,
    serve: bool = True,
    buffer_steps: int = 10_000,
    replay_topic_frame: bool = True,
) -> tuple[Publisher, Source]:
    """A publisher bound on 127.0.0.1 (its replay thread running, unless not ``serve``: a
    replay socket bound and not read yet), and the Source vLLM's config would give for it:
    ``tcp://*:P``, so the subscriber connects."""
    publisher = Publisher(
        LOCAL,
        bind=True,
        replay_endpoint=LOCAL if replay else None,
        buffer_steps=buffer_steps,
        replay_topic_frame=replay_topic_frame,
        context=ctx,
    )
    if replay and serve:
        publisher.start_replay_thread()
    source = Source(f"tcp://*:{port_of(publisher.endpoint)}", publisher.replay_endpoint, 1)
    return publisher, source


def spy(subscriber: Subscriber) -> list[Message | StreamReset]:
    """Record everything ``subscriber.poll`` hands out, in order."""
    seen: list[Message | StreamReset] = []
    poll = subscriber.poll

    def recording_poll(timeout_ms: int = 100) -> list[Message | StreamReset]:
        items = poll(timeout_ms)
        seen.extend(items)
        return items

    subscriber.poll = recording_poll  # type: ignore[method-assign]
    return seen


class Relayed(NamedTuple):
    """What :func:`relayed` sets up."""

    publisher: Publisher
    source: Source
    relay: Relay
    index: TieredIndex
    seen: list[Message | StreamReset]
    """Everything the relay's subscriber handed out (:func:`spy`)."""


@contextmanager
def relayed(
    ctx: zmq.Context[zmq.Socket[bytes]],
    *,
    clear_interval: float = DEFAULT_CLEAR_INTERVAL_S,
    replay_timeout: float = DEFAULT_REPLAY_TIMEOUT_S,
    **options: Any,
) -> Iterator[Relayed]:
    """An engine publisher (:func:`engine_publisher` with ``options``) and a relay with an
    in-process index consuming it, once the publisher sees the subscription; closed on exit."""
    publisher, source = engine_publisher(ctx, **options)
    index = TieredIndex(BS)
    with (
        publisher,
        Relay(
            [source],
            block_size=BS,
            index=index,
            context=ctx,
            clear_interval=clear_interval,
            replay_timeout=replay_timeout,
        ) as relay,
    ):
        seen = spy(relay.subscriber)
        assert publisher.wait_for_subscribers(timeout=TIMEOUT)
        yield Relayed(publisher, source, relay, index, seen)


def deliver(relay: Relay, source: Source, seq: int) -> None:
    """Step the relay until it has seen ``seq`` from ``source``."""
    wait_until(
        lambda: relay.subscriber.last_seq(source) == seq,
        lambda: relay.step(20),
        lambda: f"seq {seq} never arrived",
    )


def suspend_after_two_losses(
    subscriber: Subscriber, engine: Publisher, source: Source, lost: int
) -> list[Message | StreamReset]:
    """Batch 0, then twice ``lost`` batches into the engine's buffer only, each followed by a
    batch that shows the gap: the first loss takes the stream's one clear token, the second
    finds none and suspends the stream. What the subscriber handed out meanwhile."""
    engine.publish(b"old 0")
    items = receive(subscriber, 1)
    for lost_from in (1, 2 + lost):
        for seq in range(lost_from, lost_from + lost):
            engine.publish(b"old %d" % seq, send=False)
        engine.publish(b"old %d" % (lost_from + lost))
        if lost_from == 1:  # until the first gap's replay is over
            items += poll_until(subscriber, lambda: subscriber.last_seq(source) == 1 + lost)
    items += poll_until(subscriber, lambda: subscriber.suspended(source))
    return items


def restarted_in_place(relay: Relay, engine: Publisher, payloads: list[bytes]) -> None:
    """Restart ``engine`` in place (its sequence back to 0, its connection kept) once for each
    of ``payloads``, which is the new process's batch 0, and step ``relay`` until it has
    counted each restart, or skipped its batch while out of clear tokens."""
    stats = relay.subscriber.stats
    done = stats.restarts + stats.bad_frames[BadFrame.THROTTLED]
    for restarts, payload in enumerate(payloads, start=done + 1):
        engine.restart()
        assert engine.publish(payload) == 0
        wait_until(
            lambda n=restarts: stats.restarts + stats.bad_frames[BadFrame.THROTTLED] >= n,
            lambda: relay.step(20),
            lambda: stats,
        )


def six_prompts() -> tuple[list[list[int]], list[bytes]]:
    """Six prompts of 12 tokens (three blocks each, none shared), and for each a payload that
    stores its blocks, a second after the one before."""
    prompts = [list(range(k * 100, k * 100 + 12)) for k in range(1, 7)]
    payloads = [
        encoded([stored(block_hashes(p, BS), p)], ts=TS0 + i) for i, p in enumerate(prompts)
    ]
    return prompts, payloads
