"""The test kit users put in their CI: ``kvbridge.testing`` and its pytest plugin.

Written the way a user writes tests: only the plugin's fixtures (``vllm_publisher``,
``kv_index``, the ``kvbridge_engine`` marker), public names of ``kvbridge`` and
``kvbridge.testing``, and plain ZMQ / msgpack to look at the wire.

The expected event sequences follow vLLM's block pool (facts: vllm-kv-events.md sections 4, 5, 6,
9, 11; vllm-on-cpu.md sections 6-7). The free queue is one LRU list: unused blocks first, in id
order, then freed blocks in the order they were freed. A request frees its blocks tail first.
The comments trace the queue as ``[block id (content), ...]``.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from itertools import pairwise
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from kvbridge import Overlap
from kvbridge.schemas.vllm import STORED_FIELDS
from kvbridge.testing import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    SimulatedEngine,
    SyncedIndex,
)
from kvbridge.testing.events import placeholder, removed, stored

RECV_MS = 2000


def gpu_stored(hashes: list[Any], parent: Any, tokens: list[int], block_size: int) -> BlockStored:
    """A GPU BlockStored as vLLM 0.32.0 publishes it."""
    return stored(hashes, tokens, parent=parent, block_size=block_size)


def gpu_removed(block_hash: Any) -> BlockRemoved:
    """The BlockRemoved vLLM's GPU pool sends for one evicted block."""
    return removed([block_hash])


def cpu_placeholder(block_hash: Any) -> BlockStored:
    """The OffloadingConnector's CPU store of one block (no tokens)."""
    return placeholder([block_hash])


def events(engine: SimulatedEngine, start: int = 0) -> list[list[Any]]:
    """The events of each batch published from seq ``start`` on."""
    return [batch.events for batch in engine.published[start:]]


def seq_range(first: int, count: int) -> list[int]:
    return list(range(first, first + count))


# --------------------------------------------------------------------------- the engine's events


@pytest.mark.kvbridge_engine(block_size=4)
def test_prefill_publishes_one_store_and_never_the_partial_block(vllm_publisher):
    prompt = seq_range(1, 10)  # two full blocks and two tokens
    done = vllm_publisher.generate(prompt)
    hashes = vllm_publisher.block_hashes(prompt)
    assert len(hashes) == 2
    assert events(vllm_publisher) == [[gpu_stored(hashes, None, prompt[:8], 4)]]
    assert vllm_publisher.published[0].data_parallel_rank == 0
    assert vllm_publisher.last_seq == 0
    assert done.num_cached_tokens == 0
    assert vllm_publisher.resident_hashes() == hashes[::-1]  # freed tail first


@pytest.mark.kvbridge_engine(block_size=4)
def test_hits_publish_nothing_and_a_shared_prefix_stores_only_new_blocks(vllm_publisher):
    prompt = seq_range(1, 10)
    vllm_publisher.generate(prompt)
    again = vllm_publisher.generate(prompt)
    assert again.num_cached_tokens == 8
    assert len(vllm_publisher.published) == 1  # hits publish nothing

    longer = prompt[:8] + seq_range(50, 9)  # 17 tokens: two shared blocks, two new, one token
    done = vllm_publisher.generate(longer)
    assert done.num_cached_tokens == 8
    new = vllm_publisher.block_hashes(longer)
    assert new[:2] == vllm_publisher.block_hashes(prompt)
    assert events(vllm_publisher, 1) == [[gpu_stored(new[2:], new[1], longer[8:16], 4)]]


@pytest.mark.kvbridge_engine(block_size=4, num_blocks=4)
def test_a_fully_cached_prompt_recomputes_and_restores_its_last_block(vllm_publisher):
    """vLLM always computes the last prompt token, so a block-aligned prompt that is fully cached
    hits all but its last block, which goes into a second GPU block and is published again. Each
    copy's eviction publishes its own BlockRemoved."""
    prompt = seq_range(1, 8)
    h0, h1 = vllm_publisher.block_hashes(prompt)
    vllm_publisher.generate(prompt)  # blocks 0, 1; free queue [2, 3, 1 (h1), 0 (h0)]
    again = vllm_publisher.generate(prompt)  # hit 0; new block 2 (h1); free [3, 1 (h1), 2 (h1), 0]
    assert again.num_cached_tokens == 4
    assert events(vllm_publisher, 1) == [[gpu_stored([h1], h0, prompt[4:], 4)]]
    assert vllm_publisher.resident_hashes() == [h1, h0]

    other = seq_range(100, 16)  # four blocks: takes 3, 1, 2, 0
    vllm_publisher.generate(other)
    assert events(vllm_publisher, 2) == [
        [
            gpu_removed(h1),
            gpu_removed(h1),
            gpu_removed(h0),
            gpu_stored(vllm_publisher.block_hashes(other), None, other, 4),
        ]
    ]


@pytest.mark.kvbridge_engine(block_size=4, num_blocks=6)
def test_evictions_take_the_least_recently_used_blocks_tail_first(vllm_publisher):
    a, b, c = seq_range(1, 9), seq_range(101, 9), seq_range(201, 13)
    ha, hb, hc = (vllm_publisher.block_hashes(tokens) for tokens in (a, b, c))
    vllm_publisher.generate(a)  # blocks 0-2; free [3, 4, 5, 2, 1 (a1), 0 (a0)]
    vllm_publisher.generate(b)  # blocks 3-5; free [2, 1 (a1), 0 (a0), 5, 4 (b1), 3 (b0)]
    vllm_publisher.generate(a)  # hits 0, 1, takes 2: free [5, 4 (b1), 3 (b0), 2, 1 (a1), 0 (a0)]
    assert len(vllm_publisher.published) == 2
    assert vllm_publisher.resident_hashes() == [hb[1], hb[0], ha[1], ha[0]]

    vllm_publisher.generate(c)  # four blocks: 5, 4 (b1), 3 (b0), 2
    assert events(vllm_publisher, 2) == [
        [gpu_removed(hb[1]), gpu_removed(hb[0]), gpu_stored(hc, None, c[:12], 4)]
    ]
    assert vllm_publisher.resident_hashes() == [ha[1], ha[0], hc[2], hc[1], hc[0]]


@pytest.mark.kvbridge_engine(block_size=4)
def test_decode_blocks_are_published_but_not_the_last_generated_token(vllm_publisher):
    prompt = seq_range(1, 6)
    done = vllm_publisher.generate(prompt, max_tokens=6)
    assert done.output_token_ids == [SimulatedEngine.output_token(p) for p in range(6, 12)]
    sequence = done.token_ids  # 12 tokens; the last one is generated but never computed
    hashes = vllm_publisher.block_hashes(sequence)
    assert len(hashes) == 3
    # The prefill stores block 0; the decode step that computes token 7 stores block 1.
    assert events(vllm_publisher) == [
        [gpu_stored(hashes[:1], None, sequence[:4], 4)],
        [gpu_stored(hashes[1:2], hashes[0], sequence[4:8], 4)],
    ]
    assert set(vllm_publisher.resident_hashes()) == set(hashes[:2])


@pytest.mark.kvbridge_engine(block_size=4, max_num_batched_tokens=8)
def test_chunked_prefill_publishes_one_store_per_chunk(vllm_publisher):
    prompt = seq_range(1, 18)
    hashes = vllm_publisher.block_hashes(prompt)
    vllm_publisher.generate(prompt)
    assert events(vllm_publisher) == [
        [gpu_stored(hashes[:2], None, prompt[:8], 4)],
        [gpu_stored(hashes[2:], hashes[1], prompt[8:16], 4)],
    ]


@pytest.mark.kvbridge_engine(block_size=4)
def test_reset_is_published_with_the_next_step(vllm_publisher):
    prompt = seq_range(1, 9)
    hashes = vllm_publisher.block_hashes(prompt)
    vllm_publisher.generate(prompt)
    assert vllm_publisher.reset_prefix_cache()
    assert len(vllm_publisher.published) == 1  # queued, like vLLM
    assert vllm_publisher.resident_hashes() == []
    assert vllm_publisher.step() is not None
    assert events(vllm_publisher, 1) == [[AllBlocksCleared()]]
    assert vllm_publisher.step() is None

    vllm_publisher.reset_prefix_cache()
    done = vllm_publisher.generate(prompt)  # nothing cached: everything is stored again
    assert done.num_cached_tokens == 0
    assert events(vllm_publisher, 2) == [
        [AllBlocksCleared(), gpu_stored(hashes, None, prompt[:8], 4)]
    ]


@pytest.mark.kvbridge_engine(block_size=4)
def test_restart_starts_over(vllm_publisher):
    prompt = seq_range(1, 9)
    vllm_publisher.generate(prompt)
    vllm_publisher.generate(seq_range(50, 9))
    total = vllm_publisher.total_published
    vllm_publisher.restart()
    assert vllm_publisher.published == []
    assert vllm_publisher.last_seq is None
    assert vllm_publisher.resident_hashes() == []
    done = vllm_publisher.generate(prompt)
    assert done.num_cached_tokens == 0
    assert vllm_publisher.last_seq == 0
    assert vllm_publisher.total_published == total + 1


@pytest.mark.kvbridge_engine(block_size=4, num_blocks=4)
def test_a_request_larger_than_the_pool_is_refused(vllm_publisher):
    with pytest.raises(ValueError, match="needs 5 blocks"):
        vllm_publisher.generate(seq_range(1, 17))
    with pytest.raises(ValueError, match="needs 5 blocks"):
        vllm_publisher.generate(seq_range(1, 14), max_tokens=4)
    with pytest.raises(ValueError, match="token ids"):
        vllm_publisher.generate([1, -2])
    assert vllm_publisher.published == []


def test_a_closed_engine_refuses_requests():
    engine = SimulatedEngine(replay_endpoint=None)
    engine.close()
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.generate([1, 2, 3])


# --------------------------------------------------------------------------- the CPU tier


@pytest.mark.kvbridge_engine(block_size=4, cpu_blocks=4)
def test_cpu_placeholders_follow_the_gpu_store_in_the_next_batch(vllm_publisher):
    prompt = seq_range(1, 9)
    h0, h1 = vllm_publisher.block_hashes(prompt)
    vllm_publisher.generate(prompt)
    assert events(vllm_publisher) == [
        [gpu_stored([h0, h1], None, prompt[:8], 4)],
        [cpu_placeholder(h0), cpu_placeholder(h1)],
    ]
    assert vllm_publisher.resident_hashes("CPU") == [h1, h0]  # block 0 most recently used

    vllm_publisher.generate(prompt)  # GPU hits; already offloaded, so not offloaded again
    assert len(vllm_publisher.published) == 2


@pytest.mark.kvbridge_engine(block_size=4, cpu_blocks=4, self_describing=True)
def test_self_describing_cpu_stores_carry_tokens_and_parent(vllm_publisher):
    prompt = seq_range(1, 9)
    h0, h1 = vllm_publisher.block_hashes(prompt)
    vllm_publisher.generate(prompt)

    def cpu_stored(block_hash: int, parent: int | None, tokens: list[int]) -> BlockStored:
        return BlockStored(
            [block_hash],
            parent,
            tokens,
            4,
            None,
            medium="CPU",
            lora_name=None,
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        )

    assert events(vllm_publisher, 1) == [
        [cpu_stored(h0, None, prompt[:4]), cpu_stored(h1, h0, prompt[4:8])]
    ]


@pytest.mark.kvbridge_engine(block_size=4, num_blocks=8, cpu_blocks=2)
def test_cpu_evictions_are_one_batched_removal_in_lru_order(vllm_publisher):
    a, b = seq_range(1, 9), seq_range(101, 9)
    ha, hb = vllm_publisher.block_hashes(a), vllm_publisher.block_hashes(b)
    vllm_publisher.generate(a)  # CPU [a1, a0]
    vllm_publisher.generate(b)
    assert events(vllm_publisher, 2) == [
        [
            gpu_stored(hb, None, b[:8], 4),
            BlockRemoved([ha[1], ha[0]], medium="CPU", group_idx=0),
        ],
        [cpu_placeholder(hb[0]), cpu_placeholder(hb[1])],
    ]
    assert vllm_publisher.resident_hashes("CPU") == [hb[1], hb[0]]


@pytest.mark.kvbridge_engine(block_size=4, num_blocks=3, cpu_blocks=8)
def test_a_gpu_miss_loads_from_the_cpu_tier(vllm_publisher):
    a, b = seq_range(1, 9), seq_range(101, 9)
    ha, hb = vllm_publisher.block_hashes(a), vllm_publisher.block_hashes(b)
    vllm_publisher.generate(a)  # blocks 0-2; free [2, 1 (a1), 0 (a0)]
    vllm_publisher.generate(b)  # evicts a1, a0; free [0, 1 (b1), 2 (b0)]
    assert events(vllm_publisher, 2)[0][:2] == [gpu_removed(ha[1]), gpu_removed(ha[0])]

    done = vllm_publisher.generate(a)
    assert (done.num_cached_tokens, done.num_external_tokens) == (0, 8)
    # One step allocates the blocks to load into (evicting b1). The next caches the loaded
    # blocks, then allocates for the last token (evicting b0). Nothing is offloaded again.
    assert events(vllm_publisher, 4) == [
        [gpu_removed(hb[1])],
        [gpu_stored(ha, None, a[:8], 4), gpu_removed(hb[0])],
    ]


@pytest.mark.kvbridge_engine(block_size=4, cpu_blocks=4)
def test_a_gpu_reset_leaves_the_cpu_tier_alone_unless_external(vllm_publisher):
    prompt = seq_range(1, 9)
    vllm_publisher.generate(prompt)
    vllm_publisher.reset_prefix_cache()
    assert len(vllm_publisher.resident_hashes("CPU")) == 2
    vllm_publisher.reset_prefix_cache(reset_external=True)
    assert vllm_publisher.resident_hashes("CPU") == []
    vllm_publisher.step()
    assert events(vllm_publisher, 2) == [[AllBlocksCleared(), AllBlocksCleared()]]


# --------------------------------------------------------------------------- hashes


def test_hashes_are_vllms_sha256_chain():
    """vllm-kv-events.md 7.4: block size 16, tokens 1..16 then 17..32, seed "vllm-none-hash"."""
    with SimulatedEngine(block_size=16, replay_endpoint=None) as engine:
        assert engine.block_hashes(range(1, 33)) == [1403909460543360175, 1643945449041937783]


def test_hashes_are_deterministic_and_salted_per_engine():
    tokens = seq_range(1, 64)
    with (
        SimulatedEngine(replay_endpoint=None) as first,
        SimulatedEngine(replay_endpoint=None) as second,
        SimulatedEngine(replay_endpoint=None, hash_seed=b"worker-b") as salted,
        SimulatedEngine(replay_endpoint=None, hash_seed=b"worker-b") as salted_too,
    ):
        assert first.block_hashes(tokens) == second.block_hashes(tokens)
        assert salted.block_hashes(tokens) == salted_too.block_hashes(tokens)
        assert not set(salted.block_hashes(tokens)) & set(first.block_hashes(tokens))
        assert all(0 <= h < 2**64 for h in first.block_hashes(tokens))


@pytest.mark.kvbridge_engine(block_size=4, bytes_hashes=True)
def test_bytes_hashes_are_the_digests(vllm_publisher):
    prompt = seq_range(1, 9)
    vllm_publisher.generate(prompt)
    (stored,) = vllm_publisher.published[0].events
    assert all(isinstance(h, bytes) and len(h) == 32 for h in stored.block_hashes)
    with SimulatedEngine(block_size=4, replay_endpoint=None) as ints:
        assert [int.from_bytes(h[-8:], "big") for h in stored.block_hashes] == ints.block_hashes(
            prompt
        )


# --------------------------------------------------------------------------- the wire


def _subscribe(engine: SimulatedEngine) -> zmq.Socket[bytes]:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVTIMEO, RECV_MS)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(engine.endpoint)
    assert engine.wait_for_subscribers()
    return sub


@pytest.mark.kvbridge_engine(block_size=4, release="0.22.0", cpu_blocks=4, topic="kv-events")
def test_release_0_22_encodes_array_events(vllm_publisher):
    sub = _subscribe(vllm_publisher)
    try:
        prompt = seq_range(1, 9)
        vllm_publisher.generate(prompt)
        frames = [sub.recv_multipart() for _ in range(2)]
    finally:
        sub.close()
    assert [(topic, seq) for topic, seq, _ in frames] == [
        (b"kv-events", (0).to_bytes(8, "big")),
        (b"kv-events", (1).to_bytes(8, "big")),
    ]
    (ts, gpu_events, rank), (_, cpu_events, _) = (
        msgspec.msgpack.decode(payload) for _, _, payload in frames
    )
    assert isinstance(ts, float) and rank == 0
    hashes = vllm_publisher.block_hashes(prompt)
    assert gpu_events == [
        ["BlockStored", hashes, None, prompt[:8], 4, None, "GPU", None, [None, None], 0,
         "full_attention", None]
    ]  # fmt: skip
    # 0.20-0.23 OffloadingConnector placeholders: raw digest bytes, block_size 0, no group_idx.
    assert [event[0] for event in cpu_events] == ["BlockStored", "BlockStored"]
    assert all(len(event) == 12 and event[4] == 0 and event[9] is None for event in cpu_events)
    assert [int.from_bytes(event[1][0][-8:], "big") for event in cpu_events] == hashes


@pytest.mark.kvbridge_engine(block_size=4)
def test_release_0_32_encodes_map_events(vllm_publisher):
    sub = _subscribe(vllm_publisher)
    try:
        vllm_publisher.generate(seq_range(1, 9))
        _, _, payload = sub.recv_multipart()
    finally:
        sub.close()
    _, (event,), _ = msgspec.msgpack.decode(payload)
    # Every field up to kv_cache_spec_kind, the last one the engine sets (nil ones are omitted).
    last = STORED_FIELDS.index("kv_cache_spec_kind")
    assert list(event) == ["type", *STORED_FIELDS[: last + 1]]


@pytest.mark.kvbridge_engine(block_size=4, topic="kv")
def test_replay_socket_serves_every_batch(vllm_publisher):
    vllm_publisher.generate(seq_range(1, 9))
    vllm_publisher.generate(seq_range(101, 9))
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVTIMEO, RECV_MS)
    dealer.connect(vllm_publisher.replay_endpoint)
    try:
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replies = [dealer.recv_multipart() for _ in range(3)]
    finally:
        dealer.close()
    assert [reply[:3] for reply in replies[:2]] == [
        [b"", b"kv", (0).to_bytes(8, "big")],
        [b"", b"kv", (1).to_bytes(8, "big")],
    ]
    assert replies[2] == [b"", b"", b"\xff" * 8, b""]


@pytest.mark.kvbridge_engine(block_size=4, dp_rank=2)
def test_batches_carry_the_dp_rank(vllm_publisher, kv_index):
    prompt = seq_range(1, 9)
    vllm_publisher.generate(prompt)
    assert vllm_publisher.published[0].data_parallel_rank == 2
    assert kv_index.overlap(prompt) == {(0, 2): Overlap(2, 2, 2)}


# --------------------------------------------------------------------------- the index


@pytest.mark.kvbridge_engine(block_size=4)
def test_shared_prefixes_give_exact_overlaps(vllm_publisher, kv_index):
    a = seq_range(1, 13)  # three blocks and a token
    b = a[:8] + seq_range(500, 5)  # shares two blocks
    vllm_publisher.generate(a)
    vllm_publisher.generate(b)
    assert kv_index.engine_overlap(a) == Overlap(3, 3, 3)
    assert kv_index.engine_overlap(b) == Overlap(3, 3, 3)
    assert kv_index.engine_overlap(a[:8] + [999] * 8) == Overlap(2, 2, 2)
    assert kv_index.engine_overlap(a[:7]) == Overlap(1, 1, 1)
    assert kv_index.engine_overlap(seq_range(700, 16)) == Overlap()
    assert kv_index.workers() == [(0, 0)]


@pytest.mark.kvbridge_engine(block_size=4, num_blocks=6)
def test_an_eviction_drops_exactly_the_evicted_blocks(vllm_publisher, kv_index):
    a, b, c = seq_range(1, 9), seq_range(101, 9), seq_range(201, 13)
    vllm_publisher.generate(a)
    vllm_publisher.generate(b)
    vllm_publisher.generate(a)  # touches a
    assert kv_index.engine_overlap(b).device == 2
    vllm_publisher.generate(c)  # evicts b1, then b0
    assert kv_index.engine_overlap(b) == Overlap()
    assert kv_index.engine_overlap(a).device == 2
    assert kv_index.engine_overlap(c).device == 3


@pytest.mark.kvbridge_engine(block_size=4, num_blocks=4)
def test_a_partial_eviction_keeps_the_leading_blocks(vllm_publisher, kv_index):
    a, b = seq_range(1, 13), seq_range(101, 5)  # a: blocks 0-3; free [3, 2 (a2), 1 (a1), 0 (a0)]
    vllm_publisher.generate(a)
    vllm_publisher.generate(b)  # two blocks: 3, then 2 (a2)
    assert kv_index.engine_overlap(a).device == 2


@pytest.mark.kvbridge_engine(block_size=4, num_blocks=4)
def test_evicting_one_of_two_gpu_copies_keeps_the_block(vllm_publisher, kv_index):
    prompt = seq_range(1, 8)
    vllm_publisher.generate(prompt)
    vllm_publisher.generate(prompt)  # h1 now in blocks 1 and 2; free [3, 1 (h1), 2 (h1), 0 (h0)]
    vllm_publisher.generate(seq_range(100, 5))  # takes 3, then 1: one copy of h1 goes
    assert events(vllm_publisher, 2)[0][0] == gpu_removed(vllm_publisher.block_hashes(prompt)[1])
    assert kv_index.engine_overlap(prompt) == Overlap(2, 2, 2)


@pytest.mark.parametrize("self_describing", [False, True])
def test_the_cpu_tier_gives_exact_host_pinned_overlaps(self_describing):
    with (
        SimulatedEngine(
            block_size=4, num_blocks=3, cpu_blocks=8, self_describing=self_describing
        ) as engine,
        SyncedIndex(engine) as index,
    ):
        a, b = seq_range(1, 9), seq_range(101, 9)
        engine.generate(a)
        assert index.engine_overlap(a) == Overlap(2, 2, 2)
        engine.generate(b)  # evicts a from the GPU; both stay on the CPU
        assert index.engine_overlap(a) == Overlap(device=0, host_pinned=2, disk=2)
        assert index.engine_overlap(b) == Overlap(2, 2, 2)
        engine.generate(a)  # loaded back from the CPU, evicting b from the GPU
        assert index.engine_overlap(a) == Overlap(2, 2, 2)
        assert index.engine_overlap(b) == Overlap(0, 2, 2)
        assert index.relay.workers[0].normalizer.stats == {}


@pytest.mark.kvbridge_engine(
    block_size=4, num_blocks=9, cpu_blocks=16, self_describing=True, cpu_store_seed=3
)
def test_cpu_stores_in_vllms_arbitrary_order_still_index(vllm_publisher, kv_index):
    """A real engine publishes a step's CPU stores in set order (a child can precede its parent,
    as in the 0.32.0 offload recording); the index must still attach every block."""
    a, b = seq_range(1, 33), seq_range(101, 33)  # eight blocks and a token each
    vllm_publisher.generate(a)
    order = [event.block_hashes[0] for event in vllm_publisher.published[1].events]
    hashes = vllm_publisher.block_hashes(a)
    assert sorted(order) == sorted(hashes)
    position = {block_hash: index for index, block_hash in enumerate(order)}
    assert any(position[child] < position[parent] for parent, child in pairwise(hashes))
    vllm_publisher.generate(b)  # evicts all of a from the GPU
    assert kv_index.engine_overlap(a) == Overlap(device=0, host_pinned=8, disk=8)


@pytest.mark.kvbridge_engine(block_size=4, cpu_blocks=8)
def test_a_reset_brings_every_overlap_to_zero(vllm_publisher, kv_index):
    prompt = seq_range(1, 9)
    vllm_publisher.generate(prompt)
    assert kv_index.engine_overlap(prompt) == Overlap(2, 2, 2)
    vllm_publisher.reset_prefix_cache()
    assert kv_index.engine_overlap(prompt) == Overlap(2, 2, 2)  # not published yet
    vllm_publisher.step()
    assert kv_index.engine_overlap(prompt) == Overlap()
    assert kv_index.workers() == []


@pytest.mark.kvbridge_engine(block_size=4)
def test_an_engine_restart_clears_the_worker(vllm_publisher, kv_index):
    a, b = seq_range(1, 9), seq_range(101, 9)
    vllm_publisher.generate(a)
    assert kv_index.engine_overlap(a).device == 2
    vllm_publisher.restart()
    vllm_publisher.generate(b)
    assert kv_index.engine_overlap(a) == Overlap()
    assert kv_index.engine_overlap(b).device == 2


def test_engines_that_disagree_on_hashes_agree_in_the_index():
    prompt = seq_range(1, 13)
    with (
        SimulatedEngine(block_size=4) as first,
        SimulatedEngine(block_size=4, hash_seed=b"other") as second,
        SyncedIndex([first, second], worker_ids=[7, 8]) as index,
    ):
        first.generate(prompt)
        second.generate(prompt[:8] + [0] * 5)
        assert first.block_hashes(prompt)[:2] != second.block_hashes(prompt)[:2]
        assert index.overlap(prompt) == {(7, 0): Overlap(3, 3, 3), (8, 0): Overlap(2, 2, 2)}
        assert index.engine_overlap(prompt, second) == Overlap(2, 2, 2)


def test_two_ranks_of_one_worker():
    prompt = seq_range(1, 9)
    with (
        SimulatedEngine(block_size=4, dp_rank=0) as rank0,
        SimulatedEngine(block_size=4, dp_rank=1) as rank1,
        SyncedIndex([rank0, rank1], worker_ids=[3, 3]) as index,
    ):
        rank1.generate(prompt)
        assert index.overlap(prompt) == {(3, 1): Overlap(2, 2, 2)}


@pytest.mark.kvbridge_engine(block_size=4)
def test_sync_hands_over_a_quiet_index(vllm_publisher, kv_index):
    for start in range(0, 200, 10):
        vllm_publisher.generate(seq_range(start, 9))
    index = kv_index.sync(timeout=5)
    assert index is kv_index
    assert index.relay.stats.batches_in == vllm_publisher.total_published == 20


# --------------------------------------------------------------------------- the plugin


def test_the_plugin_is_registered_by_its_entry_point(pytestconfig, vllm_publisher):
    assert pytestconfig.pluginmanager.hasplugin("kvbridge")
    assert vllm_publisher.block_size == 16
    assert vllm_publisher.endpoint.startswith("tcp://127.0.0.1:")
    assert vllm_publisher.replay_endpoint.startswith("tcp://127.0.0.1:")
    assert vllm_publisher.release == "0.32.0"


@pytest.mark.kvbridge_engine(num_blocks=8, block_size=32)
class TestMarkers:
    def test_a_class_marker_applies(self, vllm_publisher):
        assert (vllm_publisher.block_size, vllm_publisher.num_blocks) == (32, 8)

    @pytest.mark.kvbridge_engine(block_size=8)
    def test_the_innermost_marker_wins(self, vllm_publisher):
        assert (vllm_publisher.block_size, vllm_publisher.num_blocks) == (8, 8)


class TestOptionsFixture:
    @pytest.fixture
    def kvbridge_engine_options(self):
        return {"cpu_blocks": 4, "topic": "kv"}

    def test_an_options_override_applies(self, vllm_publisher):
        assert (vllm_publisher.cpu_blocks, vllm_publisher.topic) == (4, "kv")


@pytest.mark.parametrize(
    "vllm_publisher", [{"release": "0.22.0"}, {"release": "0.33.0"}], indirect=True
)
def test_indirect_parametrization(vllm_publisher, kv_index):
    prompt = seq_range(1, 40)
    vllm_publisher.generate(prompt)
    assert kv_index.engine_overlap(prompt).device == 2


def test_a_users_suite_gets_the_fixtures_without_a_conftest(tmp_path: Path):
    (tmp_path / "test_user.py").write_text(
        textwrap.dedent(
            """
            import pytest

            @pytest.mark.kvbridge_engine(block_size=32, cpu_blocks=8)
            def test_prefix(vllm_publisher, kv_index):
                prompt = list(range(100))
                vllm_publisher.generate(prompt)
                assert kv_index.engine_overlap(prompt).host_pinned == 3
            """
        )
    )
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout
