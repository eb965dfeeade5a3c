"""Fixture values as the JSON files beside the msgpack fixtures write them.

The fixture tools write a bytes value (a 32-byte block hash) as ``{"bytes": "<hex>"}`` and
every other value as JSON has it; :func:`from_json` reads that form back.
"""

from __future__ import annotations

from typing import Any


def from_json(value: Any) -> Any:
    """A fixture JSON value as kvbridge decodes it: ``{"bytes": hex}`` becomes bytes, inside
    lists too; everything else is returned as it is."""
    if isinstance(value, dict) and set(value) == {"bytes"}:
        return bytes.fromhex(value["bytes"])
    if isinstance(value, list):
        return [from_json(item) for item in value]
    return value
