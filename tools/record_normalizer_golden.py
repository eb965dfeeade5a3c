#!/usr/bin/env python3
"""Records what the pure-Python ``kvbridge.Normalizer`` makes of a set of worker streams, as
golden data in ``tests/fixtures/normalizer/``, for ``tests/test_normalizer_golden.py``.

A stream is one worker's ordered ``(payload, seq)`` list, its worker id and block size. Every
stream gets one fresh ``Normalizer(worker_id, block_size)``; each payload is decoded with
``decode_batch`` (a ``SchemaError`` is recorded as such and the normalizer skipped) and
normalized with its seq. After the last batch the state is recorded, then ``reset()`` (every
rank) is called and recorded too; the benchmark streams also call ``reset(0)`` once after half
their batches. Per step (batch or reset) the recording holds the number of events, a digest of
``msgspec.msgpack.encode(events)`` and a digest of the relay's canonical payloads
(``encode_canonical(events, block_size, ts)``, ``ts`` the batch's, 0.0 for a reset).

The streams:

* ``bench-*``: the five variants of ``benchmarks/normalize.py`` (its simulated engine, at
  ``--blocks`` blocks, default 40 000); their payloads are stored here
  (``payloads/<stream>.msgpack.xz``: lzma of a msgpack array of payloads, seq = index), since the
  generator will change;
* ``vllm-0.32.0-<capture>-w<id>``: every golden capture of ``tests/fixtures/vllm-0.32.0``, one
  stream per worker id of the capture, block size 32, read in place;
* ``sample-w<id>``: the bundled ``kvbridge/data/sample.kvcap``, its two workers, block size 4;
* ``release-<v>`` / ``layout-<v>``: every ``tests/fixtures/releases/*.msgpack`` and
  ``tests/fixtures/layouts/*.msgpack``, one payload each (seq 0, worker 1, block size 4: the
  ``block_size`` of their stores), read in place.

For every stream but the benchmarks, ``events/<stream>.msgpack`` also holds every step's events
and canonical payloads, to debug a mismatch.

Run: .venv/bin/python tools/record_normalizer_golden.py [--blocks N]
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.util
import json
import lzma
import platform
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import msgspec

from kvbridge import Normalizer, SchemaError, Tier, TieredEvent, decode_batch
from kvbridge.adapters.capture import CaptureReader
from kvbridge.normalizers.canonical import encode_canonical

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "normalizer"
CAPTURES = "tests/fixtures/vllm-0.32.0"
CAPTURE_BLOCK_SIZE = 32
SAMPLE = "kvbridge/data/sample.kvcap"
FIXTURE_DIRS = (("release", "tests/fixtures/releases"), ("layout", "tests/fixtures/layouts"))
FIXTURE_BLOCK_SIZE = 4
FIXTURE_WORKER = 1
BENCH_WORKER = 1
"""As ``benchmarks/normalize.py`` runs it: ``Normalizer(worker_id=1, block_size)``."""


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:32]


def events_digest(events: list[TieredEvent]) -> str:
    return digest(msgspec.msgpack.encode(events))


def canonical_digest(payloads: list[bytes]) -> str:
    return digest(b"".join(len(p).to_bytes(4, "little") + p for p in payloads))


@dataclass
class Stream:
    name: str
    worker_id: int
    block_size: int
    source: dict[str, Any]
    """How the test finds the payloads (paths relative to the repository root)."""
    payloads: list[tuple[bytes, int]]
    """(payload, seq) in order."""
    mid_reset: bool
    """``reset(0)`` after half the batches."""
    keep_events: bool


BENCH = {"mid_reset": True, "keep_events": False}
SMALL = {"mid_reset": False, "keep_events": True}


def load_bench() -> ModuleType:
    path = ROOT / "benchmarks" / "normalize.py"
    spec = importlib.util.spec_from_file_location("kvbridge_bench_normalize", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def bench_name(variant_name: str) -> str:
    return "bench-" + "-".join(variant_name.split())


def bench_streams(blocks: int, seed: int) -> Iterator[Stream]:
    bench = load_bench()
    steps = {
        size: bench.simulate(size, blocks, seed) for size in {v.block_size for v in bench.VARIANTS}
    }
    for variant in bench.VARIANTS:
        payloads = bench.encode_steps(steps[variant.block_size], variant)
        name = bench_name(variant.name)
        source = {
            "kind": "payloads",
            "file": f"payloads/{name}.msgpack.xz",
            "generator": {
                "module": "benchmarks/normalize.py",
                "variant": variant.name,
                "blocks": blocks,
                "seed": seed,
            },
        }
        pairs = [(payload, seq) for seq, payload in enumerate(payloads)]
        yield Stream(name, BENCH_WORKER, variant.block_size, source, pairs, **BENCH)


def capture_streams(path: str, block_size: int, prefix: str) -> Iterator[Stream]:
    records = list(CaptureReader(ROOT / path))
    for worker_id in sorted({record.worker_id for record in records}):
        pairs = []
        for record in records:
            if record.worker_id == worker_id:
                assert record.seq is not None, f"{path}: a message without vLLM's three frames"
                pairs.append((record.frames[2], record.seq))
        source = {"kind": "kvcap", "path": path, "worker_id": worker_id}
        yield Stream(f"{prefix}-w{worker_id}", worker_id, block_size, source, pairs, **SMALL)


def fixture_streams() -> Iterator[Stream]:
    for prefix, directory in FIXTURE_DIRS:
        for path in sorted((ROOT / directory).glob("*.msgpack")):
            version = path.name.removeprefix("vllm-").removesuffix(".msgpack")
            relative = path.relative_to(ROOT).as_posix()
            source = {"kind": "payload", "path": relative}
            pairs = [(path.read_bytes(), 0)]
            name = f"{prefix}-{version}"
            yield Stream(name, FIXTURE_WORKER, FIXTURE_BLOCK_SIZE, source, pairs, **SMALL)


def all_streams(blocks: int, seed: int) -> Iterator[Stream]:
    yield from bench_streams(blocks, seed)
    for path in sorted((ROOT / CAPTURES).glob("*.kvcap")):
        relative = path.relative_to(ROOT).as_posix()
        yield from capture_streams(relative, CAPTURE_BLOCK_SIZE, f"vllm-0.32.0-{path.stem}")
    yield from capture_streams(SAMPLE, 4, "sample")
    yield from fixture_streams()


def state(normalizer: Normalizer) -> dict[str, Any]:
    ranks = normalizer.dp_ranks
    return {
        "stats": dict(sorted(normalizer.stats.items())),
        "forwarded": sorted(
            [kind, tier.value, n] for (kind, tier), n in normalizer.forwarded.items()
        ),
        "dropped": sorted([*key, n] for key, n in normalizer.dropped.items()),
        "unknown_fields": normalizer.unknown_fields,
        "dp_ranks": ranks,
        "resident_blocks": [
            [rank, tier.value, normalizer.resident_blocks(rank, tier)]
            for rank in ranks
            for tier in Tier
        ],
    }


StepEvents = tuple[list[TieredEvent], list[bytes]]


def step(
    op: dict[str, Any], events: list[TieredEvent], block_size: int, ts: float
) -> tuple[dict[str, Any], StepEvents]:
    canonical = encode_canonical(events, block_size, ts)
    op.update(
        events=len(events), digest=events_digest(events), canonical=canonical_digest(canonical)
    )
    return op, (events, canonical)


def record(stream: Stream) -> tuple[dict[str, Any], list[StepEvents | None]]:
    normalizer = Normalizer(stream.worker_id, stream.block_size)
    steps: list[dict[str, Any]] = []
    full: list[StepEvents | None] = []
    half = len(stream.payloads) // 2 if stream.mid_reset else None
    for index, (payload, seq) in enumerate(stream.payloads):
        if index == half:
            op, kept = step(
                {"op": "reset", "dp_rank": 0}, normalizer.reset(0), stream.block_size, 0.0
            )
            steps.append(op)
            full.append(kept)
        try:
            batch = decode_batch(payload)
        except SchemaError as error:
            steps.append({"op": "batch", "seq": seq, "error": "SchemaError", "message": str(error)})
            full.append(None)
            continue
        events = normalizer.normalize(batch, seq)
        op, kept = step({"op": "batch", "seq": seq}, events, stream.block_size, batch.ts)
        steps.append(op)
        full.append(kept)
    final = state(normalizer)
    op, kept = step({"op": "reset", "dp_rank": None}, normalizer.reset(), stream.block_size, 0.0)
    steps.append(op)
    full.append(kept)
    expected = {
        "name": stream.name,
        "worker_id": stream.worker_id,
        "block_size": stream.block_size,
        "source": stream.source,
        "events_file": f"events/{stream.name}.msgpack" if stream.keep_events else None,
        "state_before_final_reset": final,
        "steps": steps,
    }
    return expected, full


def dump_json(data: dict[str, Any]) -> str:
    """Indented JSON with one line per state entry and per step, so that a diff shows what
    changed."""

    def block(items: list[str], indent: str, brackets: str) -> str:
        inner = ",\n".join(indent + "  " + item for item in items)
        return brackets[0] + "\n" + inner + "\n" + indent + brackets[1]

    def compact(value: Any) -> str:
        return json.dumps(value, separators=(", ", ": "))

    entries = []
    for key, value in data.items():
        if key == "steps":
            text = block([compact(s) for s in value], "  ", "[]")
        elif key == "state_before_final_reset":
            text = block([f"{json.dumps(k)}: {compact(v)}" for k, v in value.items()], "  ", "{}")
        else:
            text = json.dumps(value, indent=2).replace("\n", "\n  ")
        entries.append(f"{json.dumps(key)}: {text}")
    return block(entries, "", "{}") + "\n"


def git(*args: str) -> str:
    result = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True)
    return result.stdout.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=40_000, help="blocks per benchmark variant")
    parser.add_argument("--seed", type=int, default=20_240_601, help="the benchmark's seed")
    args = parser.parse_args(argv)

    for sub in ("streams", "events", "payloads"):
        shutil.rmtree(OUT / sub, ignore_errors=True)
        (OUT / sub).mkdir(parents=True)
    names = []
    for stream in all_streams(args.blocks, args.seed):
        expected, full = record(stream)
        names.append(stream.name)
        (OUT / "streams" / f"{stream.name}.json").write_text(dump_json(expected))
        if stream.keep_events:
            (OUT / expected["events_file"]).write_bytes(msgspec.msgpack.encode(full))
        if stream.source["kind"] == "payloads":
            raw = msgspec.msgpack.encode([payload for payload, _ in stream.payloads])
            packed = lzma.compress(raw, preset=9 | lzma.PRESET_EXTREME)
            (OUT / stream.source["file"]).write_bytes(packed)
        errors = sum("error" in s for s in expected["steps"])
        print(
            f"{stream.name}: {len(stream.payloads)} payloads, {len(expected['steps'])} steps, "
            f"{sum(s.get('events', 0) for s in expected['steps'])} events, {errors} undecodable"
        )
    manifest = {
        "generator": "tools/record_normalizer_golden.py",
        "command": " ".join(["tools/record_normalizer_golden.py", *sys.argv[1:]]),
        "recorded": datetime.date.today().isoformat(),
        "git_head": git("rev-parse", "HEAD"),
        "git_dirty": git("status", "--porcelain", "--", "kvbridge").splitlines(),
        "python": platform.python_version(),
        "msgspec": msgspec.__version__,
        "streams": names,
    }
    (OUT / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    size = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    print(f"{len(names)} streams, {size / 1e6:.2f} MB in {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
