"""Typed wire formats and values: vLLM's KV events (every release), Dynamo's KvCacheEvent,
kvbridge's tiers and overlaps."""

from kvbridge.schemas.errors import SchemaError
from kvbridge.schemas.kv_cache_event import KvCacheEvent
from kvbridge.schemas.overlap import Overlap
from kvbridge.schemas.tiers import Tier, TieredEvent
from kvbridge.schemas.token_ids import TokenIds
from kvbridge.schemas.vllm import (
    LAYOUTS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    Layout,
    VllmBatch,
    decode_batch,
    encode_batch,
    layout_for,
)

__all__ = [
    "LAYOUTS",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "Event",
    "KvCacheEvent",
    "Layout",
    "Overlap",
    "SchemaError",
    "Tier",
    "TieredEvent",
    "TokenIds",
    "VllmBatch",
    "decode_batch",
    "encode_batch",
    "layout_for",
]
