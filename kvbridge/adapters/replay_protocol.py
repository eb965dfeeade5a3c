"""vLLM's replay protocol, both sides of it: the frames of a request and of its answer.

The publisher's ROUTER (:class:`~kvbridge.adapters.publisher.Publisher`) and the subscriber's
DEALER (:class:`~kvbridge.adapters.replay_client.ReplayClient`) speak it with each other, and
with vLLM engines and Dynamo's listener, so the layouts are written once, here.

A request is ``[b"", start_seq8]`` from a DEALER, which the ROUTER receives as
``[identity, b"", start_seq8]``. The answer is one message per batch from ``start_seq`` on, then
an end marker, in one of two layouts (as a DEALER receives them):

====================  ================================  ===========================
layout                per batch                         end marker
====================  ================================  ===========================
vLLM 0.26+            ``[b"", topic, seq8, payload]``   ``[b"", b"", FF*8, b""]``
legacy (<= 0.25)      ``[b"", seq8, payload]``          ``[b"", FF*8, b""]``
====================  ================================  ===========================

``seq8`` is the sequence number as 8 bytes, unsigned big-endian.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "END_SEQ",
    "MAX_SEQ",
    "ReplayedFrames",
    "answer_frames",
    "end_frames",
    "parse_answer",
    "parse_request",
    "request_frames",
    "seq8",
]

END_SEQ: Final[bytes] = b"\xff" * 8
"""Seq frame of the end marker: -1 as a signed 8-byte big-endian int."""
MAX_SEQ: Final[int] = 2**64 - 2
"""Largest seq a batch can have; 2**64 - 1 would be indistinguishable from :data:`END_SEQ`."""

ReplayedFrames = tuple[bytes, bytes, bytes]
"""One answered batch, as ``(topic, seq frame, payload)``."""


def seq8(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def request_frames(start_seq: int) -> list[bytes]:
    """What a DEALER sends to ask for every batch from ``start_seq``."""
    return [b"", seq8(start_seq)]


def parse_request(frames: list[bytes]) -> tuple[bytes, int] | None:
    """``(identity, start_seq)`` of a request as a ROUTER receives it; ``None`` for anything
    that is not exactly ``[identity, b"", start_seq8]``."""
    if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
        return None
    return frames[0], int.from_bytes(frames[2], "big")


def answer_frames(
    identity: bytes, topic: bytes, seq: int, payload: bytes, *, topic_frame: bool
) -> tuple[bytes, ...]:
    """One batch of an answer, as the ROUTER sends it to ``identity``."""
    if topic_frame:
        return (identity, b"", topic, seq8(seq), payload)
    return (identity, b"", seq8(seq), payload)


def end_frames(identity: bytes, *, topic_frame: bool) -> tuple[bytes, ...]:
    """The end marker of an answer, as the ROUTER sends it to ``identity``."""
    return (identity, b"", b"", END_SEQ, b"") if topic_frame else (identity, b"", END_SEQ, b"")


def parse_answer(frames: list[bytes], topic: bytes) -> ReplayedFrames | None:
    """A message of an answer as a DEALER receives it, in either layout: ``(topic, seq frame,
    payload)``, where the legacy layout gets ``topic``; ``None`` for another frame count. The
    end marker parses too: its seq frame is :data:`END_SEQ` and its payload empty."""
    body = frames[1:] if frames and frames[0] == b"" else frames
    if len(body) == 3:
        return body[0], body[1], body[2]
    if len(body) == 2:
        return topic, body[0], body[1]
    return None
