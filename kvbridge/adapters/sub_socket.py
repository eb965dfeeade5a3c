"""A subscriber's SUB socket: how it is opened, how a message is read off it without waiting,
and what its monitor says about its connection.

The subscriber watches each SUB socket (a ZMQ socket monitor) for two things: a drop, after
which the publisher must be checked and the socket may be reopened, and a completed handshake
after that, when the socket receives again and what the drop cost can be replayed at once (see
:meth:`~kvbridge.adapters.sequencing.Sequencer.catch_up`).
"""

from __future__ import annotations

from typing import Final, NamedTuple

import zmq

from kvbridge.adapters.monitors import monitor_events

__all__ = [
    "HEARTBEAT_IVL_MS",
    "HEARTBEAT_TIMEOUT_MS",
    "WATCHED",
    "ConnectionEvents",
    "open_sub",
    "read_events",
    "recv_frames",
]

HEARTBEAT_IVL_MS: Final = 2000
HEARTBEAT_TIMEOUT_MS: Final = 6000
"""ZMTP pings on every SUB: a publisher that stops answering (its host gone, no FIN) is
dropped after this, and the drop is handled as any other (see the subscriber's "reconnects")."""
WATCHED: Final = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
"""The events a SUB socket's monitor reports."""

_NOBLOCK: Final = int(zmq.NOBLOCK)


def open_sub(
    context: zmq.Context[zmq.Socket[bytes]], topic: str, *, rcvhwm: int, maxmsgsize: int
) -> zmq.Socket[bytes]:
    """A SUB socket subscribed to ``topic``, with the subscriber's bounds and heartbeats, not
    yet bound or connected."""
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.RCVHWM, rcvhwm)
    socket.setsockopt(zmq.MAXMSGSIZE, maxmsgsize)
    socket.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    socket.setsockopt(zmq.SUBSCRIBE, topic.encode())
    return socket


def recv_frames(socket: zmq.Socket[bytes]) -> list[bytes] | None:
    """``socket.recv_multipart(zmq.NOBLOCK)``, or ``None`` if no message waits, in half the
    time: pyzmq's version asks for ``RCVMORE`` with a ``getsockopt`` per frame, where a
    frame knows it (``Frame.more``); the bytes are the same copies."""
    try:
        frame = socket.recv(_NOBLOCK, copy=False)
    except zmq.Again:
        return None
    frames = [frame.bytes]
    while frame.more:  # the rest of a multipart message is already there: no Again
        frame = socket.recv(_NOBLOCK, copy=False)
        frames.append(frame.bytes)
    return frames


class ConnectionEvents(NamedTuple):
    """What a SUB socket's monitor reported since it was last read."""

    drops: int
    """Connections that dropped."""
    connected: bool
    """A handshake completed after the last drop (or with no drop): the socket receives."""


def read_events(monitor: zmq.Socket[bytes]) -> ConnectionEvents:
    """Every event ``monitor`` holds, read without waiting."""
    drops, connected = 0, False
    for event in monitor_events(monitor):
        if event == zmq.EVENT_DISCONNECTED:
            drops, connected = drops + 1, False
        else:
            connected = True
    return ConnectionEvents(drops, connected)
