"""``kvbridge validate --compare-dynamo``: what a real Dynamo gets wrong on a user's own stream.

A recorded stream is replayed twice in one process, on loopback sockets this module binds:

- **alone**: byte for byte into a real ``dynamo.llm.SelectionService`` whose workers are
  registered directly on the raw streams, as a user without kvbridge runs it;
- **bridged**: through kvbridge's :class:`~kvbridge.adapters.pipeline.StreamPipeline`, whose
  canonical streams feed a second ``SelectionService`` (what ``kvbridge relay`` in front of Dynamo
  gives).

Both services are then read the same way: ``indexer_snapshot()`` (the standalone ``/dump`` shape)
gives each resident block with its ``tokens_hash`` and its parent, and ``overlap_scores`` the
per-prompt overlap. Blocks are compared by content, not by engine hash: a block's key is
Dynamo's rolling sequence hash of the ``tokens_hash`` values of its chain, which is what
kvbridge's canonical hashes are, and which two engines that hash differently still agree on.

A block the bridged side holds and the alone side does not is *missing*; one the alone side
holds and the bridged side does not is *stale*. Each is given the cause kvbridge knows from
the raw events (:class:`Cause`); a block whose own events were clean inherits the cause of the
nearest ancestor that differs, since Dynamo drops a store whose parent it lacks.

The modules, in the order a comparison runs: :mod:`.recorded` reads the captures into streams,
:mod:`.side` runs each Dynamo and its sockets, :mod:`.ledger` follows the raw events to name
causes, :mod:`.compare` replays and diffs, :mod:`.report` holds the report and its text.
"""

from kvbridge.adapters.dynamo_compare import report
from kvbridge.adapters.dynamo_compare.compare import compare_captures
from kvbridge.adapters.dynamo_compare.recorded import MAX_COMPARED_BLOCK_SIZE, first_block_size

# The report's names, as its own __all__ lists them.
from kvbridge.adapters.dynamo_compare.report import *  # noqa: F403

__all__ = ["MAX_COMPARED_BLOCK_SIZE", "compare_captures", "first_block_size"]
__all__ += report.__all__
