"""The ways :mod:`kvbridge.testing.corpus` breaks a valid payload: bytes flipped, truncated,
inserted or spliced, integers out of their range, values of the wrong type, invalid UTF-8, deep
nesting, unknown fields and shuffled keys, and random msgpack values."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, Final

import msgspec

from kvbridge.schemas.vllm import MAX_NESTING

__all__ = ["EDGE_INTS", "MUTATIONS", "encode_value", "random_value", "splice"]

EDGE_INTS: Final = (
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
"""Integers at the edges of what msgpack and the wire types carry."""
_OUT_OF_RANGE: Final = (-1, -(2**7), -(2**31), -(2**63), 2**32, 2**32 + 1, 2**63, 2**64 - 1)
"""Replacements for integer fields: outside u32 (dp rank, token ids, block size, group index)
and at the edges of what msgpack can carry."""
_INVALID_UTF8: Final = (b"\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\x80")
_SENTINEL: Final = "\x00kvbridge-corpus-sentinel\x00"


def random_value(rng: random.Random, depth: int = 0) -> Any:
    """A random msgpack value (containers up to a few levels)."""
    pick = rng.randrange(12 if depth < 4 else 9)
    if pick == 0:
        return None
    if pick == 1:
        return rng.random() < 0.5
    if pick == 2:
        return rng.choice(EDGE_INTS)
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
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(5))]
    return {
        rng.choice(("type", "block_hashes", "medium", "x", "")): random_value(rng, depth + 1)
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


def encode_value(root: Any) -> bytes | None:
    """``root`` as msgpack, or ``None`` if msgpack cannot carry it."""
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


def splice(rng: random.Random, payload: bytes, other: bytes) -> bytes:
    return payload[: rng.randrange(len(payload) + 1)] + other[rng.randrange(len(other) + 1) :]


def _out_of_range(rng: random.Random, payload: bytes) -> bytes | None:
    """An integer field (not a bool) set to a value outside its range."""
    found = _structural(rng, payload, lambda value: type(value) is int)
    if found is None:
        return None
    root, path = found
    return encode_value(_replace(root, path, rng.choice(_OUT_OF_RANGE)))


def _wrong_type(rng: random.Random, payload: bytes) -> bytes | None:
    """Any value (a container included) replaced by a random value."""
    found = _structural(rng, payload, lambda value: True)
    if found is None:
        return None
    root, path = found
    return encode_value(_replace(root, path, random_value(rng)))


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
    encoded = encode_value(_replace(root, path, _SENTINEL))
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
        target.append(random_value(rng))
    else:
        target[rng.choice(("future_field", "x", "type2"))] = random_value(rng)
    return encode_value(root)


def _shuffle_keys(rng: random.Random, payload: bytes) -> bytes | None:
    """A map's keys in another order (the event tag may then come last)."""
    found = _structural(rng, payload, lambda value: isinstance(value, dict) and len(value) > 1)
    if found is None:
        return None
    root, path = found
    items = list(_at(root, path).items())
    rng.shuffle(items)
    return encode_value(_replace(root, path, dict(items)))


# -- the corpus ----------------------------------------------------------------------------


MUTATIONS: Final[dict[str, Callable[[random.Random, bytes], bytes | None]]] = {
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
"""The mutations by kind (``splice`` takes a second payload and stands apart)."""
