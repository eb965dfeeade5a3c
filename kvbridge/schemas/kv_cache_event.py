"""Dynamo's ``KvCacheEvent`` JSON, exactly the form ``RadixTree.apply_event`` accepts.

Hashes are unsigned 64-bit: Dynamo rejects negative values and strings. A clear is the bare
string ``"cleared"``; stores and removals are single-key objects with lower-case variant names.

The structs are ``gc=False``: as msgspec builds them they hold scalars and lists of each other,
never a reference back up, so none is part of a reference cycle (see ``TieredEvent``).
"""

from __future__ import annotations

from typing import Annotated, Literal, TypeAlias

import msgspec

__all__ = [
    "U64",
    "EventData",
    "KvCacheEvent",
    "MmExtraInfo",
    "MmObject",
    "RemovedData",
    "StoredBlock",
    "StoredData",
]

U64: TypeAlias = Annotated[int, msgspec.Meta(ge=0)]
"""An unsigned 64-bit hash. msgspec itself rejects integers above 2**64 - 1."""


class MmObject(msgspec.Struct, gc=False):
    mm_hash: U64
    offsets: list[tuple[int, int]]


class MmExtraInfo(msgspec.Struct, gc=False):
    mm_objects: list[MmObject]


class StoredBlock(msgspec.Struct, omit_defaults=True, gc=False):
    block_hash: U64
    """The external hash: kvbridge always sends the canonical rolling sequence hash here."""
    tokens_hash: U64
    """Dynamo's content hash of the block's tokens (its ``LocalBlockHash``)."""
    mm_extra_info: MmExtraInfo | None = None


class StoredData(msgspec.Struct, omit_defaults=True, gc=False):
    parent_hash: U64 | None
    blocks: list[StoredBlock]
    start_position: int | None = None


class RemovedData(msgspec.Struct, gc=False):
    block_hashes: list[U64]


class EventData(msgspec.Struct, omit_defaults=True, gc=False):
    """Exactly one of ``stored`` or ``removed`` is set."""

    stored: StoredData | None = None
    removed: RemovedData | None = None


class KvCacheEvent(msgspec.Struct, gc=False):
    event_id: U64
    data: EventData | Literal["cleared"]
    dp_rank: Annotated[int, msgspec.Meta(ge=0, le=0xFFFF_FFFF)] = 0
