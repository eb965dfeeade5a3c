"""``kvbridge validate --compare-dynamo``: what a real Dynamo gets wrong on a user's own stream.

A recorded stream is replayed twice in one process, on loopback sockets this module binds:

- **alone**: byte for byte into a real ``dynamo.llm.SelectionService`` whose workers are
  registered directly on the raw streams, as a user without kvbridge runs it;
- **bridged**: through kvbridge's :class:`~kvbridge.adapters.pipeline.StreamPipeline`, whose
  canonical streams feed a second ``SelectionService`` (what ``kvbridge relay`` in front of Dynamo
  gives).

Both services are then read the same way: ``indexer_snapshot()`` (the standalone ``/dump`` shape)
gives each resident block with its ``tokens_hash`` and its parent, and ``overlap_scores`` the
per-prompt overlap. Blocks are compared by content, not by engine hash: a block's key is
Dynamo's rolling sequence hash of the ``tokens_hash`` values of its chain, which is what
kvbridge's canonical hashes are, and which two engines that hash differently still agree on.

A block the bridged side holds and the alone side does not is *missing*; one the alone side
holds and the bridged side does not is *stale*. Each is given the cause kvbridge knows from
the raw events (:class:`Cause`); a block whose own events were clean inherits the cause of the
nearest ancestor that differs, since Dynamo drops a store whose parent it lacks.

Dynamo applies what it receives on its own threads. To know when it has seen everything, each
stream ends with a *sentinel*: one block of a token that no tokenizer emits, stored after the
last recorded batch; once the sentinel is visible on a worker and rank, everything before it
on that stream has been applied. Sentinel blocks are left out of every comparison.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import msgspec

from kvbridge.adapters.capture import CaptureReader, FrameRecord, Prompt, in_receipt_order
from kvbridge.adapters.pipeline import PublisherSink, StreamPipeline, record_source
from kvbridge.adapters.ports import free_port_range
from kvbridge.adapters.publisher import Publisher
from kvbridge.adapters.selection import SelectionClient
from kvbridge.normalizers.hashing import (
    DYNAMO_SALT_PREFIX,
    engine_hash_u64,
    sequence_hashes,
    tokens_hashes,
)
from kvbridge.normalizers.media import MEDIA, tier_for_medium
from kvbridge.schemas import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    SchemaError,
    VllmBatch,
    decode_batch,
)
from kvbridge.schemas.tiers import Tier
from kvbridge.schemas.vllm import encode_batch, layout_for

__all__ = [
    "Cause",
    "DynamoComparison",
    "PromptOverlap",
    "ResidentDiff",
    "TierCounts",
    "WorkerOverlap",
    "compare_captures",
    "first_block_size",
    "render_comparison",
]

MODEL: Final = "kvbridge-compare"
"""The model name both services register the workers under."""

SYNC_TIMEOUT_S: Final = 30.0
"""How long Dynamo may take to apply a stream once it has been sent."""

_SENTINEL_TOKEN: Final = 0xFFFF_FFFF
"""The sentinel blocks' token, one less for each stream: the largest u32 values, which no
vocabulary reaches."""
_SENTINEL_HASH: Final = 0x6B76_6272_6964_6765  # "kvbridge"
_SENTINEL_LAYOUT: Final = layout_for("0.32.0")

_DYNAMO_MEDIA: Final = frozenset(MEDIA) - {"FS", "OBJ"}
"""The medium strings Dynamo 1.6.1's decoder maps to a tier: exactly these spellings (absent
means GPU). kvbridge also reads any case, and vLLM 0.26's ``FS`` / ``OBJ``."""


class Cause:
    """Why Dynamo alone holds a block differently, as kvbridge knows it from the raw events."""

    BYTES_HASHES: Final = "bytes_hashes"
    """The batch had bytes hashes (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``, or offload
    events before vLLM 0.24): Dynamo's decoder rejects the whole batch."""
    PLACEHOLDER: Final = "placeholder_cpu_event"
    """An OffloadingConnector placeholder (no tokens, block size 0): Dynamo drops it for its
    block size; kvbridge resolves it through the GPU block of the same engine hash."""
    MEDIUM_SPELLING: Final = "unknown_case_medium"
    """A medium Dynamo knows only in another spelling (``cpu`` from Mooncake or LMCache,
    ``FS`` / ``OBJ`` from vLLM 0.26): Dynamo drops the event."""
    RE_ANNOUNCED: Final = "re_announced_chunk"
    """A removal of a block stored more than once on the tier (self-describing offload chunks
    re-announce shared blocks): Dynamo does not reference-count and removes it."""
    SECOND_ENGINE: Final = "second_engine_hashes"
    """A worker that stored content another worker had stored under other hashes: Dynamo keeps
    the first writer's hash, so this worker's children of it fail and its removals do nothing."""
    RAW_CACHE_SALT: Final = "raw_cache_salt"
    """A cache salt without Dynamo's ``dynamo-cache-salt:`` prefix: Dynamo indexes the blocks
    unsalted, so the salted blocks are missing and unsalted ones are stale."""
    UNEXPLAINED: Final = "unexplained"
    """A difference none of the above accounts for (a case kvbridge does not model yet)."""


# -- report types ----------------------------------------------------------------------------


class TierCounts(msgspec.Struct, frozen=True):
    """Cumulative overlap in blocks, as ``overlap_scores`` gives it: leading blocks on the GPU,
    on the GPU or host, anywhere."""

    device: int
    host_pinned: int
    disk: int


class ResidentDiff(msgspec.Struct):
    """One worker, dp rank and tier: what each side holds, and how they differ."""

    worker_id: int
    dp_rank: int
    tier: str
    """Dynamo's storage tier: ``device``, ``host_pinned``, ``disk`` or ``external``."""
    alone: int
    """Blocks Dynamo holds fed the raw stream."""
    bridged: int
    """Blocks Dynamo holds fed through kvbridge."""
    missing: dict[str, int]
    """Blocks only the bridged side holds, by :class:`Cause`."""
    stale: dict[str, int]
    """Blocks only the alone side holds, by :class:`Cause`."""


class WorkerOverlap(msgspec.Struct):
    """One prompt's overlap on one worker and rank, each way."""

    worker_id: int
    dp_rank: int
    alone: TierCounts
    bridged: TierCounts


class PromptOverlap(msgspec.Struct):
    """A prompt of the capture, and the overlap each side's ``overlap_scores`` answers."""

    capture: str
    prompt: str
    """The prompt's name, or its index in the capture's (or the given) prompts."""
    blocks: int
    """Full blocks in the prompt."""
    workers: list[WorkerOverlap]
    """Workers with a non-zero overlap on either side."""
    differs: bool


class DynamoComparison(msgspec.Struct):
    """Dynamo fed the raw streams against Dynamo fed through kvbridge, on the same captures."""

    captures: list[str]
    differs: bool
    """Whether any resident block or any prompt's overlap differs."""
    missing: int
    """Blocks Dynamo alone misses, over every worker, rank and tier."""
    stale: int
    """Blocks Dynamo alone keeps that are not resident."""
    causes: dict[str, int]
    """Missing and stale blocks together, by :class:`Cause`."""
    resident: list[ResidentDiff]
    """One entry per worker, dp rank and tier that either side holds blocks on."""
    prompts: list[PromptOverlap] = []
    seconds: float = 0.0
    """Wall time of the comparison, services included."""


# -- what the raw events tell ----------------------------------------------------------------

_Key = tuple[int, int, str, int]
"""(worker_id, dp_rank, tier, content key)."""


class _Identity(msgspec.Struct, array_like=True):
    """What one engine hash of a worker stands for: its content key and hash context."""

    key: int
    unsalted: int
    lora_name: str | None
    salt: str | None
    salt_raw: bool
    """The salt came without Dynamo's prefix, so Dynamo hashed the block unsalted."""


class _Ledger:
    """Follows the raw events to know, per block content, what would make Dynamo alone differ.

    It keeps what Dynamo itself cannot: each worker's engine hash to content (``tokens_hash``
    chain), reference counts per tier, and which worker first stored each content (Dynamo keeps
    that writer's hash). The differences themselves are always measured on the services; the
    ledger only names their causes.
    """

    def __init__(self, block_sizes: Mapping[int, int]) -> None:
        self.block_sizes = block_sizes
        """Each worker's block size."""
        self.identities: dict[tuple[int, int], _Identity] = {}
        self.counts: Counter[_Key] = Counter()
        """Stores minus removals per block and tier, as kvbridge counts them."""
        self.owners: dict[tuple[str, int], tuple[int, int]] = {}
        """(tier, content) -> (worker, engine hash) of its first writer."""
        self.foreign: set[tuple[int, int]] = set()
        """(worker, engine hash) of blocks Dynamo credits under another worker's hash."""
        self.missing: dict[_Key, str] = {}
        self.stale: dict[_Key, str] = {}

    def observe(self, worker_id: int, batch: VllmBatch) -> None:
        """One raw batch of a worker, in stream order."""
        rank = batch.data_parallel_rank or 0
        rejected = _has_bytes_hashes(batch)
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(worker_id, rank, event, rejected)
            elif isinstance(event, BlockRemoved):
                self._removed(worker_id, rank, event, rejected)
            elif isinstance(event, AllBlocksCleared):
                for counted in [k for k in self.counts if k[:2] == (worker_id, rank)]:
                    del self.counts[counted]

    def _stored(self, worker: int, rank: int, event: BlockStored, rejected: bool) -> None:
        tier = tier_for_medium(event.medium)
        size = self.block_sizes[worker]
        if tier is None or (not event.is_placeholder and event.block_size != size):
            return  # dropped on both sides
        hashes = [engine_hash_u64(value) for value in event.block_hashes]
        parent = (
            None if event.parent_block_hash is None else engine_hash_u64(event.parent_block_hash)
        )
        if event.is_placeholder:
            identities = [self.identities.get((worker, value)) for value in hashes]
        else:
            identities = list(self._identify(worker, event, hashes, parent))
        cause = self._store_cause(worker, event, parent, rejected)
        for value, identity in zip(hashes, identities, strict=True):
            if identity is None:
                continue  # a placeholder kvbridge cannot resolve either
            key = (worker, rank, tier.value, identity.key)
            self.counts[key] += 1
            if identity.salt_raw and cause is None:
                self.missing[key] = Cause.RAW_CACHE_SALT
                self.stale[(worker, rank, tier.value, identity.unsalted)] = Cause.RAW_CACHE_SALT
            elif cause is not None:
                self.missing[key] = cause
            else:
                self.missing.pop(key, None)  # Dynamo got it: a difference is its parent's
                self._own(worker, tier, value, identity.key)

    def _store_cause(
        self, worker: int, event: BlockStored, parent: int | None, rejected: bool
    ) -> str | None:
        """Why Dynamo would not store this event's blocks as kvbridge does, if it would not."""
        if rejected:
            return Cause.BYTES_HASHES
        if event.medium is not None and event.medium not in _DYNAMO_MEDIA:
            return Cause.MEDIUM_SPELLING
        if event.is_placeholder:
            return Cause.PLACEHOLDER
        if (worker, parent) in self.foreign:
            return Cause.SECOND_ENGINE
        return None

    def _identify(
        self, worker: int, event: BlockStored, hashes: list[int], parent: int | None
    ) -> Iterator[_Identity]:
        """The identity of each block of a store with tokens, chained on its parent's."""
        above = None if parent is None else self.identities.get((worker, parent))
        lora = event.lora_name or (above.lora_name if above else None)
        salt, raw = _salt(event)
        if salt is None and above is not None:
            salt, raw = above.salt, above.salt_raw
        size = self.block_sizes[worker]
        tokens = event.token_ids[: len(hashes) * size]
        keys = sequence_hashes(
            tokens_hashes(tokens, size, lora_name=lora, cache_salt=salt),
            above.key if above else None,
        )
        unsalted = keys
        if raw:
            unsalted = sequence_hashes(
                tokens_hashes(tokens, size, lora_name=lora),
                above.unsalted if above else None,
            )
        for value, key, plain in zip(hashes, keys, unsalted, strict=False):
            identity = _Identity(key, plain, lora, salt, raw)
            self.identities[(worker, value)] = identity
            yield identity

    def _own(self, worker: int, tier: Tier, value: int, key: int) -> None:
        """Dynamo's node of this content keeps its first writer's hash."""
        owner = self.owners.setdefault((tier.value, key), (worker, value))
        if owner[0] != worker and owner[1] != value:
            self.foreign.add((worker, value))

    def _removed(self, worker: int, rank: int, event: BlockRemoved, rejected: bool) -> None:
        tier = tier_for_medium(event.medium)
        if tier is None:
            return
        for value in map(engine_hash_u64, event.block_hashes):
            identity = self.identities.get((worker, value))
            if identity is None:
                continue
            key = (worker, rank, tier.value, identity.key)
            count = self.counts[key]
            if count > 1:
                self.counts[key] = count - 1
                self.missing[key] = Cause.RE_ANNOUNCED
                continue
            self.counts.pop(key, None)
            if rejected:
                self.stale[key] = Cause.BYTES_HASHES
            elif event.medium is not None and event.medium not in _DYNAMO_MEDIA:
                self.stale[key] = Cause.MEDIUM_SPELLING
            elif (worker, value) in self.foreign:
                self.stale[key] = Cause.SECOND_ENGINE


def _has_bytes_hashes(batch: VllmBatch) -> bool:
    """Whether Dynamo's decoder rejects the batch: it reads hashes as integers only."""
    for event in batch.events:
        hashes: list[object] = []
        if isinstance(event, BlockStored):
            hashes = [*event.block_hashes, event.parent_block_hash]
        elif isinstance(event, BlockRemoved):
            hashes = list(event.block_hashes)
        if any(isinstance(value, bytes) for value in hashes):
            return True
    return False


def _salt(event: BlockStored) -> tuple[str | None, bool]:
    """The cache salt vLLM put in the first block's extra keys, and whether it lacks Dynamo's
    prefix. Multimodal digests (64 hex digits) and the LoRA name are not salts."""
    first = (event.extra_keys or [None])[0] or []
    for item in first:
        if not isinstance(item, str) or item == event.lora_name or _is_digest(item):
            continue
        salt = item.removeprefix(DYNAMO_SALT_PREFIX)
        return (salt or None), not item.startswith(DYNAMO_SALT_PREFIX)
    return None, False


def _is_digest(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text)


# -- one Dynamo and the streams that feed it -------------------------------------------------


class _Side:
    """A ``SelectionService`` with a PUB socket per stream it is registered on.

    The sockets are bound on 127.0.0.1 at consecutive ports from ``base_port`` and Dynamo's
    listeners connect to them, as they connect to an engine that binds. It runs one indexer
    thread: the comparison needs the state at the end, not throughput, and the machine's
    cores are better left to the replay.
    """

    def __init__(self, streams: Sequence[tuple[int, int]], base_port: int) -> None:
        self.client = SelectionClient(indexer_threads=1)
        self.publishers: list[Publisher] = []
        self.last_rank: list[int] = [0] * len(streams)
        """The dp rank of each stream's last batch, where its sentinel goes."""
        self.next_seq: list[int | None] = [None] * len(streams)
        """For streams sent as recorded: the seq after the last recorded one (the sentinel's).
        ``None``: the publisher numbers the batches itself."""
        try:
            for index in range(len(streams)):
                endpoint = f"tcp://127.0.0.1:{base_port + index}"
                self.publishers.append(Publisher(endpoint, bind=True))
            self._register(streams)
        except BaseException:
            self.close()
            raise

    def _register(self, streams: Sequence[tuple[int, int]]) -> None:
        """Each worker once, its streams as dp ranks 0, 1, ... (a batch's rank overrides)."""
        by_worker: dict[int, list[int]] = {}
        for index, (worker_id, _) in enumerate(streams):
            by_worker.setdefault(worker_id, []).append(index)
        for worker_id, indexes in by_worker.items():
            worker: dict[str, Any] = {
                "worker_id": worker_id,
                "model_name": MODEL,
                "endpoint": f"http://worker-{worker_id}",
                "block_size": streams[indexes[0]][1],
                "data_parallel_size": len(indexes),
                "kv_events_endpoints": {
                    rank: self.publishers[index].endpoint for rank, index in enumerate(indexes)
                },
            }
            record = self.client.call_sync("upsert_worker", worker)
            if record["lifecycle"] != "schedulable":
                reasons = "; ".join(record.get("not_schedulable_reasons") or ["none given"])
                raise RuntimeError(f"Dynamo refused worker {worker_id}: {reasons}")
        for publisher in self.publishers:
            if not publisher.wait_for_subscribers(timeout=SYNC_TIMEOUT_S):
                raise RuntimeError(f"Dynamo never subscribed to {publisher.endpoint}")

    def finish(self, streams: Sequence[tuple[int, int]]) -> None:
        """Send each stream's sentinel and wait until Dynamo has applied every stream.

        Raises:
            RuntimeError: a sentinel is not visible within :data:`SYNC_TIMEOUT_S`.
        """
        waiting = {}
        for index, (worker_id, block_size) in enumerate(streams):
            rank = self.last_rank[index]
            sentinel = _sentinel(index, block_size, rank)
            self.publishers[index].publish(sentinel, seq=self.next_seq[index])
            waiting[index] = (worker_id, rank, Prompt("", _sentinel_tokens(index, block_size)))
        deadline = time.monotonic() + SYNC_TIMEOUT_S
        while waiting:
            for index, (worker_id, rank, prompt) in list(waiting.items()):
                if (worker_id, rank) in self.overlap(prompt):
                    del waiting[index]
            if waiting and time.monotonic() > deadline:
                raise RuntimeError(f"Dynamo did not apply the streams in {SYNC_TIMEOUT_S:g} s")
            time.sleep(0.01)

    def overlap(self, prompt: Prompt) -> dict[tuple[int, int], TierCounts]:
        """``overlap_scores`` per (worker_id, dp_rank), in blocks; workers with no overlap
        left out."""
        request = {"model_name": MODEL, **msgspec.to_builtins(prompt)}
        del request["name"]
        answer = self.client.call_sync("overlap_scores", request)
        return {
            (int(w["worker_id"]), int(w["dp_rank"])): TierCounts(
                int(w["device_blocks"]), int(w["host_pinned_blocks"]), int(w["disk_blocks"])
            )
            for w in answer["workers"]
            if int(w["disk_blocks"])  # cumulative: the largest of the three
        }

    def resident(self, sentinels: frozenset[int]) -> dict[_Key, int | None]:
        """Every resident block by content, with its parent's key; blocks whose
        ``tokens_hash`` is in ``sentinels`` left out."""
        rows = [
            row
            for group in self.client.call_sync("indexer_snapshot").values()
            for row in group["events"]
        ]
        return _content_keys(rows, sentinels)

    def close(self) -> None:
        for publisher in self.publishers:
            publisher.close()
        self.client.close()


def _sentinel_tokens(index: int, block_size: int) -> list[int]:
    """The tokens of stream ``index``'s sentinel block, distinct for every stream."""
    return [_SENTINEL_TOKEN - index] * block_size


def _sentinel(index: int, block_size: int, rank: int) -> bytes:
    """A batch storing stream ``index``'s sentinel block on ``rank``, in vLLM 0.32's layout."""
    tokens = _sentinel_tokens(index, block_size)
    store = BlockStored([_SENTINEL_HASH + index], None, tokens, block_size, None, "GPU", None)
    return encode_batch(VllmBatch(time.time(), [store], rank), _SENTINEL_LAYOUT)


def _content_keys(
    rows: Iterable[Mapping[str, Any]], sentinels: frozenset[int]
) -> dict[_Key, int | None]:
    """The dump's blocks keyed by content: the rolling sequence hash of their chain.

    A row's parent is looked up on its own tier, then on the device tier (Dynamo's lower-tier
    index accepts a chunk whose parent is only on the GPU). A block whose chain cannot be
    followed to the root keeps its ``tokens_hash`` chained on its parent's engine hash, so that
    it is still counted, and differs from any rooted block.
    """
    edges: dict[tuple[int, int, str], dict[int, tuple[int | None, int]]] = {}
    for row in rows:
        stored = (
            row["event"]["data"].get("stored") if isinstance(row["event"]["data"], dict) else None
        )
        if stored is None:
            continue
        place = (int(row["worker_id"]), int(row["event"].get("dp_rank") or 0), row["storage_tier"])
        place_edges = edges.setdefault(place, {})
        parent = stored["parent_hash"]
        for block in stored["blocks"]:
            if int(block["tokens_hash"]) not in sentinels:
                place_edges[int(block["block_hash"])] = (parent, int(block["tokens_hash"]))
            parent = int(block["block_hash"])
    keys: dict[_Key, int | None] = {}
    for (worker, rank, tier), blocks in edges.items():
        device = edges.get((worker, rank, Tier.DEVICE.value), {})
        memo: dict[int, int] = {}
        for value in blocks:
            key, parent_key = _chain_key(value, blocks, device, memo)
            keys[(worker, rank, tier, key)] = parent_key
    return keys


def _chain_key(
    value: int,
    blocks: Mapping[int, tuple[int | None, int]],
    device: Mapping[int, tuple[int | None, int]],
    memo: dict[int, int],
) -> tuple[int, int | None]:
    """(key of block ``value``, key of its parent), following parents iteratively."""
    path: list[tuple[int, int]] = []
    current: int | None = value
    base: int | None = None
    while current is not None and current not in memo:
        edge = blocks.get(current) or device.get(current)
        if edge is None:
            base = current  # not in the dump: chain on the engine hash itself
            break
        path.append((current, edge[1]))
        current = edge[0]
    if current is not None and current in memo:
        base = memo[current]
    for block, block_tokens_hash in reversed(path):
        base = sequence_hashes([block_tokens_hash], base)[0]
        memo[block] = base
    parent = blocks.get(value) or device.get(value)
    parent_value = parent[0] if parent else None
    return memo[value], (memo.get(parent_value) if parent_value is not None else None)


# -- the comparison --------------------------------------------------------------------------


class _Stream(msgspec.Struct):
    """One recorded stream, and the capture it comes from."""

    capture: str
    worker_id: int
    block_size: int
    records: list[FrameRecord]


def first_block_size(batch: VllmBatch) -> int | None:
    """The block size of the batch's first store with tokens (placeholders have none)."""
    for event in batch.events:
        if isinstance(event, BlockStored) and event.token_ids and event.block_size:
            return event.block_size
    return None


def _decoded(record: FrameRecord) -> VllmBatch | None:
    """The record's batch, or ``None`` for a frame vLLM's shape or schema does not allow."""
    if record.seq is None:
        return None
    try:
        return decode_batch(record.frames[2])
    except SchemaError:
        return None


def _records_block_size(records: Iterable[FrameRecord]) -> int | None:
    for record in records:
        batch = _decoded(record)
        size = None if batch is None else first_block_size(batch)
        if size:
            return size
    return None


def _read(path: str, block_size: int | None) -> tuple[list[_Stream], list[Prompt]]:
    """A capture's streams, each with the capture's block size (given, in its header, or of
    its first store with tokens), and the prompts its header carries."""
    reader = CaptureReader(path)
    records = list(reader)
    size = block_size or reader.meta.get("block_size") or _records_block_size(records) or 0
    if records and not size:
        raise ValueError(f"{path}: no store with tokens tells the block size: give --block-size")
    streams: dict[str, _Stream] = {}
    for record in records:
        source = record_source(record)
        stream = streams.get(source.endpoint)
        if stream is None:
            stream = streams[source.endpoint] = _Stream(path, record.worker_id, size, [])
        stream.records.append(record)
    for stream in streams.values():
        stream.records = _engine_order(stream.records)
    return list(streams.values()), reader.prompts


def _engine_order(records: Sequence[FrameRecord]) -> list[FrameRecord]:
    """A stream's records in the order its engine published them.

    A batch the recorder recovered through the replay socket (stream ``replay:...``) was
    received after the live batch that showed the gap; sent in that order, Dynamo would drop
    it (a listener ignores a seq it has passed) where a listener with a replay endpoint would
    have fetched it. So each goes back among the live ones by its seq, within the run since the
    engine last restarted (a live seq going back). A record without a seq stays after the one
    before it.
    """
    run, last = 0, -1
    keyed = []
    for position, record in enumerate(records):
        seq, live = record.seq, not record.stream.startswith("replay:")
        if live and seq is not None:
            if seq < last:
                run += 1
            last = seq
        keyed.append(((run, last if seq is None else seq, position), record))
    keyed.sort(key=lambda item: item[0])
    return [record for _, record in keyed]


def _check_workers(streams: Sequence[_Stream]) -> None:
    """A worker id belongs to one capture: the services see every capture as one fleet."""
    seen: dict[int, str] = {}
    for stream in streams:
        other = seen.setdefault(stream.worker_id, stream.capture)
        if other != stream.capture:
            raise ValueError(
                f"worker {stream.worker_id} is in both {other} and {stream.capture}: captures "
                "compared together are one fleet, so compare these in separate runs"
            )


def compare_captures(
    paths: Iterable[str | Path],
    *,
    block_size: int | None = None,
    prompts: Sequence[Prompt] | None = None,
) -> DynamoComparison:
    """Replay captures into Dynamo alone and through kvbridge, and compare what each holds.

    The captures are one fleet: every stream of every capture feeds the same two services,
    so that what one engine does to another's blocks (hashes that differ) shows. ``prompts``
    are asked of both services; without them each capture's header prompts are.

    Raises:
        ValueError: a worker id is in two captures, or a capture's block size is unknown.
        RuntimeError: Dynamo did not subscribe, or did not apply the streams in time.
        CaptureError: a file is not a readable capture.
    """
    start = time.monotonic()
    names = [str(path) for path in paths]
    streams, asked = _load(names, block_size, prompts)
    specs = [(stream.worker_id, stream.block_size) for stream in streams]
    sentinels = frozenset(
        tokens_hashes(_sentinel_tokens(index, size), size)[0]
        for index, (_, size) in enumerate(specs)
    )
    base = free_port_range(2 * len(streams)) if streams else 0
    with contextlib.ExitStack() as stack:
        alone = _Side(specs, base)
        stack.callback(alone.close)
        bridged = _Side(specs, base + len(streams))
        stack.callback(bridged.close)
        ledger = _replay(streams, alone, bridged)
        alone.finish(specs)
        bridged.finish(specs)
        resident = _diff(alone.resident(sentinels), bridged.resident(sentinels), ledger)
        overlaps = [
            _prompt_overlap(capture, size, prompt, alone, bridged)
            for capture, size, prompt in (asked if streams else [])  # no worker, nothing to ask
        ]
    return _summary(names, resident, overlaps, time.monotonic() - start)


def _load(
    names: Sequence[str], block_size: int | None, prompts: Sequence[Prompt] | None
) -> tuple[list[_Stream], list[tuple[str, int, Prompt]]]:
    """Every capture's streams, and the prompts to ask with the capture and block size they
    are counted in (given prompts: those of the first stream)."""
    streams: list[_Stream] = []
    asked: list[tuple[str, int, Prompt]] = []
    for name in names:
        captured, header_prompts = _read(name, block_size)
        streams += captured
        size = captured[0].block_size if captured else 0
        asked += [(name, size, prompt) for prompt in header_prompts]
    _check_workers(streams)
    if prompts is not None:
        size = streams[0].block_size if streams else 0
        asked = [(", ".join(names), size, prompt) for prompt in prompts]
    return streams, asked


def _summary(
    names: list[str], resident: list[ResidentDiff], overlaps: list[PromptOverlap], seconds: float
) -> DynamoComparison:
    missing = sum(sum(entry.missing.values()) for entry in resident)
    stale = sum(sum(entry.stale.values()) for entry in resident)
    causes: Counter[str] = Counter()
    for entry in resident:
        causes.update(entry.missing)
        causes.update(entry.stale)
    return DynamoComparison(
        captures=names,
        differs=bool(missing or stale or any(p.differs for p in overlaps)),
        missing=missing,
        stale=stale,
        causes=dict(sorted(causes.items())),
        resident=resident,
        prompts=overlaps,
        seconds=round(seconds, 3),
    )


def _replay(streams: Sequence[_Stream], alone: _Side, bridged: _Side) -> _Ledger:
    """Send every record raw to one side and through the pipeline to the other, in the order
    of receipt over all streams (each stream's own order kept); the ledger follows the raw
    events."""
    ledger = _Ledger({stream.worker_id: stream.block_size for stream in streams})
    pipelines: dict[str, StreamPipeline] = {}
    for index, stream in enumerate(streams):
        pipeline = pipelines.setdefault(stream.capture, StreamPipeline(stream.block_size))
        sink = PublisherSink(bridged.publishers[index])
        pipeline.add_source(record_source(stream.records[0]), sink)
    for index, record in in_receipt_order([stream.records for stream in streams]):
        if not record.frames:
            continue
        stream = streams[index]
        alone.publishers[index].send_frames(record.frames)
        if record.seq is not None:
            alone.next_seq[index] = record.seq + 1
        batch = _decoded(record)
        if batch is not None:
            ledger.observe(stream.worker_id, batch)
            alone.last_rank[index] = bridged.last_rank[index] = batch.data_parallel_rank or 0
        pipelines[stream.capture].feed_record(record, decoded=batch)
    return ledger


def _diff(
    alone: Mapping[_Key, int | None], bridged: Mapping[_Key, int | None], ledger: _Ledger
) -> list[ResidentDiff]:
    """Per worker, rank and tier: the blocks on one side only, each with its cause."""
    missing = [key for key in bridged if key not in alone]
    stale = [key for key in alone if key not in bridged]
    missing_causes = _causes(missing, bridged, ledger.missing)
    stale_causes = _causes(stale, alone, ledger.stale)
    places = sorted({key[:3] for key in alone} | {key[:3] for key in bridged}, key=_place_order)
    held_alone = Counter(key[:3] for key in alone)
    held_bridged = Counter(key[:3] for key in bridged)
    result = []
    for place in places:
        worker_id, dp_rank, tier = place
        result.append(
            ResidentDiff(
                worker_id,
                dp_rank,
                tier,
                alone=held_alone[place],
                bridged=held_bridged[place],
                missing=_tally(missing_causes, place),
                stale=_tally(stale_causes, place),
            )
        )
    return result


_TIER_ORDER: Final = {tier.value: index for index, tier in enumerate(Tier)}


def _place_order(place: tuple[int, int, str]) -> tuple[int, int, int]:
    return place[0], place[1], _TIER_ORDER.get(place[2], len(_TIER_ORDER))


def _tally(causes: Mapping[_Key, str], place: tuple[int, int, str]) -> dict[str, int]:
    return dict(sorted(Counter(c for key, c in causes.items() if key[:3] == place).items()))


def _causes(
    keys: Sequence[_Key], side: Mapping[_Key, int | None], known: Mapping[_Key, str]
) -> dict[_Key, str]:
    """The cause of each differing block: its own, else that of its nearest differing
    ancestor (looked up on its tier, then on the device tier), else unexplained."""
    differing = set(keys)
    result: dict[_Key, str] = {}
    for key in keys:
        chain = []
        current: _Key | None = key
        while current is not None and current not in result and current not in known:
            chain.append(current)
            current = _differing_parent(current, side, differing)
        if current is None:
            cause = Cause.UNEXPLAINED
        else:
            cause = result.setdefault(current, known.get(current, Cause.UNEXPLAINED))
        for step in chain:
            result[step] = cause
    return result


def _differing_parent(
    key: _Key, side: Mapping[_Key, int | None], differing: set[_Key]
) -> _Key | None:
    parent = side.get(key)
    if parent is None:
        return None
    worker_id, dp_rank, tier, _ = key
    for place_tier in (tier, Tier.DEVICE.value):
        candidate = (worker_id, dp_rank, place_tier, parent)
        if candidate in side:
            return candidate if candidate in differing else None
    return None


def _prompt_overlap(
    capture: str, block_size: int, prompt: Prompt, alone: _Side, bridged: _Side
) -> PromptOverlap:
    """One prompt's ``overlap_scores`` on each side, workers with no overlap on either left out."""
    a, b = alone.overlap(prompt), bridged.overlap(prompt)
    none = TierCounts(0, 0, 0)
    workers = [
        WorkerOverlap(worker_id, dp_rank, a.get(place, none), b.get(place, none))
        for place in sorted(set(a) | set(b))
        for worker_id, dp_rank in [place]
        if a.get(place, none) != none or b.get(place, none) != none
    ]
    return PromptOverlap(
        capture,
        prompt.name,
        blocks=len(prompt.token_ids) // block_size,
        workers=workers,
        differs=any(w.alone != w.bridged for w in workers),
    )


# -- text ------------------------------------------------------------------------------------


def _counts(counts: TierCounts) -> str:
    return f"{counts.device}/{counts.host_pinned}/{counts.disk}"


def _by_cause(causes: Mapping[str, int]) -> str:
    return ", ".join(f"{cause} {count}" for cause, count in causes.items())


def render_comparison(comparison: DynamoComparison) -> str:
    """The comparison as text: a verdict, one line per worker, rank and tier, then the prompts
    whose overlap differs (the JSON report has every prompt)."""
    verdict = "DIFFERS" if comparison.differs else "same"
    lines = [
        f"Dynamo alone vs through kvbridge: {verdict} ({comparison.missing} missing, "
        f"{comparison.stale} stale in {len(comparison.captures)} capture(s))"
    ]
    for entry in comparison.resident:
        line = (
            f"  worker {entry.worker_id} dp {entry.dp_rank} {entry.tier}: "
            f"alone {entry.alone}, bridged {entry.bridged}"
        )
        if entry.missing:
            line += f"; missing {sum(entry.missing.values())} ({_by_cause(entry.missing)})"
        if entry.stale:
            line += f"; stale {sum(entry.stale.values())} ({_by_cause(entry.stale)})"
        lines.append(line)
    changed = [prompt for prompt in comparison.prompts if prompt.differs]
    if comparison.prompts:
        lines.append(
            f"  prompts whose overlap differs: {len(changed)} of {len(comparison.prompts)}"
            + (" (device/host/disk blocks, alone -> bridged)" if changed else "")
        )
    for prompt in changed:
        each = "; ".join(
            f"worker {w.worker_id} dp {w.dp_rank} {_counts(w.alone)} -> {_counts(w.bridged)}"
            for w in prompt.workers
            if w.alone != w.bridged
        )
        lines.append(f"    prompt {prompt.prompt} ({prompt.blocks} blocks): {each}")
    return "\n".join(lines)
