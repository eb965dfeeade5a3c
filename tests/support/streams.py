"""Deterministic vLLM-like worker streams, sent both to a real SelectionService and to kvbridge.

A :class:`Chain` is one prompt as one engine hashes it: vLLM's ``sha256`` block-hash chain
(:mod:`kvbridge.testing.vllm_hashes`, seeded per engine, a cache salt in the first block's extra
keys), sent as the u64 vLLM makes of a digest or as the raw 32-byte digest, with builders of the
events that name its blocks.

A :class:`WorkerStream` owns one :class:`~kvbridge.adapters.publisher.Publisher` per dp rank,
registers the worker with a :class:`~support.selection_harness.SelectionHarness`, and sends every batch
twice from the *same bytes*: over ZMQ to the service, and through the relay's
:class:`~kvbridge.adapters.pipeline.StreamPipeline` into a ``TieredIndex``.
:meth:`WorkerStream.sync` publishes a sentinel chain (GPU → CPU → DISK) on each rank and waits
until the service reports it, so every batch published before it on that rank has been applied
on every tier.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from kvbridge import TieredIndex
from kvbridge._closing import ClosedOnExit
from kvbridge.adapters.pipeline import IndexSink, StreamPipeline
from kvbridge.adapters.publisher import Publisher
from kvbridge.adapters.source import Source
from kvbridge.adapters.stream_stats import BadFrame
from kvbridge.normalizers.hashing import engine_hash_u64
from kvbridge.schemas.vllm import AllBlocksCleared, BlockStored, Event
from kvbridge.testing.events import TS0, encoded, placeholder, removed, stored
from kvbridge.testing.vllm_hashes import block_digests, none_hash
from support.selection_harness import Overlap, SelectionHarness, wait_connected

__all__ = ["Chain", "WorkerStream", "kvbridge_overlap"]

LOCAL = "tcp://127.0.0.1:0"
SYNC_TIMEOUT_S = 5.0
_SENTINEL_BASE = 3_000_000_000
"""Sentinel tokens live far above every prompt token (still u32)."""


class Chain:
    """One prompt as one engine sees it: tokens, per-block hashes, and event builders."""

    def __init__(
        self,
        tokens: Sequence[int],
        block_size: int,
        *,
        seed: bytes | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """``seed`` plays ``PYTHONHASHSEED``: chains of engines with the same seed (vLLM 0.29+'s
        default by default) hash identical prefixes identically."""
        self.tokens = list(tokens)
        self.block_size = block_size
        self.cache_salt = cache_salt
        root = none_hash(seed)
        self.digests = block_digests(self.tokens, block_size, root, cache_salt=cache_salt)
        self.hashes = [engine_hash_u64(digest) for digest in self.digests]

    def __len__(self) -> int:
        return len(self.hashes)

    def _hash(self, index: int, as_bytes: bool) -> int | bytes:
        return self.digests[index] if as_bytes else self.hashes[index]

    def prefix(self, blocks: int, extra_tokens: Sequence[int] = ()) -> list[int]:
        """The first ``blocks`` blocks' tokens, plus ``extra_tokens``."""
        return [*self.tokens[: blocks * self.block_size], *extra_tokens]

    def stored(
        self,
        start: int,
        stop: int,
        *,
        medium: str | None = "GPU",
        as_bytes: bool = False,
        parent: int | bytes | bool | None = True,
        extra_keys: list[list[Any] | None] | None = None,
    ) -> BlockStored:
        """A self-describing ``BlockStored`` of blocks ``start:stop``. ``parent=True`` uses
        this chain's previous block (nil for block 0); any other value is sent as given."""
        if parent is True:
            parent = None if start == 0 else self._hash(start - 1, as_bytes)
        elif parent is False:
            parent = None
        if extra_keys is None and self.cache_salt and start == 0:
            # vLLM publishes the raw salt, untagged, on the first block only (facts 7.3).
            extra_keys = [[self.cache_salt]] + [None] * (stop - start - 1)
        bs = self.block_size
        return stored(
            [self._hash(i, as_bytes) for i in range(start, stop)],
            self.tokens[start * bs : stop * bs],
            parent=parent,
            block_size=bs,
            medium=medium,
            extra_keys=extra_keys,
        )

    def placeholder(self, index: int, *, medium: str = "CPU", as_bytes: bool = False) -> Event:
        """An OffloadingConnector placeholder store: the chunk's (here: one block's) hash,
        no tokens, block_size 0, no parent (vllm-kv-events.md 9)."""
        return placeholder([self._hash(index, as_bytes)], medium=medium)

    def evicted(self, *indices: int, medium: str = "GPU", as_bytes: bool = False) -> list[Event]:
        """GPU evictions: one ``BlockRemoved`` per hash, in the order given."""
        return [removed([self._hash(i, as_bytes)], medium=medium) for i in indices]

    def removed(self, *indices: int, medium: str = "CPU", as_bytes: bool = False) -> Event:
        """An offload tier's removal: several hashes in one event."""
        return removed([self._hash(i, as_bytes) for i in indices], medium=medium)


def kvbridge_overlap(index: TieredIndex, tokens: Sequence[int], **kwargs: Any) -> Overlap:
    """The TieredIndex's overlap in the same shape (all-zero entries left out)."""
    return {
        key: (o.device, o.host_pinned, o.disk)
        for key, o in index.overlap(tokens, **kwargs).items()
        if o.device or o.host_pinned or o.disk
    }


class WorkerStream(ClosedOnExit):
    """One worker: a Publisher per dp rank, registered with the service, and a pipeline
    (one source per rank, one Normalizer for the worker) into ``index``."""

    def __init__(
        self,
        harness: SelectionHarness,
        index: TieredIndex,
        worker_id: int,
        block_size: int,
        *,
        ranks: Sequence[int] = (0,),
        release: str = "0.32.0",
        releases: dict[int, str] | None = None,
    ) -> None:
        self.harness = harness
        self.index = index
        self.worker_id = worker_id
        self.block_size = block_size
        self.releases = {rank: (releases or {}).get(rank, release) for rank in ranks}
        self.pipeline = StreamPipeline(block_size, sinks=[IndexSink(index)])
        self.normalizer = self.pipeline.worker(worker_id).normalizer
        self.publishers: dict[int, Publisher] = {}
        self.sources: dict[int, Source] = {}
        self._sentinels = 0
        try:
            for rank in ranks:
                self.publishers[rank] = Publisher(LOCAL, bind=True)
                self.sources[rank] = Source(self.publishers[rank].endpoint, worker_id=worker_id)
            harness.add_worker(
                worker_id,
                block_size=block_size,
                endpoints={rank: pub.endpoint for rank, pub in self.publishers.items()},
            )
            for pub in self.publishers.values():
                wait_connected(pub)
        except BaseException:
            self.close()
            raise

    def send(self, events: Iterable[Event], rank: int = 0) -> int:
        """Publish one batch on ``rank``'s publisher and feed the same bytes to kvbridge."""
        pub = self.publishers[rank]
        seq = pub.next_seq
        payload = encoded(events, dp_rank=rank, ts=TS0 + seq, release=self.releases[rank])
        assert pub.publish(payload) == seq
        self.pipeline.feed_batch(self.sources[rank], payload, seq)
        assert not self.pipeline.stats.bad_frames[BadFrame.SCHEMA], f"batch {seq} does not decode"
        return seq

    def clear(self, rank: int = 0) -> int:
        return self.send([AllBlocksCleared()], rank)

    def sync(self) -> None:
        """Publish a fresh sentinel chain on every rank (1 GPU block, then 1 CPU and 1 DISK
        block chained to it) and wait until the service reports (1, 2, 3) for it."""
        self._sentinels += 1
        targets = []
        for rank in self.publishers:
            token = _SENTINEL_BASE + self.worker_id * 100_000 + rank * 10_000 + self._sentinels
            chain = Chain([token] * (3 * self.block_size), self.block_size, seed=b"sentinel")
            self.send(
                [
                    chain.stored(0, 1),
                    chain.stored(1, 2, medium="CPU"),
                    chain.stored(2, 3, medium="DISK"),
                ],
                rank,
            )
            targets.append((chain.tokens, (self.worker_id, rank)))
        for tokens, key in targets:

            def indexed(tokens: list[int] = tokens, key: tuple[int, int] = key) -> bool:
                return self.harness.overlap(tokens).get(key) == (1, 2, 3)

            ok = self.harness.wait_for(indexed, SYNC_TIMEOUT_S)
            assert ok, f"sentinel of {key} not indexed: {self.harness.overlap(tokens)}"

    def close(self) -> None:
        for pub in self.publishers.values():
            pub.close()
