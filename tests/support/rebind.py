"""Binding a publisher again on the ports of one just closed, as a restarted engine does."""

from __future__ import annotations

import time
from collections.abc import Callable

import zmq

from kvbridge.adapters.publisher import Publisher

__all__ = ["bound_again"]


def bound_again(make: Callable[[], Publisher], timeout: float = 5.0) -> Publisher:
    """``make()`` of a publisher on the ports of one just closed, retried for up to ``timeout``
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
