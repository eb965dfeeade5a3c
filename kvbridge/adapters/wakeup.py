"""Ending another thread's ZMQ poll at once.

A loop that polls ZMQ sockets with a timeout sees a stop, or work another thread queued for
it, only when its poll returns: up to the whole timeout later. A :class:`Wakeup` is a socket
pair whose read end sits in the loop's poller beside its ZMQ sockets; :meth:`Wakeup.wake`,
from any thread, makes the poll return at once. (A ZMQ socket cannot do this: it may not be
used by two threads.)
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterable

import zmq

__all__ = ["Wakeup"]


class Wakeup:
    """A socket pair registered in ``poller``: :meth:`wake` ends the poll that waits on it."""

    def __init__(self, poller: zmq.Poller) -> None:
        self._read, self._write = socket.socketpair()
        self._read.setblocking(False)
        self._write.setblocking(False)
        self.fd = self._read.fileno()
        """What a poll's events name when :meth:`wake` ended it."""
        self._poller = poller
        poller.register(self.fd, zmq.POLLIN)

    def wake(self) -> None:
        """End the current or next poll. Safe from any thread, never blocks, and does nothing
        once closed."""
        # A full buffer means wake-ups are pending already.
        with contextlib.suppress(OSError):
            self._write.send(b"\0")

    def woken(self, events: Iterable[tuple[object, int]]) -> bool:
        """Whether a poll's ``events`` include a wake-up; if so, the pending ones are taken,
        so that the next poll waits again."""
        if not any(fd == self.fd for fd, _ in events):
            return False
        with contextlib.suppress(OSError):
            while self._read.recv(4096):
                pass
        return True

    def close(self) -> None:
        """Take it out of the poller and close both ends. Idempotent."""
        self._poller.register(self.fd, 0)  # unregistered, if it is registered
        self._read.close()
        self._write.close()
