"""Run ``kvbridge relay`` / ``kvbridge watch`` as subprocesses and talk to them over real sockets.

* The relay binds its ``i``-th output on ``--publish`` port + ``i`` (and ``--publish-replay``
  port + ``i``), so a two-worker relay needs consecutive ports:
  :func:`kvbridge.adapters.ports.free_port_range` finds them.
* :class:`RelayProcess` starts ``python -m kvbridge.cli relay ...``, waits until its
  ``--metrics-port`` answers and always terminates it (kill after a timeout).
* :func:`wait_tcp_peers` waits until a port that a subprocess bound has ``count`` established
  TCP peers (read from ``/proc/net/tcp``). It stands in for ``Publisher.wait_for_subscribers``
  on the relay's own PUB sockets, which live in another process: Dynamo's ``upsert_worker``
  returns before its SUB is connected, and a batch published earlier is lost.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kvbridge._closing import ClosedOnExit

__all__ = [
    "RelayProcess",
    "Samples",
    "fetch_metrics",
    "kvbridge_command",
    "parse_metrics",
    "port_of",
    "start_kvbridge",
    "stop_process",
    "wait_tcp_peers",
]

_START_TIMEOUT_S = 15.0

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
"""``{(sample name, frozenset of label items): value}``."""


# --------------------------------------------------------------------------- ports


def port_of(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def _established_peers(port: int) -> int:
    """Established TCP connections whose local end is ``port`` (one per connected peer)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                local, state = fields[1], fields[3]
                if state == "01" and int(local.rsplit(":", 1)[1], 16) == port:
                    count += 1
    return count


def wait_tcp_peers(port: int, count: int = 1, timeout: float = 5.0, settle: float = 0.1) -> None:
    """Block until ``count`` peers are connected to the listening ``port``, then ``settle`` s
    for the ZMTP handshake and the subscription that follows it.

    Raises:
        TimeoutError: fewer peers within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while _established_peers(port) < count:
        if time.monotonic() >= deadline:
            raise TimeoutError(f"fewer than {count} peers on port {port} within {timeout}s")
        time.sleep(0.01)
    time.sleep(settle)


# --------------------------------------------------------------------------- metrics


def parse_metrics(text: str) -> Samples:
    """Every sample of a Prometheus text exposition, keyed by name and labels."""
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name, frozenset(sample.labels.items())] = sample.value
    return samples


def fetch_metrics(port: int, timeout: float = 2.0, host: str = "127.0.0.1") -> str:
    """The metrics text served on ``host`` (an IPv6 address in brackets) and ``port``."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout) as answer:
        text: str = answer.read().decode()
        return text


# --------------------------------------------------------------------------- subprocesses


def stop_process(process: subprocess.Popen[bytes], timeout: float = 5.0) -> None:
    """SIGTERM ``process``, then SIGKILL it if it has not exited after ``timeout`` s, so that no
    test leaves a subprocess behind. Nothing happens if it has exited already."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout)


def kvbridge_command(*args: str) -> list[str]:
    """``python -m kvbridge.cli ARGS`` with this interpreter."""
    return [sys.executable, "-m", "kvbridge.cli", *args]


def start_kvbridge(*args: str, env: Mapping[str, str] | None = None) -> subprocess.Popen[str]:
    """``kvbridge ARGS`` started with its stdout and stderr piped, as text (``env``: the
    child's environment, this process's by default)."""
    return subprocess.Popen(
        kvbridge_command(*args),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


class RelayProcess(ClosedOnExit):
    """``kvbridge relay`` in a subprocess, ready once its metrics endpoint answers.

    ``args`` are the relay's arguments after ``relay`` (``--metrics-port`` is added). Its log
    (stderr) goes to ``log_path`` so that a full pipe can never block it. ``metrics_host`` is
    where its metrics are read (give ``--metrics-host`` in ``args`` to serve them elsewhere).
    """

    def __init__(
        self,
        args: Sequence[str],
        *,
        metrics_port: int,
        log_path: Path,
        metrics_host: str = "127.0.0.1",
    ) -> None:
        self.metrics_port = metrics_port
        self.metrics_host = metrics_host
        self.log_path = log_path
        self._log = log_path.open("wb")
        self.process = subprocess.Popen(
            kvbridge_command("relay", *args, "--metrics-port", str(metrics_port)),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            self._wait_ready()
        except BaseException:
            self.close()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"kvbridge relay exited with {self.process.returncode}:\n{self.log()}"
                )
            with contextlib.suppress(OSError, urllib.error.URLError):
                fetch_metrics(self.metrics_port, timeout=0.5, host=self.metrics_host)
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(f"kvbridge relay not serving metrics:\n{self.log()}")
            time.sleep(0.05)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def metrics_text(self) -> str:
        return fetch_metrics(self.metrics_port, host=self.metrics_host)

    def metrics(self) -> Samples:
        return parse_metrics(self.metrics_text())

    def value(self, name: str, **labels: str) -> float:
        """One sample's value (0.0 if the relay does not export it yet)."""
        return self.metrics().get((name, frozenset(labels.items())), 0.0)

    def wait_value(self, name: str, expected: float, timeout: float = 5.0, **labels: str) -> bool:
        """Poll until the sample equals ``expected``; ``False`` on timeout."""
        deadline = time.monotonic() + timeout
        while self.value(name, **labels) != expected:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    def close(self) -> None:
        """SIGTERM, then SIGKILL after 5 s. Idempotent."""
        stop_process(self.process)
        self._log.close()
