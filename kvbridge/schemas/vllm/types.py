"""The vLLM KV-cache event types, typed once with every field any release has shipped.

Values are range-checked as they are decoded (token ids, block sizes, group indices and dp ranks
are u32, as Dynamo keeps them). Which release sends which fields is the layout table's job
(:mod:`kvbridge.schemas.vllm.layouts`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, Final, TypeAlias

import msgspec

__all__ = [
    "MAX_NESTING",
    "U32",
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "Event",
    "TokenId",
    "VllmBatch",
]

BlockHash: TypeAlias = int | bytes
"""A block hash as vLLM sends it: an int (signed before 0.10.2) or the raw digest bytes."""

U32: TypeAlias = Annotated[int, msgspec.Meta(ge=0, le=0xFFFF_FFFF)]
"""An unsigned 32-bit integer: token ids, block sizes, KV-cache group indices and dp ranks
(Dynamo keeps token ids and dp ranks as u32)."""
TokenId: TypeAlias = U32

MAX_NESTING: Final = 64
"""The deepest nesting of arrays and maps a payload may have, the batch array being level 1.
vLLM's payloads nest at most 6 levels (an extra key's ``(identifier, offset)`` pair inside a
block's extra keys); deeper payloads raise :class:`SchemaError` before msgspec recurses into
them."""


class _WireEvent(msgspec.Struct, tag_field="type"):
    """Base of the event types.

    Decoded events are instances of private wire variants (array or map, strict or tolerant) of
    the public types, so equality compares tag and fields rather than the exact class.
    """

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _WireEvent):
            return NotImplemented
        return type(self).__struct_config__.tag == type(other).__struct_config__.tag and (
            msgspec.structs.astuple(self) == msgspec.structs.astuple(other)
        )

    __hash__ = None  # type: ignore[assignment]


class BlockStored(_WireEvent, tag="BlockStored"):
    """Full blocks newly cached by the engine or one of its offload tiers."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[TokenId]
    block_size: U32
    lora_id: int | None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[list[Any] | None] | None = None
    group_idx: U32 | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[TokenId]] | None = None

    @property
    def is_placeholder(self) -> bool:
        """An offload-tier store that names a chunk by hash only, without tokens or parent."""
        return not self.token_ids

    @property
    def tokens_short(self) -> bool:
        """Whether the tokens cannot fill the blocks (a placeholder has none to check): such a
        store is invalid, and decoding refuses it."""
        return not self.is_placeholder and (
            self.block_size == 0 or len(self.token_ids) < len(self.block_hashes) * self.block_size
        )


class BlockRemoved(_WireEvent, tag="BlockRemoved"):
    """Blocks that left one medium."""

    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: U32 | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(_WireEvent, tag="AllBlocksCleared"):
    """The engine's prefix cache was reset. It carries no medium."""


Event: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


class VllmBatch(msgspec.Struct):
    """One decoded ZMQ payload: the events of one engine step."""

    ts: float
    events: list[Event]
    data_parallel_rank: U32 | None = None
    unknown_fields: int = 0
    """Unknown trailing array positions plus unknown map keys that were ignored."""


def wire_union(
    *,
    array_like: bool,
    strict: bool,
    nil_fields: Mapping[type[msgspec.Struct], Sequence[str]] | None = None,
    store_check: Callable[[BlockStored], None] | None = None,
) -> Any:
    """The union of the three events as one wire form decodes them (for the decoders; not
    exported): each event a subclass of its public type, tagged with its name, as arrays or
    maps, with unknown fields refused (``strict``) or ignored. ``nil_fields`` adds, per type,
    fields that take only nil; ``store_check`` runs on every decoded store."""
    nil_fields = nil_fields or {}
    stored, removed, cleared = (
        msgspec.defstruct(
            base.__name__,
            [(name, None, None) for name in nil_fields.get(base, ())],
            bases=(base,),
            tag=base.__name__,
            array_like=array_like,
            forbid_unknown_fields=strict,
            namespace=(
                {"__post_init__": store_check}
                if store_check is not None and base is BlockStored
                else None
            ),
        )
        for base in (BlockStored, BlockRemoved, AllBlocksCleared)
    )
    return stored | removed | cleared
