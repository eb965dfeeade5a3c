"""One replay answer as a subscriber reads it: what it asked for, what came, and whether ZMQ
refused one of its batches.

A batch past the DEALER's ``MAXMSGSIZE`` is refused at its size header: ZMQ drops the
connection it came on, and the engine's answer goes with it. A peer that goes away drops the
connection too, but ZMQ then tries to connect again at once, where after a refusal (a
protocol error) it does not. So the DEALER's monitor tells the two apart: a drop of a
connection whose handshake completed, without a reconnect attempt within
:data:`REFUSAL_GRACE_S`, is a refusal (:meth:`Answer.refused`), of the batch after the last one
the answer read. (A peer that is not a ROUTER fails the handshake instead, and its answer
times out.) The replay client then asks again from the batch after that one, on a new DEALER
(see :mod:`~kvbridge.adapters.replay_client`).
"""

from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Final, TypeAlias, TypeVar

import zmq

from kvbridge.adapters.monitors import close_monitor, monitor_events
from kvbridge.adapters.replay_protocol import MAX_SEQ
from kvbridge.adapters.source import Message
from kvbridge.adapters.stream_state import StreamState

__all__ = [
    "REFUSAL_GRACE_S",
    "WATCHED",
    "Answer",
    "Fetch",
    "Replayed",
    "Replaying",
    "close_replay_sockets",
    "run_before",
]

WATCHED: Final = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
"""The events a replay DEALER's monitor reports."""
REFUSAL_GRACE_S: Final = 0.05
"""How long after a drop a reconnect attempt may come and show the peer gone, not a batch
refused. ZMQ's I/O thread reports it right after the drop (within a millisecond here); the
grace is for that thread being descheduled under load."""


@dataclass(frozen=True, eq=False)
class Fetch:
    """A replay that a stream's sequencing waits for: every batch of ``stream`` from
    ``start``. The sequencing yields it and is sent the batches that came
    (:data:`Replaying`)."""

    stream: StreamState
    start: int
    in_back_off: bool = False
    """Asked for within the source's back-off too: the publisher check, and the replays of a
    drop's catch-up (the drop ended the back-off before it; one begun since is another
    connection's)."""


class Replayed(list[Message]):
    """The batches a replay answer delivered, whether it was :attr:`whole`, and its
    :attr:`end`."""

    def __init__(self, messages: list[Message], *, whole: bool, end: int | None = None) -> None:
        super().__init__(messages)
        self.whole = whole
        """It came to its end marker with every batch it held: not timed out, not cut at its
        bounds, no batch skipped, and asked for at all. Batches after the last of an answer
        that is not whole may be missing, unless its :attr:`end` is known."""
        self.end = end
        """If it came to its end marker and the last frame it read had a sequence number: the
        batch after that frame. Those before it that it did not deliver were skipped (too big,
        refused, or not a batch) and are lost; the engine held none after it. ``None``
        otherwise."""


_T = TypeVar("_T")
Replaying: TypeAlias = Generator[Fetch, Replayed, _T]
"""Sequencing that may wait for replays: a generator that yields each :class:`Fetch`, is sent
its batches, and returns its result. Whoever drives it sends the requests and reads the
answers alongside everything else (see :mod:`~kvbridge.adapters.replays_in_flight`)."""


@dataclass(eq=False)
class Answer:
    """A replay request sent, and its answer as read so far."""

    stream: StreamState
    start: int
    dealer: zmq.Socket[bytes]
    monitor: zmq.Socket[bytes]
    """The DEALER's monitor (:data:`WATCHED`), to tell a refused batch from a peer gone."""
    deadline: float
    """When it times out (``time.monotonic()``)."""
    messages: list[Message] = field(default_factory=list)
    size: int = 0
    """Payload bytes read."""
    cut: bool = False
    """It ended before its end marker: its bounds were reached, or a batch of it was refused
    and the rest could not be asked for. The rest was not read."""
    skipped: bool = False
    """A frame of it was skipped (not a batch, too big, or refused)."""
    ended: bool = False
    """Its end marker came."""
    next_seq: int | None = field(init=False)
    """The batch after the last frame read, where a refusal falls; ``None`` after a frame
    without a sequence number."""
    read_since_ask: bool = False
    """A frame came since the last request was sent."""
    blind: bool = False
    """The last refusal came before any frame of its request."""
    handshaken: bool = False
    """The DEALER's connection completed its handshake and has not dropped since."""
    dropped_at: float | None = None
    """When a handshaken connection dropped, with no reconnect attempt seen since."""
    peer_gone: bool = False
    """A reconnect attempt followed the drop: the engine went away, nothing was refused."""

    def __post_init__(self) -> None:
        self.next_seq = self.start

    @property
    def sockets(self) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
        """What to poll for it: the DEALER and its monitor."""
        return self.dealer, self.monitor

    def watch(self) -> None:
        """Take in what the DEALER's monitor reported since the last look."""
        for event in monitor_events(self.monitor):
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:  # connected (again): nothing dropped
                self.handshaken, self.dropped_at, self.peer_gone = True, None, False
            elif event == zmq.EVENT_CONNECT_RETRIED:
                self.peer_gone = True
            elif self.handshaken:
                self.handshaken, self.dropped_at = False, time.monotonic()

    def _refusal_at(self) -> float | None:
        """When a drop counts as a refusal, if one is pending: the end of its grace."""
        if self.dropped_at is None or self.peer_gone:
            return None
        return self.dropped_at + REFUSAL_GRACE_S

    def refused(self) -> bool:
        """Whether ZMQ refused the batch at :attr:`next_seq`: the connection dropped
        :data:`REFUSAL_GRACE_S` ago or more, with no reconnect attempt after it."""
        at = self._refusal_at()
        return at is not None and time.monotonic() >= at

    def wake_at(self) -> float:
        """When it is next to be looked at without a frame: its deadline, or sooner the end
        of a drop's grace."""
        at = self._refusal_at()
        return self.deadline if at is None else min(self.deadline, at)

    def may_ask_past(self) -> bool:
        """Whether the refused batch, at :attr:`next_seq`, may be asked past: it is known and
        below the last seq there is, the refusal is not a second in a row before any frame of
        its request, and the deadline has not passed."""
        return (
            self.next_seq is not None
            and self.next_seq < MAX_SEQ
            and not (self.blind and not self.read_since_ask)
            and time.monotonic() < self.deadline
        )

    def asked_past(self, dealer: zmq.Socket[bytes], monitor: zmq.Socket[bytes]) -> None:
        """The batch at :attr:`next_seq` was refused, and the rest asked for on ``dealer``."""
        assert self.next_seq is not None
        self.dealer, self.monitor = dealer, monitor
        self.next_seq += 1
        self.blind, self.read_since_ask = not self.read_since_ask, False
        self.handshaken, self.dropped_at, self.peer_gone = False, None, False

    def took(self, seq: int | None) -> None:
        """A frame was read, of batch ``seq`` (``None``: of no known batch)."""
        self.next_seq = None if seq is None else seq + 1
        self.read_since_ask = True

    def replayed(self, *, timed_out: bool) -> Replayed:
        """What it delivered, ``timed_out`` or not."""
        complete = self.ended and not (timed_out or self.cut)
        return Replayed(
            self.messages,
            whole=complete and not self.skipped,
            end=self.next_seq if complete else None,
        )


def close_replay_sockets(
    dealer: zmq.Socket[bytes] | None, monitor: zmq.Socket[bytes] | None
) -> None:
    """Close a replay DEALER and its monitor (either may be missing, or closed already)."""
    if dealer is not None and monitor is not None:
        close_monitor(dealer, monitor)
    if dealer is not None:
        dealer.close(0)


def run_before(start: int, end: int, answer: list[Message]) -> list[Message]:
    """Of the batches ``start .. end - 1`` in a replay ``answer``, the run that ends at
    ``end - 1`` unbroken (see
    :meth:`~kvbridge.adapters.replay_recovery.ReplayRecovery.run_before`)."""
    run: list[Message] = []
    for message in answer:
        if message.seq >= end:
            break
        if message.seq < start or (run and message.seq <= run[-1].seq):
            continue  # not asked for, or out of order
        if run and message.seq != run[-1].seq + 1:
            run = []
        run.append(message)
    return run if run and run[-1].seq == end - 1 else []
