"""What a subscriber reads from and hands on: a :class:`Source` (one vLLM publisher), each batch
as a :class:`Message` of raw frames, and a :class:`StreamReset` when what a consumer derived
from a source must be cleared. Plain values, shared by the subscriber, the pipeline, the relay
and the recorder.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from kvbridge.adapters.endpoints import should_bind
from kvbridge.adapters.replay_protocol import seq8

__all__ = ["Message", "ResetReason", "Source", "StreamReset"]


class Source(msgspec.Struct, frozen=True):
    """One vLLM publisher: its configured ``endpoint`` (vLLM's ``KVEventsConfig.endpoint``),
    its replay endpoint, and the worker it belongs to.

    ``bind`` overrides vLLM's bind/connect rule, e.g. to connect to a remote engine that binds
    ``tcp://*:5557`` (give ``tcp://10.0.0.5:5557`` with ``bind=False``).
    """

    endpoint: str
    replay_endpoint: str | None = None
    worker_id: int = 0
    topic: str = ""
    bind: bool | None = None

    @property
    def subscriber_binds(self) -> bool:
        return not should_bind(self.endpoint) if self.bind is None else self.bind


class Message(msgspec.Struct, frozen=True):
    """One batch as received, live or through a replay."""

    source: Source
    seq: int
    topic: bytes
    payload: bytes
    received_ns: int
    replayed: bool = False

    @property
    def frames(self) -> list[bytes]:
        return [self.topic, seq8(self.seq), self.payload]


ResetReason = Literal["restart", "lost", "repair"]
"""Why a stream was reset: a new process (or a stream that moved, or a publisher that could not
be checked: :attr:`StreamReset.checked`), batches lost from the same process (whose block
identities survive downstream), or a repair: the batches of such a loss are to be had after
all, and the stream is delivered again from its first (identities survive too)."""


class StreamReset(msgspec.Struct, frozen=True):
    """The consumer must clear everything it derived from this source."""

    source: Source
    reason: ResetReason
    lost_batches: int = 0
    """For ``"lost"``: batches that no replay could recover (a lower bound if unknown)."""
    checked: bool = True
    """``False`` for a ``"restart"`` taken from a publisher check that went unanswered: the
    publisher may as well be the same process going on, so a consumer keeps what the worker's
    engine hashes stand for, as after a loss (a new process's hashes do not name other
    blocks than an old one's did)."""
