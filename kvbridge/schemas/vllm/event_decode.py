"""The event-by-event path of :func:`~kvbridge.schemas.vllm.decode_batch`: every payload the
fast path refuses, decoded one event at a time.

This is where the decoder's promises are kept: array events of any era mixed with map events,
unknown trailing positions and unknown map keys ignored and counted, and for anything invalid a
:class:`SchemaError` that names the event index and the field (rewritten from msgspec's error
path), including a payload nested deeper than
:data:`~kvbridge.schemas.vllm.types.MAX_NESTING`, refused before anything recurses into it.
"""

from __future__ import annotations

import re
from typing import Final

import msgspec

from kvbridge.schemas.errors import SchemaError
from kvbridge.schemas.vllm.layouts import LAST_ARRAY_LAYOUT, REMOVED_FIELDS, STORED_FIELDS
from kvbridge.schemas.vllm.msgpack_headers import array_header, is_array, nesting_path
from kvbridge.schemas.vllm.types import (
    MAX_NESTING,
    U32,
    BlockStored,
    Event,
    VllmBatch,
    wire_union,
)

__all__ = ["decode_by_event"]


class _WireBatch(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: U32 | None = None


class _TolerantWireBatch(_WireBatch, array_like=True, forbid_unknown_fields=False):
    """Struct options are inherited, so ``forbid_unknown_fields`` must be switched off here."""


_BATCH = msgspec.msgpack.Decoder(_WireBatch)
_TOLERANT_BATCH = msgspec.msgpack.Decoder(_TolerantWireBatch)
# Strict event decoders, tried first, and tolerant ones (unknown fields ignored) for payloads
# from releases newer than this table.
_STRICT = {
    era: msgspec.msgpack.Decoder(wire_union(array_like=era, strict=True)) for era in (True, False)
}
_TOLERANT = {
    era: msgspec.msgpack.Decoder(wire_union(array_like=era, strict=False)) for era in (True, False)
}


_GENERIC = msgspec.msgpack.Decoder()
_FIELDS_BY_TAG: Final[dict[str, tuple[str, ...]]] = {
    "BlockStored": STORED_FIELDS,
    "BlockRemoved": REMOVED_FIELDS,
    "AllBlocksCleared": (),
}
_ARRAY_PATH = re.compile(r"^\$\[(\d+)\](.*)$")
_MAP_PATH = re.compile(r"^\$\.(\w+)(.*)$")

_ARRAY_FIELDS: Final = {
    "BlockStored": LAST_ARRAY_LAYOUT.stored_fields,
    "BlockRemoved": LAST_ARRAY_LAYOUT.removed_fields,
    "AllBlocksCleared": 0,
}
"""Array events never carried the map-only fields, so positions past these are unknown."""


def _array_overflow(raw: msgspec.Raw) -> int:
    """How many trailing positions of an array event no release defined."""
    length, tag = array_header(raw)
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
        _, tag = array_header(raw)
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


def _nesting_error(path: list[tuple[int, bool]]) -> SchemaError:
    """The error for a payload nested too deep at ``path`` (from
    :func:`~kvbridge.schemas.vllm.msgpack_headers.nesting_path`): inside an event when the batch
    and its events are arrays and the path goes through the events."""
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
    array = is_array(raw)
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
    if isinstance(event, BlockStored) and event.tokens_short:
        raise SchemaError(
            f"event {index}: field 'token_ids': {len(event.token_ids)} tokens cannot fill "
            f"{len(event.block_hashes)} blocks of {event.block_size}",
            event_index=index,
            field="token_ids",
        )


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


def decode_by_event(payload: bytes | memoryview) -> VllmBatch:
    """Decode event by event: array events, unknown fields, and precise errors."""
    if (path := nesting_path(payload, MAX_NESTING)) is not None:
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
