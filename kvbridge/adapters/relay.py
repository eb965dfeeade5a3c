"""The relay: vLLM streams in, a canonical stream per worker out, that unmodified Dynamo indexes.

Each source goes ``Subscriber`` → :class:`~kvbridge.adapters.pipeline.StreamPipeline` (its
worker's ``Normalizer``, per-source resets, bad frames skipped); the canonical payloads are
published on an output stream of its own, with a replay ROUTER speaking vLLM's 0.26+ replay
protocol. Dynamo registers each
worker with the relay's endpoints instead of the engine's and recovers from gaps the usual way.

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
it also feeds an in-process :class:`~kvbridge.adapters.dynamo.TieredIndex`. Both are sinks of
the pipeline: the index sees every source, each publisher its own.

When a poll brings several batches (a backlog), their canonical payloads are published in
bursts of up to :data:`PUBLISH_BURST`, in order, and always before :meth:`Relay.step` returns.
Each message sent alone costs the relay's core a wake-up of ZMQ's I/O thread and a TCP write
(about 13 us on a 2-core KVM guest); a burst shares them. A batch that arrives alone is
published as soon as it is normalized, as before.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Final

import zmq

from kvbridge.adapters.dynamo import TieredIndex
from kvbridge.adapters.pipeline import IndexSink, StreamPipeline, WorkerState
from kvbridge.adapters.publisher import Publisher
from kvbridge.adapters.zmq import DEFAULT_MAX_FRAME_BYTES, Source, Subscriber
from kvbridge.normalizers.batch import NormalizedBatch

__all__ = ["Relay", "offset_endpoint"]

DEFAULT_BUFFER_STEPS: Final = 10_000
_STOP_TIMEOUT_S: Final = 5.0
PUBLISH_BURST: Final = 256
"""Canonical payloads held back at most before they are sent, when batches queue up. At about
25 us of normalizing each, the first of a burst goes out at most 6.4 ms later than it would
alone, and the backlog as a whole is out sooner: 41 us a batch against 52 without bursts
(2,299 queued batches through one core, best of 10 runs each)."""


def offset_endpoint(endpoint: str, offset: int) -> str:
    """``tcp://host:port`` with the port moved up by ``offset``, as vLLM offsets dp ranks."""
    if offset == 0:
        return endpoint
    head, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit() or not endpoint.startswith("tcp://"):
        raise ValueError(f"cannot offset {endpoint!r}: several workers need tcp://host:port")
    return f"{head}:{int(port) + offset}"


class _HeldSink:
    """A source's output: its canonical payloads, held for the relay to publish in order."""

    __slots__ = ("held", "publisher")

    def __init__(self, publisher: Publisher, held: list[tuple[Publisher, bytes]]) -> None:
        self.publisher = publisher
        self.held = held

    def apply(self, batch: NormalizedBatch, source: Source, ts: float, /) -> None:
        publisher = self.publisher
        self.held.extend((publisher, payload) for payload in batch.canonical_payloads(ts))


class Relay:
    """Relays and canonicalises the KV-event streams of one or more vLLM workers."""

    def __init__(
        self,
        sources: Sequence[Source],
        *,
        block_size: int,
        publish: str | None = None,
        publish_replay: str | None = None,
        topic: str = "",
        buffer_steps: int = DEFAULT_BUFFER_STEPS,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        index: TieredIndex | None = None,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        replay_on_start: bool = False,
    ) -> None:
        if not sources:
            raise ValueError("a relay needs at least one source")
        self.block_size = block_size
        self.index = index
        self.context = context or zmq.Context.instance()
        self.subscriber = Subscriber(
            sources,
            context=self.context,
            max_frame_bytes=max_frame_bytes,
            replay_on_start=replay_on_start,
        )
        self.stats: Counter[str] = Counter()
        """``batches_in``, ``batches_out`` and ``bad_frame:schema``."""
        self.pipeline = StreamPipeline(
            block_size, sinks=[IndexSink(index)] if index is not None else (), stats=self.stats
        )
        self.workers: dict[int, WorkerState] = self.pipeline.workers
        """Each worker's normalizer and lag, by worker id (the pipeline's own)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.outputs: dict[Source, Publisher] = {}
        self._held: list[tuple[Publisher, bytes]] = []
        """Payloads normalized and not yet published, in stream order (see :meth:`step`)."""
        first_seq = time.time_ns() // 1000
        for offset, source in enumerate(sources):
            self.pipeline.add_source(source)
            if publish is None:
                continue
            publisher = Publisher(
                offset_endpoint(publish, offset),
                replay_endpoint=offset_endpoint(publish_replay, offset) if publish_replay else None,
                topic=topic,
                buffer_steps=buffer_steps,
                context=self.context,
                bind=True,
                first_seq=first_seq,
            )
            if publish_replay:
                publisher.start_replay_thread()
            self.outputs[source] = publisher
            self.pipeline.add_source(source, _HeldSink(publisher, self._held))

    def endpoints(self, source: Source) -> tuple[str, str | None]:
        """The bound publish and replay endpoints that republish ``source``."""
        publisher = self.outputs[source]
        return publisher.endpoint, publisher.replay_endpoint

    def step(self, timeout_ms: int = 100) -> int:
        """Process whatever arrives within ``timeout_ms``; returns the number of batches.

        Everything it normalized is published before it returns (see :data:`PUBLISH_BURST`).
        """
        items = self.subscriber.poll(timeout_ms)
        held, feed = self._held, self.pipeline.feed
        try:
            for item in items:
                feed(item)
                if len(held) >= PUBLISH_BURST:
                    self._publish_held()
        finally:
            self._publish_held()
        return len(items)

    def _publish_held(self) -> None:
        held = self._held
        if not held:
            return
        stats = self.stats
        try:
            for publisher, payload in held:
                publisher.publish(payload)
                stats["batches_out"] += 1
        finally:
            held.clear()

    def run(self, stop: threading.Event, timeout_ms: int = 100) -> None:
        """Relay until ``stop`` is set."""
        while not stop.is_set():
            self.step(timeout_ms)

    def start(self) -> None:
        """Relay on a daemon thread until :meth:`close`. The relay's sockets then belong to
        that thread: do not call :meth:`step` as well."""
        if self._thread is not None:
            raise RuntimeError("the relay is already running")
        self._thread = threading.Thread(
            target=self.run, args=(self._stop,), name="kvbridge-relay", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        """Stop the thread :meth:`start` started, if any, and close the sockets. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(_STOP_TIMEOUT_S)
        self.subscriber.close()
        for publisher in self.outputs.values():
            publisher.close()

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
