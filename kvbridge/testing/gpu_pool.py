"""The simulated engine's GPU block pool: vLLM's ``BlockPool`` with its prefix cache and its
``FreeKVCacheBlockQueue``, queueing the events vLLM's pool queues (docs/simulator.md,
"Prefix-cache hits", "Stores", "Evictions" and "Reset")."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvbridge.schemas.vllm import AllBlocksCleared, BlockHash, Event
from kvbridge.testing.events import removed, stored
from kvbridge.testing.vllm_hashes import published_hash

__all__ = ["GpuBlock", "GpuPool"]


class GpuBlock:
    """One GPU block: its id, the hash it holds while cached, and the requests using it."""

    __slots__ = ("block_id", "digest", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.digest: bytes | None = None
        """The block's hash while it is cached (vLLM's ``block_hash``)."""
        self.ref_cnt = 0


class GpuPool:
    """``num_blocks`` GPU blocks, a prefix cache over them and vLLM's LRU free queue.

    The pool appends what it does to :attr:`events` (vLLM's pool event queue), which the engine
    takes at the end of each step. Hashes go out as ``BlockHash`` in the engine's published form
    (``as_bytes``, see :func:`~kvbridge.testing.vllm_hashes.published_hash`).
    """

    def __init__(self, num_blocks: int, *, as_bytes: bool) -> None:
        self._as_bytes = as_bytes
        self._blocks = [GpuBlock(block_id) for block_id in range(num_blocks)]
        self._free: OrderedDict[int, GpuBlock] = OrderedDict(
            (block.block_id, block) for block in self._blocks
        )
        """vLLM's FreeKVCacheBlockQueue: head = next block to allocate (least recently used)."""
        self._cached: dict[bytes, dict[int, GpuBlock]] = {}
        """vLLM's cached_block_hash_to_block: every GPU block holding a hash, first copy first."""
        self.events: list[Event] = []
        """The pool's event queue, taken by the engine at the end of each step."""

    def _wire(self, digest: bytes) -> BlockHash:
        return published_hash(digest, as_bytes=self._as_bytes)

    def cache_hits(self, digests: Sequence[bytes]) -> list[GpuBlock]:
        """The first cached copy of each leading digest that is cached (vLLM's
        ``find_longest_cache_hit``); the caller leaves out the block holding the last prompt
        token."""
        hits: list[GpuBlock] = []
        for digest in digests:
            copies = self._cached.get(digest)
            if not copies:
                break
            hits.append(next(iter(copies.values())))
        return hits

    def touch(self, block: GpuBlock) -> None:
        """A request takes a reference to ``block``, taking it out of the free queue."""
        if block.ref_cnt == 0:
            del self._free[block.block_id]
        block.ref_cnt += 1

    def allocate(self, count: int) -> list[GpuBlock]:
        """``count`` blocks from the free queue's head, each evicting what it held."""
        blocks: list[GpuBlock] = []
        for _ in range(count):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def _evict(self, block: GpuBlock) -> None:
        digest = block.digest
        if digest is None:
            return
        copies = self._cached[digest]
        del copies[block.block_id]
        if not copies:
            del self._cached[digest]
        block.digest = None
        self.events.append(removed([self._wire(digest)]))

    def cache(
        self,
        blocks: Sequence[GpuBlock],
        digests: Sequence[bytes],
        parent: bytes | None,
        tokens: list[int],
        block_size: int,
    ) -> None:
        """Cache ``blocks`` under ``digests`` (vLLM's ``cache_full_blocks``) and queue one
        ``BlockStored`` for them, chained to ``parent``, with their ``tokens``."""
        for block, digest in zip(blocks, digests, strict=True):
            block.digest = digest
            self._cached.setdefault(digest, {})[block.block_id] = block
        self.events.append(
            stored(
                [self._wire(digest) for digest in digests],
                tokens,
                parent=None if parent is None else self._wire(parent),
                block_size=block_size,
            )
        )

    def free(self, blocks: Sequence[GpuBlock]) -> None:
        """vLLM's ``BlockPool.free_blocks`` (0.23+): tail first; a freed block that holds no hash
        (the partial last block) goes to the head of the free queue, to be reused before any
        cached block is evicted."""
        for block in reversed(blocks):
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
                if block.digest is None:
                    self._free.move_to_end(block.block_id, last=False)

    def reset(self) -> None:
        """Uncache every block and queue an ``AllBlocksCleared`` (vLLM's
        ``reset_prefix_cache``)."""
        for block in self._blocks:
            block.digest = None
        self._cached.clear()
        self.events.append(AllBlocksCleared())

    def resident(self) -> list[BlockHash]:
        """The cached hashes in the order eviction would take them (free blocks first, then
        those in use), each once, in their published form."""
        seen: dict[bytes, None] = {}
        free = [block.digest for block in self._free.values() if block.digest is not None]
        used = [b.digest for b in self._blocks if b.ref_cnt and b.digest is not None]
        for digest in free + used:
            seen.setdefault(digest, None)
        return [self._wire(digest) for digest in seen]
