"""The one path from vLLM worker streams to canonical events: frames or resets in, sinks out.

The relay, ``kvbridge demo``, ``kvbridge validate`` and the test references all do the same
thing with a worker's stream, and it is easy to get subtly wrong when written several times:

- each payload goes to its worker's :class:`~kvbridge.normalizers.Normalizer` (one per worker
  id, shared by all of that worker's sources, since a worker's dp ranks share one block space
  in Dynamo);
- a payload that does not decode is counted (:attr:`BadFrame.SCHEMA
  <kvbridge.adapters.stream_stats.BadFrame.SCHEMA>`), logged with its stream and
  sequence number, and skipped, leaving every state as it was;
- a reset of one source (:class:`~kvbridge.adapters.source.StreamReset`: the engine restarted or
  batches were lost for good) clears exactly the dp ranks that source delivered, and nothing
  of the worker's other sources;
- a source reset before any batch named its rank is *uncleared*: its first batch is preceded
  by a clear of that batch's rank, because a consumer may still hold that rank's blocks from
  before (a restarted relay, an engine that restarted while nobody listened);
- every non-empty result goes to the sinks, as a
  :class:`~kvbridge.normalizers.batch.NormalizedBatch`.

:class:`StreamPipeline` is that path. It leaves decoding and encoding to the normalizer's
:meth:`~kvbridge.normalizers.Normalizer.process` and to
:meth:`~kvbridge.normalizers.batch.NormalizedBatch.canonical_payloads`, so that a native
implementation can take over both, down to producing the relay's bytes without building
Python events when only a publisher listens.

The batch's engine time and rank, which the per-source ranks, the lag and the canonical
stream's timestamps need, come with the result; an uncleared source's clear is made by the
normalizer in the same result, so that it goes out in the same canonical payload.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

import structlog

from kvbridge.adapters.capture import FrameRecord
from kvbridge.adapters.logs import LogLimiter
from kvbridge.adapters.publisher import Publisher
from kvbridge.adapters.source import Message, Source, StreamReset
from kvbridge.adapters.stream_stats import BadFrame, PipelineStats, skip_bad_frame
from kvbridge.normalizers import Normalizer
from kvbridge.normalizers.batch import NormalizedBatch
from kvbridge.schemas import SchemaError, VllmBatch

if TYPE_CHECKING:
    from kvbridge.adapters.tiered_index import TieredIndex

__all__ = [
    "EventSink",
    "IndexSink",
    "PublisherSink",
    "StreamPipeline",
    "WorkerState",
    "record_source",
]

log = structlog.get_logger("kvbridge.pipeline")


class EventSink(Protocol):
    """Where canonical events go: an index, a canonical publisher, anything that consumes them.

    ``source`` is the stream the events came from (a sink per source, such as a relay output,
    ignores it); ``ts`` is the engine time of the batch, or the time of a reset, for sinks that
    republish.
    """

    def apply(self, batch: NormalizedBatch, source: Source, ts: float, /) -> None: ...


class IndexSink:
    """Feeds a :class:`~kvbridge.adapters.tiered_index.TieredIndex`.

    An adapter rather than a method of the index: ``TieredIndex.apply`` takes any iterable of
    events and is called that way by many users; a sink is a pipeline's view of it.
    """

    __slots__ = ("index",)

    def __init__(self, index: TieredIndex) -> None:
        self.index = index

    def apply(self, batch: NormalizedBatch, source: Source, ts: float, /) -> None:
        self.index.apply(batch.events)


class PublisherSink:
    """Republishes canonical payloads on a :class:`~kvbridge.adapters.publisher.Publisher`.

    Only asks the batch for its payloads (never for its events), so that a native normalizer
    can hand over bytes it encoded itself. ``stats``, if given, counts ``batches_out``.
    """

    __slots__ = ("publisher", "stats")

    def __init__(self, publisher: Publisher, stats: PipelineStats | None = None) -> None:
        self.publisher = publisher
        self.stats = stats

    def apply(self, batch: NormalizedBatch, source: Source, ts: float, /) -> None:
        for payload in batch.canonical_payloads(ts):
            self.publisher.publish(payload)
            if self.stats is not None:
                self.stats.batches_out += 1


class WorkerState:
    """One worker's normalizer, shared by its sources (one per dp rank), and what the pipeline
    remembers per source to reset exactly what that source delivered."""

    __slots__ = ("cleared", "lag", "layout_ranks", "normalizer", "ranks", "uncleared")

    def __init__(self, normalizer: Normalizer) -> None:
        self.normalizer = normalizer
        self.ranks: dict[Source, set[int]] = {}
        """The dp ranks seen on each source, to clear when that source resets."""
        self.layout_ranks: dict[Source, int] = {}
        """The rank each registered source publishes by vLLM's layout (its position among the
        worker's sources, as vLLM offsets a dp rank's port by the rank), for what must name a
        rank before any batch has (an opening clear, a heartbeat, a snapshot)."""
        self.uncleared: set[Source] = set()
        """Sources reset before any batch named their rank: the first one that does is
        preceded by a clear of that rank, since a consumer may hold its blocks from before."""
        self.cleared: set[Source] = set()
        """Sources whose ranks a reset cleared, with no batch since: a further reset has
        nothing new to clear downstream, and leaves the identities as the first one did."""
        self.lag = 0.0
        """Seconds between the engine step and its batch reaching the pipeline, last batch."""


def record_source(record: FrameRecord) -> Source:
    """The source a capture record came from; a replayed record (stream ``replay:<endpoint>``)
    belongs to the same source as the live ones."""
    return Source(record.stream.removeprefix("replay:"), worker_id=record.worker_id)


class StreamPipeline:
    """Normalizes the streams of any number of workers and hands the results to sinks.

    ``sinks`` get the events of every source; :meth:`add_source` adds sinks of one source (a
    relay's per-source output). ``stats`` counts ``batches_in`` (every payload fed, good or
    bad) and the payloads that do not decode; pass a :class:`PipelineStats` to share it with
    the caller's own.

    Not thread-safe: feed it from one thread.
    """

    def __init__(
        self,
        block_size: int,
        *,
        sinks: Iterable[EventSink] = (),
        stats: PipelineStats | None = None,
    ) -> None:
        self.block_size = block_size
        self.sinks: list[EventSink] = list(sinks)
        self.source_sinks: dict[Source, list[EventSink]] = {}
        self.workers: dict[int, WorkerState] = {}
        self.stats = PipelineStats() if stats is None else stats
        self._warn = LogLimiter(log.warning)
        """Per-frame warnings, limited per stream and reason (the stats count every frame)."""

    def worker(self, worker_id: int) -> WorkerState:
        """The state of ``worker_id``, created with a fresh normalizer on first use."""
        worker = self.workers.get(worker_id)
        if worker is None:
            worker = self.workers[worker_id] = WorkerState(Normalizer(worker_id, self.block_size))
        return worker

    def add_source(self, source: Source, *sinks: EventSink) -> WorkerState:
        """Register ``source`` (and its worker, so that it is listed before any batch arrives),
        with sinks that get only this source's events."""
        if sinks:
            self.source_sinks.setdefault(source, []).extend(sinks)
        worker = self.worker(source.worker_id)
        worker.layout_ranks.setdefault(source, len(worker.layout_ranks))
        return worker

    def source_ranks(self, source: Source) -> list[int]:
        """The dp ranks ``source`` delivered, in order; before any batch, the rank it publishes
        by vLLM's layout (rank 0 for a source never registered with :meth:`add_source`)."""
        worker = self.worker(source.worker_id)
        seen = worker.ranks.get(source)
        return sorted(seen) if seen else [worker.layout_ranks.get(source, 0)]

    def feed(self, item: Message | StreamReset) -> None:
        """What a :class:`~kvbridge.adapters.subscriber.Subscriber` hands out: a batch or a
        reset."""
        if isinstance(item, StreamReset):
            self.feed_reset(item)
        else:
            self.feed_batch(item.source, item.payload, item.seq)

    def feed_record(self, record: FrameRecord, *, decoded: VllmBatch | None = None) -> None:
        """A capture record: its third frame is the payload. ``decoded`` is that payload
        already decoded, by a caller that inspects batches itself (``kvbridge validate``). A
        reset record resets its source as the recorder's subscriber did (:meth:`feed_reset`).

        A record without vLLM's framing (three frames, a sequence number a batch can have) is
        counted, logged and skipped for the reason a live message's would be
        (:attr:`FrameRecord.framing_error <kvbridge.adapters.capture.FrameRecord.framing_error>`),
        not decoded from whatever frame it ends with."""
        source = record_source(record)
        reset = record.stream_reset(source)
        if reset is not None:
            self.feed_reset(reset)
            return
        framing = record.framing_error
        if framing is not None:
            self.stats.batches_in += 1
            reason, error = framing
            skip_bad_frame(
                self.stats.bad_frames, self._warn, source.endpoint, reason, None, error=error
            )
            return
        self.feed_batch(source, record.frames[2] if decoded is None else decoded, record.seq)

    def feed_batch(
        self, source: Source, batch: bytes | memoryview | VllmBatch, seq: int | None
    ) -> None:
        """One batch of ``source``: a payload (frame 2), or a batch already decoded.

        ``seq`` becomes the Dynamo ``event_id`` of its events (``None``: the normalizer counts).
        """
        self.stats.batches_in += 1
        worker = self.worker(source.worker_id)
        uncleared = source in worker.uncleared
        try:
            normalized = worker.normalizer.process(batch, seq, reset_first=uncleared)
        except SchemaError as error:
            skip_bad_frame(
                self.stats.bad_frames,
                self._warn,
                source.endpoint,
                BadFrame.SCHEMA,
                seq,
                error=str(error),
            )
            return
        ts, rank = normalized.ts, normalized.dp_rank
        assert ts is not None and rank is not None  # a batch's result names its batch
        if uncleared:
            worker.uncleared.discard(source)
        worker.cleared.discard(source)
        worker.ranks.setdefault(source, set()).add(rank)
        worker.lag = max(0.0, time.time() - ts)
        self._emit(source, normalized, ts)

    def feed_reset(self, reset: StreamReset) -> None:
        """Clear the ranks ``reset.source`` delivered, or, if it delivered none yet, mark it
        uncleared so that its first batch clears its rank.

        Batches lost for good, or a restart that the publisher check could not confirm
        (:attr:`~kvbridge.adapters.source.StreamReset.checked`), leave the engine's blocks
        unknown downstream, not different: the identities are kept, so that the next store on
        a known chain announces it again. A restart the sequence or the check showed forgets
        them. A source reset again before its next batch (a restart, then the loss of the
        batches its replay could not deliver) is not cleared or logged twice, and its
        identities stay as the first reset left them: kept ones are never wrong to keep (a
        block's canonical identity is a function of its content, and no engine hash names two
        contents), only perhaps of no further use."""
        source = reset.source
        worker = self.worker(source.worker_id)
        keep = reset.reason != "restart" or not reset.checked
        ranks = sorted(worker.ranks.pop(source, ()))
        if ranks:
            worker.cleared.add(source)
        elif source in worker.cleared:
            return  # the reset before cleared it, and nothing came since
        else:
            worker.uncleared.add(source)
        self._warn(
            "worker cleared",
            (source.endpoint, reset.reason),
            worker_id=source.worker_id,
            stream=source.endpoint,
            reason=reset.reason,
            lost_batches=reset.lost_batches,
        )
        now = time.time()
        for rank in ranks:
            self._emit(source, worker.normalizer.process_reset(rank, keep_identities=keep), now)

    def snapshot(self, source: Source) -> list[NormalizedBatch]:
        """Everything ``source`` delivered, for a consumer that knows nothing: per dp rank it
        named (its layout rank if none yet, see :meth:`source_ranks`), a clear of the rank then
        every resident block."""
        normalizer = self.worker(source.worker_id).normalizer
        return [normalizer.process_snapshot(rank) for rank in self.source_ranks(source)]

    def _emit(self, source: Source, batch: NormalizedBatch, ts: float) -> None:
        if not batch:
            return
        for sink in self.sinks:
            sink.apply(batch, source, ts)
        for sink in self.source_sinks.get(source, ()):
            sink.apply(batch, source, ts)
