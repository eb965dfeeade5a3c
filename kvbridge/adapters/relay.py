"""The relay: vLLM streams in, a canonical stream per worker out, that unmodified Dynamo indexes.

Each source goes ``Subscriber`` → :class:`~kvbridge.adapters.pipeline.StreamPipeline` (its
worker's ``Normalizer``, per-source resets, bad frames skipped); the canonical payloads are
published on an output stream of its own, with a replay ROUTER speaking vLLM's 0.26+ replay
protocol. Dynamo registers each worker with the relay's endpoints instead of the engine's and
recovers from gaps the usual way.

Outputs mirror the sources one to one, offset the way vLLM offsets data-parallel ranks: the
``i``-th source is republished on ``tcp://host:(port + i)`` with replays on
``tcp://host:(replay_port + i)``. A vLLM engine with two dp ranks is two sources, so Dynamo sees
the same endpoint layout it would see from the engine (and Dynamo 1.6 serves replays only to a
worker registered with one dp rank).

The relay's sequence numbers start at the microseconds since the epoch rather than 0: Dynamo
ignores a stream whose sequence goes backwards until it passes the last one seen, so a restarted
relay must continue above the sequence numbers of its previous run. An engine restart, which the
relay sees as its input sequence going back, goes out as an ``AllBlocksCleared`` on a stream
whose sequence keeps increasing.

Without a publish endpoint the relay only tracks state (``kvbridge watch``); with an ``index``
it also feeds an in-process :class:`~kvbridge.adapters.tiered_index.TieredIndex`. Both are sinks of
the pipeline: the index sees every source, each publisher its own.

What a listener behind the relay can always recover from (checked against Dynamo 1.6.1's
listener, see the README's "Failure modes"):

- **The stream opens with the state it holds.** Each output's first batch is a clear (a fresh
  relay holds nothing, while a listener may hold a previous run's blocks) of the rank the
  source publishes by vLLM's layout (a worker's ``i``-th source is its dp rank ``i``); a
  listener that missed it (or holds another rank) is past it in sequence, and its replay
  request, older than the buffer, gets a snapshot.
- **Heartbeats.** An output that sent nothing for :data:`DEFAULT_HEARTBEAT_S` publishes an
  empty batch (``[ts, [], dp_rank]``) with the next sequence number, so that a listener that
  missed batches while the engine is idle sees the gap and asks for a replay.
- **Snapshots.** A replay request older than an output's buffer (a listener of a previous run,
  or one whose gap outgrew the buffer) is answered with a snapshot: per rank, a clear then
  every resident block, then the buffered batches after it. The normalizer belongs to the
  relay's thread, so the replay thread queues the request and :meth:`Relay.step` answers it.

A backlog is published in bursts of up to :data:`PUBLISH_BURST` batches, each output's in order
and merged into as few canonical batches of up to ``merge_bytes`` (:data:`DEFAULT_MERGE_BYTES`)
as hold their events, before :meth:`Relay.step` returns. A message costs a wake-up of ZMQ's I/O
thread and a TCP write (about 13 us on a 2-core KVM guest), and the consumer its own: a burst
shares the wake-ups, a merged batch saves messages. A batch alone goes out at once, as is.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

import msgspec
import structlog
import zmq

from kvbridge._closing import ClosedOnExit
from kvbridge.adapters.endpoints import offset_endpoint
from kvbridge.adapters.pipeline import IndexSink, StreamPipeline, WorkerState
from kvbridge.adapters.publisher import DEFAULT_BUFFER_STEPS, Publisher
from kvbridge.adapters.replay_server import ReplayServer
from kvbridge.adapters.snapshot_requests import Snapshot, SnapshotRequests
from kvbridge.adapters.socket_limits import (
    SOCKET_HEADROOM,
    SOCKETS_PER_SOURCE,
    output_hwm_for,
    raise_limits,
)
from kvbridge.adapters.source import Source
from kvbridge.adapters.stream_stats import OutputStats, PipelineStats
from kvbridge.adapters.subscriber import (
    DEFAULT_CLEAR_BURST,
    DEFAULT_CLEAR_INTERVAL_S,
    DEFAULT_MAX_FRAME_BYTES,
    DEFAULT_REPLAY_TIMEOUT_S,
    Subscriber,
)
from kvbridge.normalizers.batch import NormalizedBatch, merged_canonical_payloads

if TYPE_CHECKING:
    from kvbridge.adapters.tiered_index import TieredIndex

__all__ = ["Relay"]

log = structlog.get_logger("kvbridge.relay")

_STOP_TIMEOUT_S: Final = 5.0
DEFAULT_HEARTBEAT_S: Final = 0.5
"""An output idle this long publishes an empty batch with the next sequence number."""
PUBLISH_BURST: Final = 256
"""Normalized batches held back at most before they are sent, when batches queue up. At 25 us
a batch, the first of a burst goes out at most 6.4 ms later than alone, and a backlog sooner:
41 us a batch against 52 without bursts (2,299 queued batches, one core, best of 10 runs)."""
DEFAULT_MERGE_BYTES: Final = 64 * 1024
"""About the largest canonical batch a burst's batches are merged into: fewer messages at both
ends (:data:`DEFAULT_BUFFER_BYTES` bounds the replay buffer's). 0 merges nothing."""
DEFAULT_BUFFER_BYTES: Final = 64 * 1024 * 1024
"""Payload bytes each output's replay buffer holds at most, besides its ``buffer_steps``
batches: a backlog's merged batches, or an engine's long prefills, cannot make it grow past
this. A request older than the buffer gets a snapshot, as one older than its batches does."""


def _opening_clear(ts: float, dp_rank: int) -> bytes:
    """A fresh relay's first batch on an output: it holds nothing, so a clear of the rank (the
    normalizer's own state is untouched, so that its counts stay those of the stream)."""
    return msgspec.msgpack.encode((ts, [{"type": "AllBlocksCleared"}], dp_rank))


_Held = tuple[Publisher, NormalizedBatch, float]
"""A batch normalized and not yet published: its output, the batch, its engine time."""


class _HeldSink:
    """A source's output: its normalized batches, held for the relay to publish in order."""

    __slots__ = ("held", "publisher")

    def __init__(self, publisher: Publisher, held: list[_Held]) -> None:
        self.publisher = publisher
        self.held = held

    def apply(self, batch: NormalizedBatch, source: Source, ts: float, /) -> None:
        self.held.append((self.publisher, batch, ts))


class Relay(ClosedOnExit):
    """Relays and canonicalises the KV-event streams of one or more vLLM workers.

    Each output's PUB socket has the high-water mark ``output_hwm``; ``None`` (the default)
    takes it from ``merge_bytes`` (:func:`~kvbridge.adapters.socket_limits.output_hwm_for`), so
    that what a consumer that never reads holds queued stays about
    :data:`~kvbridge.adapters.socket_limits.OUTPUT_QUEUE_BYTES` however large a merged batch is.
    ``max_frame_bytes``, ``replay_*`` and ``clear_*`` are passed on to its ``Subscriber``.
    """

    def __init__(
        self,
        sources: Sequence[Source],
        *,
        block_size: int,
        publish: str | None = None,
        publish_replay: str | None = None,
        topic: str = "",
        buffer_steps: int = DEFAULT_BUFFER_STEPS,
        buffer_bytes: int | None = DEFAULT_BUFFER_BYTES,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        index: TieredIndex | None = None,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        replay_on_start: bool = False,
        heartbeat_s: float | None = DEFAULT_HEARTBEAT_S,
        output_hwm: int | None = None,
        merge_bytes: int = DEFAULT_MERGE_BYTES,
        replay_timeout: float = DEFAULT_REPLAY_TIMEOUT_S,
        clear_burst: int = DEFAULT_CLEAR_BURST,
        clear_interval: float = DEFAULT_CLEAR_INTERVAL_S,
    ) -> None:
        if not sources:
            raise ValueError("a relay needs at least one source")
        if merge_bytes < 0:
            raise ValueError(f"merge_bytes must be >= 0, got {merge_bytes}")
        self.block_size = block_size
        self.merge_bytes = merge_bytes
        self.index = index
        self.context = context or zmq.Context.instance()
        per_source = SOCKETS_PER_SOURCE if publish is not None else SOCKETS_PER_SOURCE - 4
        raise_limits(self.context, len(sources) * per_source + SOCKET_HEADROOM)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._thread_lock = threading.Lock()
        self._thread_running = False
        self._thread_closes = False  # close gave up waiting: the thread closes the sockets
        self._failure: Exception | None = None
        self.outputs: dict[Source, Publisher] = {}
        self._replays: ReplayServer | None = None
        """One thread and one poller serve every output's replays (not a thread each)."""
        self._snapshots = SnapshotRequests[Source](lambda: self.subscriber.wakeup.wake())
        self.subscriber = Subscriber(
            sources,
            context=self.context,
            max_frame_bytes=max_frame_bytes,
            replay_on_start=replay_on_start,
            replay_timeout=replay_timeout,
            clear_burst=clear_burst,
            clear_interval=clear_interval,
        )
        self.stats = PipelineStats()
        """Batches in and out and the payloads that do not decode (shared with the
        pipeline)."""
        self.heartbeat_s = heartbeat_s
        self._beat_check = 0.0
        """When :meth:`_heartbeat` next looks at the outputs (monotonic)."""
        self.output_stats = OutputStats()
        """The batches the outputs made themselves: opening clears, heartbeats, snapshots."""
        self.pipeline = StreamPipeline(
            block_size, sinks=[IndexSink(index)] if index is not None else (), stats=self.stats
        )
        self.workers: dict[int, WorkerState] = self.pipeline.workers
        """Each worker's normalizer and lag, by worker id (the pipeline's own)."""
        self._held: list[_Held] = []
        """Batches normalized and not yet published, in stream order (see :meth:`step`)."""
        first_seq = time.time_ns() // 1000
        try:
            for offset, source in enumerate(sources):
                self.pipeline.add_source(source)
                if publish is None:
                    continue
                publisher = Publisher(
                    offset_endpoint(publish, offset),
                    replay_endpoint=offset_endpoint(publish_replay, offset)
                    if publish_replay
                    else None,
                    topic=topic,
                    buffer_steps=buffer_steps,
                    buffer_bytes=buffer_bytes,
                    context=self.context,
                    bind=True,
                    first_seq=first_seq,
                    hwm=output_hwm_for(merge_bytes) if output_hwm is None else output_hwm,
                )
                self.outputs[source] = publisher
                self.pipeline.add_source(source, _HeldSink(publisher, self._held))
                (rank,) = self.pipeline.source_ranks(source)
                publisher.publish(_opening_clear(time.time(), rank))
                self.output_stats.opened += 1
                if publish_replay:
                    publisher.snapshot = self._snapshots.provider(source)
            replaying = [
                p.replay_socket() for p in self.outputs.values() if p.replay_endpoint is not None
            ]
            self._replays = ReplayServer(replaying).start() if replaying else None
        except BaseException:  # what was made is closed: nothing bound or read stays behind
            self.close()
            raise

    def endpoints(self, source: Source) -> tuple[str, str | None]:
        """The bound publish and replay endpoints that republish ``source``."""
        publisher = self.outputs[source]
        return publisher.endpoint, publisher.replay_endpoint

    def step(self, timeout_ms: int = 100) -> int:
        """Process whatever arrives within ``timeout_ms``; returns the number of batches.

        Everything it normalized is published before it returns (see :data:`PUBLISH_BURST`).
        """
        if self.heartbeat_s is not None:  # sent between polls, at most half an interval late
            timeout_ms = min(timeout_ms, int(self.heartbeat_s * 500))
        items = self.subscriber.poll(timeout_ms)
        held, feed = self._held, self.pipeline.feed
        try:
            for item in items:
                feed(item)
                if len(held) >= PUBLISH_BURST:
                    self._publish_held()
        finally:
            self._publish_held()
        self._snapshots.answer(self._snapshot)
        if self.heartbeat_s is not None:
            self._heartbeat(self.heartbeat_s)
        return len(items)

    def _snapshot(self, source: Source, start_seq: int) -> Snapshot:
        """The snapshot a replay thread asked for (:mod:`~kvbridge.adapters.snapshot_requests`):
        the state as of the last batch published, with the seq the next one will get. Numbered
        from the seq asked for, its payloads must stay below that one: if they would not, empty
        batches (heartbeats) are published first, as many as that takes."""
        now = time.time()
        payloads = [
            payload
            for batch in self.pipeline.snapshot(source)
            for payload in batch.canonical_payloads(now)
        ]
        publisher = self.outputs[source]
        while publisher.next_seq < start_seq + len(payloads):
            self._publish_empty(source, publisher)
        self.output_stats.snapshots += 1
        return publisher.next_seq, payloads

    def _heartbeat(self, interval: float) -> None:
        """An empty batch with the next seq on every output idle for ``interval`` seconds."""
        now = time.monotonic()
        if now < self._beat_check:  # many outputs: not a loop over all of them every step
            return
        self._beat_check = now + interval / 10
        for source, publisher in self.outputs.items():
            if now - publisher.last_sent < interval:
                continue
            self._publish_empty(source, publisher)

    def _publish_empty(self, source: Source, publisher: Publisher) -> None:
        """A heartbeat: an empty batch with the next seq, of the source's last rank."""
        rank = self.pipeline.source_ranks(source)[-1]
        publisher.publish(msgspec.msgpack.encode((time.time(), [], rank)))
        self.output_stats.heartbeats += 1

    def _publish_held(self) -> None:
        """Publish the held batches, each output's merged. Outputs are streams of their own:
        each keeps its order, and the order between them does not matter."""
        held = self._held
        if not held:
            return
        stats = self.stats
        by_output: dict[Publisher, list[tuple[NormalizedBatch, float]]] = {}
        try:
            for publisher, batch, ts in held:
                by_output.setdefault(publisher, []).append((batch, ts))
            for publisher, batches in by_output.items():
                for payload in merged_canonical_payloads(batches, self.merge_bytes):
                    publisher.publish(payload)
                    stats.batches_out += 1
        finally:
            held.clear()

    def run(self, stop: threading.Event, timeout_ms: int = 100) -> None:
        """Relay until ``stop`` is set. An error that ends it is kept in :attr:`failure`, then
        raised: a relay on a thread is then seen to have stopped (a replica's health check)."""
        try:
            while not stop.is_set():
                self.step(timeout_ms)
        except Exception as error:
            self._failure = error
            raise

    @property
    def failure(self) -> Exception | None:
        """What ended :meth:`run`, or the thread that serves the outputs' replays, if an error
        did: the relay no longer moves, or no longer recovers its consumers' gaps."""
        replays = self._replays
        return self._failure or (None if replays is None else replays.failure)

    def start(self, timeout_ms: int = 100) -> None:
        """Relay on a daemon thread until :meth:`close`, polling ``timeout_ms`` at most at a
        time (half of ``heartbeat_s`` at most; :meth:`close` wakes it). Do not call
        :meth:`step` as well: the sockets are its."""
        if self._thread is not None:
            raise RuntimeError("the relay is already running")
        self._thread = threading.Thread(
            target=self._run_thread, args=(timeout_ms,), name="kvbridge-relay", daemon=True
        )
        self._thread_running = True
        self._thread.start()

    def _run_thread(self, timeout_ms: int) -> None:
        try:
            self.run(self._stop, timeout_ms)
        finally:
            with self._thread_lock:
                self._thread_running = False
                closes = self._thread_closes
            if closes:
                self._close_sockets()

    def close(self) -> None:
        """Stop the thread :meth:`start` started, if any, and close the sockets. Idempotent.

        A thread still busy after ``_STOP_TIMEOUT_S`` keeps the sockets, and closes them when
        it ends: ZMQ sockets are not thread-safe, and libzmq may abort the process on one
        closed under a thread that uses it."""
        if self._stop.is_set():
            return
        self._stop.set()
        self.subscriber.wakeup.wake()
        if self._thread is not None:
            self._thread.join(_STOP_TIMEOUT_S)
            with self._thread_lock:
                self._thread_closes = self._thread_running
            if self._thread_closes:
                log.warning("relay thread still busy; it closes its sockets when it ends")
                return
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._snapshots.cancel()
        if self._replays is not None:  # first: its snapshot requests wake the subscriber
            self._replays.close()
        self.subscriber.close()
        for publisher in self.outputs.values():
            publisher.close()
