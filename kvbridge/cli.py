"""The ``kvbridge`` command."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any, NoReturn

import msgspec
import structlog
import zmq

from kvbridge.adapters.capture import CaptureError, CaptureReader, CaptureWriter, replay_capture
from kvbridge.adapters.dynamo import TieredIndex
from kvbridge.adapters.metrics import serve_metrics
from kvbridge.adapters.pipeline import IndexSink, StreamPipeline
from kvbridge.adapters.relay import Relay
from kvbridge.adapters.validation import Report, render_text, validate_captures
from kvbridge.adapters.watch import WatchView
from kvbridge.adapters.zmq import DEFAULT_MAX_FRAME_BYTES, Source, StreamReset, Subscriber
from kvbridge.schemas.export import json_schema

__all__ = ["main"]

log = structlog.get_logger("kvbridge")


class _UsageError(Exception):
    """A combination of arguments argparse cannot check by itself."""


class _Parser(argparse.ArgumentParser):
    """Reports a bad argument in one line and exits with status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _configure_logging(log_format: str) -> None:
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if log_format == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )


def _sample_capture() -> Path:
    return Path(str(resources.files("kvbridge") / "data" / "sample.kvcap"))


def _demo(args: argparse.Namespace) -> int:
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
    messages, bad = pipeline.stats["batches_in"], pipeline.stats["bad_frame:schema"]
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


def _sources(args: argparse.Namespace) -> list[Source]:
    """Pair the i-th ``--source-replay`` and ``--worker-id`` with the i-th ``--source``."""
    count = len(args.source)
    replays = args.source_replay or []
    workers = args.worker_id or list(range(count))
    if len(replays) not in (0, count):
        raise _UsageError("give --source-replay once per --source, or not at all")
    if len(workers) != count:
        raise _UsageError("give --worker-id once per --source, or not at all")
    return [
        Source(
            endpoint,
            replays[index] if replays else None,
            workers[index],
            topic=args.source_topic,
        )
        for index, endpoint in enumerate(args.source)
    ]


def _until(args: argparse.Namespace) -> threading.Event:
    """An event set by SIGINT / SIGTERM, or after ``--duration`` seconds if given."""
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    duration = getattr(args, "duration", None)
    if duration:
        timer = threading.Timer(duration, stop.set)
        timer.daemon = True
        timer.start()
    return stop


def _relay(args: argparse.Namespace) -> int:
    with Relay(
        _sources(args),
        block_size=args.block_size,
        publish=args.publish,
        publish_replay=args.publish_replay,
        topic=args.topic,
        buffer_steps=args.buffer_steps,
        max_frame_bytes=args.max_frame_bytes,
        replay_on_start=True,
    ) as relay:
        _serve_metrics(args, relay)
        for source in relay.outputs:
            publish, replay = relay.endpoints(source)
            log.info(
                "relaying",
                worker_id=source.worker_id,
                source=source.endpoint,
                publish=publish,
                publish_replay=replay,
            )
        relay.run(_until(args))
    return 0


def _watch(args: argparse.Namespace) -> int:
    with Relay(
        _sources(args),
        block_size=args.block_size,
        max_frame_bytes=args.max_frame_bytes,
        replay_on_start=True,
    ) as relay:
        _serve_metrics(args, relay)
        stop = _until(args)
        view = WatchView(relay, clear_screen=sys.stdout.isatty())
        while not stop.is_set():
            deadline = time.monotonic() + args.interval
            while not stop.is_set() and time.monotonic() < deadline:
                relay.step(50)
            print(view.render(), flush=True)
    return 0


def _record(args: argparse.Namespace) -> int:
    sources = _sources(args)
    meta = {"command": "kvbridge record", "sources": [msgspec.to_builtins(s) for s in sources]}
    stop = _until(args)
    with (
        Subscriber(
            sources, max_frame_bytes=args.max_frame_bytes, replay_on_start=True
        ) as subscriber,
        CaptureWriter(args.out, meta=meta) as capture,
    ):
        _serve_metrics(args, subscriber=subscriber)
        while not stop.is_set() and (args.count is None or capture.count < args.count):
            for item in subscriber.poll(50):
                if isinstance(item, StreamReset):
                    log.warning("stream reset", stream=item.source.endpoint, reason=item.reason)
                    continue
                stream = ("replay:" if item.replayed else "") + item.source.endpoint
                capture.write(
                    item.frames,
                    stream=stream,
                    worker_id=item.source.worker_id,
                    received_ns=item.received_ns,
                )
                if args.count is not None and capture.count >= args.count:
                    break
            capture.flush()
    log.info("recorded", out=args.out, messages=capture.count)
    return 0


def _replay(args: argparse.Namespace) -> int:
    _serve_metrics(args)
    records = list(CaptureReader(args.capture))
    sent = replay_capture(
        records,
        args.publish,
        pace=args.pace,
        wait_subscribers=args.wait_subscribers,
        stop=_until(args),
    )
    log.info("replayed", capture=args.capture, messages=sent, publish=args.publish)
    return 0


def _validate(args: argparse.Namespace) -> int:
    _serve_metrics(args)
    if args.json_schema:
        print(msgspec.json.format(msgspec.json.encode(msgspec.json.schema(Report))).decode())
        return 0
    if not args.captures:
        raise _UsageError("give at least one capture")
    report = validate_captures(args.captures, strict=args.strict, block_size=args.block_size)
    if args.format == "json":
        print(msgspec.json.format(msgspec.json.encode(report)).decode())
    else:
        print(render_text(report))
    return 0 if report.valid else 1


def _schema(args: argparse.Namespace) -> int:
    _serve_metrics(args)
    print(msgspec.json.format(msgspec.json.encode(json_schema()), indent=2).decode())
    return 0


def _serve_metrics(
    args: argparse.Namespace, relay: Relay | None = None, subscriber: Subscriber | None = None
) -> None:
    if args.metrics_port is not None:
        serve_metrics(args.metrics_port, relay=relay, subscriber=subscriber)
        log.info("serving metrics", url=f"http://127.0.0.1:{args.metrics_port}/metrics")


def _parser() -> argparse.ArgumentParser:
    common = _Parser(add_help=False)
    common.add_argument("--log-format", choices=("console", "json"), default="console")
    common.add_argument(
        "--metrics-port", type=_port, help="serve Prometheus metrics on this port (127.0.0.1)"
    )
    sources = _Parser(add_help=False)
    sources.add_argument(
        "--source",
        action="append",
        required=True,
        metavar="ENDPOINT",
        help="vLLM's KV-events endpoint as configured in vLLM (repeatable); a wildcard host "
        "means vLLM binds and kvbridge connects, any other host means kvbridge binds",
    )
    sources.add_argument(
        "--source-replay", action="append", metavar="ENDPOINT", help="vLLM's replay endpoint"
    )
    sources.add_argument(
        "--worker-id", action="append", type=_u64, metavar="N", help="worker id of each source"
    )
    sources.add_argument("--source-topic", default="", help="subscribe to this topic prefix")
    sources.add_argument(
        "--max-frame-bytes",
        type=_positive_int,
        default=DEFAULT_MAX_FRAME_BYTES,
        help="refuse larger frames",
    )

    parser = _Parser(prog="kvbridge", description="vLLM KV-cache events, made right for Dynamo.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    demo = commands.add_parser(
        "demo",
        parents=[common],
        help="index a capture (the bundled sample by default) and print per-tier overlap",
    )
    demo.add_argument("capture", nargs="?", help="a .kvcap file (default: the bundled sample)")
    demo.add_argument("--block-size", type=_positive_int, help="override the capture's block size")
    demo.set_defaults(run=_demo)

    relay = commands.add_parser(
        "relay",
        parents=[common, sources],
        help="republish vLLM streams as canonical streams that unmodified Dynamo indexes",
    )
    relay.add_argument("--publish", required=True, metavar="ENDPOINT", help="PUB endpoint (bound)")
    relay.add_argument("--publish-replay", metavar="ENDPOINT", help="replay ROUTER endpoint")
    relay.add_argument("--block-size", type=_positive_int, required=True)
    relay.add_argument("--topic", default="", help="topic of the published stream")
    relay.add_argument(
        "--buffer-steps", type=_positive_int, default=10_000, help="replay buffer, in batches"
    )
    relay.add_argument("--duration", type=_positive_float, help="stop after S seconds")
    relay.set_defaults(run=_relay)

    record = commands.add_parser(
        "record", parents=[common, sources], help="record live streams into a .kvcap capture"
    )
    record.add_argument("--out", required=True, metavar="FILE")
    record.add_argument("--count", type=_positive_int, help="stop after N messages")
    record.add_argument("--duration", type=_positive_float, help="stop after S seconds")
    record.set_defaults(run=_record)

    replay = commands.add_parser(
        "replay", parents=[common], help="publish a capture's frames on a PUB socket"
    )
    replay.add_argument("capture", metavar="FILE")
    replay.add_argument("--publish", required=True, metavar="ENDPOINT")
    replay.add_argument("--pace", choices=("original", "max"), default="original")
    replay.add_argument(
        "--wait-subscribers",
        type=_non_negative_float,
        default=5.0,
        metavar="S",
        help="wait up to S seconds for a subscriber before sending (default 5)",
    )
    replay.set_defaults(run=_replay)

    watch = commands.add_parser(
        "watch", parents=[common, sources], help="live view of workers: tiers, rates, recovery"
    )
    watch.add_argument("--block-size", type=_positive_int, required=True)
    watch.add_argument("--interval", type=_positive_float, default=1.0, metavar="S")
    watch.add_argument("--duration", type=_positive_float, help="stop after S seconds")
    watch.set_defaults(run=_watch)

    validate = commands.add_parser(
        "validate",
        parents=[common],
        help="decode and normalize every frame of captures; exit 1 if any is invalid",
    )
    validate.add_argument("captures", nargs="*", metavar="CAPTURE")
    validate.add_argument("--format", choices=("text", "json"), default="text")
    validate.add_argument(
        "--strict",
        action="store_true",
        help="also fail on unknown fields and on blocks that would not be forwarded",
    )
    validate.add_argument("--block-size", type=_positive_int, help="the workers' block size")
    validate.add_argument(
        "--json-schema", action="store_true", help="print the JSON Schema of the JSON report"
    )
    validate.set_defaults(run=_validate)

    schema = commands.add_parser(
        "schema", parents=[common], help="print the JSON Schema of every vLLM layout and Dynamo's"
    )
    schema.set_defaults(run=_schema)
    return parser


def _number(text: str, kind: Callable[[str], Any], low: float, what: str) -> Any:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be at least {low}: {text!r}")
    return value


def _port(text: str) -> int:
    port: int = _number(text, int, 1, "a port number")
    if port > 65535:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}")
    return port


def _u64(text: str) -> int:
    value: int = _number(text, int, 0, "an integer")
    if value >= 2**64:
        raise argparse.ArgumentTypeError(f"does not fit in 64 bits: {text!r}")
    return value


def _positive_float(text: str) -> float:
    value: float = _number(text, float, 1e-9, "a number")
    return value


def _non_negative_float(text: str) -> float:
    value: float = _number(text, float, 0, "a number")
    return value


def _positive_int(text: str) -> int:
    value: int = _number(text, int, 1, "an integer")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _configure_logging(args.log_format)
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        return run(args)
    except (CaptureError, OSError, zmq.ZMQError, RuntimeError) as error:
        print(f"kvbridge {args.command}: error: {error}", file=sys.stderr)
        return 1
    except (_UsageError, ValueError) as error:
        print(f"kvbridge {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
