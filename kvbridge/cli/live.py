"""What the commands that run until stopped share: the sources they subscribe to, the stop
signal, the warning about a silent source and the metrics endpoint.

``relay``, ``record`` and ``watch`` subscribe to ``--source`` engines; ``replay`` also runs
until it is done or stopped. Each takes from here what it needs, so that the same argument means
the same thing in every command.
"""

from __future__ import annotations

import argparse
import errno
import signal
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TypedDict

import structlog

from kvbridge.adapters.endpoints import Endpoint, SilenceWatch
from kvbridge.adapters.relay import Relay
from kvbridge.adapters.source import Source
from kvbridge.adapters.status_server import HEALTH_PATH, METRICS_HOST, serve_metrics
from kvbridge.adapters.subscriber import Subscriber
from kvbridge.cli.usage import MissingExtra, UsageError

__all__ = [
    "StreamOptions",
    "delivered",
    "metrics_served",
    "silence",
    "sources",
    "stream_options",
    "until",
]

log = structlog.get_logger("kvbridge")


def sources(args: argparse.Namespace) -> list[Source]:
    """Pair the i-th ``--source-replay`` and ``--worker-id`` with the i-th ``--source``."""
    count = len(args.source)
    replays: list[Endpoint] = args.source_replay or []
    workers = args.worker_id or list(range(count))
    if len(replays) not in (0, count):
        raise UsageError("give --source-replay once per --source, or not at all")
    if len(workers) != count:
        raise UsageError("give --worker-id once per --source, or not at all")
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


class StreamOptions(TypedDict):
    """The subscriber's bounds that the shared source arguments set, as keyword arguments of
    :class:`~kvbridge.adapters.subscriber.Subscriber` and
    :class:`~kvbridge.adapters.relay.Relay`."""

    max_frame_bytes: int
    replay_timeout: float
    clear_burst: int
    clear_interval: float


def stream_options(args: argparse.Namespace) -> StreamOptions:
    """``--max-frame-bytes``, ``--replay-timeout``, ``--clear-burst`` and ``--clear-interval``."""
    return StreamOptions(
        max_frame_bytes=args.max_frame_bytes,
        replay_timeout=args.replay_timeout,
        clear_burst=args.clear_burst,
        clear_interval=args.clear_interval,
    )


def silence(sources: Sequence[Source]) -> SilenceWatch:
    """The watch that warns, once each, of a source that has delivered nothing yet."""
    return SilenceWatch((source.endpoint, source.subscriber_binds) for source in sources)


def delivered(subscriber: Subscriber, sources: Sequence[Source]) -> list[str]:
    """The endpoints of the sources that have delivered a batch, for :func:`silence`."""
    return [s.endpoint for s in sources if subscriber.last_seq(s) is not None]


def until(args: argparse.Namespace) -> threading.Event:
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


@contextmanager
def loop_failures() -> Iterator[None]:
    """Around a command's loop over its sockets: an error raised there is a bug (no input is
    known to raise one), not a bad argument, so it ends the command with exit 1 and its
    traceback logged, rather than as the usage error (exit 2) that a ``ValueError`` or a
    ``ZMQError`` means before the loop. A closed stdout stays what it is."""
    try:
        yield
    except BrokenPipeError:
        raise
    except Exception as error:
        log.exception("stopped on an error")
        raise RuntimeError(f"stopped on an error: {error!r}") from error


@contextmanager
def metrics_served(
    args: argparse.Namespace, relay: Relay | None = None, subscriber: Subscriber | None = None
) -> Iterator[None]:
    """Serve ``--metrics-port``, if given, while the command's loop runs; stopped on exit, so
    that no request reads a subscriber being closed.

    Raises:
        MissingExtra: prometheus-client is not installed.
        UsageError: the port cannot be bound.
    """
    if args.metrics_port is None:
        yield
        return
    host = args.metrics_host or METRICS_HOST
    try:
        server = serve_metrics(
            args.metrics_port, relay=relay, subscriber=subscriber, host=host.strip("[]")
        )
    except ImportError:
        raise MissingExtra(
            "--metrics-port needs prometheus-client, the extra 'metrics': pip install "
            "prometheus-client (or, in a clone, pip install '.[metrics]')"
        ) from None
    except OSError as error:
        # A port in use is the port's fault; any other failure is the given host's.
        given_host = args.metrics_host is not None and error.errno != errno.EADDRINUSE
        flag = "--metrics-host" if given_host else "--metrics-port"
        raise UsageError(
            f"argument {flag}: cannot bind {host}:{args.metrics_port}: {error.strerror or error}"
        ) from None
    url = f"http://{host}:{args.metrics_port}"
    log.info("serving metrics", url=f"{url}/metrics", health=f"{url}{HEALTH_PATH}")
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()
