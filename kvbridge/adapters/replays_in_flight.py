"""The replays a subscriber's streams wait for, read alongside its sources.

What a message means can depend on a replay (a gap to fill, a publisher to check, the start of
a stream): the sequencing of that message is a generator that yields a
:class:`~kvbridge.adapters.replay_answer.Fetch` and is sent its answer
(:data:`~kvbridge.adapters.replay_answer.Replaying`). :class:`ReplaysInFlight` sends the
request, parks the generator, and reads the answer as it arrives, in the subscriber's own poll;
an answer that is over, or past the replay timeout, resumes its stream. Meanwhile the stream's
own messages wait in ZMQ's queue, so its order is kept, and every other source is read as
usual: a replay endpoint that does not answer holds up its own source, not the others (but
see the slots, below).

At most ``max_replays`` answers are read at a time [:data:`DEFAULT_MAX_REPLAYS`] (each is
bounded, see :mod:`~kvbridge.adapters.replay_client`); further requests wait their turn, in
the order they came. One of the slots is kept for sources whose last replay was answered:
sources whose replay endpoints time out share the others, and hold up the rest by at most the
time a source takes to show it is one of them (a timeout).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterable
from typing import Final

import zmq

from kvbridge.adapters.replay_answer import (
    Answer,
    Fetch,
    Replayed,
    Replaying,
    close_replay_sockets,
)
from kvbridge.adapters.replay_client import ReplayClient
from kvbridge.adapters.source import Message, StreamReset
from kvbridge.adapters.stream_state import StreamState

__all__ = ["DEFAULT_MAX_REPLAYS", "ReplaysInFlight", "Sequencing"]

DEFAULT_MAX_REPLAYS: Final = 4
"""Replay answers read at a time, over all sources."""

Sequencing = Replaying[list[Message | StreamReset]]
"""What one message (or a stream's start) delivers, worked out while waiting for replays."""


class ReplaysInFlight:
    """The streams of one subscriber that wait for a replay, and the answers being read."""

    def __init__(self, client: ReplayClient, poller: zmq.Poller, max_replays: int) -> None:
        self.client = client
        self.poller = poller
        """The subscriber's poller: each answer's DEALER is polled with its sources."""
        self.max_replays = max_replays
        self._waiting: dict[StreamState, tuple[Sequencing, Fetch]] = {}
        self._queued: deque[StreamState] = deque()
        """Streams whose request waits for a turn, first come first."""
        self._answers: dict[StreamState, Answer] = {}

    def waiting(self, stream: StreamState) -> bool:
        """Whether ``stream`` waits for a replay: its messages are not to be read yet."""
        return stream in self._waiting

    def run(self, stream: StreamState, work: Sequencing, out: list[Message | StreamReset]) -> None:
        """Run ``stream``'s sequencing until it waits for a replay or ends, its items onto
        ``out``; a request goes out at once if there is a turn for it."""
        self._resume(stream, work, None, out)
        self._send_queued(out)

    def wait_ms(self, timeout_ms: int, streams: Iterable[StreamState]) -> int:
        """``timeout_ms`` (negative: no bound), or less: until the first answer is due a look
        (:meth:`Answer.wake_at`: its deadline, or the end of a drop's grace), or the first
        time one of ``streams`` has something to do (:meth:`StreamState.due_at`; a repair
        waits for no time while the stream waits for a replay)."""
        deadlines = [answer.wake_at() for answer in self._answers.values()]
        deadlines += [
            due
            for stream in streams
            if (stream.suspended or not self.waiting(stream))
            and (due := stream.due_at()) is not None
        ]
        if not deadlines:
            return timeout_ms
        until = max(0, math.ceil((min(deadlines) - time.monotonic()) * 1000))
        return until if timeout_ms < 0 else min(timeout_ms, until)

    def read(self, ready: set[zmq.Socket[bytes]], out: list[Message | StreamReset]) -> None:
        """Read the answers whose DEALER or its monitor is in ``ready`` (or that are due a
        look, :meth:`Answer.wake_at`), end those that are over or past their deadline, and
        resume their streams (items onto ``out``), then send what waits for a turn."""
        now = time.monotonic()
        for stream, answer in list(self._answers.items()):
            late = answer.deadline <= now  # what came by now still counts
            sockets = answer.sockets
            due = late or answer.wake_at() <= now or not ready.isdisjoint(sockets)
            try:
                over = due and self.client.read(answer)
            finally:
                if answer.sockets != sockets or answer.dealer.closed:  # asked again, or cut
                    self._watch(sockets, 0)
                    self._watch(answer.sockets, 0 if answer.dealer.closed else zmq.POLLIN)
            if over or late:
                self._watch(answer.sockets, 0)
                del self._answers[stream]
                messages = self.client.end(answer, timed_out=not over)
                work, _ = self._waiting.pop(stream)
                self._resume(stream, work, messages, out)
        self._send_queued(out)

    def _watch(self, sockets: Iterable[zmq.Socket[bytes]], flags: int) -> None:
        """Poll ``sockets`` for ``flags`` (0: no longer)."""
        for socket in sockets:
            self.poller.register(socket, flags)

    def close(self) -> None:
        """Forget every wait, and close the answers' DEALERs."""
        for answer in self._answers.values():
            self._watch(answer.sockets, 0)
            close_replay_sockets(*answer.sockets)
        self._answers.clear()
        self._waiting.clear()
        self._queued.clear()

    def _resume(
        self,
        stream: StreamState,
        work: Sequencing,
        answer: Replayed | None,
        out: list[Message | StreamReset],
    ) -> None:
        try:
            fetch = next(work) if answer is None else work.send(answer)
        except StopIteration as done:
            out.extend(done.value)
            self.poller.register(stream.socket, zmq.POLLIN)  # its messages are read again
            return
        except BaseException:
            self.poller.register(stream.socket, zmq.POLLIN)  # not left unread for good
            raise
        self._waiting[stream] = (work, fetch)
        self._queued.append(stream)
        self.poller.register(stream.socket, 0)  # not polled: it would be ready at every poll

    def _next_turn(self) -> StreamState | None:
        """The first queued stream that may have a free slot: one slot is kept for sources
        whose last replay was answered, so that endpoints that time out cannot take them all."""
        free = self.max_replays - len(self._answers)
        for stream in self._queued:
            if free > 1 or (free == 1 and (stream.replay_failures == 0 or self.max_replays == 1)):
                self._queued.remove(stream)
                return stream
        return None

    def _send_queued(self, out: list[Message | StreamReset]) -> None:
        while (stream := self._next_turn()) is not None:
            work, fetch = self._waiting[stream]
            answer = self.client.begin(fetch)
            if answer is None:  # not asked for: an empty answer, at once
                del self._waiting[stream]
                self._resume(stream, work, Replayed([], whole=False), out)
                continue
            self._answers[stream] = answer
            self._watch(answer.sockets, zmq.POLLIN)
