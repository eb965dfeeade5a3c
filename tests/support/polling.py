"""Polling a subscriber in a test until what it hands out shows what the test waits for."""

from __future__ import annotations

import time
from collections.abc import Callable

from kvbridge.adapters.source import Message, StreamReset
from kvbridge.adapters.subscriber import Subscriber

__all__ = [
    "TIMEOUT",
    "poll_for",
    "poll_until",
    "receive",
    "shape",
    "wait_until",
]

TIMEOUT = 5.0
"""Seconds a test waits for anything over loopback."""

BOUND_SUB_SETTLE = 0.5
"""Seconds a bound SUB is polled after a peer's handshake before the peer publishes
(:func:`poll_for`). With both cores busy, stopping at the first empty poll lost the first
batches in 6 runs of 15; this lost none in 15."""


def receive(subscriber: Subscriber, count: int) -> list[Message | StreamReset]:
    """Poll until ``count`` messages (resets not counted) have come out."""
    items: list[Message | StreamReset] = []
    deadline = time.monotonic() + TIMEOUT
    while sum(isinstance(item, Message) for item in items) < count:
        assert time.monotonic() < deadline, f"only {items} arrived"
        items.extend(subscriber.poll(20))
    return items


def wait_until(
    done: Callable[[], object],
    step: Callable[[], object],
    seen: Callable[[], object] = lambda: "",
    *,
    timeout: float = TIMEOUT,
) -> None:
    """Call ``step()`` until ``done()`` is true, for up to ``timeout`` seconds; past that,
    fail with what ``seen()`` says."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, seen()
        step()


def poll_until(
    subscriber: Subscriber, done: Callable[[], object], *, timeout: float = TIMEOUT
) -> list[Message | StreamReset]:
    """Poll until ``done()`` is true; what came out meanwhile."""
    items: list[Message | StreamReset] = []

    def step() -> None:
        items.extend(subscriber.poll(20))

    wait_until(done, step, lambda: (shape(items[-20:]), subscriber.stats), timeout=timeout)
    return items


def poll_for(
    subscriber: Subscriber, seconds: float = BOUND_SUB_SETTLE
) -> list[Message | StreamReset]:
    """Poll for ``seconds``; what came out meanwhile.

    A bound SUB sends its subscription to a new peer only when its thread polls, and the
    peer's handshake (which :meth:`~kvbridge.adapters.publisher.Publisher.wait_for_subscribers`
    waits for) can come before that: what the peer publishes before the subscription reaches
    it is dropped. A PUB cannot tell when it has, so a test polls for a while first."""
    deadline = time.monotonic() + seconds
    return poll_until(subscriber, lambda: time.monotonic() >= deadline, timeout=seconds + TIMEOUT)


def shape(items: list[Message | StreamReset]) -> list[tuple[object, ...]]:
    """Items reduced to what the tests compare: (seq, replayed) or (reason, lost_batches)."""
    return [
        (item.seq, item.replayed) if isinstance(item, Message) else (item.reason, item.lost_batches)
        for item in items
    ]
