"""Polling a subscriber in a test until what it hands out shows what the test waits for."""

from __future__ import annotations

import time
from collections.abc import Callable

from kvbridge.adapters.source import Message, StreamReset
from kvbridge.adapters.subscriber import Subscriber

__all__ = ["TIMEOUT", "poll_until", "receive", "shape", "wait_until"]

TIMEOUT = 5.0
"""Seconds a test waits for anything over loopback."""


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


def shape(items: list[Message | StreamReset]) -> list[tuple[object, ...]]:
    """Items reduced to what the tests compare: (seq, replayed) or (reason, lost_batches)."""
    return [
        (item.seq, item.replayed) if isinstance(item, Message) else (item.reason, item.lost_batches)
        for item in items
    ]
