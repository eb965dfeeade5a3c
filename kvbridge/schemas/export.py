"""JSON Schema of every vLLM layout and of Dynamo's KvCacheEvent, generated from the types."""

from __future__ import annotations

from typing import Any

import msgspec

from kvbridge.schemas.kv_cache_event import KvCacheEvent
from kvbridge.schemas.vllm import LAYOUTS, layout_types

__all__ = ["json_schema"]


def _batch_schema(
    releases: str, event_types: dict[str, type[msgspec.Struct]], fields: int
) -> dict[str, Any]:
    """vLLM's batch is a positional array ``[ts, events, data_parallel_rank]``. Each schema is
    its own resource (``$id``), so its ``#/$defs`` references resolve inside it."""
    stored, removed, cleared = event_types.values()
    _, components = msgspec.json.schema_components([stored, removed, cleared])
    items: list[Any] = [
        {"type": "number", "title": "ts"},
        {
            "type": "array",
            "title": "events",
            "items": {"anyOf": [{"$ref": f"#/$defs/{name}"} for name in event_types]},
        },
        {"anyOf": [{"type": "integer"}, {"type": "null"}], "title": "data_parallel_rank"},
    ][:fields]
    return {
        "$id": f"urn:kvbridge:vllm:{releases}",
        "title": f"vLLM {releases} KV-event batch",
        "type": "array",
        "prefixItems": items,
        "minItems": 2,
        "description": "msgpack payload (frame 2); bytes are msgpack bin, shown as base64",
        "$defs": components,
    }


def json_schema() -> dict[str, Any]:
    """One document: ``vllm`` maps each layout's release range to the schema of its batch, and
    ``dynamo`` holds the schema of the ``KvCacheEvent`` JSON that ``RadixTree`` accepts."""
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "kvbridge wire formats",
        "vllm": {
            layout.releases: _batch_schema(
                layout.releases, layout_types(layout), layout.batch_fields
            )
            for layout in LAYOUTS
        },
        "dynamo": {
            "KvCacheEvent": {
                "$id": "urn:kvbridge:dynamo:KvCacheEvent",
                **msgspec.json.schema(KvCacheEvent),
            }
        },
    }
