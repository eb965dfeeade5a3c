"""Typed wire formats: vLLM's KV events (every release), Dynamo's KvCacheEvent, kvbridge's tiers."""

from kvbridge.schemas.dynamo import KvCacheEvent
from kvbridge.schemas.errors import SchemaError
from kvbridge.schemas.tiers import Tier, TieredEvent
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
    "SchemaError",
    "Tier",
    "TieredEvent",
    "VllmBatch",
    "decode_batch",
    "encode_batch",
    "layout_for",
]
