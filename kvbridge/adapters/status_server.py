"""The HTTP endpoint of a command that runs until stopped (``relay``, ``record``, ``watch``):
Prometheus metrics on ``/metrics`` and a health check on ``/healthz``, on one port
(``--metrics-port``), served from a daemon thread.

The server answers from a thread of its own, so an answer proves nothing about the loop that
does the work. ``/healthz`` answers 200 while that loop moves on, and 503 once it has not for
``stall_s`` seconds (:data:`DEFAULT_STALL_S`): a loop stuck on something, or one whose thread
died. The loop moves on when it begins a poll, at least every 100 ms
(:attr:`~kvbridge.adapters.subscriber.Subscriber.progressed_at`): a poll reads at most its
budget of live messages and what has arrived of the replays it waits for, without waiting
for any, so a working relay stays far from the bound. It is what a Kubernetes liveness probe
asks; a readiness probe can ask the same, as a relay takes listeners from the moment its
outputs are bound.

The body is JSON (:class:`Health`): the status, how long ago the loop last moved on, and per
source its endpoint, worker id, the seq of its last batch delivered and whether its stream is
suspended (clears throttled). A suspended source leaves the process healthy: the other sources
are relayed, and a restart would not mend that one.

Any other path gets the metrics, as from ``prometheus_client``'s own server. Needs the
``metrics`` extra (``prometheus-client``).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterable
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any, Final, Literal
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server
from wsgiref.types import StartResponse, WSGIApplication, WSGIEnvironment

import msgspec

from kvbridge.adapters.relay_metrics import metrics_registry

if TYPE_CHECKING:
    from kvbridge.adapters.relay import Relay
    from kvbridge.adapters.subscriber import Subscriber

__all__ = [
    "DEFAULT_STALL_S",
    "HEALTH_PATH",
    "METRICS_HOST",
    "Health",
    "SourceHealth",
    "health",
    "serve_metrics",
]

METRICS_HOST: Final = "127.0.0.1"
"""Where metrics are served unless told otherwise: this host alone."""
HEALTH_PATH: Final = "/healthz"
DEFAULT_STALL_S: Final = 10.0
"""Seconds of a loop that does not move on after which ``/healthz`` answers 503."""
_IDLE_TIMEOUT_S: Final = 10.0


class SourceHealth(msgspec.Struct, frozen=True):
    """Where one source's stream stands."""

    endpoint: str
    worker_id: int
    last_seq: int | None
    """The seq of the last batch delivered, ``None`` before the first."""
    suspended: bool
    """The stream needed a clear with its clear tokens spent: what it sends is skipped until a
    token is back, when the clear goes out (whether or not the source sends) and the stream
    starts over from the engine's replay (or at its next message)."""


class Health(msgspec.Struct, frozen=True):
    """What ``/healthz`` answers."""

    status: Literal["ok", "stalled"]
    progress_age_s: float
    """Seconds since the loop last moved on: began a poll (a poll waits for no replay)."""
    stall_s: float
    """The bound on ``progress_age_s`` past which the status is ``stalled``."""
    sources: list[SourceHealth]


def health(subscriber: Subscriber, stall_s: float = DEFAULT_STALL_S) -> Health:
    """The health of the loop that polls ``subscriber``, and where each of its sources stands.

    Read from another thread than the loop's: each value is read whole, and a source's values
    may be a poll apart."""
    since = time.monotonic() - subscriber.progressed_at
    return Health(
        status="ok" if since <= stall_s else "stalled",
        progress_age_s=round(since, 3),
        stall_s=stall_s,
        sources=[
            SourceHealth(
                endpoint=source.endpoint,
                worker_id=source.worker_id,
                last_seq=subscriber.last_seq(source),
                suspended=subscriber.suspended(source),
            )
            for source in subscriber.sources
        ],
    )


def _with_health(
    metrics: WSGIApplication, subscriber: Subscriber, stall_s: float
) -> WSGIApplication:
    """``metrics``, the WSGI app of prometheus-client, with :data:`HEALTH_PATH` answered."""

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != HEALTH_PATH:
            return metrics(environ, start_response)
        report = health(subscriber, stall_s)
        body = msgspec.json.encode(report)
        status = "200 OK" if report.status == "ok" else "503 Service Unavailable"
        headers = [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
        start_response(status, headers)
        return [body]

    return app


class _Server(ThreadingMixIn, WSGIServer):
    """A request per thread, so that a slow scraper cannot hold up a probe."""

    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    """No line on stderr per request: probes come every few seconds. A connection that sends
    nothing for :data:`_IDLE_TIMEOUT_S` is closed, so that idle clients do not hold threads."""

    timeout = _IDLE_TIMEOUT_S

    def log_message(self, format: str, *args: Any) -> None:
        pass


def serve_metrics(
    port: int,
    *,
    relay: Relay | None = None,
    subscriber: Subscriber | None = None,
    host: str = METRICS_HOST,
    stall_s: float = DEFAULT_STALL_S,
) -> WSGIServer:
    """Serve ``http://host:port/metrics`` and ``/healthz`` from a daemon thread: the relay's
    (or a bare subscriber's) counters with the process's (``process_*``: memory, CPU, file
    descriptors; ``python_info``), and the health of the loop that polls the subscriber (the
    relay's own). Returns the server, for a caller that stops it (``shutdown()``, then
    ``server_close()``) before it closes the subscriber.

    Raises:
        ImportError: prometheus-client is not installed.
        ValueError: neither a relay nor a subscriber.
        OSError: ``host`` and ``port`` cannot be bound.
    """
    try:
        from prometheus_client import PlatformCollector, ProcessCollector, make_wsgi_app
    except ImportError as error:
        raise ImportError(
            "serving metrics needs the metrics extra: pip install 'kvbridge[metrics]'"
        ) from error
    subscriber = subscriber or (relay.subscriber if relay is not None else None)
    if subscriber is None:
        raise ValueError("serve_metrics needs a relay or a subscriber")
    registry = metrics_registry(relay, subscriber)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    app = _with_health(make_wsgi_app(registry), subscriber, stall_s)
    family, _, _, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]

    class Server(_Server):
        address_family = family

    server = make_server(str(address[0]), port, app, Server, handler_class=_QuietHandler)
    thread = threading.Thread(target=server.serve_forever, name="kvbridge-metrics", daemon=True)
    thread.start()
    return server
