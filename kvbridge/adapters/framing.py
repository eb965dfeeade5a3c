"""vLLM's message framing, ``[topic, seq, payload]``, and what makes a message not a batch.

One check for every reader of messages: the subscriber's live messages and every reader of a
capture's records (the pipeline, ``validate``) skip a message for the same reason, and count
it under the same :class:`~kvbridge.adapters.stream_stats.BadFrame`.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvbridge.adapters.replay_protocol import END_SEQ
from kvbridge.adapters.stream_stats import BadFrame

__all__ = ["framing_error"]


def framing_error(frames: Sequence[bytes]) -> tuple[BadFrame, str] | None:
    """Why a message of ``frames`` is not a vLLM batch whatever its payload, if it is not: the
    reason it counts under, and what is wrong. The sequence frame is 8 bytes, big-endian, and
    not 2**64 - 1, the replay protocol's end marker, which a replay of that batch could not
    be told from."""
    if len(frames) != 3:
        return BadFrame.FRAME_COUNT, f"expected 3 frames, got {len(frames)}"
    seq_frame = frames[1]
    if len(seq_frame) != 8:
        return BadFrame.BAD_SEQ, f"sequence frame has {len(seq_frame)} bytes, expected 8"
    if seq_frame == END_SEQ:
        return BadFrame.BAD_SEQ, "sequence frame is 2**64 - 1, the replay protocol's end marker"
    return None
