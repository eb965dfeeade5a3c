"""The fast path of :func:`~kvbridge.schemas.vllm.decode_batch`: a whole batch in one pass of
msgspec.

Almost every payload is a batch whose events are all of one era (arrays up to vLLM 0.23, tagged
maps from 0.24), all known and all valid; for those, one msgspec decoder per era types the
whole batch at once. It is a module apart from the event-by-event path
(:mod:`~kvbridge.schemas.vllm.event_decode`) because it answers only "yes, here is the batch" or
"no": it names no error and counts no unknown field, and anything it refuses goes to that path.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

from kvbridge.schemas.vllm.layouts import LAST_ARRAY_LAYOUT, REMOVED_FIELDS, STORED_FIELDS
from kvbridge.schemas.vllm.types import (
    MAX_NESTING,
    U32,
    BlockRemoved,
    BlockStored,
    VllmBatch,
    wire_union,
)

__all__ = ["decode_fast"]

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
    if event.tokens_short:
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
        BlockStored: STORED_FIELDS[LAST_ARRAY_LAYOUT.stored_fields :],
        BlockRemoved: REMOVED_FIELDS[LAST_ARRAY_LAYOUT.removed_fields :],
    }
    return wire_union(
        array_like=array_like,
        strict=True,
        nil_fields=past_array_era if array_like else None,
        store_check=_check_store,
    )


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


def decode_fast(payload: bytes | memoryview) -> VllmBatch | None:
    """The batch, if the fast path decodes it; ``None`` sends it to the event-by-event path."""
    for decoder in _FAST_BATCHES:
        try:
            fast: Any = decoder.decode(payload)
        except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
            # RecursionError: msgspec skipping a deep field before a map event's tag, or
            # decoding deep extra keys; the event-by-event path rejects the nesting first.
            continue
        return VllmBatch(fast.ts, fast.events, fast.data_parallel_rank)
    return None
