"""A stream whose tiers stay prefix-closed, for the one test that needs it: the snapshot test
compares Dynamo dump rows, and their grouping follows the store events.

:class:`PrefixClosedEngine` serves seeded requests that share system prefixes on a small GPU
tier and a small CPU tier, each evicting least recently used *leaves* only, so every store is a
chain under a resident parent and a CPU offload is one self-describing store of the request's
chain. :class:`~kvbridge.testing.SimulatedEngine` follows vLLM instead: its CPU tier stores one
block per event and evicts a parent before its children, so a snapshot regroups into one row a
chain the stream stored in two, and the dumps differ by row while holding the same blocks.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence

from kvbridge.schemas.vllm import BlockHash, Event
from kvbridge.testing.events import TS0, encoded, removed, stored
from kvbridge.testing.vllm_hashes import block_hashes
from kvbridge.testing.workload import ChatPrompts

__all__ = ["PrefixClosedEngine"]

GPU_BLOCKS = 24
CPU_BLOCKS = 32
OFFLOAD_EVERY = 3
"""Every third step offloads its request's chain to the CPU."""


def _blocks(prompt: Sequence[int], block_size: int) -> list[list[int]]:
    return [
        list(prompt[start : start + block_size])
        for start in range(0, len(prompt) - len(prompt) % block_size, block_size)
    ]


class _Tier:
    """One prefix-closed LRU cache of blocks: hash -> (parent hash, tokens)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[BlockHash, BlockHash | None] = OrderedDict()
        self.children: dict[BlockHash, int] = {}

    def __contains__(self, block: BlockHash) -> bool:
        return block in self.blocks

    def touch(self, block: BlockHash) -> None:
        self.blocks.move_to_end(block)

    def add(self, block: BlockHash, parent: BlockHash | None) -> None:
        self.blocks[block] = parent
        if parent is not None:
            self.children[parent] = self.children.get(parent, 0) + 1

    def evict(self, keep: set[BlockHash]) -> list[BlockHash]:
        """Evict least recently used leaves (never one in ``keep``) down to capacity."""
        gone: list[BlockHash] = []
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


class PrefixClosedEngine:
    """A seeded simulation of one vLLM engine (dp rank 0) with GPU and CPU tiers.

    Every :meth:`step` serves one or more requests and returns the non-empty event list of one
    engine step. :attr:`prompts` holds every distinct prompt served, for overlap queries.
    """

    def __init__(self, seed: int, *, block_size: int = 4) -> None:
        self.block_size = block_size
        self.gpu = _Tier(GPU_BLOCKS)
        self.cpu = _Tier(CPU_BLOCKS)
        self.steps = 0
        self._prompts = ChatPrompts(random.Random(seed), block_size)

    @property
    def prompts(self) -> list[list[int]]:
        """Every distinct prompt served, in the order first served."""
        return self._prompts.served

    def _serve(self, prompt: list[int], events: list[Event]) -> None:
        hashes = block_hashes(prompt, self.block_size)
        blocks = _blocks(prompt, self.block_size)
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
        if self.steps % OFFLOAD_EVERY == 0:
            self._offload(hashes, blocks, events)

    def _offload(
        self, hashes: list[BlockHash], blocks: list[list[int]], events: list[Event]
    ) -> None:
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
        while not events:
            self._serve(self._prompts.next(), events)
        self.steps += 1
        return events

    def payloads(self, count: int) -> list[bytes]:
        """``count`` consecutive steps, encoded."""
        return [encoded(self.step(), ts=TS0 + step) for step in range(count)]
