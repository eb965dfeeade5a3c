"""ZMQ socket monitors: opened so that they can never stop a context, read without waiting,
and closed before their socket.

ZMQ's I/O thread sends each monitor event with a blocking send. A monitor that is not read
while its queue is at its high-water mark (about 2,000 events at ZMQ's defaults) would stop
that thread, and with it every socket of the context: a publisher whose consumers came and
went a thousand times, or a replay DEALER of an engine that stays down (ZMQ reports a
reconnect attempt several times a second). So a monitor's queue is unbounded
(:func:`watch`), and each is read where its socket is used: the subscriber's SUB monitors on
every poll that finds them ready (see :mod:`~kvbridge.adapters.sub_socket`), a replay
DEALER's while its one answer is read (see :mod:`~kvbridge.adapters.replay_answer`), and a
publisher's as it publishes.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Final

import zmq
from zmq.utils.monitor import parse_monitor_message

__all__ = ["close_monitor", "monitor_events", "watch"]

_names: Final = itertools.count()


def watch(socket: zmq.Socket[bytes], events: int) -> zmq.Socket[bytes]:
    """A monitor of ``socket`` that reports ``events`` (``zmq.EVENT_*``) and queues them
    without bound until read. Call it from the thread that uses ``socket``."""
    address = f"inproc://kvbridge-monitor-{next(_names)}"
    socket.monitor(address, events)
    monitor: zmq.Socket[bytes] = socket.context.socket(zmq.PAIR)
    monitor.setsockopt(zmq.LINGER, 0)
    monitor.setsockopt(zmq.RCVHWM, 0)  # taken for the pipe from ZMQ's side, made at connect
    monitor.connect(address)
    return monitor


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
    """Stop ``socket``'s monitor and close it, before ``socket`` is closed."""
    with contextlib.suppress(zmq.ZMQError):  # the socket is closed already
        socket.disable_monitor()
    monitor.close(0)
