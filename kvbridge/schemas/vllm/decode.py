"""Decoding vLLM payloads into the typed events: :func:`decode_batch`, the entry point.

Decoding is tolerant but never guesses: unknown trailing positions and unknown map keys are
ignored and counted, while an unknown event tag, a wrong type, a value out of its range, a
``BlockStored`` whose tokens cannot cover its hashes, malformed msgpack or arrays and maps nested
deeper than :data:`~kvbridge.schemas.vllm.types.MAX_NESTING` raise :class:`SchemaError` (naming
the event index and the field where they are known). :func:`decode_batch` raises nothing else
for any payload.

A payload takes one of two paths: the fast one (:mod:`~kvbridge.schemas.vllm.fast_decode`), a
whole batch in one pass of msgspec, and if that refuses it, the event-by-event one
(:mod:`~kvbridge.schemas.vllm.event_decode`), which counts unknown fields and names the bad
field.
"""

from __future__ import annotations

from kvbridge.schemas.errors import SchemaError
from kvbridge.schemas.vllm.event_decode import decode_by_event
from kvbridge.schemas.vllm.fast_decode import decode_fast
from kvbridge.schemas.vllm.types import VllmBatch

__all__ = ["decode_batch"]


def decode_batch(payload: bytes | memoryview) -> VllmBatch:
    """Decode the msgpack payload (frame 2) of any vLLM release that publishes KV events.

    Raises:
        SchemaError: for any payload that is not a valid batch of a known layout (and nothing
            else for any payload).
    """
    if not payload:
        raise SchemaError("batch: empty payload")
    batch = decode_fast(payload)
    return decode_by_event(payload) if batch is None else batch
