"""A seeded stream of a chat-like workload on a :class:`~kvbridge.testing.SimulatedEngine`, for
tests that need many realistic batches rather than a few written by hand: to drop and replay
them, snapshot the index they build, or read them from several threads.

Six system prompts of 1 to 4 blocks are each followed by one of eight user turns of 1 to 3
blocks (three requests in ten have two turns), so that requests share prefixes; the engine's
pools are small (24 GPU blocks, 48 CPU blocks with self-describing stores), so both evict.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvbridge.schemas.vllm import encode_batch
from kvbridge.testing.simulated_engine import SimulatedEngine

__all__ = ["ChatPrompts", "SeededStream", "seeded_stream"]

GPU_BLOCKS = 24
CPU_BLOCKS = 48


@dataclass(frozen=True)
class SeededStream:
    """What :func:`seeded_stream` published."""

    payloads: list[bytes]
    """The batches in publication order; payload ``i`` is seq ``i``."""
    prompts: list[list[int]]
    """Every distinct prompt served, in the order first served, for overlap queries."""


class ChatPrompts:
    """The workload's prompts, drawn from ``rng``: six system prompts of 1 to 4 blocks, each
    followed by one of its eight user turns of 1 to 3 blocks, or by two (three requests in ten)."""

    def __init__(self, rng: random.Random, block_size: int) -> None:
        self._rng = rng
        self._prefixes = [
            [1000 * (p + 1) + t for t in range(block_size * rng.randint(1, 4))] for p in range(6)
        ]
        self._turns = [
            [
                [rng.randrange(1, 500) for _ in range(block_size * rng.randint(1, 3))]
                for _ in range(8)
            ]
            for _ in range(6)
        ]
        self.served: list[list[int]] = []
        """Every distinct prompt drawn, in the order first drawn."""
        self._seen: set[tuple[int, ...]] = set()

    def next(self) -> list[int]:
        """The next request's prompt (recorded in :attr:`served` if it is new)."""
        family = self._rng.randrange(len(self._prefixes))
        prompt = self._prefixes[family] + self._rng.choice(self._turns[family])
        if self._rng.random() < 0.3:
            prompt = prompt + self._rng.choice(self._turns[family])
        if tuple(prompt) not in self._seen:
            self._seen.add(tuple(prompt))
            self.served.append(prompt)
        return prompt


def seeded_stream(
    seed: int, count: int, *, block_size: int = 4, clear_at: int | None = None
) -> SeededStream:
    """The first ``count`` batches the workload of ``seed`` makes an engine publish.

    ``clear_at``: once that many batches are out, the engine resets its prefix cache, both
    tiers, so that the next batch opens with an ``AllBlocksCleared``.
    """
    prompts = ChatPrompts(random.Random(seed), block_size)
    with SimulatedEngine(
        replay_endpoint=None,
        num_blocks=GPU_BLOCKS,
        block_size=block_size,
        cpu_blocks=CPU_BLOCKS,
        self_describing=True,
    ) as engine:
        while len(engine.published) < count:
            if clear_at is not None and len(engine.published) >= clear_at:
                engine.reset_prefix_cache(reset_external=True)
                clear_at = None
            engine.generate(prompts.next())
        payloads = [encode_batch(batch, engine.layout) for batch in engine.published[:count]]
    return SeededStream(payloads, prompts.served)
