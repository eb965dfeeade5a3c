"""What normalizing one batch yields: canonical events, and the relay's payloads on request."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Final, TypeAlias

import msgspec

from kvbridge import _core
from kvbridge.schemas.tiers import TieredEvent

__all__ = ["TIERED_EVENTS", "NormalizedBatch", "merged_canonical_payloads"]

TIERED_EVENTS: Final = msgspec.msgpack.Decoder(list[TieredEvent])
"""Builds a batch's events from the core's bytes, in one pass."""

NormalizedBatch: TypeAlias = _core.NormalizedBatch
"""The canonical events of one input batch (or of a reset), for any sink: a sequence of
:class:`TieredEvent` with the input batch's ``ts`` and ``dp_rank`` (``None`` for a reset).

The core keeps the events as it wrote them. A sink that republishes asks for
``canonical_payloads(ts)``, the relay's canonical vLLM payloads made without a Python object
per block (one per dp-rank run: an array batch of tagged-map events in vLLM 0.32's layout,
canonical hashes, media Dynamo knows, tokens on every store and the cache salt where Dynamo
reads it). One that indexes reads ``events`` (or iterates), :class:`TieredEvent` values
built on first use in one msgspec pass (:data:`TIERED_EVENTS`).

It is the core's own type, so that a batch costs no Python object of its own: one is made
per payload, on the hot path of every pipeline."""

Sequence.register(_core.NormalizedBatch)


def merged_canonical_payloads(
    batches: Sequence[tuple[NormalizedBatch, float]], max_bytes: int
) -> list[bytes]:
    """The canonical payloads of consecutive batches of one normalizer, each given with the
    time to stamp it with, in as few messages as fit: their events in order, one payload per
    run of one dp rank, each closed before the batch that would take it past ``max_bytes``
    (a batch is never split by size, so one larger than that goes out alone) and stamped with
    the time of the last batch whose events it holds. Any ``max_bytes`` from ``sys.maxsize``
    up means no bound.

    A relay with a backlog sends one message where it would send several: every message costs
    ZMQ a wake-up and a write at both ends, which dominates a small batch's cost.
    """
    if max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
    if len(batches) == 1:  # a batch that arrived alone: nothing to merge or weigh
        batch, ts = batches[0]
        return batch.canonical_payloads(ts)
    return _core.canonical_payloads(list(batches), min(max_bytes, sys.maxsize))
