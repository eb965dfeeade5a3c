"""``kvbridge demo``: index a capture (the bundled sample by default) in-process and print each
prompt's overlap per worker and tier, so that a first run shows the whole path with no engine
and no Dynamo service."""

from __future__ import annotations

import argparse
from importlib import resources
from pathlib import Path

from kvbridge.adapters.capture import CaptureReader
from kvbridge.adapters.pipeline import IndexSink, StreamPipeline
from kvbridge.adapters.stream_stats import BadFrame
from kvbridge.adapters.tiered_index import TieredIndex

__all__ = ["run_demo"]


def _sample_capture() -> Path:
    return Path(str(resources.files("kvbridge") / "data" / "sample.kvcap"))


def run_demo(args: argparse.Namespace) -> int:
    """Decode and index a capture, then print each prompt's overlap per worker and tier."""
    path = Path(args.capture) if args.capture else _sample_capture()
    reader = CaptureReader(path)
    block_size = args.block_size or reader.meta.get("block_size")
    if not block_size:
        raise SystemExit("kvbridge demo: error: the capture names no block size; pass --block-size")
    index = TieredIndex(block_size)
    pipeline = StreamPipeline(block_size, sinks=[IndexSink(index)])
    for record in reader:
        pipeline.feed_record(record)  # a bad frame is logged, counted and skipped
    messages, bad = pipeline.stats.batches_in, pipeline.stats.bad_frames[BadFrame.SCHEMA]
    print(f"{path.name}: {messages} messages, {bad} bad, block size {block_size}")
    for worker_id, worker in sorted(pipeline.workers.items()):
        normalizer = worker.normalizer
        drops = ", ".join(f"{k}={v}" for k, v in sorted(normalizer.stats.items())) or "none"
        print(f"worker {worker_id}: not forwarded: {drops}")
    prompts = reader.meta.get("prompts", [])
    print(
        f"\n{'prompt':<16}{'blocks':>7}  {'worker':>6}{'dp':>4}{'device':>8}{'host':>6}{'disk':>6}"
    )
    for prompt in prompts:
        tokens = prompt["token_ids"]
        overlaps = index.overlap(tokens)
        name, blocks = prompt["name"], len(tokens) // block_size
        if not overlaps:
            print(f"{name:<16}{blocks:>7}  {'-':>6}")
        for (worker_id, dp_rank), overlap in overlaps.items():
            print(
                f"{name:<16}{blocks:>7}  {worker_id:>6}{dp_rank:>4}"
                f"{overlap.device:>8}{overlap.host_pinned:>6}{overlap.disk:>6}"
            )
    return 0
