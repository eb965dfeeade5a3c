"""The fixed sample events every release's classes encode, and their JSON form.

Each :class:`Sample` names the values of the fields it sets; a release's class takes those it
declares (and, with ``fill``, every other field :data:`OPTIONAL_VALUES` has a value for).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

SHA_A = hashlib.sha256(b"a").digest()
SHA_B = hashlib.sha256(b"b").digest()
SHA_PARENT = hashlib.sha256(b"parent").digest()
U64_A = int.from_bytes(SHA_A[-8:], "big")  # 13366815110101616827
U64_B = int.from_bytes(SHA_B[-8:], "big")  # 14660323646696587421

TS = 1700000000.5
DATA_PARALLEL_RANK = 3

OPTIONAL_VALUES: dict[str, Any] = {
    "lora_id": 7,
    "medium": "GPU",
    "lora_name": "adapter-a",
    "extra_keys": [["adapter-a", "salt-1"], None],
    "group_idx": 0,
    "kv_cache_spec_kind": "full_attention",
    "kv_cache_spec_sliding_window": 128,
    "locality": "LOCAL",
    "ownership": "kvcr",
    "session_id": "sess-1",
    "lookahead_token_ids": [[9, 10]],
}
"""The value of every field beyond the first four of ``BlockStored`` (and beyond
``block_hashes`` of ``BlockRemoved``), used by the samples with ``fill=True``."""


@dataclasses.dataclass(frozen=True)
class Sample:
    """One event to encode with every release's classes."""

    name: str
    event: str
    values: dict[str, Any]
    """Values of these fields where the release's class has them."""
    fill: bool
    """Also set every other field of the class that :data:`OPTIONAL_VALUES` has a value for;
    otherwise fields with a default stay at it."""


def _stored(
    name: str,
    block_hashes: list[Any],
    parent_block_hash: Any,
    token_ids: list[int],
    *,
    fill: bool = True,
    **values: Any,
) -> Sample:
    """A ``BlockStored`` sample of 4-token blocks with its four required fields (and ``values``)."""
    required = {
        "block_hashes": block_hashes,
        "parent_block_hash": parent_block_hash,
        "token_ids": token_ids,
        "block_size": 4,
    }
    return Sample(name, "BlockStored", {**required, **values}, fill=fill)


SAMPLES: tuple[Sample, ...] = (
    _stored("stored_int", [U64_A, U64_B], None, [1, 2, 3, 4, 5, 6, 7, 8]),
    _stored(
        "stored_negative", [-42, -(2**63)], -1234567890123456789, [9, 10, 11, 12, 13, 14, 15, 16]
    ),
    _stored("stored_bytes", [SHA_A, SHA_B], SHA_PARENT, [1, 2, 3, 4, 5, 6, 7, 8]),
    _stored(
        "stored_defaults",
        [U64_B],
        U64_A,
        [1, 2, 3, 4],
        fill=False,
        lora_id=None,
        medium=None,
        lora_name=None,
    ),
    Sample("removed", "BlockRemoved", {"block_hashes": [U64_A]}, fill=True),
    Sample("cleared", "AllBlocksCleared", {}, fill=False),
)


def to_json(value: Any) -> Any:
    """JSON form of a sample value: bytes become ``{"bytes": "<hex>"}``, tuples lists."""
    if isinstance(value, bytes):
        return {"bytes": value.hex()}
    if isinstance(value, list | tuple):
        return [to_json(item) for item in value]
    if isinstance(value, dict):
        return {key: to_json(item) for key, item in value.items()}
    return value


def samples_json() -> list[dict[str, Any]]:
    """The sample set as the manifest records it."""
    return [
        {
            "name": s.name,
            "event": s.event,
            "values": to_json(s.values),
            "fill": s.fill,
        }
        for s in SAMPLES
    ]
