"""What a publisher keeps of its stream for replays, and the answer to a replay request.

The publisher's live stream appends to a :class:`ReplayBuffer`; the thread that serves replays
(:mod:`~kvbridge.adapters.replay_server`) asks it for the batches that answer a request: the
buffered ones from the seq asked for, or, for a request older than the buffer, a snapshot of the
whole state first (:data:`SnapshotProvider`).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Final

__all__ = ["SNAPSHOT_ATTEMPTS", "ReplayBuffer", "SnapshotProvider"]

SnapshotProvider = Callable[[int], tuple[int, list[bytes]] | None]
"""What a request from ``start_seq`` older than the buffer is answered with, called with
``start_seq``: ``(next_seq, payloads)``, the payloads rebuilding all state as of just before
``next_seq``, with ``next_seq >= start_seq + len(payloads)`` (the provider publishes empty
batches first if need be, so that the payloads can be numbered from ``start_seq`` below it), or
``None``. Without a snapshot the buffer is replayed as usual."""

SNAPSHOT_ATTEMPTS: Final = 3
"""Snapshots taken at most for one request whose point the stream pushed out of the buffer
before the answer was read; the last one is sent whatever the stream did."""


class ReplayBuffer:
    """The last ``buffer_steps`` batches of a stream, with their seqs, and the seq of the next;
    with ``buffer_bytes``, no more of them than fit in that many payload bytes (the newest is
    kept whatever its size).

    The publishing thread appends and the replay thread reads, so a lock guards it.
    """

    def __init__(self, buffer_steps: int, first_seq: int, buffer_bytes: int | None = None) -> None:
        self._lock = threading.Lock()
        self._batches: deque[tuple[int, bytes]] = deque()
        self._steps = buffer_steps
        self._max_bytes = buffer_bytes
        self._bytes = 0
        """Payload bytes held."""
        self._next_seq = first_seq
        self.snapshot: SnapshotProvider | None = None
        """Called on the replay thread for a request older than the buffer, with the seq it
        starts at (see :data:`SnapshotProvider`)."""

    @property
    def steps(self) -> int:
        """How many batches it holds at the most (``buffer_steps``)."""
        return self._steps

    @property
    def next_seq(self) -> int:
        """The seq :meth:`append` without an explicit ``seq`` will use."""
        with self._lock:
            return self._next_seq

    def append(self, payload: bytes, seq: int | None) -> int:
        """Keep ``payload`` under ``seq`` (by default the next one) and return the seq used;
        the next one is ``seq + 1``.

        A payload that is not ``bytes`` (a ``bytearray`` from an untyped caller) is kept as a
        copy: answers send the buffer's payloads without copying them, so they must never
        change or move while ZMQ holds them."""
        if type(payload) is not bytes:
            payload = bytes(payload)
        with self._lock:
            used = self._next_seq if seq is None else seq
            self._next_seq = used + 1
            batches = self._batches
            if self._steps == 0:
                return used
            batches.append((used, payload))
            self._bytes += len(payload)
            bound = self._max_bytes
            while len(batches) > self._steps or (
                bound is not None and self._bytes > bound and len(batches) > 1
            ):
                self._bytes -= len(batches.popleft()[1])
        return used

    def restart(self) -> None:
        """Forget every batch; the next seq is 0, as after an engine restart."""
        with self._lock:
            self._next_seq = 0
            self._batches.clear()
            self._bytes = 0

    def answer(self, start_seq: int) -> list[tuple[int, bytes]]:
        """The ``(seq, payload)`` batches that answer a request from ``start_seq``: the buffered
        ones from there on, preceded by the snapshot's payloads if the request is older than
        the buffer and there is a snapshot."""
        with self._lock:
            provider = self.snapshot
            if start_seq >= self._first_held() or provider is None:
                # read under the lock that decided, so that no batch it counted on goes first
                return self._held_from(start_seq)
        for attempt in range(1, SNAPSHOT_ATTEMPTS + 1):
            snapshot = provider(start_seq)
            if snapshot is None:
                break
            # Numbered from the seq asked for (Dynamo's listener calls a replay that starts
            # later "incomplete"), and below the snapshot's point, which the provider moved
            # past them: a seq the live stream gives a later batch would make that batch a
            # duplicate to the listener. The buffered batches from the snapshot's point follow.
            # A listener re-applies the live batches it holds after them: replaying a suffix
            # of the stream on top of its result changes nothing.
            next_seq, payloads = snapshot
            if start_seq + len(payloads) > next_seq:
                break
            with self._lock:
                # Batches published since the snapshot may have pushed its point out of the
                # buffer, and the answer would skip them: take the snapshot again. The last
                # one goes out all the same, since without it the listener would have no
                # state at all, only the buffer's tail.
                if next_seq < self._first_held() and attempt < SNAPSHOT_ATTEMPTS:
                    continue
                answer = [(start_seq + i, payload) for i, payload in enumerate(payloads)]
                return answer + self._held_from(next_seq)
        with self._lock:
            return self._held_from(start_seq)

    def _first_held(self) -> int:
        """The oldest seq the buffer can answer from (the next one's, if it holds none); the
        caller holds the lock."""
        return self._batches[0][0] if self._batches else self._next_seq

    def _held_from(self, start_seq: int) -> list[tuple[int, bytes]]:
        """The buffered batches from ``start_seq`` on; the caller holds the lock."""
        return [(seq, payload) for seq, payload in self._batches if seq >= start_seq]
