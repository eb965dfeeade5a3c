"""The cause ledger: what the raw events say about why Dynamo alone would hold a block
differently (a :class:`~kvbridge.adapters.dynamo_compare.report.Cause` per block)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Final

import msgspec

from kvbridge.adapters.dynamo_compare.report import Cause
from kvbridge.normalizers.hashing import (
    DYNAMO_SALT_PREFIX,
    engine_hash_u64,
    sequence_hashes,
    tokens_hashes,
)
from kvbridge.normalizers.media import MEDIA, tier_for_medium
from kvbridge.schemas import AllBlocksCleared, BlockRemoved, BlockStored, VllmBatch
from kvbridge.schemas.tiers import Tier

__all__ = ["Key", "Ledger"]

_DYNAMO_MEDIA: Final = frozenset(MEDIA) - {"FS", "OBJ"}
"""The medium strings Dynamo 1.6.1's decoder maps to a tier: exactly these spellings (absent
means GPU). kvbridge also reads any case, and vLLM 0.26's ``FS`` / ``OBJ``."""

Key = tuple[int, int, str, int]
"""(worker_id, dp_rank, tier, content key)."""


class _Identity(msgspec.Struct, array_like=True):
    """What one engine hash of a worker stands for: its content key and hash context."""

    key: int
    unsalted: int
    lora_name: str | None
    salt: str | None
    salt_raw: bool
    """The salt came without Dynamo's prefix, so Dynamo hashed the block unsalted."""


class Ledger:
    """Follows the raw events to know, per block content, what would make Dynamo alone differ.

    It keeps what Dynamo itself cannot: each worker's engine hash to content (``tokens_hash``
    chain), reference counts per tier, and which worker first stored each content (Dynamo keeps
    that writer's hash). The differences themselves are always measured on the services; the
    ledger only names their causes.
    """

    def __init__(self, block_sizes: Mapping[int, int]) -> None:
        self.block_sizes = block_sizes
        """Each worker's block size."""
        self.identities: dict[tuple[int, int], _Identity] = {}
        self.counts: Counter[Key] = Counter()
        """Stores minus removals per block and tier, as kvbridge counts them."""
        self.owners: dict[tuple[str, int], tuple[int, int]] = {}
        """(tier, content) -> (worker, engine hash) of its first writer."""
        self.foreign: set[tuple[int, int]] = set()
        """(worker, engine hash) of blocks Dynamo credits under another worker's hash."""
        self.missing: dict[Key, Cause] = {}
        self.stale: dict[Key, Cause] = {}

    def observe(self, worker_id: int, batch: VllmBatch, *, passed: bool = False) -> None:
        """One raw batch of a worker, in stream order; ``passed``: its seq is one Dynamo's
        listener has passed, so it ignores the batch (see :meth:`restart`)."""
        rank = batch.data_parallel_rank or 0
        ignored = Cause.BYTES_HASHES if _has_bytes_hashes(batch) else None
        if passed:
            ignored = Cause.ENGINE_RESTART
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(worker_id, rank, event, ignored)
            elif isinstance(event, BlockRemoved):
                self._removed(worker_id, rank, event, ignored)
            elif isinstance(event, AllBlocksCleared):
                self._clear(worker_id, {rank}, ignored)

    def restart(self, worker_id: int, ranks: set[int]) -> None:
        """The engine of these ranks of a worker restarted: kvbridge clears them, and Dynamo
        keeps every block the old process left, and ignores the new one's batches until its
        sequence passes the old one's last (:meth:`observe`'s ``passed``)."""
        self._clear(worker_id, ranks, Cause.ENGINE_RESTART)

    def _clear(self, worker: int, ranks: set[int], ignored: Cause | None) -> None:
        """kvbridge forgets the blocks of these ranks; Dynamo keeps them if it ignores the
        clear (for ``ignored``)."""
        for counted in [k for k in self.counts if k[0] == worker and k[1] in ranks]:
            del self.counts[counted]
            if ignored is not None:
                self.stale[counted] = ignored

    def _stored(self, worker: int, rank: int, event: BlockStored, ignored: Cause | None) -> None:
        tier = tier_for_medium(event.medium)
        size = self.block_sizes[worker]
        if tier is None or (not event.is_placeholder and event.block_size != size):
            return  # dropped on both sides
        hashes = [engine_hash_u64(value) for value in event.block_hashes]
        parent = (
            None if event.parent_block_hash is None else engine_hash_u64(event.parent_block_hash)
        )
        if event.is_placeholder:
            identities = [self.identities.get((worker, value)) for value in hashes]
        else:
            identities = list(self._identify(worker, event, hashes, parent))
        cause = self._store_cause(worker, event, parent, ignored)
        for value, identity in zip(hashes, identities, strict=True):
            if identity is None:
                continue  # a placeholder kvbridge cannot resolve either
            key = (worker, rank, tier.value, identity.key)
            self.counts[key] += 1
            if identity.salt_raw and cause is None:
                self.missing[key] = Cause.RAW_CACHE_SALT
                self.stale[(worker, rank, tier.value, identity.unsalted)] = Cause.RAW_CACHE_SALT
            elif cause is not None:
                self.missing[key] = cause
            else:
                self.missing.pop(key, None)  # Dynamo got it: a difference is its parent's
                self._own(worker, tier, value, identity.key)

    def _store_cause(
        self, worker: int, event: BlockStored, parent: int | None, ignored: Cause | None
    ) -> Cause | None:
        """Why Dynamo would not store this event's blocks as kvbridge does, if it would not:
        first why it ignores the whole batch, if it does."""
        if ignored is not None:
            return ignored
        if event.medium is not None and event.medium not in _DYNAMO_MEDIA:
            return Cause.MEDIUM_SPELLING
        if event.is_placeholder:
            return Cause.PLACEHOLDER
        if (worker, parent) in self.foreign:
            return Cause.SECOND_ENGINE
        return None

    def _identify(
        self, worker: int, event: BlockStored, hashes: list[int], parent: int | None
    ) -> Iterator[_Identity]:
        """The identity of each block of a store with tokens, chained on its parent's."""
        above = None if parent is None else self.identities.get((worker, parent))
        lora = event.lora_name or (above.lora_name if above else None)
        salt, raw = _salt(event)
        if salt is None and above is not None:
            salt, raw = above.salt, above.salt_raw
        size = self.block_sizes[worker]
        tokens = event.token_ids[: len(hashes) * size]
        keys = sequence_hashes(
            tokens_hashes(tokens, size, lora_name=lora, cache_salt=salt),
            above.key if above else None,
        )
        unsalted = keys
        if raw:
            unsalted = sequence_hashes(
                tokens_hashes(tokens, size, lora_name=lora),
                above.unsalted if above else None,
            )
        for value, key, plain in zip(hashes, keys, unsalted, strict=False):
            identity = _Identity(key, plain, lora, salt, raw)
            self.identities[(worker, value)] = identity
            yield identity

    def _own(self, worker: int, tier: Tier, value: int, key: int) -> None:
        """Dynamo's node of this content keeps its first writer's hash."""
        owner = self.owners.setdefault((tier.value, key), (worker, value))
        if owner[0] != worker and owner[1] != value:
            self.foreign.add((worker, value))

    def _removed(self, worker: int, rank: int, event: BlockRemoved, ignored: Cause | None) -> None:
        tier = tier_for_medium(event.medium)
        if tier is None:
            return
        for value in map(engine_hash_u64, event.block_hashes):
            identity = self.identities.get((worker, value))
            if identity is None:
                continue
            key = (worker, rank, tier.value, identity.key)
            count = self.counts[key]
            if count > 1:
                self.counts[key] = count - 1
                self.missing[key] = Cause.RE_ANNOUNCED
                continue
            self.counts.pop(key, None)
            if ignored is not None:
                self.stale[key] = ignored
            elif event.medium is not None and event.medium not in _DYNAMO_MEDIA:
                self.stale[key] = Cause.MEDIUM_SPELLING
            elif (worker, value) in self.foreign:
                self.stale[key] = Cause.SECOND_ENGINE


def _has_bytes_hashes(batch: VllmBatch) -> bool:
    """Whether Dynamo's decoder rejects the batch: it reads hashes as integers only."""
    for event in batch.events:
        hashes: list[object] = []
        if isinstance(event, BlockStored):
            hashes = [*event.block_hashes, event.parent_block_hash]
        elif isinstance(event, BlockRemoved):
            hashes = list(event.block_hashes)
        if any(isinstance(value, bytes) for value in hashes):
            return True
    return False


def _salt(event: BlockStored) -> tuple[str | None, bool]:
    """The cache salt vLLM put in the first block's extra keys, and whether it lacks Dynamo's
    prefix. Multimodal digests (64 hex digits) and the LoRA name are not salts."""
    first = (event.extra_keys or [None])[0] or []
    for item in first:
        if not isinstance(item, str) or item == event.lora_name or _is_digest(item):
            continue
        salt = item.removeprefix(DYNAMO_SALT_PREFIX)
        return (salt or None), not item.startswith(DYNAMO_SALT_PREFIX)
    return None, False


def _is_digest(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text)
