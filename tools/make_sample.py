"""Writes kvbridge/data/sample.kvcap, the stream `kvbridge demo` indexes by default.

Two workers serve the same prompt families, with the problems kvbridge exists for:

- worker 1 runs a 0.32-layout engine (tagged maps, int hashes) that offloads to CPU with
  placeholder events (no tokens) and then evicts the offloaded blocks from the GPU;
- worker 2 runs a 0.22-layout engine (positional arrays, raw bytes hashes) whose hash seed
  differs, so it hashes identical tokens differently, and whose connector reports its CPU tier
  as lower-case "cpu".

Run: python tools/make_sample.py
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from kvbridge.adapters.capture import CaptureWriter
from kvbridge.schemas.vllm import BlockHash, BlockStored
from kvbridge.testing.events import encoded, placeholder, removed, stored

BLOCK_SIZE = 4
OUT = Path(__file__).resolve().parents[1] / "kvbridge" / "data" / "sample.kvcap"
PROMPTS = {
    "support-bot": list(range(100, 118)),
    "code-review": list(range(200, 214)),
    "translate": list(range(300, 311)),
}


def sample_hashes(seed: bytes, tokens: list[int], *, as_bytes: bool) -> list[BlockHash]:
    """Chained SHA-256 block hashes with a per-engine seed, over each block's ``repr``. Not
    vLLM's pickle-based chain (:mod:`kvbridge.testing.vllm_hashes`): the sample's hashes are
    fixed by the golden fixtures built from it (tests/fixtures/normalizer), which a change of
    hash would rewrite; what the sample shows only needs two engines that disagree."""
    parent = hashlib.sha256(seed).digest()
    out: list[BlockHash] = []
    for start in range(0, len(tokens) - len(tokens) % BLOCK_SIZE, BLOCK_SIZE):
        block = repr(tuple(tokens[start : start + BLOCK_SIZE])).encode()
        parent = hashlib.sha256(parent + block).digest()
        out.append(parent if as_bytes else int.from_bytes(parent[-8:], "big"))
    return out


def sample_stored(
    hashes: list[BlockHash], tokens: list[int], parent: BlockHash | None = None, medium: str = "GPU"
) -> BlockStored:
    """A store of ``hashes`` with the tokens they cover and no extra keys."""
    return stored(
        hashes, tokens[: len(hashes) * BLOCK_SIZE], parent=parent, medium=medium, extra_keys=None
    )


def main() -> None:
    support, review, translate = PROMPTS.values()
    s1 = sample_hashes(b"engine-1", support, as_bytes=False)
    r1 = sample_hashes(b"engine-1", review, as_bytes=False)
    s2 = sample_hashes(b"engine-2", support, as_bytes=True)
    t2 = sample_hashes(b"engine-2", translate, as_bytes=True)
    worker_1 = [
        [sample_stored(s1, support)],
        [sample_stored(r1[:2], review), sample_stored(r1[2:], review[8:], parent=r1[1])],
        [placeholder(s1[2:4])],
        [removed([h]) for h in reversed(s1[2:])],
    ]
    worker_2 = [
        [sample_stored(s2[:2], support), sample_stored(t2, translate)],
        [sample_stored(t2, translate, medium="cpu")],
        [removed(t2[1:])],
    ]
    meta = {
        "description": "Bundled kvbridge sample: two workers, CPU placeholders, mismatched hashes",
        "block_size": BLOCK_SIZE,
        "prompts": [{"name": name, "token_ids": tokens} for name, tokens in PROMPTS.items()],
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    start = 1_764_000_000_000_000_000
    with CaptureWriter(OUT, meta=meta) as capture:
        for worker_id, release, batches in ((1, "0.32.0", worker_1), (2, "0.22.0", worker_2)):
            stream = f"tcp://127.0.0.1:{5556 + worker_id}"
            for seq, events in enumerate(batches):
                payload = encoded(events, ts=1764000000.0 + seq, release=release)
                capture.write(
                    [b"kv-events", seq.to_bytes(8, "big"), payload],
                    stream=stream,
                    worker_id=worker_id,
                    received_ns=start + 10_000_000 * seq,
                )
    print(f"wrote {OUT} ({capture.count} messages)")


if __name__ == "__main__":
    main()
