"""A vLLM engine in miniature that publishes real KV events, and an index that follows it.

:class:`SimulatedEngine` reproduces what a vLLM engine with prefix caching publishes: its GPU block
pool (vLLM's ``BlockPool`` and ``FreeKVCacheBlockQueue``), the scheduler's per-step event batches,
and optionally the OffloadingConnector's CPU tier. It runs no model. Token ids go in, and the
engine publishes the frames a real engine would publish for them, on a real ZMQ PUB socket with
vLLM's replay ROUTER (through :class:`kvbridge.adapters.publisher.Publisher`). The events are
encoded in the layout of any vLLM release (:func:`kvbridge.schemas.vllm.layout_for`).

:class:`SyncedIndex` is a :class:`~kvbridge.adapters.dynamo.TieredIndex` fed from one or more
engines by a :class:`~kvbridge.adapters.relay.Relay` on a background thread, so that tests can
check what a router would see.

What the engine does, and the vLLM behaviour it follows
=========================================================

Block hashes
    vLLM's default ``sha256`` algorithm: block ``i`` hashes to
    ``SHA-256(pickle((digest of block i-1, tuple(tokens of block i), None)))``. Block 0 uses
    ``NONE_HASH = SHA-256(pickle(seed))`` as its parent, where the seed is ``"vllm-none-hash"``
    (vLLM 0.29+ without ``PYTHONHASHSEED``). So for the same tokens the engine publishes exactly
    the hashes of a real vLLM 0.29+ engine (no LoRA, multimodal inputs or cache salt). Pickle is
    only used to serialise the engine's own tuples before hashing, as vLLM does; nothing is ever
    unpickled. ``hash_seed`` replaces the seed, as ``PYTHONHASHSEED`` does in vLLM, to reproduce
    engines that disagree on hashes. On the wire a hash is the digest's last 8 bytes as a
    big-endian u64, or the 32 digest bytes with ``bytes_hashes=True`` (vLLM with
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``).

Prefix-cache hits
    A request's leading full blocks that are cached are hits: they are touched (taken out of the
    free queue) and publish nothing. As in vLLM, at most ``(len(prompt) - 1) // block_size``
    blocks can hit, because the last prompt token is always computed. A prompt whose length is a
    multiple of ``block_size`` and whose blocks are all cached therefore recomputes its last
    block into a new GPU block and publishes it again: a second ``BlockStored`` for a hash that is
    already resident. Two GPU blocks then hold that hash, and each one's eviction publishes a
    ``BlockRemoved``. This is why consumers must reference-count.

Stores
    In each engine step the blocks that became full are cached and published as one
    ``BlockStored`` for the request, in block order. Its ``parent_block_hash`` is the hash of the
    block before the first new one (``None`` if the first new block is block 0) and its
    ``token_ids`` cover exactly the new blocks. The other fields are ``block_size``,
    ``lora_id=None``, ``medium="GPU"``, ``lora_name=None``, ``extra_keys=[None] * n``,
    ``group_idx=0`` and ``kv_cache_spec_kind="full_attention"``. The chosen release's layout keeps
    only the fields that release has. The partial last block is never published. During decoding,
    a block that becomes full is published in the step that computes its last token, with the
    generated tokens in ``token_ids``. The last generated token is never computed, as in vLLM, so
    it never fills a published block. A prompt is prefilled in one step unless
    ``max_num_batched_tokens`` splits it into chunks (vLLM's chunked prefill): each chunk's step
    then publishes the blocks it completed.

Evictions
    vLLM's free queue is a single LRU list: blocks that were never used come first (in block id
    order), then freed blocks in the order they were freed. A finished request frees its blocks
    tail first (``reversed(blocks)``), so the tail of a prompt is evicted before its head.
    Allocation takes blocks from the head of the queue whether or not they are cached, and each
    cached block taken publishes one ``BlockRemoved`` with ``medium="GPU"``, ``group_idx=0`` and
    one hash. vLLM evicts while allocating, before the step's blocks are cached, so a step's
    batch holds its removals first and its ``BlockStored`` after them.

Data-parallel rank and batches
    The ``data_parallel_rank`` of every batch is ``dp_rank``. A batch is published only for a step
    that produced events. Engine events come first, then the connector's (CPU tier) events.

CPU tier (``cpu_blocks=N``): vLLM's OffloadingConnector, LRU CPU manager, one block per chunk
    * **Store scheduling.** In every step, the request's full blocks that are not yet on the CPU
      are scheduled for offload. That includes prefix hits whose CPU copy was evicted, and, unless
      ``offload_prompt_only``, decode blocks too. The CPU pool makes room by evicting its least
      recently used ready blocks. The evicted hashes go out as one ``BlockRemoved(medium="CPU")``
      in the same step's batch.
    * **Store publication.** The copy completes one step later. Each offloaded block is then
      published as its own ``BlockStored(medium="CPU")``, in the next batch. They come in block
      order. vLLM iterates a set of hashes there, so a real engine's order is arbitrary and can put
      a child before its parent; ``cpu_store_seed`` shuffles each step's stores reproducibly to
      exercise that. The engine runs that
      extra step at the end of the request, as vLLM keeps a request's blocks until its offload
      finishes. The event is self-describing (tokens, parent, ``block_size``) with
      ``self_describing=True``. Otherwise it is a placeholder: ``token_ids=[]``, ``block_size=0``,
      parent ``None``, ``group_idx=0``.
    * **No duplicate offloads.** A hash already on the CPU is not offloaded again.
    * **Lookups and LRU order.** A request's lookup touches its blocks in the CPU pool (block 0
      becomes the most recently used), as does every offload.
    * **Loads.** On a GPU miss, leading blocks found on the CPU are loaded instead of recomputed,
      like vLLM's asynchronous loads. One step allocates the GPU blocks, publishing evictions only.
      The next step caches the loaded blocks and publishes them as a GPU ``BlockStored``, then
      computes the rest of the prompt. Loaded blocks are not offloaded again.
    * **Releases.** The hashes of CPU events are raw digest bytes before vLLM 0.24. Placeholders
      have ``block_size = block_size`` before 0.20, and no ``group_idx`` before 0.24.

Reset
    :meth:`SimulatedEngine.reset_prefix_cache` uncaches every GPU block and queues an
    ``AllBlocksCleared``. As in vLLM, the event goes out at the start of the *next* step's batch:
    the next :meth:`~SimulatedEngine.generate`, or :meth:`~SimulatedEngine.step` to flush it. By
    default the CPU tier keeps its blocks, as vLLM does without ``reset_external``. It publishes no
    CPU event either way.

Differences from a real engine
    * **Null block.** All ``num_blocks`` blocks are usable. vLLM's ``num_gpu_blocks`` includes
      block 0, the null block.
    * **One request at a time.** Requests run one at a time, each to completion. Its steps and
      its delayed free happen inside :meth:`~SimulatedEngine.generate`, so no batch mixes two
      requests.
    * **Request size.** A request that does not fit in ``num_blocks`` raises :class:`ValueError`.
      vLLM would keep it waiting.
    * **No LoRA, no extra keys.**
    * **Hashes before 0.10.2.** Layouts older than 0.10.2 get the same u64 hashes. Those releases
      used Python's ``hash()``, so their ints could be negative.
"""

from __future__ import annotations

import hashlib
import pickle
import random
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Final, Self

from kvbridge.adapters.dynamo import Overlap, TieredIndex
from kvbridge.adapters.publisher import DEFAULT_BUFFER_STEPS, Publisher, should_bind
from kvbridge.adapters.relay import Relay
from kvbridge.adapters.zmq import Source
from kvbridge.schemas.tiers import Tier
from kvbridge.schemas.vllm import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    Event,
    Layout,
    VllmBatch,
    decode_batch,
    encode_batch,
    layout_for,
)

__all__ = ["BlockHash", "Completion", "SimulatedEngine", "SyncedIndex"]

DEFAULT_HASH_SEED: Final = "vllm-none-hash"
"""The seed of vLLM 0.29+'s NONE_HASH for sha256 when ``PYTHONHASHSEED`` is not set."""

_MAX_TOKEN: Final = 0xFFFF_FFFF
_RELEASE: Final = re.compile(r"^v?(\d+(?:\.\d+)*)")


def _release_key(release: str) -> tuple[int, ...]:
    match = _RELEASE.match(release.strip())
    if match is None:
        raise ValueError(f"not a vLLM release: {release!r}")
    return tuple(int(part) for part in match[1].split("."))


def _sha256(value: object) -> bytes:
    """vLLM's ``sha256`` hash function: SHA-256 of the pickled value (highest protocol)."""
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _u64(digest: bytes) -> int:
    """vLLM's int form of a digest: its low 64 bits, i.e. the last 8 bytes big-endian."""
    return int.from_bytes(digest[-8:], "big")


class Completion:
    """What :meth:`SimulatedEngine.generate` did for one request."""

    __slots__ = ("num_cached_tokens", "num_external_tokens", "output_token_ids", "prompt_token_ids")

    def __init__(
        self,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        num_cached_tokens: int,
        num_external_tokens: int,
    ) -> None:
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids = output_token_ids
        """The generated tokens (:meth:`SimulatedEngine.output_token` of their positions)."""
        self.num_cached_tokens = num_cached_tokens
        """Prompt tokens found in the GPU prefix cache (vLLM's ``num_cached_tokens``)."""
        self.num_external_tokens = num_external_tokens
        """Prompt tokens loaded from the CPU tier instead of being recomputed."""

    @property
    def token_ids(self) -> list[int]:
        """Prompt and output tokens, the sequence whose KV the engine holds (but the last)."""
        return self.prompt_token_ids + self.output_token_ids

    def __repr__(self) -> str:
        return (
            f"Completion(prompt={len(self.prompt_token_ids)} tokens, "
            f"output={self.output_token_ids}, num_cached_tokens={self.num_cached_tokens}, "
            f"num_external_tokens={self.num_external_tokens})"
        )


class _GpuBlock:
    __slots__ = ("block_id", "digest", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.digest: bytes | None = None
        """The block's hash while it is cached (vLLM's ``block_hash``)."""
        self.ref_cnt = 0


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


class _Request:
    __slots__ = (
        "blocks",
        "digests",
        "next_offload",
        "num_cached",
        "num_computed",
        "num_prompt",
        "tokens",
    )

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.num_prompt = len(tokens)
        self.digests: list[bytes] = []
        """The hashes of every full block of ``tokens`` (vLLM's ``request.block_hashes``)."""
        self.blocks: list[_GpuBlock] = []
        self.num_computed = 0
        self.num_cached = 0
        """Blocks already cached (vLLM's ``num_cached_block``)."""
        self.next_offload = 0
        """First block the connector has not yet scheduled for offload."""


class SimulatedEngine:
    """A vLLM engine in miniature: a prefix-cached GPU block pool (and optionally a CPU offload
    tier) that publishes vLLM's KV events over ZMQ, with a replay socket.

    See the module documentation for the exact behaviour. The engine is not thread-safe: call it
    from one thread (the replay socket is served by a thread of its own).

    Args:
        endpoint: PUB address. Bound by default (``tcp://127.0.0.1:0`` picks a free port; read the
            actual address from :attr:`endpoint`).
        replay_endpoint: replay ROUTER address (always bound), or ``None`` for no replay socket.
        num_blocks: GPU blocks in the pool.
        block_size: tokens per block.
        cpu_blocks: blocks in the CPU offload tier; ``None`` (default) means no CPU tier.
        self_describing: CPU stores carry tokens, parent and block size (vLLM 0.24+'s
            ``self_describing_kv_events``) instead of placeholders.
        offload_prompt_only: offload only the prompt's blocks (vLLM 0.33's default for the
            OffloadingConnector); by default decode blocks are offloaded too.
        release: the vLLM release whose wire layout, replay layout and CPU-event conventions to
            reproduce.
        topic: frame 0 of every message (vLLM's ``KVEventsConfig.topic``).
        dp_rank: the data-parallel rank written into every batch.
        hash_seed: seed of the hash chain (like ``PYTHONHASHSEED``); ``None`` gives vLLM 0.29+'s
            default hashes. Engines with different seeds publish different hashes for the same
            tokens.
        bytes_hashes: publish the 32-byte digests instead of u64s (vLLM 0.10.2+ with
            ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``).
        cpu_store_seed: shuffle each step's CPU stores with ``random.Random(cpu_store_seed)``
            (vLLM's order is arbitrary); ``None`` keeps block order.
        max_num_batched_tokens: token budget per step; longer prompts are prefilled in chunks.
            ``None`` prefills every prompt in one step.
        buffer_steps: replay ring size, in batches.
        bind: bind (``True``, default) or connect (``False``) the PUB socket; ``None`` applies
            vLLM's rule (bind only for ``*``, ``::``, ``ipc://`` and ``inproc://`` endpoints).

    Raises:
        ValueError: an argument is out of range, or the release cannot do what is asked (KV events
            start at 0.9.0, bytes hashes at 0.10.2, the CPU tier at 0.11.0, self-describing CPU
            events at 0.24.0).
    """

    def __init__(
        self,
        endpoint: str = "tcp://127.0.0.1:0",
        *,
        replay_endpoint: str | None = "tcp://127.0.0.1:0",
        num_blocks: int = 64,
        block_size: int = 16,
        cpu_blocks: int | None = None,
        self_describing: bool = False,
        offload_prompt_only: bool = False,
        cpu_store_seed: int | None = None,
        release: str = "0.32.0",
        topic: str = "",
        dp_rank: int = 0,
        hash_seed: bytes | str | None = None,
        bytes_hashes: bool = False,
        max_num_batched_tokens: int | None = None,
        buffer_steps: int = DEFAULT_BUFFER_STEPS,
        bind: bool | None = True,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if cpu_blocks is not None and cpu_blocks <= 0:
            raise ValueError(f"cpu_blocks must be positive (or None), got {cpu_blocks}")
        if dp_rank < 0:
            raise ValueError(f"dp_rank must be >= 0, got {dp_rank}")
        if max_num_batched_tokens is not None and max_num_batched_tokens <= 0:
            raise ValueError(
                f"max_num_batched_tokens must be positive, got {max_num_batched_tokens}"
            )
        layout = layout_for(release)
        version = _release_key(release)
        if bytes_hashes and version < (0, 10, 2):
            raise ValueError(f"vLLM {release} publishes int hashes only (bytes from 0.10.2)")
        if cpu_blocks is not None and version < (0, 11):
            raise ValueError(f"vLLM {release} has no OffloadingConnector (0.11.0+)")
        if self_describing and version < (0, 24):
            raise ValueError(f"vLLM {release} has no self-describing CPU events (0.24.0+)")
        if self_describing and cpu_blocks is None:
            raise ValueError("self_describing needs a CPU tier (cpu_blocks)")

        self._layout: Final = layout
        self._release: Final = release
        self._num_blocks: Final = num_blocks
        self._block_size: Final = block_size
        self._cpu_capacity: Final = cpu_blocks
        self._self_describing: Final = self_describing
        self._offload_prompt_only: Final = offload_prompt_only
        self._dp_rank: Final = dp_rank
        self._bytes_hashes: Final = bytes_hashes
        self._max_batched: Final = max_num_batched_tokens
        self._cpu_shuffle: Final = None if cpu_store_seed is None else random.Random(cpu_store_seed)
        self._buffer_steps: Final = buffer_steps
        self._cpu_bytes: Final = version < (0, 24)
        """CPU events carry raw digests before 0.24 (even when GPU events carry ints)."""
        self._cpu_group: Final = 0 if version >= (0, 24) else None
        self._placeholder_size: Final = block_size if version < (0, 20) else 0
        seed = DEFAULT_HASH_SEED if hash_seed is None else hash_seed
        self._none_hash: Final = _sha256(seed)

        self.published: list[VllmBatch] = []
        """The batches published since construction or the last :meth:`restart`, as decoded from
        the wire (fields the release lacks are ``None``); ``published[seq]`` is batch ``seq``."""
        self._total_published = 0
        self._closed = False
        self._reset_state()

        self._publisher = Publisher(
            endpoint,
            replay_endpoint=replay_endpoint,
            topic=topic,
            buffer_steps=buffer_steps,
            replay_topic_frame=version >= (0, 26),
            bind=bind,
        )
        self._subscriber_binds: Final = not (should_bind(endpoint) if bind is None else bind)
        if replay_endpoint is not None:
            try:
                self._publisher.start_replay_thread()
            except BaseException:
                self._publisher.close()
                raise

    def _reset_state(self) -> None:
        self._blocks = [_GpuBlock(block_id) for block_id in range(self._num_blocks)]
        self._free: OrderedDict[int, _GpuBlock] = OrderedDict(
            (block.block_id, block) for block in self._blocks
        )
        """vLLM's FreeKVCacheBlockQueue: head = next block to allocate (least recently used)."""
        self._cached: dict[bytes, dict[int, _GpuBlock]] = {}
        """vLLM's cached_block_hash_to_block: every GPU block holding a hash, first copy first."""
        self._cpu: OrderedDict[bytes, _CpuBlock] = OrderedDict()
        """The CPU tier in LRU order (head = next to evict)."""
        self._engine_events: list[Event] = []
        """The block pool's event queue, taken at the end of each step."""
        self._connector_events: list[Event] = []
        self._offloading: list[_Offload] = []
        """Offloads scheduled in the current step."""
        self._in_flight: list[_Offload] = []
        """Offloads scheduled in the previous step, completing at the end of this one."""

    # ------------------------------------------------------------------ properties

    @property
    def endpoint(self) -> str:
        """The PUB socket's actual address (ephemeral port resolved)."""
        return self._publisher.endpoint

    @property
    def replay_endpoint(self) -> str | None:
        """The replay ROUTER's actual address, or ``None`` without a replay socket."""
        return self._publisher.replay_endpoint

    @property
    def topic(self) -> str:
        return self._publisher.topic

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def cpu_blocks(self) -> int | None:
        return self._cpu_capacity

    @property
    def dp_rank(self) -> int:
        return self._dp_rank

    @property
    def release(self) -> str:
        return self._release

    @property
    def layout(self) -> Layout:
        """The wire layout of :attr:`release`."""
        return self._layout

    @property
    def buffer_steps(self) -> int:
        return self._buffer_steps

    @property
    def last_seq(self) -> int | None:
        """The seq of the last published batch since the last restart, or ``None``."""
        return len(self.published) - 1 if self.published else None

    @property
    def total_published(self) -> int:
        """Batches published since construction, across restarts."""
        return self._total_published

    def source(self, worker_id: int = 0) -> Source:
        """The :class:`~kvbridge.adapters.zmq.Source` a kvbridge subscriber uses for this engine.

        It connects to the bound PUB socket (``bind=False``) even though the address has no
        wildcard, which under vLLM's rule would make the subscriber bind.
        """
        return Source(
            self.endpoint,
            self.replay_endpoint,
            worker_id,
            topic=self.topic,
            bind=self._subscriber_binds,
        )

    # ------------------------------------------------------------------ hashes

    def _chain(self, tokens: Sequence[int], parent: bytes | None, start: int) -> list[bytes]:
        size = self._block_size
        digests: list[bytes] = []
        for begin in range(start * size, len(tokens) - size + 1, size):
            parent = _sha256(
                (
                    self._none_hash if parent is None else parent,
                    tuple(tokens[begin : begin + size]),
                    None,
                )
            )
            digests.append(parent)
        return digests

    def _wire(self, digest: bytes) -> BlockHash:
        return digest if self._bytes_hashes else _u64(digest)

    def _cpu_wire(self, digest: bytes) -> BlockHash:
        return digest if self._cpu_bytes else self._wire(digest)

    def block_hashes(self, token_ids: Sequence[int]) -> list[BlockHash]:
        """The hashes this engine publishes for the full blocks of ``token_ids``, in order."""
        return [self._wire(digest) for digest in self._chain(_tokens(token_ids), None, 0)]

    @staticmethod
    def output_token(position: int) -> int:
        """The token the engine generates at ``position`` (0-based in the whole sequence)."""
        return 1000 + (position * 7919) % 30000

    # ------------------------------------------------------------------ requests

    def generate(self, prompt_token_ids: Sequence[int], max_tokens: int = 0) -> Completion:
        """Run one request to completion, publishing one batch per engine step that has events.

        ``max_tokens`` tokens are generated after the prompt (0: prefill only; vLLM's minimum of 1
        gives the same events, since the last generated token is never computed).

        Raises:
            ValueError: the prompt is empty, a token is not a u32, ``max_tokens`` is negative, or
                the request needs more than ``num_blocks`` blocks.
            RuntimeError: the engine is closed.
        """
        self._check_open()
        tokens = _tokens(prompt_token_ids)
        if not tokens:
            raise ValueError("the prompt is empty")
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        size = self._block_size
        needed = -(-(len(tokens) + max(max_tokens, 1) - 1) // size)
        if needed > self._num_blocks:
            raise ValueError(
                f"the request needs {needed} blocks of {size} tokens; the pool has "
                f"{self._num_blocks}"
            )
        request = _Request(tokens)
        request.digests = self._chain(tokens, None, 0)
        prompt_len = len(tokens)

        # Admission (vLLM's schedule() for a waiting request): local hits, then the CPU tier.
        hits = self._find_cache_hit(request)
        for block in hits:
            self._touch(block)
        request.blocks = list(hits)
        request.num_cached = len(hits)
        request.num_computed = len(hits) * size
        cached_tokens = request.num_computed
        external = self._match_cpu(request, len(hits))
        if external:
            self._load(request, len(hits), external)

        # Prefill, in chunks if a token budget is set.
        while request.num_computed < prompt_len:
            budget = prompt_len - request.num_computed
            if self._max_batched is not None:
                budget = min(budget, self._max_batched)
            self._compute(request, budget)

        # Decode: the token sampled in a step is computed in the next one.
        output: list[int] = []
        for index in range(max_tokens):
            token = self.output_token(len(request.tokens))
            self._append(request, token)
            output.append(token)
            if index < max_tokens - 1:
                self._compute(request, 1)

        # The request finishes; vLLM frees its blocks once its offloads have completed.
        while self._in_flight or self._offloading:
            self._end_step()
        self._free_request(request)
        return Completion(tokens[:prompt_len], output, cached_tokens, external * size)

    def _append(self, request: _Request, token: int) -> None:
        request.tokens.append(token)
        full = len(request.tokens) // self._block_size
        if full > len(request.digests):
            parent = request.digests[-1] if request.digests else None
            request.digests.extend(self._chain(request.tokens, parent, len(request.digests)))

    def _find_cache_hit(self, request: _Request) -> list[_GpuBlock]:
        """The leading cached blocks, leaving the last prompt token to compute."""
        limit = (len(request.tokens) - 1) // self._block_size
        hits: list[_GpuBlock] = []
        for digest in request.digests[:limit]:
            copies = self._cached.get(digest)
            if not copies:
                break
            hits.append(next(iter(copies.values())))
        return hits

    def _touch(self, block: _GpuBlock) -> None:
        if block.ref_cnt == 0:
            del self._free[block.block_id]
        block.ref_cnt += 1

    def _compute(self, request: _Request, num_new_tokens: int) -> None:
        """One engine step computing ``num_new_tokens`` tokens of the request."""
        total = request.num_computed + num_new_tokens
        self._allocate(request, total)
        self._cache(request, min(total, len(request.tokens)))
        if self._cpu_capacity is not None:
            self._schedule_offload(request, total)
        request.num_computed = total
        self._end_step()

    def _allocate(self, request: _Request, num_tokens: int) -> None:
        """Give the request blocks for ``num_tokens`` tokens, taken from the free queue's head."""
        needed = -(-num_tokens // self._block_size) - len(request.blocks)
        for _ in range(needed):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            request.blocks.append(block)

    def _evict(self, block: _GpuBlock) -> None:
        digest = block.digest
        if digest is None:
            return
        copies = self._cached[digest]
        del copies[block.block_id]
        if not copies:
            del self._cached[digest]
        block.digest = None
        self._engine_events.append(BlockRemoved([self._wire(digest)], medium="GPU", group_idx=0))

    def _cache(self, request: _Request, num_tokens: int) -> None:
        """Cache the blocks that ``num_tokens`` fill (vLLM's cache_full_blocks): one BlockStored."""
        size = self._block_size
        first, full = request.num_cached, num_tokens // size
        if full <= first:
            return
        for index in range(first, full):
            block, digest = request.blocks[index], request.digests[index]
            block.digest = digest
            self._cached.setdefault(digest, {})[block.block_id] = block
        parent = request.digests[first - 1] if first else None
        count = full - first
        self._engine_events.append(
            BlockStored(
                [self._wire(digest) for digest in request.digests[first:full]],
                None if parent is None else self._wire(parent),
                request.tokens[first * size : full * size],
                size,
                None,
                medium="GPU",
                lora_name=None,
                extra_keys=[None] * count,
                group_idx=0,
                kv_cache_spec_kind="full_attention",
            )
        )
        request.num_cached = full

    def _free_request(self, request: _Request) -> None:
        """vLLM's ``BlockPool.free_blocks`` (0.23+): tail first; a freed block that holds no hash
        (the partial last block) goes to the head of the free queue, to be reused before any
        cached block is evicted."""
        for block in reversed(request.blocks):
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
                if block.digest is None:
                    self._free.move_to_end(block.block_id, last=False)
        request.blocks = []

    # ------------------------------------------------------------------ the CPU tier

    def _cpu_touch(self, digests: Sequence[bytes]) -> None:
        for digest in reversed(digests):
            if digest in self._cpu:
                self._cpu.move_to_end(digest)

    def _match_cpu(self, request: _Request, start: int) -> int:
        """vLLM's get_num_new_matched_tokens: touch the request's blocks, then count the ready
        CPU blocks that follow the local hits."""
        if self._cpu_capacity is None:
            return 0
        full = len(request.tokens) // self._block_size
        self._cpu_touch(request.digests[:full])
        hits = 0
        for digest in request.digests[start:full]:
            block = self._cpu.get(digest)
            if block is None or not block.ready:
                break
            hits += 1
        return hits

    def _load(self, request: _Request, start: int, count: int) -> None:
        """An asynchronous load of ``count`` CPU blocks: one step allocates, the next caches."""
        size = self._block_size
        loading = request.digests[start : start + count]
        for digest in loading:
            self._cpu[digest].ref_cnt += 1
        self._allocate(request, (start + count) * size)
        request.next_offload = start + count
        self._end_step()
        for digest in loading:
            self._cpu[digest].ref_cnt -= 1
        computed = min(len(request.blocks) * size, len(request.tokens))
        if computed == len(request.tokens):
            computed -= 1  # the last token is always computed
        self._cache(request, computed)
        request.num_computed = computed

    def _schedule_offload(self, request: _Request, total_tokens: int) -> None:
        """vLLM's OffloadingConnector scheduling the request's newly full blocks for offload."""
        size = self._block_size
        if self._offload_prompt_only:
            total_tokens = min(total_tokens, request.num_prompt)
        full = min(total_tokens, len(request.tokens)) // size
        start = request.next_offload
        if full <= start:
            return
        wanted = request.digests[start:full]
        stored = self._prepare_store(wanted)
        if stored is None:
            return  # no room: vLLM logs a warning and retries in the next step
        request.next_offload = full
        if not stored:
            return
        self._cpu_touch(request.digests[:full])
        reserved = set(stored)
        offloads = [
            _Offload(
                digest,
                request.digests[index - 1] if index else None,
                request.tokens[index * size : (index + 1) * size],
            )
            for index, digest in enumerate(request.digests[start:full], start)
            if digest in reserved
        ]
        if self._cpu_shuffle is not None:
            self._cpu_shuffle.shuffle(offloads)
        self._offloading.extend(offloads)

    def _prepare_store(self, digests: list[bytes]) -> list[bytes] | None:
        """vLLM's LRU offloading manager: make room, evicting the least recently used ready
        blocks (one batched CPU removal), and reserve blocks for the hashes not yet stored."""
        assert self._cpu_capacity is not None
        to_store = [digest for digest in digests if digest not in self._cpu]
        excess = len(self._cpu) + len(to_store) - self._cpu_capacity
        evict: list[bytes] = []
        if excess > 0:
            protected = set(digests)
            for digest, block in self._cpu.items():
                if block.ready and block.ref_cnt == 0 and digest not in protected:
                    evict.append(digest)
                    if len(evict) == excess:
                        break
            else:
                return None
        for digest in evict:
            del self._cpu[digest]
        if evict:
            self._connector_events.append(
                BlockRemoved(
                    [self._cpu_wire(digest) for digest in evict],
                    medium="CPU",
                    group_idx=self._cpu_group,
                )
            )
        for digest in to_store:
            self._cpu[digest] = _CpuBlock()
        return to_store

    def _complete_offloads(self) -> None:
        """The copies scheduled in the previous step complete: one CPU BlockStored per block."""
        size = self._block_size
        for offload in self._in_flight:
            block = self._cpu.get(offload.digest)
            if block is None:
                continue
            block.ready = True
            if self._self_describing:
                event = BlockStored(
                    [self._cpu_wire(offload.digest)],
                    None if offload.parent is None else self._cpu_wire(offload.parent),
                    offload.tokens,
                    size,
                    None,
                    medium="CPU",
                    lora_name=None,
                    group_idx=self._cpu_group,
                    kv_cache_spec_kind="full_attention",
                )
            else:
                event = BlockStored(
                    [self._cpu_wire(offload.digest)],
                    None,
                    [],
                    self._placeholder_size,
                    None,
                    medium="CPU",
                    lora_name=None,
                    group_idx=self._cpu_group,
                )
            self._connector_events.append(event)
        self._in_flight, self._offloading = self._offloading, []

    # ------------------------------------------------------------------ steps and publishing

    def _end_step(self) -> VllmBatch | None:
        """The end of an engine step: complete last step's offloads, publish the events."""
        if self._cpu_capacity is not None:
            self._complete_offloads()
        events = self._engine_events + self._connector_events
        self._engine_events, self._connector_events = [], []
        if not events:
            return None
        payload = encode_batch(VllmBatch(time.time(), events, self._dp_rank), self._layout)
        self._publisher.publish(payload)
        batch = decode_batch(payload)
        self.published.append(batch)
        self._total_published += 1
        return batch

    def step(self) -> VllmBatch | None:
        """Run one engine step without a new request, publishing what is queued (a reset's
        ``AllBlocksCleared``). Returns the batch, or ``None`` when there was nothing to publish."""
        self._check_open()
        return self._end_step()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the engine is closed")

    def reset_prefix_cache(self, *, reset_external: bool = False) -> bool:
        """Uncache every GPU block and queue an ``AllBlocksCleared`` for the next step.

        ``reset_external`` also empties the CPU tier, without publishing anything for it (as vLLM's
        ``reset_prefix_cache?reset_external=true``). Returns ``True`` (vLLM returns ``False`` while
        a request holds blocks, which cannot happen between calls here).
        """
        for block in self._blocks:
            block.digest = None
        self._cached.clear()
        self._engine_events.append(AllBlocksCleared())
        if reset_external:
            self._cpu.clear()
        return True

    def restart(self) -> None:
        """Restart the engine: seqs start at 0 again, the replay buffer, both pools and
        :attr:`published` are emptied. Nothing is published."""
        self._publisher.restart()
        self.published = []
        self._reset_state()

    def wait_for_subscribers(self, count: int = 1, *, timeout: float = 5.0) -> bool:
        """Wait until ``count`` subscribers are connected (ZMQ drops what a PUB socket sends
        before then). Returns ``False`` on timeout."""
        return self._publisher.wait_for_subscribers(count, timeout=timeout)

    # ------------------------------------------------------------------ state

    def resident_hashes(self, medium: str = "GPU") -> list[BlockHash]:
        """The hashes cached on ``medium`` (``"GPU"`` or ``"CPU"``), in the order eviction would
        take them (least recently used first), each once, in their published form."""
        kind = medium.upper()
        if kind == "GPU":
            seen: dict[bytes, None] = {}
            free = [block for block in self._free.values() if block.digest is not None]
            used = [b for b in self._blocks if b.ref_cnt and b.digest is not None]
            for block in free + used:
                assert block.digest is not None
                seen.setdefault(block.digest, None)
            return [self._wire(digest) for digest in seen]
        if kind == "CPU":
            return [self._cpu_wire(d) for d, block in self._cpu.items() if block.ready]
        raise ValueError(f"unknown medium {medium!r} (GPU or CPU)")

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Close the sockets. Idempotent."""
        self._closed = True
        self._publisher.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"SimulatedEngine(endpoint={self.endpoint!r}, "
            f"replay_endpoint={self.replay_endpoint!r}, "
            f"release={self._release!r}, block_size={self._block_size}, "
            f"num_blocks={self._num_blocks}, cpu_blocks={self._cpu_capacity}, "
            f"dp_rank={self._dp_rank})"
        )


def _tokens(token_ids: Sequence[int]) -> list[int]:
    tokens = list(token_ids)
    for token in tokens:
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token <= _MAX_TOKEN:
            raise ValueError(f"token ids must be ints in [0, 2**32), got {token!r}")
    return tokens


_STEP_MS: Final = 20
"""How long one relay step waits for frames, bounding how fast the relay thread parks or stops."""


class SyncedIndex(TieredIndex):
    """A :class:`~kvbridge.adapters.dynamo.TieredIndex` fed live from simulated engines.

    A background thread runs a :class:`~kvbridge.adapters.relay.Relay` that subscribes to every
    engine (with its replay socket) and applies the canonical events to this index, exactly as
    ``kvbridge`` would feed it from real vLLM workers. Engine ``i`` is worker ``worker_ids[i]``
    (``i`` by default); give two engines the same worker id and different ``dp_rank`` to model one
    worker with two data-parallel ranks.

    Reading and thread safety: :meth:`sync` waits until the relay has processed every batch the
    engines have published so far, then *parks* the relay thread, so the index does not change
    until the next :meth:`sync`. The read methods (:meth:`overlap`, :meth:`resident`,
    :meth:`workers`, :meth:`dump`, :meth:`engine_overlap`) call :meth:`sync` first, so they
    always see everything published before the call. Frames published while the thread is
    parked wait in the subscriber's queue. Call it from the thread that drives the engines.

    The index subscribes when it is created (and waits for each engine to see the subscriber),
    so create it before the engines publish. A batch published earlier is recovered through the
    replay socket once the engine publishes another one, as kvbridge recovers from ZMQ's slow
    joiner.

    Args:
        engines: the engine, or engines, to follow. They must share one block size.
        worker_ids: the worker id of each engine.
        timeout: the default of :meth:`sync`, in seconds.
    """

    def __init__(
        self,
        engines: SimulatedEngine | Sequence[SimulatedEngine],
        *,
        worker_ids: Sequence[int] | None = None,
        timeout: float = 5.0,
    ) -> None:
        followed = [engines] if isinstance(engines, SimulatedEngine) else list(engines)
        if not followed:
            raise ValueError("give at least one engine")
        ids = list(range(len(followed))) if worker_ids is None else list(worker_ids)
        if len(ids) != len(followed):
            raise ValueError("give one worker id per engine")
        sizes = {engine.block_size for engine in followed}
        if len(sizes) != 1:
            raise ValueError(f"the engines disagree on the block size: {sorted(sizes)}")
        block_size = sizes.pop()
        super().__init__(block_size)
        self._engines: Final = followed
        self._worker_ids: Final = dict(zip(map(id, followed), ids, strict=True))
        self.timeout = timeout
        # Batches no replay can bring back: those of earlier runs, and those past the buffer.
        self._unrecoverable = sum(
            engine.total_published - min(len(engine.published), engine.buffer_steps)
            for engine in followed
        )
        self._relay = Relay(
            [engine.source(worker) for engine, worker in zip(followed, ids, strict=True)],
            block_size=block_size,
            index=self,
        )
        self._cond = threading.Condition()
        self._parked = False
        self._busy = False
        self._stopping = False
        self._processed = 0
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvbridge-synced-index", daemon=True)
        self._thread.start()
        for engine in followed:
            if not engine.wait_for_subscribers(timeout=timeout):
                self.close()
                raise TimeoutError(f"no subscription reached {engine.endpoint} in {timeout} s")

    # ------------------------------------------------------------------ the relay thread

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._parked and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                self._busy = True
            try:
                self._relay.step(_STEP_MS)
            except BaseException as error:
                with self._cond:
                    self._error = error
                    self._busy = False
                    self._cond.notify_all()
                return
            with self._cond:
                self._busy = False
                self._processed = self._relay.stats["batches_in"]
                self._cond.notify_all()

    def sync(self, timeout: float | None = None) -> Self:
        """Wait until the relay has processed every batch published so far, then park it.

        Returns this index, safe to read until the next :meth:`sync`.

        Raises:
            TimeoutError: the relay did not catch up within ``timeout`` seconds (default
                :attr:`timeout`).
            RuntimeError: the relay thread failed, or the index is closed.
        """
        if self._closed:
            raise RuntimeError("the index is closed")
        wait = self.timeout if timeout is None else timeout
        target = sum(engine.total_published for engine in self._engines) - self._unrecoverable
        with self._cond:
            self._parked = False
            self._cond.notify_all()
            caught_up = self._cond.wait_for(
                lambda: self._error is not None or self._processed >= target, wait
            )
            self._parked = True
            self._cond.wait_for(lambda: not self._busy, max(wait, 1.0))
            error, processed = self._error, self._processed
        if error is not None:
            raise RuntimeError("the relay thread failed") from error
        if not caught_up:
            raise TimeoutError(
                f"the relay processed {processed} of {target} batches in {wait} s (batches "
                "published before the index subscribed are replayed only when the engine "
                "publishes again)"
            )
        return self

    @property
    def relay(self) -> Relay:
        """The relay feeding this index (its ``stats`` and per-worker normalizers). Read it after
        :meth:`sync` only."""
        return self._relay

    # ------------------------------------------------------------------ reads

    def overlap(
        self,
        token_ids: Sequence[int],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> dict[tuple[int, int], Overlap]:
        """:meth:`TieredIndex.overlap`, after :meth:`sync`."""
        self.sync()
        return super().overlap(token_ids, lora_name=lora_name, cache_salt=cache_salt)

    def engine_overlap(
        self, token_ids: Sequence[int], engine: SimulatedEngine | None = None
    ) -> Overlap:
        """The overlap of ``token_ids`` on one engine's worker and rank (the only engine by
        default); all zero when it holds none of the blocks."""
        if engine is None:
            if len(self._engines) != 1:
                raise ValueError("this index follows several engines: name one")
            engine = self._engines[0]
        key = (self._worker_ids[id(engine)], engine.dp_rank)
        return self.overlap(token_ids).get(key, Overlap())

    def resident(self, worker_id: int, dp_rank: int = 0) -> dict[Tier, int]:
        """:meth:`TieredIndex.resident`, after :meth:`sync`."""
        self.sync()
        return super().resident(worker_id, dp_rank)

    def workers(self) -> list[tuple[int, int]]:
        """:meth:`TieredIndex.workers`, after :meth:`sync`."""
        self.sync()
        return super().workers()

    def dump(self) -> dict[str, list[dict[str, Any]]]:
        """:meth:`TieredIndex.dump`, after :meth:`sync`."""
        self.sync()
        return super().dump()

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Stop the relay thread and close its sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join()
        self._relay.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
