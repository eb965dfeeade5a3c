"""``kvbridge record``: write live streams into a ``.kvcap`` capture, frames as received, for
fixtures, ``kvbridge validate`` in CI and ``kvbridge replay``."""

from __future__ import annotations

import argparse
from typing import Any

import msgspec
import structlog

from kvbridge.adapters.capture import CaptureWriter, read_prompts
from kvbridge.adapters.source import StreamReset
from kvbridge.adapters.subscriber import Subscriber
from kvbridge.cli import live
from kvbridge.cli.sockets import check_uses, source_uses

__all__ = ["run_record"]

log = structlog.get_logger("kvbridge")


def run_record(args: argparse.Namespace) -> int:
    """Record until ``--count`` messages, ``--duration``, SIGINT or SIGTERM: each message, and
    each reset of a stream (a restart, a loss, a repair) where it fell, so that a reader builds
    what a relay built (:meth:`CaptureWriter.write_item`); the header keeps the sources, and
    ``--block-size`` and ``--prompts`` if given."""
    sources = live.sources(args)
    check_uses(args, source_uses(args))
    meta: dict[str, Any] = {
        "command": "kvbridge record",
        "sources": [msgspec.to_builtins(s) for s in sources],
    }
    if args.block_size is not None:
        meta["block_size"] = args.block_size
    if args.prompts is not None:
        meta["prompts"] = msgspec.to_builtins(read_prompts(args.prompts))
    stop = live.until(args)
    with (
        Subscriber(sources, replay_on_start=True, **live.stream_options(args)) as subscriber,
        CaptureWriter(args.out, meta=meta) as capture,
        live.metrics_served(args, subscriber=subscriber),
    ):
        silence = live.silence(sources)
        while not stop.is_set() and (args.count is None or capture.count < args.count):
            for item in subscriber.poll(50):
                if isinstance(item, StreamReset):
                    log.warning("stream reset", stream=item.source.endpoint, reason=item.reason)
                capture.write_item(item)
                if args.count is not None and capture.count >= args.count:
                    break
            capture.flush()
            silence.check(live.delivered(subscriber, sources))
    log.info("recorded", out=args.out, messages=capture.count, resets=capture.resets)
    return 0
