"""The stateful translation of one worker's vLLM event stream into canonical Dynamo events.

Dynamo's index keeps the first writer's block hash for each node, so two engines that hash the
same tokens differently corrupt it silently; it also forwards every store and removal without
reference counts, and cannot place CPU placeholder events. The :class:`Normalizer` fixes all
three at the source: every engine hash is rewritten to Dynamo's rolling sequence hash of the
block's content, residency is reference-counted per (dp_rank, tier, block), and placeholders
are resolved through a per-rank map from engine hash to canonical block.
"""

from __future__ import annotations

import itertools
import operator
import struct
from array import array
from collections import Counter, OrderedDict
from collections.abc import Iterable
from typing import Any, Final

import msgspec
import structlog
import xxhash

from kvbridge.normalizers.hashing import (
    DYNAMO_SALT_PREFIX,
    DYNAMO_SEED,
    block_seed,
    engine_hash_u64,
    engine_hashes_u64,
    pack_tokens,
    tokens_hash,
)
from kvbridge.normalizers.batch import NormalizedBatch
from kvbridge.normalizers.media import tier_for_medium
from kvbridge.schemas.dynamo import (
    EventData,
    KvCacheEvent,
    RemovedData,
    StoredBlock,
    StoredData,
)
from kvbridge.schemas.tiers import Tier, TieredEvent
from kvbridge.schemas.vllm import BlockRemoved, BlockStored, VllmBatch, decode_batch

__all__ = ["MAIN_ATTENTION_KINDS", "DropReason", "Normalizer"]

MAIN_ATTENTION_KINDS: Final = frozenset(("full_attention", "mla_attention", "sink_full_attention"))
"""The KV-cache group kinds a prefix index can use; Dynamo indexes exactly these."""

_TIERS: Final = tuple(Tier)
_xxh3_64 = xxhash.xxh3_64_intdigest
_pair = struct.Struct("<QQ").pack
_removal_admission = operator.attrgetter("medium", "locality", "group_idx")
_block_hashes = operator.attrgetter("block_hashes")


class DropReason:
    """Why a block (or a clear) was not forwarded. Counted in :attr:`Normalizer.stats`."""

    UNKNOWN_MEDIUM: Final = "unknown_medium"
    REMOTE_LOCALITY: Final = "remote_locality"
    UNKNOWN_LOCALITY: Final = "unknown_locality"
    NON_MAIN_GROUP: Final = "non_main_group"
    BLOCK_SIZE_MISMATCH: Final = "block_size_mismatch"
    ORPHAN_PARENT: Final = "orphan_parent"
    UNRESOLVED_PLACEHOLDER: Final = "unresolved_placeholder"
    DUPLICATE_STORE: Final = "duplicate_store"
    STILL_REFERENCED: Final = "still_referenced"
    UNKNOWN_BLOCK: Final = "unknown_block"
    CLEARED_EARLIER: Final = "cleared_earlier"
    """A removal of a block an ``AllBlocksCleared`` already took off every tier. vLLM's reset
    keeps its CPU pool, so the CPU tier goes on evicting blocks kvbridge has cleared: expected,
    and nothing is lost."""
    UNKNOWN_FIELD: Final = "unknown_field"
    """Not a drop: unknown trailing positions or map keys the decoder ignored."""


class _Block(msgspec.Struct, gc=False):
    """What one engine hash stands for: a canonical block and the inputs of its hashes.

    A struct without garbage-collector tracking (it holds only ints, bytes and strings): one is
    made for every new block, so it is built in C.
    """

    canonical: int
    tokens_hash: int
    parent: int | None
    tokens: bytes
    lora_name: str | None
    cache_salt: str | None


_Verdict = tuple[Tier | None, str | None]
"""The tier an event goes to, or ``None`` and the reason it is dropped."""


class _Rank:
    """The state of one dp_rank's stream."""

    __slots__ = ("admission", "blocks", "cleared", "group_kinds", "refs", "retired")

    def __init__(self) -> None:
        self.blocks: dict[int, _Block] = {}
        self.retired: OrderedDict[int, _Block] = OrderedDict()
        self.refs: dict[Tier, dict[int, int]] = {tier: {} for tier in _TIERS}
        """Per tier: canonical block → reference count."""
        self.group_kinds: dict[int, str] = {}
        self.admission: dict[tuple[str | None, str | None, int | None, str | None], _Verdict] = {}
        """Verdicts by (medium, locality, group_idx, kind): a few distinct keys per stream."""
        self.cleared: set[int] = set()
        """Engine hashes that were resident when the rank was last cleared."""

    def lookup(self, engine_hash: int) -> _Block | None:
        block = self.blocks.get(engine_hash)
        return block if block is not None else self.retired.get(engine_hash)

    def revive(self, engine_hash: int) -> _Block | None:
        """Look a block up for a store: one that had left every tier becomes live again."""
        block = self.blocks.get(engine_hash)
        if block is None:
            block = self.retired.pop(engine_hash, None)
            if block is not None:
                self.blocks[engine_hash] = block
        return block


class Normalizer:
    """Translates one worker's vLLM batches into canonical, tiered Dynamo events.

    ``block_size`` is the block size the worker is registered with in Dynamo; stores of any
    other size are dropped. ``retain_evicted`` bounds how many blocks that left every tier are
    remembered, so that a CPU placeholder or a child published after its GPU block was evicted
    can still be resolved.
    """

    def __init__(
        self,
        worker_id: int,
        block_size: int,
        *,
        retain_evicted: int = 100_000,
        main_kinds: Iterable[str] = MAIN_ATTENTION_KINDS,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if worker_id < 0:
            raise ValueError(f"worker_id must be a u64, got {worker_id}")
        self.worker_id = worker_id
        self.block_size = block_size
        self.retain_evicted = retain_evicted
        self.main_kinds = frozenset(main_kinds)
        self.forwarded: Counter[tuple[str, Tier]] = Counter()
        """Blocks forwarded, by (``"stored"`` | ``"removed"`` | ``"cleared"``, tier); a clear
        counts once per tier."""
        self.dropped: Counter[tuple[str, str, str]] = Counter()
        """Blocks not forwarded, by (``"stored"`` | ``"removed"``, tier or ``"unknown"``,
        :class:`DropReason`)."""
        self.unknown_fields = 0
        """Unknown fields the decoder ignored in this stream's batches."""
        self._ranks: dict[int, _Rank] = {}
        self._event_ids = itertools.count()
        self._seeds: dict[tuple[str | None, str | None], int] = {}
        self._logged: set[str] = set()
        self._log = structlog.get_logger("kvbridge.normalizer").bind(worker_id=worker_id)

    # -- public API -----------------------------------------------------------------------

    def normalize(self, batch: VllmBatch, seq: int | None = None) -> list[TieredEvent]:
        """The canonical events of one batch. ``seq`` (the ZMQ sequence number) becomes the
        Dynamo ``event_id``; without it an internal counter is used.

        Consecutive removals from one tier come out as one event: vLLM sends one
        ``BlockRemoved`` per evicted GPU block.
        """
        event_id = next(self._event_ids) if seq is None else seq
        dp_rank = batch.data_parallel_rank or 0
        rank = self._ranks.get(dp_rank)
        if rank is None:
            rank = self._ranks[dp_rank] = _Rank()
        self.unknown_fields += batch.unknown_fields
        out: list[TieredEvent] = []
        gone: list[int] = []
        gone_tier: Tier | None = None
        # Events come in runs of one class. vLLM sends one BlockRemoved per evicted GPU block,
        # so a run of removals of one medium, locality and group is admitted once and processed
        # in one pass.
        for event_type, events in itertools.groupby(batch.events, type):
            if issubclass(event_type, BlockRemoved):
                for (medium, locality, group), run in itertools.groupby(events, _removal_admission):
                    hashes = list(itertools.chain.from_iterable(map(_block_hashes, run)))
                    tier = self._admit(rank, "removed", len(hashes), medium, locality, group, None)
                    if tier is None:
                        continue
                    if tier is not gone_tier and gone:
                        out.append(self._removal(dp_rank, event_id, gone_tier, gone))
                        gone = []
                    gone_tier = tier
                    self._removed(rank, tier, medium, hashes, gone)
                continue
            if gone:
                out.append(self._removal(dp_rank, event_id, gone_tier, gone))
                gone = []
            for event in events:
                if isinstance(event, BlockStored):
                    self._stored(rank, dp_rank, event_id, event, out)
                else:
                    out.extend(self._clear(rank, dp_rank, event_id))
        if gone:
            out.append(self._removal(dp_rank, event_id, gone_tier, gone))
        return out

    def process(
        self, batch: VllmBatch | bytes | memoryview, seq: int | None = None
    ) -> NormalizedBatch:
        """:meth:`normalize` for pipelines: a payload or a batch in, a :class:`NormalizedBatch`
        out. A payload that does not decode raises :class:`~kvbridge.schemas.SchemaError` and
        leaves the state unchanged."""
        if not isinstance(batch, VllmBatch):
            batch = decode_batch(batch)
        return NormalizedBatch(self.normalize(batch, seq), self.block_size)

    def process_reset(self, dp_rank: int | None = None) -> NormalizedBatch:
        """:meth:`reset` for pipelines."""
        return NormalizedBatch(self.reset(dp_rank), self.block_size)

    def reset(self, dp_rank: int | None = None) -> list[TieredEvent]:
        """Forget a rank's state (or every known rank's) and return the clears that undo it
        downstream. A named rank is cleared even if this normalizer never saw it, since a
        consumer may hold its blocks from before (a restarted relay, say).

        Used when the stream restarted or batches were lost for good: consistency comes before
        stale hits.
        """
        ranks = list(self._ranks) if dp_rank is None else [dp_rank]
        event_id = next(self._event_ids)
        out: list[TieredEvent] = []
        for rank_id in ranks:
            rank = self._ranks.pop(rank_id, None) or _Rank()
            out.extend(self._clear(rank, rank_id, event_id))
        return out

    @property
    def stats(self) -> Counter[str]:
        """Blocks not forwarded, by :class:`DropReason`, plus ``unknown_field``."""
        totals: Counter[str] = Counter()
        for (_, _, reason), count in self.dropped.items():
            totals[reason] += count
        if self.unknown_fields:
            totals[DropReason.UNKNOWN_FIELD] = self.unknown_fields
        return totals

    @property
    def dp_ranks(self) -> list[int]:
        return sorted(self._ranks)

    def resident_blocks(self, dp_rank: int, tier: Tier) -> int:
        """How many distinct blocks are resident on one tier of one rank."""
        rank = self._ranks.get(dp_rank)
        return 0 if rank is None else len(rank.refs[tier])

    # -- admission --------------------------------------------------------------------------

    def _drop(self, kind: str, tier: Tier | None, reason: str, count: int, **context: Any) -> None:
        self.dropped[kind, "unknown" if tier is None else tier.value, reason] += count
        if reason not in self._logged:
            self._logged.add(reason)
            self._log.warning("event dropped", reason=reason, **context)

    def _admit(
        self,
        rank: _Rank,
        kind: str,
        blocks: int,
        medium: str | None,
        locality: str | None,
        group: int | None,
        spec: str | None,
    ) -> Tier | None:
        """The tier of an event of this medium, locality, group and kind, or ``None`` after
        counting why its ``blocks`` are not indexed.

        ``spec`` is a store's ``kv_cache_spec_kind``; it teaches the rank its groups' kinds,
        which removals (that carry only ``group_idx``) are filtered by.
        """
        if spec is not None and group is not None and rank.group_kinds.get(group) != spec:
            rank.group_kinds[group] = spec
            rank.admission.clear()
        key = (medium, locality, group, spec)
        verdict = rank.admission.get(key)
        if verdict is None:
            verdict = rank.admission[key] = self._judge(rank, *key)
        tier, reason = verdict
        if reason is not None:
            self._drop(
                kind,
                tier,
                reason,
                blocks,
                medium=medium,
                locality=locality,
                group_idx=group,
                spec_kind=spec,
            )
            return None
        return tier

    def _judge(
        self,
        rank: _Rank,
        medium: str | None,
        locality: str | None,
        group: int | None,
        spec: str | None,
    ) -> _Verdict:
        tier = tier_for_medium(medium)
        if tier is None:
            return None, DropReason.UNKNOWN_MEDIUM
        if locality is not None and locality.upper() != "LOCAL":
            remote = locality.upper() == "REMOTE"
            return tier, DropReason.REMOTE_LOCALITY if remote else DropReason.UNKNOWN_LOCALITY
        if spec is None and group is not None:
            spec = rank.group_kinds.get(group)
        main = spec in self.main_kinds if spec is not None else group in (None, 0)
        return tier, None if main else DropReason.NON_MAIN_GROUP

    def _seed(self, lora_name: str | None, cache_salt: str | None) -> int:
        key = (lora_name, cache_salt)
        seed = self._seeds.get(key)
        if seed is None:
            seed = self._seeds[key] = block_seed(lora_name, cache_salt)
        return seed

    # -- stores -----------------------------------------------------------------------------

    def _stored(
        self, rank: _Rank, dp_rank: int, event_id: int, event: BlockStored, out: list[TieredEvent]
    ) -> None:
        tier = self._admit(
            rank,
            "stored",
            len(event.block_hashes),
            event.medium,
            event.locality,
            event.group_idx,
            event.kv_cache_spec_kind,
        )
        if tier is None:
            return
        blocks: list[_Block] | None
        if event.is_placeholder:
            blocks = []
            for key in engine_hashes_u64(event.block_hashes):
                block = rank.revive(key)
                if block is None:
                    reason = DropReason.UNRESOLVED_PLACEHOLDER
                    self._drop("stored", tier, reason, 1, medium=event.medium)
                else:
                    blocks.append(block)
            self._make_resident(rank, dp_rank, event_id, tier, blocks, None, out)
            return
        if event.block_size != self.block_size:
            self._drop(
                "stored",
                tier,
                DropReason.BLOCK_SIZE_MISMATCH,
                len(event.block_hashes),
                expected=self.block_size,
                block_size=event.block_size,
            )
            return
        blocks = self._canonical_blocks(rank, event)
        if blocks is None:
            self._drop("stored", tier, DropReason.ORPHAN_PARENT, len(event.block_hashes))
            return
        self._make_resident(rank, dp_rank, event_id, tier, blocks, event.token_ids, out)

    def _canonical_blocks(self, rank: _Rank, event: BlockStored) -> list[_Block] | None:
        """Hash the event's blocks canonically and remember them by engine hash.

        A block whose engine hash is already known keeps its canonical identity: an offload
        tier's copy of a GPU block carries no extra keys (no salt, no multimodal hashes), so
        hashing it again would mis-hash it and leave the GPU block's removal unmatched.
        """
        lora_name = event.lora_name or None
        if event.parent_block_hash is None:
            parent, salt = None, _cache_salt(event)
        else:
            parent_block = rank.lookup(engine_hash_u64(event.parent_block_hash))
            if parent_block is None:
                return None
            parent, salt = parent_block.canonical, parent_block.cache_salt
            lora_name = lora_name or parent_block.lora_name
        width = self.block_size * 4
        packed = b""  # the event's tokens as Dynamo hashes them, packed for its first new block
        extra_keys = event.extra_keys or ()
        seed = self._seed(lora_name, salt)
        live, retired = rank.blocks, rank.retired
        blocks = []
        for index, key in enumerate(engine_hashes_u64(event.block_hashes)):
            block = live.get(key)
            if block is None and (block := retired.pop(key, None)) is not None:
                live[key] = block  # known, then evicted from every tier: live again
            if block is None:
                packed = packed or pack_tokens(event.token_ids)
                tokens = packed[index * width : (index + 1) * width]
                keys = extra_keys[index] if index < len(extra_keys) else None
                content = (
                    tokens_hash(tokens, seed, _mm_hashes(keys)) if keys else _xxh3_64(tokens, seed)
                )
                # hashing.tokens_hash and hashing.sequence_hash, inlined on this hot path
                canonical = (
                    content if parent is None else _xxh3_64(_pair(parent, content), DYNAMO_SEED)
                )
                block = live[key] = _Block(canonical, content, parent, tokens, lora_name, salt)
            elif block.cache_salt != salt or block.lora_name != lora_name:
                salt, lora_name = block.cache_salt, block.lora_name
                seed = self._seed(lora_name, salt)
            blocks.append(block)
            parent = block.canonical
        return blocks

    def _make_resident(
        self,
        rank: _Rank,
        dp_rank: int,
        event_id: int,
        tier: Tier,
        blocks: list[_Block],
        token_ids: list[int] | None,
        out: list[TieredEvent],
    ) -> None:
        """Count one more reference on ``tier`` for each block; forward those that just became
        resident, as runs of chained blocks. ``token_ids`` are the event's own tokens (block
        ``i`` is ``token_ids[i * block_size:]``), or ``None`` to take them from the blocks."""
        refs = rank.refs[tier]
        start = 0
        run: list[_Block] = []
        last: int | None = None  # the canonical hash of the run's last block
        duplicates = 0
        for index, block in enumerate(blocks):
            canonical = block.canonical
            count = refs.get(canonical, 0)
            refs[canonical] = count + 1
            if count:
                duplicates += 1
                continue
            if run and last != block.parent:
                out.append(self._store_event(dp_rank, event_id, tier, run, token_ids, start))
                run = []
            if not run:
                start = index
            elif index != start + len(run):
                token_ids = None  # a skipped duplicate inside the chain: not one token slice
            run.append(block)
            last = canonical
        if run:
            out.append(self._store_event(dp_rank, event_id, tier, run, token_ids, start))
        if duplicates:
            self.dropped["stored", tier.value, DropReason.DUPLICATE_STORE] += duplicates

    def _store_event(
        self,
        dp_rank: int,
        event_id: int,
        tier: Tier,
        run: list[_Block],
        token_ids: list[int] | None,
        start: int,
    ) -> TieredEvent:
        self.forwarded["stored", tier] += len(run)
        data = StoredData(
            parent_hash=run[0].parent,
            blocks=[StoredBlock(block.canonical, block.tokens_hash) for block in run],
        )
        if token_ids is not None:
            size = self.block_size
            tokens = token_ids[start * size : (start + len(run)) * size]
        else:
            packed = array("I")
            packed.frombytes(b"".join(block.tokens for block in run))
            tokens = packed.tolist()
        return TieredEvent(
            self.worker_id,
            dp_rank,
            tier,
            KvCacheEvent(event_id, EventData(stored=data), dp_rank),
            tokens,
            run[0].lora_name,
            run[0].cache_salt,
        )

    # -- removals and clears ----------------------------------------------------------------

    def _removed(
        self,
        rank: _Rank,
        tier: Tier,
        medium: str | None,
        engine_hashes: list[int | bytes],
        gone: list[int],
    ) -> None:
        """Count one reference less on ``tier`` for each block; collect in ``gone`` those whose
        last reference went."""
        refs, blocks = rank.refs[tier], rank.blocks
        # The other tiers that hold blocks: a block on none of them has left every tier.
        elsewhere = [other for other in rank.refs.values() if other and other is not refs]
        evicted = []  # engine hashes whose block left its last tier
        for key in engine_hashes_u64(engine_hashes):
            block = blocks.get(key)
            count = 0 if block is None else refs.get(block.canonical, 0)
            if count == 1:
                canonical = block.canonical  # type: ignore[union-attr]
                del refs[canonical]
                gone.append(canonical)
                for other in elsewhere:
                    if canonical in other:
                        break
                else:
                    evicted.append(key)
            elif count > 1:
                refs[block.canonical] = count - 1  # type: ignore[union-attr]
                self.dropped["removed", tier.value, DropReason.STILL_REFERENCED] += 1
            elif key in rank.cleared:
                rank.cleared.discard(key)
                self.dropped["removed", tier.value, DropReason.CLEARED_EARLIER] += 1
            else:
                self._drop("removed", tier, DropReason.UNKNOWN_BLOCK, 1, medium=medium)
        self._retire(rank, evicted)

    def _removal(
        self, dp_rank: int, event_id: int, tier: Tier | None, gone: list[int]
    ) -> TieredEvent:
        assert tier is not None
        self.forwarded["removed", tier] += len(gone)
        data = EventData(removed=RemovedData(gone))
        return TieredEvent(self.worker_id, dp_rank, tier, KvCacheEvent(event_id, data, dp_rank))

    def _retire(self, rank: _Rank, keys: list[int]) -> None:
        """Move blocks that left every tier to the retired ones, keeping the newest
        ``retain_evicted`` of those."""
        live, retired = rank.blocks, rank.retired
        for key in keys:
            retired[key] = live.pop(key)
        for _ in range(len(retired) - self.retain_evicted):
            retired.popitem(last=False)

    def _clear(self, rank: _Rank, dp_rank: int, event_id: int) -> list[TieredEvent]:
        if len(rank.cleared) + len(rank.blocks) > self.retain_evicted:
            rank.cleared.clear()
        rank.cleared.update(rank.blocks)
        self._retire(rank, list(rank.blocks))
        for refs in rank.refs.values():
            refs.clear()
        out = []
        for tier in _TIERS:
            self.forwarded["cleared", tier] += 1
            cleared = KvCacheEvent(event_id, "cleared", dp_rank)
            out.append(TieredEvent(self.worker_id, dp_rank, tier, cleared))
        return out


def _cache_salt(event: BlockStored) -> str | None:
    """The cache salt in the first block's extra keys: the first string that is not the LoRA
    name. Dynamo's own ``dynamo-cache-salt:`` prefix is removed."""
    if not event.extra_keys or not event.extra_keys[0]:
        return None
    lora_seen = event.lora_name is None
    for key in event.extra_keys[0]:
        if not isinstance(key, str) or _is_digest(key):
            continue
        if not lora_seen and key == event.lora_name:
            lora_seen = True
            continue
        return key.removeprefix(DYNAMO_SALT_PREFIX) or None
    return None


def _is_digest(key: str) -> bool:
    """A 64-hex-digit multimodal digest: vLLM up to 0.18 puts it bare into the extra keys."""
    return len(key) == 64 and all(char in "0123456789abcdefABCDEF" for char in key)


def _mm_hashes(keys: list[Any] | None) -> list[int]:
    """The multimodal object hashes among one block's extra keys, as Dynamo derives them: a
    hex digest by its first 16 hex digits, any other identifier by its XXH3-64. The key is an
    ``(identifier, offset)`` pair from vLLM 0.19, a bare digest before."""
    if not keys:
        return []
    hashes = []
    for key in keys:
        if isinstance(key, str) and _is_digest(key):
            hashes.append(int(key[:16], 16))
        elif isinstance(key, list | tuple) and key and isinstance(key[0], str):
            identifier = key[0]
            hashes.append(int(identifier[:16], 16) if _is_digest(identifier) else _xxh(identifier))
    return hashes


def _xxh(identifier: str) -> int:
    return tokens_hash(identifier.encode(), 0)
