"""The records of a ``.kvcap`` capture after its header: a message as received, or a reset.

A reset record keeps what the recorder's subscriber concluded between two messages: the engine
restarted, batches were lost for good, or a loss was repaired and the stream is delivered again
(:class:`~kvbridge.adapters.source.StreamReset`). A reader that applies the records in order,
resets included, builds what the relay built from the same stream; without them, a stream that
restarted or was repaired would be read as one process whose batches came twice.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from kvbridge.adapters.framing import framing_error
from kvbridge.adapters.source import ResetReason, Source, StreamReset
from kvbridge.adapters.stream_stats import BadFrame

__all__ = ["FrameRecord", "RecordedReset"]


class RecordedReset(msgspec.Struct, frozen=True, omit_defaults=True):
    """A reset of the record's stream: the fields of
    :class:`~kvbridge.adapters.source.StreamReset` but its source, which the record names."""

    reason: ResetReason
    lost_batches: Annotated[int, msgspec.Meta(ge=0)] = 0
    checked: bool = True


class FrameRecord(msgspec.Struct, array_like=True, frozen=True):
    """One captured ZMQ message, or a reset of its stream (no frames, and :attr:`reset`). A
    capture's records are checked as they are read: a worker id is Dynamo's u64, and a message
    has at least one frame."""

    received_ns: int
    stream: str
    worker_id: Annotated[int, msgspec.Meta(ge=0)]
    frames: list[bytes]
    reset: RecordedReset | None = None

    def __post_init__(self) -> None:
        if (self.reset is None) == (not self.frames):
            raise ValueError(
                "a record has frames (a message) or a reset, not both"
                if self.frames
                else "a message has at least one frame"
            )

    @property
    def seq(self) -> int | None:
        """The vLLM sequence number, if the record is a message with vLLM's three-frame shape
        and its seq frame is one a batch can have (not the replay protocol's end marker,
        2**64 - 1)."""
        if self.reset is None and self.framing_error is None:
            return int.from_bytes(self.frames[1], "big")
        return None

    @property
    def framing_error(self) -> tuple[BadFrame, str] | None:
        """Why the message is not a vLLM batch whatever its payload, if it is not
        (:func:`~kvbridge.adapters.framing.framing_error`, as for a live message); ``None``
        for a reset, which is no message."""
        return None if self.reset is not None else framing_error(self.frames)

    def stream_reset(self, source: Source) -> StreamReset | None:
        """The reset this record keeps, of ``source`` (the record's own); ``None`` for a
        message."""
        if self.reset is None:
            return None
        reset = self.reset
        return StreamReset(source, reset.reason, reset.lost_batches, reset.checked)
