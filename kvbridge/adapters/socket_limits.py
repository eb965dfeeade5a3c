"""How many ZMQ sockets and file descriptors a relay may open: raised to what its sources need.

A relay of a thousand sources opens eight thousand sockets, past ZMQ's default of 1,023 a
context and the usual soft limit of 1,024 file descriptors a process.
"""

from __future__ import annotations

from typing import Final

import zmq

__all__ = ["SOCKETS_PER_SOURCE", "SOCKET_HEADROOM", "raise_limits"]

SOCKETS_PER_SOURCE: Final = 8
"""ZMQ sockets a relayed source can use: SUB, its monitor (2), replay DEALER; PUB, its monitor
(2), replay ROUTER."""
SOCKET_HEADROOM: Final = 64


def raise_limits(context: zmq.Context[zmq.Socket[bytes]], sockets: int) -> None:
    """Make room for ``sockets`` ZMQ sockets: the context's ``MAX_SOCKETS`` (1,023 by default;
    effective only before the context's first socket) and the soft ``RLIMIT_NOFILE``, up to the
    hard limit (a socket takes an fd for its mailbox, and a connection or listener another)."""
    if context.get(zmq.MAX_SOCKETS) < sockets:
        context.set(zmq.MAX_SOCKETS, min(sockets, context.get(zmq.SOCKET_LIMIT)))
    try:
        import resource
    except ImportError:  # not on POSIX
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 2 * sockets + 256
    if soft != resource.RLIM_INFINITY and soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
