#!/usr/bin/env python3
"""Throughput of kvbridge's native core against a plain msgpack decode, and the speed-up over
the pure-Python normalizer it replaced.

The workload is a deterministic simulation of one vLLM worker's KV-event stream: a GPU prefix
cache with LRU eviction of free blocks (as vLLM's free-block queue does it), requests drawn from
prompt families that share system prompts and multi-turn histories, chunked prefill (1-64 blocks
per ``BlockStored``, chained on the last cached block), one-block decode stores, one
``BlockRemoved`` per evicted GPU block, and a CPU offload tier that announces its stores either
self-describing (tokens and parent) or as placeholders (hashes only) and evicts in small groups.
The stream carries no ``AllBlocksCleared``. Each engine step with events becomes one payload,
encoded with :func:`kvbridge.schemas.vllm.encode_batch` in the layout of the variant; in the
``map/1`` variant each event becomes a payload of its own (about two blocks each), so that the
cost of a call shows as an engine that frees or fills a block or two per step makes it count.

For every variant, on the same payloads and in the same run, alternating within each
repetition, it times:

(a) ``msgspec.msgpack.decode(payload)`` (untyped) of every payload: the baseline;
(b) ``kvbridge.decode_batch(payload)`` of every payload;
(d) bytes to the relay's canonical bytes: ``normalizer.process(payload, seq)
    .canonical_payloads(ts)``, a fresh ``Normalizer(1, block_size)`` per repetition;
(e) bytes to Python ``TieredEvent`` values: ``normalizer.process(payload, seq).events``, same.

There is no (c) any more. It was ``decode_batch`` + ``Normalizer.normalize`` of the decoded
``VllmBatch``: with the native core that is a compatibility path, since the core reads bytes,
and ``Normalizer.process`` re-encodes a decoded batch (``encode_batch`` in the newest layout)
before the core decodes it again. No pipeline takes it; it would time msgspec twice and the
core once.

With ``--before PATH`` (a checkout of the pure-Python code, e.g. ``git worktree add
/tmp/kv-8950c4a 8950c4a``), a worker subprocess runs that code on the same payloads
(``PYTHONPATH=PATH``, the same interpreter; it checks that ``kvbridge`` is imported from PATH)
and times its own (a) and the old (c), ``decode_batch`` + ``Normalizer.normalize``, its
repetitions alternating with this process's. Its events are compared with (e)'s, encoded.

A block is one entry of an event's ``block_hashes`` (stored or removed); throughput is blocks per
second of the best (fastest) repetition, the median is printed alongside. The acceptance targets
are (d)/(a) >= 3.0 and (e)/(a) >= 1.0 on every variant of one payload a step; ``map/1`` is
printed, not counted against them.

Each repetition's minor page faults are counted too, and priced at what a first touch of a
fresh page costs on this machine (measured before the runs): a new normalizer grows its state
from empty, and (a) allocates nothing that outlives a payload.

``--breakdown`` adds, alternating in the same way, where (d) and (e) spend their time: the core
alone (a loop of ``_core.Normalizer.process``), the core with every store dropped (its
decoder, nearly alone), the core's two writers, msgspec building the ``TieredEvent`` values from
the core's bytes, and the Python wrapper ``Normalizer.process``.

Run: python benchmarks/normalize.py [--blocks N] [--repeat R] [--variant S] [--before PATH]
         [--breakdown] [--json FILE]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import mmap
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from array import array
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from run_info import machine, write_results

from kvbridge import Normalizer, decode_batch
from kvbridge.cli.arguments import positive_int
from kvbridge.normalizers.batch import TIERED_EVENTS
from kvbridge.schemas.vllm import (
    BlockRemoved,
    BlockStored,
    Event,
)
from kvbridge.testing.events import TS0, encoded, placeholder, removed, stored

TARGETS = {"(d) canonical": 3.0, "(e) events": 1.0}
"""Acceptance targets: the measure's throughput over (a)'s, on every variant."""

TS = 1_700_000_000.0
"""The time (d) stamps the canonical payloads with (the relay uses its receive time)."""

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
    one_event_each: bool = False
    """Each event a payload of its own, as an engine whose steps each free or fill a block or
    two publishes them: the cost of a call, not of a block."""


VARIANTS = (
    Variant("0.32.0 map   int   bs16", "0.32.0", 16, False),
    Variant("0.32.0 map   bytes bs16", "0.32.0", 16, True),
    Variant("0.32.0 map   int   bs32", "0.32.0", 32, False),
    Variant("0.22.0 array int   bs16", "0.22.0", 16, False),
    Variant("0.22.0 array bytes bs16", "0.22.0", 16, True),
    Variant("0.32.0 map/1 int   bs16", "0.32.0", 16, False, one_event_each=True),
)


def _hash(digest: bytes, as_bytes: bool) -> int | bytes:
    return digest if as_bytes else int.from_bytes(digest[-8:], "big")


def encode_steps(steps: list[list[tuple[Any, ...]]], variant: Variant) -> list[bytes]:
    """Each step's events as one payload in the variant's layout, built with
    :mod:`kvbridge.testing.events` (a step ``0.01`` s after the one before)."""
    raw = variant.bytes_hashes
    payloads = []
    for number, step in enumerate(steps):
        events: list[Event] = []
        for kind, hashes, *rest in step:
            wire = [_hash(h, raw) for h in hashes]
            if kind == "removed":
                events.append(removed(wire, medium=rest[0]))
            elif kind == "placeholder":
                events.append(placeholder(wire))
            else:
                parent, tokens, family, extra, medium = rest
                lora_id, lora_name = family.lora or (None, None)
                events.append(
                    stored(
                        wire,
                        tokens,
                        parent=None if parent is None else _hash(parent, raw),
                        block_size=variant.block_size,
                        medium=medium,
                        lora_id=lora_id,
                        lora_name=lora_name,
                        extra_keys=None if not any(extra) else extra,
                    )
                )
        ts = TS0 + number * 0.01
        if variant.one_event_each:
            payloads.extend(encoded([event], ts=ts, release=variant.release) for event in events)
        else:
            payloads.append(encoded(events, ts=ts, release=variant.release))
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


@dataclass
class Case:
    """One variant's payloads, and what the breakdown needs of them."""

    payloads: list[bytes]
    block_size: int
    tiered: list[bytes] = field(default_factory=list)
    """The core's ``TieredEvent`` msgpack of every payload (``--breakdown`` only)."""


Measure = tuple[str, Callable[[Case], Any]]


def run_baseline(case: Case) -> None:
    decode = msgspec.msgpack.decode
    for payload in case.payloads:
        decode(payload)


def run_decode(case: Case) -> None:
    for payload in case.payloads:
        decode_batch(payload)


def run_canonical(case: Case) -> Normalizer:
    normalizer = Normalizer(worker_id=1, block_size=case.block_size)
    process = normalizer.process
    for seq, payload in enumerate(case.payloads):
        process(payload, seq).canonical_payloads(TS)
    return normalizer


def run_events(case: Case) -> Normalizer:
    normalizer = Normalizer(worker_id=1, block_size=case.block_size)
    process = normalizer.process
    for seq, payload in enumerate(case.payloads):
        process(payload, seq).events  # noqa: B018 (built on first access)
    return normalizer


MEASURES: tuple[Measure, ...] = (
    ("(a) msgpack", run_baseline),
    ("(b) decode", run_decode),
    ("(d) canonical", run_canonical),
    ("(e) events", run_events),
)


def _core_normalizer(block_size: int) -> Any:
    """The ``_core.Normalizer`` a ``Normalizer`` wraps, made with the same defaults."""
    return Normalizer(worker_id=1, block_size=block_size)._core


def run_core(case: Case) -> None:
    normalize = _core_normalizer(case.block_size).process
    for seq, payload in enumerate(case.payloads):
        normalize(payload, seq)


def run_core_decode(case: Case) -> None:
    # registered with another block size: every store is dropped after decoding and admission,
    # every removal finds nothing; what is left is the decoder
    normalize = _core_normalizer(case.block_size + 1).process
    for seq, payload in enumerate(case.payloads):
        normalize(payload, seq)


def run_core_canonical(case: Case) -> None:
    normalize = _core_normalizer(case.block_size).process
    for seq, payload in enumerate(case.payloads):
        normalize(payload, seq).canonical_payloads(TS)


def run_core_tiered(case: Case) -> None:
    normalize = _core_normalizer(case.block_size).process
    for seq, payload in enumerate(case.payloads):
        normalize(payload, seq).tiered_events()


def run_tiered_decode(case: Case) -> None:
    decode = TIERED_EVENTS.decode
    for tiered in case.tiered:
        decode(tiered)


def run_process(case: Case) -> None:
    process = Normalizer(worker_id=1, block_size=case.block_size).process
    for seq, payload in enumerate(case.payloads):
        process(payload, seq)


BREAKDOWN: tuple[Measure, ...] = (
    ("core", run_core),
    ("core, stores dropped", run_core_decode),
    ("core + canonical", run_core_canonical),
    ("core + tiered", run_core_tiered),
    ("TieredEvent decode", run_tiered_decode),
    ("process", run_process),
)


# -- the pure-Python code, in a worker process -----------------------------------------------

WORKER = r"""
import gc, hashlib, json, sys, time
import msgspec
import kvbridge
from kvbridge import Normalizer, decode_batch

with open(sys.argv[1], "rb") as file:
    payloads = msgspec.msgpack.decode(file.read())
block_size = int(sys.argv[2])


def baseline():
    decode = msgspec.msgpack.decode
    for payload in payloads:
        decode(payload)


def normalize(digest=None):
    normalizer = Normalizer(worker_id=1, block_size=block_size)
    run = normalizer.normalize
    for seq, payload in enumerate(payloads):
        events = run(decode_batch(payload), seq)
        if digest is not None:
            digest.update(msgspec.msgpack.encode(events))
    return normalizer


def timed(function):
    gc.collect()
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


print(json.dumps({"kvbridge": kvbridge.__file__}), flush=True)
for line in sys.stdin:
    if line.strip() == "run":
        print(json.dumps({"a": timed(baseline), "c": timed(normalize)}), flush=True)
    elif line.strip() == "digest":
        digest = hashlib.sha256()
        stats = dict(normalize(digest).stats)
        print(json.dumps({"digest": digest.hexdigest(), "stats": stats}), flush=True)
    else:
        break
"""


class Before:
    """The pure-Python normalizer of another checkout, timed in its own process."""

    def __init__(self, path: Path, payloads: Sequence[bytes], block_size: int) -> None:
        self.path = path.resolve()
        with tempfile.NamedTemporaryFile(suffix=".msgpack", delete=False) as file:
            file.write(msgspec.msgpack.encode(list(payloads)))
        self.file = Path(file.name)
        self.process = subprocess.Popen(
            [sys.executable, "-c", WORKER, str(self.file), str(block_size)],
            cwd=self.path,
            env={**os.environ, "PYTHONPATH": str(self.path)},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        module = Path(self._answer()["kvbridge"]).resolve()
        if not module.is_relative_to(self.path):
            self.close()
            raise SystemExit(f"--before {path}: the worker imported kvbridge from {module}")
        self.module = module

    def _answer(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise SystemExit(f"--before {self.path}: the worker exited")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def ask(self, command: str) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self._answer()

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait(timeout=60)
        self.file.unlink(missing_ok=True)


def events_digest(case: Case) -> tuple[str, Counter[str]]:
    """SHA-256 of (e)'s events, encoded batch by batch with their token ids as lists (as the
    pure-Python code had them); the counters of what was dropped."""
    normalizer = Normalizer(worker_id=1, block_size=case.block_size)
    digest = hashlib.sha256()
    for seq, payload in enumerate(case.payloads):
        events = normalizer.process(payload, seq).events
        listed = [msgspec.structs.replace(e, token_ids=list(e.token_ids)) for e in events]
        digest.update(msgspec.msgpack.encode(listed))
    return digest.hexdigest(), normalizer.stats


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def page_fault_us(pages: int = 16_384) -> float:
    """Microseconds a first touch of a fresh anonymous page costs on this machine: the time to
    touch each page of a new mapping once, less the time to touch them again."""
    region = mmap.mmap(-1, pages * mmap.PAGESIZE)
    try:
        offsets = range(0, pages * mmap.PAGESIZE, mmap.PAGESIZE)
        seconds = []
        for value in (1, 2):
            start = time.perf_counter()
            for offset in offsets:
                region[offset] = value
            seconds.append(time.perf_counter() - start)
    finally:
        region.close()
    return (seconds[0] - seconds[1]) / pages * 1e6


def measure(
    case: Case, measures: Sequence[Measure], repeat: int, before: Before | None
) -> tuple[dict[str, list[float]], dict[str, list[int]]]:
    """Seconds and minor page faults per repetition for each measure; the measures (and the
    pure-Python worker's two) alternate within a repetition."""
    times: dict[str, list[float]] = {name: [] for name, _ in measures}
    faults: dict[str, list[int]] = {name: [] for name, _ in measures}
    if before is not None:
        times["before (a)"], times["before (c)"] = [], []
    for _ in range(repeat):
        for name, function in measures:
            gc.collect()
            faulted = _minor_faults()
            start = time.perf_counter()
            function(case)
            times[name].append(time.perf_counter() - start)
            faults[name].append(_minor_faults() - faulted)
        if before is not None:
            answer = before.ask("run")
            times["before (a)"].append(answer["a"])
            times["before (c)"].append(answer["c"])
    return times, faults


# -- reporting -------------------------------------------------------------------------------


def _rate(blocks: int, seconds: Sequence[float]) -> dict[str, float]:
    return {"best": blocks / min(seconds), "median": blocks / statistics.median(seconds)}


def _ratio(top: dict[str, float], bottom: dict[str, float]) -> dict[str, float]:
    return {key: top[key] / bottom[key] for key in ("best", "median")}


def _print_header(header: str) -> None:
    """A table's column header, ruled underneath."""
    print(header)
    print("-" * len(header))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=positive_int, default=100_000, help="blocks per variant")
    parser.add_argument("--repeat", type=positive_int, default=5, help="repetitions per measure")
    parser.add_argument("--seed", type=int, default=20_240_601)
    parser.add_argument(
        "--variant", action="append", help="run only variants whose name contains this"
    )
    parser.add_argument(
        "--before",
        type=Path,
        metavar="PATH",
        help="a checkout of the pure-Python code (e.g. 8950c4a) to time (c) on, in a worker",
    )
    parser.add_argument(
        "--breakdown", action="store_true", help="also time the parts of (d) and (e)"
    )
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the results here")
    args = parser.parse_args(argv)
    variants = [v for v in VARIANTS if not args.variant or any(s in v.name for s in args.variant)]
    if not variants:
        parser.error(f"no variant's name contains any of {args.variant}")

    host = machine()
    print(
        f"{host['cpu']}, {host['cpus']} CPUs, load {host['load_average']:.2f}; python "
        f"{host['python']}, msgspec {host['msgspec']}, kvbridge {host['commit']} from "
        f"{host['kvbridge']}"
    )
    fault_us = page_fault_us()
    print(f"a first touch of a fresh page (a minor fault) costs {fault_us:.2f} us here")
    started = time.perf_counter()
    steps_by_size = {
        size: simulate(size, args.blocks, args.seed) for size in {v.block_size for v in variants}
    }
    print(f"workload simulated in {time.perf_counter() - started:.1f} s")
    measures = MEASURES + (BREAKDOWN if args.breakdown else ())

    results = []
    for variant in variants:
        case = Case(encode_steps(steps_by_size[variant.block_size], variant), variant.block_size)
        by_kind, events_by_kind = count_blocks(case.payloads)
        blocks, events = by_kind.total(), events_by_kind.total()
        if args.breakdown:
            normalize = _core_normalizer(variant.block_size).process
            case.tiered = [normalize(p, seq).tiered_events() for seq, p in enumerate(case.payloads)]
        digest, stats = events_digest(case)
        before = None
        result: dict[str, Any] = {
            "name": variant.name,
            "release": variant.release,
            "block_size": variant.block_size,
            "bytes_hashes": variant.bytes_hashes,
            "one_event_each": variant.one_event_each,
            "payloads": len(case.payloads),
            "bytes": sum(map(len, case.payloads)),
            "events": events,
            "blocks": blocks,
            "mix": {kind: [count, events_by_kind[kind]] for kind, count in sorted(by_kind.items())},
            "not_forwarded": dict(sorted(stats.items())),
        }
        if args.before is not None:
            before = Before(args.before, case.payloads, variant.block_size)
            answer = before.ask("digest")
            result["before"] = {
                "path": args.before.as_posix(),
                "module": before.module.as_posix(),
                "same_events": answer["digest"] == digest,
                "not_forwarded": dict(sorted(answer["stats"].items())),
            }
        try:
            times, faults = measure(case, measures, args.repeat, before)
        finally:
            if before is not None:
                before.close()
        result["seconds"] = times
        result["minor_faults"] = faults
        result["rates"] = {name: _rate(blocks, seconds) for name, seconds in times.items()}
        results.append(result)
        print(
            f"\n{variant.name}: {len(case.payloads)} payloads, {result['bytes'] / 1e6:.1f} MB, "
            f"{events} events"
        )
        mix = ", ".join(f"{kind} {n} in {e} events" for kind, (n, e) in result["mix"].items())
        print(f"  blocks: {mix}")
        drops = ", ".join(f"{k} {v}" for k, v in result["not_forwarded"].items()) or "none"
        print(f"  not forwarded: {drops}")
        if "before" in result:
            old = result["before"]
            same = "identical" if old["same_events"] else "DIFFERENT"
            print(f"  pure Python from {old['module']}: events {same} to (e)'s")

    print(
        f"\nblocks/s of the best of {args.repeat} repetitions (median in brackets); ratios of "
        f"the bests (of the medians); targets (d)/(a) >= {TARGETS['(d) canonical']}, "
        f"(e)/(a) >= {TARGETS['(e) events']}\n"
    )
    names = [name for name, _ in MEASURES]
    header = f"{'variant':<24} {'blocks':>7} " + " ".join(f"{n:>18}" for n in names)
    header += "".join(f" {n[:3] + '/(a)':>12}" for n in names[1:])
    _print_header(header)
    worst = dict.fromkeys(TARGETS, float("inf"))
    for result in results:
        rates = result["rates"]
        cells = " ".join(
            f"{rates[n]['best'] / 1e6:8.2f}M ({rates[n]['median'] / 1e6:5.2f}M)" for n in names
        )
        ratios = {}
        for name in names[1:]:
            ratios[name] = ratio = _ratio(rates[name], rates["(a) msgpack"])
            cells += f" {ratio['best']:5.2f} ({ratio['median']:4.2f})"
            if name in worst and not result["one_event_each"]:
                worst[name] = min(worst[name], ratio["best"])
        result["ratios"] = ratios
        print(f"{result['name']:<24} {result['blocks']:>7} {cells}")

    print(
        "\nminor page faults per repetition (median), and what they cost per block at the "
        f"{fault_us:.2f} us a fault measured above\n"
    )
    faulted = [name for name in names if name != "(b) decode"]
    if args.breakdown:
        faulted.append("core")
    header = f"{'variant':<24}" + "".join(f" {n:>18}" for n in faulted)
    _print_header(header)
    for result in results:
        cells = ""
        for name in faulted:
            count = statistics.median(result["minor_faults"][name])
            cells += f" {count:>7.0f} ({count * fault_us * 1e3 / result['blocks']:4.0f} ns/bl)"
        print(f"{result['name']:<24}{cells}")

    if args.before is not None:
        print(
            f"\nthe pure-Python (c) at {args.before}, decode_batch + normalize, in its own "
            "process: its (c)/(a) against its own (a), and the speed-up of (d) and (e) over it"
            "\n(blocks/s of the bests, the medians in brackets)\n"
        )
        header = (
            f"{'variant':<24} {'(a), worker':>18} {'(c), pure Python':>18} {'(c)/(a)':>12} "
            f"{'(d)/(c)':>12} {'(e)/(c)':>12}"
        )
        _print_header(header)
        for result in results:
            rates = result["rates"]
            old_a, old_c = rates["before (a)"], rates["before (c)"]
            speedups = {
                "(c)/(a)": _ratio(old_c, old_a),
                "(d)/(c)": _ratio(rates["(d) canonical"], old_c),
                "(e)/(c)": _ratio(rates["(e) events"], old_c),
            }
            result["before"]["ratios"] = speedups
            cells = " ".join(
                f"{r['best'] / 1e6:8.2f}M ({r['median'] / 1e6:5.2f}M)" for r in (old_a, old_c)
            )
            cells += "".join(
                f" {speedups[k]['best']:5.2f} ({speedups[k]['median']:4.2f})"
                for k in ("(c)/(a)", "(d)/(c)", "(e)/(c)")
            )
            print(f"{result['name']:<24} {cells}")

    if args.breakdown:
        print(
            "\nnanoseconds per block of the best repetitions: the core alone (decode + state), "
            "its decoder (every store dropped), its writers, msgspec building the TieredEvents "
            "from the core's bytes, the Python wrapper (process - core)\n"
        )
        header = (
            f"{'variant':<24} {'(a)':>5} {'core':>5} {'dec':>5} {'state':>5} {'canon':>5} "
            f"{'tierd':>5} {'TEdec':>5} {'wrap':>5} {'(d)':>5} {'(e)':>5} {'e/a max':>7}"
        )
        _print_header(header)
        for result in results:
            ns = {n: 1e9 * min(s) / result["blocks"] for n, s in result["seconds"].items()}
            parts = {
                "(a)": ns["(a) msgpack"],
                "core": ns["core"],
                "decoder": ns["core, stores dropped"],
                "state": ns["core"] - ns["core, stores dropped"],
                "canonical writer": ns["core + canonical"] - ns["core"],
                "tiered writer": ns["core + tiered"] - ns["core"],
                "TieredEvent decode": ns["TieredEvent decode"],
                "wrapper": ns["process"] - ns["core"],
                "(d)": ns["(d) canonical"],
                "(e)": ns["(e) events"],
            }
            ceiling = parts["(a)"] / parts["TieredEvent decode"]
            result["breakdown_ns"] = parts
            result["events_ceiling"] = ceiling
            cells = " ".join(f"{v:5.0f}" for v in parts.values())
            print(f"{result['name']:<24} {cells} {ceiling:7.2f}")
        print(
            "\ne/a max: (e)/(a) if the core and the wrapper took no time, msgspec building the "
            "TieredEvents alone"
        )

    verdicts = []
    for name, target in TARGETS.items():
        verdict = "met" if worst[name] >= target else "NOT met"
        verdicts.append(f"worst {name[:3]}/(a) = {worst[name]:.2f}: target {target} {verdict}")
    print("\n" + "; ".join(verdicts) + " (over the variants of one payload a step; map/1 is apart)")
    print(f"total {time.perf_counter() - started:.1f} s")
    if args.json is not None:
        write_results(
            args.json,
            "normalize",
            host,
            blocks=args.blocks,
            repeat=args.repeat,
            seed=args.seed,
            targets=TARGETS,
            page_fault_us=fault_us,
            variants=results,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
