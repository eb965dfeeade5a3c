"""A deterministic stand-in for a vLLM engine's KV-event stream, plus helpers to index it.

:class:`Engine` simulates a GPU prefix cache with a CPU offload tier and emits what vLLM 0.32.0
would publish for it, one batch per step (``encode_batch`` in the 0.32.0 layout): stores of the
blocks a request newly caches, one GPU ``BlockRemoved`` per evicted hash, batched CPU stores and
removals, and optionally an ``AllBlocksCleared``. Requests share system prefixes, so blocks are
re-used, and both tiers are small, so they evict. Each tier is kept prefix-closed (only leaves
are evicted), which is how a block pool behaves and keeps every store a chain under a resident
parent.

:func:`index_of` builds the lossless reference: every payload decoded, normalised and indexed
by the relay's :class:`~kvbridge.adapters.pipeline.StreamPipeline`, without any socket in
between.
"""

from __future__ import annotations

import hashlib
import json
import random
import socket
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from kvbridge import TieredIndex, VllmBatch
from kvbridge.adapters.pipeline import IndexSink, StreamPipeline
from kvbridge.adapters.zmq import Source
from kvbridge.schemas.vllm import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    encode_batch,
    layout_for,
)

__all__ = [
    "LAYOUT",
    "Engine",
    "block_hash",
    "chain",
    "dump_rows",
    "free_port",
    "index_of",
    "overlaps",
    "removed",
    "stored",
    "vllm_batch",
    "wait_until",
]

LAYOUT = layout_for("0.32.0")
TS0 = 1_700_000_000.0


def block_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """An engine-side block hash: the low 64 bits of a SHA-256 over parent and tokens."""
    data = (parent or 0).to_bytes(8, "big") + b"".join(t.to_bytes(4, "big") for t in tokens)
    return int.from_bytes(hashlib.sha256(data).digest()[-8:], "big")


def chain(tokens: Sequence[int], block_size: int) -> list[int]:
    """The engine hashes of every full block of ``tokens``."""
    hashes: list[int] = []
    parent: int | None = None
    for start in range(0, len(tokens) - len(tokens) % block_size, block_size):
        parent = block_hash(parent, tokens[start : start + block_size])
        hashes.append(parent)
    return hashes


def stored(
    hashes: Sequence[int | bytes],
    tokens: list[int],
    *,
    parent: int | None = None,
    medium: str = "GPU",
    block_size: int = 4,
) -> BlockStored:
    return BlockStored(
        list(hashes),
        parent,
        tokens,
        block_size,
        None,
        medium,
        None,
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    )


def removed(hashes: Sequence[int | bytes], *, medium: str = "GPU") -> BlockRemoved:
    return BlockRemoved(list(hashes), medium, group_idx=0)


def vllm_batch(events: Sequence[Event], step: int = 0) -> bytes:
    """One vLLM 0.32.0 payload ``[ts, events, dp_rank=0]``."""
    return encode_batch(VllmBatch(TS0 + step, list(events), 0), LAYOUT)


def prompt_blocks(prompt: Sequence[int], block_size: int) -> list[list[int]]:
    return [
        list(prompt[start : start + block_size])
        for start in range(0, len(prompt) - len(prompt) % block_size, block_size)
    ]


class _Tier:
    """One prefix-closed LRU cache of blocks: hash -> (parent hash, tokens)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[int, int | None] = OrderedDict()
        self.children: dict[int, int] = {}

    def __contains__(self, block: int) -> bool:
        return block in self.blocks

    def touch(self, block: int) -> None:
        self.blocks.move_to_end(block)

    def add(self, block: int, parent: int | None) -> None:
        self.blocks[block] = parent
        if parent is not None:
            self.children[parent] = self.children.get(parent, 0) + 1

    def evict(self, keep: set[int]) -> list[int]:
        """Evict least recently used leaves (never one in ``keep``) down to capacity."""
        gone: list[int] = []
        while len(self.blocks) > self.capacity:
            victim = next(
                (b for b in self.blocks if not self.children.get(b) and b not in keep), None
            )
            if victim is None:
                break
            parent = self.blocks.pop(victim)
            if parent is not None:
                self.children[parent] -= 1
            gone.append(victim)
        return gone

    def clear(self) -> None:
        self.blocks.clear()
        self.children.clear()


class Engine:
    """A seeded simulation of one vLLM engine (dp rank 0) with GPU and CPU tiers.

    Every :meth:`step` serves one or more requests and returns the non-empty event list of one
    engine step. :attr:`prompts` holds every distinct prompt served, for overlap queries.
    """

    def __init__(
        self,
        seed: int,
        *,
        block_size: int = 4,
        gpu_blocks: int = 24,
        cpu_blocks: int = 32,
        offload_every: int = 3,
        clear_at: int | None = None,
    ) -> None:
        self.rng = random.Random(seed)
        self.block_size = block_size
        self.gpu = _Tier(gpu_blocks)
        self.cpu = _Tier(cpu_blocks)
        self.offload_every = offload_every
        self.clear_at = clear_at
        self.steps = 0
        self.prompts: list[list[int]] = []
        self._seen: set[tuple[int, ...]] = set()
        size = block_size
        # Six system prompts of 1-4 blocks, each with eight possible user turns of 1-3 blocks.
        self._prefixes = [
            [1000 * (p + 1) + t for t in range(size * self.rng.randint(1, 4))] for p in range(6)
        ]
        self._suffixes = [
            [
                [self.rng.randrange(1, 500) for _ in range(size * self.rng.randint(1, 3))]
                for _ in range(8)
            ]
            for _ in range(6)
        ]

    def _request(self) -> list[int]:
        p = self.rng.randrange(len(self._prefixes))
        prompt = self._prefixes[p] + self.rng.choice(self._suffixes[p])
        if self.rng.random() < 0.3:  # a longer conversation: two user turns
            prompt = prompt + self.rng.choice(self._suffixes[p])
        if tuple(prompt) not in self._seen:
            self._seen.add(tuple(prompt))
            self.prompts.append(prompt)
        return prompt

    def _serve(self, prompt: list[int], events: list[Event]) -> None:
        hashes = chain(prompt, self.block_size)
        blocks = prompt_blocks(prompt, self.block_size)
        cached = 0
        while cached < len(hashes) and hashes[cached] in self.gpu:
            self.gpu.touch(hashes[cached])
            cached += 1
        if cached < len(hashes):
            parent = hashes[cached - 1] if cached else None
            new = hashes[cached:]
            for index, block in enumerate(new):
                self.gpu.add(block, hashes[cached + index - 1] if cached + index else None)
            tokens = [t for block in blocks[cached:] for t in block]
            events.append(stored(new, tokens, parent=parent, block_size=self.block_size))
        # One BlockRemoved per evicted GPU hash, as vLLM's block pool sends them.
        for victim in self.gpu.evict(keep=set(hashes)):
            events.append(removed([victim]))
        if self.steps % self.offload_every == 0:
            self._offload(hashes, blocks, events)

    def _offload(self, hashes: list[int], blocks: list[list[int]], events: list[Event]) -> None:
        """Copy the request's blocks to the CPU (self-describing stores), evict in one event."""
        first = 0
        while first < len(hashes) and hashes[first] in self.cpu:
            self.cpu.touch(hashes[first])
            first += 1
        if first == len(hashes):
            return
        for index in range(first, len(hashes)):
            self.cpu.add(hashes[index], hashes[index - 1] if index else None)
        tokens = [t for block in blocks[first:] for t in block]
        parent = hashes[first - 1] if first else None
        events.append(
            stored(hashes[first:], tokens, parent=parent, medium="CPU", block_size=self.block_size)
        )
        gone = self.cpu.evict(keep=set(hashes))
        if gone:
            events.append(removed(gone, medium="CPU"))

    def step(self) -> list[Event]:
        events: list[Event] = []
        if self.clear_at is not None and self.steps == self.clear_at:
            self.gpu.clear()
            self.cpu.clear()
            events.append(AllBlocksCleared())
        while not events:
            self._serve(self._request(), events)
        self.steps += 1
        return events

    def payloads(self, count: int) -> list[bytes]:
        """``count`` consecutive steps, encoded."""
        return [vllm_batch(self.step(), step) for step in range(count)]


def index_of(payloads: Iterable[bytes], *, worker_id: int, block_size: int) -> TieredIndex:
    """The lossless reference: every payload through the relay's own pipeline (seq = position)
    into an index, with no socket in between. A payload that does not decode fails here: a
    reference that skipped one would not be lossless."""
    index = TieredIndex(block_size)
    pipeline = StreamPipeline(block_size, sinks=[IndexSink(index)])
    source = Source(f"reference:{worker_id}", worker_id=worker_id)
    for seq, payload in enumerate(payloads):
        pipeline.feed_batch(source, payload, seq)
        assert not pipeline.stats["bad_frame:schema"], f"payload {seq} does not decode"
    return index


def dump_rows(index: TieredIndex) -> dict[str, list[str]]:
    """Each level's Dynamo dump as sorted JSON rows, comparable across indexes."""
    return {
        level: sorted(json.dumps(row, sort_keys=True) for row in rows)
        for level, rows in index.dump().items()
    }


def overlaps(
    index: TieredIndex, prompts: Iterable[Sequence[int]]
) -> list[dict[tuple[int, int], tuple[int, int, int]]]:
    """Every prompt's overlap, as plain tuples."""
    return [
        {key: (o.device, o.host_pinned, o.disk) for key, o in index.overlap(prompt).items()}
        for prompt in prompts
    ]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_until(condition: Callable[[], bool], step: Callable[[], object], timeout: float) -> None:
    """Call ``step`` until ``condition`` holds, or fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        step()
