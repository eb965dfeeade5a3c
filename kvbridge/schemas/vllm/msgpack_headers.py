"""Reading msgpack headers without decoding: how deep a payload nests, and an array event's
length and tag.

The event-by-event decoder needs these answers before (or instead of) letting msgspec decode:
a payload nested too deep must be refused before anything recurses into it, and an array
event's trailing positions are counted from its headers alone. Reading bytes is a job apart
from typing events, so it has this module.
"""

from __future__ import annotations

from typing import Final

import msgspec

__all__ = ["array_header", "is_array", "nesting_path"]


def is_array(raw: msgspec.Raw) -> bool:
    """Whether an encoded value is a msgpack array."""
    first = memoryview(raw)[0]
    return 0x90 <= first <= 0x9F or first in (0xDC, 0xDD)


def array_header(raw: msgspec.Raw) -> tuple[int, str | None]:
    """An array event's length and tag, read from the msgpack headers of the array and of its
    first item (a cheap look at the first bytes); the tag is ``None`` if it is not a string."""
    view = memoryview(raw)
    first = view[0]
    if first <= 0x9F:
        length, offset = first & 0x0F, 1
    else:
        width = 2 if first == 0xDC else 4
        length, offset = int.from_bytes(view[1 : 1 + width], "big"), 1 + width
    if offset >= len(view):
        return length, None
    head = view[offset]
    if 0xA0 <= head <= 0xBF:
        size, start = head & 0x1F, offset + 1
    elif head in (0xD9, 0xDA, 0xDB):
        width = 1 << (head - 0xD9)
        size = int.from_bytes(view[offset + 1 : offset + 1 + width], "big")
        start = offset + 1 + width
    else:
        return length, None
    return length, bytes(view[start : start + size]).decode("utf-8", "replace")


def _scalar_sizes() -> bytes:
    """For each msgpack first byte, the size of the whole value if it has a fixed size (0 for
    containers, for str, bin and ext with a length field, and for the unused 0xc1)."""
    sizes = bytearray(256)
    for head in range(256):
        if head <= 0x7F or head >= 0xE0 or head in (0xC0, 0xC2, 0xC3):
            sizes[head] = 1  # fixint, nil, bool
        elif 0xA0 <= head <= 0xBF:
            sizes[head] = 1 + (head & 0x1F)  # fixstr
    for heads, size in (
        ((0xCC, 0xD0), 2),  # (u)int8
        ((0xCD, 0xD1), 3),  # (u)int16
        ((0xCA, 0xCE, 0xD2), 5),  # float32, (u)int32
        ((0xCB, 0xCF, 0xD3), 9),  # float64, (u)int64
        ((0xD4,), 3),  # fixext 1, 2, 4, 8, 16 (type byte included)
        ((0xD5,), 4),
        ((0xD6,), 6),
        ((0xD7,), 10),
        ((0xD8,), 18),
    ):
        for head in heads:
            sizes[head] = size
    return bytes(sizes)


_SCALAR_SIZES: Final = _scalar_sizes()
_LENGTH_WIDTH: Final = {
    **{0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4},  # bin, str
    **{0xC7: 1, 0xC8: 2, 0xC9: 4},  # ext (a type byte follows the length)
    **{0xDC: 2, 0xDD: 4, 0xDE: 2, 0xDF: 4},  # array, map
}


def nesting_path(payload: bytes | memoryview, limit: int) -> list[tuple[int, bool]] | None:
    """Where arrays and maps first nest deeper than ``limit`` levels, read from the msgpack
    headers alone, before anything recurses: for each enclosing container, outermost first,
    the position in it (a map counts its keys and values) and whether it is a map; ``None`` if
    they never do.

    Malformed or truncated msgpack ends the walk (``None``): msgspec then reports it, having
    recursed no deeper than the walk did. Linear in the payload's size, recursion-free.
    """
    data = bytes(payload)
    sizes = data.translate(_SCALAR_SIZES)  # each byte's value size, were it a header
    stack: list[int] = []  # items left in each enclosing container (and the root), innermost last
    opened: list[tuple[int, bool]] = []  # item count and map-ness of each enclosing container
    remaining = 1  # the payload: one value
    pos = 0
    try:
        while True:
            while remaining:  # scalars of a fixed size: the bulk of a payload
                size = sizes[pos]
                if not size:
                    break
                pos += size
                remaining -= 1
            else:
                if not stack:
                    return None
                remaining = stack.pop()
                opened.pop()
                continue
            head = data[pos]
            remaining -= 1
            if head <= 0x9F:  # fixmap 0x80-0x8f, fixarray 0x90-0x9f
                count = (head & 0x0F) << (head < 0x90)
                pos += 1
            else:
                width = _LENGTH_WIDTH.get(head)
                if width is None:
                    return None  # 0xc1, never used
                length = int.from_bytes(data[pos + 1 : pos + 1 + width], "big")
                pos += 1 + width
                if head < 0xDC:  # str, bin, ext: skip the body (and an ext's type byte)
                    pos += length + (head in (0xC7, 0xC8, 0xC9))
                    continue
                count = length << (head >= 0xDE)
            if len(stack) >= limit:
                lefts = [*stack[1:], remaining]
                return [
                    (n - left - 1, is_map) for (n, is_map), left in zip(opened, lefts, strict=True)
                ]
            stack.append(remaining)
            opened.append((count, head <= 0x8F or head >= 0xDE))
            remaining = count
    except IndexError:  # truncated
        return None
