"""The simulated vLLM engine: a GPU block pool (and optionally a CPU offload tier) driven one
request at a time, publishing each engine step's KV events as real ZMQ frames in any release's
layout, with vLLM's replay socket. What it does, step by step and against vLLM's code, is
docs/simulator.md."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import Final

from kvbridge._closing import ClosedOnExit
from kvbridge.adapters.endpoints import should_bind
from kvbridge.adapters.publisher import DEFAULT_BUFFER_STEPS, Publisher
from kvbridge.adapters.source import Source
from kvbridge.schemas.vllm import decode_batch, encode_batch
from kvbridge.schemas.vllm.layouts import Layout, layout_for, release_key
from kvbridge.schemas.vllm.types import BlockHash, Event, VllmBatch
from kvbridge.testing.cpu_tier import CpuTier
from kvbridge.testing.gpu_pool import GpuPool
from kvbridge.testing.scheduler import Completion, Scheduler
from kvbridge.testing.vllm_hashes import checked_token_ids, none_hash, published_hash

__all__ = ["SimulatedEngine"]


class SimulatedEngine(ClosedOnExit):
    """A vLLM engine in miniature: a prefix-cached GPU block pool (and optionally a CPU offload
    tier) that publishes vLLM's KV events over ZMQ, with a replay socket.

    docs/simulator.md says exactly what it publishes, and where it differs from vLLM. The engine
    is not thread-safe: call it from one thread (the replay socket is served by a thread of its
    own).

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
        version = release_key(release)
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
        self._cpu_bytes: Final = bytes_hashes or version < (0, 24)
        """CPU events carry raw digests before 0.24 (even when GPU events carry ints)."""
        self._cpu_group: Final = 0 if version >= (0, 24) else None
        self._placeholder_size: Final = block_size if version < (0, 20) else 0
        self._none_hash: Final = none_hash(hash_seed)

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
        cpu = None
        if self._cpu_capacity is not None:
            cpu = CpuTier(
                self._cpu_capacity,
                block_size=self._block_size,
                as_bytes=self._cpu_bytes,
                group_idx=self._cpu_group,
                placeholder_size=self._placeholder_size,
                self_describing=self._self_describing,
                shuffle=self._cpu_shuffle,
            )
        self._scheduler = Scheduler(
            GpuPool(self._num_blocks, as_bytes=self._bytes_hashes),
            cpu,
            block_size=self._block_size,
            root=self._none_hash,
            max_num_batched_tokens=self._max_batched,
            offload_prompt_only=self._offload_prompt_only,
            publish=self._publish,
            output_token=self.output_token,
        )

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
        """The :class:`~kvbridge.adapters.source.Source` a kvbridge subscriber uses for this
        engine.

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

    def block_hashes(self, token_ids: Sequence[int]) -> list[BlockHash]:
        """The hashes this engine publishes for the full blocks of ``token_ids``, in order."""
        digests = self._scheduler.digests(checked_token_ids(token_ids))
        return [published_hash(digest, as_bytes=self._bytes_hashes) for digest in digests]

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
        tokens = checked_token_ids(prompt_token_ids)
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
        return self._scheduler.run(tokens, max_tokens)

    # ------------------------------------------------------------------ steps and publishing

    def _publish(self, events: list[Event]) -> VllmBatch | None:
        """Publish one step's events as a batch, unless there are none."""
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
        return self._publish(self._scheduler.end_step())

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the engine is closed")

    def reset_prefix_cache(self, *, reset_external: bool = False) -> bool:
        """Uncache every GPU block and queue an ``AllBlocksCleared`` for the next step.

        ``reset_external`` also empties the CPU tier, without publishing anything for it (as vLLM's
        ``reset_prefix_cache?reset_external=true``). Returns ``True`` (vLLM returns ``False`` while
        a request holds blocks, which cannot happen between calls here).
        """
        self._scheduler.gpu.reset()
        if reset_external and self._scheduler.cpu is not None:
            self._scheduler.cpu.clear()
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
            return self._scheduler.gpu.resident()
        if kind == "CPU":
            cpu = self._scheduler.cpu
            return [] if cpu is None else cpu.resident()
        raise ValueError(f"unknown medium {medium!r} (GPU or CPU)")

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Close the sockets. Idempotent."""
        self._closed = True
        self._publisher.close()

    def __repr__(self) -> str:
        return (
            f"SimulatedEngine(endpoint={self.endpoint!r}, "
            f"replay_endpoint={self.replay_endpoint!r}, "
            f"release={self._release!r}, block_size={self._block_size}, "
            f"num_blocks={self._num_blocks}, cpu_blocks={self._cpu_capacity}, "
            f"dp_rank={self._dp_rank})"
        )
