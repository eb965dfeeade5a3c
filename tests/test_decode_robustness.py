"""``decode_batch`` turns every payload into a ``VllmBatch`` or a ``SchemaError``, nothing else.

Reproducers of payloads that once escaped as ``msgspec.DecodeError`` or ``RecursionError`` or were
accepted out of range, the nesting limit at its boundary on both decoding paths, and a seeded
fuzz run over :func:`kvbridge.testing.corpus.payload_corpus`.
"""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
from collections import Counter
from typing import Any

import msgspec
import pytest

from kvbridge import SchemaError, VllmBatch, decode_batch
from kvbridge.schemas.vllm import MAX_NESTING, BlockStored
from kvbridge.testing.corpus import KINDS, labelled_corpus, payload_corpus

HEAD = "93cb0000000000000000"
"""``[0.0, ...`` : a batch array of three, its ``ts`` as a float64."""


def _error(payload: bytes) -> SchemaError:
    with pytest.raises(SchemaError) as caught:
        decode_batch(payload)
    return caught.value


@pytest.mark.parametrize(
    ("payload", "message", "event_index", "field"),
    [
        pytest.param(
            HEAD + "9192b0416c6c426c6f636b73436c6561726564a1ffc0",
            "event 0: malformed msgpack: Invalid UTF-8 encoded string",
            0,
            None,
            id="array-event-trailing-invalid-utf8",
        ),
        pytest.param(
            HEAD + "9183a474797065b0416c6c426c6f636b73436c6561726564a17801a1ff01c0",
            "event 0: malformed msgpack: Invalid UTF-8 encoded string",
            0,
            None,
            id="map-event-unknown-key-then-invalid-utf8-key",
        ),
        pytest.param(
            HEAD + "91" * 996 + "c0c0",
            f"event 0: nesting deeper than {MAX_NESTING} levels",
            0,
            None,
            id="deep-nesting",
        ),
        pytest.param(
            HEAD + "9191b0416c6c426c6f636b73436c6561726564ff",
            "batch: field 'data_parallel_rank': Expected `int` >= 0",
            None,
            "data_parallel_rank",
            id="negative-dp-rank",
        ),
    ],
)
def test_reproducer(payload: str, message: str, event_index: int | None, field: str | None) -> None:
    error = _error(bytes.fromhex(payload))
    assert str(error) == message
    assert (error.event_index, error.field) == (event_index, field)


# -- ranges --------------------------------------------------------------------------------

STORE: dict[str, Any] = {
    "type": "BlockStored",
    "block_hashes": [1],
    "parent_block_hash": None,
    "token_ids": [1, 2],
    "block_size": 2,
    "lora_id": None,
    "lora_name": None,
}
U32_MAX = 2**32 - 1


def _batch(*events: Any, rank: Any = 0) -> bytes:
    return msgspec.msgpack.encode([1.5, list(events), rank])


@pytest.mark.parametrize("rank", [0, U32_MAX, None])
def test_dp_rank_in_u32_is_accepted(rank: int | None) -> None:
    assert decode_batch(_batch(STORE, rank=rank)).data_parallel_rank == rank


@pytest.mark.parametrize(
    ("rank", "text"),
    [
        (-1, "Expected `int` >= 0"),
        (-(2**63), "Expected `int` >= 0"),
        (2**32, "Expected `int` <= 4294967295"),
        (2**64 - 1, "Expected `int` <= 4294967295"),
    ],
)
def test_dp_rank_outside_u32(rank: int, text: str) -> None:
    for events in ([], [STORE], [["AllBlocksCleared", "unknown"]]):  # both decoding paths
        error = _error(_batch(*events, rank=rank))
        assert str(error) == f"batch: field 'data_parallel_rank': {text}"
        assert (error.event_index, error.field) == (None, "data_parallel_rank")


@pytest.mark.parametrize(
    ("field", "value", "text"),
    [
        ("block_size", 2**32, "Expected `int` <= 4294967295"),
        ("group_idx", 2**32, "Expected `int` <= 4294967295"),
        ("group_idx", -1, "Expected `int` >= 0"),
    ],
)
def test_event_fields_outside_u32(field: str, value: int, text: str) -> None:
    event = {**STORE, field: value}
    if field == "block_size":
        event["block_hashes"] = []  # no tokens to fill: only the range can fail
    error = _error(_batch(event))
    assert str(error) == f"event 0: field {field!r}: {text}"
    assert (error.event_index, error.field) == (0, field)


def test_u32_edges_are_accepted() -> None:
    event = {**STORE, "block_hashes": [], "block_size": U32_MAX, "group_idx": U32_MAX}
    [decoded] = decode_batch(_batch(event)).events
    assert isinstance(decoded, BlockStored)
    assert (decoded.block_size, decoded.group_idx) == (U32_MAX, U32_MAX)


# -- nesting ---------------------------------------------------------------------------------


def _nest(levels: int) -> Any:
    value: Any = None
    for _ in range(levels):
        value = [value]
    return value


def _deep_bytes(levels: int) -> bytes:
    """``levels`` nested arrays around a nil (msgspec cannot encode this deep itself)."""
    return b"\x91" * levels + b"\xc0"


NESTING_ERROR = f"event 0: nesting deeper than {MAX_NESTING} levels"


@pytest.mark.parametrize("depth", [MAX_NESTING - 1, MAX_NESTING])
def test_nesting_up_to_the_limit_fails_with_a_type_error(depth: int) -> None:
    """``[ts, [[[...]]], nil]``: the batch is level 1, so the event holds ``depth - 2`` levels."""
    payload = bytes.fromhex(HEAD) + _deep_bytes(depth - 1) + b"\xc0"
    error = _error(payload)
    assert str(error) == "event 0: field 'type': Expected `str`, got `array`"


@pytest.mark.parametrize("depth", [MAX_NESTING + 1, MAX_NESTING + 2, 5_000, 100_000])
def test_nesting_past_the_limit(depth: int) -> None:
    payload = bytes.fromhex(HEAD) + _deep_bytes(depth - 1) + b"\xc0"
    error = _error(payload)
    assert str(error) == NESTING_ERROR
    assert (error.event_index, error.field) == (0, None)


def _store_with(depth: int, where: str) -> bytes:
    """A valid store whose payload nests ``depth`` levels, in its extra keys (the fast path
    decodes those), in an unknown field (the event-by-event path skips it) or in an unknown
    field before the tag (msgspec skips it looking for the tag)."""
    if where == "extra_keys":  # batch, events, event, extra_keys, the block's keys: 5 levels
        return _batch({**STORE, "extra_keys": [[_nest(depth - 5)]]})
    if where == "unknown":
        return _batch({**STORE, "future": _nest(depth - 3)})
    assert where == "before_tag"
    return _batch({"future": _nest(depth - 3), **STORE})


@pytest.mark.parametrize("where", ["extra_keys", "unknown", "before_tag"])
def test_valid_payload_at_the_limit_decodes(where: str) -> None:
    batch = decode_batch(_store_with(MAX_NESTING, where))
    assert len(batch.events) == 1
    assert batch.unknown_fields == (0 if where == "extra_keys" else 1)


@pytest.mark.parametrize("where", ["extra_keys", "unknown", "before_tag"])
@pytest.mark.parametrize("depth", [MAX_NESTING + 1, 900])
def test_valid_payload_past_the_limit(where: str, depth: int) -> None:
    error = _error(_store_with(depth, where))
    assert str(error) == NESTING_ERROR
    assert (error.event_index, error.field) == (0, None)


@pytest.mark.parametrize("levels", [2_000, 20_000])
def test_deeper_than_the_recursion_limit_before_a_map_event_tag(levels: int) -> None:
    """The fast path's msgspec recurses (skipping to the tag) and raises RecursionError; the
    event-by-event path rejects the nesting before decoding."""
    event = b"\x82\xa6future" + _deep_bytes(levels) + msgspec.msgpack.encode("type")
    event += msgspec.msgpack.encode("AllBlocksCleared")
    payload = bytes.fromhex(HEAD) + b"\x91" + event + b"\xc0"
    assert levels > sys.getrecursionlimit()
    assert str(_error(payload)) == NESTING_ERROR


def test_nesting_outside_the_events_is_a_batch_error() -> None:
    payload = msgspec.msgpack.encode([1.5, [], 0, "x"])[:-2] + _deep_bytes(MAX_NESTING)
    error = _error(payload)
    assert str(error) == f"batch: nesting deeper than {MAX_NESTING} levels"
    assert (error.event_index, error.field) == (None, None)


def _header(rng: random.Random, count: int, fix: int, code16: int, code32: int) -> bytes:
    """The header of a msgpack array or map of ``count`` items, in one of its three forms at
    random: ``fix | count``, or ``code16`` / ``code32`` and a 16- / 32-bit count."""
    return rng.choice(
        (
            bytes([fix | count]),
            bytes([code16]) + count.to_bytes(2, "big"),
            bytes([code32]) + count.to_bytes(4, "big"),
        )
    )


def _random_nested(rng: random.Random, depth: int) -> bytes:
    """A msgpack value exactly ``depth`` levels deep (0: a scalar), written by hand with every
    header kind (fix, 16 and 32-bit containers, str, bin and ext of each width) around the
    deepest path, so that the nesting check's walk over the headers is exercised."""
    scalars = [
        b"\x05",
        b"\xe0",
        b"\xcc\x80",
        b"\xcd\x01\x00",
        b"\xce\x00\x01\x00\x00",
        b"\xcf" + bytes(8),
        b"\xd3" + bytes(8),
        b"\xca" + bytes(4),
        b"\xcb" + bytes(8),
        b"\xa3abc",
        b"\xd9\x03abc",
        b"\xda\x00\x03abc",
        b"\xdb\x00\x00\x00\x03abc",
        b"\xc4\x02\x91\x91",
        b"\xc5\x00\x02\x91\x91",
        b"\xc6\x00\x00\x00\x02\x91\x91",
        b"\xd4\x01\x91",
        b"\xd8\x01" + b"\x91" * 16,
        b"\xc7\x02\x01\x91\x91",
        b"\xc8\x00\x02\x01\x91\x91",
        b"\xc9\x00\x00\x00\x02\x01\x91\x91",
        b"\xc0",
        b"\xc3",
    ]
    if depth == 0:
        return rng.choice(scalars)
    inner = _random_nested(rng, depth - 1)
    siblings = [rng.choice(scalars) for _ in range(rng.randrange(3))]
    if rng.random() < 0.5:  # an array, the deep value anywhere among its items
        items = [*siblings, inner]
        rng.shuffle(items)
        return _header(rng, len(items), 0x90, 0xDC, 0xDD) + b"".join(items)
    pairs = [(b"\xa1k", scalar) for scalar in siblings] + [(b"\xa1d", inner)]
    rng.shuffle(pairs)
    return _header(rng, len(pairs), 0x80, 0xDE, 0xDF) + b"".join(k + v for k, v in pairs)


@pytest.mark.parametrize("seed", range(40))
def test_nesting_limit_with_every_msgpack_header(seed: int) -> None:
    """An unknown field of a valid store (level 4) holding a value of random depth: the batch
    decodes up to the limit and fails past it."""
    rng = random.Random(seed)
    for depth in (MAX_NESTING - 4, MAX_NESTING - 3, MAX_NESTING - 2, rng.randrange(1, 80)):
        encoded = msgspec.msgpack.encode({**STORE, "future": "@"})
        event = encoded.replace(b"\xa1@", _random_nested(rng, depth))
        payload = bytes.fromhex(HEAD) + b"\x91" + event + b"\xc0"
        if 3 + depth <= MAX_NESTING:
            assert decode_batch(payload).unknown_fields == 1
        else:
            assert str(_error(payload)) == NESTING_ERROR


# -- the fuzz corpus -------------------------------------------------------------------------

FUZZ_COUNT = 50_000
FUZZ_SEED = 20_240_601


def _outcome(payload: bytes) -> str:
    try:
        batch = decode_batch(payload)
    except SchemaError:
        return "SchemaError"
    except Exception as error:  # the failure this test exists for
        raise AssertionError(
            f"{type(error).__name__}: {error} for {payload[:200].hex()}"
        ) from error
    assert isinstance(batch, VllmBatch)
    return "decoded"


def test_fuzz_corpus_decodes_or_raises_schema_error() -> None:
    outcomes: Counter[tuple[str, str]] = Counter()
    for kind, payload in labelled_corpus(FUZZ_SEED, FUZZ_COUNT):
        outcomes[kind, _outcome(payload)] += 1
    assert sum(outcomes.values()) == FUZZ_COUNT
    by_kind = {kind for kind, _ in outcomes}
    assert by_kind == set(KINDS)
    assert outcomes["valid", "decoded"] > 0 and ("valid", "SchemaError") not in outcomes
    assert outcomes["base", "decoded"] > 0 and ("base", "SchemaError") not in outcomes
    for kind in ("truncate", "random_bytes", "invalid_utf8", "deep"):
        assert outcomes[kind, "SchemaError"] > 0


def _digest(seed: int, count: int) -> str:
    digest = hashlib.sha256()
    for payload in payload_corpus(seed, count):
        digest.update(len(payload).to_bytes(4, "big") + payload)
    return digest.hexdigest()


def test_corpus_is_deterministic_across_processes() -> None:
    """Same seed, same payloads, whatever the hash seed of the process (a differential test
    against another decoder relies on it)."""
    assert _digest(3, 2_000) == _digest(3, 2_000)
    assert _digest(3, 2_000) != _digest(4, 2_000)
    code = "from test_decode_robustness import _digest; print(_digest(3, 2_000))"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=os.path.dirname(__file__),
        env=env,
    )
    assert result.stdout.strip() == _digest(3, 2_000)


def test_corpus_count_and_kinds() -> None:
    payloads = list(payload_corpus(0, 500))
    assert len(payloads) == 500
    assert all(isinstance(payload, bytes) for payload in payloads)
    assert list(payload_corpus(0, 0)) == []
