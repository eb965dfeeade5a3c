"""The canonical, tier-annotated event that every kvbridge sink consumes."""

from __future__ import annotations

import enum

import msgspec

from kvbridge.schemas.kv_cache_event import KvCacheEvent
from kvbridge.schemas.token_ids import EMPTY, TokenIds

__all__ = ["Tier", "TieredEvent"]


class Tier(enum.Enum):
    """Where a block is resident, in Dynamo's storage-tier vocabulary, fastest first."""

    DEVICE = "device"
    HOST_PINNED = "host_pinned"
    DISK = "disk"
    EXTERNAL = "external"

    __hash__ = object.__hash__
    """Members are singletons compared by identity: hash them the same way, in C (``Enum``'s
    own ``__hash__`` is Python code, and tiers key the normalizer's per-event counters)."""


class TieredEvent(msgspec.Struct, frozen=True, gc=False):
    """One Dynamo event for one (worker, dp_rank, tier).

    ``event`` carries canonical hashes only. For stores, ``token_ids`` holds the tokens of the
    stored blocks (packed as :class:`TokenIds` by the normalizer; a list of ints where a caller
    or an older recording gave one, equal either way) and ``lora_name`` / ``cache_salt`` the hash
    inputs, so that a consumer that hashes for itself (Dynamo's ZMQ decoder, behind the relay)
    derives the same ``tokens_hash``. A clear is emitted once per tier.

    ``gc=False``, as every struct an event holds: as msgspec builds them (and as the
    normalizer hands them out) their fields are scalars, enum members, ``bytes`` and lists of
    such structs or of ints, none of which refers back to the event, so the collector need not
    track them (msgspec builds a batch of untracked events about a sixth faster). A caller who
    puts an event inside its own lists makes a cycle the collector will not see: that memory
    is kept until the process ends.
    """

    worker_id: int
    dp_rank: int
    tier: Tier
    event: KvCacheEvent
    token_ids: TokenIds | list[int] = EMPTY
    lora_name: str | None = None
    cache_salt: str | None = None
