"""Exact overlaps of :class:`kvbridge.TieredIndex` on the real ``dynamo.llm.RadixTree``.

``overlap()`` is cumulative like Dynamo's: ``device`` counts leading blocks on the GPU,
``host_pinned`` leading blocks on the GPU or in host memory, ``disk`` leading blocks on any tier.
The last test checks it against a reference computed from nothing but the set of resident
(tier, block) pairs, over random interleavings of stores, removals, clears and worker removals.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from dataclasses import dataclass, field

import msgspec
import pytest
from dynamo.llm import RadixTree

from kvbridge import Normalizer, Overlap, Tier, TieredEvent, TieredIndex, VllmBatch
from kvbridge.normalizers.hashing import sequence_hashes, tokens_hashes
from kvbridge.schemas.kv_cache_event import (
    EventData,
    KvCacheEvent,
    RemovedData,
    StoredBlock,
    StoredData,
)
from kvbridge.schemas.vllm import AllBlocksCleared, BlockRemoved, BlockStored

BS = 4
D, H, K, X = Tier.DEVICE, Tier.HOST_PINNED, Tier.DISK, Tier.EXTERNAL


@dataclass(frozen=True)
class Prompt:
    tokens: tuple[int, ...]
    lora_name: str | None = None
    cache_salt: str | None = None
    block_size: int = BS

    @property
    def th(self) -> list[int]:
        return tokens_hashes(
            self.tokens, self.block_size, lora_name=self.lora_name, cache_salt=self.cache_salt
        )

    @property
    def seq(self) -> list[int]:
        return sequence_hashes(self.th)

    @property
    def blocks(self) -> int:
        return len(self.tokens) // self.block_size


P = Prompt(tuple(range(100, 116)))  # 4 blocks: the facts sheet's example


def store(
    tier: Tier,
    start: int,
    end: int,
    prompt: Prompt = P,
    *,
    worker: int = 1,
    rank: int = 0,
) -> TieredEvent:
    """Blocks ``start..end-1`` (0-based) of ``prompt``, as the Normalizer emits them."""
    seq, th = prompt.seq, prompt.th
    parent = seq[start - 1] if start else None
    data = EventData(
        stored=StoredData(parent, [StoredBlock(seq[i], th[i]) for i in range(start, end)])
    )
    bs = prompt.block_size
    return TieredEvent(
        worker,
        rank,
        tier,
        KvCacheEvent(0, data, rank),
        list(prompt.tokens[start * bs : end * bs]),
        prompt.lora_name,
        prompt.cache_salt,
    )


def remove(
    tier: Tier, indices: Iterable[int], prompt: Prompt = P, *, worker: int = 1, rank: int = 0
) -> TieredEvent:
    seq = prompt.seq
    data = EventData(removed=RemovedData([seq[i] for i in indices]))
    return TieredEvent(worker, rank, tier, KvCacheEvent(0, data, rank))


def clear(tier: Tier, *, worker: int = 1, rank: int = 0) -> TieredEvent:
    return TieredEvent(worker, rank, tier, KvCacheEvent(0, "cleared", rank))


def ov(index: TieredIndex, prompt: Prompt = P) -> dict[tuple[int, int], tuple[int, int, int]]:
    result = index.overlap(
        list(prompt.tokens), lora_name=prompt.lora_name, cache_salt=prompt.cache_salt
    )
    return {key: (o.device, o.host_pinned, o.disk) for key, o in result.items()}


def one(index: TieredIndex, prompt: Prompt = P) -> tuple[int, int, int]:
    """The overlap of worker 1, rank 0 (all zeros when the index does not list it)."""
    return ov(index, prompt).get((1, 0), (0, 0, 0))


# -- tiers -------------------------------------------------------------------------------------


def test_gpu_store_cpu_copy_and_reattachment() -> None:
    index = TieredIndex(BS)
    index.apply([store(D, 0, 4)])
    assert index.overlap(list(P.tokens)) == {(1, 0): Overlap(4, 4, 4)}
    index.apply([store(H, 2, 4)])  # CPU copy of blocks 3 and 4
    assert one(index) == (4, 4, 4)
    index.apply([remove(D, [1, 2, 3])])  # blocks 2-4 leave the GPU
    # Block 2 is on no tier, so blocks 3 and 4 (on the CPU) are not a prefix.
    assert one(index) == (1, 1, 1)
    index.apply([store(D, 1, 2)])  # block 2 back on the GPU: 3 and 4 re-attach on the CPU level
    assert one(index) == (2, 4, 4)
    index.apply([remove(H, [3])])
    assert one(index) == (2, 3, 3)
    index.apply([remove(D, [0])])
    assert one(index) == (0, 0, 0)
    assert index.overlap(list(P.tokens)) == {}
    index.apply([store(H, 0, 1)])  # block 1 on the CPU, 2 on the GPU, 3 on the CPU
    assert one(index) == (0, 3, 3)
    assert index.resident(1) == {D: 1, H: 2, K: 0, X: 0}


def test_cpu_chunk_whose_parent_is_only_on_the_gpu() -> None:
    index = TieredIndex(BS)
    index.apply([store(D, 0, 2), store(H, 2, 4)])
    assert one(index) == (2, 4, 4)
    index.apply([store(H, 0, 1)])
    index.apply([remove(D, [0])])  # block 1 still on the CPU, block 2 only on the GPU
    assert one(index) == (0, 4, 4)


def test_cpu_only_prefix() -> None:
    index = TieredIndex(BS)
    index.apply([store(H, 0, 3)])
    assert index.overlap(list(P.tokens)) == {(1, 0): Overlap(0, 3, 3)}


def test_disk_and_external_count_in_disk_only() -> None:
    index = TieredIndex(BS)
    index.apply([store(K, 0, 4)])
    assert one(index) == (0, 0, 4)
    index.apply([clear(K)])
    index.apply([store(D, 0, 2), store(X, 2, 4)])
    assert one(index) == (2, 2, 4)
    index.apply([store(K, 2, 3)])
    index.apply([remove(X, [2])])  # block 3 is still on disk
    assert one(index) == (2, 2, 4)
    index.apply([remove(K, [2])])
    assert one(index) == (2, 2, 2)
    index.apply([store(H, 2, 3)])  # block 3 on the CPU, block 4 still external
    assert one(index) == (2, 3, 4)
    index.apply([store(X, 2, 3)])
    index.apply([remove(H, [2])])
    assert one(index) == (2, 2, 4)
    assert index.resident(1) == {D: 2, H: 0, K: 0, X: 2}


def test_middle_block_removal_and_restore() -> None:
    index = TieredIndex(BS)
    index.apply([store(D, 0, 4)])
    index.apply([remove(D, [1])])
    assert one(index) == (1, 1, 1)
    assert index.resident(1)[D] == 3  # blocks 3 and 4 are still resident, but unreachable
    index.apply([store(D, 1, 2)])
    assert one(index) == (4, 4, 4)
    # The same removal seen from a lower tier that holds the middle block.
    index.apply([store(H, 1, 2)])
    index.apply([remove(D, [1])])
    assert one(index) == (1, 4, 4)
    index.apply([store(D, 1, 2)])
    assert one(index) == (4, 4, 4)


def test_radix_tree_forgets_children_which_the_index_reattaches() -> None:
    """Why the index tracks residency: Dynamo's RadixTree drops the children of a node removed
    by its last worker, so a plain tree under-counts after a re-store."""
    tree = RadixTree()
    for n, event in enumerate([store(D, 0, 4), remove(D, [1]), store(D, 1, 2)]):
        payload = KvCacheEvent(n, event.event.data, 0)
        tree.apply_event(1, msgspec.json.encode(payload))
    assert tree.find_matches(P.th).scores == {(1, 0): 2}
    index = TieredIndex(BS)
    index.apply([store(D, 0, 4), remove(D, [1]), store(D, 1, 2)])
    assert one(index) == (4, 4, 4)


def test_clears_per_tier() -> None:
    index = TieredIndex(BS)
    index.apply([store(D, 0, 4), store(H, 0, 2), store(K, 0, 4)])
    index.apply([store(D, 0, 4, rank=1)])
    assert one(index) == (4, 4, 4)
    index.apply([clear(X)])  # nothing there: no change
    assert one(index) == (4, 4, 4)
    index.apply([clear(D)])
    assert ov(index) == {(1, 0): (0, 2, 4), (1, 1): (4, 4, 4)}
    index.apply([clear(H)])
    assert ov(index) == {(1, 0): (0, 0, 4), (1, 1): (4, 4, 4)}
    index.apply([clear(K)])
    assert ov(index) == {(1, 1): (4, 4, 4)}
    assert index.resident(1) == {D: 0, H: 0, K: 0, X: 0}
    assert index.workers() == [(1, 1)]
    # Stores after a clear work again, chaining included.
    index.apply([store(H, 0, 2), store(D, 2, 4)])
    assert one(index) == (0, 4, 4)  # blocks 3-4 on the GPU, under CPU blocks 1-2
    index.apply([store(D, 0, 2)])
    assert one(index) == (4, 4, 4)


def test_clear_of_a_lower_tier_keeps_the_device() -> None:
    index = TieredIndex(BS)
    index.apply([store(D, 0, 2), store(H, 2, 4)])
    index.apply([clear(H)])
    assert one(index) == (2, 2, 2)
    index.apply([store(H, 2, 3)])
    assert one(index) == (2, 3, 3)


def test_normalizer_clear_reaches_every_tier() -> None:
    norm, index = Normalizer(1, BS), TieredIndex(BS)
    events: list[BlockStored] = [
        BlockStored([11, 12, 13, 14], None, list(P.tokens), BS, None, "GPU"),
        BlockStored([13, 14], 12, list(P.tokens[8:]), BS, None, "CPU"),
        BlockStored([11, 12, 13, 14], None, list(P.tokens), BS, None, "STORAGE"),
    ]
    index.apply(norm.normalize(VllmBatch(0.0, list(events), 0)))
    index.apply(norm.normalize(VllmBatch(0.0, [BlockRemoved([12], "GPU")], 0)))
    assert one(index) == (1, 1, 4)  # block 2 is left on disk only
    index.apply(norm.normalize(VllmBatch(0.0, [AllBlocksCleared()], 0)))
    assert index.overlap(list(P.tokens)) == {}
    assert index.workers() == []


# -- workers and ranks -------------------------------------------------------------------------


def test_two_workers_two_ranks() -> None:
    index = TieredIndex(BS)
    index.apply(
        [
            store(D, 0, 2, worker=1),
            store(D, 2, 4, worker=1),
            store(D, 0, 3, worker=1, rank=2),
            store(D, 0, 1, worker=2),
        ]
    )
    assert ov(index) == {(1, 0): (4, 4, 4), (1, 2): (3, 3, 3), (2, 0): (1, 1, 1)}
    index.apply([remove(D, [3], worker=1)])
    assert ov(index) == {(1, 0): (3, 3, 3), (1, 2): (3, 3, 3), (2, 0): (1, 1, 1)}
    index.apply([clear(D, worker=1, rank=0)])
    assert ov(index) == {(1, 2): (3, 3, 3), (2, 0): (1, 1, 1)}
    assert index.workers() == [(1, 2), (2, 0)]


def test_shared_nodes_across_workers() -> None:
    """Both workers hold the same canonical blocks (one RadixTree node each)."""
    index = TieredIndex(BS)
    index.apply([store(D, 0, 4, worker=1), store(D, 0, 2, worker=2)])
    index.apply([remove(D, [1], worker=2)])
    assert ov(index) == {(1, 0): (4, 4, 4), (2, 0): (1, 1, 1)}
    index.apply([remove(D, [1], worker=1)])  # the last holder of block 2 removes it
    assert ov(index) == {(1, 0): (1, 1, 1), (2, 0): (1, 1, 1)}
    index.apply([store(D, 1, 2, worker=2)])
    assert ov(index) == {(1, 0): (1, 1, 1), (2, 0): (2, 2, 2)}
    index.apply([store(D, 1, 2, worker=1)])
    assert ov(index) == {(1, 0): (4, 4, 4), (2, 0): (2, 2, 2)}


def test_remove_worker() -> None:
    index = TieredIndex(BS)
    index.apply(
        [
            store(D, 0, 4, worker=1),
            store(H, 0, 4, worker=1, rank=1),
            store(D, 0, 2, worker=2),
            store(K, 0, 4, worker=2),
        ]
    )
    assert ov(index) == {(1, 0): (4, 4, 4), (1, 1): (0, 4, 4), (2, 0): (2, 2, 4)}
    index.remove_worker(1)
    assert ov(index) == {(2, 0): (2, 2, 4)}
    assert index.workers() == [(2, 0)]
    assert index.resident(1) == index.resident(1, 1) == {D: 0, H: 0, K: 0, X: 0}
    # A removed worker starts again from nothing.
    index.apply([store(D, 2, 4, worker=1)])
    assert ov(index) == {(2, 0): (2, 2, 4)}
    index.apply([store(D, 0, 2, worker=1)])
    assert ov(index) == {(1, 0): (4, 4, 4), (2, 0): (2, 2, 4)}
    index.remove_worker(2)
    index.remove_worker(99)
    assert ov(index) == {(1, 0): (4, 4, 4)}


# -- reads -------------------------------------------------------------------------------------


def test_dump_structure() -> None:
    index = TieredIndex(BS)
    index.apply([store(D, 0, 2), store(H, 2, 3), store(D, 0, 1, worker=2, rank=3)])
    dump = index.dump()
    assert set(dump) == {"device", "host_pinned", "disk"}
    for rows in dump.values():
        for row in rows:
            assert row["storage_tier"] == "device"
            assert row["residency_domain"] == "worker"
            assert set(row["event"]) == {"event_id", "dp_rank", "data"}
            assert set(row["event"]["data"]) == {"stored"}
    assert _dumped(dump["device"]) == {(1, 0, P.seq[0]), (1, 0, P.seq[1]), (2, 3, P.seq[0])}
    assert (
        _dumped(dump["host_pinned"])
        == _dumped(dump["disk"])
        == _dumped(dump["device"]) | {(1, 0, P.seq[2])}
    )
    tokens_hashes_dumped = {
        block["tokens_hash"]
        for row in dump["disk"]
        for block in row["event"]["data"]["stored"]["blocks"]
    }
    assert tokens_hashes_dumped == set(P.th[:3])
    # Replaying a level's dump into a fresh tree reproduces its scores.
    tree = RadixTree()
    for row in dump["host_pinned"]:
        tree.apply_event(row["worker_id"], json.dumps(row["event"]).encode())
    assert tree.find_matches(P.th).scores == {(1, 0): 3, (2, 3): 1}


def _dumped(rows: list[dict[str, object]]) -> set[tuple[int, int, int]]:
    out = set()
    for row in rows:
        event = row["event"]
        assert isinstance(event, dict)
        for block in event["data"]["stored"]["blocks"]:
            out.add((row["worker_id"], event["dp_rank"], block["block_hash"]))
    return out  # type: ignore[return-value]


def test_resident_counts() -> None:
    index = TieredIndex(BS)
    assert index.resident(1) == {D: 0, H: 0, K: 0, X: 0}
    index.apply([store(D, 0, 4), store(H, 1, 3), store(X, 3, 4), store(K, 0, 1, rank=1)])
    assert index.resident(1) == {D: 4, H: 2, K: 0, X: 1}
    assert index.resident(1, 1) == {D: 0, H: 0, K: 1, X: 0}
    index.apply([remove(D, [0, 1])])
    assert index.resident(1) == {D: 2, H: 2, K: 0, X: 1}
    assert one(index) == (0, 0, 0)
    assert index.workers() == [(1, 0), (1, 1)]


def test_lora_and_salt_queries_match_only_their_blocks() -> None:
    plain = P
    lora = Prompt(P.tokens, lora_name="my-lora")
    salted = Prompt(P.tokens, cache_salt="tenantA")
    both = Prompt(P.tokens, lora_name="my-lora", cache_salt="tenantA")
    index = TieredIndex(BS)
    index.apply(
        [
            store(D, 0, 4, plain, worker=1),
            store(D, 0, 3, lora, worker=2),
            store(D, 0, 2, salted, worker=3),
            store(H, 0, 1, both, worker=4),
        ]
    )
    assert ov(index, plain) == {(1, 0): (4, 4, 4)}
    assert ov(index, lora) == {(2, 0): (3, 3, 3)}
    assert ov(index, salted) == {(3, 0): (2, 2, 2)}
    assert ov(index, both) == {(4, 0): (0, 1, 1)}
    assert ov(index, Prompt(P.tokens, lora_name="other")) == {}
    assert ov(index, Prompt(P.tokens, lora_name="", cache_salt="")) == {(1, 0): (4, 4, 4)}


def test_salt_from_the_normalizer_reaches_the_index() -> None:
    norm, index = Normalizer(1, BS), TieredIndex(BS)
    event = BlockStored(
        [11, 12, 13, 14],
        None,
        list(P.tokens),
        BS,
        None,
        "GPU",
        "my-lora",
        [["my-lora", "dynamo-cache-salt:tenantA"], ["my-lora"], None, None],
    )
    index.apply(norm.normalize(VllmBatch(0.0, [event], 0)))
    assert index.overlap(list(P.tokens)) == {}
    assert index.overlap(list(P.tokens), lora_name="my-lora") == {}
    assert index.overlap(list(P.tokens), lora_name="my-lora", cache_salt="tenantA") == {
        (1, 0): Overlap(4, 4, 4)
    }


def test_block_size_learned_and_short_queries() -> None:
    index = TieredIndex()
    assert index.overlap(list(P.tokens)) == {}
    index.apply([store(D, 0, 2)])
    assert index.block_size == BS
    assert index.overlap(list(P.tokens[:7])) == {(1, 0): Overlap(1, 1, 1)}
    assert index.overlap(list(P.tokens[:3])) == {}
    assert index.overlap([]) == {}


# -- the invented-block property ---------------------------------------------------------------

PBS = 2  # small blocks keep the prompts short


@dataclass
class Reference:
    """What is resident, as (tier, canonical hash) pairs per (worker, dp_rank), and nothing
    else: the expected overlaps and tree contents are derived from this alone."""

    parents: dict[int, int | None]
    resident: dict[tuple[int, int], dict[Tier, set[int]]] = field(default_factory=dict)

    def tiers(self, key: tuple[int, int]) -> dict[Tier, set[int]]:
        return self.resident.setdefault(key, {tier: set() for tier in Tier})

    @staticmethod
    def allowed(level: int) -> tuple[Tier, ...]:
        return ((D,), (D, H), (D, H, K, X))[level]

    def on_level(self, key: tuple[int, int], level: int) -> set[int]:
        tiers = self.resident.get(key)
        if tiers is None:
            return set()
        return set().union(*(tiers[tier] for tier in self.allowed(level)))

    def overlap(self, prompt: Prompt) -> dict[tuple[int, int], Overlap]:
        seq = prompt.seq
        out = {}
        for key in sorted(self.resident):
            counts = []
            for level in range(3):
                present = self.on_level(key, level)
                n = 0
                while n < len(seq) and seq[n] in present:
                    n += 1
                counts.append(n)
            if counts[2]:
                out[key] = Overlap(*counts)
        return out

    def reachable(self, level: int) -> set[tuple[int, int, int]]:
        """Blocks resident on the level whose every ancestor is too: what a tree may hold."""
        out = set()
        for key in self.resident:
            present = self.on_level(key, level)
            for block in present:
                node: int | None = block
                while node is not None and node in present:
                    node = self.parents[node]
                if node is None:
                    out.add((key[0], key[1], block))
        return out


def _prompt_forest(rng: random.Random) -> list[Prompt]:
    def fresh(blocks: int) -> tuple[int, ...]:
        return tuple(rng.randrange(50_000) for _ in range(blocks * PBS))

    prompts = [Prompt(fresh(rng.randrange(4, 9)), block_size=PBS) for _ in range(3)]
    for _ in range(5):  # branches sharing a prefix with an earlier prompt
        base = rng.choice(prompts)
        cut = rng.randrange(1, base.blocks + 1) * PBS
        prompts.append(Prompt(base.tokens[:cut] + fresh(rng.randrange(1, 5)), block_size=PBS))
    # The same tokens under a LoRA and a salt are different blocks.
    prompts.append(Prompt(prompts[0].tokens, lora_name="lora-a", block_size=PBS))
    prompts.append(Prompt(prompts[1].tokens, cache_salt="tenant", block_size=PBS))
    return prompts


def _queries(rng: random.Random, prompts: list[Prompt]) -> list[Prompt]:
    queries = list(prompts)
    for prompt in prompts:
        queries.append(  # a trailing partial block and a different continuation
            Prompt(
                prompt.tokens[: rng.randrange(1, len(prompt.tokens) + 1)]
                + (99_999,) * rng.randrange(0, 2 * PBS),
                prompt.lora_name,
                prompt.cache_salt,
                PBS,
            )
        )
    queries.append(Prompt(prompts[0].tokens, cache_salt="tenant", block_size=PBS))  # no match
    return queries


@pytest.mark.parametrize("tiers", [(D, H), (D, H, K, X)], ids=["gpu+cpu", "all-tiers"])
@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_overlap_equals_reference_under_random_interleavings(
    seed: int, tiers: tuple[Tier, ...]
) -> None:
    rng = random.Random(seed)
    prompts = _prompt_forest(rng)
    queries = _queries(rng, prompts)
    parents: dict[int, int | None] = {}
    for prompt in prompts:
        seq = prompt.seq
        for i, block in enumerate(seq):
            parents[block] = seq[i - 1] if i else None
    keys = [(1, 0), (1, 1), (2, 0)]
    ref = Reference(parents)
    index = TieredIndex(PBS)
    counts = {"store": 0, "remove": 0, "clear": 0, "remove_worker": 0}
    max_seen = [0, 0, 0]

    for step in range(200):
        key = rng.choice(keys)
        worker, rank = key
        roll = rng.random()
        events: list[TieredEvent] = []
        if roll < 0.5:
            tier = rng.choice(tiers)
            prompt = rng.choice(prompts)
            start = rng.randrange(prompt.blocks)
            end = min(prompt.blocks, start + rng.randrange(1, 5))
            held = ref.tiers(key)[tier]
            seq = prompt.seq
            # Like the Normalizer: only blocks new on this tier, one event per run.
            i = start
            while i < end:
                if seq[i] in held:
                    i += 1
                    continue
                j = i
                while j < end and seq[j] not in held:
                    j += 1
                events.append(store(tier, i, j, prompt, worker=worker, rank=rank))
                held.update(seq[i:j])
                i = j
            counts["store"] += bool(events)
        elif roll < 0.85:
            tier = rng.choice(tiers)
            held = ref.tiers(key)[tier]
            if held:
                gone = rng.sample(sorted(held), min(len(held), rng.randrange(1, 4)))
                held.difference_update(gone)
                data = EventData(removed=RemovedData(gone))
                events.append(TieredEvent(worker, rank, tier, KvCacheEvent(0, data, rank)))
                counts["remove"] += 1
        elif roll < 0.96:
            cleared = list(Tier) if rng.random() < 0.4 else [rng.choice(tiers)]
            for tier in cleared:
                ref.tiers(key)[tier].clear()
                events.append(clear(tier, worker=worker, rank=rank))
            counts["clear"] += 1
        else:
            index.remove_worker(worker)
            for other in keys:
                if other[0] == worker:
                    ref.resident.pop(other, None)
            counts["remove_worker"] += 1
        index.apply(events)

        for query in queries:
            expected = ref.overlap(query)
            actual = index.overlap(
                list(query.tokens), lora_name=query.lora_name, cache_salt=query.cache_salt
            )
            assert actual == expected, (step, query, events)
            for o in expected.values():
                assert o.device <= o.host_pinned <= o.disk
                seen = (o.device, o.host_pinned, o.disk)
                max_seen = [max(m, v) for m, v in zip(max_seen, seen, strict=True)]
        dump = index.dump()
        for level, name in enumerate(("device", "host_pinned", "disk")):
            assert _dumped(dump[name]) == ref.reachable(level), (step, name)
        for key in keys:
            tiers_now = ref.resident.get(key, {tier: set() for tier in Tier})
            assert index.resident(*key) == {tier: len(tiers_now[tier]) for tier in Tier}

    # The walk was not trivial.
    assert counts["store"] > 60 and counts["remove"] > 20 and counts["clear"] > 5
    assert max_seen[0] >= 3 and max_seen[2] >= 4


MEDIUM_TIER = {"GPU": D, "cpu": H, "STORAGE": K, "SHARED": X}


@pytest.mark.parametrize("seed", [5, 6, 7])
def test_normalizer_and_index_match_reference_counts(seed: int) -> None:
    """End to end: vLLM events with re-announced (duplicate) stores, removals and clears, each
    rank hashing in its own engine style, through the Normalizer into the index. Residency is
    reference-counted per (rank, tier, block) in the reference."""
    rng = random.Random(seed)
    prompts = _prompt_forest(rng)[:-2]  # plain prompts only: the Normalizer reads no salt here
    queries = _queries(rng, prompts)
    salt = {0: rng.getrandbits(64), 1: rng.getrandbits(64)}
    rng_bytes = {block: rng.randbytes(8) for prompt in prompts for block in prompt.seq}

    def engine(rank: int, block: int) -> int | bytes:
        value = (block * 0x9E3779B97F4A7C15 + salt[rank]) % 2**64
        # Rank 1 sends 16-byte digests whose low 64 bits are the value.
        return value if rank == 0 else rng_bytes[block] + value.to_bytes(8, "big")

    norm, index = Normalizer(1, PBS), TieredIndex(PBS)
    refs: dict[tuple[int, Tier], dict[int, int]] = {}
    known: dict[int, set[int]] = {0: set(), 1: set()}
    for _ in range(250):
        rank = rng.choice((0, 1))
        roll = rng.random()
        events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
        if roll < 0.55:
            medium = rng.choice(list(MEDIUM_TIER))
            prompt = rng.choice(prompts)
            seq = prompt.seq
            start = 0 if rng.random() < 0.4 else rng.randrange(prompt.blocks)
            end = min(prompt.blocks, start + rng.randrange(1, 5))
            parent = seq[start - 1] if start else None
            events.append(
                BlockStored(
                    [engine(rank, block) for block in seq[start:end]],
                    None if parent is None else engine(rank, parent),
                    list(prompt.tokens[start * PBS : end * PBS]),
                    PBS,
                    None,
                    medium,
                )
            )
            if parent is None or parent in known[rank]:
                counts = refs.setdefault((rank, MEDIUM_TIER[medium]), {})
                for block in seq[start:end]:
                    counts[block] = counts.get(block, 0) + 1
                    known[rank].add(block)
        elif roll < 0.92:
            medium = rng.choice(list(MEDIUM_TIER))
            counts = refs.setdefault((rank, MEDIUM_TIER[medium]), {})
            shared = sorted(block for block, n in counts.items() if n > 1)
            pool = shared if shared and rng.random() < 0.5 else sorted(counts)
            if pool:
                gone = rng.sample(pool, min(len(pool), rng.randrange(1, 4)))
                events.append(BlockRemoved([engine(rank, block) for block in gone], medium))
                for block in gone:
                    counts[block] -= 1
                    if not counts[block]:
                        del counts[block]
        else:
            events.append(AllBlocksCleared())
            for tier in Tier:
                refs.pop((rank, tier), None)
        index.apply(norm.normalize(VllmBatch(0.0, list(events), rank)))

        for query in queries:
            seq = query.seq
            expected = {}
            for r in (0, 1):
                levels = []
                for level in range(3):
                    present = set().union(
                        *(refs.get((r, tier), {}).keys() for tier in Reference.allowed(level))
                    )
                    n = 0
                    while n < len(seq) and seq[n] in present:
                        n += 1
                    levels.append(n)
                if levels[2]:
                    expected[(1, r)] = Overlap(*levels)
            actual = index.overlap(
                list(query.tokens), lora_name=query.lora_name, cache_salt=query.cache_salt
            )
            assert actual == expected, (query, events)
        for r in (0, 1):
            assert index.resident(1, r) == {t: len(refs.get((r, t), {})) for t in Tier}

    assert norm.stats["duplicate_store"] > 20
    assert norm.stats["still_referenced"] >= 3
    assert set(norm.stats) <= {"duplicate_store", "still_referenced", "orphan_parent"}
