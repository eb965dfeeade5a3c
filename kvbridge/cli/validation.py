"""``kvbridge validate``: check recorded streams against the schemas, frame by frame.

Every frame of every capture is decoded and normalized exactly as the relay would, through the
same :class:`~kvbridge.adapters.pipeline.StreamPipeline`. A frame that cannot be decoded is a
problem; with ``strict``, so are unknown fields (the engine sends something this kvbridge does
not know yet) and blocks the normalizer would not forward. Each problem names the capture, the
record, the stream, the sequence number and, where it lies inside an event, the event index and
the field.

A run can also fail on what is *not* there, so that a CI recording that caught nothing, or not
what it was meant to exercise, does not pass: a capture without frames (unless ``allow_empty``),
fewer frames than ``min_frames`` over all captures, or no event with a medium of
``require_media`` (``CPU``, ``DISK``... matched without regard to case; an event without a medium
is ``GPU``) in any capture. Each such requirement left unmet is one line of
:attr:`Report.unmet`.

With ``--compare-dynamo`` the report also carries :attr:`Report.dynamo`, what a real Dynamo
gets wrong on these captures without kvbridge
(:func:`~kvbridge.adapters.dynamo_compare.compare_captures`); it does not change
:attr:`Report.valid`.

The JSON report is a :class:`Report`; ``kvbridge validate --json-schema`` prints its schema.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Final

import msgspec
from msgspec.structs import replace

from kvbridge.adapters.capture import CaptureReader, FrameRecord, capture_name
from kvbridge.adapters.dynamo_compare import DynamoComparison, first_block_size, render_comparison
from kvbridge.adapters.pipeline import StreamPipeline
from kvbridge.normalizers import DropReason
from kvbridge.schemas import BlockRemoved, BlockStored, SchemaError, VllmBatch, decode_batch

__all__ = ["BENIGN", "Problem", "Report", "render_text", "validate_captures"]

BENIGN: Final = frozenset(
    (DropReason.DUPLICATE_STORE, DropReason.STILL_REFERENCED, DropReason.CLEARED_EARLIER)
)
"""Not forwarded, yet nothing is lost (reference counting; removals of blocks a reset already
cleared). Never a problem, even strict."""


class Problem(msgspec.Struct, omit_defaults=True):
    """One frame that failed validation."""

    capture: str
    record: int
    """Index of the frame record in its capture, from 0."""
    stream: str
    worker_id: int
    reason: str
    """``frame_count``, ``bad_seq``, ``schema``; strict also ``unknown_field`` and drop reasons."""
    message: str
    seq: int | None = None
    event_index: int | None = None
    field: str | None = None
    count: int = 1
    """Blocks or fields concerned, for strict-mode reasons."""


class Report(msgspec.Struct):
    """The outcome of validating one or more captures."""

    valid: bool
    strict: bool
    captures: list[str]
    frames: int
    """Message records; a capture's reset records are not frames."""
    events: int
    invalid_frames: int
    problems: list[Problem]
    summary: dict[str, int]
    """Problems by reason."""
    dropped: dict[str, int]
    """Blocks not forwarded, by reason, over all frames (reported whether strict or not)."""
    unknown_fields: int
    media: dict[str, int] = {}
    """Events (stores and removals) by medium, upper-cased; an event without one is ``GPU``."""
    unmet: list[str] = []
    """Requirements the captures do not meet (no frames, too few frames, a missing medium)."""
    resets: int = 0
    """Reset records (``kvbridge record`` keeps the resets of its streams): each resets its
    stream as the relay did."""
    dynamo: DynamoComparison | None = None
    """With ``--compare-dynamo``: Dynamo fed the raw streams against Dynamo fed through
    kvbridge."""


class _Stream:
    """One worker across the frames of a capture: a pipeline of its own, started once its block
    size is known.

    Validation decodes each frame itself (it reports the schema errors, counts the vLLM events
    and finds the block size in the first store with tokens), so the pipeline gets the decoded
    batch and does not decode it again. A pipeline per worker, not per capture, because each
    worker may find its own block size.
    """

    def __init__(self, worker_id: int, block_size: int | None) -> None:
        self.worker_id = worker_id
        self.block_size = block_size
        self.pipeline: StreamPipeline | None = None

    def reset(self, record: FrameRecord) -> None:
        """Apply a reset record, as the relay applied the reset (nothing to clear before the
        pipeline starts)."""
        if self.pipeline is not None:
            self.pipeline.feed_record(record)

    def normalize(self, record: FrameRecord, batch: VllmBatch) -> Counter[str]:
        """Normalize a record's decoded batch; returns what it added to the drop counters."""
        if self.pipeline is None:
            size = self.block_size or first_block_size(batch)
            if size is None:
                return Counter()  # nothing indexable yet: wait for a store with tokens
            self.pipeline = StreamPipeline(size)
        normalizer = self.pipeline.worker(self.worker_id).normalizer
        before = Counter(normalizer.dropped)
        self.pipeline.feed_record(record, decoded=batch)
        added: Counter[str] = Counter()
        for (_, _, reason), count in (normalizer.dropped - before).items():
            added[reason] += count
        return added


def validate_captures(
    paths: Iterable[str | Path],
    *,
    strict: bool = False,
    block_size: int | None = None,
    allow_empty: bool = False,
    min_frames: int = 0,
    require_media: Iterable[str] = (),
) -> Report:
    """Validate captures. Without ``block_size`` each worker's is taken from the capture's
    ``meta["block_size"]`` or from its first store with tokens.

    A capture without frames fails unless ``allow_empty``; fewer than ``min_frames`` frames over
    all captures fail, and so does a medium of ``require_media`` that no event has."""
    problems: list[Problem] = []
    unmet: list[str] = []
    media: Counter[str] = Counter()
    dropped: Counter[str] = Counter()
    frames = events = unknown = resets = 0
    invalid: set[tuple[str, int]] = set()
    names = []
    for path in paths:
        reader = CaptureReader(path)
        name = capture_name(path)
        names.append(name)
        size = block_size or reader.block_size
        streams: dict[int, _Stream] = {}
        first_frame = frames
        for index, record in enumerate(reader):
            stream = streams.setdefault(record.worker_id, _Stream(record.worker_id, size))
            if record.reset is not None:
                resets += 1
                stream.reset(record)
                continue
            frames += 1
            where = Problem(name, index, record.stream, record.worker_id, "", "", seq=record.seq)
            framing = record.framing_error
            if framing is not None:
                problems.append(replace(where, reason=framing[0].value, message=framing[1]))
                invalid.add((name, index))
                continue
            try:
                batch = decode_batch(record.frames[2])
            except SchemaError as error:
                problems.append(
                    replace(
                        where,
                        reason="schema",
                        message=str(error),
                        event_index=error.event_index,
                        field=error.field,
                    )
                )
                invalid.add((name, index))
                continue
            events += len(batch.events)
            unknown += batch.unknown_fields
            for event in batch.events:
                if isinstance(event, BlockStored | BlockRemoved):
                    media[(event.medium or "GPU").upper()] += 1
            drops = stream.normalize(record, batch)
            dropped.update(drops)
            if not strict:
                continue
            if batch.unknown_fields:
                message = f"{batch.unknown_fields} unknown field(s) ignored"
                problems.append(
                    replace(
                        where,
                        reason=DropReason.UNKNOWN_FIELD,
                        message=message,
                        count=batch.unknown_fields,
                    )
                )
                invalid.add((name, index))
            for reason, count in sorted(drops.items()):
                if reason in BENIGN:
                    continue
                message = f"{count} block(s) not forwarded: {reason}"
                problems.append(replace(where, reason=reason, message=message, count=count))
                invalid.add((name, index))
        if frames == first_frame and not allow_empty:
            unmet.append(f"{name}: no frames (--allow-empty accepts an empty capture)")
    if frames < min_frames:
        unmet.append(f"{frames} frames, fewer than --min-frames {min_frames}")
    seen = ", ".join(f"{medium}={count}" for medium, count in sorted(media.items())) or "none"
    for medium in dict.fromkeys(m.upper() for m in require_media):
        if not media[medium]:
            unmet.append(f"no event with medium {medium} (media seen: {seen})")
    summary = Counter(problem.reason for problem in problems)
    return Report(
        valid=not problems and not unmet,
        strict=strict,
        captures=names,
        frames=frames,
        resets=resets,
        events=events,
        invalid_frames=len(invalid),
        problems=problems,
        summary=dict(sorted(summary.items())),
        dropped=dict(sorted(dropped.items())),
        unknown_fields=unknown,
        media=dict(sorted(media.items())),
        unmet=unmet,
    )


def render_text(report: Report) -> str:
    """The human-readable report: one line per problem, then the summary, then the comparison
    with Dynamo if there is one."""
    lines = []
    for problem in report.problems:
        seq = "-" if problem.seq is None else problem.seq
        lines.append(
            f"{problem.capture}: record {problem.record}, stream {problem.stream}, "
            f"worker {problem.worker_id}, seq {seq}: [{problem.reason}] {problem.message}"
        )
    verdict = "valid" if report.valid else "INVALID"
    mode = " (strict)" if report.strict else ""
    lines.append(
        f"{verdict}{mode}: {report.frames} frames, {report.events} events, "
        f"{report.invalid_frames} invalid frames in {len(report.captures)} capture(s)"
        + (f", {report.resets} stream resets" if report.resets else "")
    )
    for reason, count in report.summary.items():
        lines.append(f"  {reason}: {count}")
    for requirement in report.unmet:
        lines.append(f"  {requirement}")
    if report.dropped:
        not_forwarded = ", ".join(f"{k}={v}" for k, v in report.dropped.items())
        lines.append(f"  not forwarded (blocks): {not_forwarded}")
    if report.dynamo is not None:
        lines.append(render_comparison(report.dynamo))
    return "\n".join(lines)
