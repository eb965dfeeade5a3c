"""The HTTP endpoint of the long-running commands (``kvbridge.adapters.status_server``):
``/healthz`` follows the loop that polls the sources, not the server's own thread, and says
where each source's stream stands; ``/metrics`` adds the process's metrics to kvbridge's.

Real ZMQ sockets on 127.0.0.1 and a real HTTP server; ``kvbridge relay`` in a subprocess for
the command's own endpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from support.relay_process import RelayProcess, Samples, parse_metrics

from kvbridge.adapters.ports import free_port_range
from kvbridge.adapters.publisher import Publisher
from kvbridge.adapters.source import Source
from kvbridge.adapters.status_server import DEFAULT_STALL_S, Health, SourceHealth, serve_metrics
from kvbridge.adapters.subscriber import Subscriber
from kvbridge.cli.live import metrics_served

TIMEOUT = 5.0
STALL_S = 1.0
"""The stall bound of the tests that wait for a stall (the default is 10 s)."""


def get(port: int, path: str) -> tuple[int, bytes]:
    """The status and body of ``GET http://127.0.0.1:port/path``, an error status included."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=TIMEOUT) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def metrics(port: int) -> Samples:
    status, body = get(port, "/metrics")
    assert status == 200
    return parse_metrics(body.decode())


def healthz(port: int) -> tuple[int, Health]:
    status, body = get(port, "/healthz")
    return status, msgspec.json.decode(body, type=Health)


@contextmanager
def served(
    ctx: zmq.Context[zmq.Socket[bytes]], stall_s: float = DEFAULT_STALL_S, **options: Any
) -> Iterator[tuple[Publisher, Subscriber, Source, int]]:
    """An engine's publisher, a subscriber to it (``options``) as worker 7, and the status
    server of that subscriber on a free port, with a stall bound of ``stall_s``."""
    publisher = Publisher("tcp://127.0.0.1:0", bind=True, context=ctx)
    source = Source(f"tcp://*:{publisher.endpoint.rsplit(':', 1)[1]}", None, 7)
    port = free_port_range(1)
    with publisher, Subscriber([source], context=ctx, **options) as subscriber:
        server = serve_metrics(port, subscriber=subscriber, stall_s=stall_s)
        try:
            assert publisher.wait_for_subscribers(timeout=TIMEOUT)
            yield publisher, subscriber, source, port
        finally:
            server.shutdown()
            server.server_close()


def deliver(subscriber: Subscriber, source: Source, seq: int) -> None:
    deadline = time.monotonic() + TIMEOUT
    while subscriber.last_seq(source) != seq:
        assert time.monotonic() < deadline, f"seq {seq} never arrived: {subscriber.stats}"
        subscriber.poll(20)


def test_healthz_follows_the_loop_that_polls(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """200 while the loop polls; 503 once it has not polled for the stall bound, though the
    server's own thread still answers; 200 again when polling resumes."""
    with served(ctx, STALL_S, replay_timeout=0.5) as (publisher, subscriber, source, port):
        for seq in range(3):
            publisher.publish(b"x", seq=seq)
        deliver(subscriber, source, 2)

        status, report = healthz(port)
        assert status == 200
        assert report.status == "ok"
        assert 0 <= report.progress_age_s < STALL_S
        assert report.stall_s == STALL_S
        expected = SourceHealth(source.endpoint, worker_id=7, last_seq=2, suspended=False)
        assert report.sources == [expected]

        time.sleep(STALL_S + 0.1)
        status, report = healthz(port)
        assert status == 503
        assert report.status == "stalled"
        assert report.progress_age_s > STALL_S
        assert report.sources == [expected]
        age = metrics(port)["kvbridge_progress_age_seconds", frozenset()]
        assert report.progress_age_s <= age < report.progress_age_s + 1.0

        subscriber.poll(0)
        status, report = healthz(port)
        assert (status, report.status) == (200, "ok")


def test_healthz_shows_a_suspended_stream_and_stays_healthy(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """A stream whose clears are spent is suspended: ``/healthz`` says so, and answers 200, as
    the process relays its other sources and a restart would not mend this one."""
    with served(ctx, clear_burst=1, clear_interval=3600.0) as (publisher, subscriber, source, port):
        for seq in (0, 1, 0, 1, 0):  # two restarts: the first takes the only clear token
            publisher.publish(b"x", seq=seq)
        deadline = time.monotonic() + TIMEOUT
        while subscriber.stats.messages < 5:
            assert time.monotonic() < deadline, subscriber.stats
            subscriber.poll(20)
        assert subscriber.stats.restarts == 1

        status, report = healthz(port)
        samples = metrics(port)
    assert status == 200
    assert report.sources == [SourceHealth(source.endpoint, 7, last_seq=1, suspended=True)]
    labels = frozenset({("worker", "7"), ("endpoint", source.endpoint)})
    assert samples["kvbridge_stream_suspended", labels] == 1
    assert samples["kvbridge_bad_frames_total", frozenset({("reason", "throttled")})] == 1


def test_metrics_add_the_process_metrics(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with served(ctx) as (publisher, subscriber, source, port):
        publisher.publish(b"x", seq=0)
        deliver(subscriber, source, 0)
        samples = metrics(port)
    assert samples["kvbridge_restarts_total", frozenset()] == 0
    assert samples["process_resident_memory_bytes", frozenset()] > 10**6
    assert samples["process_open_fds", frozenset()] > 0
    assert ("python_info", "implementation") in {
        (name, key) for name, labels in samples for key, _ in labels
    }


def test_the_relay_command_serves_its_health(tmp_path: Path) -> None:
    """``kvbridge relay --metrics-port`` answers ``/healthz`` with each source, in the order
    given, and logs where."""
    port = free_port_range(5)  # sources, outputs (offset per source), metrics
    first, second = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}"
    with RelayProcess(
        [
            "--source", first, "--worker-id", "4", "--source", second, "--worker-id", "9",
            "--publish", f"tcp://127.0.0.1:{port + 2}", "--block-size", "4",
        ],
        metrics_port=port + 4,
        log_path=tmp_path / "relay.log",
    ) as relay:  # fmt: skip
        status, report = healthz(port + 4)
        log = relay.log()
    assert status == 200
    assert report.status == "ok"
    assert report.stall_s == DEFAULT_STALL_S
    assert report.sources == [
        SourceHealth(first, 4, last_seq=None, suspended=False),
        SourceHealth(second, 9, last_seq=None, suspended=False),
    ]
    assert f"health=http://127.0.0.1:{port + 4}/healthz" in log


@pytest.mark.parametrize("path", ["/metrics", "/"])
def test_other_paths_get_the_metrics(ctx: zmq.Context[zmq.Socket[bytes]], path: str) -> None:
    with served(ctx) as (_, _, _, port):
        status, body = get(port, path)
    assert status == 200
    assert b"kvbridge_gaps_total 0.0" in body


def test_healthz_stays_ok_while_replays_go_unanswered(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """Four streams meet a gap each, and no one serves their replay endpoints: the replays
    are waited for together, not one after another, and no poll waits for them, so
    ``/healthz`` answers 200 throughout with a stall bound of two replay timeouts."""
    replay_timeout, stall_s = 0.4, 0.8
    port = free_port_range(4)  # replay endpoints that no one serves
    with contextlib.ExitStack() as stack:
        publishers = [
            stack.enter_context(Publisher("tcp://127.0.0.1:0", bind=True, context=ctx))
            for _ in range(4)
        ]
        sources = [
            Source(publisher.endpoint, f"tcp://127.0.0.1:{port + i}", worker_id=i, bind=False)
            for i, publisher in enumerate(publishers)
        ]
        subscriber = stack.enter_context(
            Subscriber(sources, context=ctx, replay_timeout=replay_timeout)
        )
        for publisher in publishers:
            assert publisher.wait_for_subscribers(timeout=TIMEOUT)
            publisher.publish(b"x", seq=0)
        for source in sources:
            deliver(subscriber, source, 0)
        for publisher in publishers:
            publisher.publish(b"x", seq=5)  # a gap of four batches on every stream
        time.sleep(0.3)  # all four in ZMQ's queues

        server = serve_metrics(free_port_range(1), subscriber=subscriber, stall_s=stall_s)
        stack.callback(server.server_close)
        stack.callback(server.shutdown)
        began = time.monotonic()
        statuses, longest_poll = [], 0.0
        while subscriber.stats.replay_timeouts < 4:
            assert time.monotonic() < began + TIMEOUT, subscriber.stats
            polled = time.monotonic()
            subscriber.poll(50)
            longest_poll = max(longest_poll, time.monotonic() - polled)
            statuses.append(healthz(server.server_port)[0])
        took = time.monotonic() - began
    assert subscriber.stats.gaps == 4
    assert subscriber.stats.lost == 16
    assert replay_timeout <= took < 2 * replay_timeout
    assert longest_poll < replay_timeout
    assert set(statuses) == {200}


def test_replays_are_read_at_most_max_replays_at_a_time(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """With ``replay_on_start``, every source asks for its replay at the first poll, and at
    most ``max_replays`` answers are waited for at a time: the third source's request goes
    out when one of the first two times out."""
    port = free_port_range(6)
    sources = [
        Source(f"tcp://127.0.0.1:{port + i}", f"tcp://127.0.0.1:{port + 3 + i}", worker_id=i)
        for i in range(3)
    ]
    with Subscriber(
        sources, context=ctx, replay_on_start=True, replay_timeout=0.2, max_replays=2
    ) as subscriber:
        stats = subscriber.stats
        seen = []
        deadline = time.monotonic() + TIMEOUT
        while stats.replay_timeouts < 3:
            assert time.monotonic() < deadline, stats
            subscriber.poll(20)
            if not seen or seen[-1] != (stats.replays, stats.replay_timeouts):
                seen.append((stats.replays, stats.replay_timeouts))
    assert seen[0] == (2, 0)
    assert seen[-1] == (3, 3)
    assert all(replays - timeouts <= 2 for replays, timeouts in seen)


def test_the_relay_command_takes_the_replay_timeout_and_clear_rate(tmp_path: Path) -> None:
    """``--replay-timeout`` reaches the relay's subscriber (the start-up replay of a replay
    endpoint no one serves times out, and the source backs off for as long), and
    ``--clear-burst`` / ``--clear-interval`` its clear rate: a burst of one suspends the stream
    at the second restart of the engine."""
    port = free_port_range(4)
    with (
        Publisher(f"tcp://127.0.0.1:{port}", bind=True) as engine,
        RelayProcess(
            [
                "--source", f"connect:tcp://127.0.0.1:{port}",
                "--source-replay", f"tcp://127.0.0.1:{port + 3}",
                "--publish", f"tcp://127.0.0.1:{port + 1}",
                "--block-size", "4", "--replay-timeout", "0.25", "--clear-burst", "1",
                "--clear-interval", "3600",
            ],
            metrics_port=port + 2,
            log_path=tmp_path / "relay.log",
        ) as relay,
    ):  # fmt: skip
        assert relay.wait_value("kvbridge_replay_timeouts_total", 1), relay.log()
        assert engine.wait_for_subscribers(timeout=TIMEOUT)
        for seq in (0, 1, 0, 1, 0):  # the engine restarts (its sequence starts over) twice
            engine.publish(b"x", seq=seq)
        assert relay.wait_value("kvbridge_bad_frames_total", 1, reason="throttled"), relay.log()
        time.sleep(1.2)  # past the default interval: the stream is still suspended
        status, report = healthz(port + 2)
        samples = relay.metrics()
        log = relay.log()
    assert "replays skipped after a timeout" in log
    assert "seconds=0.25" in log
    assert (status, report.sources[0].suspended) == (200, True)
    assert samples["kvbridge_restarts_total", frozenset()] == 1


def test_the_endpoint_stops_with_the_command(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """A command's endpoint is served while its loop runs and stopped when the loop ends,
    before the subscriber is closed, so that no request reads a closed subscriber."""
    port = free_port_range(2)
    args = argparse.Namespace(metrics_port=port + 1, metrics_host=None)
    with Subscriber([Source(f"tcp://127.0.0.1:{port}")], context=ctx) as subscriber:
        with metrics_served(args, subscriber=subscriber):
            assert healthz(port + 1)[0] == 200
        with pytest.raises(urllib.error.URLError) as error:
            get(port + 1, "/healthz")
    assert isinstance(error.value.reason, ConnectionRefusedError)
