"""Decoding vLLM payloads into the typed events: :func:`decode_batch`.

Decoding is tolerant but never guesses: unknown trailing positions and unknown map keys are
ignored and counted, while an unknown event tag, a wrong type, a value out of its range, a
``BlockStored`` whose tokens cannot cover its hashes, malformed msgpack or arrays and maps nested
deeper than :data:`~kvbridge.schemas.vllm.types.MAX_NESTING` raise :class:`SchemaError` (naming
the event index and the field where they are known). :func:`decode_batch` raises nothing else
for any payload.
"""

from __future__ import annotations

import re
from typing import Any, Final

import msgspec

from kvbridge.schemas.errors import SchemaError
from kvbridge.schemas.vllm.layouts import LAYOUTS, REMOVED_FIELDS, STORED_FIELDS
from kvbridge.schemas.vllm.types import (
    MAX_NESTING,
    U32,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    VllmBatch,
)

__all__ = ["decode_batch"]


# Wire variants of the public event types: strict ones for the fast path, tolerant ones (unknown
# fields ignored) for payloads from releases newer than this table.
def _variants(*, array_like: bool, strict: bool) -> tuple[type[Any], ...]:
    return tuple(
        msgspec.defstruct(
            base.__name__,
            [],
            bases=(base,),
            tag=base.__name__,
            array_like=array_like,
            forbid_unknown_fields=strict,
        )
        for base in (BlockStored, BlockRemoved, AllBlocksCleared)
    )


def _event_union(*, array_like: bool, strict: bool) -> Any:
    stored, removed, cleared = _variants(array_like=array_like, strict=strict)
    return stored | removed | cleared


class _WireBatch(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: U32 | None = None


class _TolerantWireBatch(_WireBatch, array_like=True, forbid_unknown_fields=False):
    """Struct options are inherited, so ``forbid_unknown_fields`` must be switched off here."""


_BATCH = msgspec.msgpack.Decoder(_WireBatch)
_TOLERANT_BATCH = msgspec.msgpack.Decoder(_TolerantWireBatch)
_LAST_ARRAY_LAYOUT: Final = [layout for layout in LAYOUTS if layout.encoding == "array"][-1]
_STRICT = {
    era: msgspec.msgpack.Decoder(_event_union(array_like=era, strict=True)) for era in (True, False)
}
_TOLERANT = {
    era: msgspec.msgpack.Decoder(_event_union(array_like=era, strict=False))
    for era in (True, False)
}


def _tokens_short(event: BlockStored) -> bool:
    """Whether a store's tokens cannot fill its blocks (a placeholder has none to check)."""
    return bool(event.token_ids) and (
        event.block_size == 0 or len(event.token_ids) < len(event.block_hashes) * event.block_size
    )


_KEY_LEVELS: Final = MAX_NESTING - 5
"""How deep one extra key may nest: a block's keys are at level 5 (batch, events, event,
``extra_keys``, the block's keys)."""


def _nests_deeper(value: Any, levels: int) -> bool:
    """Whether a decoded value's lists and dicts (tuples as dict keys) nest more than ``levels``
    deep. Recurses at most ``levels`` times."""
    if type(value) is dict:
        children: Any = [*value, *value.values()]
    elif type(value) is list or type(value) is tuple:
        children = value
    else:
        return False
    return levels < 1 or any(_nests_deeper(child, levels - 1) for child in children)


def _check_store(event: BlockStored) -> None:
    """``__post_init__`` of the fast path's stores: msgspec calls it as it decodes each one, and
    a failure sends the batch to the event-by-event path, whose error names the event.

    The fast path does not look at nesting before it decodes: only the extra keys (typed
    ``Any``) can nest deeply in what it accepts, so they are checked here, and a payload nested
    deeper than :data:`MAX_NESTING` fails on either path.
    """
    if _tokens_short(event):
        raise ValueError("the tokens cannot fill the blocks")
    if event.extra_keys is not None:
        for keys in event.extra_keys:
            if keys:
                for key in keys:
                    if (type(key) is list or type(key) is dict) and _nests_deeper(key, _KEY_LEVELS):
                        raise ValueError("an extra key nests too deep")


def _fast_union(*, array_like: bool) -> Any:
    """The strict event union of the fast path, for one era.

    Stores check their token count as they are decoded. Array events never had the map-only
    fields (``locality`` and after), so the array variants accept only nil there: an array
    event with a value past its era's positions fails and goes to the event-by-event path,
    which counts it as unknown.
    """
    past_array_era: dict[type[msgspec.Struct], tuple[str, ...]] = {
        BlockStored: STORED_FIELDS[_LAST_ARRAY_LAYOUT.stored_fields :],
        BlockRemoved: REMOVED_FIELDS[_LAST_ARRAY_LAYOUT.removed_fields :],
    }
    stored, removed, cleared = (
        msgspec.defstruct(
            base.__name__,
            [(name, None, None) for name in past_array_era.get(base, ())] if array_like else [],
            bases=(base,),
            tag=base.__name__,
            array_like=array_like,
            forbid_unknown_fields=True,
            namespace={"__post_init__": _check_store} if base is BlockStored else None,
        )
        for base in (BlockStored, BlockRemoved, AllBlocksCleared)
    )
    return stored | removed | cleared


_FAST_BATCHES = tuple(
    msgspec.msgpack.Decoder(
        msgspec.defstruct(
            "_FastWireBatch",
            [
                ("ts", float),
                ("events", list[_fast_union(array_like=era)]),  # type: ignore[misc]
                ("data_parallel_rank", U32 | None, None),
            ],
            array_like=True,
            forbid_unknown_fields=True,
        )
    )
    for era in (False, True)
)
"""The fast path: a batch whose events are all of one era, all known and all valid, in one pass
of msgspec; map events (vLLM 0.24+) are tried first. Anything else (mixed eras, unknown fields,
errors) takes the event-by-event path, which counts unknown fields and names the bad field."""


_GENERIC = msgspec.msgpack.Decoder()
_FIELDS_BY_TAG: Final[dict[str, tuple[str, ...]]] = {
    "BlockStored": STORED_FIELDS,
    "BlockRemoved": REMOVED_FIELDS,
    "AllBlocksCleared": (),
}
_ARRAY_PATH = re.compile(r"^\$\[(\d+)\](.*)$")
_MAP_PATH = re.compile(r"^\$\.(\w+)(.*)$")


def _is_array(raw: msgspec.Raw) -> bool:
    first = memoryview(raw)[0]
    return 0x90 <= first <= 0x9F or first in (0xDC, 0xDD)


_ARRAY_FIELDS: Final = {
    "BlockStored": _LAST_ARRAY_LAYOUT.stored_fields,
    "BlockRemoved": _LAST_ARRAY_LAYOUT.removed_fields,
    "AllBlocksCleared": 0,
}
"""Array events never carried the map-only fields, so positions past these are unknown."""


def _array_header(raw: msgspec.Raw) -> tuple[int, str | None]:
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


def _array_overflow(raw: msgspec.Raw) -> int:
    """How many trailing positions of an array event no release defined."""
    length, tag = _array_header(raw)
    known = _ARRAY_FIELDS.get(tag) if tag is not None else None
    return 0 if known is None else max(0, length - 1 - known)


def _count_unknown(raw: msgspec.Raw, tag: str) -> int:
    """Slow path only: how many positions or keys of one event this table does not know."""
    generic = _GENERIC.decode(raw)
    known = _FIELDS_BY_TAG[tag]
    if isinstance(generic, list):
        return max(0, len(generic) - 1 - len(known))
    return len(generic.keys() - {"type", *known})


def _field_error(index: int, raw: msgspec.Raw, error: Exception) -> SchemaError:
    """Rewrite msgspec's error so that it names the event index and the field."""
    message = str(error)
    text, _, path = message.partition(" - at `")
    path = path.rstrip("`")
    field = "event"
    if match := _ARRAY_PATH.match(path):
        position, rest = int(match[1]), match[2]
        # From the header: decoding the whole event could fail on some other value.
        _, tag = _array_header(raw)
        names = _FIELDS_BY_TAG.get(str(tag))
        if position == 0:
            field = "type"
        elif names and position <= len(names):
            field = names[position - 1] + rest
        else:
            field = f"[{position}]{rest}"
    elif match := _MAP_PATH.match(path):
        field = match[1] + match[2]
    elif "tag" in text.lower() or "Invalid value" in text:
        field = "type"
    return SchemaError(f"event {index}: field {field!r}: {text}", event_index=index, field=field)


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


def _too_deep(payload: bytes | memoryview, limit: int) -> list[tuple[int, bool]] | None:
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


def _nesting_error(path: list[tuple[int, bool]]) -> SchemaError:
    """The error for a payload nested too deep at ``path`` (from :func:`_too_deep`): inside an
    event when the batch and its events are arrays and the path goes through the events."""
    text = f"nesting deeper than {MAX_NESTING} levels"
    if len(path) >= 2 and path[0] == (1, False) and not path[1][1]:
        return SchemaError(f"event {path[1][0]}: {text}", event_index=path[1][0])
    return SchemaError(f"batch: {text}")


def _decode_event(index: int, raw: msgspec.Raw) -> tuple[Event, int]:
    """Decode one event of the event-by-event path."""
    try:
        return _decode_wire_event(index, raw)
    except msgspec.DecodeError as error:  # invalid UTF-8 in a string the batch skipped, say
        raise SchemaError(
            f"event {index}: malformed msgpack: {error}", event_index=index
        ) from error


def _decode_wire_event(index: int, raw: msgspec.Raw) -> tuple[Event, int]:
    array = _is_array(raw)
    if array and (overflow := _array_overflow(raw)):
        trimmed = _GENERIC.decode(raw)[: -overflow or None]
        event, _ = _decode_event(index, msgspec.Raw(msgspec.msgpack.encode(trimmed)))
        return event, overflow
    try:
        return _STRICT[array].decode(raw), 0
    except msgspec.ValidationError as strict_error:
        try:
            event = _TOLERANT[array].decode(raw)
        except msgspec.ValidationError as error:
            raise _field_error(index, raw, error) from error
        unknown = _count_unknown(raw, type(event).__name__)
        if not unknown:  # the strict decoder failed for another reason than extra fields
            raise _field_error(index, raw, strict_error) from strict_error
        return event, unknown


def _check(index: int, event: Event) -> None:
    if isinstance(event, BlockStored) and _tokens_short(event):
        raise SchemaError(
            f"event {index}: field 'token_ids': {len(event.token_ids)} tokens cannot fill "
            f"{len(event.block_hashes)} blocks of {event.block_size}",
            event_index=index,
            field="token_ids",
        )


def decode_batch(payload: bytes | memoryview) -> VllmBatch:
    """Decode the msgpack payload (frame 2) of any vLLM release that publishes KV events.

    Raises:
        SchemaError: for any payload that is not a valid batch of a known layout (and nothing
            else for any payload).
    """
    if not payload:
        raise SchemaError("batch: empty payload")
    for decoder in _FAST_BATCHES:
        try:
            fast: Any = decoder.decode(payload)
        except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
            # RecursionError: msgspec skipping a deep field before a map event's tag, or
            # decoding deep extra keys; the event-by-event path rejects the nesting first.
            continue
        return VllmBatch(fast.ts, fast.events, fast.data_parallel_rank)
    return _decode_batch_by_event(payload)


_BATCH_FIELDS: Final = {"$[0]": "ts", "$[1]": "events", "$[2]": "data_parallel_rank"}
_BOUND = re.compile(r"^Expected `int` [<>]=? -?\d+$")


def _batch_error(error: msgspec.ValidationError) -> SchemaError:
    """msgspec's error about the batch itself. A value out of its range names its field, as
    event errors do; other errors keep msgspec's wording and path (``- at `$[2]```)."""
    text, _, path = str(error).partition(" - at `")
    field = _BATCH_FIELDS.get(path.rstrip("`"))
    if field is not None and _BOUND.match(text):
        return SchemaError(f"batch: field {field!r}: {text}", field=field)
    return SchemaError(f"batch: {error}")


def _decode_batch_by_event(payload: bytes | memoryview) -> VllmBatch:
    """Decode event by event: array events, unknown fields, and precise errors."""
    if (path := _too_deep(payload, MAX_NESTING)) is not None:
        raise _nesting_error(path)
    try:
        try:
            wire: _WireBatch = _BATCH.decode(payload)
            unknown = 0
        except msgspec.ValidationError as strict_error:
            wire = _TOLERANT_BATCH.decode(payload)
            generic = _GENERIC.decode(payload)
            unknown = len(generic) - 3
            if unknown <= 0:
                raise strict_error from None
    except msgspec.ValidationError as error:
        raise _batch_error(error) from error
    except msgspec.DecodeError as error:
        raise SchemaError(f"batch: malformed msgpack: {error}") from error
    events: list[Event] = []
    for index, raw in enumerate(wire.events):
        event, extra = _decode_event(index, raw)
        _check(index, event)
        events.append(event)
        unknown += extra
    return VllmBatch(wire.ts, events, wire.data_parallel_rank, unknown)
