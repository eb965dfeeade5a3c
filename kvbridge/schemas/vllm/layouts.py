"""The per-release layouts of the wire format, in one table that the decoder, the encoder, the
fixtures, the JSON Schema export and the Rust core's field table (checked by a test) follow.

vLLM has shipped twelve distinct layouts: positional arrays up to 0.23 (a field appended every
few releases) and tagged maps from 0.24 (defaulted fields left out). Each row of
:data:`LAYOUTS` says how many of each event's fields, in declaration order, a range of releases
sends.
"""

from __future__ import annotations

import functools
import re
from typing import Final, Literal

import msgspec

from kvbridge.schemas.vllm.types import AllBlocksCleared, BlockRemoved, BlockStored

__all__ = [
    "LAYOUTS",
    "REMOVED_FIELDS",
    "STORED_FIELDS",
    "Layout",
    "layout_for",
    "layout_types",
]


class Layout(msgspec.Struct, frozen=True):
    """The wire layout shared by a range of vLLM releases."""

    first: str
    last: str
    encoding: Literal["array", "map"]
    batch_fields: int
    stored_fields: int
    removed_fields: int

    @property
    def releases(self) -> str:
        return self.first if self.first == self.last else f"{self.first}-{self.last}"

    @property
    def stored(self) -> tuple[str, ...]:
        return STORED_FIELDS[: self.stored_fields]

    @property
    def removed(self) -> tuple[str, ...]:
        return REMOVED_FIELDS[: self.removed_fields]


STORED_FIELDS: Final = tuple(BlockStored.__struct_fields__)
REMOVED_FIELDS: Final = tuple(BlockRemoved.__struct_fields__)
_STORED_ALWAYS_SENT: Final = 7
"""In the map era the fields without a default (up to ``lora_name``) are sent even when nil."""
_REMOVED_ALWAYS_SENT: Final = 2

LAYOUTS: Final[tuple[Layout, ...]] = (
    Layout("0.9.0", "0.9.0.1", "array", 2, 5, 1),
    Layout("0.9.1", "0.10.1.1", "array", 3, 5, 1),
    Layout("0.10.2", "0.13.0", "array", 3, 6, 2),  # + medium
    Layout("0.14.0", "0.16.0", "array", 3, 7, 2),  # + lora_name
    Layout("0.17.0", "0.19.1", "array", 3, 8, 2),  # + extra_keys
    Layout("0.20.0", "0.21.0", "array", 3, 9, 3),  # + group_idx
    Layout("0.22.0", "0.23.x", "array", 3, 11, 3),  # + kv_cache_spec_kind, _sliding_window
    Layout("0.24.0", "0.25.1", "map", 3, 11, 3),  # events become tagged maps
    Layout("0.26.0", "0.28.x", "map", 3, 12, 4),  # + locality
    Layout("0.29.0", "0.29.0", "map", 3, 13, 5),  # + ownership
    Layout("0.30.0", "0.32.0", "map", 3, 14, 5),  # + session_id
    Layout("0.33.0", "0.33.0", "map", 3, 15, 5),  # + lookahead_token_ids
)
"""Every distinct layout, oldest first. Each adds fields at the end of the previous one."""

LAST_ARRAY_LAYOUT: Final = [layout for layout in LAYOUTS if layout.encoding == "array"][-1]
"""The newest layout of positional arrays: array events never carried the fields after its
own (the map-only fields, ``locality`` and after)."""


_RELEASE: Final = re.compile(r"^v?(\d+(?:\.\d+)*)")


def release_key(release: str) -> tuple[int, ...]:
    """A vLLM release's number as a tuple that orders releases (``"v0.25.2"`` and ``"0.25.2"``
    give ``(0, 25, 2)``; a suffix such as ``rc1`` is ignored).

    Raises:
        ValueError: ``release`` does not start with a release number.
    """
    match = _RELEASE.match(release.strip())
    if match is None:
        raise ValueError(f"not a vLLM release: {release!r}")
    return tuple(int(part) for part in match[1].split("."))


@functools.lru_cache(maxsize=64)
def layout_for(release: str) -> Layout:
    """The layout a vLLM release publishes: that of the newest table row it is not older than
    (``"0.21.0"``, ``"v0.25.2"``, ``"0.9.0rc1"``; releases past the table get the newest).

    Cached: builders call it for every payload they encode."""
    key = release_key(release)
    for layout in reversed(LAYOUTS):
        if key >= release_key(layout.first):
            return layout
    raise ValueError(f"vLLM {release} publishes no KV events (they start at 0.9.0)")


@functools.cache
def layout_types(layout: Layout) -> dict[str, type[msgspec.Struct]]:
    """The event structs of one layout, declared as that release declares them (same fields,
    order, defaults and encoding), so that msgspec writes the same bytes (map headers and
    omitted defaults included) and exports that release's JSON Schema."""
    types: dict[str, type[msgspec.Struct]] = {}
    for base, count, required in (
        (BlockStored, layout.stored_fields, _STORED_ALWAYS_SENT),
        (BlockRemoved, layout.removed_fields, _REMOVED_ALWAYS_SENT),
        (AllBlocksCleared, 0, 0),
    ):
        fields = [
            (field.name, field.type) if position < required else (field.name, field.type, None)
            for position, field in enumerate(msgspec.structs.fields(base)[:count])
        ]
        tag = base.__name__
        types[tag] = msgspec.defstruct(
            tag,
            fields,
            tag=tag,
            tag_field="type",
            array_like=layout.encoding == "array",
            omit_defaults=True,
            module=f"vllm_{layout.first.replace('.', '_')}",
        )
    return types
