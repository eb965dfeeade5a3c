"""One Dynamo of the comparison: a real ``SelectionService`` and the PUB sockets that feed it.

Dynamo applies what it receives on its own threads. To know when it has seen everything, each
stream ends with a *sentinel*: one block of a token that no tokenizer emits, stored after the
last recorded batch; once the sentinel is visible on a worker and rank, everything before it on
that stream has been applied. Sentinel blocks are left out of every comparison.

Dynamo's listeners apply different streams concurrently, so when two engines store the same
tokens under different hashes, which one Dynamo keeps depends on which listener ran first. To
make that the engine whose batch came first, :meth:`Side.sync` waits (with a sentinel) for
the streams sent so far before the replay moves on to another capture; the raw streams'
sequence numbers then continue one past each sentinel.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

import msgspec

from kvbridge.adapters.capture import Prompt
from kvbridge.adapters.dynamo_compare.ledger import Key
from kvbridge.adapters.dynamo_compare.report import TierCounts
from kvbridge.adapters.publisher import Publisher
from kvbridge.adapters.replay_protocol import seq8
from kvbridge.adapters.selection_client import SelectionClient
from kvbridge.normalizers.hashing import sequence_hashes, tokens_hashes
from kvbridge.schemas import BlockStored, VllmBatch
from kvbridge.schemas.tiers import Tier
from kvbridge.schemas.vllm import encode_batch, layout_for

__all__ = ["MODEL", "SYNC_TIMEOUT_S", "Side", "sentinel_tokens"]

MODEL: Final = "kvbridge-compare"
"""The model name both services register the workers under."""

SYNC_TIMEOUT_S: Final = 30.0
"""How long Dynamo may take to apply a stream once it has been sent."""

_SENTINEL_TOKEN: Final = 0xFFFF_FFFF
"""The sentinel blocks' token, one less for each stream: the largest u32 values, which no
vocabulary reaches."""
_SENTINEL_HASH: Final = 0x6B76_6272_6964_6765  # "kvbridge"
_SENTINEL_LAYOUT: Final = layout_for("0.32.0")


class Side:
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
        self.highest: list[int | None] = [None] * len(streams)
        """For streams sent as recorded: the highest seq sent (a sentinel's included), which
        Dynamo's listener has passed: it ignores a batch at or below it. ``None``: the
        publisher numbers the batches itself."""
        self.inserted: list[int] = [0] * len(streams)
        """Sentinels sent on each stream so far: its recorded seqs go out this much later."""
        self.sentinels: set[int] = set()
        """The ``tokens_hash`` of every sentinel block sent, to leave out of the comparison."""
        self._block_sizes = [block_size for _, block_size in streams]
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

    def send_recorded(self, index: int, frames: list[bytes], seq: int | None) -> bool:
        """A recorded message on stream ``index``, its seq moved past the sentinels sent;
        whether Dynamo applies it: ``False`` for a batch whose seq the listener has passed (a
        restarted engine's, until its sequence passes the old process's last)."""
        shift = self.inserted[index]
        if shift and seq is not None and len(frames) == 3 and len(frames[1]) == 8:
            frames = [frames[0], seq8(seq + shift), frames[2]]
        self.publishers[index].send_frames(frames)
        if seq is None:
            return True
        highest = self.highest[index]
        if highest is not None and seq + shift <= highest:
            return False
        self.highest[index] = seq + shift
        return True

    def finish(self, streams: Sequence[tuple[int, int]]) -> None:
        """Wait until Dynamo has applied every stream (see :meth:`sync`)."""
        self.sync({index: worker_id for index, (worker_id, _) in enumerate(streams)})

    def sync(self, streams: Mapping[int, int]) -> None:
        """Send a sentinel on each of ``streams`` ({index: worker_id}) and wait until Dynamo
        shows them all: everything sent on those streams before has been applied.

        Raises:
            RuntimeError: a sentinel is not visible within :data:`SYNC_TIMEOUT_S`.
        """
        waiting = {}
        for index, worker_id in streams.items():
            rank, block_size = self.last_rank[index], self._block_sizes[index]
            tokens = sentinel_tokens(index, block_size, self.inserted[index])
            highest = self.highest[index]
            seq = None if highest is None else highest + 1
            self.publishers[index].publish(_sentinel(index, tokens, rank), seq=seq)
            if seq is not None:
                self.inserted[index] += 1
                self.highest[index] = seq
            self.sentinels.add(tokens_hashes(tokens, block_size)[0])
            waiting[index] = (worker_id, rank, Prompt("", tokens))
        deadline = time.monotonic() + SYNC_TIMEOUT_S
        while waiting:
            for index, (worker_id, rank, prompt) in list(waiting.items()):
                if (worker_id, rank) in self.overlap(prompt):
                    del waiting[index]
            if waiting and time.monotonic() > deadline:
                late = ", ".join(
                    f"worker {worker_id} dp {rank}" for worker_id, rank, _ in waiting.values()
                )
                raise RuntimeError(
                    f"Dynamo did not apply the streams in {SYNC_TIMEOUT_S:g} s (not seen: {late})"
                )
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

    def resident(self, sentinels: frozenset[int]) -> dict[Key, int | None]:
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


def sentinel_tokens(index: int, block_size: int, sent: int = 0) -> list[int]:
    """The tokens of stream ``index``'s sentinel block after ``sent`` earlier ones: distinct
    for every stream and every sentinel (the block's first token counts them)."""
    return [_SENTINEL_TOKEN - sent] + [_SENTINEL_TOKEN - 1024 - index] * (block_size - 1)


def _sentinel(index: int, tokens: list[int], rank: int) -> bytes:
    """A batch storing a sentinel block of stream ``index`` on ``rank``, in vLLM 0.32's
    layout (an engine hash of its own, from its first token)."""
    engine_hash = _SENTINEL_HASH + 1024 * index + (_SENTINEL_TOKEN - tokens[0])
    store = BlockStored([engine_hash], None, tokens, len(tokens), None, "GPU", None)
    return encode_batch(VllmBatch(time.time(), [store], rank), _SENTINEL_LAYOUT)


def _content_keys(
    rows: Iterable[Mapping[str, Any]], sentinels: frozenset[int]
) -> dict[Key, int | None]:
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
    keys: dict[Key, int | None] = {}
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
