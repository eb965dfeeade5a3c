"""A :class:`~kvbridge.testing.SimulatedEngine` driven through a golden scenario's requests, and
both streams reduced to comparable events.

The engine is configured like the recorded one (block size 32, ``num_gpu_blocks_override=64``
of which vLLM keeps one as the null block, so 63; ``max_num_batched_tokens=512``; for the offload
scenarios a 32-block CPU tier that offloads prompt blocks only) and sent the manifest's prompts
in order, phase by phase, ``reset_prefix_cache()`` for a ``reset`` phase.

:class:`RecordedOutputs` generates the tokens the real engine generated (the manifest's
``output_token_ids``) instead of :meth:`SimulatedEngine.output_token`'s arithmetic sequence. The
blocks that decoding fills then hold the same tokens, and so the same hashes, in both streams;
nothing else about the engine changes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from kvbridge.schemas.vllm import AllBlocksCleared, BlockRemoved, BlockStored
from kvbridge.testing import SimulatedEngine
from support.golden import BLOCK_SIZE, Golden, decode_events, engine_key, phase_ends

__all__ = ["Event", "RecordedOutputs", "TwinRun", "real_events", "run_twin"]

GPU_BLOCKS = 63
CPU_BLOCKS = 32
MAX_BATCHED_TOKENS = 512


@dataclass(frozen=True)
class Event:
    """One event, stream position included: ``seq`` is the batch it came in."""

    seq: int
    type: str
    medium: str | None
    hashes: tuple[int, ...]
    parent: int | None

    @property
    def shape(self) -> tuple[str, str | None, int, bool | None]:
        """(type, medium, number of hashes, parent is None); the last is ``None`` but for
        stores."""
        parent_none = self.parent is None if self.type == "BlockStored" else None
        return (self.type, self.medium, len(self.hashes), parent_none)

    @property
    def key(self) -> tuple[str, str | None, tuple[int, ...], int | None]:
        return (self.type, self.medium, self.hashes, self.parent)


def real_events(golden: Golden) -> dict[str, list[Event]]:
    """The capture's events by phase (:func:`support.golden.phase_ends`), in stream order.
    A phase that published nothing (``reset``) maps to an empty list."""
    ends = phase_ends(golden)
    order = [name for name, _ in golden.phase_groups()]
    out: dict[str, list[Event]] = {name: [] for name in order}
    for seq, payload in golden.payloads():
        phase = next(name for name in order if name in ends and seq <= ends[name])
        for event in decode_events(payload):
            parent = event.get("parent_block_hash")
            out[phase].append(
                Event(
                    seq,
                    event["type"],
                    event.get("medium"),
                    tuple(engine_key(h) for h in event.get("block_hashes", ())),
                    None if parent is None else engine_key(parent),
                )
            )
    return out


class RecordedOutputs(SimulatedEngine):
    """A :class:`SimulatedEngine` that generates the given output tokens for each request."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._outputs: list[int] = []
        self._first = 0

    def expect(self, prompt: Sequence[int], outputs: Sequence[int]) -> None:
        """The next request's prompt length and outputs."""
        self._first, self._outputs = len(prompt), list(outputs)

    def output_token(self, position: int) -> int:  # type: ignore[override]
        return self._outputs[position - self._first]


@dataclass
class TwinRun:
    events: dict[str, list[Event]]
    """The simulated stream's events by phase."""
    resident: dict[str, set[int]]
    """Medium -> engine hashes resident at the end."""
    block_of: dict[int, tuple[int, int]]
    """Engine hash -> (prompt index, block index), for every full block of every request."""


def engine_options(golden: Golden) -> dict[str, Any]:
    options: dict[str, Any] = {
        "replay_endpoint": None,
        "num_blocks": GPU_BLOCKS,
        "block_size": BLOCK_SIZE,
        "max_num_batched_tokens": MAX_BATCHED_TOKENS,
        "release": golden.manifest["vllm_version"],
    }
    connector = golden.manifest["engine_args"].get("kv_transfer_config")
    if connector is not None:
        extra = connector["kv_connector_extra_config"]
        assert extra["cpu_bytes_to_use"] == CPU_BLOCKS * 32 * 1024  # 32 KiB per block
        options["cpu_blocks"] = CPU_BLOCKS
        options["offload_prompt_only"] = True
        options["self_describing"] = bool(extra["self_describing_kv_events"])
    return options


def run_twin(golden: Golden) -> TwinRun:
    """Send the scenario's requests to a simulated engine, phase by phase, ``max_tokens`` 8."""
    max_tokens = golden.manifest["sampling"]["max_tokens"]
    events: dict[str, list[Event]] = {}
    block_of: dict[int, tuple[int, int]] = {}
    with RecordedOutputs(**engine_options(golden)) as engine:
        for phase, indices in golden.phase_groups():
            first = len(engine.published)
            if phase == "reset":
                assert not indices
                engine.reset_prefix_cache()
            for index in indices:
                prompt, outputs = golden.prompts[index], golden.outputs[index]
                engine.expect(prompt, outputs)
                completion = engine.generate(prompt, max_tokens)
                assert completion.output_token_ids == outputs
                for block, block_hash in enumerate(engine.block_hashes(prompt + outputs)):
                    block_of.setdefault(engine_key(block_hash), (index, block))
            events[phase] = list(_events(engine.published[first:], first))
        resident = {
            medium: {engine_key(h) for h in engine.resident_hashes(medium)}
            for medium in ("GPU", "CPU")
        }
    return TwinRun(events, resident, block_of)


def _events(batches: Sequence[Any], first: int) -> Iterator[Event]:
    for seq, batch in enumerate(batches, first):
        for event in batch.events:
            if isinstance(event, BlockStored):
                parent = event.parent_block_hash
                yield Event(
                    seq,
                    "BlockStored",
                    event.medium,
                    tuple(map(engine_key, event.block_hashes)),
                    None if parent is None else engine_key(parent),
                )
            elif isinstance(event, BlockRemoved):
                hashes = tuple(map(engine_key, event.block_hashes))
                yield Event(seq, "BlockRemoved", event.medium, hashes, None)
            else:
                assert isinstance(event, AllBlocksCleared)
                yield Event(seq, "AllBlocksCleared", None, (), None)
