"""The simulated engine's CPU tier: vLLM's OffloadingConnector with its LRU offloading manager,
one block per chunk, queueing the connector's events (docs/simulator.md, "CPU tier")."""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence

from kvbridge.schemas.vllm import BlockHash, BlockStored, Event
from kvbridge.testing.events import placeholder, removed, stored
from kvbridge.testing.vllm_hashes import published_hash

__all__ = ["CpuTier"]


class _CpuBlock:
    __slots__ = ("ready", "ref_cnt")

    def __init__(self) -> None:
        self.ready = False
        """False while the GPU→CPU copy is in flight."""
        self.ref_cnt = 0
        """Loads in flight."""


class _Offload:
    """One block whose GPU→CPU copy is in flight."""

    __slots__ = ("digest", "parent", "tokens")

    def __init__(self, digest: bytes, parent: bytes | None, tokens: list[int]) -> None:
        self.digest = digest
        self.parent = parent
        self.tokens = tokens


class CpuTier:
    """``capacity`` CPU blocks in LRU order, with the copies in flight between the GPU and them.

    The tier appends what it does to :attr:`events` (the connector's event queue). The release
    decides the events' form: ``as_bytes`` hashes, ``group_idx`` and the ``placeholder_size``
    of placeholder stores, or ``self_describing`` stores with tokens and parent.

    Args:
        capacity: CPU blocks.
        block_size: tokens per block.
        as_bytes: publish the 32-byte digests instead of u64s.
        group_idx: the ``group_idx`` of every event (``None`` before vLLM 0.24).
        placeholder_size: the ``block_size`` of a placeholder store.
        self_describing: stores carry tokens, parent and block size instead of placeholders.
        shuffle: shuffles each step's stores (vLLM's order is arbitrary); ``None`` keeps block
            order.
    """

    def __init__(
        self,
        capacity: int,
        *,
        block_size: int,
        as_bytes: bool,
        group_idx: int | None,
        placeholder_size: int,
        self_describing: bool,
        shuffle: random.Random | None,
    ) -> None:
        self._capacity = capacity
        self._block_size = block_size
        self._as_bytes = as_bytes
        self._group_idx = group_idx
        self._placeholder_size = placeholder_size
        self._self_describing = self_describing
        self._shuffle = shuffle
        self._blocks: OrderedDict[bytes, _CpuBlock] = OrderedDict()
        """The tier in LRU order (head = next to evict)."""
        self._offloading: list[_Offload] = []
        """Offloads scheduled in the current step."""
        self._in_flight: list[_Offload] = []
        """Offloads scheduled in the previous step, completing at the end of this one."""
        self.events: list[Event] = []
        """The connector's event queue, taken by the engine at the end of each step."""

    def _wire(self, digest: bytes) -> BlockHash:
        return published_hash(digest, as_bytes=self._as_bytes)

    @property
    def copying(self) -> bool:
        """Offloads are scheduled or in flight (vLLM keeps their request's blocks until then)."""
        return bool(self._in_flight or self._offloading)

    def touch(self, digests: Sequence[bytes]) -> None:
        """Make the blocks held among ``digests`` the most recently used, the first one last."""
        for digest in reversed(digests):
            if digest in self._blocks:
                self._blocks.move_to_end(digest)

    def ready_prefix(self, digests: Sequence[bytes]) -> int:
        """How many leading ``digests`` are on the CPU with their copy complete."""
        hits = 0
        for digest in digests:
            block = self._blocks.get(digest)
            if block is None or not block.ready:
                break
            hits += 1
        return hits

    def pin(self, digests: Sequence[bytes], delta: int) -> None:
        """Count a load of ``digests`` in (``delta=1``) or out (``-1``): loading blocks are not
        evicted."""
        for digest in digests:
            self._blocks[digest].ref_cnt += delta

    def offload(self, digests: Sequence[bytes], tokens: Sequence[int], start: int) -> bool:
        """Schedule the blocks ``start:`` of a request's full blocks ``digests`` (with their
        ``tokens``) for offload, those already on the CPU excepted. Returns ``False`` when there
        is no room, as vLLM then logs a warning and retries in the next step."""
        size = self._block_size
        stored = self._prepare_store(digests[start:])
        if stored is None:
            return False
        if not stored:
            return True
        self.touch(digests)
        reserved = set(stored)
        offloads = [
            _Offload(
                digest,
                digests[index - 1] if index else None,
                list(tokens[index * size : (index + 1) * size]),
            )
            for index, digest in enumerate(digests[start:], start)
            if digest in reserved
        ]
        if self._shuffle is not None:
            self._shuffle.shuffle(offloads)
        self._offloading.extend(offloads)
        return True

    def _prepare_store(self, digests: Sequence[bytes]) -> list[bytes] | None:
        """vLLM's LRU offloading manager: make room, evicting the least recently used ready
        blocks (one batched CPU removal), and reserve blocks for the hashes not yet stored."""
        to_store = [digest for digest in digests if digest not in self._blocks]
        excess = len(self._blocks) + len(to_store) - self._capacity
        evict: list[bytes] = []
        if excess > 0:
            protected = set(digests)
            for digest, block in self._blocks.items():
                if block.ready and block.ref_cnt == 0 and digest not in protected:
                    evict.append(digest)
                    if len(evict) == excess:
                        break
            else:
                return None
        for digest in evict:
            del self._blocks[digest]
        if evict:
            self.events.append(
                removed(
                    [self._wire(digest) for digest in evict],
                    medium="CPU",
                    group_idx=self._group_idx,
                )
            )
        for digest in to_store:
            self._blocks[digest] = _CpuBlock()
        return to_store

    def complete(self) -> None:
        """The end of a step: the copies scheduled in the previous one complete, one CPU
        ``BlockStored`` per block."""
        for offload in self._in_flight:
            block = self._blocks.get(offload.digest)
            if block is None:
                continue
            block.ready = True
            self.events.append(self._stored(offload))
        self._in_flight, self._offloading = self._offloading, []

    def _stored(self, offload: _Offload) -> BlockStored:
        """The offloaded block's store: self-describing (without extra keys), or a
        placeholder."""
        block_hash = self._wire(offload.digest)
        if self._self_describing:
            return stored(
                [block_hash],
                offload.tokens,
                parent=None if offload.parent is None else self._wire(offload.parent),
                block_size=self._block_size,
                medium="CPU",
                extra_keys=None,
                group_idx=self._group_idx,
            )
        return placeholder(
            [block_hash], block_size=self._placeholder_size, group_idx=self._group_idx
        )

    def clear(self) -> None:
        """Empty the tier, publishing nothing (vLLM's ``reset_external``)."""
        self._blocks.clear()

    def resident(self) -> list[BlockHash]:
        """The hashes whose copy is complete, least recently used first, in published form."""
        return [self._wire(digest) for digest, block in self._blocks.items() if block.ready]
