"""The command line: scan a range of vLLM releases, run a worker for each kept one, and write
the fixtures and ``manifest.json``.

Run from the repository root: ``python -m tools.release_fixtures [--through 0.34.0]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .extract import KV_EVENTS, definitions_sha256, directory_reader, plan
from .fetch import cache_dir, fetch, list_releases, pypi_index, version_key
from .samples import DATA_PARALLEL_RANK, OPTIONAL_VALUES, TS, samples_json
from .worker import worker

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "tests" / "fixtures" / "releases"
PACKAGE = "tools.release_fixtures"
"""This package, as ``python -m`` names it from :data:`ROOT`."""


def dumps(value: Any, indent: int = 0, prefix: int = 0) -> str:
    """JSON with each value on one line when it fits in 100 columns (compact, diff-friendly)."""
    flat = json.dumps(value)
    if indent + prefix + len(flat) <= 99 or not isinstance(value, dict | list) or not value:
        return flat
    pad = " " * (indent + 2)
    if isinstance(value, dict):
        items = [
            f"{pad}{json.dumps(k)}: {dumps(v, indent + 2, len(json.dumps(k)) + 2)}"
            for k, v in value.items()
        ]
        return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    items = [pad + dumps(v, indent + 2) for v in value]
    return "[\n" + ",\n".join(items) + "\n" + " " * indent + "]"


def _run_worker(release: str, files: Path) -> dict[str, Any]:
    """Run :func:`.worker.worker` for one release in a fresh interpreter; its result.

    ``-E -s``: no ``PYTHON*`` variables and no user site; the working directory is the repository
    root, so that ``-m`` finds this package (``-I`` would leave it off ``sys.path``)."""
    result = subprocess.run(
        [sys.executable, "-E", "-s", "-m", PACKAGE, "--worker", release, str(files)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode:
        raise SystemExit(f"worker for vLLM {release} failed:\n{result.stderr}")
    out: dict[str, Any] = json.loads(result.stdout)
    return out


def _scan(
    releases: list[str], sources: Mapping[str, dict[str, Any] | None], cache: Path
) -> tuple[list[dict[str, Any]], list[str]]:
    """The manifest's ``scanned`` entries, and the releases to keep: those whose
    ``kv_events.py`` (or the definitions executed) differs from the previous release's."""
    scanned: list[dict[str, Any]] = []
    kept: list[str] = []
    previous_file = previous_defs = None
    for release in releases:
        source = sources[release]
        if source is None:
            scanned.append({"release": release, "source": None, "note": "no sdist or wheel"})
            continue
        file_digest = source["files"][KV_EVENTS]
        defs_digest = definitions_sha256(plan(directory_reader(cache / release)))
        changed = file_digest != previous_file
        entry = {
            "release": release,
            "source": source["kind"],
            "filename": source["filename"],
            "sha256": source["sha256"],
            "kv_events_sha256": file_digest,
            "definitions_sha256": defs_digest,
            "changed": changed,
        }
        if defs_digest != previous_defs and not changed:
            entry["note"] = "the definitions changed although kv_events.py did not"
            changed = True
        if changed:
            kept.append(release)
        scanned.append(entry)
        previous_file, previous_defs = file_digest, defs_digest
    return scanned, kept


def main(argv: list[str] | None = None) -> int:
    """The command line (``--help``); the worker too, with ``--worker RELEASE FILES``."""
    parser = argparse.ArgumentParser(
        prog=f"python -m {PACKAGE}",
        description=(sys.modules[PACKAGE].__doc__ or "").split("\n\n")[0],
    )
    parser.add_argument("--from", dest="first", default="0.9.0")
    parser.add_argument("--through", default="0.33.0")
    parser.add_argument("--cache", help="default: $KVBRIDGE_CACHE/vllm-sdists")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--jobs", type=int, default=4, help="parallel downloads")
    parser.add_argument("--offline", action="store_true", help="use the cached index only")
    parser.add_argument("--no-wheels", dest="wheels", action="store_false")
    parser.add_argument("--worker", nargs=2, metavar=("RELEASE", "FILES"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        json.dump(worker(args.worker[0], Path(args.worker[1])), sys.stdout)
        return 0

    started = time.monotonic()
    cache = cache_dir(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    index = pypi_index(cache, args.offline)
    releases = list_releases(index, args.first, args.through)
    print(f"{len(releases)} final releases {args.first} .. {args.through}", file=sys.stderr)

    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        sources = dict(
            zip(
                releases,
                pool.map(lambda r: fetch(r, index["releases"][r], cache, args.wheels), releases),
                strict=True,
            )
        )
    downloaded = sum(s["downloaded"] for s in sources.values() if s)

    scanned, kept = _scan(releases, sources, cache)

    args.out.mkdir(parents=True, exist_ok=True)
    for stale in args.out.glob("vllm-*.msgpack"):
        if stale.stem.removeprefix("vllm-") not in kept:
            stale.unlink()
    entries = []
    versions: set[str] = set()
    msgspec_versions: set[str] = set()
    for position, release in enumerate(kept):
        source = sources[release]
        assert source is not None
        result = _run_worker(release, cache / release)
        payload = bytes.fromhex(result.pop("payload_hex"))
        fixture = f"vllm-{release}.msgpack"
        (args.out / fixture).write_bytes(payload)
        following = kept[position + 1] if position + 1 < len(kept) else None
        same = [
            e["release"]
            for e in scanned
            if e.get("source")
            and version_key(release) <= version_key(e["release"])
            and (following is None or version_key(e["release"]) < version_key(following))
        ]
        msgspec_versions.add(result.pop("msgspec"))
        versions.add(result.pop("python"))
        batch_info = result["classes"][result["batch_class"]]
        if not batch_info["array_like"]:
            print(f"WARNING: vLLM {release}: {result['batch_class']} is NOT array_like")
        entries.append(
            {
                "release": release,
                "fixture": fixture,
                "payload_sha256": hashlib.sha256(payload).hexdigest(),
                "payload_bytes": len(payload),
                "same_kv_events_through": same[-1],
                "source": {
                    k: source[k] for k in ("kind", "filename", "size", "sha256", "verified")
                },
                "kv_events_sha256": source["files"][KV_EVENTS],
                "files": source["files"],
                **result,
            }
        )
        print(
            f"{fixture:24} {len(payload):5} bytes  kv_events.py {source['files'][KV_EVENTS][:12]}"
            f"  same through {same[-1]}"
            + (
                f"  skipped: {[s['sample'] for s in result['skipped']]}"
                if result["skipped"]
                else ""
            )
        )
    manifest = {
        "generator": "tools/release_fixtures",
        "range": {"from": args.first, "through": args.through},
        "msgspec": sorted(msgspec_versions),
        "python": sorted(versions),
        "ts": TS,
        "data_parallel_rank": DATA_PARALLEL_RANK,
        "optional_values": OPTIONAL_VALUES,
        "samples": samples_json(),
        "scanned": scanned,
        "releases": entries,
    }
    (args.out / "manifest.json").write_text(dumps(manifest) + "\n")
    elapsed = time.monotonic() - started
    print(
        f"{len(kept)} of {len(releases)} releases changed kv_events.py; downloaded"
        f" {downloaded / 1e6:.1f} MB in {elapsed:.1f} s",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
