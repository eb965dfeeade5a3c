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
    from typing import Final

    from kvbridge.adapters.tiered_index import TieredIndex
    from kvbridge.normalizers import DropReason, Normalizer
    from kvbridge.schemas import Overlap, SchemaError, Tier, TieredEvent, VllmBatch, decode_batch

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

_MODULE_OF: Final = {
    "DropReason": "kvbridge.normalizers",
    "Normalizer": "kvbridge.normalizers",
    "Overlap": "kvbridge.schemas",
    "SchemaError": "kvbridge.schemas",
    "Tier": "kvbridge.schemas",
    "TieredEvent": "kvbridge.schemas",
    "TieredIndex": "kvbridge.adapters.tiered_index",
    "VllmBatch": "kvbridge.schemas",
    "decode_batch": "kvbridge.schemas",
}
"""Where each public name lives."""


_import_public_name, __dir__ = lazy_names(__name__, globals(), _MODULE_OF)


if not TYPE_CHECKING:
    # Hidden from type checkers, which read the imports above: with a visible module
    # ``__getattr__`` they would accept any attribute of ``kvbridge``, misspelt ones included.
    __getattr__ = _import_public_name
