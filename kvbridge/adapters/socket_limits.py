"""How many ZMQ sockets and file descriptors a relay may open, raised to what its sources need,
and how many messages each output's PUB queues for a consumer that does not read.

A relay of a thousand sources opens ten thousand sockets, past ZMQ's default of 1,023 a
context and the usual soft limit of 1,024 file descriptors a process.
"""

from __future__ import annotations

from typing import Final

import zmq

__all__ = [
    "DEFAULT_OUTPUT_HWM",
    "OUTPUT_QUEUE_BYTES",
    "SOCKETS_PER_SOURCE",
    "SOCKET_HEADROOM",
    "output_hwm_for",
    "raise_limits",
]

SOCKETS_PER_SOURCE: Final = 10
"""ZMQ sockets a relayed source can use: SUB, its monitor (2), replay DEALER, its monitor (2);
PUB, its monitor (2), replay ROUTER."""
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


DEFAULT_OUTPUT_HWM: Final = 10_000
"""``SNDHWM`` of each output's PUB socket when nothing is merged: a consumer that never reads
costs the relay at most this many canonical payloads, each of one batch; past it ZMQ drops, and
the consumer sees a gap it can replay."""
OUTPUT_QUEUE_BYTES: Final = 16 * 1024 * 1024
"""What a consumer that never reads costs the relay per output in merged payloads. ZMQ bounds
a queue in messages, and a merged one holds up to about ``merge_bytes``, so the output's
``SNDHWM`` is this over ``merge_bytes``: 256 at the relay's default ``merge_bytes``
(:data:`~kvbridge.adapters.relay.DEFAULT_MERGE_BYTES`), where 10,000 payloads could hold
640 MiB. A batch larger than ``merge_bytes`` goes out alone and unsplit, so queued messages of
such batches cost more (each at most the source's frame bound)."""


def output_hwm_for(merge_bytes: int) -> int:
    """The ``SNDHWM`` of an output that merges batches into payloads of up to ``merge_bytes``:
    :data:`OUTPUT_QUEUE_BYTES` of them, at least 1 (ZMQ takes 0 as no bound) and at most
    :data:`DEFAULT_OUTPUT_HWM`, which any ``merge_bytes`` below 1,678 gets.

    Outside a backlog each message is one batch, usually far smaller than ``merge_bytes``: a
    consumer that stalls then drops after this many batches, and replays them."""
    if merge_bytes == 0:
        return DEFAULT_OUTPUT_HWM
    return max(1, min(DEFAULT_OUTPUT_HWM, OUTPUT_QUEUE_BYTES // merge_bytes))
