"""kvbridge: vLLM KV-cache events, every release and tier, made right for NVIDIA Dynamo.

The names below are imported on first use, so that ``import kvbridge`` stays light: Dynamo's
binary (``kvbridge.TieredIndex``), structlog, msgspec's decoders and even ``typing`` load only
when a name that needs them is first read.
"""

from __future__ import annotations

from kvbridge._lazy import lazy_names

TYPE_CHECKING = False
"""True for type checkers only (as ``typing.TYPE_CHECKING``, without importing ``typing``)."""
if TYPE_CHECKING:
    from kvbridge.adapters.tiered_index import TieredIndex as TieredIndex
    from kvbridge.normalizers import DropReason as DropReason
    from kvbridge.normalizers import Normalizer as Normalizer
    from kvbridge.schemas.errors import SchemaError as SchemaError
    from kvbridge.schemas.overlap import Overlap as Overlap
    from kvbridge.schemas.tiers import Tier as Tier
    from kvbridge.schemas.tiers import TieredEvent as TieredEvent
    from kvbridge.schemas.token_ids import TokenIds as TokenIds
    from kvbridge.schemas.vllm import VllmBatch as VllmBatch
    from kvbridge.schemas.vllm import decode_batch as decode_batch

__version__ = "0.1.0"

lazy_names(
    globals(),
    {
        "kvbridge.adapters.tiered_index": ["TieredIndex"],
        "kvbridge.normalizers": ["DropReason", "Normalizer"],
        "kvbridge.schemas.errors": ["SchemaError"],
        "kvbridge.schemas.overlap": ["Overlap"],
        "kvbridge.schemas.tiers": ["Tier", "TieredEvent"],
        "kvbridge.schemas.token_ids": ["TokenIds"],
        "kvbridge.schemas.vllm": ["VllmBatch", "decode_batch"],
    },
)
