"""A deterministic corpus of vLLM KV-event payloads, valid and broken, for decoder robustness.

:func:`payload_corpus` yields msgpack payloads (ZMQ frame 2) of every kind a decoder may meet:
valid batches of every layout in :data:`~kvbridge.schemas.vllm.LAYOUTS` (built with
:func:`~kvbridge.schemas.vllm.encode_batch`), the bundled fixtures, batches with fields no
release has, and broken ones: flipped, truncated, inserted and spliced bytes, integers out of
their range, values of the wrong type, invalid UTF-8, deep nesting, random msgpack values and
random bytes. The same seed and count always yield the same payloads (given the same fixture
files), so that two decoders (kvbridge's and a native one) can be run over the same corpus and
compared payload by payload.

The corpus asserts nothing: :func:`kvbridge.decode_batch` must turn each payload into a
:class:`~kvbridge.schemas.vllm.VllmBatch` or raise :class:`~kvbridge.SchemaError`, and
``tests/test_decode_robustness.py`` and ``tools/fuzz_decode.py`` check that it does.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Final

import msgspec

from kvbridge.schemas.vllm import (
    LAYOUTS,
    MAX_NESTING,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    VllmBatch,
    encode_batch,
)

__all__ = [
    "KINDS",
    "base_payloads",
    "fixture_payloads",
    "labelled_corpus",
    "payload_corpus",
    "valid_payload",
]

_FIXTURES: Final = Path(__file__).resolve().parents[2] / "tests" / "fixtures"
_FIXTURE_DIRS: Final = ("layouts", "releases")

_MEDIA: Final = ("GPU", "CPU", "cpu", "DISK", "CPU_TIER2", "EXTERNAL", "HBM", None)
_EDGE_INTS: Final = (
    0,
    1,
    127,
    128,
    255,
    2**16 - 1,
    2**31 - 1,
    2**32 - 1,
    2**63 - 1,
    2**64 - 1,
    -1,
    -(2**31),
    -(2**63),
)
_OUT_OF_RANGE: Final = (-1, -(2**7), -(2**31), -(2**63), 2**32, 2**32 + 1, 2**63, 2**64 - 1)
"""Replacements for integer fields: outside u32 (dp rank, token ids, block size, group index)
and at the edges of what msgpack can carry."""
_INVALID_UTF8: Final = (b"\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\x80")
_SENTINEL: Final = "\x00kvbridge-corpus-sentinel\x00"


def fixture_payloads(root: Path | None = None) -> list[bytes]:
    """The bundled fixture payloads (``tests/fixtures/layouts`` and ``releases``), in path
    order; empty outside a source checkout."""
    root = _FIXTURES if root is None else root
    return [
        path.read_bytes()
        for directory in _FIXTURE_DIRS
        for path in sorted((root / directory).glob("*.msgpack"))
    ]


def _hash(rng: random.Random, as_bytes: bool) -> int | bytes:
    if as_bytes:
        return rng.randbytes(32 if rng.random() < 0.8 else rng.randrange(17))
    pick = rng.random()
    if pick < 0.6:
        return rng.getrandbits(64)  # u64, as from vLLM 0.10.2
    if pick < 0.9:
        return rng.getrandbits(63) - (1 << 62)  # signed, as before
    return rng.choice(_EDGE_INTS)


def _tokens(rng: random.Random, count: int) -> list[int]:
    """``count`` token ids of a 152k vocabulary, with the u32 edges now and then."""
    tokens = [word % 152_064 for word in struct.unpack(f"<{count}I", rng.randbytes(4 * count))]
    if tokens and rng.random() < 0.2:
        tokens[rng.randrange(count)] = rng.choice((0, 2**32 - 1))
    return tokens


_EXTRA_KEYS: Final[tuple[Callable[[random.Random], Any], ...]] = (
    lambda rng: "adapter-1",  # a LoRA name
    lambda rng: "tenant-7",  # a cache salt
    lambda rng: rng.randbytes(32).hex(),  # a multimodal digest (up to vLLM 0.18)
    lambda rng: [rng.randbytes(32).hex(), rng.randrange(4096)],  # (identifier, offset), 0.19+
    lambda rng: rng.randbytes(32),  # a prompt-embeddings digest
    lambda rng: rng.randrange(2**31),
)


def _extra_key(rng: random.Random) -> Any:
    return rng.choice(_EXTRA_KEYS)(rng)


def _event(rng: random.Random) -> Event:
    """One event with every field set to a valid value (a layout keeps the fields it has)."""
    kind = rng.random()
    as_bytes = rng.random() < 0.4
    if kind < 0.08:
        return AllBlocksCleared()
    blocks = rng.choice((1, 1, 2, 3, 8, rng.randrange(1, 65)))
    hashes = [_hash(rng, as_bytes) for _ in range(blocks)]
    medium = rng.choice(_MEDIA)
    group = rng.choice((None, 0, 1, 2**32 - 1))
    locality = rng.choice((None, "LOCAL", "REMOTE"))
    ownership = rng.choice((None, "OWNED", "SHARED"))
    if kind < 0.4:
        return BlockRemoved(hashes, medium, group, locality, ownership)
    block_size = rng.choice((1, 4, 16, 16, 32))
    placeholder = rng.random() < 0.15
    tokens = [] if placeholder else _tokens(rng, blocks * block_size)
    extra = None
    if rng.random() < 0.3:
        extra = [[_extra_key(rng) for _ in range(rng.randrange(3))] or None for _ in hashes]
    return BlockStored(
        hashes,
        None if placeholder or rng.random() < 0.5 else _hash(rng, as_bytes),
        tokens,
        block_size,
        rng.choice((None, None, 1, 2**31 - 1)),
        medium,
        rng.choice((None, "adapter-1")),
        extra,
        group,
        rng.choice((None, "full_attention", "sliding_window", "mla_attention")),
        rng.choice((None, 128, 4096)),
        locality,
        ownership,
        rng.choice((None, "session-1")),
        rng.choice((None, [_tokens(rng, rng.randrange(4))])),
    )


def valid_payload(rng: random.Random) -> bytes:
    """A valid batch of random events in the layout of a random vLLM release."""
    layout = rng.choice(LAYOUTS)
    events = [_event(rng) for _ in range(rng.choice((0, 1, 1, 2, 3, 5, rng.randrange(1, 40))))]
    rank = rng.choice((None, 0, 0, 1, 7, 2**32 - 1))
    return encode_batch(VllmBatch(rng.random() * 2e9, events, rank), layout)


def base_payloads(seed: int = 0, built: int = 4) -> list[bytes]:
    """The valid payloads the corpus mutates: the fixtures, then ``built`` payloads built with
    ``encode_batch`` for every layout of ``LAYOUTS``."""
    rng = random.Random(seed)
    payloads = fixture_payloads()
    for layout in LAYOUTS:
        for _ in range(built):
            events = [_event(rng) for _ in range(rng.randrange(1, 8))]
            payloads.append(encode_batch(VllmBatch(1.5, events, rng.choice((None, 0, 3))), layout))
    return payloads


# -- generic msgpack values ----------------------------------------------------------------


def _random_value(rng: random.Random, depth: int = 0) -> Any:
    """A random msgpack value (containers up to a few levels)."""
    pick = rng.randrange(12 if depth < 4 else 9)
    if pick == 0:
        return None
    if pick == 1:
        return rng.random() < 0.5
    if pick == 2:
        return rng.choice(_EDGE_INTS)
    if pick == 3:
        return rng.uniform(-1e6, 1e6)
    if pick == 4:
        return rng.choice(("", "GPU", "BlockStored", "BlockRemoved", "AllBlocksCleared", "type"))
    if pick == 5:
        return rng.randbytes(rng.randrange(10))
    if pick == 6:
        return msgspec.msgpack.Ext(
            rng.randrange(-128, 128), rng.randbytes(rng.choice((1, 4, 8, 12)))
        )
    if pick in (7, 8):
        return rng.getrandbits(rng.choice((8, 32, 64)))
    if pick in (9, 10):
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(5))]
    return {
        rng.choice(("type", "block_hashes", "medium", "x", "")): _random_value(rng, depth + 1)
        for _ in range(rng.randrange(4))
    }


def _children(value: Any) -> list[Any]:
    if isinstance(value, list):
        return list(range(len(value)))
    if isinstance(value, dict):
        return list(value)
    return []


def _replace(root: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    parent = root
    for step in path[:-1]:
        parent = parent[step]
    parent[path[-1]] = new
    return root


def _at(root: Any, path: tuple[Any, ...]) -> Any:
    for step in path:
        root = root[step]
    return root


def _structural(
    rng: random.Random, payload: bytes, pick: Callable[[Any], bool]
) -> tuple[Any, tuple[Any, ...]] | None:
    """The decoded payload and the path of a value satisfying ``pick``, found by random
    descent from the root (a few tries), or ``None``."""
    try:
        root = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, RecursionError):
        return None
    for _ in range(16):
        path: tuple[Any, ...] = ()
        value = root
        while (children := _children(value)) and not (pick(value) and rng.random() < 0.3):
            step = rng.choice(children)
            path, value = (*path, step), value[step]
        if pick(value):
            return root, path
    return None


def _encode(root: Any) -> bytes | None:
    try:
        return msgspec.msgpack.encode(root)
    except (TypeError, ValueError, OverflowError, RecursionError):
        return None


# -- mutations -----------------------------------------------------------------------------


def _flip(rng: random.Random, payload: bytes) -> bytes:
    data = bytearray(payload)
    for _ in range(rng.choice((1, 1, 1, 2, 3, 8))):
        at = rng.randrange(len(data))
        data[at] = rng.randrange(256) if rng.random() < 0.5 else data[at] ^ (1 << rng.randrange(8))
    return bytes(data)


def _truncate(rng: random.Random, payload: bytes) -> bytes:
    return payload[: rng.randrange(len(payload))]


def _insert(rng: random.Random, payload: bytes) -> bytes:
    at = rng.randrange(len(payload) + 1)
    chunk = rng.choice(
        (
            rng.randbytes(rng.randrange(1, 9)),
            bytes([rng.choice((0xC0, 0xC1, 0x90, 0x91, 0x80, 0x81, 0xDC, 0xDD, 0xDE, 0xDF))]),
            b"\xa1\xff",
            b"\xcf" + rng.randbytes(8),
        )
    )
    return payload[:at] + chunk + payload[at:]


def _splice(rng: random.Random, payload: bytes, other: bytes) -> bytes:
    return payload[: rng.randrange(len(payload) + 1)] + other[rng.randrange(len(other) + 1) :]


def _out_of_range(rng: random.Random, payload: bytes) -> bytes | None:
    """An integer field (not a bool) set to a value outside its range."""
    found = _structural(rng, payload, lambda value: type(value) is int)
    if found is None:
        return None
    root, path = found
    return _encode(_replace(root, path, rng.choice(_OUT_OF_RANGE)))


def _wrong_type(rng: random.Random, payload: bytes) -> bytes | None:
    """Any value (a container included) replaced by a random value."""
    found = _structural(rng, payload, lambda value: True)
    if found is None:
        return None
    root, path = found
    return _encode(_replace(root, path, _random_value(rng)))


def _has_text(value: Any) -> bool:
    if isinstance(value, dict):
        return any(isinstance(key, str) and key for key in value)
    return isinstance(value, str) and bool(value)


def _invalid_utf8(rng: random.Random, payload: bytes) -> bytes | None:
    """One string (a value or a map key) whose bytes are no longer UTF-8, same length."""
    found = _structural(rng, payload, _has_text)
    if found is None:
        return None
    value = _at(*found)
    if isinstance(value, dict):
        value = rng.choice([key for key in value if isinstance(key, str) and key])
    encoded = msgspec.msgpack.encode(value)
    at = payload.find(encoded)
    if at < 0:
        return None
    body = len(value.encode())
    start = at + len(encoded) - body  # past the header
    bad = rng.choice(_INVALID_UTF8)[:body]
    start += rng.randrange(body - len(bad) + 1)
    return payload[:start] + bad + payload[start + len(bad) :]


_LEVELS: Final = (b"\x91", b"\x81\xa1k", b"\x92\x01", b"\xdc\x00\x01", b"\xde\x00\x01\x00")
"""msgpack headers that each open one level: arrays and maps, the nested value last."""


def _nested_bytes(rng: random.Random, depth: int) -> bytes:
    """``depth`` nested arrays and maps around a nil, as msgpack (msgspec would recurse)."""
    levels = [rng.choice(_LEVELS) for _ in range(min(depth, 16))]
    whole, rest = divmod(depth, len(levels)) if levels else (0, 0)
    return b"".join(levels) * whole + b"".join(levels[:rest]) + b"\xc0"


def _deep(rng: random.Random, payload: bytes) -> bytes | None:
    """A value replaced by arrays and maps nested around :data:`MAX_NESTING` levels deep, or
    far deeper than the interpreter's recursion limit."""
    found = _structural(rng, payload, lambda value: True)
    if found is None:
        return None
    root, path = found
    encoded = _encode(_replace(root, path, _SENTINEL))
    if encoded is None:
        return None
    depth = rng.choice(
        (
            rng.randrange(MAX_NESTING - 8, MAX_NESTING + 3),
            rng.randrange(1, MAX_NESTING * 2),
            rng.randrange(900, 3000),
            rng.randrange(10_000, 20_000),
        )
    )
    sentinel = msgspec.msgpack.encode(_SENTINEL)
    return encoded.replace(sentinel, _nested_bytes(rng, depth), 1)


def _unknown_fields(rng: random.Random, payload: bytes) -> bytes | None:
    """Fields no release has: a trailing batch element, a trailing array position or an
    unknown map key, with a random value (valid if the rest is)."""
    found = _structural(rng, payload, lambda value: isinstance(value, list | dict))
    if found is None:
        return None
    root, path = found
    target = _at(root, path)
    if isinstance(target, list):
        target.append(_random_value(rng))
    else:
        target[rng.choice(("future_field", "x", "type2"))] = _random_value(rng)
    return _encode(root)


def _shuffle_keys(rng: random.Random, payload: bytes) -> bytes | None:
    """A map's keys in another order (the event tag may then come last)."""
    found = _structural(rng, payload, lambda value: isinstance(value, dict) and len(value) > 1)
    if found is None:
        return None
    root, path = found
    items = list(_at(root, path).items())
    rng.shuffle(items)
    return _encode(_replace(root, path, dict(items)))


# -- the corpus ----------------------------------------------------------------------------

KINDS: Final = (
    "valid",
    "base",
    "flip",
    "truncate",
    "insert",
    "splice",
    "out_of_range",
    "wrong_type",
    "invalid_utf8",
    "deep",
    "unknown_fields",
    "shuffle_keys",
    "random_msgpack",
    "random_bytes",
)
"""The kinds of payload :func:`payload_corpus` draws from, in equal shares."""


_MUTATIONS: Final[dict[str, Callable[[random.Random, bytes], bytes | None]]] = {
    "flip": _flip,
    "truncate": _truncate,
    "insert": _insert,
    "out_of_range": _out_of_range,
    "wrong_type": _wrong_type,
    "invalid_utf8": _invalid_utf8,
    "deep": _deep,
    "unknown_fields": _unknown_fields,
    "shuffle_keys": _shuffle_keys,
}


def _one(rng: random.Random, kind: str, bases: Sequence[bytes]) -> bytes | None:
    """One payload of ``kind``, or ``None`` if the mutation drawn cannot apply."""
    if kind == "valid":
        return valid_payload(rng)
    if kind == "random_msgpack":
        return _encode(_random_value(rng))
    if kind == "random_bytes":
        return rng.randbytes(rng.choice((rng.randrange(1, 16), rng.randrange(1, 512))))
    base = rng.choice(bases) if rng.random() < 0.5 else valid_payload(rng)
    if kind == "base" or not base:
        return base
    if kind == "splice":
        return _splice(rng, base, rng.choice(bases))
    return _MUTATIONS[kind](rng, base)


def labelled_corpus(
    seed: int, count: int, *, bases: Sequence[bytes] | None = None
) -> Iterator[tuple[str, bytes]]:
    """:func:`payload_corpus` with the kind (one of :data:`KINDS`) of each payload."""
    rng = random.Random(seed)
    pool = list(base_payloads(seed) if bases is None else bases) or [valid_payload(rng)]
    for _ in range(count):
        kind = rng.choice(KINDS)
        payload = _one(rng, kind, pool)
        yield ("valid", valid_payload(rng)) if payload is None else (kind, payload)


def payload_corpus(
    seed: int, count: int, *, bases: Sequence[bytes] | None = None
) -> Iterator[bytes]:
    """``count`` payloads drawn from :data:`KINDS`, the same ones for the same ``seed``.

    Args:
        seed: seeds the only random generator used.
        count: how many payloads to yield.
        bases: the valid payloads to mutate; by default :func:`base_payloads` (the fixtures of
            a source checkout, then payloads built for every layout).

    A mutation that cannot apply to the payload drawn (no string to break, say) yields a valid
    payload instead, so that exactly ``count`` payloads come out.
    """
    for _, payload in labelled_corpus(seed, count, bases=bases):
        yield payload
