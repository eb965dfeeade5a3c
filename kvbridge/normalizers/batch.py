"""What normalizing one batch yields: canonical events, and the relay's payloads on request."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from typing import Final

import msgspec

from kvbridge import _core
from kvbridge.schemas.tiers import TieredEvent

__all__ = ["NormalizedBatch", "merged_canonical_payloads"]

_TIERED_EVENTS: Final = msgspec.msgpack.Decoder(list[TieredEvent])


class NormalizedBatch(Sequence[TieredEvent]):
    """The canonical events of one input batch (or of a reset), for any sink.

    The core keeps them as it wrote them. A sink that republishes asks for
    :meth:`canonical_payloads`, bytes made without a Python object per block; one that indexes
    iterates the :class:`TieredEvent` values, built on first use in one msgspec pass.
    """

    __slots__ = ("_events", "_output")

    def __init__(self, output: _core.Output) -> None:
        self._output = output
        self._events: list[TieredEvent] | None = None

    def __len__(self) -> int:
        return len(self._output)

    @property
    def ts(self) -> float | None:
        """The engine time of the input batch; ``None`` for a reset."""
        return self._output.ts

    @property
    def dp_rank(self) -> int | None:
        """The dp rank of the input batch (0 when it names none); ``None`` for a reset."""
        return self._output.dp_rank

    def __iter__(self) -> Iterator[TieredEvent]:
        return iter(self.events)

    def __getitem__(self, index: int) -> TieredEvent:  # type: ignore[override]
        return self.events[index]

    @property
    def events(self) -> list[TieredEvent]:
        """The events as :class:`TieredEvent` values."""
        if self._events is None:
            self._events = _TIERED_EVENTS.decode(self._output.tiered_events())
        return self._events

    def canonical_payloads(self, ts: float) -> list[bytes]:
        """The canonical vLLM payloads that republish these events, one per dp-rank run: an
        array batch of tagged-map events (vLLM 0.32's layout), canonical hashes, media Dynamo
        knows, tokens on every store and the cache salt where Dynamo reads it."""
        return self._output.canonical_payloads(ts)


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
    outputs = [(batch._output, ts) for batch, ts in batches]
    return _core.canonical_payloads(outputs, min(max_bytes, sys.maxsize))
