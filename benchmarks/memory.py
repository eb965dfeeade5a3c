#!/usr/bin/env python3
"""Bytes per tracked block of the normalizer's state, at a million GPU-resident blocks.

For each block size (16 and 32), one ``Normalizer(1, block_size)`` is filled with ``--blocks``
(1,000,000) distinct GPU-resident blocks: ``BlockStored`` events of ``--chain`` (64) blocks
each, every chain from the root, four events per payload, encoded with
:func:`kvbridge.schemas.vllm.encode_batch` in the layout of vLLM 0.32.0 (tagged maps, int
hashes). Token ids stay below 151,936, as a real vocabulary's do; no two blocks have the same
tokens. Then every block is removed (``BlockRemoved`` events of 64 hashes, 16 events per
payload).

Every case runs in a fresh subprocess, so nothing else the benchmark made pollutes its memory.
The payloads are built once per block size by this process and read by the subprocess before
its first measurement. Reported per case:

- RSS growth (``/proc/self/statm``) from just before the ``Normalizer`` is made to after the
  fill (``gc.collect()`` first), divided by the number of blocks;
- the core's own accounting, ``Normalizer.heap_bytes()``, divided by the number of blocks;
- the target, ``4 * block_size + 48`` bytes per block (112 at block size 16, 176 at 32);
- after the removal of every block: ``tracked_blocks()`` (live, retired), which must be
  ``(0, min(blocks, retain_evicted))``, ``heap_bytes()``, which must drop to the bound of the
  retained blocks (``retain_evicted * (4 * block_size + 48)``), and RSS, before and after
  glibc's ``malloc_trim(0)``: freed memory need not go back to the operating system.

Cases: ``core`` (the current Normalizer), ``core+index`` with ``--index`` (the Normalizer
feeding a :class:`kvbridge.TieredIndex` with its ``TieredEvent`` values: Dynamo's radix trees
and the index's residency), and ``before`` with ``--before PATH``: the pure-Python Normalizer of
a checkout of the code before the native core (e.g. ``git worktree add /tmp/kv-8950c4a
8950c4a``), run with ``PYTHONPATH=PATH`` on the same payloads (decode_batch + normalize); it has
no ``heap_bytes``, so RSS only.

Run: python benchmarks/memory.py [--blocks N] [--block-size 16 --block-size 32] [--index]
         [--before PATH] [--json FILE]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
from run_info import checkout, machine, write_results

from kvbridge.cli import arguments

RETAIN_EVICTED = 100_000
"""The Normalizer's default ``retain_evicted``."""

VOCAB = 151_936
STORES_PER_PAYLOAD = 4
REMOVED_PER_EVENT = 64
REMOVALS_PER_PAYLOAD = 16


def target(block_size: int) -> int:
    """Bytes per tracked block the state may take."""
    return 4 * block_size + 48


# -- the payloads ----------------------------------------------------------------------------


def _engine_hash(index: int) -> int:
    """A distinct, well-mixed 64-bit engine hash per block (splitmix64 of its index)."""
    value = (index * 0x9E3779B97F4A7C15) & 0xFFFF_FFFF_FFFF_FFFF
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFF_FFFF_FFFF_FFFF
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & 0xFFFF_FFFF_FFFF_FFFF
    return value ^ (value >> 31)


def build_payloads(blocks: int, block_size: int, chain: int) -> dict[str, list[bytes]]:
    """The stores that make ``blocks`` resident, and the removals of all of them."""
    from kvbridge.schemas.vllm import BlockRemoved, BlockStored, encode_batch, layout_for

    layout = layout_for("0.32.0")
    rng = random.Random(block_size)
    pool = [rng.randrange(VOCAB) for _ in range(1 << 16)]
    stride = chain * block_size
    stores: list[bytes] = []
    events: list[Any] = []
    for first in range(0, blocks, chain):
        count = min(chain, blocks - first)
        offset = (first * 7_919) % (len(pool) - stride)
        tokens = pool[offset : offset + count * block_size]
        for index in range(count):
            # the first two tokens spell the block's number: no two blocks share their tokens
            number = first + index
            tokens[index * block_size] = number % VOCAB
            tokens[index * block_size + 1] = number // VOCAB
        hashes = [_engine_hash(first + index) for index in range(count)]
        events.append(
            BlockStored(
                hashes,
                None,
                tokens,
                block_size,
                None,
                "GPU",
                None,
                group_idx=0,
                kv_cache_spec_kind="full_attention",
            )
        )
        if len(events) == STORES_PER_PAYLOAD:
            stores.append(encode_batch(events, layout, ts=float(len(stores))))
            events = []
    if events:
        stores.append(encode_batch(events, layout, ts=float(len(stores))))
        events = []
    removals: list[bytes] = []
    for first in range(0, blocks, REMOVED_PER_EVENT):
        last = min(blocks, first + REMOVED_PER_EVENT)
        events.append(BlockRemoved([_engine_hash(i) for i in range(first, last)], "GPU", 0))
        if len(events) == REMOVALS_PER_PAYLOAD:
            removals.append(encode_batch(events, layout, ts=float(len(removals))))
            events = []
    if events:
        removals.append(encode_batch(events, layout, ts=float(len(removals))))
    return {"stores": stores, "removals": removals}


# -- one case, in its own process ------------------------------------------------------------


def rss() -> int:
    """Resident set size of this process, in bytes."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def malloc_trim() -> bool:
    """Asks glibc to give freed heap memory back to the OS; ``False`` where there is no glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    libc.malloc_trim(0)
    return True


def run_case(case: str, payload_file: Path, block_size: int, blocks: int) -> dict[str, Any]:
    """Fills a normalizer, removes everything, and measures; in a fresh process."""
    import kvbridge
    from kvbridge import Normalizer, Tier

    data = msgspec.msgpack.decode(payload_file.read_bytes())
    stores, removals = data["stores"], data["removals"]
    del data
    result: dict[str, Any] = {
        "case": case,
        "block_size": block_size,
        "blocks": blocks,
        "module": kvbridge.__file__,
    }
    index = None
    gc.collect()
    rss_before = rss()
    normalizer = Normalizer(worker_id=1, block_size=block_size, retain_evicted=RETAIN_EVICTED)
    if case == "before":
        from kvbridge import decode_batch

        normalize = normalizer.normalize

        def feed(payload: bytes, seq: int) -> None:
            normalize(decode_batch(payload), seq)

    elif case == "core+index":
        from kvbridge import TieredIndex

        index = TieredIndex(block_size)
        process, apply = normalizer.process, index.apply

        def feed(payload: bytes, seq: int) -> None:
            apply(process(payload, seq).events)

    else:
        process = normalizer.process

        def feed(payload: bytes, seq: int) -> None:
            process(payload, seq)

    def state() -> dict[str, Any]:
        gc.collect()
        out: dict[str, Any] = {"rss": rss() - rss_before}
        out["resident"] = normalizer.resident_blocks(0, Tier.DEVICE)
        if hasattr(normalizer, "heap_bytes"):
            out["heap_bytes"] = normalizer.heap_bytes()
        if hasattr(normalizer, "tracked_blocks"):
            out["tracked"] = list(normalizer.tracked_blocks())
        else:  # the pure-Python normalizer: its ranks' dicts
            ranks = normalizer._ranks.values()
            out["tracked"] = [sum(len(r.blocks) for r in ranks), sum(len(r.retired) for r in ranks)]
        return out

    start = time.perf_counter()
    for seq, payload in enumerate(stores):
        feed(payload, seq)
    result["fill_seconds"] = time.perf_counter() - start
    result["full"] = state()
    start = time.perf_counter()
    for seq, payload in enumerate(removals, start=len(stores)):
        feed(payload, seq)
    result["remove_seconds"] = time.perf_counter() - start
    result["emptied"] = state()
    result["emptied"]["rss_trimmed"] = rss() - rss_before if malloc_trim() else None
    return result


def spawn(case: str, payload_file: Path, block_size: int, blocks: int, before: Path | None) -> Any:
    """Runs one case in a fresh interpreter and checks which kvbridge it imported."""
    env = dict(os.environ)
    home = checkout()
    if case == "before":
        assert before is not None
        home = before.resolve()
        env["PYTHONPATH"] = str(home)
    command = [sys.executable, str(Path(__file__).resolve()), "--child", case]
    command += [str(payload_file), str(block_size), str(blocks)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"case {case} at block size {block_size} failed:\n{done.stderr}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if not Path(result["module"]).resolve().is_relative_to(home):
        raise SystemExit(f"case {case} imported kvbridge from {result['module']}, not {home}")
    return result


# -- reporting -------------------------------------------------------------------------------


def _per_block(value: int | None, blocks: int) -> str:
    return "-" if value is None else f"{value / blocks:7.1f}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--blocks", type=arguments.positive_int, default=1_000_000, help="resident blocks"
    )
    parser.add_argument(
        "--chain", type=arguments.positive_int, default=64, help="blocks per BlockStored"
    )
    parser.add_argument(
        "--block-size",
        type=arguments.block_size,
        action="append",
        dest="block_sizes",
        help="16 and 32 if none",
    )
    parser.add_argument(
        "--before", type=Path, metavar="PATH", help="a checkout of the pure-Python code"
    )
    parser.add_argument(
        "--index", action="store_true", help="also measure Normalizer + TieredIndex"
    )
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the results here")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        case, payload_file, block_size, blocks = args.child
        print(json.dumps(run_case(case, Path(payload_file), int(block_size), int(blocks))))
        return 0

    host = machine()
    print(
        f"{host['cpu']}, {host['cpus']} CPUs, load {host['load_average']:.2f}; python "
        f"{host['python']}, msgspec {host['msgspec']}, kvbridge {host['commit']} from "
        f"{host['kvbridge']}"
    )
    cases = ["core"] + ["core+index"] * args.index + ["before"] * (args.before is not None)
    results = []
    for block_size in args.block_sizes or [16, 32]:
        started = time.perf_counter()
        payloads = build_payloads(args.blocks, block_size, args.chain)
        print(
            f"\nblock size {block_size}: {len(payloads['stores'])} store payloads, "
            f"{len(payloads['removals'])} removal payloads, built in "
            f"{time.perf_counter() - started:.1f} s"
        )
        with tempfile.NamedTemporaryFile(suffix=".msgpack") as file:
            file.write(msgspec.msgpack.encode(payloads))
            file.flush()
            del payloads
            for case in cases:
                result = spawn(case, Path(file.name), block_size, args.blocks, args.before)
                results.append(result)
                full = result["full"]
                print(
                    f"  {case:<10} filled in {result['fill_seconds']:.1f} s, emptied in "
                    f"{result['remove_seconds']:.1f} s; resident {full['resident']}, tracked "
                    f"{tuple(full['tracked'])}"
                )

    retained = min(args.blocks, RETAIN_EVICTED)
    print(
        f"\nbytes per block at {args.blocks:,} GPU-resident blocks (RSS growth and the core's "
        f"heap_bytes, divided by {args.blocks:,}); target 4 * block_size + 48\n"
    )
    header = f"{'case':<12} {'bs':>3} {'RSS/block':>10} {'heap/block':>10} {'target':>7}  verdict"
    print(header)
    print("-" * len(header))
    for result in results:
        bs, full = result["block_size"], result["full"]
        heap = full.get("heap_bytes")
        result["target_per_block"] = limit = target(bs)
        if result["case"] == "core+index":
            verdict = "no target (the index is not the normalizer's state)"
        else:
            result["rss_met"] = full["rss"] / args.blocks <= limit
            verdicts = [f"RSS {'met' if result['rss_met'] else 'NOT met'}"]
            if heap is not None:
                result["heap_met"] = heap / args.blocks <= limit
                verdicts.append(f"heap {'met' if result['heap_met'] else 'NOT met'}")
            verdict = ", ".join(verdicts)
        print(
            f"{result['case']:<12} {bs:>3} {_per_block(full['rss'], args.blocks):>10} "
            f"{_per_block(heap, args.blocks):>10} {limit:>7}  {verdict}"
        )

    print(
        f"\nafter removing every block: tracked (live, retired) must be (0, {retained:,}); "
        f"heap_bytes at most retain_evicted * target; RSS growth in MB, before and after "
        f"malloc_trim(0)\n"
    )
    header = (
        f"{'case':<12} {'bs':>3} {'tracked':>14} {'heap MB':>8} {'bound MB':>8} "
        f"{'RSS MB':>7} {'trimmed':>7}  verdict"
    )
    print(header)
    print("-" * len(header))
    for result in results:
        bs, emptied = result["block_size"], result["emptied"]
        heap = emptied.get("heap_bytes")
        bound = retained * target(bs)
        emptied["bound"] = bound
        emptied["tracked_ok"] = emptied["tracked"] == [0, retained]
        verdict = f"tracked {'ok' if emptied['tracked_ok'] else 'NOT ok'}"
        if heap is not None:
            emptied["heap_ok"] = heap <= bound
            verdict += f", heap {'ok' if emptied['heap_ok'] else 'NOT ok'}"
        trimmed = emptied["rss_trimmed"]
        print(
            f"{result['case']:<12} {bs:>3} {tuple(emptied['tracked'])!s:>14} "
            f"{'-' if heap is None else f'{heap / 1e6:8.1f}':>8} {bound / 1e6:8.1f} "
            f"{emptied['rss'] / 1e6:7.1f} "
            f"{'-' if trimmed is None else f'{trimmed / 1e6:7.1f}':>7}  {verdict}"
        )
    if args.json is not None:
        write_results(
            args.json,
            "memory",
            host,
            blocks=args.blocks,
            chain=args.chain,
            retain_evicted=RETAIN_EVICTED,
            cases=results,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
