"""kvbridge: vLLM KV-cache events, every release and tier, made right for NVIDIA Dynamo."""

from kvbridge.adapters.dynamo import Overlap, TieredIndex
from kvbridge.normalizers import DropReason, Normalizer
from kvbridge.schemas import SchemaError, Tier, TieredEvent, VllmBatch, decode_batch

__all__ = [
    "DropReason",
    "Normalizer",
    "Overlap",
    "SchemaError",
    "Tier",
    "TieredEvent",
    "TieredIndex",
    "VllmBatch",
    "decode_batch",
]
__version__ = "0.1.0"
