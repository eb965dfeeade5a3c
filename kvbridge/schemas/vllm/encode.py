"""Encoding events exactly as a given release puts them on the wire (fixtures, tests, the
decoders' differential corpus)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from kvbridge.schemas.vllm.layouts import Layout, layout_types
from kvbridge.schemas.vllm.types import Event, VllmBatch

__all__ = ["encode_batch"]


def encode_batch(batch: VllmBatch | Sequence[Event], layout: Layout, *, ts: float = 0.0) -> bytes:
    """Encode events exactly as the releases of ``layout`` put them on the wire.

    Fields the layout does not have are left out, as that release would.
    """
    if isinstance(batch, VllmBatch):
        ts, events, rank = batch.ts, batch.events, batch.data_parallel_rank
    else:
        events, rank = list(batch), None
    types = layout_types(layout)
    wire_events = []
    for event in events:
        wire_type = types[type(event).__struct_config__.tag]  # type: ignore[index]
        # A layout's fields are the leading fields of the event type.
        fields = msgspec.structs.astuple(event)[: len(wire_type.__struct_fields__)]
        wire_events.append(wire_type(*fields))
    wire: list[Any] = [ts, wire_events, rank]
    return msgspec.msgpack.encode(wire[: layout.batch_fields])
