"""The recorded streams to compare: read from captures, each in its engine's order.

The captures are one fleet: a worker id belongs to one capture, and each capture's streams share
its block size (given, in its header, or of its first store with tokens).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Final

import msgspec

from kvbridge.adapters.capture import (
    CaptureError,
    CaptureReader,
    FrameRecord,
    Prompt,
    RecordedReset,
    capture_name,
    capture_streams,
)
from kvbridge.adapters.replay_protocol import MAX_SEQ
from kvbridge.normalizers import MAX_BLOCK_SIZE
from kvbridge.schemas import BlockStored, SchemaError, VllmBatch, decode_batch

__all__ = ["MAX_COMPARED_BLOCK_SIZE", "Stream", "decoded", "first_block_size", "load_streams"]


class Stream(msgspec.Struct):
    """One recorded stream, and the capture it comes from."""

    capture: str
    worker_id: int
    block_size: int
    records: list[FrameRecord]


def first_block_size(batch: VllmBatch) -> int | None:
    """The block size of the batch's first store with tokens (placeholders have none), if it is
    one a worker can have (up to :data:`~kvbridge.normalizers.MAX_BLOCK_SIZE`)."""
    for event in batch.events:
        if isinstance(event, BlockStored) and event.token_ids and event.block_size:
            return event.block_size if event.block_size <= MAX_BLOCK_SIZE else None
    return None


def decoded(record: FrameRecord) -> VllmBatch | None:
    """The record's batch, or ``None`` for a frame vLLM's shape or schema does not allow."""
    if record.seq is None:
        return None
    try:
        return decode_batch(record.frames[2])
    except SchemaError:
        return None


def _records_block_size(records: Iterable[FrameRecord]) -> int | None:
    for record in records:
        batch = decoded(record)
        size = None if batch is None else first_block_size(batch)
        if size:
            return size
    return None


MAX_COMPARED_BLOCK_SIZE: Final = 65_536
"""The largest block size a comparison takes: it sends blocks of its own (sentinels, a block of
tokens each) to both services, and Dynamo hashes and indexes them; no engine's blocks come near."""


def _read(path: str, block_size: int | None) -> tuple[list[Stream], list[Prompt]]:
    """A capture's streams, each with the capture's block size (given, in its header, or of
    its first store with tokens), and the prompts its header carries. The comparison feeds
    both services each stream's batches in its engine's order, and the restarts between its
    processes (:func:`_engine_order`)."""
    reader = CaptureReader(path)
    records = list(reader)
    size = block_size or reader.block_size or _records_block_size(records) or 0
    if records and not size:
        raise ValueError(f"{path}: no store with tokens tells the block size: give --block-size")
    if size > MAX_COMPARED_BLOCK_SIZE:
        raise CaptureError(
            f"{path}: block size {size} is above the {MAX_COMPARED_BLOCK_SIZE} a comparison takes"
        )
    streams = []
    for endpoint, stream in capture_streams(records).items():
        workers = sorted({record.worker_id for record in stream})
        if len(workers) > 1:
            raise CaptureError(
                f"{path}: stream {endpoint} names workers {', '.join(map(str, workers))}: a "
                "stream is one worker's, so a comparison cannot tell whose its blocks are"
            )
        _check_seq_room(path, endpoint, stream)
        ordered = _engine_order(stream)
        if ordered:  # not a stream of resets alone, recorded before its first message
            streams.append(Stream(path, workers[0], size, ordered))
    return streams, reader.prompts


def _check_seq_room(path: str, endpoint: str, records: Sequence[FrameRecord]) -> None:
    """Refuse a stream whose seqs leave no room for the comparison's sentinels.

    Each sentinel takes the seq after the last one sent on its stream and moves the later
    records one further, so a stream of ``n`` records needs ``n + 1`` seqs above its largest.
    Sent past :data:`~kvbridge.adapters.publisher.MAX_SEQ`, a seq would read as the replay
    protocol's end marker, and Dynamo would never show the sentinel.
    """
    last = max((record.seq for record in records if record.seq is not None), default=0)
    if last + len(records) + 1 > MAX_SEQ:
        raise CaptureError(
            f"{path}: stream {endpoint} reaches seq {last}, above the "
            f"{MAX_SEQ - len(records) - 1} a comparison of its {len(records)} records takes: it "
            "numbers its sentinel blocks after them, below 2**64 - 1"
        )


def _engine_order(records: Sequence[FrameRecord]) -> list[FrameRecord]:
    """A stream's messages in the order its engine published them, each batch once, with a
    ``"restart"`` reset record where a new process's batches begin.

    A batch the recorder recovered through the replay socket (stream ``replay:...``) was
    received after the live batch that showed the gap; sent in that order, Dynamo would drop
    it (a listener ignores a seq it has passed) where a listener with a replay endpoint would
    have fetched it. So each goes back among the live ones by its seq, within the run since the
    engine last restarted: a ``"restart"`` reset record (the recorder's subscriber found a new
    process, whose first batches it then replayed), or, in a capture without resets, a live seq
    going back, for which a restart record is made. A batch received twice in one run (a repair
    delivers the batches of a loss again) is kept once. A record without a seq stays after the
    one before it. The other resets (a loss, a repair) are left out: the comparison sends the
    engine's batches, not what the recorder missed of them.
    """
    run, last = 0, -1
    keyed: list[tuple[tuple[int, int, int], FrameRecord]] = []
    for position, record in enumerate(records):
        if record.reset is not None:
            if record.reset.reason == "restart":
                run, last = run + 1, -1
                keyed.append(((run, -1, position), record))  # first of its run
            continue
        seq, live = record.seq, not record.stream.startswith("replay:")
        if live and seq is not None:
            if seq < last:
                run += 1
                keyed.append(((run, -1, position), _restart_before(record)))
            last = seq
        keyed.append(((run, last if seq is None else seq, position), record))
    keyed.sort(key=lambda item: item[0])
    kept: list[FrameRecord] = []
    sent: set[tuple[int, int]] = set()
    for (run_of, _, _), record in keyed:
        if record.reset is not None:
            if kept and kept[-1].reset is None:  # a restart after batches, once
                kept.append(record)
            continue
        batch = None if record.seq is None else (run_of, record.seq)
        if batch not in sent:
            kept.append(record)
            if batch is not None:
                sent.add(batch)
    return kept


def _restart_before(record: FrameRecord) -> FrameRecord:
    """A ``"restart"`` reset record of ``record``'s stream, received with it."""
    return FrameRecord(
        record.received_ns, record.stream, record.worker_id, [], RecordedReset("restart")
    )


def _check_workers(streams: Sequence[Stream]) -> None:
    """A worker id belongs to one capture: the services see every capture as one fleet."""
    seen: dict[int, str] = {}
    for stream in streams:
        other = seen.setdefault(stream.worker_id, stream.capture)
        if other != stream.capture:
            raise ValueError(
                f"worker {stream.worker_id} is in both {other} and {stream.capture}: captures "
                "compared together are one fleet, so compare these in separate runs"
            )


def load_streams(
    names: Sequence[str], block_size: int | None, prompts: Sequence[Prompt] | None
) -> tuple[list[Stream], list[tuple[str, int, Prompt]]]:
    """Every capture's streams, and the prompts to ask with the capture and block size they
    are counted in (given prompts: those of the first stream)."""
    streams: list[Stream] = []
    asked: list[tuple[str, int, Prompt]] = []
    for name in names:
        captured, header_prompts = _read(name, block_size)
        streams += captured
        size = captured[0].block_size if captured else 0
        asked += [(capture_name(name), size, prompt) for prompt in header_prompts]
    _check_workers(streams)
    if prompts is not None:
        size = streams[0].block_size if streams else 0
        asked = [(", ".join(map(capture_name, names)), size, prompt) for prompt in prompts]
    return streams, asked
