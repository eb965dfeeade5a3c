"""Canonical events written back in vLLM's wire format, in the form Dynamo's own decoder indexes
correctly: an array batch of tagged-map events, canonical u64 hashes, upper-case media that
Dynamo knows, token ids on every store, the dp_rank kept, and the cache salt tagged with the
prefix Dynamo looks for."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Final

from kvbridge.normalizers.hashing import DYNAMO_SALT_PREFIX
from kvbridge.schemas.tiers import Tier, TieredEvent
from kvbridge.schemas.vllm import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    VllmBatch,
    encode_batch,
    layout_for,
)

__all__ = ["CANONICAL_LAYOUT", "MEDIUM_OF_TIER", "canonical_batches", "encode_canonical"]

CANONICAL_LAYOUT: Final = layout_for("0.32.0")
MEDIUM_OF_TIER: Final = {
    Tier.DEVICE: "GPU",
    Tier.HOST_PINNED: "CPU",
    Tier.DISK: "DISK",
    Tier.EXTERNAL: "EXTERNAL",
}


def _vllm_event(tiered: TieredEvent, block_size: int) -> Event:
    data = tiered.event.data
    medium = MEDIUM_OF_TIER[tiered.tier]
    if data == "cleared":
        return AllBlocksCleared()
    if data.stored is not None:
        hashes: list[int | bytes] = [block.block_hash for block in data.stored.blocks]
        extra_keys: list[list[Any] | None] | None = None
        if tiered.cache_salt:
            # Dynamo reads the salt of each event from its first block's extra keys.
            extra_keys = [[DYNAMO_SALT_PREFIX + tiered.cache_salt]] + [None] * (len(hashes) - 1)
        return BlockStored(
            hashes,
            data.stored.parent_hash,
            tiered.token_ids,
            block_size,
            None,
            medium,
            tiered.lora_name,
            extra_keys,
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        )
    assert data.removed is not None
    removed: list[int | bytes] = list(data.removed.block_hashes)
    return BlockRemoved(removed, medium, 0)


def canonical_batches(
    events: Iterable[TieredEvent], block_size: int, ts: float
) -> Iterator[VllmBatch]:
    """Group canonical events into vLLM batches, one per dp_rank run, in order.

    The per-tier clears of one rank collapse into one ``AllBlocksCleared``: a medium-less clear
    is what clears every tier of the rank in Dynamo.
    """
    batch: VllmBatch | None = None
    for tiered in events:
        if batch is None or batch.data_parallel_rank != tiered.dp_rank:
            if batch is not None:
                yield batch
            batch = VllmBatch(ts, [], tiered.dp_rank)
        event = _vllm_event(tiered, block_size)
        if (
            isinstance(event, AllBlocksCleared)
            and batch.events
            and isinstance(batch.events[-1], AllBlocksCleared)
        ):
            continue
        batch.events.append(event)
    if batch is not None:
        yield batch


def encode_canonical(events: Iterable[TieredEvent], block_size: int, ts: float) -> list[bytes]:
    """The payloads that republish ``events``, one per batch."""
    return [
        encode_batch(batch, CANONICAL_LAYOUT) for batch in canonical_batches(events, block_size, ts)
    ]
