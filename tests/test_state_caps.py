"""The normalizer's state stays under its caps whatever the input, and what a cap gives up is
made consistent downstream and counted: a forgotten rank is cleared, an evicted block removed."""

from __future__ import annotations

from kvbridge import Normalizer, Tier, TieredIndex
from kvbridge.schemas.vllm import BlockStored
from kvbridge.testing.events import encoded, removed, stored

BS = 4


def chain(first_hash: int, blocks: int, salt: str | None = None) -> BlockStored:
    """``blocks`` chained blocks whose content is unique to ``first_hash``."""
    tokens = [first_hash % 100_000 + 1] + [7] * (blocks * BS - 1)
    extra = [[salt]] + [None] * (blocks - 1) if salt else None
    hashes = list(range(first_hash, first_hash + blocks))
    return stored(hashes, tokens, extra_keys=extra)


def kinds(events: list[object]) -> list[str]:
    out = []
    for tiered in events:
        data = tiered.event.data  # type: ignore[attr-defined]
        out.append("cleared" if data == "cleared" else "stored" if data.stored else "removed")
    return out


def test_distinct_dp_ranks_past_the_cap_clear_the_least_recent_rank() -> None:
    normalizer = Normalizer(1, BS, max_ranks=8)
    index = TieredIndex(BS)
    for rank in range(8):
        index.apply(normalizer.normalize(encoded([chain(1000 * rank + 1, 1)], dp_rank=rank), rank))
    assert normalizer.dp_ranks == list(range(8))
    # Rank 0 is written again, so rank 1 is now the least recently written.
    index.apply(normalizer.normalize(encoded([chain(50_001, 1)], dp_rank=0), 8))
    events = normalizer.normalize(encoded([chain(9001, 1)], dp_rank=9), 9)
    assert kinds(events) == ["cleared"] * 4 + ["stored"]
    assert {event.dp_rank for event in events[:4]} == {1}
    index.apply(events)
    assert normalizer.dp_ranks == [0, 2, 3, 4, 5, 6, 7, 9]
    assert normalizer.evictions == {"ranks": 1, "blocks": 0, "context_compactions": 0}
    assert (1, 1) not in index.overlap([1001 % 100_000 + 1] + [7] * (BS - 1))

    for rank in range(10, 100_010):
        normalizer.normalize(encoded([], dp_rank=rank), rank)
    assert len(normalizer.dp_ranks) == 8
    assert normalizer.evictions["ranks"] == 1 + 100_000


def test_stores_without_removals_evict_the_oldest_blocks_and_remove_them() -> None:
    normalizer = Normalizer(1, BS, max_blocks=1_600)
    index = TieredIndex(BS)
    for step in range(100):
        index.apply(normalizer.normalize(encoded([chain(1 + step * 64, 64)], dp_rank=None), step))
    live, _ = normalizer.tracked_blocks()
    assert live <= 1_600
    evicted = normalizer.evictions["blocks"]
    assert evicted == 6_400 - live
    assert normalizer.resident_blocks(0, Tier.DEVICE) == live
    assert normalizer.forwarded["removed", Tier.DEVICE] == evicted
    # Dynamo's tree holds exactly what the normalizer still tracks: the newest chains whole,
    # the evicted ones not at all (a chain's root went first, so nothing dangles).
    newest = [[(1 + step * 64) % 100_000 + 1] + [7] * (64 * BS - 1) for step in (99, 98)]
    for tokens in newest:
        assert {k: v.device for k, v in index.overlap(tokens).items()} == {(1, 0): 64}
    oldest = [(1 + 0 * 64) % 100_000 + 1] + [7] * (64 * BS - 1)
    assert index.overlap(oldest) == {}


def test_distinct_salts_past_the_cap_compact_or_drop() -> None:
    normalizer = Normalizer(1, BS, max_contexts=4)
    # Three salted chains, each removed again: their salts are unused afterwards.
    for step in range(3):
        normalizer.normalize(
            encoded([chain(1 + 10 * step, 1, salt=f"s{step}")], dp_rank=None), step
        )
        normalizer.normalize(encoded([removed([1 + 10 * step])], dp_rank=None), step)
    # The table (the unsalted pair and three salts) is full: a fourth salt compacts it.
    out = normalizer.normalize(encoded([chain(101, 1, salt="s3")], dp_rank=None), 10)
    assert kinds(out) == ["stored"] and out[0].cache_salt == "s3"
    assert normalizer.evictions["context_compactions"] == 1
    # Salts in use are kept: with s3..s5 resident the table is full of pairs in use, and a
    # store that needs a new one is dropped and counted.
    normalizer.normalize(encoded([chain(201, 1, salt="s4")], dp_rank=None), 11)
    normalizer.normalize(encoded([chain(301, 1, salt="s5")], dp_rank=None), 12)
    assert normalizer.normalize(encoded([chain(401, 2, salt="s6")], dp_rank=None), 13) == []
    assert normalizer.stats["state_cap"] == 2
    assert normalizer.resident_blocks(0, Tier.DEVICE) == 3


def test_after_every_block_is_removed_the_state_holds_only_its_retained_blocks() -> None:
    """A mass eviction leaves the retained blocks and nothing of the rest: by the core's own
    count, no more than the per-block bound (4 bytes per token and 48) for each of them.

    38,000 blocks and 5,000 retained: the state compacts whenever half of its slots are free,
    last at 9,500 slots, so the last 4,500 removals would leave 4,500 free slots behind (nearly
    half) if a state with no live block did not compact as well."""
    block_size, retain, chain_length, chains = 16, 5_000, 40, 950
    normalizer = Normalizer(1, block_size, retain_evicted=retain)
    for step in range(chains):
        hashes = list(range(1 + step * chain_length, 1 + (step + 1) * chain_length))
        tokens = [token % 150_000 for token in range(hashes[0] * 16, (hashes[-1] + 1) * 16)]
        normalizer.normalize(encoded([stored(hashes, tokens, block_size=block_size)]), step)
    assert normalizer.tracked_blocks() == (chains * chain_length, 0)
    for step in range(chains):
        hashes = list(range(1 + step * chain_length, 1 + (step + 1) * chain_length))
        normalizer.normalize(encoded([removed(hashes)]), chains + step)
    assert normalizer.tracked_blocks() == (0, retain)
    assert normalizer.resident_blocks(0, Tier.DEVICE) == 0
    assert normalizer.heap_bytes() <= retain * (4 * block_size + 48)
