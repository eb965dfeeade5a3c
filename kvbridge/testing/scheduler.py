"""One request at a time through the simulated engine's pools, step by step as vLLM's scheduler
takes it: admission (prefix hits, then loads from the CPU tier), chunked prefill, decode,
offloads, and the free once its offloads are done (docs/simulator.md)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvbridge.schemas.vllm import Event
from kvbridge.testing.cpu_tier import CpuTier
from kvbridge.testing.gpu_pool import GpuBlock, GpuPool
from kvbridge.testing.vllm_hashes import block_digests

__all__ = ["Completion", "Scheduler"]


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
        self.blocks: list[GpuBlock] = []
        self.num_computed = 0
        self.num_cached = 0
        """Blocks already cached (vLLM's ``num_cached_block``)."""
        self.next_offload = 0
        """First block the connector has not yet scheduled for offload."""


class Scheduler:
    """Runs requests through a GPU pool and an optional CPU tier, handing each engine step's
    events to ``publish``.

    Args:
        gpu: the GPU block pool.
        cpu: the CPU tier, or ``None``.
        block_size: tokens per block.
        root: the hash chain's ``NONE_HASH`` (:func:`~kvbridge.testing.vllm_hashes.none_hash`).
        max_num_batched_tokens: token budget per step, or ``None`` for one-step prefills.
        offload_prompt_only: offload the prompt's blocks only.
        publish: called with the events of every step that ends.
        output_token: the token generated at a position of the sequence.
    """

    def __init__(
        self,
        gpu: GpuPool,
        cpu: CpuTier | None,
        *,
        block_size: int,
        root: bytes,
        max_num_batched_tokens: int | None,
        offload_prompt_only: bool,
        publish: Callable[[list[Event]], object],
        output_token: Callable[[int], int],
    ) -> None:
        self.gpu = gpu
        self.cpu = cpu
        self._block_size = block_size
        self._root = root
        self._max_batched = max_num_batched_tokens
        self._offload_prompt_only = offload_prompt_only
        self._publish = publish
        self._output_token = output_token

    def _chain(self, tokens: Sequence[int], parent: bytes | None, start: int) -> list[bytes]:
        return block_digests(tokens, self._block_size, self._root, parent=parent, start=start)

    def digests(self, tokens: Sequence[int]) -> list[bytes]:
        """The digests of the full blocks of ``tokens``."""
        return self._chain(tokens, None, 0)

    def end_step(self) -> list[Event]:
        """The end of an engine step: last step's offloads complete; the step's events, the
        pool's before the connector's, are taken from their queues."""
        events, self.gpu.events = self.gpu.events, []
        if self.cpu is not None:
            self.cpu.complete()
            events, self.cpu.events = events + self.cpu.events, []
        return events

    def run(self, tokens: list[int], max_tokens: int) -> Completion:
        """Run one request to completion (the caller checked that it fits in the pool)."""
        size = self._block_size
        request = _Request(tokens)
        request.digests = self.digests(tokens)
        prompt_len = len(tokens)

        # Admission (vLLM's schedule() for a waiting request): local hits, then the CPU tier.
        hits = self._find_cache_hit(request)
        for block in hits:
            self.gpu.touch(block)
        request.blocks = list(hits)
        request.num_cached = len(hits)
        request.num_computed = len(hits) * size
        cached_tokens = request.num_computed
        external = self._match_cpu(request, len(hits))
        if external and self.cpu is not None:
            self._load(self.cpu, request, len(hits), external)

        # Prefill, in chunks if a token budget is set.
        while request.num_computed < prompt_len:
            budget = prompt_len - request.num_computed
            if self._max_batched is not None:
                budget = min(budget, self._max_batched)
            self._compute(request, budget)

        # Decode: the token sampled in a step is computed in the next one.
        output: list[int] = []
        for index in range(max_tokens):
            token = self._output_token(len(request.tokens))
            self._append(request, token)
            output.append(token)
            if index < max_tokens - 1:
                self._compute(request, 1)

        # The request finishes; vLLM frees its blocks once its offloads have completed.
        while self.cpu is not None and self.cpu.copying:
            self._publish(self.end_step())
        self.gpu.free(request.blocks)
        request.blocks = []
        return Completion(tokens[:prompt_len], output, cached_tokens, external * size)

    def _append(self, request: _Request, token: int) -> None:
        request.tokens.append(token)
        full = len(request.tokens) // self._block_size
        if full > len(request.digests):
            parent = request.digests[-1] if request.digests else None
            request.digests.extend(self._chain(request.tokens, parent, len(request.digests)))

    def _find_cache_hit(self, request: _Request) -> list[GpuBlock]:
        """The leading cached blocks, leaving the last prompt token to compute."""
        limit = (len(request.tokens) - 1) // self._block_size
        return self.gpu.cache_hits(request.digests[:limit])

    def _compute(self, request: _Request, num_new_tokens: int) -> None:
        """One engine step computing ``num_new_tokens`` tokens of the request."""
        total = request.num_computed + num_new_tokens
        self._allocate(request, total)
        self._cache(request, min(total, len(request.tokens)))
        if self.cpu is not None:
            self._schedule_offload(self.cpu, request, total)
        request.num_computed = total
        self._publish(self.end_step())

    def _allocate(self, request: _Request, num_tokens: int) -> None:
        """Give the request blocks for ``num_tokens`` tokens, taken from the free queue's head."""
        needed = -(-num_tokens // self._block_size) - len(request.blocks)
        request.blocks.extend(self.gpu.allocate(needed))

    def _cache(self, request: _Request, num_tokens: int) -> None:
        """Cache the blocks that ``num_tokens`` fill (vLLM's cache_full_blocks): one BlockStored."""
        size = self._block_size
        first, full = request.num_cached, num_tokens // size
        if full <= first:
            return
        self.gpu.cache(
            request.blocks[first:full],
            request.digests[first:full],
            request.digests[first - 1] if first else None,
            request.tokens[first * size : full * size],
            size,
        )
        request.num_cached = full

    def _match_cpu(self, request: _Request, start: int) -> int:
        """vLLM's get_num_new_matched_tokens: touch the request's blocks, then count the ready
        CPU blocks that follow the local hits."""
        if self.cpu is None:
            return 0
        full = len(request.tokens) // self._block_size
        self.cpu.touch(request.digests[:full])
        return self.cpu.ready_prefix(request.digests[start:full])

    def _load(self, cpu: CpuTier, request: _Request, start: int, count: int) -> None:
        """An asynchronous load of ``count`` CPU blocks: one step allocates, the next caches."""
        size = self._block_size
        loading = request.digests[start : start + count]
        cpu.pin(loading, 1)
        self._allocate(request, (start + count) * size)
        request.next_offload = start + count
        self._publish(self.end_step())
        cpu.pin(loading, -1)
        computed = min(len(request.blocks) * size, len(request.tokens))
        if computed == len(request.tokens):
            computed -= 1  # the last token is always computed
        self._cache(request, computed)
        request.num_computed = computed

    def _schedule_offload(self, cpu: CpuTier, request: _Request, total_tokens: int) -> None:
        """vLLM's OffloadingConnector scheduling the request's newly full blocks for offload."""
        if self._offload_prompt_only:
            total_tokens = min(total_tokens, request.num_prompt)
        full = min(total_tokens, len(request.tokens)) // self._block_size
        start = request.next_offload
        if full > start and cpu.offload(request.digests[:full], request.tokens, start):
            request.next_offload = full
