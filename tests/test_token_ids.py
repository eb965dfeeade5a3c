"""``TokenIds``, the packed token ids of a ``TieredEvent``, and the native ``NormalizedBatch``
that carries the events: what they equal, how they encode, what the normalizer hands out."""

from __future__ import annotations

import gc
import pickle
import struct
from collections.abc import Sequence

import msgspec
import pytest

from kvbridge import Normalizer, Tier, TieredEvent
from kvbridge.normalizers.batch import NormalizedBatch
from kvbridge.schemas import KvCacheEvent, TokenIds
from kvbridge.schemas.kv_cache_event import EventData, StoredBlock, StoredData
from kvbridge.testing.events import TS0, encoded, removed, stored

IDS = [0, 1, 127, 128, 65_535, 65_536, 151_935, 2**32 - 1]


def test_token_ids_are_the_ids_packed_as_u32_little_endian() -> None:
    ids = TokenIds.of(IDS)
    assert ids.packed == struct.pack("<8I", *IDS)
    assert len(ids) == 8
    assert ids.tolist() == IDS
    assert list(ids) == IDS
    assert (ids[0], ids[3], ids[-1]) == (0, 128, 2**32 - 1)
    assert ids[2:5] == TokenIds.of([127, 128, 65_535])
    assert 65_536 in ids and 3 not in ids
    assert (ids.index(128), ids.index(0, 0, 1), ids.count(1), ids.count(3)) == (3, 0, 1, 0)
    assert list(reversed(ids)) == IDS[::-1]
    assert TokenIds.of(b"\x01\x02") == [1, 2]  # the ints bytes iterate, not a machine word
    assert repr(ids) == f"TokenIds({IDS!r})"
    assert isinstance(ids, Sequence)
    with pytest.raises(IndexError):
        ids[8]


def test_token_ids_equal_lists_and_tuples_of_the_same_ids() -> None:
    ids = TokenIds.of([5, 6, 7])
    assert ids == [5, 6, 7] and [5, 6, 7] == ids  # noqa: SIM300 (the reflected comparison)
    assert ids == (5, 6, 7) and (5, 6, 7) == ids  # noqa: SIM300
    assert ids == TokenIds.of((5, 6, 7))
    assert ids != [5, 6] and ids != [5, 6, 8] and ids != TokenIds.of([5, 6])
    assert (ids != [5, 6, 7]) is False
    assert ids != "567" and ids != b"\x05\x00\x00\x00"
    assert hash(ids) == hash((5, 6, 7))
    assert {ids: "a"}[TokenIds.of([5, 6, 7])] == "a"


def test_packed_bytes_that_are_not_whole_ids_are_refused_when_read() -> None:
    torn = msgspec.msgpack.decode(msgspec.msgpack.encode({"packed": b"abcde"}), type=TokenIds)
    for read in (len, list, repr, hash, TokenIds.tolist):
        with pytest.raises(ValueError, match="TokenIds: 5 packed bytes are not whole 4-byte ids"):
            read(torn)


@pytest.mark.parametrize("bad", [[-1], [2**32], [1, 2**40]])
def test_token_ids_refuse_ids_outside_u32(bad: list[int]) -> None:
    with pytest.raises(OverflowError):
        TokenIds.of(bad)


def _store(tokens: TokenIds | list[int]) -> TieredEvent:
    data = EventData(stored=StoredData(None, [StoredBlock(11, 12)]))
    return TieredEvent(3, 0, Tier.DEVICE, KvCacheEvent(9, data, 0), tokens)


def test_events_round_trip_with_packed_ids_and_still_decode_lists() -> None:
    packed = _store(TokenIds.of([1, 2, 3, 4]))
    wire = msgspec.msgpack.encode(packed)
    assert msgspec.msgpack.decode(wire, type=TieredEvent) == packed
    assert pickle.loads(pickle.dumps(packed)) == packed  # as Ray sends values
    assert msgspec.msgpack.decode(wire)["token_ids"] == {"packed": struct.pack("<4I", 1, 2, 3, 4)}
    # An event written with a plain list (by a caller, or an older recording) decodes as one.
    listed = msgspec.msgpack.decode(msgspec.msgpack.encode(_store([1, 2, 3, 4])), type=TieredEvent)
    assert listed.token_ids == [1, 2, 3, 4] and type(listed.token_ids) is list
    assert listed == packed


def test_the_normalizers_batch_is_a_sequence_of_untracked_events() -> None:
    normalizer = Normalizer(worker_id=5, block_size=4)
    payload = encoded(
        [stored([101, 102], list(range(8)), block_size=4), removed([101])],
        ts=TS0,
        release="0.22.0",
    )
    batch = normalizer.process(payload, 40)
    assert isinstance(batch, NormalizedBatch) and isinstance(batch, Sequence)
    assert (len(batch), batch.ts, batch.dp_rank) == (2, TS0, 0)
    events = batch.events
    assert batch.events is events  # built once
    assert list(batch) == events and batch[0] is events[0] and batch[-1] is events[1]
    assert batch[0:1] == events[0:1] and list(reversed(batch)) == events[::-1]
    assert events[1] in batch and batch.index(events[1]) == 1 and batch.count(events[0]) == 1
    with pytest.raises(ValueError):
        batch.index(events[1], 0, 1)
    with pytest.raises(IndexError):
        batch[2]
    store, removal = events
    assert type(store.token_ids) is TokenIds and store.token_ids == list(range(8))
    assert removal.token_ids == [] and type(removal.token_ids) is TokenIds
    assert [event.event.event_id for event in events] == [40, 40]
    assert not any(gc.is_tracked(value) for value in (store, store.event, store.token_ids))


def _batches() -> int:
    return sum(type(value) is NormalizedBatch for value in gc.get_objects())


def test_a_batch_in_a_cycle_through_its_events_is_collected() -> None:
    normalizer = Normalizer(worker_id=5, block_size=4)
    gc.collect()
    before = _batches()
    batch = normalizer.process(encoded([stored([7], [1, 2, 3, 4], block_size=4)]), 0)
    batch.events.append(batch)  # type: ignore[arg-type]
    assert gc.is_tracked(batch) and _batches() == before + 1
    del batch
    gc.collect()
    assert _batches() == before
