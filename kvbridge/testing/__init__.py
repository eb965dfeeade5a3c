"""What users' own test suites use: a vLLM engine in miniature and an index that follows it.

- :class:`SimulatedEngine` publishes what a vLLM engine with prefix caching (and optionally a CPU
  offload tier) publishes, as real ZMQ frames in any release's layout, with a replay socket.
- :class:`SyncedIndex` is a tiered Dynamo index fed from engines by kvbridge's relay.
- The pytest plugin (:mod:`kvbridge.testing.plugin`, registered through the ``pytest11`` entry
  point) provides them as the ``vllm_publisher`` and ``kv_index`` fixtures.

The event types are re-exported for assertions on :attr:`SimulatedEngine.published`.
Importing this package does not import pytest, and the names are imported on first use: pytest
loads the plugin before a suite's ``conftest.py``, which may still configure Dynamo (its log
filter, ``DYN_LOG``, is read when Dynamo is first imported).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from kvbridge._lazy import lazy_names

if TYPE_CHECKING:
    from kvbridge.schemas import Overlap
    from kvbridge.schemas.vllm import (
        AllBlocksCleared,
        BlockHash,
        BlockRemoved,
        BlockStored,
        VllmBatch,
    )
    from kvbridge.testing.scheduler import Completion
    from kvbridge.testing.simulated_engine import SimulatedEngine
    from kvbridge.testing.synced_index import SyncedIndex

__all__ = [
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "Completion",
    "Overlap",
    "SimulatedEngine",
    "SyncedIndex",
    "VllmBatch",
]

_MODULE_OF: Final = {
    "AllBlocksCleared": "kvbridge.schemas.vllm",
    "BlockHash": "kvbridge.schemas.vllm",
    "BlockRemoved": "kvbridge.schemas.vllm",
    "BlockStored": "kvbridge.schemas.vllm",
    "Completion": "kvbridge.testing.scheduler",
    "Overlap": "kvbridge.schemas",
    "SimulatedEngine": "kvbridge.testing.simulated_engine",
    "SyncedIndex": "kvbridge.testing.synced_index",
    "VllmBatch": "kvbridge.schemas.vllm",
}


_import_public_name, __dir__ = lazy_names(__name__, globals(), _MODULE_OF)


if not TYPE_CHECKING:
    # Hidden from type checkers, which read the imports above (see kvbridge/__init__.py).
    __getattr__ = _import_public_name
