"""Dynamo's two standalone services behind ``kvbridge relay``, all as subprocesses, as a user runs
them: ``python -m dynamo.indexer`` (HTTP ``/register``, ``/query``) and ``python -m
dynamo.select_service`` (HTTP ``/workers``, ``/overlap_scores``), from ``ai-dynamo-runtime``.

The bundled sample has both streams Dynamo gets wrong on its own:

- worker 1 offloads two blocks of ``support-bot`` to CPU with OffloadingConnector placeholder
  events (no tokens, block size 0), then evicts them from the GPU: Dynamo drops the placeholders
  ("Block not published. Block size must be 4 tokens ... Block size is: 0"), so it sees 2 blocks
  on GPU or CPU where there are 4;
- worker 2 is an older release (positional arrays) with raw ``bytes`` hashes: Dynamo rejects
  every batch ("data did not match any variant of untagged enum BlockHashValue") and indexes
  nothing of it.

``kvbridge replay`` publishes the sample, one socket per recorded stream. Straight into the
services, the answers are wrong in exactly those two ways; through ``kvbridge relay``, both
services answer what kvbridge's own index answers (the table ``kvbridge demo`` prints).

Ports are taken below the kernel's ephemeral range; Dynamo's logs (``DYN_LOG=warn``, from
``conftest.py``) go to files under the test's temporary directory.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.relay_process import RelayProcess, stop_process, wait_tcp_peers

from kvbridge.adapters.capture import CaptureReader
from kvbridge.adapters.pipeline import IndexSink, StreamPipeline
from kvbridge.adapters.ports import free_port_range
from kvbridge.adapters.tiered_index import TieredIndex

SAMPLE = Path(__file__).resolve().parents[1] / "kvbridge" / "data" / "sample.kvcap"
BLOCK_SIZE = 4
PROMPTS: dict[str, list[int]] = {
    prompt["name"]: prompt["token_ids"] for prompt in CaptureReader(SAMPLE).meta["prompts"]
}
TIMEOUT = 20.0

Overlaps = dict[str, dict[int, tuple[int, int, int]]]
"""``{prompt: {worker: (device, host_pinned, disk)}}`` in blocks, cumulative over tiers; workers
with no overlap left out."""

RIGHT: Overlaps = {
    "support-bot": {1: (2, 4, 4), 2: (2, 2, 2)},
    "code-review": {1: (3, 3, 3)},
    "translate": {2: (1, 2, 2)},
}
"""What kvbridge's index answers for the sample (``kvbridge demo``)."""

WRONG: Overlaps = {
    "support-bot": {1: (2, 2, 2)},  # the two CPU blocks are missing; worker 2 is missing
    "code-review": {1: (3, 3, 3)},
    "translate": {},  # only worker 2 holds it
}
"""What Dynamo answers when the sample's streams reach it unrelayed."""

PLACEHOLDER_DROPPED = (
    "Block not published. Block size must be 4 tokens to be published. Block size is: 0"
)
BYTES_REJECTED = (
    "Failed to decode KvEventBatch: data did not match any variant of untagged enum BlockHashValue"
)


def test_right_is_kvbridges_own_index() -> None:
    index = TieredIndex(BLOCK_SIZE)
    pipeline = StreamPipeline(BLOCK_SIZE, sinks=[IndexSink(index)])
    for record in CaptureReader(SAMPLE):
        pipeline.feed_record(record)
    ours = {
        name: {
            worker: (o.device, o.host_pinned, o.disk)
            for (worker, _), o in index.overlap(tokens).items()
        }
        for name, tokens in PROMPTS.items()
    }
    assert ours == RIGHT


# --------------------------------------------------------------------------- the services


def http(port: int, method: str, path: str, body: Any = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=data,
        method=method,
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=5) as answer:
        text = answer.read()
        return json.loads(text) if text else None


class Service:
    """One standalone Dynamo service in a subprocess, its log in a file."""

    def __init__(self, module: str, port: int, log: Path) -> None:
        self.module = module
        self.port = port
        self.log_path = log
        self._log = log.open("wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", module, "--port", str(port), "--threads", "1"],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=os.environ.copy(),
        )
        deadline = time.monotonic() + TIMEOUT
        while True:
            assert self.process.poll() is None, f"{module} exited:\n{self.log()}"
            try:
                http(port, "GET", "/health")
                return
            except (OSError, urllib.error.URLError):
                assert time.monotonic() < deadline, f"{module} never answered:\n{self.log()}"
                time.sleep(0.1)

    def log(self) -> str:
        self._log.flush()
        return re.sub(r"\x1b\[[0-9;]*m", "", self.log_path.read_text(errors="replace"))

    def close(self) -> None:
        stop_process(self.process)
        self._log.close()


class Indexer(Service):
    """``python -m dynamo.indexer``: ``POST /register``, ``POST /query`` (counts in tokens)."""

    def register(self, worker: int, model: str, endpoint: str, replay: str | None) -> None:
        body: dict[str, Any] = {
            "instance_id": worker,
            "endpoint": endpoint,
            "model_name": model,
            "block_size": BLOCK_SIZE,
        }
        if replay is not None:
            body["replay_endpoint"] = replay
        assert http(self.port, "POST", "/register", body) == {"status": "ok"}

    def overlaps(self, model: str) -> Overlaps:
        out: Overlaps = {}
        for name, tokens in PROMPTS.items():
            answer = http(self.port, "POST", "/query", {"token_ids": tokens, "model_name": model})
            out[name] = {
                int(worker): (
                    counts["gpu"] // BLOCK_SIZE,
                    counts["cpu"] // BLOCK_SIZE,
                    counts["disk"] // BLOCK_SIZE,
                )
                for worker, counts in answer["instances"].items()
                if counts["disk"]
            }
        return out


class SelectService(Service):
    """``python -m dynamo.select_service``: ``POST /workers``, ``POST /overlap_scores`` (blocks)."""

    def register(self, worker: int, model: str, endpoint: str, replay: str | None) -> None:
        body: dict[str, Any] = {
            "worker_id": worker,
            "model_name": model,
            "endpoint": f"http://worker-{worker}",
            "block_size": BLOCK_SIZE,
            "kv_events_endpoint": endpoint,
        }
        if replay is not None:
            body["replay_endpoint"] = replay
        record = http(self.port, "POST", "/workers", body)
        assert (record["worker_id"], record["lifecycle"]) == (worker, "schedulable"), record

    def overlaps(self, model: str) -> Overlaps:
        out: Overlaps = {}
        for name, tokens in PROMPTS.items():
            answer = http(
                self.port, "POST", "/overlap_scores", {"token_ids": tokens, "model_name": model}
            )
            out[name] = {
                w["worker_id"]: (w["device_blocks"], w["host_pinned_blocks"], w["disk_blocks"])
                for w in answer["workers"]
                if w["disk_blocks"]
            }
        return out


@pytest.fixture(scope="module")
def ports() -> Iterator[Callable[[int], int]]:
    """Hands out consecutive ports from one free range below the ephemeral range."""
    base = free_port_range(16)
    given = [base]

    def take(count: int) -> int:
        first = given[0]
        given[0] += count
        assert given[0] <= base + 16
        return first

    yield take


@pytest.fixture(scope="module")
def services(
    ports: Callable[[int], int], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Service]]:
    logs = tmp_path_factory.mktemp("dynamo")
    started: dict[str, Service] = {}
    try:
        started["indexer"] = Indexer("dynamo.indexer", ports(1), logs / "indexer.log")
        started["select_service"] = SelectService(
            "dynamo.select_service", ports(1), logs / "select_service.log"
        )
        yield started
    finally:
        for service in started.values():
            service.close()


def replay(publish: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvbridge.cli", "replay", str(SAMPLE), "--publish", publish,
         "--pace", "max"],
        capture_output=True, text=True, check=False, timeout=TIMEOUT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "[warning" not in result.stderr, result.stderr  # a subscriber on every stream


def eventually(read: Callable[[], Overlaps], expected: Overlaps, log: Callable[[], str]) -> None:
    deadline = time.monotonic() + TIMEOUT
    while (seen := read()) != expected:
        assert time.monotonic() < deadline, f"{seen} != {expected}\n{log()}"
        time.sleep(0.1)


# --------------------------------------------------------------------------- the tests

RAW_IDS = {"indexer": {1: 11, 2: 12}, "select_service": {1: 21, 2: 22}}


@pytest.mark.parametrize("name", ["indexer", "select_service"])
def test_without_the_relay_dynamo_is_wrong(
    services: dict[str, Service], ports: Callable[[int], int], name: str
) -> None:
    """The sample's streams straight into the service: worker 1's CPU blocks and all of worker
    2 are missing, and the service's log says why."""
    service = services[name]
    model = f"raw-{name}"
    port = ports(2)
    workers = RAW_IDS[name]  # ids of their own, apart from the relayed workers 1 and 2
    for stream, worker in workers.items():
        service.register(worker, model, f"tcp://127.0.0.1:{port + stream - 1}", None)
    # vLLM's rule: the engine binds a wildcard endpoint, and Dynamo connects to it.
    replay(f"tcp://*:{port}")

    wrong = {p: {workers[w]: o for w, o in per.items()} for p, per in WRONG.items()}
    deadline = time.monotonic() + TIMEOUT
    while service.log().count(BYTES_REJECTED) < 3 or PLACEHOLDER_DROPPED not in service.log():
        assert time.monotonic() < deadline, service.log()  # all 7 batches have arrived
        time.sleep(0.1)
    eventually(lambda: service.overlaps(model), wrong, service.log)
    right = {p: {workers[w]: o for w, o in per.items()} for p, per in RIGHT.items()}
    assert service.overlaps(model) != right


def test_through_the_relay_both_services_are_right(
    services: dict[str, Service], ports: Callable[[int], int], tmp_path: Path
) -> None:
    """The sample replayed into ``kvbridge relay``; both services registered with the relay's
    endpoints (and its replay sockets) answer what kvbridge's index answers."""
    sources, publish, publish_replay, metrics = ports(2), ports(2), ports(2), ports(1)
    with RelayProcess(
        [
            "--source", f"tcp://127.0.0.1:{sources}", "--worker-id", "1",
            "--source", f"tcp://127.0.0.1:{sources + 1}", "--worker-id", "2",
            "--publish", f"tcp://127.0.0.1:{publish}",
            "--publish-replay", f"tcp://127.0.0.1:{publish_replay}",
            "--block-size", str(BLOCK_SIZE),
        ],
        metrics_port=metrics,
        log_path=tmp_path / "relay.log",
    ) as relay:  # fmt: skip
        for service in services.values():
            for offset, worker in enumerate((1, 2)):
                service.register(
                    worker,
                    "relayed",
                    f"tcp://127.0.0.1:{publish + offset}",
                    f"tcp://127.0.0.1:{publish_replay + offset}",
                )
        for offset in range(2):  # both services subscribed to both outputs
            wait_tcp_peers(publish + offset, count=len(services), timeout=TIMEOUT)
        # The engine connects to a non-wildcard endpoint, which the relay binds.
        replay(f"tcp://127.0.0.1:{sources}")
        assert relay.wait_value("kvbridge_batches_total", 7, timeout=TIMEOUT, direction="in")
        for service in services.values():
            eventually(
                lambda service=service: service.overlaps("relayed"),
                RIGHT,
                lambda service=service: service.log() + relay.log(),
            )
        log = relay.log()
    assert "error" not in log.lower(), log


def test_dynamo_logs_are_filtered() -> None:
    """``DYN_LOG=warn`` (conftest.py): no INFO line from Dynamo's Rust core in a service's log."""
    assert os.environ.get("DYN_LOG") == "warn"
    port = free_port_range(1)
    process = subprocess.Popen(
        [sys.executable, "-m", "dynamo.indexer", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + TIMEOUT
        while True:
            try:
                http(port, "GET", "/health")
                break
            except (OSError, urllib.error.URLError):
                assert time.monotonic() < deadline
                time.sleep(0.1)
    finally:
        process.terminate()
        out, _ = process.communicate(timeout=10)
    assert " INFO " not in re.sub(r"\x1b\[[0-9;]*m", "", out), out
