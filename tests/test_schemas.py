"""Decoder and encoder of vLLM's KV-event wire format (``kvbridge.schemas.vllm``).

The layout fixtures in ``tests/fixtures/layouts`` come from ``tools/make_layout_fixtures.py``,
which re-declares vLLM's own classes without importing kvbridge; the hex vectors are those of
section 13 of the vLLM KV-events fact sheet (copied in ``tests/fixtures/README.md``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from support.fixture_json import from_json

import kvbridge
from kvbridge.schemas import (
    LAYOUTS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Layout,
    SchemaError,
    VllmBatch,
    decode_batch,
    encode_batch,
    layout_for,
)

FIXTURES = Path(__file__).parent / "fixtures" / "layouts"

SHA_A = hashlib.sha256(b"a").digest()
SHA_B = hashlib.sha256(b"b").digest()
U64_A = 13366815110101616827
U64_B = 14660323646696587421

EVENT_TYPES: dict[str, type[Any]] = {
    "BlockStored": BlockStored,
    "BlockRemoved": BlockRemoved,
    "AllBlocksCleared": AllBlocksCleared,
}
ALL_FIELDS: dict[str, tuple[str, ...]] = {
    tag: tuple(cls.__struct_fields__) for tag, cls in EVENT_TYPES.items()
}
LAYOUT_IDS = [layout.first for layout in LAYOUTS]


def _load(layout: Layout) -> tuple[bytes, dict[str, Any]]:
    stem = FIXTURES / f"vllm-{layout.first}"
    payload = stem.with_name(stem.name + ".msgpack").read_bytes()
    expected = json.loads(stem.with_name(stem.name + ".json").read_text())
    return payload, expected


def _event(expected: dict[str, Any]) -> Any:
    """The public event type built from one fixture JSON event."""
    fields = {name: from_json(value) for name, value in expected.items() if name != "type"}
    return EVENT_TYPES[expected["type"]](**fields)


def _batch(expected: dict[str, Any]) -> VllmBatch:
    return VllmBatch(
        expected["ts"],
        [_event(event) for event in expected["events"]],
        expected["data_parallel_rank"],
    )


def _wrap(*events: bytes, ts: float = 1.5, rank: int | None = 0) -> bytes:
    """A 3-element batch around raw msgpack events."""
    return msgspec.msgpack.encode([ts, [msgspec.Raw(event) for event in events], rank])


def _schema_error(payload: bytes) -> SchemaError:
    with pytest.raises(SchemaError) as caught:
        decode_batch(payload)
    return caught.value


# ---------------------------------------------------------------------------------------------
# Layout fixtures (independent of kvbridge)
# ---------------------------------------------------------------------------------------------


def test_one_fixture_per_layout() -> None:
    stems = sorted(path.stem for path in FIXTURES.glob("*.msgpack"))
    assert stems == sorted(f"vllm-{first}" for first in LAYOUT_IDS)
    assert len(LAYOUTS) == 12
    assert kvbridge.decode_batch is decode_batch


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_layout_table_matches_fixture(layout: Layout) -> None:
    """kvbridge's table gives each layout the fields vLLM declared, in vLLM's order."""
    _, expected = _load(layout)
    assert expected["releases"] == {"first": layout.first, "last": layout.last}
    assert expected["event_encoding"] == layout.encoding
    assert len(expected["batch_fields"]) == layout.batch_fields
    assert list(layout.stored) == expected["stored_fields"]
    assert list(layout.removed) == expected["removed_fields"]


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_fixture_exercises_every_optional_field(layout: Layout) -> None:
    """Each defaulted field is set in one event and nil (omitted in maps) in another."""
    payload, expected = _load(layout)
    events = expected["events"]
    for tag, fields in (("BlockStored", layout.stored), ("BlockRemoved", layout.removed)):
        of_tag = [event for event in events if event["type"] == tag]
        for name in fields:
            if name in ("block_hashes", "token_ids", "block_size"):  # never nil
                continue
            values = [event[name] for event in of_tag]
            assert any(v is not None for v in values), (tag, name)
            assert any(v is None for v in values), (tag, name)
    raw_events = msgspec.msgpack.decode(payload)[1]
    if layout.encoding == "map":
        required = {"type", *layout.stored[:7]}
        assert set(raw_events[1]) == required  # every defaulted key omitted
        assert set(raw_events[0]) == {"type", *layout.stored}
    else:
        assert len(raw_events[1]) == 1 + len(layout.stored)  # trailing nils still sent


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_fixture_decodes_to_expected_values(layout: Layout) -> None:
    payload, expected = _load(layout)
    batch = decode_batch(payload)
    assert isinstance(batch, VllmBatch)
    assert batch.ts == expected["ts"] == 1700000000.5
    assert batch.data_parallel_rank == expected["data_parallel_rank"]
    assert batch.data_parallel_rank == (None if layout.batch_fields == 2 else 3)
    assert batch.unknown_fields == 0
    assert len(batch.events) == len(expected["events"]) == 7
    for index, (event, want) in enumerate(zip(batch.events, expected["events"], strict=True)):
        assert isinstance(event, EVENT_TYPES[want["type"]]), index
        for name in ALL_FIELDS[want["type"]]:
            actual = getattr(event, name)
            if name in want:
                assert actual == from_json(want[name]), (index, name)
            else:  # a field this layout does not have
                assert actual is None, (index, name)
        assert event == _event(want)


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_fixture_hash_forms(layout: Layout) -> None:
    """Ints of every width (uint64 ``cf``, negative int64), and 32-byte bin8 digests."""
    batch = decode_batch(_load(layout)[0])
    stored_int, stored_negative, stored_bytes, removed_int, removed_negative, removed_bytes, _ = (
        batch.events
    )
    assert stored_int.block_hashes == [U64_A, U64_B]
    assert stored_negative.block_hashes == [-42, -(2**63)]
    assert stored_negative.parent_block_hash == -1234567890123456789
    assert stored_bytes.block_hashes == [SHA_A, SHA_B]
    assert stored_bytes.parent_block_hash == hashlib.sha256(b"parent").digest()
    assert removed_int.block_hashes == [U64_A]
    assert removed_negative.block_hashes == [-42, -1]
    assert removed_bytes.block_hashes == [SHA_A, SHA_B]
    assert isinstance(batch.events[6], AllBlocksCleared)


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_encode_matches_independent_fixture(layout: Layout) -> None:
    """kvbridge's encoder writes the bytes of vLLM's own declarations, for every layout."""
    payload, expected = _load(layout)
    assert encode_batch(_batch(expected), layout) == payload
    assert encode_batch(decode_batch(payload), layout) == payload


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_encode_decode_round_trip(layout: Layout) -> None:
    _, expected = _load(layout)
    batch = _batch(expected)
    decoded = decode_batch(encode_batch(batch, layout))
    assert decoded.ts == batch.ts
    assert decoded.data_parallel_rank == batch.data_parallel_rank
    assert decoded.events == batch.events
    assert decoded.unknown_fields == 0


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_encode_drops_fields_the_layout_lacks(layout: Layout) -> None:
    stored = BlockStored(
        block_hashes=[U64_A],
        parent_block_hash=U64_B,
        token_ids=[1, 2, 3, 4],
        block_size=4,
        lora_id=7,
        medium="GPU",
        lora_name="adapter-a",
        extra_keys=[["adapter-a"]],
        group_idx=2,
        kv_cache_spec_kind="mamba",
        kv_cache_spec_sliding_window=64,
        locality="LOCAL",
        ownership="kvcr",
        session_id="sess-1",
        lookahead_token_ids=[[5]],
    )
    removed = BlockRemoved(
        block_hashes=[U64_A], medium="CPU", group_idx=2, locality="REMOTE", ownership="kvcr"
    )
    decoded = decode_batch(encode_batch([stored, removed, AllBlocksCleared()], layout, ts=2.5))
    assert decoded.ts == 2.5
    assert decoded.data_parallel_rank is None
    assert decoded.unknown_fields == 0
    for event, source, kept in zip(
        decoded.events, (stored, removed), (layout.stored, layout.removed), strict=False
    ):
        for name in type(source).__struct_fields__:
            assert getattr(event, name) == (getattr(source, name) if name in kept else None), name
    assert decoded.events[2] == AllBlocksCleared()


# ---------------------------------------------------------------------------------------------
# Fact-sheet test vectors (section 13)
# ---------------------------------------------------------------------------------------------

REMOVED_MAP = bytes.fromhex(
    "84a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391cfb9807785afee48bba66d6564"
    "69756da3475055a967726f75705f69647800"
)
REMOVED_ARRAY = bytes.fromhex("94ac426c6f636b52656d6f76656491cfb9807785afee48bba347505500")
REMOVED_MAP_BYTES = bytes.fromhex(
    "84a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391c420ca978112ca1bbdcafac231"
    "b39a23dc4da786eff8147c4e72b9807785afee48bba66d656469756da3475055a967726f75705f69647800"
)
CLEARED_MAP = bytes.fromhex("81a474797065b0416c6c426c6f636b73436c6561726564")
CLEARED_ARRAY = bytes.fromhex("91b0416c6c426c6f636b73436c6561726564")
STORED_MAP = bytes.fromhex(
    "de000ba474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cfb9807785afee48bbcfcb73"
    "eeaed59c009db1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473980102030405060708aa62"
    "6c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0aa65787472"
    "615f6b65797392c0c0a967726f75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c6c5f61"
    "7474656e74696f6e"
)
STORED_ARRAY = bytes.fromhex(
    "9cab426c6f636b53746f72656492cfb9807785afee48bbcfcb73eeaed59c009dc098010203040506070804c0a347"
    "5055c092c0c000ae66756c6c5f617474656e74696f6ec0"
)
BATCH_ARRAY = bytes.fromhex(
    "93cb41d954fc40200000929cab426c6f636b53746f72656492cfb9807785afee48bbcfcb73eeaed59c009dc09801"
    "0203040506070804c0a3475055c092c0c000ae66756c6c5f617474656e74696f6ec094ac426c6f636b52656d6f76"
    "656491cfb9807785afee48bba34750550000"
)
PLACEHOLDER = bytes.fromhex(
    "de0009a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391cfcb73eeaed59c009db17061"
    "72656e745f626c6f636b5f68617368c0a9746f6b656e5f69647390aa626c6f636b5f73697a6500a76c6f72615f69"
    "64c0a66d656469756da3435055a96c6f72615f6e616d65c0a967726f75705f69647800"
)

VECTOR_REMOVED = BlockRemoved(block_hashes=[U64_A], medium="GPU", group_idx=0)
VECTOR_STORED = BlockStored(
    block_hashes=[U64_A, U64_B],
    parent_block_hash=None,
    token_ids=[1, 2, 3, 4, 5, 6, 7, 8],
    block_size=4,
    lora_id=None,
    medium="GPU",
    lora_name=None,
    extra_keys=[None, None],
    group_idx=0,
    kv_cache_spec_kind="full_attention",
)


def test_vector_sizes_and_hash_conversion() -> None:
    sizes = [len(v) for v in (REMOVED_MAP, REMOVED_ARRAY, REMOVED_MAP_BYTES, CLEARED_MAP)]
    assert sizes == [64, 29, 89, 23]
    sizes = [len(v) for v in (CLEARED_ARRAY, STORED_MAP, STORED_ARRAY, BATCH_ARRAY, PLACEHOLDER)]
    assert sizes == [18, 192, 69, 110, 127]
    assert int.from_bytes(SHA_A[-8:], "big") == U64_A
    assert int.from_bytes(SHA_B[-8:], "big") == U64_B


@pytest.mark.parametrize(
    ("vector", "expected"),
    [
        pytest.param(REMOVED_MAP, VECTOR_REMOVED, id="removed-map"),
        pytest.param(REMOVED_ARRAY, VECTOR_REMOVED, id="removed-array"),
        pytest.param(
            REMOVED_MAP_BYTES,
            BlockRemoved(block_hashes=[SHA_A], medium="GPU", group_idx=0),
            id="removed-map-bytes",
        ),
        pytest.param(CLEARED_MAP, AllBlocksCleared(), id="cleared-map"),
        pytest.param(CLEARED_ARRAY, AllBlocksCleared(), id="cleared-array"),
        pytest.param(STORED_MAP, VECTOR_STORED, id="stored-map"),
        pytest.param(STORED_ARRAY, VECTOR_STORED, id="stored-array"),
        pytest.param(
            PLACEHOLDER,
            BlockStored(
                block_hashes=[U64_B],
                parent_block_hash=None,
                token_ids=[],
                block_size=0,
                lora_id=None,
                medium="CPU",
                lora_name=None,
                group_idx=0,
            ),
            id="placeholder",
        ),
    ],
)
def test_fact_sheet_event_vectors(vector: bytes, expected: Any) -> None:
    batch = decode_batch(_wrap(vector))
    assert batch.unknown_fields == 0
    assert batch.ts == 1.5
    assert batch.data_parallel_rank == 0
    [event] = batch.events
    assert type(event).__struct_config__.tag == type(expected).__struct_config__.tag
    assert isinstance(event, type(expected))
    for name in type(expected).__struct_fields__:
        assert getattr(event, name) == getattr(expected, name), name
    assert event == expected


def test_fact_sheet_event_vector_details() -> None:
    [removed] = decode_batch(_wrap(REMOVED_MAP_BYTES)).events
    assert removed.block_hashes[0].hex() == (
        "ca978112ca1bbdcafac231b39a23dc4da786eff8147c4e72b9807785afee48bb"
    )
    [stored] = decode_batch(_wrap(STORED_MAP)).events
    assert stored.kv_cache_spec_sliding_window is None
    assert stored.locality is stored.ownership is stored.session_id is None
    assert stored.lookahead_token_ids is None
    assert not stored.is_placeholder
    [placeholder] = decode_batch(_wrap(PLACEHOLDER)).events
    assert placeholder.is_placeholder
    assert placeholder.extra_keys is None


def test_fact_sheet_batch_vector() -> None:
    batch = decode_batch(BATCH_ARRAY)
    assert batch.ts == 1700000000.5
    assert batch.data_parallel_rank == 0
    assert batch.unknown_fields == 0
    assert batch.events == [VECTOR_STORED, VECTOR_REMOVED]
    assert isinstance(batch.events[0], BlockStored)
    assert isinstance(batch.events[1], BlockRemoved)


@pytest.mark.parametrize("release", ["0.22.0", "0.23.4"])
def test_batch_vector_reencodes_byte_for_byte(release: str) -> None:
    assert encode_batch(decode_batch(BATCH_ARRAY), layout_for(release)) == BATCH_ARRAY


@pytest.mark.parametrize(
    ("vector", "release"),
    [
        pytest.param(STORED_MAP, "0.33.0", id="stored-map"),
        pytest.param(PLACEHOLDER, "0.33.0", id="placeholder"),
        pytest.param(REMOVED_MAP, "0.24.0", id="removed-map-0.24"),
        pytest.param(REMOVED_MAP, "0.33.0", id="removed-map-0.33"),
        pytest.param(REMOVED_MAP_BYTES, "0.33.0", id="removed-map-bytes"),
        pytest.param(CLEARED_MAP, "0.29.0", id="cleared-map"),
        pytest.param(STORED_ARRAY, "0.22.0", id="stored-array"),
        pytest.param(REMOVED_ARRAY, "0.20.0", id="removed-array"),
        pytest.param(CLEARED_ARRAY, "0.9.1", id="cleared-array"),
    ],
)
def test_event_vectors_reencode_byte_for_byte(vector: bytes, release: str) -> None:
    payload = _wrap(vector)
    assert encode_batch(decode_batch(payload), layout_for(release)) == payload


def test_stored_map_vector_header_comes_from_the_033_class() -> None:
    """The 0.24 class has 12 map entries at most (fixmap); 0.33's has 16 (map16)."""
    batch = decode_batch(_wrap(STORED_MAP))
    for release in ("0.24.0", "0.26.0", "0.29.0", "0.30.0"):
        assert encode_batch(batch, layout_for(release)) == _wrap(b"\x8b" + STORED_MAP[3:])
    assert encode_batch(batch, layout_for("0.33.0")) == _wrap(STORED_MAP)


# ---------------------------------------------------------------------------------------------
# Unknown fields: ignored and counted
# ---------------------------------------------------------------------------------------------

STORED_MAP_EVENT = {
    "type": "BlockStored",
    "block_hashes": [U64_A, U64_B],
    "parent_block_hash": None,
    "token_ids": [1, 2, 3, 4, 5, 6, 7, 8],
    "block_size": 4,
    "lora_id": None,
    "medium": "GPU",
    "lora_name": None,
}
STORED_ARRAY_022 = [
    "BlockStored",
    [U64_A, U64_B],
    None,
    [1, 2, 3, 4, 5, 6, 7, 8],
    4,
    None,
    "GPU",
    None,
    [None, None],
    0,
    "full_attention",
    None,
]
REMOVED_ARRAY_020 = ["BlockRemoved", [U64_A], "GPU", 0]


def test_unknown_map_keys_are_ignored_and_counted() -> None:
    event = {**STORED_MAP_EVENT, "future": 1, "future_map": {"a": [1]}, "future_nil": None}
    batch = decode_batch(msgspec.msgpack.encode([1.5, [event], 0]))
    assert batch.unknown_fields == 3
    [stored] = batch.events
    assert stored.block_hashes == [U64_A, U64_B]
    assert stored.medium == "GPU"
    assert stored.group_idx is None


def test_unknown_map_keys_in_removed_and_cleared() -> None:
    removed = {"type": "BlockRemoved", "block_hashes": [U64_A], "medium": "GPU", "x": "y"}
    cleared = {"type": "AllBlocksCleared", "medium": "GPU", "reason": 1}
    batch = decode_batch(msgspec.msgpack.encode([1.5, [removed, cleared], 0]))
    assert batch.unknown_fields == 3
    assert batch.events == [BlockRemoved(block_hashes=[U64_A], medium="GPU"), AllBlocksCleared()]


def test_unknown_trailing_positions_of_all_blocks_cleared() -> None:
    batch = decode_batch(msgspec.msgpack.encode([1.5, [["AllBlocksCleared", "GPU", 7]], 0]))
    assert batch.unknown_fields == 2
    assert batch.events == [AllBlocksCleared()]


def test_extra_batch_element_is_ignored_and_counted() -> None:
    batch = decode_batch(msgspec.msgpack.encode([1.5, [["AllBlocksCleared"]], 4, "future"]))
    assert batch.unknown_fields == 1
    assert batch.ts == 1.5
    assert batch.data_parallel_rank == 4
    assert batch.events == [AllBlocksCleared()]


def test_unknown_fields_add_up_across_batch_and_events() -> None:
    events = [
        {**STORED_MAP_EVENT, "a": 1, "b": 2},
        ["AllBlocksCleared", None],
        {"type": "BlockRemoved", "block_hashes": [1], "medium": None, "c": 3},
    ]
    batch = decode_batch(msgspec.msgpack.encode([1.5, events, 0, "x", {"y": 1}]))
    assert batch.unknown_fields == 2 + 2 + 1 + 1
    assert [type(e).__struct_config__.tag for e in batch.events] == [
        "BlockStored",
        "AllBlocksCleared",
        "BlockRemoved",
    ]


def test_extra_batch_element_does_not_hide_a_wrong_type() -> None:
    error = _schema_error(msgspec.msgpack.encode(["x", [], 0, "future"]))
    assert str(error) == "batch: Expected `float`, got `str` - at `$[0]`"
    assert error.event_index is None
    assert error.field is None


@pytest.mark.parametrize(
    ("event", "extra"),
    [
        pytest.param(STORED_ARRAY_022, ["future"], id="stored-str"),
        pytest.param(STORED_ARRAY_022, [5, "x"], id="stored-int"),
        pytest.param(REMOVED_ARRAY_020, ["future"], id="removed-str"),
        pytest.param(REMOVED_ARRAY_020, [5], id="removed-int"),
    ],
)
def test_unknown_trailing_array_positions_are_ignored_and_counted(
    event: list[Any], extra: list[Any]
) -> None:
    batch = decode_batch(msgspec.msgpack.encode([1.5, [event + extra], 0]))
    assert batch.unknown_fields == len(extra)
    [decoded] = batch.events
    assert decoded.locality is None
    assert decoded.ownership is None


# ---------------------------------------------------------------------------------------------
# SchemaError
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cut", range(1, len(BATCH_ARRAY)))
def test_truncated_array_batch(cut: int) -> None:
    error = _schema_error(BATCH_ARRAY[:cut])
    assert str(error) == "batch: malformed msgpack: Input data was truncated"
    assert error.event_index is None
    assert error.field is None


@pytest.mark.parametrize("fraction", [0.01, 0.25, 0.5, 0.75, 0.99])
def test_truncated_map_era_fixture(fraction: float) -> None:
    payload, _ = _load(LAYOUTS[-1])
    error = _schema_error(payload[: int(len(payload) * fraction)])
    assert str(error) == "batch: malformed msgpack: Input data was truncated"
    assert (error.event_index, error.field) == (None, None)


@pytest.mark.parametrize("payload", [b"", memoryview(b"")], ids=["bytes", "memoryview"])
def test_empty_payload(payload: bytes) -> None:
    error = _schema_error(payload)
    assert str(error) == "batch: empty payload"
    assert (error.event_index, error.field) == (None, None)
    assert isinstance(error, ValueError)


def test_map_encoded_batch() -> None:
    payload = msgspec.msgpack.encode({"ts": 1.5, "events": [], "data_parallel_rank": 0})
    error = _schema_error(payload)
    assert str(error) == "batch: Expected `array`, got `object`"
    assert (error.event_index, error.field) == (None, None)


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        pytest.param([1.5], "batch: Expected `array` of at least length 2, got 1", id="short"),
        pytest.param([1.5, 3, 0], "batch: Expected `array`, got `int` - at `$[1]`", id="events"),
        pytest.param(
            [1.5, [], "0"], "batch: Expected `int | null`, got `str` - at `$[2]`", id="rank"
        ),
    ],
)
def test_malformed_batch(payload: list[Any], message: str) -> None:
    error = _schema_error(msgspec.msgpack.encode(payload))
    assert str(error) == message
    assert (error.event_index, error.field) == (None, None)


def test_trailing_bytes_after_batch() -> None:
    error = _schema_error(BATCH_ARRAY + b"\x00")
    assert str(error) == (
        "batch: malformed msgpack: MessagePack data is malformed: trailing characters (byte 110)"
    )


def _with(base: list[Any] | dict[str, Any], key: int | str, value: Any) -> Any:
    changed = list(base) if isinstance(base, list) else dict(base)
    changed[key] = value  # type: ignore[index]
    return changed


A = STORED_ARRAY_022
M = STORED_MAP_EVENT
R = REMOVED_ARRAY_020
MR = {"type": "BlockRemoved", "block_hashes": [U64_A], "medium": "GPU"}
NOT_STR = "Expected `str | null`, got `int`"


@pytest.mark.parametrize(
    ("event", "field", "text"),
    [
        # array events (0.22 layout); positions count the tag as 0
        (_with(A, 4, "x"), "block_size", "Expected `int`, got `str`"),
        (_with(A, 3, [1, 2, "3", 4, 5, 6, 7, 8]), "token_ids[2]", "Expected `int`, got `str`"),
        (_with(A, 6, 5), "medium", NOT_STR),
        (_with(A, 1, [1.5]), "block_hashes[0]", "Expected `int | bytes`, got `float`"),
        (_with(A, 1, 5), "block_hashes", "Expected `array`, got `int`"),
        (_with(A, 2, "p"), "parent_block_hash", "Expected `int | bytes | null`, got `str`"),
        (_with(A, 5, "7"), "lora_id", "Expected `int | null`, got `str`"),
        (_with(A, 7, 3), "lora_name", NOT_STR),
        (_with(A, 8, "x"), "extra_keys", "Expected `array | null`, got `str`"),
        (_with(A, 8, ["x"]), "extra_keys[0]", "Expected `array | null`, got `str`"),
        (_with(A, 9, "0"), "group_idx", "Expected `int | null`, got `str`"),
        (_with(A, 9, -1), "group_idx", "Expected `int` >= 0"),
        (_with(A, 10, 1), "kv_cache_spec_kind", NOT_STR),
        (_with(A, 11, "128"), "kv_cache_spec_sliding_window", "Expected `int | null`, got `str`"),
        (_with(A, 0, 5), "type", "Expected `str`, got `int`"),
        (_with(R, 2, 5), "medium", NOT_STR),
        (_with(R, 3, "g"), "group_idx", "Expected `int | null`, got `str`"),
        # map events
        (_with(M, "block_size", "x"), "block_size", "Expected `int`, got `str`"),
        (_with(M, "token_ids", [1, "2"]), "token_ids[1]", "Expected `int`, got `str`"),
        (_with(M, "medium", 5), "medium", NOT_STR),
        (_with(M, "block_hashes", ["z"]), "block_hashes[0]", "Expected `int | bytes`, got `str`"),
        (
            _with(M, "parent_block_hash", 1.5),
            "parent_block_hash",
            "Expected `int | bytes | null`, got `float`",
        ),
        (_with(M, "extra_keys", [5]), "extra_keys[0]", "Expected `array | null`, got `int`"),
        (_with(M, "locality", 1), "locality", NOT_STR),
        (_with(M, "ownership", 1), "ownership", NOT_STR),
        (_with(M, "session_id", 1), "session_id", NOT_STR),
        (
            _with(M, "lookahead_token_ids", [["a"]]),
            "lookahead_token_ids[0][0]",
            "Expected `int`, got `str`",
        ),
        (_with(M, "type", None), "type", "Expected `str`, got `null`"),
        (_with(MR, "group_idx", "x"), "group_idx", "Expected `int | null`, got `str`"),
        (_with(MR, "ownership", 3), "ownership", NOT_STR),
    ],
)
def test_wrong_type(event: Any, field: str, text: str) -> None:
    """The bad event sits at index 1, after a valid one."""
    error = _schema_error(msgspec.msgpack.encode([1.5, [["AllBlocksCleared"], event], 0]))
    assert str(error) == f"event 1: field {field!r}: {text}"
    assert error.event_index == 1
    assert error.field == field


@pytest.mark.parametrize(
    ("event", "field", "text"),
    [
        pytest.param(["BlockEvicted", [1]], "type", "Invalid value 'BlockEvicted'", id="array"),
        pytest.param(
            {"type": "BlockEvicted", "block_hashes": [1]},
            "type",
            "Invalid value 'BlockEvicted'",
            id="map",
        ),
        pytest.param(
            {"block_hashes": [1]}, "event", "Object missing required field `type`", id="no-tag"
        ),
        pytest.param(
            {"type": "BlockRemoved"},
            "event",
            "Object missing required field `block_hashes`",
            id="missing-field",
        ),
        pytest.param(
            ["BlockStored", [1]],
            "event",
            "Expected `array` of at least length 6, got 2",
            id="short-array",
        ),
        pytest.param([], "event", "Expected `array` of at least length 1, got 0", id="empty"),
        pytest.param(3, "event", "Expected `object`, got `int`", id="not-an-event"),
    ],
)
def test_unknown_or_missing_tag_and_fields(event: Any, field: str, text: str) -> None:
    error = _schema_error(msgspec.msgpack.encode([1.5, [["AllBlocksCleared"], event], 0]))
    assert str(error) == f"event 1: field {field!r}: {text}"
    assert error.event_index == 1
    assert error.field == field


@pytest.mark.parametrize(
    "event",
    [
        pytest.param(_with(A, 1, [1, 2, 3]), id="array"),
        pytest.param(_with(M, "block_hashes", [1, 2, 3]), id="map"),
    ],
)
def test_tokens_cannot_fill_hashes(event: Any) -> None:
    error = _schema_error(msgspec.msgpack.encode([1.5, [["AllBlocksCleared"], event], 0]))
    assert str(error) == "event 1: field 'token_ids': 8 tokens cannot fill 3 blocks of 4"
    assert error.event_index == 1
    assert error.field == "token_ids"


def test_more_tokens_than_hashes_is_accepted() -> None:
    """Sliding-window and Mamba groups skip hashes of null blocks (fact sheet section 4)."""
    batch = decode_batch(msgspec.msgpack.encode([1.5, [_with(A, 1, [U64_A])], 0]))
    assert batch.events[0].block_hashes == [U64_A]
    assert len(batch.events[0].token_ids) == 8


def test_negative_block_size() -> None:
    error = _schema_error(msgspec.msgpack.encode([1.5, [_with(M, "block_size", -4)], 0]))
    assert str(error) == "event 0: field 'block_size': Expected `int` >= 0"
    assert (error.event_index, error.field) == (0, "block_size")


@pytest.mark.parametrize(
    ("tokens", "field", "text"),
    [
        ([1, 2, 3, 4, 5, 6, 7, 2**32], "token_ids[7]", "Expected `int` <= 4294967295"),
        ([1, 2, 3, 4, 5, 6, 7, -1], "token_ids[7]", "Expected `int` >= 0"),
    ],
)
def test_token_id_out_of_u32_range(tokens: list[int], field: str, text: str) -> None:
    for event in (_with(A, 3, tokens), _with(M, "token_ids", tokens)):
        error = _schema_error(msgspec.msgpack.encode([1.5, [event], 0]))
        assert str(error) == f"event 0: field {field!r}: {text}"
        assert (error.event_index, error.field) == (0, field)


def test_token_id_u32_max_is_accepted() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 7, 2**32 - 1]
    batch = decode_batch(msgspec.msgpack.encode([1.5, [_with(M, "token_ids", tokens)], 0]))
    assert batch.events[0].token_ids[-1] == 4294967295


def test_lookahead_token_id_above_u32() -> None:
    event = _with(M, "lookahead_token_ids", [[2**32]])
    error = _schema_error(msgspec.msgpack.encode([1.5, [event], 0]))
    assert str(error) == (
        "event 0: field 'lookahead_token_ids[0][0]': Expected `int` <= 4294967295"
    )


def test_hash_of_every_int_width() -> None:
    hashes = [0, 127, 255, 65535, 2**32 - 1, 2**63 - 1, 2**64 - 1, -1, -(2**15), -(2**63)]
    batch = decode_batch(msgspec.msgpack.encode([1.5, [["BlockRemoved", hashes, None]], 0]))
    assert batch.events[0].block_hashes == hashes


# ---------------------------------------------------------------------------------------------
# layout_for
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("release", "first"),
    [
        ("0.9.0", "0.9.0"),
        ("0.9.0.1", "0.9.0"),
        ("0.9.1", "0.9.1"),
        ("0.10.1.1", "0.9.1"),
        ("0.10.2", "0.10.2"),
        ("0.13.0", "0.10.2"),
        ("0.14.0", "0.14.0"),
        ("0.19.1", "0.17.0"),
        ("0.21.0", "0.20.0"),
        ("0.23.4", "0.22.0"),
        ("0.24.0", "0.24.0"),
        ("0.25.1", "0.24.0"),
        ("0.28.1", "0.26.0"),
        ("0.29.0", "0.29.0"),
        ("0.32.0", "0.30.0"),
        ("0.33.0", "0.33.0"),
        ("v0.25.2", "0.24.0"),
        ("0.29.1", "0.29.0"),
        ("0.9.0rc1", "0.9.0"),
        ("0.40.0", "0.33.0"),
    ],
)
def test_layout_for(release: str, first: str) -> None:
    layout = layout_for(release)
    assert layout.first == first
    assert layout is LAYOUTS[LAYOUT_IDS.index(first)]


def test_layout_for_representative_shapes() -> None:
    assert layout_for("0.9.0").batch_fields == 2
    assert layout_for("0.9.0.1").batch_fields == 2
    assert layout_for("0.10.1.1").stored == (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
    )
    assert layout_for("0.10.2").removed == ("block_hashes", "medium")
    assert layout_for("0.23.4").encoding == "array"
    assert layout_for("0.24.0").encoding == "map"
    assert layout_for("0.33.0").stored[-1] == "lookahead_token_ids"
    assert len(layout_for("0.33.0").stored) == 15


def test_layout_for_release_without_kv_events() -> None:
    with pytest.raises(ValueError, match=r"^vLLM 0\.8\.5 publishes no KV events"):
        layout_for("0.8.5")
    with pytest.raises(ValueError, match=r"^not a vLLM release: 'latest'$"):
        layout_for("latest")
