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
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Final

import zmq

from kvbridge.adapters.dynamo import TieredIndex
from kvbridge.adapters.pipeline import IndexSink, PublisherSink, StreamPipeline, WorkerState
from kvbridge.adapters.publisher import Publisher
from kvbridge.adapters.zmq import DEFAULT_MAX_FRAME_BYTES, Source, Subscriber

__all__ = ["Relay", "offset_endpoint"]

DEFAULT_BUFFER_STEPS: Final = 10_000
_STOP_TIMEOUT_S: Final = 5.0


def offset_endpoint(endpoint: str, offset: int) -> str:
    """``tcp://host:port`` with the port moved up by ``offset``, as vLLM offsets dp ranks."""
    if offset == 0:
        return endpoint
    head, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit() or not endpoint.startswith("tcp://"):
        raise ValueError(f"cannot offset {endpoint!r}: several workers need tcp://host:port")
    return f"{head}:{int(port) + offset}"


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
            self.pipeline.add_source(source, PublisherSink(publisher, self.stats))

    def endpoints(self, source: Source) -> tuple[str, str | None]:
        """The bound publish and replay endpoints that republish ``source``."""
        publisher = self.outputs[source]
        return publisher.endpoint, publisher.replay_endpoint

    def step(self, timeout_ms: int = 100) -> int:
        """Process whatever arrives within ``timeout_ms``; returns the number of batches."""
        items = self.subscriber.poll(timeout_ms)
        for item in items:
            self.pipeline.feed(item)
        return len(items)

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
