"""ZMQ socket monitors: what happened to a socket's connections, read without waiting, and
how a monitor is closed before its socket.

The subscriber watches each SUB socket for drops and handshakes (see
:mod:`~kvbridge.adapters.sub_socket`) and each replay DEALER for drops and the reconnects
after them (see :mod:`~kvbridge.adapters.replay_answer`); a publisher watches its PUB for its
subscribers.
"""

from __future__ import annotations

import contextlib

import zmq
from zmq.utils.monitor import parse_monitor_message

__all__ = ["close_monitor", "monitor_events"]


def monitor_events(monitor: zmq.Socket[bytes]) -> list[int]:
    """The events (``zmq.EVENT_*``) that ``monitor`` holds, oldest first, read without
    waiting."""
    events: list[int] = []
    while True:
        try:
            frames = monitor.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return events
        events.append(parse_monitor_message(frames)["event"])


def close_monitor(socket: zmq.Socket[bytes], monitor: zmq.Socket[bytes]) -> None:
    """Stop ``socket``'s monitor and close it; before ``socket`` is closed, since pyzmq names a
    monitor's endpoint after its socket's descriptor, which a new socket may get next."""
    with contextlib.suppress(zmq.ZMQError):  # the socket is closed already
        socket.disable_monitor()
    monitor.close(0)
