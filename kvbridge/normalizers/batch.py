"""What normalizing one batch yields: canonical events, and the relay's payloads on request."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from kvbridge.normalizers.canonical import encode_canonical
from kvbridge.schemas.tiers import TieredEvent

__all__ = ["NormalizedBatch"]


class NormalizedBatch(Sequence[TieredEvent]):
    """The canonical events of one input batch (or of a reset), for any sink.

    A sink that republishes asks for :meth:`canonical_payloads`; one that indexes iterates the
    events. Both views describe the same events.
    """

    __slots__ = ("_block_size", "_events")

    def __init__(self, events: list[TieredEvent], block_size: int) -> None:
        self._events = events
        self._block_size = block_size

    def __len__(self) -> int:
        return len(self._events)

    def __iter__(self) -> Iterator[TieredEvent]:
        return iter(self._events)

    def __getitem__(self, index: int) -> TieredEvent:  # type: ignore[override]
        return self._events[index]

    @property
    def events(self) -> list[TieredEvent]:
        """The events as :class:`TieredEvent` values."""
        return self._events

    def canonical_payloads(self, ts: float) -> list[bytes]:
        """The canonical vLLM payloads that republish these events, one per dp-rank run."""
        return encode_canonical(self._events, self._block_size, ts)
