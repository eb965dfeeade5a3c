"""The lossless reference a test compares kvbridge's live index against, and the forms in which
two indexes are compared.

:func:`index_of` builds the reference: every payload decoded, normalised and indexed by the
relay's :class:`~kvbridge.adapters.pipeline.StreamPipeline`, without any socket in between.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

from kvbridge import TieredIndex
from kvbridge.adapters.pipeline import IndexSink, StreamPipeline
from kvbridge.adapters.source import Source
from kvbridge.adapters.stream_stats import BadFrame

__all__ = ["dump_rows", "index_of", "overlaps"]


def index_of(payloads: Iterable[bytes], *, worker_id: int, block_size: int) -> TieredIndex:
    """The lossless reference: every payload through the relay's own pipeline (seq = position)
    into an index, with no socket in between. A payload that does not decode fails here: a
    reference that skipped one would not be lossless."""
    index = TieredIndex(block_size)
    pipeline = StreamPipeline(block_size, sinks=[IndexSink(index)])
    source = Source(f"reference:{worker_id}", worker_id=worker_id)
    for seq, payload in enumerate(payloads):
        pipeline.feed_batch(source, payload, seq)
        assert not pipeline.stats.bad_frames[BadFrame.SCHEMA], f"payload {seq} does not decode"
    return index


def dump_rows(index: TieredIndex) -> dict[str, list[str]]:
    """Each level's Dynamo dump as sorted JSON rows, comparable across indexes."""
    return {
        level: sorted(json.dumps(row, sort_keys=True) for row in rows)
        for level, rows in index.dump().items()
    }


def overlaps(
    index: TieredIndex, prompts: Iterable[Sequence[int]]
) -> list[dict[tuple[int, int], tuple[int, int, int]]]:
    """Every prompt's overlap, as plain tuples."""
    return [
        {key: (o.device, o.host_pinned, o.disk) for key, o in index.overlap(prompt).items()}
        for prompt in prompts
    ]
