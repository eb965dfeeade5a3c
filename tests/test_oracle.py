"""Dynamo's own SelectionService as the oracle for kvbridge, and where Dynamo alone is wrong.

Every batch is encoded once, in vLLM's wire format (``encode_batch`` with the 0.32.0 tagged-map
layout, or the 0.22.0 positional arrays), and the *same bytes* go two ways
(``support.streams.WorkerStream``):

* over a real :class:`~kvbridge.adapters.publisher.Publisher` on 127.0.0.1 to a real, in-process
  ``dynamo.llm.SelectionService`` subscribed with its native ZMQ decoder;
* through ``decode_batch`` → ``Normalizer.normalize`` → ``TieredIndex.apply``.

Before reading scores, ``WorkerStream.sync`` publishes a sentinel GPU → CPU → DISK chain on every
rank and waits (bounded) until the service reports it on all three tiers, so every earlier
batch of that rank has been applied; expectations are then also polled (bounded) before the
exact assertions.

Group 1 (issue acceptance 4): on streams Dynamo's decoder handles, Dynamo's
``overlap_scores`` (device, host_pinned, disk) equals ``TieredIndex.overlap`` for every prompt
and every (worker, dp_rank), and a few hand-computed values pin both.

Group 2 (issue acceptance 5): streams where the native path is wrong. TieredIndex gives the
correct overlap; the values asserted for Dynamo 1.6.1 are the ones it was observed to give.

What Dynamo does with each stream: README.md, "Drop reasons" and "Tiers";
9-11, 13.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from support.selection_harness import Overlap, SelectionHarness
from support.streams import Chain, WorkerStream, kvbridge_overlap

from kvbridge import DropReason, TieredIndex

POLL_S = 3.0
BS = 4


@pytest.fixture
def harness() -> Iterator[SelectionHarness]:
    with SelectionHarness() as h:
        yield h


def seg(base: int, blocks: int, bs: int) -> list[int]:
    return list(range(base, base + blocks * bs))


def families(bs: int, seed: bytes | None = None) -> dict[str, Chain]:
    """Deterministic prompt families sharing prefixes, as the engine of ``seed`` hashes them.

    ROOT is 2 blocks. P0 = ROOT + 6 blocks (8); P1 = P0's first 4 blocks + 4 of its own (8);
    P2 = ROOT + 3 blocks (5); P3 (5 blocks) and P4 (6 blocks) share nothing.
    """
    root = seg(1000, 2, bs)
    p0 = root + seg(1100, 6, bs)
    return {
        "P0": Chain(p0, bs, seed=seed),
        "P1": Chain(p0[: 4 * bs] + seg(1200, 4, bs), bs, seed=seed),
        "P2": Chain(root + seg(1300, 3, bs), bs, seed=seed),
        "P3": Chain(seg(1400, 5, bs), bs, seed=seed),
        "P4": Chain(seg(1500, 6, bs), bs, seed=seed),
    }


def queries(chains: dict[str, Chain]) -> list[list[int]]:
    """Every block prefix of every family, each full prompt plus a trailing partial block, and
    each family diverging after its first block."""
    out: list[list[int]] = []
    for chain in chains.values():
        bs = chain.block_size
        out.extend(chain.prefix(n) for n in range(1, len(chain) + 1))
        out.append(chain.prefix(len(chain), [7] * (bs - 1)))
        out.append(chain.prefix(1, [9] * bs) + chain.tokens[2 * bs :])
    return out


def assert_oracle(harness: SelectionHarness, index: TieredIndex, prompts: list[list[int]]) -> None:
    """Dynamo's overlap_scores == TieredIndex.overlap, for every prompt, (worker, dp_rank), tier."""

    def agree() -> bool:
        return all(harness.overlap(p) == kvbridge_overlap(index, p) for p in prompts)

    harness.wait_for(agree, POLL_S)
    for prompt in prompts:
        assert harness.overlap(prompt) == kvbridge_overlap(index, prompt), prompt


def observe(
    harness: SelectionHarness,
    index: TieredIndex,
    prompt: list[int],
    *,
    native: Overlap,
    correct: Overlap,
    **query: Any,
) -> None:
    """Dynamo's (wrong) overlap is ``native`` and kvbridge's is ``correct``, exactly."""
    harness.wait_for(lambda: harness.overlap(prompt, **query) == native, POLL_S)
    assert harness.overlap(prompt, **query) == native
    assert kvbridge_overlap(index, prompt, **query) == correct
    assert native != correct


# =============================================================================================
# Group 1: Dynamo's own decoder and indexer as the oracle
# =============================================================================================
#
# Patterns deliberately avoided, because Dynamo's semantics legitimately differ from "leading
# blocks resident on the GPU / on the GPU or CPU / on any tier" (both observed on 1.6.1 with
# this harness, block size 4, 5-block prompt):
#
# * Tier holes. Past the device prefix, Dynamo extends the match only through blocks resident
#   on the lower tier itself, so a GPU-only block after a CPU-only one ends it. GPU store of
#   blocks 0-4, CPU copies of blocks 1 and 3, GPU eviction of 3 then 1: Dynamo (1, 2, 2),
#   cumulative residency (1, 5, 5). Here every prompt runs GPU*, then CPU*, then DISK*.
# * Evicting a GPU block in the middle of a chain and storing it again: Dynamo's radix tree
#   drops the descendants of a node its last worker removed, although they stay resident
#   (blocks 0-4, evict 2, store 2 again: Dynamo (3, 3, 3), residency (5, 5, 5)). vLLM evicts
#   tail first, so every eviction here is tail first.
# * Storing one block twice on one tier (Dynamo does not reference-count: group 2).


@pytest.mark.parametrize("bs", [4, 16])
def test_selection_service_agrees_with_tiered_index(harness: SelectionHarness, bs: int) -> None:
    """Worker 1: one rank, vLLM 0.32.0 maps. Worker 2: dp ranks 0 (vLLM 0.22.0 arrays) and 1
    (0.32.0 maps), one publisher per rank, registered as data_parallel_size=2 without replay.
    Int u64 hashes identical on all workers, canonical media, self-describing CPU stores, GPU
    evictions one hash per BlockRemoved, CPU removals, AllBlocksCleared."""
    index = TieredIndex(bs)
    chains = families(bs)
    p0, p1, p2, p3, p4 = chains.values()
    prompts = queries(chains)
    hashes = [h for chain in chains.values() for h in chain.hashes]
    assert any(h >= 2**63 for h in hashes) and any(h < 2**63 for h in hashes)  # both int widths
    with (
        WorkerStream(harness, index, 1, bs) as w1,
        WorkerStream(harness, index, 2, bs, ranks=(0, 1), releases={0: "0.22.0"}) as w2,
    ):
        # Worker 1: chunked prefill of P0 (two chained stores in one step), then P1 after P0's
        # first 4 blocks; a CPU chunk of P2 whose parent (ROOT) is only on the GPU; P0's blocks
        # 0-5 offloaded to CPU then 5 and 4 evicted from the GPU; P0's 6-7 on DISK (parent only
        # on CPU); P1's 7 and 6 evicted.
        w1.send([p0.stored(0, 4), p0.stored(4, 6)])
        w1.send([p1.stored(4, 8)])
        w1.send([p2.stored(2, 5, medium="CPU")])
        w1.send([p0.stored(0, 6, medium="CPU"), *p0.evicted(5, 4)])
        w1.send([p0.stored(6, 8, medium="DISK")])
        w1.send(p1.evicted(7, 6))
        # Worker 2 rank 0 (arrays): P0 on GPU, 7-5 evicted; P3 offloaded to CPU, then every
        # GPU copy evicted (a CPU-only prefix). Rank 1: P2, then P1 after the shared ROOT.
        w2.send([p0.stored(0, 8)], 0)
        w2.send([p3.stored(0, 5)], 0)
        w2.send(p0.evicted(7, 6, 5), 0)
        w2.send([p3.stored(0, 5, medium="CPU"), *p3.evicted(4, 3, 2, 1, 0)], 0)
        w2.send([p2.stored(0, 5)], 1)
        w2.send([p1.stored(2, 8)], 1)
        w1.sync()
        w2.sync()
        assert_oracle(harness, index, prompts)
        # By hand:
        # P0: w1 GPU 0-3, CPU 0-5, DISK 6-7 -> (4, 6, 8); w2r0 GPU 0-4 -> 5; w2r1 holds ROOT
        # and P1's 2-3 (= P0's 2-3) -> 4.
        assert harness.overlap(p0.tokens) == {
            (1, 0): (4, 6, 8),
            (2, 0): (5, 5, 5),
            (2, 1): (4, 4, 4),
        }
        # P1: w1 GPU 0-5 -> 6; w2r0 only the shared 0-3 -> 4; w2r1 all 8.
        assert harness.overlap(p1.tokens) == {
            (1, 0): (6, 6, 6),
            (2, 0): (4, 4, 4),
            (2, 1): (8, 8, 8),
        }
        # P2: w1 ROOT on GPU + 3 CPU blocks -> (2, 5, 5); w2r0 ROOT -> 2; w2r1 all 5.
        assert harness.overlap(p2.tokens) == {
            (1, 0): (2, 5, 5),
            (2, 0): (2, 2, 2),
            (2, 1): (5, 5, 5),
        }
        # P3: CPU only on w2r0 -> (0, 5, 5). P4: nowhere.
        assert harness.overlap(p3.tokens) == {(2, 0): (0, 5, 5)}
        assert harness.overlap(p4.tokens) == {}

        # Rank 1 is reset (AllBlocksCleared, data_parallel_rank 1 only), then stores P4's first
        # 3 blocks on GPU and 3-5 on DISK. Worker 1: CPU removal of P2's 4, GPU evictions of
        # P1's 5 and 4, CPU removal of P0's 5 (its DISK children become unreachable).
        w2.clear(1)
        w2.send([p4.stored(0, 3)], 1)
        w2.send([p4.stored(3, 6, medium="DISK")], 1)
        w1.send([p2.removed(4)])
        w1.send(p1.evicted(5, 4))
        w1.send([p0.removed(5)])
        w1.sync()
        w2.sync()
        assert_oracle(harness, index, prompts)
        # By hand: P0 w1 GPU 0-3 + CPU 4 -> (4, 5, 5), DISK 6-7 hang off the removed 5; w2r1
        # is empty after the clear. P1 w1 GPU 0-3 -> 4. P2 w1 ROOT + CPU 2-3 -> (2, 4, 4).
        # P4 w2r1 GPU 0-2 + DISK 3-5 -> (3, 3, 6).
        assert harness.overlap(p0.tokens) == {(1, 0): (4, 5, 5), (2, 0): (5, 5, 5)}
        assert harness.overlap(p1.tokens) == {(1, 0): (4, 4, 4), (2, 0): (4, 4, 4)}
        assert harness.overlap(p2.tokens) == {(1, 0): (2, 4, 4), (2, 0): (2, 2, 2)}
        assert harness.overlap(p4.tokens) == {(2, 1): (3, 3, 6)}
        assert kvbridge_overlap(index, p4.tokens) == {(2, 1): (3, 3, 6)}
        # Nothing was dropped on the kvbridge side either.
        assert w1.normalizer.stats == Counter()
        assert w2.normalizer.stats == Counter()


# =============================================================================================
# Group 2: where Dynamo alone is wrong
# =============================================================================================


def test_bytes_hashes(harness: SelectionHarness) -> None:
    """32-byte digest hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0, or the CPU events of vLLM
    0.11-0.23). Dynamo rejects bytes ("data did not match any variant of untagged enum
    BlockHashValue") and drops the whole batch, int-hashed GPU stores in it included."""
    index = TieredIndex(BS)
    p0, _, p2, p3, _ = families(BS).values()
    with (
        WorkerStream(harness, index, 1, BS) as w1,
        WorkerStream(harness, index, 2, BS, release="0.22.0") as w2,
    ):
        # Worker 1 (0.32.0), every hash as bytes: P0 0-3 and P3 in one batch, P0 4-5 chained to
        # P0's 3 by its digest, then a GPU eviction of P0's 5 by digest.
        w1.send([p0.stored(0, 4, as_bytes=True), p3.stored(0, 5, as_bytes=True)])
        w1.send([p0.stored(4, 6, as_bytes=True)])
        w1.send(p0.evicted(5, as_bytes=True))
        # Worker 2 (0.22.0 arrays): int-hashed GPU store of P2 plus OffloadingConnector 0.20-0.23
        # CPU placeholders (bytes hash, no tokens, block_size 0), one per block, in one step;
        # then GPU evictions of P2's 4, 3, 2 (ints).
        w2.send([p2.stored(0, 5), *(p2.placeholder(i, as_bytes=True) for i in range(5))])
        w2.send(p2.evicted(4, 3, 2))
        w1.sync()
        w2.sync()
        # Correct: P0 on worker 1 GPU 0-4 -> 5; worker 2 holds the shared ROOT (P2's 0-1) on
        # the GPU -> 2. Dynamo: every batch with a bytes hash is gone ("Failed to decode
        # KvEventBatch: data did not match any variant of untagged enum BlockHashValue"), and
        # worker 2's int removals find nothing (BlockNotFound).
        observe(
            harness, index, p0.tokens, native={}, correct={(1, 0): (5, 5, 5), (2, 0): (2, 2, 2)}
        )
        observe(harness, index, p3.tokens, native={}, correct={(1, 0): (5, 5, 5)})
        # P2 on worker 2: GPU 0-1, CPU 0-4 (placeholders resolved through the GPU store).
        observe(
            harness, index, p2.tokens, native={}, correct={(1, 0): (2, 2, 2), (2, 0): (2, 5, 5)}
        )
        assert w1.normalizer.stats == Counter()
        assert w2.normalizer.stats == Counter()


def test_placeholder_cpu_events(harness: SelectionHarness) -> None:
    """vLLM's default OffloadingConnector placeholders (token_ids [], block_size 0, medium CPU,
    the GPU block's hash; 0.32.0 maps). Dynamo's block-size check drops them ("Block not
    published"), so blocks offloaded then evicted from the GPU are lost to it."""
    index = TieredIndex(BS)
    p0 = families(BS)["P0"]
    with WorkerStream(harness, index, 1, BS) as w1:
        w1.send([p0.stored(0, 6)])
        w1.send([p0.placeholder(i) for i in range(6)])
        w1.send(p0.evicted(5, 4, 3, 2))
        w1.sync()
        # Correct: GPU 0-1, CPU 0-5 -> (2, 6, 6). Dynamo: only the GPU -> (2, 2, 2).
        observe(harness, index, p0.tokens, native={(1, 0): (2, 2, 2)}, correct={(1, 0): (2, 6, 6)})
        w1.send(p0.evicted(1, 0))
        w1.sync()
        # Correct: CPU only -> (0, 6, 6). Dynamo: nothing.
        observe(harness, index, p0.tokens, native={}, correct={(1, 0): (0, 6, 6)})
        assert w1.normalizer.stats == Counter()


def test_lowercase_media(harness: SelectionHarness) -> None:
    """Mooncake and LMCache say "cpu". Dynamo's medium match is case-sensitive: unknown medium,
    dropped."""
    index = TieredIndex(BS)
    p0, _, _, p3, _ = families(BS).values()
    with WorkerStream(harness, index, 1, BS) as w1:
        w1.send([p0.stored(0, 6)])
        w1.send([p0.stored(0, 6, medium="cpu"), *p0.evicted(5, 4, 3, 2)])
        w1.send([p3.stored(0, 5, medium="cpu")])
        w1.sync()
        # Correct: GPU 0-1, CPU 0-5 -> (2, 6, 6); Dynamo counts the GPU only.
        observe(harness, index, p0.tokens, native={(1, 0): (2, 2, 2)}, correct={(1, 0): (2, 6, 6)})
        # Correct: P3 CPU only -> (0, 5, 5); Dynamo: nothing.
        observe(harness, index, p3.tokens, native={}, correct={(1, 0): (0, 5, 5)})
        assert w1.normalizer.stats == Counter()


def test_engines_hashing_identical_tokens_differently(harness: SelectionHarness) -> None:
    """Workers 1 (A) and 2 (B) hash the same tokens differently (pre-0.29 vLLM without a shared
    PYTHONHASHSEED). Dynamo's node keeps A's block hash, so B's chained store is refused
    ("Failed to find parent block") and B's removals by its own hashes do nothing (facts 1.7).
    kvbridge rewrites every hash to Dynamo's canonical sequence hash, per worker."""
    index = TieredIndex(BS)
    a = families(BS, seed=b"engine-A")["P0"]
    b = families(BS, seed=b"engine-B")["P0"]
    assert a.tokens == b.tokens
    assert not set(a.hashes) & set(b.hashes)
    with WorkerStream(harness, index, 1, BS) as wa, WorkerStream(harness, index, 2, BS) as wb:
        wa.send([a.stored(0, 3)])
        wa.sync()
        wb.send([b.stored(0, 3)])
        wb.sync()
        both = {(1, 0): (3, 3, 3), (2, 0): (3, 3, 3)}
        assert harness.overlap(a.tokens) == both
        assert kvbridge_overlap(index, a.tokens) == both

        def then(
            worker: WorkerStream, events: list[Any], native: Overlap, correct: Overlap
        ) -> None:
            """``worker`` sends ``events``; the overlaps of the shared prompt are then these."""
            worker.send(events)
            worker.sync()
            observe(harness, index, a.tokens, native=native, correct=correct)

        # B extends with blocks 3-5, parent = B's own hash of block 2.
        # Correct: B holds 6. Dynamo: "Failed to find parent block; skipping store operation",
        # B stays at 3.
        then(
            wb,
            [b.stored(3, 6)],
            native={(1, 0): (3, 3, 3), (2, 0): (3, 3, 3)},
            correct={(1, 0): (3, 3, 3), (2, 0): (6, 6, 6)},
        )
        # B evicts 5, 4, 3, 2 (tail first, by its own hashes).
        # Correct: B holds 0-1 -> 2. Dynamo: B's removals hit nothing, B stale at 3.
        then(
            wb,
            b.evicted(5, 4, 3, 2),
            native={(1, 0): (3, 3, 3), (2, 0): (3, 3, 3)},
            correct={(1, 0): (3, 3, 3), (2, 0): (2, 2, 2)},
        )
        # A evicts its block 2.
        # Correct: A 2, B 2. Dynamo: A 2, B still stale at 3.
        then(
            wa,
            a.evicted(2),
            native={(1, 0): (2, 2, 2), (2, 0): (3, 3, 3)},
            correct={(1, 0): (2, 2, 2), (2, 0): (2, 2, 2)},
        )
        assert wa.normalizer.stats == Counter()
        assert wb.normalizer.stats == Counter()


def test_chunked_cpu_offload_reannounces_shared_hashes(harness: SelectionHarness) -> None:
    """Self-describing CPU chunks that overlap a shared prefix re-announce the shared hashes
    once per chunk (vllm-kv-events.md 9.1, 11). Dynamo does not reference-count: one chunk's
    removal takes the shared blocks away although the other chunk still holds them."""
    index = TieredIndex(BS)
    chains = families(BS)
    p0, p1 = chains["P0"], chains["P1"]
    assert p0.hashes[:4] == p1.hashes[:4]  # P0 and P1 share blocks 0-3
    with WorkerStream(harness, index, 1, BS) as w1:
        # CPU only: chunk Z = blocks 0-1; chunk X = P0's 2-5 and chunk Y = P1's 2-5, both
        # chained to block 1, both carrying the shared blocks 2-3.
        w1.send([p0.stored(0, 2, medium="CPU")])
        w1.send([p0.stored(2, 6, medium="CPU"), p1.stored(2, 6, medium="CPU")])
        w1.sync()
        for chain in (p0, p1):
            both = {(1, 0): (0, 6, 6)}
            assert harness.overlap(chain.tokens[: 6 * BS]) == both
            assert kvbridge_overlap(index, chain.tokens[: 6 * BS]) == both
        # Chunk X leaves the CPU (one removal with its four hashes).
        w1.send([p0.removed(2, 3, 4, 5)])
        w1.sync()
        # Correct: P0 keeps 0-3 (2-3 still held by chunk Y) -> 4; P1 keeps all 6.
        # Dynamo: blocks 2-3 are gone -> 2 for both prompts.
        observe(harness, index, p0.tokens, native={(1, 0): (0, 2, 2)}, correct={(1, 0): (0, 4, 4)})
        observe(harness, index, p1.tokens, native={(1, 0): (0, 2, 2)}, correct={(1, 0): (0, 6, 6)})
        assert w1.normalizer.stats == Counter(
            {DropReason.DUPLICATE_STORE: 2, DropReason.STILL_REFERENCED: 2}
        )


def test_raw_vllm_cache_salt(harness: SelectionHarness) -> None:
    """vLLM publishes the raw salt untagged in the first block's extra_keys ([["tenantA"], None,
    ...]). Dynamo reads a salt there only with the "dynamo-cache-salt:" prefix, so it indexes the
    blocks unsalted: a salted query misses, an unsalted one wrongly hits."""
    index = TieredIndex(BS)
    tokens = families(BS)["P0"].tokens
    salted = Chain(tokens, BS, cache_salt="tenantA")
    with WorkerStream(harness, index, 1, BS) as w1:
        w1.send([salted.stored(0, 4)])
        assert salted.stored(0, 4).extra_keys == [["tenantA"], None, None, None]
        w1.sync()
        observe(
            harness,
            index,
            tokens,
            native={},
            correct={(1, 0): (4, 4, 4)},
            cache_salt="tenantA",
        )
        observe(harness, index, tokens, native={(1, 0): (4, 4, 4)}, correct={})
        assert w1.normalizer.stats == Counter()
