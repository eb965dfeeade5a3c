"""Binding a publisher again on the ports of one just closed, as a restarted engine does."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import TypeVar

import zmq

from kvbridge.adapters.publisher import DEFAULT_BUFFER_STEPS, Publisher

__all__ = ["bound_again", "engine_on", "listener_gone"]

Bound = TypeVar("Bound")


def engine_on(
    ctx: zmq.Context[zmq.Socket[bytes]],
    base: int,
    *,
    serve: bool = True,
    buffer_steps: int = DEFAULT_BUFFER_STEPS,
) -> Callable[[], Publisher]:
    """A factory of engines on fixed ports, publishing on ``base`` with its replay socket on
    ``base + 1``, so that a test can close one and bind its successor where the first was.
    ``serve=False`` binds the replay socket and never answers it."""

    def engine() -> Publisher:
        made = Publisher(
            f"tcp://127.0.0.1:{base}",
            bind=True,
            replay_endpoint=f"tcp://127.0.0.1:{base + 1}",
            buffer_steps=buffer_steps,
            context=ctx,
        )
        if serve:
            made.start_replay_thread()
        return made

    return engine


def bound_again(make: Callable[[], Bound], timeout: float = 5.0) -> Bound:
    """``make()`` of a publisher (or socket) on the ports of one just closed, retried for up to ``timeout``
    seconds while they are still held: ZMQ closes a socket in its I/O thread, after ``close``
    returns."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return make()
        except zmq.ZMQError as error:
            if error.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def listener_gone(port: int, timeout: float = 5.0) -> None:
    """Until nothing listens on ``port`` of 127.0.0.1: after a publisher's ``close``, ZMQ's I/O
    thread still holds its listener for a moment, and a subscriber that reopens its SUB on the
    drop (at once) would connect to it and be dropped again, a second disconnect that takes
    whatever the new SUB had queued. A test waits for this before it lets the subscriber see
    the drop."""
    deadline = time.monotonic() + timeout
    while True:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) != 0:
                return
        assert time.monotonic() < deadline, f"port {port} still listened on"
        time.sleep(0.01)
