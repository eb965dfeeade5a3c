"""``kvbridge demo``: index a capture (the bundled sample by default) in-process and print each
prompt's overlap per worker and tier, so that a first run shows the whole path with no engine
and no Dynamo service."""

from __future__ import annotations

import argparse
from importlib import resources
from pathlib import Path

from kvbridge.adapters.capture import CaptureReader
from kvbridge.adapters.pipeline import IndexSink, StreamPipeline
from kvbridge.adapters.tiered_index import TieredIndex
from kvbridge.cli.output import write

__all__ = ["run_demo"]


def _sample_capture() -> Path:
    return Path(str(resources.files("kvbridge") / "data" / "sample.kvcap"))


def run_demo(args: argparse.Namespace) -> int:
    """Decode and index a capture, then print each prompt's overlap per worker and tier."""
    path = _sample_capture() if args.capture is None else Path(args.capture)
    reader = CaptureReader(path)
    block_size = args.block_size or reader.block_size
    if not block_size:
        raise SystemExit("kvbridge demo: error: the capture names no block size; pass --block-size")
    prompts = reader.prompts
    index = TieredIndex(block_size)
    pipeline = StreamPipeline(block_size, sinks=[IndexSink(index)])
    for record in reader:
        pipeline.feed_record(record)  # a bad frame is logged, counted and skipped
    messages, bad_frames = pipeline.stats.batches_in, pipeline.stats.bad_frames
    bad = f"{bad_frames.total()} bad"
    if bad_frames:
        bad += f" ({', '.join(f'{k} {v}' for k, v in sorted(bad_frames.items()))})"
    lines = [f"{path.name}: {messages} messages, {bad}, block size {block_size}"]
    for worker_id, worker in sorted(pipeline.workers.items()):
        normalizer = worker.normalizer
        drops = ", ".join(f"{k}={v}" for k, v in sorted(normalizer.stats.items())) or "none"
        lines.append(f"worker {worker_id}: not forwarded: {drops}")
    lines.append(
        f"\n{'prompt':<16}{'blocks':>7}  {'worker':>6}{'dp':>4}{'device':>8}{'host':>6}{'disk':>6}"
    )
    for prompt in prompts:
        overlaps = index.overlap(
            prompt.token_ids, lora_name=prompt.lora_name, cache_salt=prompt.cache_salt
        )
        name, blocks = prompt.name, len(prompt.token_ids) // block_size
        if not overlaps:
            lines.append(f"{name:<16}{blocks:>7}  {'-':>6}")
        for (worker_id, dp_rank), overlap in overlaps.items():
            lines.append(
                f"{name:<16}{blocks:>7}  {worker_id:>6}{dp_rank:>4}"
                f"{overlap.device:>8}{overlap.host_pinned:>6}{overlap.disk:>6}"
            )
    write("\n".join(lines))
    return 0
