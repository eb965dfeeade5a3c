"""The comparison itself: replay the recorded streams into both Dynamos, then diff them.

Each record goes byte for byte to the *alone* side and through a
:class:`~kvbridge.adapters.pipeline.StreamPipeline` to the *bridged* side, in the order of
receipt over all streams. A restart record goes to the pipeline alone, which clears the worker
as the relay does; the raw stream only starts over, and Dynamo's listener ignores the new
process's batches until their seq passes the old process's last. Both sides are then read the
same way, by content (see the package's docstring), and each block on one side only is given
the cause the ledger knows, or that of its nearest differing ancestor, since Dynamo drops a
store whose parent it lacks.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Final

from kvbridge.adapters.capture import Prompt, capture_name
from kvbridge.adapters.capture_replay import in_receipt_order
from kvbridge.adapters.dynamo_compare.ledger import Key, Ledger
from kvbridge.adapters.dynamo_compare.recorded import Stream, decoded, load_streams
from kvbridge.adapters.dynamo_compare.report import (
    Cause,
    DynamoComparison,
    PromptOverlap,
    ResidentDiff,
    TierCounts,
    WorkerOverlap,
)
from kvbridge.adapters.dynamo_compare.side import Side
from kvbridge.adapters.pipeline import PublisherSink, StreamPipeline, record_source
from kvbridge.adapters.ports import free_port_range
from kvbridge.schemas.tiers import Tier

__all__ = ["compare_captures"]


def compare_captures(
    paths: Iterable[str | Path],
    *,
    block_size: int | None = None,
    prompts: Sequence[Prompt] | None = None,
) -> DynamoComparison:
    """Replay captures into Dynamo alone and through kvbridge, and compare what each holds.

    The captures are one fleet: every stream of every capture feeds the same two services,
    so that what one engine does to another's blocks (hashes that differ) shows. ``prompts``
    are asked of both services; without them each capture's header prompts are.

    Raises:
        ValueError: a worker id is in two captures, or a capture's block size is unknown.
        RuntimeError: Dynamo did not subscribe, or did not apply the streams in time.
        CaptureError: a file is not a readable capture.
    """
    start = time.monotonic()
    names = [str(path) for path in paths]
    streams, asked = load_streams(names, block_size, prompts)
    specs = [(stream.worker_id, stream.block_size) for stream in streams]
    base = free_port_range(2 * len(streams)) if streams else 0
    with contextlib.ExitStack() as stack:
        alone = Side(specs, base)
        stack.callback(alone.close)
        bridged = Side(specs, base + len(streams))
        stack.callback(bridged.close)
        ledger = _replay(streams, alone, bridged)
        alone.finish(specs)
        bridged.finish(specs)
        sentinels = frozenset(alone.sentinels | bridged.sentinels)
        resident = _diff(alone.resident(sentinels), bridged.resident(sentinels), ledger)
        overlaps = [
            _prompt_overlap(capture, size, prompt, alone, bridged)
            for capture, size, prompt in (asked if streams else [])  # no worker, nothing to ask
        ]
    return _summary(names, resident, overlaps, time.monotonic() - start)


def _summary(
    names: list[str], resident: list[ResidentDiff], overlaps: list[PromptOverlap], seconds: float
) -> DynamoComparison:
    missing = sum(sum(entry.missing.values()) for entry in resident)
    stale = sum(sum(entry.stale.values()) for entry in resident)
    causes: Counter[str] = Counter()
    for entry in resident:
        causes.update(entry.missing)
        causes.update(entry.stale)
    return DynamoComparison(
        captures=[capture_name(name) for name in names],
        differs=bool(missing or stale or any(p.differs for p in overlaps)),
        missing=missing,
        stale=stale,
        causes=dict(sorted(causes.items())),
        resident=resident,
        prompts=overlaps,
        seconds=round(seconds, 3),
    )


def _replay(streams: Sequence[Stream], alone: Side, bridged: Side) -> Ledger:
    """Send every record raw to one side and through the pipeline to the other, in the order
    of receipt over all streams (each stream's own order kept), a restart to the pipeline only;
    the ledger follows the raw events, and which of them Dynamo's listener ignores. Before the
    first record of another capture, the raw side waits until Dynamo has applied the streams
    sent so far (:meth:`Side.sync`), so that the engine whose batches came first is the first
    writer in Dynamo too, whatever its listeners' timing."""
    ledger = Ledger({stream.worker_id: stream.block_size for stream in streams})
    pipelines: dict[str, StreamPipeline] = {}
    for index, stream in enumerate(streams):
        pipeline = pipelines.setdefault(stream.capture, StreamPipeline(stream.block_size))
        sink = PublisherSink(bridged.publishers[index])
        pipeline.add_source(record_source(stream.records[0]), sink)
    sent: dict[int, int] = {}
    """Streams of the capture being replayed, sent since the last sync: {index: worker_id}."""
    capture: str | None = None
    for index, record in in_receipt_order([stream.records for stream in streams]):
        stream = streams[index]
        pipeline = pipelines[stream.capture]
        if record.reset is not None:  # a restart: the raw stream just starts over
            ranks = pipeline.source_ranks(record_source(record))  # what the reset clears
            ledger.restart(stream.worker_id, set(ranks))
            pipeline.feed_record(record)
            continue
        if stream.capture != capture:
            if sent:
                alone.sync(sent)
                sent = {}
            capture = stream.capture
        sent[index] = stream.worker_id
        applied = alone.send_recorded(index, record.frames, record.seq)
        batch = decoded(record)
        if batch is not None:
            ledger.observe(stream.worker_id, batch, passed=not applied)
            rank = batch.data_parallel_rank or 0
            alone.last_rank[index] = bridged.last_rank[index] = rank
        pipeline.feed_record(record, decoded=batch)
    return ledger


def _diff(
    alone: Mapping[Key, int | None], bridged: Mapping[Key, int | None], ledger: Ledger
) -> list[ResidentDiff]:
    """Per worker, rank and tier: the blocks on one side only, each with its cause."""
    missing = [key for key in bridged if key not in alone]
    stale = [key for key in alone if key not in bridged]
    missing_causes = _causes(missing, bridged, ledger.missing)
    stale_causes = _causes(stale, alone, ledger.stale)
    places = sorted({key[:3] for key in alone} | {key[:3] for key in bridged}, key=_place_order)
    held_alone = Counter(key[:3] for key in alone)
    held_bridged = Counter(key[:3] for key in bridged)
    result = []
    for place in places:
        worker_id, dp_rank, tier = place
        result.append(
            ResidentDiff(
                worker_id,
                dp_rank,
                tier,
                alone=held_alone[place],
                bridged=held_bridged[place],
                missing=_tally(missing_causes, place),
                stale=_tally(stale_causes, place),
            )
        )
    return result


_TIER_ORDER: Final = {tier.value: index for index, tier in enumerate(Tier)}


def _place_order(place: tuple[int, int, str]) -> tuple[int, int, int]:
    return place[0], place[1], _TIER_ORDER.get(place[2], len(_TIER_ORDER))


def _tally(causes: Mapping[Key, str], place: tuple[int, int, str]) -> dict[str, int]:
    return dict(sorted(Counter(c for key, c in causes.items() if key[:3] == place).items()))


def _causes(
    keys: Sequence[Key], side: Mapping[Key, int | None], known: Mapping[Key, Cause]
) -> dict[Key, Cause]:
    """The cause of each differing block: its own, else that of its nearest differing
    ancestor (looked up on its tier, then on the device tier), else unexplained."""
    differing = set(keys)
    result: dict[Key, Cause] = {}
    for key in keys:
        chain = []
        current: Key | None = key
        while current is not None and current not in result and current not in known:
            chain.append(current)
            current = _differing_parent(current, side, differing)
        if current is None:
            cause = Cause.UNEXPLAINED
        else:
            cause = result.setdefault(current, known.get(current, Cause.UNEXPLAINED))
        for step in chain:
            result[step] = cause
    return result


def _differing_parent(key: Key, side: Mapping[Key, int | None], differing: set[Key]) -> Key | None:
    parent = side.get(key)
    if parent is None:
        return None
    worker_id, dp_rank, tier, _ = key
    for place_tier in (tier, Tier.DEVICE.value):
        candidate = (worker_id, dp_rank, place_tier, parent)
        if candidate in side:
            return candidate if candidate in differing else None
    return None


def _prompt_overlap(
    capture: str, block_size: int, prompt: Prompt, alone: Side, bridged: Side
) -> PromptOverlap:
    """One prompt's ``overlap_scores`` on each side, workers with no overlap on either left out."""
    a, b = alone.overlap(prompt), bridged.overlap(prompt)
    none = TierCounts(0, 0, 0)
    workers = [
        WorkerOverlap(worker_id, dp_rank, a.get(place, none), b.get(place, none))
        for place in sorted(set(a) | set(b))
        for worker_id, dp_rank in [place]
        if a.get(place, none) != none or b.get(place, none) != none
    ]
    return PromptOverlap(
        capture,
        prompt.name,
        blocks=len(prompt.token_ids) // block_size,
        workers=workers,
        differs=any(w.alone != w.bridged for w in workers),
    )
