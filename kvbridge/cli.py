"""The ``kvbridge`` command.

Exit codes: 0 when the command did its job, 1 for invalid data (``validate`` found a bad frame or
an unmet requirement; a file that is not a readable capture), 2 for bad usage (an argument that
is wrong, missing, repeated or refused, an endpoint that cannot be bound or connected, a missing
file, a missing extra). Errors are one line on stderr; a closed stdout (``kvbridge schema |
head``) ends the command quietly.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import re
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any, Final, NoReturn

import msgspec
import structlog
import zmq

from kvbridge.adapters.capture import (
    CaptureError,
    CaptureReader,
    CaptureWriter,
    capture_streams,
    read_prompts,
    replay_streams,
)
from kvbridge.adapters.dynamo import TieredIndex
from kvbridge.adapters.dynamo_compare import compare_captures
from kvbridge.adapters.endpoints import (
    Endpoint,
    EndpointError,
    Mode,
    SilenceWatch,
    clash,
    parse_endpoint,
)
from kvbridge.adapters.metrics import serve_metrics
from kvbridge.adapters.pipeline import IndexSink, StreamPipeline
from kvbridge.adapters.publisher import DEFAULT_BUFFER_STEPS
from kvbridge.adapters.relay import Relay
from kvbridge.adapters.validation import Report, render_text, validate_captures
from kvbridge.adapters.watch import MissingExtra, WatchView, require_rich
from kvbridge.adapters.zmq import DEFAULT_MAX_FRAME_BYTES, Source, StreamReset, Subscriber
from kvbridge.schemas.export import json_schema

__all__ = ["main"]

log = structlog.get_logger("kvbridge")

_ENDPOINT_HELP: Final = (
    "[bind:|connect:]tcp://HOST:PORT or ipc://PATH. Without a prefix, vLLM's rule: a wildcard "
    "host (tcp://*:5557) means the engine binds and kvbridge connects (to 127.0.0.1); any other "
    "address means the engine connects, so kvbridge binds it. connect:tcp://10.1.2.3:5557 "
    "subscribes to a remote engine that binds"
)
_ORDINALS: Final = ("1st", "2nd", "3rd")


class _UsageError(Exception):
    """A combination of arguments argparse cannot check by itself."""


class _Parser(argparse.ArgumentParser):
    """Reports a bad argument in one line and exits with status 2; options that take one value
    refuse to be given twice."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.register("action", None, _Once)
        self.register("action", "store", _Once)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


class _Once(argparse._StoreAction):
    """``store``, except that a second occurrence is an error rather than the last one winning."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        seen: set[str] = namespace.__dict__.setdefault("_given", set())
        if option_string is not None and self.dest in seen:
            raise argparse.ArgumentError(self, "given more than once (it takes one value)")
        seen.add(self.dest)
        setattr(namespace, self.dest, values)


class _Refuse(argparse.Action):
    """An option a command does not take, refused with the reason."""

    def __init__(self, *args: Any, reason: str, **kwargs: Any) -> None:
        self.reason = reason
        super().__init__(*args, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        raise argparse.ArgumentError(self, self.reason)


class _Use(msgspec.Struct, frozen=True):
    """One socket a command will bind or connect, and the argument it comes from."""

    flag: str
    endpoint: Endpoint
    mode: Mode
    note: str = ""

    @property
    def address(self) -> str:
        return self.endpoint.dialled(self.mode)

    def describe(self) -> str:
        return f"{self.flag} {self.address}" + (f" ({self.note})" if self.note else "")


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


# -- endpoints ------------------------------------------------------------------------------


def _source_mode(endpoint: Endpoint) -> Mode:
    """How kvbridge subscribes to a source: the prefix, else the opposite of the engine."""
    if endpoint.mode is not None:
        return endpoint.mode
    return "connect" if endpoint.engine_binds else "bind"


def _engine_mode(endpoint: Endpoint) -> Mode:
    """How ``replay`` publishes, as the recorded engine would: the prefix, else vLLM's rule."""
    if endpoint.mode is not None:
        return endpoint.mode
    return "bind" if endpoint.engine_binds else "connect"


def _offset(flag: str, endpoint: Endpoint, index: int, what: str, mode: Mode = "bind") -> _Use:
    """The ``index``-th socket of an argument that the relay or replay offsets per stream."""
    try:
        shifted = endpoint.offset(index)
    except EndpointError as error:
        raise _UsageError(
            f"argument {flag}: {error} (the {_ordinal(index + 1)} {what} goes on its port + "
            f"{index})"
        ) from None
    note = f"its port + {index}, for the {_ordinal(index + 1)} {what}" if index else ""
    return _Use(flag, shifted, mode, note)


def _ordinal(n: int) -> str:
    return _ORDINALS[n - 1] if n <= len(_ORDINALS) else f"{n}th"


def _source_uses(args: argparse.Namespace) -> list[_Use]:
    uses = [_Use("--source", e, _source_mode(e)) for e in args.source]
    uses += [_Use("--source-replay", e, "connect") for e in args.source_replay or []]
    return uses


def _check_uses(args: argparse.Namespace, uses: list[_Use]) -> None:
    """Refuse two arguments that name the same socket; remember the uses to name the argument
    of a socket that fails to bind or connect."""
    if getattr(args, "metrics_port", None) is not None:
        metrics = parse_endpoint(f"tcp://127.0.0.1:{args.metrics_port}")
        uses = [*uses, _Use("--metrics-port", metrics, "bind")]
    for index, use in enumerate(uses):
        for earlier in uses[:index]:
            if not clash(earlier.endpoint, earlier.mode, use.endpoint, use.mode):
                continue
            if earlier.flag == use.flag and not earlier.note and not use.note:
                raise _UsageError(f"argument {use.flag}: {use.address} is given twice")
            own = f" ({use.note})" if use.note else ""
            raise _UsageError(
                f"argument {use.flag}: {use.address}{own} is the same socket as "
                f"{earlier.describe()}"
            )
    args.uses = uses


def _endpoint(flag: str) -> Callable[[str], Endpoint]:
    """The argparse type of an endpoint argument: ``--source``, ``--source-replay``, the relay's
    ``--publish`` and ``--publish-replay``, or ``replay --publish``."""

    def parse(text: str) -> Endpoint:
        try:
            endpoint = parse_endpoint(text)
        except EndpointError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        if endpoint.transport == "inproc":
            raise argparse.ArgumentTypeError(
                f"inproc:// reaches only sockets of the same process: use tcp:// or ipc:// "
                f"({text!r})"
            )
        if flag == "--source-replay" and endpoint.mode == "bind":
            raise argparse.ArgumentTypeError(
                f"kvbridge always connects to a replay endpoint (the engine binds it): "
                f"drop bind: ({text!r})"
            )
        if flag in ("relay --publish", "--publish-replay") and endpoint.mode == "connect":
            raise argparse.ArgumentTypeError(
                f"the relay always binds its outputs (Dynamo connects to them): "
                f"drop connect: ({text!r})"
            )
        return endpoint

    return parse


def _socket_error(args: argparse.Namespace, error: zmq.ZMQError) -> str:
    """A bind or connect that failed, as one line naming the argument."""
    text = str(error)
    match = re.search(r" \(addr='([^']*)'\)$", text)
    reason = text[: match.start()] if match else text
    address = match.group(1) if match else None
    for use in getattr(args, "uses", []):
        if use.address == address:
            line = f"argument {use.flag}: cannot {use.mode} {address}: {reason}"
            if error.errno == errno.EADDRNOTAVAIL and use.mode == "bind":
                line += f"; {address} is not an address of this host"
                if use.flag == "--source":
                    line += f" (to connect to an engine that binds it: connect:{address})"
            return line
    return reason if address is None else f"cannot use {address}: {reason}"


def _sources(args: argparse.Namespace) -> list[Source]:
    """Pair the i-th ``--source-replay`` and ``--worker-id`` with the i-th ``--source``."""
    count = len(args.source)
    replays: list[Endpoint] = args.source_replay or []
    workers = args.worker_id or list(range(count))
    if len(replays) not in (0, count):
        raise _UsageError("give --source-replay once per --source, or not at all")
    if len(workers) != count:
        raise _UsageError("give --worker-id once per --source, or not at all")
    return [
        Source(
            endpoint.address,
            replays[index].address if replays else None,
            workers[index],
            topic=args.source_topic,
            bind=None if endpoint.mode is None else endpoint.mode == "bind",
        )
        for index, endpoint in enumerate(args.source)
    ]


def _silence(sources: Sequence[Source]) -> SilenceWatch:
    return SilenceWatch((source.endpoint, source.subscriber_binds) for source in sources)


def _delivered(subscriber: Subscriber, sources: Sequence[Source]) -> list[str]:
    return [s.endpoint for s in sources if subscriber.last_seq(s) is not None]


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


# -- commands -------------------------------------------------------------------------------


def _relay(args: argparse.Namespace) -> int:
    sources = _sources(args)
    uses = _source_uses(args)
    uses += [_offset("--publish", args.publish, i, "--source") for i in range(len(sources))]
    if args.publish_replay is not None:
        replay = args.publish_replay
        uses += [_offset("--publish-replay", replay, i, "--source") for i in range(len(sources))]
    _check_uses(args, uses)
    with Relay(
        sources,
        block_size=args.block_size,
        publish=args.publish.address,
        publish_replay=args.publish_replay.address if args.publish_replay else None,
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
        stop = _until(args)
        silence = _silence(sources)
        while not stop.is_set():
            relay.step(100)
            silence.check(_delivered(relay.subscriber, sources))
    return 0


def _watch(args: argparse.Namespace) -> int:
    require_rich()
    sources = _sources(args)
    _check_uses(args, _source_uses(args))
    with Relay(
        sources,
        block_size=args.block_size,
        max_frame_bytes=args.max_frame_bytes,
        replay_on_start=True,
    ) as relay:
        _serve_metrics(args, relay)
        stop = _until(args)
        view = WatchView(relay)
        silence = _silence(sources)

        def wait() -> None:
            deadline = time.monotonic() + args.interval
            while not stop.is_set() and time.monotonic() < deadline:
                view.poll(50)
                silence.check(view.delivered())

        if sys.stdout.isatty():
            from rich.live import Live

            with Live(auto_refresh=False, vertical_overflow="crop") as live:
                while not stop.is_set():
                    wait()
                    live.update(view.renderable(), refresh=True)
        else:
            width = shutil.get_terminal_size((120, 24)).columns
            while not stop.is_set():
                wait()
                if not _print(view.render(width) + "\n"):
                    break
    return 0


def _record(args: argparse.Namespace) -> int:
    sources = _sources(args)
    _check_uses(args, _source_uses(args))
    meta: dict[str, Any] = {
        "command": "kvbridge record",
        "sources": [msgspec.to_builtins(s) for s in sources],
    }
    if args.block_size is not None:
        meta["block_size"] = args.block_size
    if args.prompts is not None:
        meta["prompts"] = msgspec.to_builtins(read_prompts(args.prompts))
    stop = _until(args)
    with (
        Subscriber(
            sources, max_frame_bytes=args.max_frame_bytes, replay_on_start=True
        ) as subscriber,
        CaptureWriter(args.out, meta=meta) as capture,
    ):
        _serve_metrics(args, subscriber=subscriber)
        silence = _silence(sources)
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
            silence.check(_delivered(subscriber, sources))
    log.info("recorded", out=args.out, messages=capture.count)
    return 0


def _replay(args: argparse.Namespace) -> int:
    reader = CaptureReader(args.capture)
    streams = capture_streams(reader)
    publish: Endpoint = args.publish
    mode = _engine_mode(publish)
    uses = [_offset("--publish", publish, i, "stream", mode) for i in range(len(streams))]
    _check_uses(args, uses)
    block_size = reader.meta.get("block_size")
    plan = list(zip(uses, streams.items(), strict=True))
    subscribe: list[str] = []
    for use, (stream, records) in plan:
        worker_id = records[0].worker_id
        log.info(
            "replaying",
            stream=stream,
            worker_id=worker_id,
            block_size=block_size,
            messages=len(records),
            publish=use.endpoint.address,
            mode=mode,
        )
        subscribe += [
            "--source",
            _subscriber_arg(use.endpoint, mode),
            "--worker-id",
            str(worker_id),
        ]
    if subscribe:
        if block_size:
            subscribe += ["--block-size", str(block_size)]
        log.info("subscribe with: " + " ".join(subscribe))
    else:
        log.warning(f"{args.capture}: the capture has no frames")
    results = replay_streams(
        [(use.endpoint.address, records) for use, (_, records) in plan],
        bind=mode == "bind",
        pace=args.pace,
        wait_subscribers=args.wait_subscribers,
        stop=_until(args),
    )
    for result in results:
        if args.wait_subscribers > 0 and not result.subscribed:
            log.warning(_no_subscriber(result.endpoint, mode, args.wait_subscribers))
    sent = sum(result.sent for result in results)
    log.info("replayed", capture=args.capture, messages=sent, publish=publish.address)
    return 0


def _subscriber_arg(endpoint: Endpoint, replay_mode: Mode) -> str:
    """The ``--source`` that meets ``replay``'s socket: it must do the opposite."""
    default = "connect" if endpoint.engine_binds else "bind"
    wanted = "connect" if replay_mode == "bind" else "bind"
    return endpoint.address if wanted == default else f"{wanted}:{endpoint.address}"


def _no_subscriber(endpoint: str, mode: Mode, waited: float) -> str:
    if mode == "bind":
        how = f"replay binds {endpoint}, so the subscriber must connect to it"
    else:
        how = f"replay connects to {endpoint}, so the subscriber must bind it"
    return (
        f"no subscriber on {endpoint} after {waited:g} s: is anyone subscribed there? {how} "
        "(both sides binding or both connecting deliver nothing)"
    )


def _validate(args: argparse.Namespace) -> int:
    if args.json_schema:
        if args.captures:
            raise _UsageError("--json-schema prints the report's schema: give no capture")
        _print(msgspec.json.format(msgspec.json.encode(msgspec.json.schema(Report))).decode())
        return 0
    if not args.captures:
        raise _UsageError("give at least one capture")
    for flag, given in (("--prompts", args.prompts), ("--fail-on-dynamo-diff", args.fail_on_diff)):
        if given and not args.compare_dynamo:
            raise _UsageError(f"{flag} goes with --compare-dynamo")
    prompts = None if args.prompts is None else read_prompts(args.prompts)
    report = validate_captures(
        args.captures,
        strict=args.strict,
        block_size=args.block_size,
        allow_empty=args.allow_empty,
        min_frames=args.min_frames or 0,
        require_media=args.require_medium or (),
    )
    if args.compare_dynamo:
        comparison = compare_captures(args.captures, block_size=args.block_size, prompts=prompts)
        report = msgspec.structs.replace(report, dynamo=comparison)
    if args.format == "json":
        _print(msgspec.json.format(msgspec.json.encode(report)).decode())
    else:
        _print(render_text(report))
    differs = args.fail_on_diff and report.dynamo is not None and report.dynamo.differs
    return 0 if report.valid and not differs else 1


def _schema(args: argparse.Namespace) -> int:
    _print(msgspec.json.format(msgspec.json.encode(json_schema()), indent=2).decode())
    return 0


def _serve_metrics(
    args: argparse.Namespace, relay: Relay | None = None, subscriber: Subscriber | None = None
) -> None:
    if args.metrics_port is not None:
        try:
            serve_metrics(args.metrics_port, relay=relay, subscriber=subscriber)
        except RuntimeError:  # prometheus-client is missing
            raise MissingExtra(
                "--metrics-port needs prometheus-client, the extra 'metrics': pip install "
                "prometheus-client (or, in a clone, pip install '.[metrics]')"
            ) from None
        except OSError as error:
            raise _UsageError(
                f"argument --metrics-port: cannot bind 127.0.0.1:{args.metrics_port}: "
                f"{error.strerror or error}"
            ) from None
        log.info("serving metrics", url=f"http://127.0.0.1:{args.metrics_port}/metrics")


def _print(text: str) -> bool:
    """Print to stdout; ``False`` if the reader has gone (stdout is then /dev/null)."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        _silence_stdout()
        return False
    return True


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush does not fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


# -- the parser -----------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    log_format = _Parser(add_help=False)
    log_format.add_argument("--log-format", choices=("console", "json"), default="console")
    metrics = _Parser(add_help=False)
    metrics.add_argument(
        "--metrics-port", type=_port, help="serve Prometheus metrics on this port (127.0.0.1)"
    )
    sources = _Parser(add_help=False)
    sources.add_argument(
        "--source",
        action="append",
        required=True,
        type=_endpoint("--source"),
        metavar="ENDPOINT",
        help="a vLLM engine's KV-events endpoint (repeatable, one per engine or dp rank): "
        + _ENDPOINT_HELP,
    )
    sources.add_argument(
        "--source-replay",
        action="append",
        type=_endpoint("--source-replay"),
        metavar="ENDPOINT",
        help="the engine's replay endpoint, the i-th for the i-th --source (always connected; "
        "a wildcard host means 127.0.0.1)",
    )
    sources.add_argument(
        "--worker-id",
        action="append",
        type=_u64,
        metavar="N",
        help="worker id of the i-th --source (default: 0, 1, ...)",
    )
    sources.add_argument("--source-topic", default="", help="subscribe to this topic prefix")
    sources.add_argument(
        "--max-frame-bytes",
        type=_positive_int,
        default=DEFAULT_MAX_FRAME_BYTES,
        help="refuse larger frames",
    )

    parser = _Parser(
        prog="kvbridge",
        description="vLLM KV-cache events, made right for Dynamo. Exit codes: 0 done, "
        "1 invalid data, 2 bad usage or missing file.",
    )
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def no_metrics(command: argparse.ArgumentParser, name: str) -> None:
        command.add_argument(
            "--metrics-port",
            action=_Refuse,
            reason=f"kvbridge {name} serves no metrics (relay, record and watch do)",
            help=argparse.SUPPRESS,
        )

    demo = commands.add_parser(
        "demo",
        parents=[log_format],
        help="index a capture (the bundled sample by default) and print per-tier overlap",
    )
    demo.add_argument("capture", nargs="?", help="a .kvcap file (default: the bundled sample)")
    demo.add_argument("--block-size", type=_positive_int, help="override the capture's block size")
    no_metrics(demo, "demo")
    demo.set_defaults(run=_demo)

    relay = commands.add_parser(
        "relay",
        parents=[log_format, metrics, sources],
        help="republish vLLM streams as canonical streams that unmodified Dynamo indexes",
        description="The i-th --source is republished on --publish's port + i (its replay on "
        "--publish-replay's port + i), as vLLM offsets dp ranks.",
    )
    relay.add_argument(
        "--publish",
        required=True,
        type=_endpoint("relay --publish"),
        metavar="ENDPOINT",
        help="PUB endpoint of the 1st source's canonical stream (always bound)",
    )
    relay.add_argument(
        "--publish-replay",
        type=_endpoint("--publish-replay"),
        metavar="ENDPOINT",
        help="replay ROUTER endpoint of the 1st source's canonical stream (always bound)",
    )
    relay.add_argument("--block-size", type=_positive_int, required=True)
    relay.add_argument("--topic", default="", help="topic of the published stream")
    relay.add_argument(
        "--buffer-steps",
        type=_positive_int,
        default=DEFAULT_BUFFER_STEPS,
        help="replay buffer, in batches",
    )
    relay.add_argument("--duration", type=_positive_float, help="stop after S seconds")
    relay.set_defaults(run=_relay)

    record = commands.add_parser(
        "record",
        parents=[log_format, metrics, sources],
        help="record live streams into a .kvcap capture",
    )
    record.add_argument("--out", required=True, metavar="FILE")
    record.add_argument("--count", type=_positive_int, help="stop after N messages")
    record.add_argument("--duration", type=_positive_float, help="stop after S seconds")
    record.add_argument(
        "--block-size",
        type=_positive_int,
        help="the engines' block size, kept in the capture for demo and validate",
    )
    record.add_argument(
        "--prompts",
        metavar="FILE",
        help="the prompts of the traffic, as token ids, kept in the capture's header: a JSON "
        "list of token-id lists or of objects with token_ids (and a name)",
    )
    record.set_defaults(run=_record)

    replay = commands.add_parser(
        "replay",
        parents=[log_format],
        help="publish a capture's frames, one PUB socket per recorded stream",
        description="Each recorded stream gets a PUB socket of its own: the i-th on --publish's "
        "port + i, in the order the streams first appear in the capture. The log says which "
        "worker and block size each stream had, and the --source arguments that subscribe.",
    )
    replay.add_argument("capture", metavar="FILE")
    replay.add_argument(
        "--publish",
        required=True,
        type=_endpoint("replay --publish"),
        metavar="ENDPOINT",
        help="PUB endpoint of the 1st stream, bound or connected as a vLLM engine would "
        "(a wildcard host binds, any other address connects), or as bind:/connect: says",
    )
    replay.add_argument("--pace", choices=("original", "max"), default="original")
    replay.add_argument(
        "--wait-subscribers",
        type=_non_negative_float,
        default=5.0,
        metavar="S",
        help="wait up to S seconds for a subscriber before sending (default 5)",
    )
    no_metrics(replay, "replay")
    replay.set_defaults(run=_replay)

    watch = commands.add_parser(
        "watch",
        parents=[log_format, metrics, sources],
        help="live view of workers: tiers, rates, recovery (needs the watch extra)",
    )
    watch.add_argument("--block-size", type=_positive_int, required=True)
    watch.add_argument("--interval", type=_positive_float, default=1.0, metavar="S")
    watch.add_argument("--duration", type=_positive_float, help="stop after S seconds")
    watch.set_defaults(run=_watch)

    validate = commands.add_parser(
        "validate",
        parents=[log_format],
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
        "--allow-empty", action="store_true", help="accept a capture without frames"
    )
    validate.add_argument(
        "--min-frames",
        type=_positive_int,
        metavar="N",
        help="fail with fewer than N frames over all captures",
    )
    validate.add_argument(
        "--require-medium",
        action="append",
        type=_medium,
        metavar="MEDIUM",
        help="fail unless some event has this medium, e.g. CPU (repeatable; an event without "
        "a medium is GPU)",
    )
    validate.add_argument(
        "--compare-dynamo",
        action="store_true",
        help="also replay the captures into a real Dynamo SelectionService, raw and through "
        "kvbridge, and report the blocks and prompt overlaps Dynamo alone gets wrong",
    )
    validate.add_argument(
        "--prompts",
        metavar="FILE",
        help="with --compare-dynamo: prompts to ask both services about instead of the "
        "captures' own (a JSON list as record --prompts takes, or an object with 'prompts')",
    )
    validate.add_argument(
        "--fail-on-dynamo-diff",
        dest="fail_on_diff",
        action="store_true",
        help="with --compare-dynamo: exit 1 if Dynamo alone differs",
    )
    validate.add_argument(
        "--json-schema", action="store_true", help="print the JSON Schema of the JSON report"
    )
    no_metrics(validate, "validate")
    validate.set_defaults(run=_validate)

    schema = commands.add_parser(
        "schema", help="print the JSON Schema of every vLLM layout and Dynamo's"
    )
    no_metrics(schema, "schema")
    schema.add_argument(
        "--log-format",
        action=_Refuse,
        reason="kvbridge schema writes no log",
        help=argparse.SUPPRESS,
    )
    schema.set_defaults(run=_schema, log_format="console")
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
    value: float = _number(text, float, float("-inf"), "a number")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return value


def _non_negative_float(text: str) -> float:
    value: float = _number(text, float, 0, "a number")
    if value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be finite: {text!r}")
    return value


def _positive_int(text: str) -> int:
    value: int = _number(text, int, 1, "an integer")
    return value


def _medium(text: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_]+", text):
        raise argparse.ArgumentTypeError(f"not a medium: {text!r} (e.g. GPU, CPU, DISK)")
    return text.upper()


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    _configure_logging(args.log_format)
    run: Callable[[argparse.Namespace], int] = args.run
    prefix = f"kvbridge {args.command}: error:"
    try:
        return run(args)
    except BrokenPipeError:
        _silence_stdout()
        return 0
    except CaptureError as error:
        print(f"{prefix} {error}", file=sys.stderr)
        return 1
    except zmq.ZMQError as error:
        print(f"{prefix} {_socket_error(args, error)}", file=sys.stderr)
        return 2
    except OSError as error:
        where = f"{error.filename}: " if error.filename is not None else ""
        print(f"{prefix} {where}{error.strerror or error}", file=sys.stderr)
        return 2
    except (_UsageError, MissingExtra, EndpointError, ValueError) as error:
        print(f"{prefix} {error}", file=sys.stderr)
        return 2
    except RuntimeError as error:
        print(f"{prefix} {error}", file=sys.stderr)
        return 1
    except SystemExit as exit_:
        if isinstance(exit_.code, str):  # a usage error raised with its message
            print(exit_.code, file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
