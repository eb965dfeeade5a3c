"""The command line: every command, its arguments and their help.

Each command's parser sets ``run``, the function that carries the command out; the modules named
after the commands hold those. A parser here reports a bad argument in one line and exits with
status 2, and an option that takes one value refuses to be given twice rather than let the last
one silently win.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, Final, NoReturn

from kvbridge.adapters.publisher import DEFAULT_BUFFER_STEPS
from kvbridge.adapters.relay import DEFAULT_BUFFER_BYTES, DEFAULT_MERGE_BYTES
from kvbridge.adapters.subscriber import (
    DEFAULT_CLEAR_BURST,
    DEFAULT_CLEAR_INTERVAL_S,
    DEFAULT_MAX_FRAME_BYTES,
    DEFAULT_REPLAY_TIMEOUT_S,
)
from kvbridge.cli import arguments
from kvbridge.cli.demo_command import run_demo
from kvbridge.cli.record_command import run_record
from kvbridge.cli.relay_command import run_relay
from kvbridge.cli.replay_command import run_replay
from kvbridge.cli.schema_command import run_schema
from kvbridge.cli.validate_command import run_validate
from kvbridge.cli.watch_command import run_watch

__all__ = ["build_parser"]

_ENDPOINT_HELP: Final = (
    "[bind:|connect:]tcp://HOST:PORT, tcp://[IPv6]:PORT or ipc://PATH. Without a prefix, vLLM's "
    "rule: a wildcard host (tcp://*:5557) or an address with :: in it means the engine binds "
    "and kvbridge connects (to 127.0.0.1, or [::1] for [::]); any other address means the "
    "engine connects, so kvbridge binds it. connect:tcp://10.1.2.3:5557 subscribes to a remote "
    "engine that binds"
)

_LIVE: Final = "relay, record and watch do"
"""The commands that follow live streams, the only ones that serve metrics."""


class _Parser(argparse.ArgumentParser):
    """Reports a bad argument in one line and exits with status 2; options that take one value
    refuse to be given twice."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.register("action", None, _Once)
        self.register("action", "store", _Once)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


class _Checked(argparse._StoreAction):
    """``store``, once :meth:`refusal` has nothing against this occurrence of the option."""

    def refusal(self, namespace: argparse.Namespace, option_string: str | None) -> str | None:
        """Why this occurrence is refused, or ``None`` to store its value. Called once per
        occurrence, so a subclass may record the occurrence here."""
        return None

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        reason = self.refusal(namespace, option_string)
        if reason is not None:
            raise argparse.ArgumentError(self, reason)
        setattr(namespace, self.dest, values)


class _Once(_Checked):
    """``store``, except that a second occurrence is an error rather than the last one winning."""

    def refusal(self, namespace: argparse.Namespace, option_string: str | None) -> str | None:
        # Records this option as given (in the namespace's ``_given``), for the next occurrence.
        seen: set[str] = namespace.__dict__.setdefault("_given", set())
        if option_string is not None and self.dest in seen:
            return "given more than once (it takes one value)"
        seen.add(self.dest)
        return None


class _Refuse(_Checked):
    """An option a command does not take, refused with the reason."""

    def __init__(self, *args: Any, reason: str, **kwargs: Any) -> None:
        self.reason = reason
        super().__init__(*args, **kwargs)

    def refusal(self, namespace: argparse.Namespace, option_string: str | None) -> str | None:
        return self.reason


def build_parser() -> argparse.ArgumentParser:
    """Every command and its arguments; each command's ``run`` is set as a default, for
    :func:`kvbridge.cli.main` to call."""
    log_format = _Parser(add_help=False)
    log_format.add_argument("--log-format", choices=("console", "json"), default="console")
    metrics = _Parser(add_help=False)
    metrics.add_argument(
        "--metrics-port",
        type=arguments.port,
        help="serve Prometheus metrics (/metrics) and a health check (/healthz) on this port "
        "(of --metrics-host)",
    )
    metrics.add_argument(
        "--metrics-host",
        type=arguments.metrics_host,
        metavar="HOST",
        help="the address metrics are served on: an IPv4 or IPv6 address or a host name, * for "
        "every IPv4 interface, :: for every interface (default: 127.0.0.1)",
    )
    sources = _Parser(add_help=False)
    sources.add_argument(
        "--source",
        action="append",
        required=True,
        type=arguments.endpoint("--source"),
        metavar="ENDPOINT",
        help="a vLLM engine's KV-events endpoint (repeatable, one per engine or dp rank): "
        + _ENDPOINT_HELP,
    )
    sources.add_argument(
        "--source-replay",
        action="append",
        type=arguments.endpoint("--source-replay"),
        metavar="ENDPOINT",
        help="the engine's replay endpoint, the i-th for the i-th --source (always connected; "
        "a wildcard host means 127.0.0.1, [::] means [::1])",
    )
    sources.add_argument(
        "--worker-id",
        action="append",
        type=arguments.u64,
        metavar="N",
        help="worker id of the i-th --source (default: 0, 1, ...)",
    )
    sources.add_argument(
        "--source-topic",
        default="",
        type=arguments.topic,
        help="subscribe to this topic prefix",
    )
    sources.add_argument(
        "--max-frame-bytes",
        type=arguments.frame_bytes,
        default=DEFAULT_MAX_FRAME_BYTES,
        help="refuse larger frames",
    )
    sources.add_argument(
        "--replay-timeout",
        type=arguments.replay_timeout,
        default=DEFAULT_REPLAY_TIMEOUT_S,
        metavar="S",
        help="seconds an engine's replay answer may take (then its replays back off)",
    )
    sources.add_argument(
        "--clear-burst",
        type=arguments.positive_int,
        default=DEFAULT_CLEAR_BURST,
        metavar="N",
        help="clears a source may cause at once, past which its stream is suspended",
    )
    sources.add_argument(
        "--clear-interval",
        type=arguments.non_negative_float,
        default=DEFAULT_CLEAR_INTERVAL_S,
        metavar="S",
        help="seconds per clear a source's allowance refills (0: clears are not rate-limited)",
    )

    parser = _Parser(
        prog="kvbridge",
        description="vLLM KV-cache events, made right for Dynamo. Exit codes: 0 done, "
        "1 invalid data, 2 bad usage or missing file.",
    )
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def refuse(command: argparse.ArgumentParser, option: str, reason: str) -> None:
        command.add_argument(option, action=_Refuse, reason=reason, help=argparse.SUPPRESS)

    def command(
        name: str,
        run: Callable[[argparse.Namespace], int],
        *,
        live: bool = False,
        logs: bool = True,
        **options: Any,
    ) -> argparse.ArgumentParser:
        """A command's parser, with ``run`` as its default. A live command (it follows engines'
        streams: relay, record, watch) takes the sources and serves metrics; any other refuses
        ``--metrics-port`` and ``--metrics-host`` with the reason. One that writes no log
        refuses ``--log-format``."""
        assert logs or not live, "a live command logs"
        parents = [log_format, metrics, sources] if live else [log_format] if logs else []
        added = commands.add_parser(name, parents=parents, **options)
        added.set_defaults(run=run, command_parser=added)
        if not live:
            refuse(added, "--metrics-port", f"kvbridge {name} serves no metrics ({_LIVE})")
            refuse(added, "--metrics-host", f"kvbridge {name} serves no metrics ({_LIVE})")
        if not logs:
            refuse(added, "--log-format", f"kvbridge {name} writes no log")
            added.set_defaults(log_format="console")
        return added

    demo = command(
        "demo",
        run_demo,
        help="index a capture (the bundled sample by default) and print per-tier overlap",
    )
    demo.add_argument(
        "capture",
        nargs="?",
        type=arguments.path,
        help="a .kvcap file (default: the bundled sample)",
    )
    demo.add_argument(
        "--block-size", type=arguments.block_size, help="override the capture's block size"
    )

    relay = command(
        "relay",
        run_relay,
        live=True,
        help="republish vLLM streams as canonical streams that unmodified Dynamo indexes",
        description="The i-th --source is republished on --publish's port + i (its replay on "
        "--publish-replay's port + i), as vLLM offsets dp ranks.",
    )
    relay.add_argument(
        "--publish",
        required=True,
        type=arguments.endpoint("relay --publish"),
        metavar="ENDPOINT",
        help="PUB endpoint of the 1st source's canonical stream (always bound)",
    )
    relay.add_argument(
        "--publish-replay",
        type=arguments.endpoint("--publish-replay"),
        metavar="ENDPOINT",
        help="replay ROUTER endpoint of the 1st source's canonical stream (always bound)",
    )
    relay.add_argument("--block-size", type=arguments.block_size, required=True)
    relay.add_argument(
        "--topic", default="", type=arguments.topic, help="topic of the published stream"
    )
    relay.add_argument(
        "--buffer-steps",
        type=arguments.buffer_steps,
        default=DEFAULT_BUFFER_STEPS,
        help="replay buffer, in batches",
    )
    relay.add_argument(
        "--buffer-bytes",
        type=arguments.positive_int,
        default=DEFAULT_BUFFER_BYTES,
        help="replay buffer, at most this many payload bytes (besides --buffer-steps batches)",
    )
    relay.add_argument(
        "--merge-bytes",
        type=arguments.non_negative_int,
        default=DEFAULT_MERGE_BYTES,
        help="in a backlog, merge an output's consecutive batches into canonical batches of up "
        "to about this many bytes (0: one batch per input batch)",
    )
    relay.add_argument(
        "--output-hwm",
        type=arguments.hwm,
        help="messages each output queues for a consumer that does not read, past which ZMQ "
        "drops them for it (default: 16 MiB over --merge-bytes, between 1 and 10,000: 256 at "
        "the default merge, 10,000 with --merge-bytes 0)",
    )
    relay.add_argument("--duration", type=arguments.positive_float, help="stop after S seconds")

    record = command(
        "record",
        run_record,
        live=True,
        help="record live streams into a .kvcap capture",
    )
    record.add_argument("--out", required=True, type=arguments.path, metavar="FILE")
    record.add_argument("--count", type=arguments.positive_int, help="stop after N messages")
    record.add_argument("--duration", type=arguments.positive_float, help="stop after S seconds")
    record.add_argument(
        "--block-size",
        type=arguments.block_size,
        help="the engines' block size, kept in the capture for demo and validate",
    )
    record.add_argument(
        "--prompts",
        type=arguments.path,
        metavar="FILE",
        help="the prompts of the traffic, as token ids, kept in the capture's header: a JSON "
        "list of token-id lists or of objects with token_ids (and a name)",
    )

    replay = command(
        "replay",
        run_replay,
        help="publish a capture's frames, one PUB socket per recorded stream",
        description="Each recorded stream gets a PUB socket of its own: the i-th on --publish's "
        "port + i, in the order the streams first appear in the capture. The log says which "
        "worker and block size each stream had, and the --source arguments that subscribe.",
    )
    replay.add_argument("capture", type=arguments.path, metavar="FILE")
    replay.add_argument(
        "--publish",
        required=True,
        type=arguments.endpoint("replay --publish"),
        metavar="ENDPOINT",
        help="PUB endpoint of the 1st stream, bound or connected as a vLLM engine would "
        "(a wildcard host binds, any other address connects), or as bind:/connect: says",
    )
    replay.add_argument("--pace", choices=("original", "max"), default="original")
    replay.add_argument(
        "--wait-subscribers",
        type=arguments.non_negative_float,
        default=5.0,
        metavar="S",
        help="wait up to S seconds for a subscriber before sending (default 5)",
    )

    watch = command(
        "watch",
        run_watch,
        live=True,
        help="live view of workers: tiers, rates, recovery (needs the watch extra)",
    )
    watch.add_argument("--block-size", type=arguments.block_size, required=True)
    watch.add_argument("--interval", type=arguments.positive_float, default=1.0, metavar="S")
    watch.add_argument("--duration", type=arguments.positive_float, help="stop after S seconds")

    validate = command(
        "validate",
        run_validate,
        help="decode and normalize every frame of captures; exit 1 if any is invalid",
    )
    validate.add_argument("captures", nargs="*", type=arguments.path, metavar="CAPTURE")
    validate.add_argument("--format", choices=("text", "json"), default="text")
    validate.add_argument(
        "--strict",
        action="store_true",
        help="also fail on unknown fields and on blocks that would not be forwarded",
    )
    validate.add_argument("--block-size", type=arguments.block_size, help="the workers' block size")
    validate.add_argument(
        "--allow-empty", action="store_true", help="accept a capture without frames"
    )
    validate.add_argument(
        "--min-frames",
        type=arguments.positive_int,
        metavar="N",
        help="fail with fewer than N frames over all captures",
    )
    validate.add_argument(
        "--require-medium",
        action="append",
        type=arguments.medium,
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
        type=arguments.path,
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

    command(
        "schema",
        run_schema,
        logs=False,
        help="print the JSON Schema of every vLLM layout and Dynamo's",
    )
    return parser
