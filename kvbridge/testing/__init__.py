"""What users' own test suites use: a vLLM engine in miniature and an index that follows it.

- :class:`SimulatedEngine` publishes what a vLLM engine with prefix caching (and optionally a CPU
  offload tier) publishes, as real ZMQ frames in any release's layout, with a replay socket.
- :class:`SyncedIndex` is a tiered Dynamo index fed from engines by kvbridge's relay.
- The pytest plugin (:mod:`kvbridge.testing.plugin`, registered through the ``pytest11`` entry
  point) provides them as the ``vllm_publisher`` and ``kv_index`` fixtures.

The event types are re-exported for assertions on :attr:`SimulatedEngine.published`.
Importing this package does not import pytest.
"""

from kvbridge.adapters.dynamo import Overlap
from kvbridge.schemas.vllm import AllBlocksCleared, BlockRemoved, BlockStored, VllmBatch
from kvbridge.testing.engine import BlockHash, Completion, SimulatedEngine, SyncedIndex

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
