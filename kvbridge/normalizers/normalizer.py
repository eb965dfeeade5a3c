"""The stateful translation of one worker's vLLM event stream into canonical Dynamo events.

Dynamo's index keeps the first writer's block hash for each node, so two engines that hash the
same tokens differently corrupt it silently; it also forwards every store and removal without
reference counts, and cannot place CPU placeholder events. The :class:`Normalizer` fixes all
three at the source: every engine hash is rewritten to Dynamo's rolling sequence hash of the
block's content, residency is reference-counted per (dp_rank, tier, block), and placeholders
are resolved through a per-rank map from engine hash to canonical block.

The work is done by the Rust core, :mod:`kvbridge._core`, on the payload's bytes (with the GIL
released for any but small ones); this class is its typed face.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from enum import StrEnum
from typing import Final

import structlog

from kvbridge import _core
from kvbridge.normalizers.batch import TIERED_EVENTS, NormalizedBatch
from kvbridge.schemas.tiers import Tier, TieredEvent
from kvbridge.schemas.vllm import LAYOUTS, VllmBatch, encode_batch

__all__ = ["MAIN_ATTENTION_KINDS", "MAX_BLOCK_SIZE", "DropReason", "Normalizer"]

MAIN_ATTENTION_KINDS: Final = frozenset(("full_attention", "mla_attention", "sink_full_attention"))
"""The KV-cache group kinds a prefix index can use; Dynamo indexes exactly these."""

_TIERS: Final = tuple(Tier)
_TIER_BY_VALUE: Final = {tier.value: tier for tier in Tier}
_NEWEST_LAYOUT: Final = LAYOUTS[-1]
_U64_MASK: Final = 0xFFFF_FFFF_FFFF_FFFF

MAX_BLOCK_SIZE: Final = 0xFFFF_FFFF
"""The largest block size a worker can have: Dynamo keeps it in 32 bits."""


class DropReason(StrEnum):
    """Why a block (or a clear) was not forwarded. Counted in :attr:`Normalizer.stats`."""

    UNKNOWN_MEDIUM = "unknown_medium"
    REMOTE_LOCALITY = "remote_locality"
    UNKNOWN_LOCALITY = "unknown_locality"
    NON_MAIN_GROUP = "non_main_group"
    BLOCK_SIZE_MISMATCH = "block_size_mismatch"
    ORPHAN_PARENT = "orphan_parent"
    UNRESOLVED_PLACEHOLDER = "unresolved_placeholder"
    DUPLICATE_STORE = "duplicate_store"
    STILL_REFERENCED = "still_referenced"
    UNKNOWN_BLOCK = "unknown_block"
    CLEARED_EARLIER = "cleared_earlier"
    """A removal of a block an ``AllBlocksCleared`` already took off every tier. vLLM's reset
    keeps its CPU pool, so the CPU tier goes on evicting blocks kvbridge has cleared: expected,
    and nothing is lost."""
    STATE_CAP = "state_cap"
    """A store that would need one more (LoRA name, cache salt) pair than ``max_contexts``
    while every pair is in use."""
    UNKNOWN_FIELD = "unknown_field"
    """Not a drop: unknown trailing positions or map keys the decoder ignored."""


class Normalizer:
    """Translates one worker's vLLM batches into canonical, tiered Dynamo events.

    ``block_size`` is the block size the worker is registered with in Dynamo; stores of any
    other size are dropped. ``retain_evicted`` bounds how many blocks that left every tier are
    remembered per rank, so that a CPU placeholder or a child published after its GPU block was
    evicted can still be resolved.

    The state is capped whatever the input, and what a cap gives up is made consistent
    downstream and counted (:attr:`evictions`): past ``max_ranks`` dp ranks the least recently
    written rank is forgotten and cleared; past ``max_blocks`` live blocks (over every rank)
    the oldest blocks of the rank being written are evicted and removed; past
    ``max_contexts`` (LoRA name, cache salt) pairs the unused pairs are forgotten, and a store
    that needs one more is dropped (``state_cap``).
    """

    def __init__(
        self,
        worker_id: int,
        block_size: int,
        *,
        retain_evicted: int = 100_000,
        main_kinds: Iterable[str] = MAIN_ATTENTION_KINDS,
        max_ranks: int = 1024,
        max_blocks: int = 4_000_000,
        max_contexts: int = 65_536,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if block_size > MAX_BLOCK_SIZE:
            raise ValueError(f"block_size must be at most {MAX_BLOCK_SIZE}, got {block_size}")
        if not 0 <= worker_id <= _U64_MASK:
            raise ValueError(f"worker_id must be a u64, got {worker_id}")
        if retain_evicted < 0:
            raise ValueError(f"retain_evicted must not be negative, got {retain_evicted}")
        caps = (
            ("max_ranks", max_ranks),
            ("max_blocks", max_blocks),
            ("max_contexts", max_contexts),
        )
        for name, cap in caps:
            if cap < 1:
                raise ValueError(f"{name} must be positive, got {cap}")
        self.worker_id = worker_id
        self.block_size = block_size
        self.retain_evicted = retain_evicted
        self.main_kinds = frozenset(main_kinds)
        self._core = _core.Normalizer(
            worker_id,
            block_size,
            retain_evicted,
            sorted(self.main_kinds),
            max_ranks,
            max_blocks,
            max_contexts,
            TIERED_EVENTS.decode,
        )
        self._process = self._core.process
        """The core's entry point, bound once: it is called per payload."""
        self._first_drops = self._core.first_drops
        """The core appends each reason dropped for the first time here; empty otherwise."""
        self._log = structlog.get_logger("kvbridge.normalizer").bind(worker_id=worker_id)

    # -- public API -----------------------------------------------------------------------

    def normalize(
        self, batch: VllmBatch | bytes | memoryview, seq: int | None = None
    ) -> list[TieredEvent]:
        """The canonical events of one batch, given decoded or as its payload bytes. ``seq``
        (the ZMQ sequence number) becomes the Dynamo ``event_id``; without it an internal
        counter is used.

        Consecutive removals from one tier come out as one event: vLLM sends one
        ``BlockRemoved`` per evicted GPU block.
        """
        return self.process(batch, seq).events

    def process(
        self,
        batch: VllmBatch | bytes | memoryview,
        seq: int | None = None,
        *,
        reset_first: bool = False,
    ) -> NormalizedBatch:
        """:meth:`normalize` for pipelines: a :class:`NormalizedBatch`, whose events are built
        only if asked for. A payload that does not decode raises
        :class:`~kvbridge.schemas.SchemaError` and leaves the state unchanged.

        ``reset_first`` clears the batch's rank before the batch, in the same result: for a
        stream that restarted before any batch named its rank, whose consumers may still hold
        that rank's blocks.
        """
        if type(batch) is bytes:
            output = self._process(batch, seq, reset_first)
        elif isinstance(batch, VllmBatch):
            output = self._process(_payload_of(batch), seq, reset_first, batch.unknown_fields)
        else:
            output = self._process(bytes(batch), seq, reset_first)
        if self._first_drops:
            self._log_first_drops()
        return output

    def reset(self, dp_rank: int | None = None) -> list[TieredEvent]:
        """Forget a rank's state (or every known rank's) and return the clears that undo it
        downstream. A named rank is cleared even if this normalizer never saw it, since a
        consumer may hold its blocks from before (a restarted relay, say).

        Used when the stream restarted or batches were lost for good: consistency comes before
        stale hits.
        """
        return self.process_reset(dp_rank).events

    def process_reset(
        self, dp_rank: int | None = None, *, keep_identities: bool = False
    ) -> NormalizedBatch:
        """:meth:`reset` for pipelines.

        ``keep_identities`` is for batches lost for good, and for a restart that may be the
        same process going on: the rank is cleared downstream as usual, but what its engine
        hashes stand for is kept (a block's canonical identity is a function of its content,
        so it survives the loss). A later store whose parent chain is known that way shows
        that the engine holds the chain, and the chain is announced again with it
        (:attr:`reanchored_blocks`), so that the hottest prefixes are re-learned on their next
        use rather than when vLLM happens to recompute them.
        """
        if not keep_identities:
            return self._core.reset(dp_rank)
        if dp_rank is None:
            raise ValueError("keep_identities resets one rank: give its dp_rank")
        return self._core.reset_lost(dp_rank)

    def process_snapshot(self, dp_rank: int) -> NormalizedBatch:
        """Everything a rank holds, for a consumer that knows nothing: a clear of the rank,
        then a store of every resident block on each tier, parents first. A relay answers a
        replay request older than its buffer with this, and opens a stream with it."""
        return self._core.snapshot(dp_rank)

    @property
    def reanchored_blocks(self) -> int:
        """Blocks announced again after a loss because a store named them as its ancestors."""
        return self._core.reanchored_blocks

    @property
    def forwarded(self) -> Counter[tuple[str, Tier]]:
        """Blocks forwarded, by (``"stored"`` | ``"removed"`` | ``"cleared"``, tier); a clear
        counts once per tier."""
        return Counter({(kind, _TIERS[tier]): n for kind, tier, n in self._core.forwarded()})

    @property
    def dropped(self) -> Counter[tuple[str, str, str]]:
        """Blocks not forwarded, by (``"stored"`` | ``"removed"``, tier or ``"unknown"``,
        :class:`DropReason`)."""
        return Counter({(kind, tier, reason): n for kind, tier, reason, n in self._core.dropped()})

    @property
    def unknown_fields(self) -> int:
        """Unknown fields the decoder ignored in this stream's batches."""
        return self._core.unknown_fields

    @property
    def stats(self) -> Counter[str]:
        """Blocks not forwarded, by :class:`DropReason`, plus ``unknown_field``."""
        totals: Counter[str] = Counter()
        for _, _, reason, count in self._core.dropped():
            totals[reason] += count
        if self.unknown_fields:
            totals[DropReason.UNKNOWN_FIELD] = self.unknown_fields
        return totals

    @property
    def dp_ranks(self) -> list[int]:
        """The data-parallel ranks this stream has named, sorted."""
        return self._core.dp_ranks()

    def resident_blocks(self, dp_rank: int, tier: Tier) -> int:
        """How many distinct blocks are resident on one tier of one rank."""
        return self._core.resident_blocks(dp_rank, _TIERS.index(tier))

    @property
    def evictions(self) -> dict[str, int]:
        """State given up to stay within the caps: ``ranks`` forgotten (and cleared
        downstream), ``blocks`` evicted (and removed downstream), and ``context_compactions``
        of the (LoRA name, cache salt) table."""
        ranks, blocks, compactions = self._core.evictions()
        return {"ranks": ranks, "blocks": blocks, "context_compactions": compactions}

    def tracked_blocks(self) -> tuple[int, int]:
        """Engine hashes the state holds, over every rank: (live, retired)."""
        return self._core.tracked_blocks()

    def heap_bytes(self) -> int:
        """Bytes of heap the state holds, by the core's own accounting."""
        return self._core.heap_bytes()

    def _log_first_drops(self) -> None:
        first_drops = self._core.take_first_drops()
        for reason, kind, tier, medium in first_drops:
            self._log.warning("event dropped", reason=reason, kind=kind, tier=tier, medium=medium)


def _payload_of(batch: VllmBatch) -> bytes:
    """A decoded batch as a payload of the newest layout, for the core to read. Integer hashes
    wider than msgpack's 64 bits are reduced as the core reduces any int hash (mod 2**64)."""
    try:
        return encode_batch(batch, _NEWEST_LAYOUT)
    except OverflowError:
        return encode_batch(_masked(batch), _NEWEST_LAYOUT)


def _masked(batch: VllmBatch) -> VllmBatch:
    import msgspec

    def mask(value: int | bytes) -> int | bytes:
        return value & _U64_MASK if isinstance(value, int) else value

    events = []
    for event in batch.events:
        changes: dict[str, object] = {}
        if hasattr(event, "block_hashes"):
            changes["block_hashes"] = [mask(value) for value in event.block_hashes]
        parent = getattr(event, "parent_block_hash", None)
        if parent is not None:
            changes["parent_block_hash"] = mask(parent)
        events.append(msgspec.structs.replace(event, **changes))
    return msgspec.structs.replace(batch, events=events)
