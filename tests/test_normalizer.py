"""Exact outcomes of :class:`kvbridge.Normalizer`: canonical hashes, reference counts, media,
drops, placeholders, clears, LoRA / cache salt and dp ranks."""

from __future__ import annotations

import hashlib
from collections import Counter
from typing import Any

import msgspec
import pytest

from kvbridge import DropReason, Normalizer, Tier, TieredEvent, decode_batch
from kvbridge.normalizers.hashing import engine_hash_u64, sequence_hashes, tokens_hashes
from kvbridge.schemas.kv_cache_event import (
    EventData,
    KvCacheEvent,
    RemovedData,
    StoredBlock,
    StoredData,
)
from kvbridge.schemas.vllm import AllBlocksCleared, encode_batch, layout_for
from kvbridge.testing.events import batch, encoded, placeholder, removed, stored

BS = 4
WORKER = 7
TOKENS = list(range(100, 116))  # four blocks of 4: the facts sheet's example prompt
TH = tokens_hashes(TOKENS, BS)
SEQ = sequence_hashes(TH)


def store_event(
    tier: Tier,
    parent: int | None,
    blocks: list[tuple[int, int]],
    tokens: list[int],
    *,
    seq: int,
    dp_rank: int = 0,
    worker: int = WORKER,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> TieredEvent:
    data = EventData(stored=StoredData(parent, [StoredBlock(b, t) for b, t in blocks]))
    return TieredEvent(
        worker,
        dp_rank,
        tier,
        KvCacheEvent(seq, data, dp_rank),
        tokens,
        lora_name,
        cache_salt,
    )


def remove_event(
    tier: Tier, hashes: list[int], *, seq: int, dp_rank: int = 0, worker: int = WORKER
) -> TieredEvent:
    data = EventData(removed=RemovedData(hashes))
    return TieredEvent(worker, dp_rank, tier, KvCacheEvent(seq, data, dp_rank))


def clear_events(*, seq: int, dp_rank: int = 0, worker: int = WORKER) -> list[TieredEvent]:
    return [
        TieredEvent(worker, dp_rank, tier, KvCacheEvent(seq, "cleared", dp_rank)) for tier in Tier
    ]


def blocks(start: int, end: int) -> list[tuple[int, int]]:
    return list(zip(SEQ[start:end], TH[start:end], strict=True))


def toks(start: int, end: int) -> list[int]:
    return TOKENS[start * BS : end * BS]


# -- canonical hashes --------------------------------------------------------------------------


def _sha(i: int) -> bytes:
    return hashlib.sha256(f"block-{i}".encode()).digest()


ENGINE_STYLES = {
    "int": lambda i: 1000 + i,
    "negative": lambda i: -(2**62) - i,  # legacy builtin hash()
    "u64-max": lambda i: 2**64 - 1 - i,
    "sha256-bytes": _sha,
    "xxhash-bytes": lambda i: hashlib.md5(f"b{i}".encode()).digest(),  # any 16-byte digest
}


def _run_chain(norm: Normalizer, h: Any) -> list[list[TieredEvent]]:
    return [
        norm.normalize(batch([stored([h(0), h(1)], toks(0, 2))]), 10),
        norm.normalize(batch([stored([h(2), h(3)], [*toks(2, 4), 9, 9], parent=h(1))]), 11),
        norm.normalize(batch([removed([h(3)]), removed([h(1), h(2)])]), 12),
    ]


@pytest.mark.parametrize("style", sorted(ENGINE_STYLES))
def test_canonical_hashes_whatever_the_engine_hashes(style: str) -> None:
    norm = Normalizer(WORKER, BS)
    out = _run_chain(norm, ENGINE_STYLES[style])
    assert out == [
        [store_event(Tier.DEVICE, None, blocks(0, 2), toks(0, 2), seq=10)],
        # Parent engine hash -> canonical parent; trailing tokens beyond the blocks dropped.
        [store_event(Tier.DEVICE, SEQ[1], blocks(2, 4), toks(2, 4), seq=11)],
        # Removals translated engine -> canonical, one event per vLLM event.
        [
            # Consecutive removals from one tier come out as one event.
            remove_event(Tier.DEVICE, [SEQ[3], SEQ[1], SEQ[2]], seq=12),
        ],
    ]
    assert SEQ == [
        6320977984009303047,
        3184517425968952090,
        3284552213212070830,
        4799968867515202603,
    ]
    assert norm.stats == Counter()
    assert norm.forwarded == Counter({("stored", Tier.DEVICE): 4, ("removed", Tier.DEVICE): 3})
    assert norm.resident_blocks(0, Tier.DEVICE) == 1


def test_two_engines_hashing_differently_give_identical_events() -> None:
    outputs = []
    for style in ("int", "sha256-bytes", "negative"):
        outputs.append(_run_chain(Normalizer(WORKER, BS), ENGINE_STYLES[style]))
    assert outputs[0] == outputs[1] == outputs[2]


def test_bytes_and_int_forms_of_one_hash_are_the_same_block() -> None:
    """vLLM 0.11-0.23 publish CPU events with bytes while GPU events carry ints."""
    norm = Normalizer(WORKER, BS)
    digest = _sha(0)
    as_int = int.from_bytes(digest, "big") % 2**64
    assert as_int == engine_hash_u64(digest)
    norm.normalize(batch([stored([as_int], toks(0, 1))]), 1)
    out = norm.normalize(batch([stored([_sha(1)], toks(1, 2), parent=digest)]), 2)
    assert out == [store_event(Tier.DEVICE, SEQ[0], blocks(1, 2), toks(1, 2), seq=2)]
    assert norm.normalize(batch([removed([digest])]), 3) == [
        remove_event(Tier.DEVICE, [SEQ[0]], seq=3)
    ]


def test_event_ids_default_to_a_counter() -> None:
    norm = Normalizer(WORKER, BS)
    first = norm.normalize(batch([stored([1], toks(0, 1))]))
    second = norm.normalize(batch([stored([2], toks(1, 2), parent=1)]))
    assert first[0].event.event_id + 1 == second[0].event.event_id


# -- reference counting ------------------------------------------------------------------------


def test_store_twice_remove_once_keeps_the_block() -> None:
    norm = Normalizer(WORKER, BS)
    assert norm.normalize(batch([stored([11], toks(0, 1))]), 1) == [
        store_event(Tier.DEVICE, None, blocks(0, 1), toks(0, 1), seq=1)
    ]
    assert norm.normalize(batch([stored([11], toks(0, 1))]), 2) == []
    assert norm.stats == Counter({"duplicate_store": 1})
    assert norm.normalize(batch([removed([11])]), 3) == []
    assert norm.stats == Counter({"duplicate_store": 1, "still_referenced": 1})
    assert norm.resident_blocks(0, Tier.DEVICE) == 1
    assert norm.normalize(batch([removed([11])]), 4) == [remove_event(Tier.DEVICE, [SEQ[0]], seq=4)]
    assert norm.resident_blocks(0, Tier.DEVICE) == 0
    assert norm.forwarded == Counter({("stored", Tier.DEVICE): 1, ("removed", Tier.DEVICE): 1})
    # A third removal is of a block no longer there.
    assert norm.normalize(batch([removed([11])]), 5) == []
    assert norm.stats == Counter({"duplicate_store": 1, "still_referenced": 1, "unknown_block": 1})


def test_overlapping_chunks_forward_only_new_blocks() -> None:
    """Self-describing CPU chunks re-announce shared blocks; runs split around them."""
    norm = Normalizer(WORKER, BS)
    norm.normalize(batch([stored([11, 12, 13], toks(0, 3))]), 1)
    assert norm.normalize(batch([stored([12], toks(1, 2), parent=11, medium="CPU")]), 2) == [
        store_event(Tier.HOST_PINNED, SEQ[0], blocks(1, 2), toks(1, 2), seq=2)
    ]
    assert norm.normalize(batch([stored([11, 12, 13], toks(0, 3), medium="CPU")]), 3) == [
        store_event(Tier.HOST_PINNED, None, blocks(0, 1), toks(0, 1), seq=3),
        store_event(Tier.HOST_PINNED, SEQ[1], blocks(2, 3), toks(2, 3), seq=3),
    ]
    assert norm.stats == Counter({"duplicate_store": 1})
    # Block 12 was announced twice on the CPU: the first removal keeps it.
    assert norm.normalize(batch([removed([12, 13], medium="CPU")]), 4) == [
        remove_event(Tier.HOST_PINNED, [SEQ[2]], seq=4)
    ]
    assert norm.stats == Counter({"duplicate_store": 1, "still_referenced": 1})
    assert norm.resident_blocks(0, Tier.HOST_PINNED) == 2
    assert norm.resident_blocks(0, Tier.DEVICE) == 3


def test_same_block_on_two_tiers_counted_per_tier() -> None:
    norm = Normalizer(WORKER, BS)
    gpu = norm.normalize(batch([stored([11], toks(0, 1), medium="GPU")]), 1)
    cpu = norm.normalize(batch([stored([11], toks(0, 1), medium="CPU")]), 2)
    assert gpu == [store_event(Tier.DEVICE, None, blocks(0, 1), toks(0, 1), seq=1)]
    assert cpu == [store_event(Tier.HOST_PINNED, None, blocks(0, 1), toks(0, 1), seq=2)]
    assert norm.stats == Counter()
    assert norm.normalize(batch([removed([11], medium="GPU")]), 3) == [
        remove_event(Tier.DEVICE, [SEQ[0]], seq=3)
    ]
    assert norm.resident_blocks(0, Tier.DEVICE) == 0
    assert norm.resident_blocks(0, Tier.HOST_PINNED) == 1
    # The CPU copy is still there and still removable; a second GPU removal is not.
    assert norm.normalize(batch([removed([11], medium="GPU")]), 4) == []
    assert norm.normalize(batch([removed([11], medium="CPU")]), 5) == [
        remove_event(Tier.HOST_PINNED, [SEQ[0]], seq=5)
    ]
    assert norm.stats == Counter({"unknown_block": 1})
    assert norm.forwarded == Counter(
        {
            ("stored", Tier.DEVICE): 1,
            ("stored", Tier.HOST_PINNED): 1,
            ("removed", Tier.DEVICE): 1,
            ("removed", Tier.HOST_PINNED): 1,
        }
    )


def test_removal_on_a_tier_the_block_is_not_on() -> None:
    norm = Normalizer(WORKER, BS)
    norm.normalize(batch([stored([11], toks(0, 1))]), 1)
    assert norm.normalize(batch([removed([11], medium="CPU")]), 2) == []
    assert norm.stats == Counter({"unknown_block": 1})
    assert norm.resident_blocks(0, Tier.DEVICE) == 1


# -- media -------------------------------------------------------------------------------------

MEDIA = {
    "GPU": Tier.DEVICE,
    "gpu": Tier.DEVICE,
    "DEVICE": Tier.DEVICE,
    "device": Tier.DEVICE,
    None: Tier.DEVICE,
    "": Tier.DEVICE,
    "CPU": Tier.HOST_PINNED,
    "cpu": Tier.HOST_PINNED,
    "CPU_PINNED": Tier.HOST_PINNED,
    "cpu_tier1": Tier.HOST_PINNED,
    "DISK": Tier.DISK,
    "NVME": Tier.DISK,
    "STORAGE": Tier.DISK,
    "storage": Tier.DISK,
    "FS": Tier.DISK,
    "OBJ": Tier.DISK,
    "CPU_TIER2": Tier.DISK,
    "EXTERNAL": Tier.EXTERNAL,
    "NETWORK": Tier.EXTERNAL,
    "REMOTE": Tier.EXTERNAL,
    "SHARED": Tier.EXTERNAL,
    "shared": Tier.EXTERNAL,
}


@pytest.mark.parametrize("medium", list(MEDIA), ids=[repr(m) for m in MEDIA])
def test_media_map_without_case(medium: str | None) -> None:
    norm = Normalizer(WORKER, BS)
    tier = MEDIA[medium]
    assert norm.normalize(batch([stored([11, 12], toks(0, 2), medium=medium)]), 1) == [
        store_event(tier, None, blocks(0, 2), toks(0, 2), seq=1)
    ]
    # Removal in another spelling of the same medium.
    other = medium.swapcase() if medium else medium
    assert norm.normalize(batch([removed([12], medium=other)]), 2) == [
        remove_event(tier, [SEQ[1]], seq=2)
    ]
    assert norm.stats == Counter()


@pytest.mark.parametrize("medium", ["CXL", "cuda:0", "GPU0", "hbm", "cpu "])
def test_unknown_media_dropped_and_counted_in_blocks(medium: str) -> None:
    norm = Normalizer(WORKER, BS)
    assert norm.normalize(batch([stored([11, 12, 13], toks(0, 3), medium=medium)]), 1) == []
    assert norm.stats == Counter({"unknown_medium": 3})
    norm.normalize(batch([stored([11, 12], toks(0, 2), medium="GPU")]), 2)
    assert norm.normalize(batch([removed([11, 12], medium=medium)]), 3) == []
    assert norm.stats == Counter({"unknown_medium": 5})
    assert norm.resident_blocks(0, Tier.DEVICE) == 2
    assert norm.forwarded == Counter({("stored", Tier.DEVICE): 2})


# -- drops -------------------------------------------------------------------------------------


def test_remote_locality_dropped() -> None:
    norm = Normalizer(WORKER, BS)
    out = norm.normalize(batch([stored([11, 12], toks(0, 2), medium="STORAGE", locality="REMOTE")]))
    assert out == []
    assert norm.stats == Counter({"remote_locality": 2})
    out = norm.normalize(batch([stored([11], toks(0, 1), medium="STORAGE", locality="remote")]))
    assert out == []
    assert norm.stats == Counter({"remote_locality": 3})
    out = norm.normalize(batch([stored([11], toks(0, 1), medium="STORAGE", locality="ELSEWHERE")]))
    assert out == []
    assert norm.stats == Counter({"remote_locality": 3, "unknown_locality": 1})
    out = norm.normalize(batch([stored([11], toks(0, 1), medium="STORAGE", locality="LOCAL")]), 4)
    assert out == [store_event(Tier.DISK, None, blocks(0, 1), toks(0, 1), seq=4)]
    out = norm.normalize(batch([removed([11], medium="STORAGE", locality="REMOTE")]), 5)
    assert out == []
    assert norm.stats == Counter({"remote_locality": 4, "unknown_locality": 1})
    out = norm.normalize(batch([removed([11], medium="STORAGE", locality="local")]), 6)
    assert out == [remove_event(Tier.DISK, [SEQ[0]], seq=6)]


@pytest.mark.parametrize("kind", ["sliding_window", "mamba", "sliding_window_mla", "unknown"])
def test_non_main_kinds_dropped(kind: str) -> None:
    norm = Normalizer(WORKER, BS)
    for group in (0, 1, None):
        event = stored([11, 12], toks(0, 2), group_idx=group, kv_cache_spec_kind=kind)
        assert norm.normalize(batch([event])) == []
    assert norm.stats == Counter({"non_main_group": 6})


@pytest.mark.parametrize("kind", ["full_attention", "mla_attention", "sink_full_attention"])
def test_main_kinds_kept_in_any_group(kind: str) -> None:
    norm = Normalizer(WORKER, BS)
    event = stored([11], toks(0, 1), group_idx=3, kv_cache_spec_kind=kind)
    assert norm.normalize(batch([event]), 1) == [
        store_event(Tier.DEVICE, None, blocks(0, 1), toks(0, 1), seq=1)
    ]
    assert norm.stats == Counter()


def test_group_without_kind_dropped_unless_learned() -> None:
    norm = Normalizer(WORKER, BS)
    # Group 0 (or no group) without a kind: kept. Group 1 without a kind: dropped.
    assert (
        len(norm.normalize(batch([stored([11], toks(0, 1), group_idx=0, kv_cache_spec_kind=None)])))
        == 1
    )
    assert (
        norm.normalize(
            batch([stored([12], toks(1, 2), parent=11, group_idx=1, kv_cache_spec_kind=None)])
        )
        == []
    )
    assert norm.stats == Counter({"non_main_group": 1})
    # A store teaches that group 1 is full attention ...
    taught = stored(
        [21], toks(0, 1), medium="CPU", group_idx=1, kv_cache_spec_kind="full_attention"
    )
    assert len(norm.normalize(batch([taught]))) == 1
    # ... so later kind-less events of group 1 are kept, removals included.
    assert norm.normalize(
        batch([stored([12], toks(1, 2), parent=11, group_idx=1, kv_cache_spec_kind=None)]), 5
    ) == [store_event(Tier.DEVICE, SEQ[0], blocks(1, 2), toks(1, 2), seq=5)]
    assert norm.normalize(batch([removed([12], group_idx=1)]), 6) == [
        remove_event(Tier.DEVICE, [SEQ[1]], seq=6)
    ]
    assert norm.stats == Counter({"non_main_group": 1})


def test_removals_in_a_sliding_window_group_dropped() -> None:
    norm = Normalizer(WORKER, BS)
    main = stored([11, 12], toks(0, 2), group_idx=0, kv_cache_spec_kind="full_attention")
    swa = stored([11, 12], toks(0, 2), group_idx=1, kv_cache_spec_kind="sliding_window")
    assert len(norm.normalize(batch([main, swa]))) == 1
    assert norm.stats == Counter({"non_main_group": 2})
    # Group 1's removals have no kind but group 1 is known to be sliding window: the main
    # group's blocks with the same hashes must survive.
    assert norm.normalize(batch([removed([11, 12], group_idx=1)])) == []
    assert norm.stats == Counter({"non_main_group": 4})
    assert norm.resident_blocks(0, Tier.DEVICE) == 2
    assert norm.normalize(batch([removed([12], group_idx=0)]), 9) == [
        remove_event(Tier.DEVICE, [SEQ[1]], seq=9)
    ]


def test_block_size_mismatch_dropped() -> None:
    norm = Normalizer(WORKER, BS)
    assert norm.normalize(batch([stored([11, 12], TOKENS, block_size=8)])) == []
    assert norm.stats == Counter({"block_size_mismatch": 2})
    assert norm.forwarded == Counter()


def test_orphan_parent_dropped() -> None:
    norm = Normalizer(WORKER, BS)
    assert norm.normalize(batch([stored([12, 13], toks(1, 3), parent=99)])) == []
    assert norm.stats == Counter({"orphan_parent": 2})
    # The orphan blocks were not learned: children of them are orphans too.
    assert norm.normalize(batch([stored([14], toks(3, 4), parent=13)])) == []
    assert norm.stats == Counter({"orphan_parent": 3})


def test_removal_of_unknown_hash_counted() -> None:
    norm = Normalizer(WORKER, BS)
    norm.normalize(batch([stored([11], toks(0, 1))]), 1)
    assert norm.normalize(batch([removed([77, 11, 78])]), 2) == [
        remove_event(Tier.DEVICE, [SEQ[0]], seq=2)
    ]
    assert norm.stats == Counter({"unknown_block": 2})


def test_unknown_fields_counted() -> None:
    norm = Normalizer(WORKER, BS)
    assert norm.normalize(batch([], unknown_fields=3)) == []
    assert norm.stats == Counter({"unknown_field": 3})
    # Through the decoder: a map-era BlockStored carrying a key from the future.
    payload = msgspec.msgpack.encode(
        [
            0.0,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [11],
                    "parent_block_hash": None,
                    "token_ids": toks(0, 1),
                    "block_size": BS,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                    "from_the_future": 1,
                }
            ],
            None,
        ]
    )
    decoded = decode_batch(payload)
    assert decoded.unknown_fields == 1
    assert norm.normalize(decoded, 4) == [
        store_event(Tier.DEVICE, None, blocks(0, 1), toks(0, 1), seq=4)
    ]
    assert norm.stats == Counter({"unknown_field": 4})


# -- placeholders ------------------------------------------------------------------------------


def test_placeholder_resolves_to_the_gpu_block() -> None:
    norm = Normalizer(WORKER, BS)
    norm.normalize(batch([stored([11, 12, 13], toks(0, 3))]), 1)
    assert norm.normalize(batch([placeholder([13], group_idx=0)]), 2) == [
        store_event(Tier.HOST_PINNED, SEQ[1], blocks(2, 3), toks(2, 3), seq=2)
    ]
    # Several hashes: one run per chain.
    assert norm.normalize(batch([placeholder([11, 12], group_idx=None)]), 3) == [
        store_event(Tier.HOST_PINNED, None, blocks(0, 2), toks(0, 2), seq=3)
    ]
    norm2 = Normalizer(WORKER, BS)
    norm2.normalize(batch([stored([11, 12, 13], toks(0, 3))]), 1)
    assert norm2.normalize(batch([placeholder([11, 13], group_idx=None)]), 2) == [
        store_event(Tier.HOST_PINNED, None, blocks(0, 1), toks(0, 1), seq=2),
        store_event(Tier.HOST_PINNED, SEQ[1], blocks(2, 3), toks(2, 3), seq=2),
    ]
    assert norm.stats == norm2.stats == Counter()


def test_placeholder_with_bytes_hash() -> None:
    """0.11-0.23 CPU placeholders carry bytes while the GPU events carry ints."""
    norm = Normalizer(WORKER, BS)
    digest = _sha(5)
    norm.normalize(batch([stored([engine_hash_u64(digest)], toks(0, 1))]), 1)
    assert norm.normalize(batch([placeholder([digest])]), 2) == [
        store_event(Tier.HOST_PINNED, None, blocks(0, 1), toks(0, 1), seq=2)
    ]


def test_unknown_placeholder_counted() -> None:
    norm = Normalizer(WORKER, BS)
    norm.normalize(batch([stored([11], toks(0, 1))]), 1)
    assert norm.normalize(batch([placeholder([99, 11, 98])]), 2) == [
        store_event(Tier.HOST_PINNED, None, blocks(0, 1), toks(0, 1), seq=2)
    ]
    assert norm.stats == Counter({"unresolved_placeholder": 2})


def test_placeholder_after_gpu_eviction_resolves() -> None:
    norm = Normalizer(WORKER, BS)
    norm.normalize(batch([stored([11, 12], toks(0, 2))]), 1)
    assert norm.normalize(batch([removed([11]), removed([12])]), 2) == [
        remove_event(Tier.DEVICE, [SEQ[0], SEQ[1]], seq=2),
    ]
    assert norm.normalize(batch([placeholder([12])]), 3) == [
        store_event(Tier.HOST_PINNED, SEQ[0], blocks(1, 2), toks(1, 2), seq=3)
    ]
    assert norm.stats == Counter()


def test_placeholder_of_evicted_block_can_be_removed_again() -> None:
    """A CPU copy resolved from a retained (evicted) GPU block must be removable from the CPU,
    or it stays resident downstream forever."""
    norm = Normalizer(WORKER, BS)
    norm.normalize(batch([stored([11, 12], toks(0, 2))]), 1)
    norm.normalize(batch([removed([11, 12])]), 2)
    assert len(norm.normalize(batch([placeholder([12])]), 3)) == 1
    assert norm.resident_blocks(0, Tier.HOST_PINNED) == 1
    assert norm.normalize(batch([removed([12], medium="CPU")]), 4) == [
        remove_event(Tier.HOST_PINNED, [SEQ[1]], seq=4)
    ]
    assert norm.stats == Counter()
    assert norm.resident_blocks(0, Tier.HOST_PINNED) == 0


def test_retained_evicted_blocks_are_bounded() -> None:
    norm = Normalizer(WORKER, BS, retain_evicted=1)
    norm.normalize(batch([stored([11, 12], toks(0, 2))]), 1)
    norm.normalize(batch([removed([11]), removed([12])]), 2)
    assert norm.normalize(batch([placeholder([11])]), 3) == []
    assert norm.stats == Counter({"unresolved_placeholder": 1})
    assert len(norm.normalize(batch([placeholder([12])]), 4)) == 1


def test_child_of_evicted_parent_chains() -> None:
    norm = Normalizer(WORKER, BS)
    norm.normalize(batch([stored([11], toks(0, 1))]), 1)
    norm.normalize(batch([removed([11])]), 2)
    assert norm.normalize(batch([stored([12], toks(1, 2), parent=11)]), 3) == [
        store_event(Tier.DEVICE, SEQ[0], blocks(1, 2), toks(1, 2), seq=3)
    ]


# -- clears and resets -------------------------------------------------------------------------


def test_all_blocks_cleared_clears_one_rank() -> None:
    norm = Normalizer(WORKER, BS)
    norm.normalize(
        batch([stored([11, 12], toks(0, 2)), stored([12], toks(1, 2), parent=11, medium="CPU")])
    )
    norm.normalize(batch([stored([11], toks(0, 1))], dp_rank=1))
    out = norm.normalize(batch([AllBlocksCleared()]), 5)
    assert out == clear_events(seq=5)
    assert [event.tier for event in out] == list(Tier)
    assert norm.forwarded[("cleared", Tier.DEVICE)] == 1
    assert norm.forwarded[("cleared", Tier.EXTERNAL)] == 1
    assert norm.resident_blocks(0, Tier.DEVICE) == norm.resident_blocks(0, Tier.HOST_PINNED) == 0
    assert norm.resident_blocks(1, Tier.DEVICE) == 1
    # Old hashes are gone on rank 0: their removals (vLLM's CPU pool outlives a reset) are
    # counted as cleared earlier, once; a second removal is unknown ...
    assert norm.normalize(batch([removed([11]), removed([12], medium="CPU")]), 6) == []
    assert norm.stats == Counter({"cleared_earlier": 2})
    assert norm.normalize(batch([removed([11])]), 6) == []
    assert norm.stats == Counter({"cleared_earlier": 2, "unknown_block": 1})
    # ... but not on rank 1.
    assert norm.normalize(batch([removed([11])], dp_rank=1), 7) == [
        remove_event(Tier.DEVICE, [SEQ[0]], seq=7, dp_rank=1)
    ]
    # Re-stores forward again, and a child may chain on a cleared parent.
    assert norm.normalize(batch([stored([11], toks(0, 1))]), 8) == [
        store_event(Tier.DEVICE, None, blocks(0, 1), toks(0, 1), seq=8)
    ]
    assert norm.normalize(batch([stored([13], toks(2, 3), parent=12)]), 9) == [
        store_event(Tier.DEVICE, SEQ[1], blocks(2, 3), toks(2, 3), seq=9)
    ]
    assert norm.stats == Counter({"cleared_earlier": 2, "unknown_block": 1})


def test_reset_returns_clears_and_forgets_the_rank() -> None:
    norm = Normalizer(WORKER, BS)
    norm.normalize(batch([stored([11], toks(0, 1))]))
    norm.normalize(batch([stored([11], toks(0, 1))], dp_rank=1))
    assert norm.dp_ranks == [0, 1]
    out = norm.reset(0)
    assert len(out) == len(Tier)
    assert out == clear_events(seq=out[0].event.event_id)
    assert norm.dp_ranks == [1]
    # A named rank is cleared downstream even when this normalizer holds nothing for it.
    again = norm.reset(0)
    assert again == clear_events(seq=again[0].event.event_id)
    assert [event.dp_rank for event in norm.reset(5)] == [5] * len(Tier)
    assert norm.dp_ranks == [1]
    # Forgotten: neither removable nor resolvable as a placeholder or a parent.
    assert norm.normalize(batch([removed([11])])) == []
    assert norm.normalize(batch([placeholder([11])])) == []
    assert norm.normalize(batch([stored([12], toks(1, 2), parent=11)])) == []
    assert norm.stats == Counter(
        {"unknown_block": 1, "unresolved_placeholder": 1, "orphan_parent": 1}
    )
    # Rank 1 is untouched.
    assert norm.normalize(batch([removed([11])], dp_rank=1), 3) == [
        remove_event(Tier.DEVICE, [SEQ[0]], seq=3, dp_rank=1)
    ]
    # reset() without a rank clears every rank.
    all_out = norm.reset()
    assert sorted({event.dp_rank for event in all_out}) == [0, 1]
    assert len(all_out) == 2 * len(Tier)
    assert norm.dp_ranks == []


# -- LoRA and cache salt -----------------------------------------------------------------------


def _salted(lora: str | None, salt: str | None) -> tuple[list[int], list[int]]:
    th = tokens_hashes(TOKENS, BS, lora_name=lora, cache_salt=salt)
    return th, sequence_hashes(th)


@pytest.mark.parametrize(
    ("lora", "first_keys", "salt"),
    [
        (None, ["tenantA"], "tenantA"),
        ("my-lora", ["my-lora", "tenantA"], "tenantA"),
        (None, ["dynamo-cache-salt:tenantA"], "tenantA"),
        ("my-lora", ["my-lora", "dynamo-cache-salt:tenantA"], "tenantA"),
        ("my-lora", ["my-lora"], None),
        ("", ["tenantA"], "tenantA"),
        (None, None, None),
    ],
)
def test_lora_and_salt_reach_the_tokens_hash(
    lora: str | None, first_keys: list[str] | None, salt: str | None
) -> None:
    norm = Normalizer(WORKER, BS)
    lora_keys = [lora] if lora else None
    extra_keys = [first_keys, lora_keys]
    th, seq = _salted(lora or None, salt)
    first = stored([11, 12], toks(0, 2), lora_name=lora, extra_keys=extra_keys)
    child = stored(
        [13, 14], toks(2, 4), parent=12, lora_name=lora, extra_keys=[lora_keys, lora_keys]
    )
    out = norm.normalize(batch([first]), 1) + norm.normalize(batch([child]), 2)
    lora_out = lora or None
    assert out == [
        store_event(
            Tier.DEVICE,
            None,
            list(zip(seq[:2], th[:2], strict=True)),
            toks(0, 2),
            seq=1,
            lora_name=lora_out,
            cache_salt=salt,
        ),
        # The child has no salt of its own: it inherits the parent's.
        store_event(
            Tier.DEVICE,
            seq[1],
            list(zip(seq[2:], th[2:], strict=True)),
            toks(2, 4),
            seq=2,
            lora_name=lora_out,
            cache_salt=salt,
        ),
    ]
    if lora or salt:
        assert th[0] != TH[0] and seq[3] != SEQ[3]


def test_salted_and_plain_blocks_are_distinct() -> None:
    norm = Normalizer(WORKER, BS)
    plain = norm.normalize(batch([stored([11], toks(0, 1))]))
    salted = norm.normalize(batch([stored([21], toks(0, 1), extra_keys=[["tenantA"]])]))
    assert len(plain) == len(salted) == 1
    plain_block = plain[0].event.data.stored.blocks[0]  # type: ignore[union-attr]
    salted_block = salted[0].event.data.stored.blocks[0]  # type: ignore[union-attr]
    assert plain_block.block_hash != salted_block.block_hash
    assert salted_block.tokens_hash == tokens_hashes(toks(0, 1), BS, cache_salt="tenantA")[0]
    assert norm.stats == Counter()


def test_self_describing_cpu_copy_of_a_salted_block() -> None:
    """OffloadingConnector's self-describing CPU events always carry ``extra_keys=None``
    (facts: vllm-kv-events section 9). The CPU copy of a salted GPU block is still the same
    block: it must keep the GPU block's canonical hash, and the GPU block must stay removable."""
    norm = Normalizer(WORKER, BS)
    th, seq = _salted(None, "tenantA")
    gpu = stored([11, 12], toks(0, 2), medium="GPU", extra_keys=[["tenantA"], None])
    salted_blocks = list(zip(seq[:2], th[:2], strict=True))
    assert norm.normalize(batch([gpu]), 1) == [
        store_event(Tier.DEVICE, None, salted_blocks, toks(0, 2), seq=1, cache_salt="tenantA")
    ]
    cpu = stored([11, 12], toks(0, 2), medium="CPU")  # same engine hashes, no extra keys
    assert norm.normalize(batch([cpu]), 2) == [
        store_event(Tier.HOST_PINNED, None, salted_blocks, toks(0, 2), seq=2, cache_salt="tenantA")
    ]
    assert norm.normalize(batch([removed([11, 12], medium="GPU")]), 3) == [
        remove_event(Tier.DEVICE, [seq[0], seq[1]], seq=3)
    ]
    assert norm.stats == Counter()
    assert norm.resident_blocks(0, Tier.DEVICE) == 0


def test_multimodal_extra_keys_before_the_salt() -> None:
    """Published extra keys: LoRA name, (mm_id, offset) pairs, then the salt (first block)."""
    norm = Normalizer(WORKER, BS)
    digest = hashlib.sha256(b"image").hexdigest()
    extra_keys = [["my-lora", (digest, 0), "tenantA"], ["my-lora", (digest, 4)]]
    event = stored([11, 12], toks(0, 2), lora_name="my-lora", extra_keys=extra_keys)
    out = norm.normalize(batch([event]), 1)
    mm = int(digest[:16], 16)
    th = tokens_hashes(
        toks(0, 2), BS, lora_name="my-lora", cache_salt="tenantA", mm_hashes=[[mm], [mm]]
    )
    assert out == [
        store_event(
            Tier.DEVICE,
            None,
            list(zip(sequence_hashes(th), th, strict=True)),
            toks(0, 2),
            seq=1,
            lora_name="my-lora",
            cache_salt="tenantA",
        )
    ]


# -- dp ranks ----------------------------------------------------------------------------------


def test_two_dp_ranks_are_independent() -> None:
    norm = Normalizer(WORKER, BS)
    out0 = norm.normalize(batch([stored([11, 12], toks(0, 2))], dp_rank=0), 1)
    out1 = norm.normalize(batch([stored([11, 12], toks(0, 2))], dp_rank=1), 2)
    assert out0 == [store_event(Tier.DEVICE, None, blocks(0, 2), toks(0, 2), seq=1)]
    assert out1 == [store_event(Tier.DEVICE, None, blocks(0, 2), toks(0, 2), seq=2, dp_rank=1)]
    assert norm.stats == Counter()
    # A batch without a rank is rank 0.
    assert norm.normalize(batch([removed([12])], dp_rank=None), 3) == [
        remove_event(Tier.DEVICE, [SEQ[1]], seq=3)
    ]
    assert norm.resident_blocks(0, Tier.DEVICE) == 1
    assert norm.resident_blocks(1, Tier.DEVICE) == 2
    # Parents are per rank: rank 2 has never seen 12.
    assert norm.normalize(batch([stored([13], toks(2, 3), parent=12)], dp_rank=2)) == []
    assert norm.stats == Counter({"orphan_parent": 1})
    assert norm.normalize(batch([stored([13], toks(2, 3), parent=12)], dp_rank=1), 4) == [
        store_event(Tier.DEVICE, SEQ[1], blocks(2, 3), toks(2, 3), seq=4, dp_rank=1)
    ]
    assert norm.dp_ranks == [0, 1, 2]


def test_constructor_validation() -> None:
    with pytest.raises(ValueError, match=r"^block_size must be positive, got 0$"):
        Normalizer(WORKER, 0)
    with pytest.raises(
        ValueError, match=r"^block_size must be at most 4294967295, got 4294967296$"
    ):
        Normalizer(WORKER, 2**32)  # Dynamo keeps a block size in 32 bits
    assert Normalizer(WORKER, 2**32 - 1).block_size == 2**32 - 1
    with pytest.raises(ValueError, match=r"^worker_id must be a u64, got -1$"):
        Normalizer(-1, BS)


def test_consecutive_removals_of_one_tier_coalesce_in_order() -> None:
    norm = Normalizer(WORKER, BS)
    norm.normalize(
        batch([stored([11, 12, 13], toks(0, 3)), stored([11, 12], toks(0, 2), medium="CPU")])
    )
    out = norm.normalize(
        batch(
            [
                removed([13]),
                removed([12]),
                removed([12], medium="CPU"),
                removed([11]),
                removed([99]),
            ]
        ),
        4,
    )
    assert out == [
        remove_event(Tier.DEVICE, [SEQ[2], SEQ[1]], seq=4),
        remove_event(Tier.HOST_PINNED, [SEQ[1]], seq=4),
        remove_event(Tier.DEVICE, [SEQ[0]], seq=4),
    ]
    assert norm.stats == Counter({"unknown_block": 1})


def test_a_duplicate_inside_a_chain_keeps_each_block_its_own_tokens() -> None:
    """Engine hash 11 twice: the second is a duplicate, and block 12's tokens are its own."""
    norm = Normalizer(WORKER, BS)
    out = norm.normalize(batch([stored([11, 11, 12], toks(0, 3))]), 1)
    assert [event.token_ids for event in out] == [toks(0, 1) + toks(2, 3)]
    assert norm.stats == Counter({"duplicate_store": 1})


def _widened(payload: bytes, tokens: list[int]) -> bytes:
    """``payload`` with its one token list (fixints) rewritten in wider integer forms, each
    id the same value: uint16, uint32 and uint8 in turn, as another encoder may write them."""
    shortest = bytes([0x90 | len(tokens), *tokens])
    assert payload.count(shortest) == 1 and all(token < 0x80 for token in tokens)
    wide = bytearray([0x90 | len(tokens)])
    for index, token in enumerate(tokens):
        wide += (
            bytes([0xCD, 0, token]),
            bytes([0xCE, 0, 0, 0, token]),
            bytes([0xCC, token]),
        )[index % 3]
    return payload.replace(shortest, bytes(wide))


def test_token_ids_in_wider_forms_go_out_as_in_their_shortest() -> None:
    """The output copies a store's token ids as the input wrote them only when each is in its
    shortest form; ids in wider forms are written again, so both writers' bytes do not depend
    on the encoder upstream."""
    tokens = list(range(1, 13))
    payload = encode_batch(batch([stored([11, 12, 13], tokens)]), layout_for("0.32.0"))
    outputs = []
    for variant in (payload, _widened(payload, tokens)):
        result = Normalizer(WORKER, BS).process(variant, 5)
        outputs.append((result.canonical_payloads(1.5), result.events))
    assert outputs[0] == outputs[1]
    [canonical], events = outputs[0]
    assert decode_batch(canonical).events[0].token_ids == tokens  # type: ignore[union-attr]
    assert events[0].token_ids == tokens


def test_a_store_split_around_a_resident_block_carries_each_runs_own_tokens() -> None:
    """Blocks 1 and 3 of a chain come back while block 2 is still resident: two runs, each
    with its own block's tokens (taken from the event, not copied whole)."""
    normalizer = Normalizer(WORKER, BS)
    chain = [21, 22, 23]
    normalizer.normalize(encoded([stored(chain, TOKENS[:12])]), 1)
    normalizer.normalize(encoded([removed([21]), removed([23])]), 2)
    result = normalizer.process(encoded([stored(chain, TOKENS[:12])]), 3)
    assert [event.token_ids for event in result.events] == [TOKENS[:4], TOKENS[8:12]]
    [canonical] = result.canonical_payloads(1.5)
    stores = decode_batch(canonical).events
    assert [event.token_ids for event in stores] == [TOKENS[:4], TOKENS[8:12]]  # type: ignore[union-attr]
    assert normalizer.stats[DropReason.DUPLICATE_STORE] == 1
