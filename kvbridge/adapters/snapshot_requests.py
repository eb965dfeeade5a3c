"""Snapshot requests, handed from a relay's replay thread to the thread that owns its state.

A replay request older than an output's buffer is answered with a snapshot of the worker's
state, which only the relay's thread may read (the normalizer is its own). The replay thread
queues the request, wakes the relay's poll and waits for the answer, up to
:data:`SNAPSHOT_TIMEOUT_S`; the relay's thread answers what is queued after each step.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Hashable
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Final, Generic, TypeVar

from kvbridge.adapters.replay_buffer import SnapshotProvider

__all__ = ["SNAPSHOT_TIMEOUT_S", "Snapshot", "SnapshotRequests"]

SNAPSHOT_TIMEOUT_S: Final = 2.0
"""How long a replay request older than the buffer waits for the relay's thread to take the
snapshot; without an answer (the relay is not stepping) the buffer is replayed as usual."""

Snapshot = tuple[int, list[bytes]]
"""The seq the snapshot's payloads are numbered from, and the payloads."""

Output = TypeVar("Output", bound=Hashable)


class SnapshotRequests(Generic[Output]):
    """The snapshot requests of a relay's outputs, queued for the relay's thread.

    ``wake`` ends the relay thread's poll, so that a request waits for a step, not a poll's
    timeout.
    """

    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        self._queue: queue.SimpleQueue[tuple[Output, int, Future[Snapshot | None]]] = (
            queue.SimpleQueue()
        )

    def provider(self, output: Output) -> SnapshotProvider:
        """What ``output``'s publisher calls, on its replay thread, for a request older than
        its buffer: the snapshot taken on the relay's thread, or ``None`` if none came in
        time."""

        def provide(start_seq: int) -> Snapshot | None:
            future: Future[Snapshot | None] = Future()
            self._queue.put((output, start_seq, future))
            self._wake()
            try:
                return future.result(SNAPSHOT_TIMEOUT_S)
            except (FutureTimeout, CancelledError):
                future.cancel()
                return None

        return provide

    def answer(self, take: Callable[[Output, int], Snapshot]) -> None:
        """On the relay's thread: answer each queued request still waited for with
        ``take(output, start_seq)``."""
        while True:
            try:
                output, start_seq, future = self._queue.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                future.set_result(take(output, start_seq))

    def cancel(self) -> None:
        """Cancel every queued request: no thread will answer them now."""
        while not self._queue.empty():
            self._queue.get_nowait()[2].cancel()
