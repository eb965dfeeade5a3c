"""Pure translation of vLLM events into canonical Dynamo events: hashing, tiers, ref-counts."""

from kvbridge.normalizers.hashing import (
    block_seed,
    engine_hash_u64,
    sequence_hashes,
    tokens_hashes,
)
from kvbridge.normalizers.media import tier_for_medium
from kvbridge.normalizers.normalizer import (
    MAIN_ATTENTION_KINDS,
    MAX_BLOCK_SIZE,
    DropReason,
    Normalizer,
)

__all__ = [
    "MAIN_ATTENTION_KINDS",
    "MAX_BLOCK_SIZE",
    "DropReason",
    "Normalizer",
    "block_seed",
    "engine_hash_u64",
    "sequence_hashes",
    "tier_for_medium",
    "tokens_hashes",
]
