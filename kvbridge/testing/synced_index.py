"""The index that follows simulated engines: a
:class:`~kvbridge.adapters.tiered_index.TieredIndex` fed by kvbridge's relay on a background
thread, so that tests can check what a router would see (docs/simulator.md, "Following
engines")."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Final, Self

from kvbridge._closing import ClosedOnExit
from kvbridge.adapters.relay import Relay
from kvbridge.adapters.tiered_index import TieredIndex
from kvbridge.schemas import Overlap
from kvbridge.testing.simulated_engine import SimulatedEngine

__all__ = ["SyncedIndex"]

_STEP_MS: Final = 20
"""How long one relay step waits for frames, bounding how fast the relay thread parks or stops."""


class SyncedIndex(TieredIndex, ClosedOnExit):
    """A :class:`~kvbridge.adapters.tiered_index.TieredIndex` fed live from simulated engines.

    A background thread runs a :class:`~kvbridge.adapters.relay.Relay` that subscribes to every
    engine (with its replay socket) and applies the canonical events to this index, exactly as
    ``kvbridge`` would feed it from real vLLM workers. Engine ``i`` is worker ``worker_ids[i]``
    (``i`` by default); give two engines the same worker id and different ``dp_rank`` to model one
    worker with two data-parallel ranks.

    Reading and thread safety: :meth:`sync` waits until the relay has processed every batch the
    engines have published so far, then *parks* the relay thread, so the index does not change
    until the next :meth:`sync`. The read methods (:meth:`overlap`, :meth:`resident`,
    :meth:`workers`, :meth:`dump`, :meth:`engine_overlap`) call :meth:`sync` first, so they
    always see everything published before the call. Frames published while the thread is
    parked wait in the subscriber's queue. Call it from the thread that drives the engines.

    The index subscribes when it is created (and waits for each engine to see the subscriber),
    so create it before the engines publish. A batch published earlier is recovered through the
    replay socket once the engine publishes another one, as kvbridge recovers from ZMQ's slow
    joiner.

    Args:
        engines: the engine, or engines, to follow. They must share one block size.
        worker_ids: the worker id of each engine.
        timeout: the default of :meth:`sync`, in seconds.
    """

    def __init__(
        self,
        engines: SimulatedEngine | Sequence[SimulatedEngine],
        *,
        worker_ids: Sequence[int] | None = None,
        timeout: float = 5.0,
    ) -> None:
        followed = [engines] if isinstance(engines, SimulatedEngine) else list(engines)
        if not followed:
            raise ValueError("give at least one engine")
        ids = list(range(len(followed))) if worker_ids is None else list(worker_ids)
        if len(ids) != len(followed):
            raise ValueError("give one worker id per engine")
        sizes = {engine.block_size for engine in followed}
        if len(sizes) != 1:
            raise ValueError(f"the engines disagree on the block size: {sorted(sizes)}")
        block_size = sizes.pop()
        super().__init__(block_size)
        self._engines: Final = followed
        self._worker_ids: Final = dict(zip(map(id, followed), ids, strict=True))
        self.timeout = timeout
        # Batches no replay can bring back: those of earlier runs, and those past the buffer.
        self._unrecoverable = sum(
            engine.total_published - min(len(engine.published), engine.buffer_steps)
            for engine in followed
        )
        self._relay = Relay(
            [engine.source(worker) for engine, worker in zip(followed, ids, strict=True)],
            block_size=block_size,
            index=self,
        )
        self._cond = threading.Condition()
        self._parked = False
        self._busy = False
        self._stopping = False
        self._processed = 0
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvbridge-synced-index", daemon=True)
        self._thread.start()
        for engine in followed:
            if not engine.wait_for_subscribers(timeout=timeout):
                self.close()
                raise TimeoutError(f"no subscription reached {engine.endpoint} in {timeout} s")

    # ------------------------------------------------------------------ the relay thread

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._parked and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                self._busy = True
            try:
                self._relay.step(_STEP_MS)
            except BaseException as error:
                with self._cond:
                    self._error = error
                    self._busy = False
                    self._cond.notify_all()
                return
            with self._cond:
                self._busy = False
                self._processed = self._relay.stats.batches_in
                self._cond.notify_all()

    def sync(self, timeout: float | None = None) -> Self:
        """Wait until the relay has processed every batch published so far, then park it.

        Returns this index, safe to read until the next :meth:`sync`.

        Raises:
            TimeoutError: the relay did not catch up within ``timeout`` seconds (default
                :attr:`timeout`).
            RuntimeError: the relay thread failed, or the index is closed.
        """
        if self._closed:
            raise RuntimeError("the index is closed")
        wait = self.timeout if timeout is None else timeout
        target = sum(engine.total_published for engine in self._engines) - self._unrecoverable
        with self._cond:
            self._parked = False
            self._cond.notify_all()
            caught_up = self._cond.wait_for(
                lambda: self._error is not None or self._processed >= target, wait
            )
            self._parked = True
            self._cond.wait_for(lambda: not self._busy, max(wait, 1.0))
            error, processed = self._error, self._processed
        if error is not None:
            raise RuntimeError("the relay thread failed") from error
        if not caught_up:
            raise TimeoutError(
                f"the relay processed {processed} of {target} batches in {wait} s (batches "
                "published before the index subscribed are replayed only when the engine "
                "publishes again)"
            )
        return self

    @property
    def relay(self) -> Relay:
        """The relay feeding this index (its ``stats`` and per-worker normalizers). Read it after
        :meth:`sync` only."""
        return self._relay

    # ------------------------------------------------------------------ reads

    def _before_read(self) -> None:
        self.sync()

    def engine_overlap(
        self, token_ids: Sequence[int], engine: SimulatedEngine | None = None
    ) -> Overlap:
        """The overlap of ``token_ids`` on one engine's worker and rank (the only engine by
        default); all zero when it holds none of the blocks."""
        if engine is None:
            if len(self._engines) != 1:
                raise ValueError("this index follows several engines: name one")
            engine = self._engines[0]
        key = (self._worker_ids[id(engine)], engine.dp_rank)
        return self.overlap(token_ids).get(key, Overlap())

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Stop the relay thread and close its sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join()
        self._relay.close()
