"""A snapshot of a rank rebuilds, in a consumer that knows nothing, exactly the index the whole
stream built: every resident block on every tier, parents first, after a clear."""

from __future__ import annotations

import json

from support.prefix_closed import PrefixClosedEngine
from support.reference import dump_rows, overlaps

from kvbridge import Normalizer, TieredIndex


def blocks(index: TieredIndex) -> dict[str, list[str]]:
    """Each level's Dynamo dump without the event ids (an index numbers what it applies)."""
    out = {}
    for level, rows in dump_rows(index).items():
        parsed = [json.loads(row) for row in rows]
        for row in parsed:
            row["event"]["event_id"] = 0
        out[level] = sorted(json.dumps(row, sort_keys=True) for row in parsed)
    return out


def test_a_snapshot_rebuilds_the_index_the_stream_built() -> None:
    engine = PrefixClosedEngine(5, block_size=4)
    normalizer, index = Normalizer(1, 4), TieredIndex(4)
    for seq, payload in enumerate(engine.payloads(300)):
        index.apply(normalizer.normalize(payload, seq))
    assert len(dump_rows(index)["host_pinned"]) > len(dump_rows(index)["device"]) > 4

    snapshot = normalizer.process_snapshot(0)
    fresh = TieredIndex(4)
    fresh.apply(snapshot)
    assert blocks(fresh) == blocks(index)
    assert overlaps(fresh, engine.prompts) == overlaps(index, engine.prompts)
    # The snapshot opens with a clear: applied over a stale index, it replaces it.
    stale, other = TieredIndex(4), Normalizer(1, 4)
    for seq, payload in enumerate(PrefixClosedEngine(6, block_size=4).payloads(100)):
        stale.apply(other.normalize(payload, seq))
    assert blocks(stale) != blocks(index)
    stale.apply(snapshot)
    assert blocks(stale) == blocks(index)
    # Reading the state changes nothing but the event ids.
    again = normalizer.process_snapshot(0).events
    assert [e.event.data for e in again] == [e.event.data for e in snapshot.events]


def test_a_snapshot_of_an_unknown_rank_is_a_clear() -> None:
    normalizer = Normalizer(1, 4)
    events = normalizer.process_snapshot(3).events
    assert [(event.dp_rank, event.event.data) for event in events] == [(3, "cleared")] * 4
