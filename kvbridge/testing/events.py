"""Builders of vLLM KV events and payloads, for the streams that tests, benchmarks and tools
write by hand (a :class:`~kvbridge.testing.SimulatedEngine` makes them from token ids instead).

A field a caller does not name gets what vLLM 0.32 sends, so that a hand-written stream reads
as a real engine's: ``group_idx=0``, ``kv_cache_spec_kind="full_attention"``, one ``None`` extra
key per block, ``lora_id=None``. Pass ``None`` to leave a field out, as older releases do. The
payload is encoded with kvbridge's own encoder in any release's layout, which keeps only the
fields that release has.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Final

from kvbridge.schemas.vllm import (
    BlockHash,
    BlockRemoved,
    BlockStored,
    Event,
    VllmBatch,
    encode_batch,
    layout_for,
)

__all__ = [
    "BLOCK_SIZE",
    "RELEASE",
    "TS0",
    "batch",
    "encoded",
    "placeholder",
    "removed",
    "stored",
]

BLOCK_SIZE: Final = 4
"""The builders' default block size: small enough that a test writes its tokens out."""

RELEASE: Final = "0.32.0"
"""The release whose layout :func:`encoded` writes by default."""

TS0: Final = 1_700_000_000.0
"""A fixed batch timestamp, for payloads that must be the same bytes on every run."""

ExtraKeys = Sequence[list[Any] | None]
"""A ``BlockStored``'s extra keys: one entry per block (LoRA, multimodal, cache salt)."""


def stored(
    hashes: Sequence[BlockHash],
    tokens: Sequence[int],
    *,
    parent: BlockHash | None = None,
    block_size: int = BLOCK_SIZE,
    medium: str | None = "GPU",
    lora_id: int | None = None,
    lora_name: str | None = None,
    extra_keys: ExtraKeys | None = (),
    group_idx: int | None = 0,
    kv_cache_spec_kind: str | None = "full_attention",
    locality: str | None = None,
) -> BlockStored:
    """A self-describing ``BlockStored``: the blocks ``hashes``, chained to ``parent``, holding
    ``tokens`` (``block_size`` per block), of the LoRA adapter ``lora_id`` / ``lora_name`` if
    any.

    ``extra_keys`` defaults to one ``None`` per block, as vLLM sends them; ``None`` leaves the
    field out.
    """
    return BlockStored(
        list(hashes),
        parent,
        list(tokens),
        block_size,
        lora_id,
        medium,
        lora_name,
        [None] * len(hashes) if extra_keys == () else _list(extra_keys),
        group_idx=group_idx,
        kv_cache_spec_kind=kv_cache_spec_kind,
        locality=locality,
    )


def placeholder(
    hashes: Sequence[BlockHash],
    *,
    medium: str | None = "CPU",
    block_size: int = 0,
    group_idx: int | None = 0,
) -> BlockStored:
    """An offload connector's placeholder store: chunk hashes only, no tokens, no parent,
    ``block_size`` 0 (vLLM 0.20+; the engine's block size before), the medium in capitals as
    the OffloadingConnector sends it."""
    return BlockStored(list(hashes), None, [], block_size, None, medium, group_idx=group_idx)


def removed(
    hashes: Sequence[BlockHash],
    *,
    medium: str | None = "GPU",
    group_idx: int | None = 0,
    locality: str | None = None,
) -> BlockRemoved:
    """A ``BlockRemoved`` of ``hashes``. vLLM's GPU pool sends one per evicted hash, an offload
    tier several in one."""
    return BlockRemoved(list(hashes), medium, group_idx, locality)


def batch(
    events: Sequence[Event],
    *,
    dp_rank: int | None = 0,
    ts: float = TS0,
    unknown_fields: int = 0,
) -> VllmBatch:
    """One engine step's events, as :func:`~kvbridge.decode_batch` gives them
    (``unknown_fields``: the count a decoder found and ignored)."""
    return VllmBatch(ts, list(events), dp_rank, unknown_fields)


def encoded(
    events: Sequence[Event],
    *,
    dp_rank: int | None = 0,
    ts: float | None = None,
    release: str = RELEASE,
) -> bytes:
    """One ZMQ payload ``[ts, events, dp_rank]`` in ``release``'s layout. ``ts`` is the current
    time by default, so that a relay's lag stays small and non-negative; give :data:`TS0` (plus
    a step) for payloads that must be the same bytes on every run."""
    when = time.time() if ts is None else ts
    return encode_batch(VllmBatch(when, list(events), dp_rank), layout_for(release))


def _list(extra_keys: ExtraKeys | None) -> list[list[Any] | None] | None:
    return None if extra_keys is None else list(extra_keys)
