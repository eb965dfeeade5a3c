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
from kvbridge.schemas.vllm import BlockRemoved, BlockStored, VllmBatch, encode_batch, layout_for

BLOCK_SIZE = 4
OUT = Path(__file__).resolve().parents[1] / "kvbridge" / "data" / "sample.kvcap"
PROMPTS = {
    "support-bot": list(range(100, 118)),
    "code-review": list(range(200, 214)),
    "translate": list(range(300, 311)),
}


class Engine:
    """Chained sha256 block hashes with a per-engine seed, as vLLM computes them."""

    def __init__(self, seed: bytes, *, as_bytes: bool) -> None:
        self.seed = seed
        self.as_bytes = as_bytes

    def hashes(self, tokens: list[int]) -> list[int | bytes]:
        parent = hashlib.sha256(self.seed).digest()
        out: list[int | bytes] = []
        for start in range(0, len(tokens) - len(tokens) % BLOCK_SIZE, BLOCK_SIZE):
            block = repr(tuple(tokens[start : start + BLOCK_SIZE])).encode()
            parent = hashlib.sha256(parent + block).digest()
            out.append(parent if self.as_bytes else int.from_bytes(parent[-8:], "big"))
        return out


def stored(
    hashes: list[int | bytes],
    tokens: list[int],
    parent: int | bytes | None = None,
    medium: str = "GPU",
) -> BlockStored:
    return BlockStored(
        hashes,
        parent,
        tokens[: len(hashes) * BLOCK_SIZE],
        BLOCK_SIZE,
        None,
        medium,
        None,
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    )


def main() -> None:
    one, two = Engine(b"engine-1", as_bytes=False), Engine(b"engine-2", as_bytes=True)
    support, review, translate = PROMPTS.values()
    s1, r1 = one.hashes(support), one.hashes(review)
    s2, t2 = two.hashes(support), two.hashes(translate)
    worker_1 = [
        [stored(s1, support)],
        [stored(r1[:2], review), stored(r1[2:], review[8:], parent=r1[1])],
        [BlockStored(s1[2:4], None, [], 0, None, "CPU", None, group_idx=0)],
        [BlockRemoved([h], "GPU", 0) for h in reversed(s1[2:])],
    ]
    worker_2 = [
        [stored(s2[:2], support), stored(t2, translate)],
        [stored(t2, translate, medium="cpu")],
        [BlockRemoved(t2[1:], "GPU", 0)],
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
                payload = encode_batch(
                    VllmBatch(1764000000.0 + seq, events, 0), layout_for(release)
                )
                capture.write(
                    [b"kv-events", seq.to_bytes(8, "big"), payload],
                    stream=stream,
                    worker_id=worker_id,
                    received_ns=start + 10_000_000 * seq,
                )
    print(f"wrote {OUT} ({capture.count} messages)")


if __name__ == "__main__":
    main()
