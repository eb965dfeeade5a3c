"""An in-process, tier-aware Dynamo index built from the real ``dynamo.llm.RadixTree``.

Dynamo's ``RadixTree`` knows one tier. :class:`TieredIndex` keeps one tree per cumulative level
(device; device or host; any tier), so that a plain prefix match on each tree yields Dynamo's
cumulative overlap: leading blocks on the GPU, on the GPU or CPU, and anywhere.

A tree only accepts a block whose parent it holds for that worker, and it forgets the children
of a block removed by its last worker. The index therefore tracks residency itself and keeps
each tree equal to the blocks that are resident at that level *and* reachable from the root:
a block whose parent is missing at a level waits, detached, and is attached (with its resident
descendants) as soon as the parent arrives.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Final, cast

import msgspec
from dynamo.llm import RadixTree

from kvbridge.normalizers.hashing import tokens_hashes
from kvbridge.schemas.kv_cache_event import (
    EventData,
    KvCacheEvent,
    RemovedData,
    StoredBlock,
    StoredData,
)
from kvbridge.schemas.overlap import Overlap
from kvbridge.schemas.tiers import Tier, TieredEvent

__all__ = ["LEVELS", "TieredIndex"]

LEVELS: Final = ("device", "host_pinned", "disk")
"""The cumulative levels, each including the ones before it."""

_LEVEL_OF_TIER: Final = {Tier.DEVICE: 0, Tier.HOST_PINNED: 1, Tier.DISK: 2, Tier.EXTERNAL: 2}
_TIER_BIT: Final = {tier: 1 << index for index, tier in enumerate(Tier)}
_LEVEL_MASK: Final = tuple(
    sum(bit for tier, bit in _TIER_BIT.items() if _LEVEL_OF_TIER[tier] <= level)
    for level in range(len(LEVELS))
)
_encode = msgspec.json.encode


class _Node:
    __slots__ = ("attached", "parent", "tiers", "tokens_hash")

    def __init__(self, parent: int | None, tokens_hash: int) -> None:
        self.parent = parent
        self.tokens_hash = tokens_hash
        self.tiers = 0
        """Bit set of the tiers the block is resident on."""
        self.attached = 0
        """Bit set of the levels whose tree holds the block."""


def _attached(node: _Node | None, level_bit: int) -> bool:
    return node is not None and bool(node.attached & level_bit)


class _Residency:
    """The blocks of one (worker, dp_rank)."""

    __slots__ = ("children", "nodes")

    def __init__(self) -> None:
        self.nodes: dict[int, _Node] = {}
        self.children: dict[int, set[int]] = {}

    def forget(self, block: int, node: _Node) -> None:
        del self.nodes[block]
        if node.parent is not None:
            siblings = self.children.get(node.parent)
            if siblings is not None:
                siblings.discard(block)
                if not siblings:
                    del self.children[node.parent]


class TieredIndex:
    """Dynamo's KV index with tiers: one ``RadixTree`` per cumulative level.

    ``block_size`` is used to hash query prompts; left out, it is learned from the first store.
    """

    def __init__(self, block_size: int | None = None) -> None:
        self.block_size = block_size
        self._trees = tuple(RadixTree() for _ in LEVELS)
        self._residency: dict[tuple[int, int], _Residency] = {}
        self._event_id = 0

    # -- writes ---------------------------------------------------------------------------

    def apply(self, events: Iterable[TieredEvent]) -> None:
        """Apply canonical events, as produced by :class:`kvbridge.Normalizer`."""
        for tiered in events:
            key = (tiered.worker_id, tiered.dp_rank)
            residency = self._residency.get(key)
            if residency is None:
                residency = self._residency[key] = _Residency()
            data = tiered.event.data
            if data == "cleared":
                self._clear(key, residency, tiered.tier)
            elif data.stored is not None:
                self._learn_block_size(tiered, data.stored)
                self._store(key, residency, tiered.tier, data.stored)
            elif data.removed is not None:
                self._remove(key, residency, tiered.tier, data.removed.block_hashes)

    def remove_worker(self, worker_id: int) -> None:
        """Forget every block of a worker, on every rank and tier."""
        for tree in self._trees:
            tree.remove_worker(worker_id)
        for key in [key for key in self._residency if key[0] == worker_id]:
            del self._residency[key]

    def _learn_block_size(self, tiered: TieredEvent, stored: StoredData) -> None:
        if self.block_size is None and tiered.token_ids:
            self.block_size = len(tiered.token_ids) // len(stored.blocks)

    def _store(
        self, key: tuple[int, int], residency: _Residency, tier: Tier, stored: StoredData
    ) -> None:
        nodes, bit = residency.nodes, _TIER_BIT[tier]
        parent = stored.parent_hash
        for block in stored.blocks:
            node = nodes.get(block.block_hash)
            if node is None:
                node = nodes[block.block_hash] = _Node(parent, block.tokens_hash)
                if parent is not None:
                    residency.children.setdefault(parent, set()).add(block.block_hash)
            node.tiers |= bit
            parent = block.block_hash
        for level in range(_LEVEL_OF_TIER[tier], len(LEVELS)):
            self._attach(key, residency, level, [block.block_hash for block in stored.blocks])

    def _remove(
        self, key: tuple[int, int], residency: _Residency, tier: Tier, blocks: Sequence[int]
    ) -> None:
        nodes, bit = residency.nodes, _TIER_BIT[tier]
        for block in blocks:
            node = nodes.get(block)
            if node is not None:
                node.tiers &= ~bit
        for level in range(_LEVEL_OF_TIER[tier], len(LEVELS)):
            mask, level_bit = _LEVEL_MASK[level], 1 << level
            gone = [
                block
                for block in blocks
                if (node := nodes.get(block)) is not None
                and node.attached & level_bit
                and not node.tiers & mask
            ]
            self._detach(key, residency, level, gone)
        for block in blocks:
            node = nodes.get(block)
            if node is not None and not node.tiers and not node.attached:
                residency.forget(block, node)

    def _clear(self, key: tuple[int, int], residency: _Residency, tier: Tier) -> None:
        bit = _TIER_BIT[tier]
        for node in residency.nodes.values():
            node.tiers &= ~bit
        for level in range(_LEVEL_OF_TIER[tier], len(LEVELS)):
            mask, level_bit = _LEVEL_MASK[level], 1 << level
            if not any(node.tiers & mask for node in residency.nodes.values()):
                self._send(level, key, "cleared")
                for node in residency.nodes.values():
                    node.attached &= ~level_bit
            else:
                gone = [
                    block
                    for block, node in residency.nodes.items()
                    if node.attached & level_bit and not node.tiers & mask
                ]
                self._detach(key, residency, level, gone)
        for block, node in list(residency.nodes.items()):
            if not node.tiers and not node.attached:
                residency.forget(block, node)

    # -- keeping each tree equal to the reachable resident blocks ---------------------------

    def _attach(
        self, key: tuple[int, int], residency: _Residency, level: int, blocks: list[int]
    ) -> None:
        """Put resident blocks whose parent the tree holds into it, then their waiting
        descendants. A store event carries a chain, so it goes to the tree as one run."""
        nodes, mask, level_bit = residency.nodes, _LEVEL_MASK[level], 1 << level
        pending = list(blocks)
        while pending:
            run: list[int] = []
            run_parent: int | None = None
            waiting: list[int] = []
            for block in pending:
                node = nodes[block]
                if node.attached & level_bit or not node.tiers & mask:
                    continue
                parent = node.parent
                if run and parent == run[-1]:
                    pass
                elif parent is None or _attached(nodes.get(parent), level_bit):
                    if run:
                        self._send_store(level, key, run_parent, run, nodes)
                    run, run_parent = [], parent
                else:
                    continue  # detached until its parent is attached
                run.append(block)
                node.attached |= level_bit
                waiting.extend(residency.children.get(block, ()))
            if run:
                self._send_store(level, key, run_parent, run, nodes)
            pending = waiting

    def _detach(
        self, key: tuple[int, int], residency: _Residency, level: int, blocks: list[int]
    ) -> None:
        """Take blocks out of a tree together with their attached descendants, which the tree
        could no longer reach; they stay resident and re-attach with their ancestor."""
        nodes, level_bit = residency.nodes, 1 << level
        gone: list[int] = []
        stack = list(blocks)
        while stack:
            block = stack.pop()
            node = nodes[block]
            if not node.attached & level_bit:
                continue
            node.attached &= ~level_bit
            gone.append(block)
            stack.extend(residency.children.get(block, ()))
        if gone:
            self._send(level, key, EventData(removed=RemovedData(gone)))

    def _send_store(
        self,
        level: int,
        key: tuple[int, int],
        parent: int | None,
        run: list[int],
        nodes: dict[int, _Node],
    ) -> None:
        blocks = [StoredBlock(block, nodes[block].tokens_hash) for block in run]
        self._send(level, key, EventData(stored=StoredData(parent, blocks)))

    def _send(self, level: int, key: tuple[int, int], data: EventData | str) -> None:
        worker_id, dp_rank = key
        self._event_id += 1
        event = KvCacheEvent(self._event_id, data, dp_rank)  # type: ignore[arg-type]
        self._trees[level].apply_event(worker_id, _encode(event))

    # -- reads ----------------------------------------------------------------------------

    def _before_read(self) -> None:
        """Called first by every read: an index fed on another thread waits for it here (see
        :class:`~kvbridge.testing.SyncedIndex`); this one is always up to date."""

    def overlap(
        self,
        token_ids: Sequence[int],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> dict[tuple[int, int], Overlap]:
        """Leading blocks of ``token_ids`` resident per (worker_id, dp_rank), by tier."""
        self._before_read()
        if self.block_size is None:
            return {}
        hashes = tokens_hashes(
            token_ids, self.block_size, lora_name=lora_name, cache_salt=cache_salt
        )
        if not hashes:
            return {}
        # The stubs declare integer keys; the 1.6 binary returns (worker_id, dp_rank) tuples.
        scores = [
            cast(dict[tuple[int, int], int], tree.find_matches(hashes).scores)
            for tree in self._trees
        ]
        device, host, disk = scores
        return {
            key: Overlap(device.get(key, 0), host.get(key, 0), disk.get(key, 0))
            for key in sorted(disk)
        }

    def resident(self, worker_id: int, dp_rank: int = 0) -> dict[Tier, int]:
        """How many blocks of a worker's rank are resident on each tier."""
        self._before_read()
        residency = self._residency.get((worker_id, dp_rank))
        nodes = residency.nodes.values() if residency else ()
        return {
            tier: sum(1 for node in nodes if node.tiers & bit) for tier, bit in _TIER_BIT.items()
        }

    def workers(self) -> list[tuple[int, int]]:
        """Every (worker_id, dp_rank) with at least one resident block."""
        self._before_read()
        return sorted(key for key, residency in self._residency.items() if residency.nodes)

    def dump(self) -> dict[str, list[dict[str, Any]]]:
        """Each level's tree as Dynamo dumps it: ``RouterEvent`` objects, one per edge."""
        self._before_read()
        return {
            level: [msgspec.json.decode(row) for row in tree.dump_tree_as_events()]
            for level, tree in zip(LEVELS, self._trees, strict=True)
        }
