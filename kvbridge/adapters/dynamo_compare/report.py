"""What ``--compare-dynamo`` reports: the causes it names, the report types and their text.

These types are the ``dynamo`` field of ``kvbridge validate``'s JSON report, so they are part of
the schema ``kvbridge validate --json-schema`` prints.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum

import msgspec

__all__ = [
    "Cause",
    "DynamoComparison",
    "PromptOverlap",
    "ResidentDiff",
    "TierCounts",
    "WorkerOverlap",
    "render_comparison",
]


class Cause(StrEnum):
    """Why Dynamo alone holds a block differently, as kvbridge knows it from the raw events."""

    BYTES_HASHES = "bytes_hashes"
    """The batch had bytes hashes (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``, or offload
    events before vLLM 0.24): Dynamo's decoder rejects the whole batch."""
    PLACEHOLDER = "placeholder_cpu_event"
    """An OffloadingConnector placeholder (no tokens, block size 0): Dynamo drops it for its
    block size; kvbridge resolves it through the GPU block of the same engine hash."""
    MEDIUM_SPELLING = "unknown_case_medium"
    """A medium Dynamo knows only in another spelling (``cpu`` from Mooncake or LMCache,
    ``FS`` / ``OBJ`` from vLLM 0.26): Dynamo drops the event."""
    RE_ANNOUNCED = "re_announced_chunk"
    """A removal of a block stored more than once on the tier (self-describing offload chunks
    re-announce shared blocks): Dynamo does not reference-count and removes it."""
    SECOND_ENGINE = "second_engine_hashes"
    """A worker that stored content another worker had stored under other hashes: Dynamo keeps
    the first writer's hash, so this worker's children of it fail and its removals do nothing."""
    RAW_CACHE_SALT = "raw_cache_salt"
    """A cache salt without Dynamo's ``dynamo-cache-salt:`` prefix: Dynamo indexes the blocks
    unsalted, so the salted blocks are missing and unsalted ones are stale."""
    ENGINE_RESTART = "engine_restart"
    """The engine restarted: a new process at the same endpoint, its sequence from 0 again.
    Dynamo's listener ignores every batch until the sequence passes the old process's last, and
    keeps the old process's blocks; kvbridge clears the worker and applies the new process's
    batches."""
    UNEXPLAINED = "unexplained"
    """A difference none of the above accounts for (a case kvbridge does not model yet)."""


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
