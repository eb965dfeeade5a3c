"""What the multi-process benchmarks (``gil.py``, ``relay_throughput.py``) share: a process
pinned to one core, a free port, and a SUB socket that drops nothing.
"""

from __future__ import annotations

import os
import socket

import zmq


def pin(core: int) -> None:
    """Pin the calling thread (and the threads it starts from now on) to one core."""
    if hasattr(os, "sched_setaffinity") and core < (os.cpu_count() or 1):
        os.sched_setaffinity(0, {core})


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def subscriber(context: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> zmq.Socket[bytes]:
    """A SUB socket connected to ``endpoint``, subscribed to every topic, with no receive
    high-water mark (it queues every message rather than drop one)."""
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    return sub
