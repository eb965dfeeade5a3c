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

from typing import TYPE_CHECKING

from kvbridge._lazy import lazy_names

if TYPE_CHECKING:
    from kvbridge.schemas import Overlap as Overlap
    from kvbridge.schemas.vllm import AllBlocksCleared as AllBlocksCleared
    from kvbridge.schemas.vllm import BlockHash as BlockHash
    from kvbridge.schemas.vllm import BlockRemoved as BlockRemoved
    from kvbridge.schemas.vllm import BlockStored as BlockStored
    from kvbridge.schemas.vllm import VllmBatch as VllmBatch
    from kvbridge.testing.scheduler import Completion as Completion
    from kvbridge.testing.simulated_engine import SimulatedEngine as SimulatedEngine
    from kvbridge.testing.synced_index import SyncedIndex as SyncedIndex

lazy_names(
    globals(),
    {
        "kvbridge.schemas": ["Overlap"],
        "kvbridge.schemas.vllm": [
            "AllBlocksCleared",
            "BlockHash",
            "BlockRemoved",
            "BlockStored",
            "VllmBatch",
        ],
        "kvbridge.testing.scheduler": ["Completion"],
        "kvbridge.testing.simulated_engine": ["SimulatedEngine"],
        "kvbridge.testing.synced_index": ["SyncedIndex"],
    },
)
