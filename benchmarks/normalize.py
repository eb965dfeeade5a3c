#!/usr/bin/env python3
"""Throughput of kvbridge's decode and normalize path against a plain msgpack decode.

The workload is a deterministic simulation of one vLLM worker's KV-event stream: a GPU prefix
cache with LRU eviction of free blocks (as vLLM's free-block queue does it), requests drawn from
prompt families that share system prompts and multi-turn histories, chunked prefill (1-64 blocks
per ``BlockStored``, chained on the last cached block), one-block decode stores, one
``BlockRemoved`` per evicted GPU block, and a CPU offload tier that announces its stores either
self-describing (tokens and parent) or as placeholders (hashes only) and evicts in small groups.
The stream carries no ``AllBlocksCleared``. Each engine step with events becomes one payload,
encoded with :func:`kvbridge.schemas.vllm.encode_batch` in the layout of the variant.

For every variant, on the same payloads and in the same run, it times:

(a) ``msgspec.msgpack.decode(payload)`` (untyped) of every payload: the baseline;
(b) ``kvbridge.decode_batch(payload)`` of every payload;
(c) ``decode_batch`` + ``Normalizer.normalize`` (a fresh ``Normalizer(1, block_size)`` per
    repetition).

A block is one entry of an event's ``block_hashes`` (stored or removed); throughput is blocks per
second of the best (fastest) repetition, the median is printed alongside. The acceptance target
is (c)/(a) >= 0.4.

Run: python benchmarks/normalize.py [--blocks N] [--repeat R] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import hashlib
import platform
import pstats
import random
import statistics
import sys
import time
from array import array
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

import kvbridge
from kvbridge import Normalizer, decode_batch
from kvbridge.schemas.vllm import (
    BlockRemoved,
    BlockStored,
    Event,
    Layout,
    VllmBatch,
    encode_batch,
    layout_for,
)

TARGET = 0.4
"""Acceptance target for (c)/(a)."""

MAX_BLOCKS_PER_STORE = 64
VOCAB = 151_936
GPU_CACHE_TOKENS = 65_536
CPU_CACHE_TOKENS = 196_608
PREFILL_TOKENS_PER_STEP = 4_096
MAX_RUNNING = 12
OFFLOAD_SHARE = 0.35
PLACEHOLDER_SHARE = 0.5
CPU_EVICTIONS_PER_EVENT = 8


# -- the simulated engine --------------------------------------------------------------------


@dataclass
class Family:
    """Requests sharing a system prompt; some carry a LoRA adapter or a cache salt."""

    prompt: list[int]
    lora: tuple[int, str] | None
    salt: str | None
    histories: list[list[int]] = field(default_factory=list)


@dataclass
class Request:
    family: Family
    tokens: list[int]
    hashes: list[bytes]
    output_blocks: int
    slots: list[int] = field(default_factory=list)
    stored: int = 0
    """Blocks of ``tokens`` whose slot is already cached or stored (prefill progress)."""


class Engine:
    """A vLLM-like prefix cache emitting KV events as abstract tuples (hashes as digests)."""

    def __init__(self, block_size: int, seed: int) -> None:
        self.block_size = block_size
        self.rng = random.Random(seed)
        self.gpu_capacity = GPU_CACHE_TOKENS // block_size
        self.cpu_capacity = CPU_CACHE_TOKENS // block_size
        self.slot_hash: dict[int, bytes] = {}
        self.slot_refs: dict[int, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict()
        """Free slots in eviction order (least recently freed first), as vLLM's queue."""
        self.by_hash: dict[bytes, list[int]] = {}
        self.next_slot = 0
        self.cpu: OrderedDict[bytes, None] = OrderedDict()
        self.families = [self._family(index) for index in range(48)]
        self.weights = [1.0 / (rank + 1) ** 0.9 for rank in range(len(self.families))]
        self.running: list[Request] = []
        self.waiting: Request | None = None
        self.reserved = 0
        """Blocks that running requests will still allocate."""
        self.pending_cpu_evictions: list[bytes] = []

    def _family(self, index: int) -> Family:
        rng = self.rng
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(64, 2_048))]
        lora = (index + 1, f"adapter-{index}") if index % 6 == 5 else None
        salt = f"tenant-{index}" if index % 8 == 3 else None
        return Family(prompt, lora, salt)

    # - hashing: chained SHA-256 over (parent, tokens, extra keys), as vLLM's sha256 mode

    def _extra_keys(self, family: Family, index: int) -> list[Any] | None:
        keys: list[Any] = []
        if family.lora is not None:
            keys.append(family.lora[1])
        if index == 0 and family.salt is not None:
            keys.append(family.salt)
        return keys or None

    def _hashes(self, family: Family, tokens: list[int]) -> list[bytes]:
        size = self.block_size
        parent = b"\x00" * 32
        out = []
        for index in range(len(tokens) // size):
            block = tokens[index * size : (index + 1) * size]
            extra = repr(self._extra_keys(family, index)).encode()
            parent = hashlib.sha256(parent + array("I", block).tobytes() + extra).digest()
            out.append(parent)
        return out

    # - requests

    def _new_request(self) -> Request:
        rng = self.rng
        family = rng.choices(self.families, self.weights)[0]
        if family.histories and rng.random() < 0.45:
            history = rng.choice(family.histories)  # a follow-up turn of a conversation
        else:
            history = family.prompt
        tail = [rng.randrange(VOCAB) for _ in range(rng.randrange(8, 1_536))]
        tokens = history + tail
        if len(tokens) > 8_192:
            tokens = family.prompt + tail
        # the answer's full blocks are stored while decoding; remember the turn for follow-ups
        answer = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 512))]
        full = tokens + answer
        output_blocks = len(full) // self.block_size - len(tokens) // self.block_size
        request = Request(family, full, self._hashes(family, full), output_blocks)
        if len(family.histories) < 24:
            family.histories.append(full)
        else:
            family.histories[rng.randrange(24)] = full
        return request

    def _schedule(self, request: Request) -> bool:
        """Take the prefix-cache hit (the leading blocks cached on the GPU) and reserve the
        other blocks; ``False`` (and nothing held) if the cache cannot hold them yet."""
        for engine_hash in request.hashes[: len(request.hashes) - request.output_blocks]:
            slots = self.by_hash.get(engine_hash)
            if not slots:
                break
            self._ref(slots[0])
            request.slots.append(slots[0])
        request.stored = len(request.slots)
        needed = len(request.hashes) - request.stored
        available = len(self.free) + self.gpu_capacity - self.next_slot - self.reserved
        if needed > available:
            self._finish(request)
            request.slots.clear()
            return False
        self.reserved += needed
        return True

    def _ref(self, slot: int) -> None:
        if self.slot_refs.get(slot, 0) == 0:
            self.free.pop(slot, None)
        self.slot_refs[slot] = self.slot_refs.get(slot, 0) + 1

    def _allocate(self, events: list[tuple[Any, ...]]) -> int:
        if self.next_slot < self.gpu_capacity:
            self.next_slot += 1
            slot = self.next_slot - 1
        else:
            slot, _ = self.free.popitem(last=False)
            evicted = self.slot_hash.pop(slot, None)
            if evicted is not None:
                slots = self.by_hash[evicted]
                slots.remove(slot)
                if not slots:
                    del self.by_hash[evicted]
                events.append(("removed", [evicted], "GPU"))
        self.slot_refs[slot] = 1
        return slot

    def _store(self, request: Request, count: int, events: list[tuple[Any, ...]]) -> None:
        """Cache ``count`` more full blocks of the request in one BlockStored."""
        start = request.stored
        hashes = request.hashes[start : start + count]
        for engine_hash in hashes:
            slot = self._allocate(events)
            self.slot_hash[slot] = engine_hash
            self.by_hash.setdefault(engine_hash, []).append(slot)
            request.slots.append(slot)
        self.reserved -= count
        parent = request.hashes[start - 1] if start else None
        size = self.block_size
        tokens = request.tokens[start * size : (start + count) * size]
        family = request.family
        extra = [self._extra_keys(family, start + i) for i in range(count)]
        events.append(("stored", hashes, parent, tokens, family, extra, "GPU"))
        request.stored += count

    def _offload(self, request: Request, events: list[tuple[Any, ...]]) -> None:
        """Copy the request's blocks to CPU: self-describing stores or placeholders."""
        placeholders = self.rng.random() < PLACEHOLDER_SHARE
        run: list[int] = []
        for index, engine_hash in enumerate(request.hashes[: request.stored]):
            if engine_hash in self.cpu:
                self.cpu.move_to_end(engine_hash)
                self._cpu_store(request, run, placeholders, events)
                run = []
                continue
            run.append(index)
            if len(run) == MAX_BLOCKS_PER_STORE:
                self._cpu_store(request, run, placeholders, events)
                run = []
        self._cpu_store(request, run, placeholders, events)

    def _cpu_store(
        self, request: Request, run: list[int], placeholder: bool, events: list[tuple[Any, ...]]
    ) -> None:
        if not run:
            return
        hashes = [request.hashes[index] for index in run]
        for engine_hash in hashes:
            self.cpu[engine_hash] = None
            if len(self.cpu) > self.cpu_capacity:
                self.pending_cpu_evictions.append(self.cpu.popitem(last=False)[0])
        if placeholder:
            events.append(("placeholder", hashes))
            return
        first, size = run[0], self.block_size
        parent = request.hashes[first - 1] if first else None
        tokens = request.tokens[first * size : (first + len(run)) * size]
        family = request.family
        extra = [self._extra_keys(family, index) for index in run]
        events.append(("stored", hashes, parent, tokens, family, extra, "CPU"))

    def _finish(self, request: Request) -> None:
        for slot in reversed(request.slots):  # tail blocks are evicted first
            refs = self.slot_refs[slot] - 1
            self.slot_refs[slot] = refs
            if refs == 0:
                self.free[slot] = None

    def step(self) -> list[tuple[Any, ...]]:
        """One engine step: its events, in the order vLLM would publish them."""
        rng = self.rng
        events: list[tuple[Any, ...]] = []
        while len(self.running) < MAX_RUNNING and rng.random() < 0.5:
            request, self.waiting = self.waiting or self._new_request(), None
            if not self._schedule(request):
                self.waiting = request
                break
            self.running.append(request)
        budget = PREFILL_TOKENS_PER_STEP // self.block_size
        for request in list(self.running):
            prompt_blocks = len(request.hashes) - request.output_blocks
            if request.stored < prompt_blocks:
                if budget <= 0:
                    continue
                count = min(prompt_blocks - request.stored, MAX_BLOCKS_PER_STORE, budget)
                count = min(count, rng.randint(1, MAX_BLOCKS_PER_STORE))
                budget -= count
                self._store(request, count, events)
                if request.stored == prompt_blocks and rng.random() < OFFLOAD_SHARE:
                    self._offload(request, events)
            elif request.stored < len(request.hashes):
                if rng.random() < 0.25:  # a decode step filled the next block
                    self._store(request, 1, events)
            else:
                self.running.remove(request)
                self._finish(request)
        while len(self.pending_cpu_evictions) >= CPU_EVICTIONS_PER_EVENT:
            group = self.pending_cpu_evictions[:CPU_EVICTIONS_PER_EVENT]
            del self.pending_cpu_evictions[:CPU_EVICTIONS_PER_EVENT]
            events.append(("removed", group, "CPU"))
        return events


def simulate(block_size: int, blocks: int, seed: int) -> list[list[tuple[Any, ...]]]:
    """Engine steps (each a non-empty list of abstract events) until ``blocks`` are counted."""
    engine = Engine(block_size, seed)
    steps = []
    counted = 0
    while counted < blocks:
        events = engine.step()
        if events:
            steps.append(events)
            counted += sum(len(event[1]) for event in events)
    return steps


# -- encoding --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    name: str
    release: str
    block_size: int
    bytes_hashes: bool


VARIANTS = (
    Variant("0.32.0 map   int   bs16", "0.32.0", 16, False),
    Variant("0.32.0 map   bytes bs16", "0.32.0", 16, True),
    Variant("0.32.0 map   int   bs32", "0.32.0", 32, False),
    Variant("0.22.0 array int   bs16", "0.22.0", 16, False),
    Variant("0.22.0 array bytes bs16", "0.22.0", 16, True),
)


def _hash(digest: bytes, as_bytes: bool) -> int | bytes:
    return digest if as_bytes else int.from_bytes(digest[-8:], "big")


def encode_steps(steps: list[list[tuple[Any, ...]]], variant: Variant) -> list[bytes]:
    layout: Layout = layout_for(variant.release)
    raw = variant.bytes_hashes
    payloads = []
    for number, step in enumerate(steps):
        events: list[Event] = []
        for kind, hashes, *rest in step:
            wire = [_hash(h, raw) for h in hashes]
            if kind == "removed":
                events.append(BlockRemoved(wire, rest[0], 0))
            elif kind == "placeholder":
                events.append(BlockStored(wire, None, [], 0, None, "CPU", None, group_idx=0))
            else:
                parent, tokens, family, extra, medium = rest
                lora_id, lora_name = family.lora or (None, None)
                events.append(
                    BlockStored(
                        wire,
                        None if parent is None else _hash(parent, raw),
                        tokens,
                        variant.block_size,
                        lora_id,
                        medium,
                        lora_name,
                        extra_keys=None if not any(extra) else extra,
                        group_idx=0,
                        kv_cache_spec_kind="full_attention",
                    )
                )
        batch = VllmBatch(1_700_000_000.0 + number * 0.01, events, 0)
        payloads.append(encode_batch(batch, layout))
    return payloads


def count_blocks(payloads: Sequence[bytes]) -> tuple[Counter[str], Counter[str]]:
    """Blocks (one per event block hash) and events, by kind, as the payloads carry them."""
    blocks: Counter[str] = Counter()
    events: Counter[str] = Counter()
    for payload in payloads:
        for event in decode_batch(payload).events:
            if isinstance(event, BlockStored):
                kind = "placeholder" if event.is_placeholder else f"stored {event.medium}"
            elif isinstance(event, BlockRemoved):
                kind = f"removed {event.medium}"
            else:
                kind = "cleared"
            events[kind] += 1
            blocks[kind] += len(getattr(event, "block_hashes", ()))
    return blocks, events


# -- timing ----------------------------------------------------------------------------------


def run_baseline(payloads: Sequence[bytes], block_size: int) -> None:
    decode = msgspec.msgpack.decode
    for payload in payloads:
        decode(payload)


def run_decode(payloads: Sequence[bytes], block_size: int) -> None:
    for payload in payloads:
        decode_batch(payload)


def run_normalize(payloads: Sequence[bytes], block_size: int) -> Normalizer:
    normalizer = Normalizer(worker_id=1, block_size=block_size)
    normalize = normalizer.normalize
    for seq, payload in enumerate(payloads):
        normalize(decode_batch(payload), seq)
    return normalizer


MEASURES: tuple[tuple[str, Callable[[Sequence[bytes], int], Any]], ...] = (
    ("(a) msgpack", run_baseline),
    ("(b) decode", run_decode),
    ("(c) normalize", run_normalize),
)


def measure(payloads: Sequence[bytes], block_size: int, repeat: int) -> list[list[float]]:
    """Seconds per repetition for each measure; the measures alternate within a repetition."""
    times: list[list[float]] = [[] for _ in MEASURES]
    for _ in range(repeat):
        for slot, (_, function) in enumerate(MEASURES):
            gc.collect()
            start = time.perf_counter()
            function(payloads, block_size)
            times[slot].append(time.perf_counter() - start)
    return times


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=100_000, help="blocks per variant")
    parser.add_argument("--repeat", type=int, default=5, help="repetitions per measure")
    parser.add_argument("--seed", type=int, default=20_240_601)
    parser.add_argument(
        "--variant", action="append", help="run only variants whose name contains this"
    )
    parser.add_argument(
        "--profile", action="store_true", help="cProfile (c) on the first variant and stop"
    )
    args = parser.parse_args(argv)
    variants = [v for v in VARIANTS if not args.variant or any(s in v.name for s in args.variant)]

    print(
        f"python {platform.python_version()} on {platform.machine()}, msgspec {msgspec.__version__}"
        f", kvbridge {kvbridge.__version__} from {Path(kvbridge.__file__).parent}"
    )
    started = time.perf_counter()
    steps_by_size = {
        size: simulate(size, args.blocks, args.seed) for size in {v.block_size for v in variants}
    }
    print(f"workload simulated in {time.perf_counter() - started:.1f} s")

    if args.profile:
        variant = variants[0]
        payloads = encode_steps(steps_by_size[variant.block_size], variant)
        profiler = cProfile.Profile()
        profiler.runcall(run_normalize, payloads, variant.block_size)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
        return 0

    rows = []
    for variant in variants:
        payloads = encode_steps(steps_by_size[variant.block_size], variant)
        by_kind, events_by_kind = count_blocks(payloads)
        blocks, events = by_kind.total(), events_by_kind.total()
        normalizer = run_normalize(payloads, variant.block_size)
        times = measure(payloads, variant.block_size, args.repeat)
        best = [blocks / min(t) for t in times]
        median = [blocks / statistics.median(t) for t in times]
        rows.append((variant, len(payloads), events, blocks, best, median))
        mix = ", ".join(
            f"{kind} {count} in {events_by_kind[kind]} events"
            for kind, count in sorted(by_kind.items())
        )
        drops = ", ".join(f"{k} {v}" for k, v in sorted(normalizer.stats.items())) or "none"
        size = sum(map(len, payloads))
        print(f"\n{variant.name}: {len(payloads)} payloads, {size / 1e6:.1f} MB, {events} events")
        print(f"  blocks: {mix}")
        print(f"  not forwarded: {drops}")

    print(
        f"\nblocks/s of the best of {args.repeat} repetitions (median in brackets); "
        f"target (c)/(a) >= {TARGET}\n"
    )
    header = (
        f"{'variant':<24} {'payloads':>8} {'blocks':>8} "
        f"{'(a) msgpack':>18} {'(b) decode':>18} {'(c) normalize':>18} {'b/a':>5} {'c/a':>5}"
    )
    print(header)
    print("-" * len(header))
    worst = float("inf")
    for variant, payloads_count, _, blocks, best, median in rows:
        cells = " ".join(
            f"{b / 1e6:8.2f}M ({m / 1e6:5.2f}M)" for b, m in zip(best, median, strict=True)
        )
        ratio_b, ratio_c = best[1] / best[0], best[2] / best[0]
        worst = min(worst, ratio_c)
        print(
            f"{variant.name:<24} {payloads_count:>8} {blocks:>8} {cells} "
            f"{ratio_b:5.2f} {ratio_c:5.2f}"
        )
    print(
        f"\nmicroseconds per block of the best repetitions; normalize is (c) - (b), its budget "
        f"what (c)/(a) = {TARGET} leaves it after (b)\n"
    )
    for variant, _, _, _, best, _ in rows:
        baseline, decode, total = (1e6 / rate for rate in best)
        print(
            f"{variant.name:<24} (a) {baseline:.2f}  (b) {decode:.2f}  (c) {total:.2f}  "
            f"normalize {total - decode:.2f}  budget {baseline / TARGET - decode:.2f}"
        )
    verdict = "met" if worst >= TARGET else "NOT met"
    print(f"\nworst (c)/(a) = {worst:.2f}: target {TARGET} {verdict}")
    print(f"total {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
