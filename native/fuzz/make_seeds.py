"""Write the fuzz seed corpus: every payload fixture and every payload frame of the golden
captures, one file each, named by its SHA-1 as libFuzzer names its inputs.

    .venv/bin/python native/fuzz/make_seeds.py     # from the repository root

Rewrites ``native/fuzz/seeds/payload/`` from scratch (about 150 kB).
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from kvbridge.adapters.capture import CaptureReader

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
SEEDS = Path(__file__).resolve().parent / "seeds" / "payload"


def payloads() -> list[bytes]:
    found = [
        path.read_bytes()
        for directory in ("layouts", "releases")
        for path in sorted((FIXTURES / directory).glob("*.msgpack"))
    ]
    for capture in sorted((FIXTURES / "vllm-0.32.0").glob("*.kvcap")):
        found.extend(record.frames[-1] for record in CaptureReader(capture) if record.frames)
    return found


def main() -> None:
    shutil.rmtree(SEEDS, ignore_errors=True)
    SEEDS.mkdir(parents=True)
    unique = {hashlib.sha1(payload).hexdigest(): payload for payload in payloads()}
    for name, payload in unique.items():
        (SEEDS / name).write_bytes(payload)
    total = sum(map(len, unique.values()))
    print(f"{len(unique)} seeds, {total} bytes, in {SEEDS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
