"""The stream counters of the subscriber, the pipeline and the relay's outputs, as types.

A counter is a field and a reason a frame was skipped is a :class:`BadFrame`, so that a
misspelt counter is a type error rather than a key nobody reads. Each exported field names
its Prometheus metric (and label) in its metadata, and
:mod:`~kvbridge.adapters.relay_metrics` builds its metric families from those and from the
:class:`BadFrame` members: a counter declared here is exported under the name it declares,
with no string to parse on the way. The name needs its help text in ``relay_metrics.METRICS``
too (a test scrapes every family, so a name without one fails there).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from kvbridge.adapters.logs import LogLimiter

__all__ = [
    "BadFrame",
    "Exported",
    "OutputStats",
    "PipelineStats",
    "SubscriberStats",
    "bad_frames",
    "exported",
    "skip_bad_frame",
]

_EXPORTED: Final = "exported"
"""The metadata key of an exported field."""


class BadFrame(StrEnum):
    """Why a message was skipped; the value is the ``reason`` label of
    ``kvbridge_bad_frames_total``."""

    FRAME_COUNT = "frame_count"
    """A message without exactly three frames (live, or a capture's record)."""
    BAD_SEQ = "bad_seq"
    """A sequence frame that is not 8 bytes, or that is the replay protocol's end marker
    (2**64 - 1), live or in a capture's record."""
    OVERSIZED = "oversized"
    """A frame over ``max_frame_bytes``."""
    SEQ_JUMP = "seq_jump"
    """A forward jump past ``max_gap`` (see the subscriber's "sequence jumps")."""
    THROTTLED = "throttled"
    """Live messages skipped while the stream is suspended, out of clear tokens. After a loss
    or a restart (of up to ``max_gap`` batches), the batches they carried may still come
    through the start-over's replay (then counted ``replayed`` too); those that do not are
    counted ``lost``. After a jump, the stream is resynced and nothing is counted lost."""
    REPLAY_FRAME_COUNT = "replay_frame_count"
    """A replay answer of neither layout."""
    REFUSED = "refused"
    """A replayed batch past ``MAXMSGSIZE``, which ZMQ refused by dropping the replay's
    connection (see the replay client's "refused batches"). One refused live drops the SUB's
    connection instead (``disconnects``)."""
    SCHEMA = "schema"
    """A payload that does not decode (counted by the pipeline)."""


@dataclass(frozen=True)
class Exported:
    """How a field is exported: the metric's name and, for a labelled family, the label's
    name and this field's value of it."""

    metric: str
    label: tuple[str, str] | None = None


def _exported(metric: str, label: tuple[str, str] | None = None) -> int:
    """An int counter field, exported as ``metric`` (with ``label``)."""
    return field(default=0, metadata={_EXPORTED: Exported(metric, label)})


def exported(
    stats: SubscriberStats | PipelineStats | OutputStats,
) -> Iterator[tuple[Exported, int]]:
    """Each exported field of ``stats`` with its count, in field order."""
    for counter in fields(stats):
        how = counter.metadata.get(_EXPORTED)
        if how is not None:
            yield how, getattr(stats, counter.name)


def skip_bad_frame(
    counts: Counter[BadFrame],
    warn: LogLimiter,
    endpoint: str,
    reason: BadFrame,
    seq: int | None,
    **fields: object,
) -> None:
    """Count a frame of ``endpoint``'s stream skipped for ``reason`` (every one) and log it
    (within ``warn``'s limits, per stream and reason), with ``fields``."""
    counts[reason] += 1
    warn(
        "bad frame skipped",
        (endpoint, reason),
        stream=endpoint,
        seq=seq,
        reason=reason.value,
        **fields,
    )


def bad_frames(*stats: SubscriberStats | PipelineStats) -> Counter[BadFrame]:
    """The frames skipped, by reason, over the subscriber's and the pipeline's counts (a
    frame is counted by one of them: the pipeline sees the messages the subscriber passed).
    Read from a scrape's thread too: each count is copied whole (under
    the GIL) before it is walked, as the loop may add a reason meanwhile."""
    total: Counter[BadFrame] = Counter()
    for counts in stats:
        total.update(dict(counts.bad_frames))
    return total


@dataclass
class SubscriberStats:
    """What :class:`~kvbridge.adapters.subscriber.Subscriber` counted, over every source."""

    messages: int = 0
    """Live messages with a valid frame layout (not exported: ``batches_total`` counts what
    the pipeline got)."""
    gaps: int = _exported("kvbridge_gaps_total")
    replays: int = _exported("kvbridge_replays_total")
    replayed: int = _exported("kvbridge_replayed_batches_total")
    lost: int = _exported("kvbridge_lost_batches_total")
    restarts: int = _exported("kvbridge_restarts_total")
    duplicates: int = _exported("kvbridge_duplicate_batches_total")
    resyncs: int = _exported("kvbridge_resyncs_total")
    disconnects: int = _exported("kvbridge_disconnects_total")
    reconnect_checks: int = _exported("kvbridge_reconnect_checks_total")
    replay_timeouts: int = _exported("kvbridge_replay_timeouts_total")
    replays_skipped: int = _exported("kvbridge_replays_skipped_total")
    replay_truncated: int = _exported("kvbridge_replay_truncated_total")
    repairs: int = _exported("kvbridge_repairs_total")
    bad_frames: Counter[BadFrame] = field(default_factory=Counter)
    """Messages skipped, by reason (every reason but :attr:`BadFrame.SCHEMA`)."""


@dataclass
class PipelineStats:
    """What a :class:`~kvbridge.adapters.pipeline.StreamPipeline` counted (a relay shares its
    own with its pipeline, and adds the batches it published)."""

    batches_in: int = _exported("kvbridge_batches_total", ("direction", "in"))
    """Every payload fed, good or bad."""
    batches_out: int = _exported("kvbridge_batches_total", ("direction", "out"))
    """Canonical payloads published (a relay merges the consecutive batches of an output
    that queued up, so during a backlog fewer go out than come in)."""
    bad_frames: Counter[BadFrame] = field(default_factory=Counter)
    """Payloads skipped, by reason: :attr:`BadFrame.SCHEMA`, and a capture record's framing
    (:attr:`BadFrame.FRAME_COUNT`, :attr:`BadFrame.BAD_SEQ`)."""


@dataclass
class OutputStats:
    """Batches a relay's outputs made themselves, summed over the outputs."""

    opened: int = _exported("kvbridge_output_batches_total", ("kind", "opening"))
    """The clears each output opens with."""
    heartbeats: int = _exported("kvbridge_output_batches_total", ("kind", "heartbeat"))
    """Empty batches of idle outputs."""
    snapshots: int = _exported("kvbridge_output_batches_total", ("kind", "snapshot"))
    """Answers to replay requests older than the buffer."""
