"""The ``kvbridge`` command: the bundled demo, endpoints, exit codes and one-line errors.

Every case of issue 12's list, with its exact message and exit code (0 ok, 1 invalid data, 2 bad
usage or missing file):

1. endpoints are checked (port range, scheme, duplicates, offsets);
2. binding or connecting is explicit when it must be (``bind:`` / ``connect:``), a bind that
   cannot work names the argument and the way out, and a silent source (or a replay nobody
   subscribed to) is reported on both sides;
3. ``validate`` fails on an empty capture;
4. ``watch`` prints separate columns and no lag for a replayed capture, and ``replay`` keeps each
   recorded stream on a socket of its own, so that ``record``, ``watch`` and ``relay`` see two
   workers with their ids and block size;
5. missing files exit 2 without ``[Errno 2]``, a closed stdout ends quietly, every flag does
   something or is refused.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
from pathlib import Path

import msgspec
import pytest
from support.ipv6 import DUAL_STACK, requires_ipv6
from support.raw_capture import HEADER, raw_capture
from support.relay_process import RelayProcess, fetch_metrics, start_kvbridge

from kvbridge.adapters.capture import CaptureReader, CaptureWriter
from kvbridge.adapters.pipeline import StreamPipeline
from kvbridge.adapters.ports import free_port_range
from kvbridge.schemas.tiers import Tier
from kvbridge.schemas.vllm import LAYOUTS, STORED_FIELDS
from kvbridge.testing.events import TS0, encoded, stored
from kvbridge.testing.vllm_hashes import block_hashes

SAMPLE = Path(__file__).resolve().parents[1] / "kvbridge" / "data" / "sample.kvcap"
TIMEOUT = 60.0
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def kvbridge(
    *args: str, timeout: float = TIMEOUT, stdout: int = subprocess.PIPE
) -> subprocess.CompletedProcess[str]:
    """``kvbridge ARGS``, its stderr captured, its stdout too unless ``stdout`` names a
    descriptor to write it to."""
    return subprocess.run(
        [sys.executable, "-m", "kvbridge.cli", *args],
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        check=False,
        timeout=timeout,
        env=ENV,
    )


def start(*args: str) -> subprocess.Popen[str]:
    return start_kvbridge(*args, env=ENV)


def finish(process: subprocess.Popen[str]) -> tuple[int, str, str]:
    try:
        out, err = process.communicate(timeout=TIMEOUT)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    return process.returncode, out, err


def two_workers(first: str, second: str) -> list[str]:
    """The options of two sources, ``first`` as worker 1 and ``second`` as worker 2."""
    return ["--source", first, "--worker-id", "1", "--source", second, "--worker-id", "2"]


def replay_sample_into(
    listener: subprocess.Popen[str], publish: str, *options: str
) -> tuple[subprocess.CompletedProcess[str], tuple[int, str, str]]:
    """``replay`` the bundled sample on ``publish`` at full speed (``options`` before ``--pace
    max``) to ``listener``, started before; then wait for the listener to end. The replay's
    result, and the listener's exit code, stdout and stderr."""
    try:
        replay = kvbridge("replay", str(SAMPLE), "--publish", publish, *options, "--pace", "max")
    finally:
        finished = finish(listener)
    return replay, finished


def record_the_replay(
    out: Path, first: str, second: str, *options: str, publish: str
) -> tuple[subprocess.CompletedProcess[str], int, str]:
    """``record`` (``options`` after its sources ``first`` and ``second``, workers 1 and 2) into
    ``out`` of up to 7 messages in 30 s, fed by :func:`replay_sample_into` on ``publish``. The
    replay's result, and the recorder's exit code and stderr."""
    record = start(
        "record", *two_workers(first, second), *options,
        "--out", str(out), "--count", "7", "--duration", "30",
    )  # fmt: skip
    replay, (code, _, err) = replay_sample_into(record, publish)
    return replay, code, err


def sample_residency() -> dict[int, tuple[int, int, int, int]]:
    """Distinct blocks resident per tier (device, host_pinned, disk, external) at the end of the
    bundled sample, for each worker, from the pipeline every command shares."""
    pipeline = StreamPipeline(4)
    for record in CaptureReader(SAMPLE):
        pipeline.feed_record(record)
    resident = {}
    for worker_id, worker in pipeline.workers.items():
        counts = [worker.normalizer.resident_blocks(0, tier) for tier in Tier]
        resident[worker_id] = (counts[0], counts[1], counts[2], counts[3])
    return resident


def test_sample_residency_reference() -> None:
    # Worker 1: support-bot's 2 GPU blocks + code-review's 3, and support-bot's 2 CPU blocks.
    assert sample_residency() == {1: (5, 2, 0, 0), 2: (3, 2, 0, 0)}


def test_demo_indexes_the_bundled_sample() -> None:
    result = kvbridge("demo")
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines()]
    assert rows[0] == ["sample.kvcap:", "7", "messages,", "0", "bad,", "block", "size", "4"]
    assert rows[1] == ["worker", "1:", "not", "forwarded:", "none"]
    assert rows[2] == ["worker", "2:", "not", "forwarded:", "none"]
    # Worker 1 offloaded blocks 3-4 of support-bot to CPU (placeholders) and evicted them from
    # the GPU; worker 2 hashes differently but its blocks land on the same canonical nodes.
    assert rows[5:] == [
        ["support-bot", "4", "1", "0", "2", "4", "4"],
        ["support-bot", "4", "2", "0", "2", "2", "2"],
        ["code-review", "3", "1", "0", "3", "3", "3"],
        ["translate", "2", "2", "0", "1", "2", "2"],
    ]


RELAY = ["relay", "--source", "tcp://*:5557", "--block-size", "16"]
"""A relay missing only its --publish."""


def bad_publish(endpoint: str, message: str) -> tuple[list[str], str]:
    """:data:`RELAY` with ``--publish endpoint``, and the one-line error that refuses it."""
    return [*RELAY, "--publish", endpoint], f"kvbridge relay: error: argument --publish: {message}"


def two_sources(publish: str, *more: str) -> list[str]:
    """A relay of the sources tcp://*:5557 and tcp://*:5558 publishing on ``publish``."""
    sources = ["--source", "tcp://*:5557", "--source", "tcp://*:5558"]
    return ["relay", *sources, "--publish", publish, *more, "--block-size", "16"]


def watch_with_replay(replay: str) -> list[str]:
    """A watch of the source tcp://*:5557 with ``--source-replay replay``."""
    return ["watch", "--source", "tcp://*:5557", "--source-replay", replay, "--block-size", "4"]


BAD_ARGUMENTS = [
    # argparse's own checks, one line each
    (
        ["demo", "--block-size", "0"],
        "kvbridge demo: error: argument --block-size: must be at least 1: '0'",
    ),
    (
        ["demo", "--block-size", "x"],
        "kvbridge demo: error: argument --block-size: not an integer: 'x'",
    ),
    (
        ["frobnicate"],
        "kvbridge: error: argument command: invalid choice: 'frobnicate' (choose from 'demo', 'relay', 'record', 'replay', 'watch', 'validate', 'schema')",
    ),
    (
        ["demo", "--log-format", "xml"],
        "kvbridge demo: error: argument --log-format: invalid choice: 'xml' (choose from 'console', 'json')",
    ),
    (
        [
            "relay",
            "--source",
            "tcp://*:1",
            "--source-replay",
            "tcp://*:2",
            "--source-replay",
            "tcp://*:3",
            "--publish",
            "tcp://127.0.0.1:4",
            "--block-size",
            "16",
        ],
        "kvbridge relay: error: give --source-replay once per --source, or not at all",
    ),
    (
        ["relay", "--source", "tcp://*:1", "--publish", "tcp://127.0.0.1:4"],
        "kvbridge relay: error: the following arguments are required: --block-size",
    ),
    (
        ["record", "--source", "tcp://*:1", "--worker-id", "-1", "--out", "x.kvcap"],
        "kvbridge record: error: argument --worker-id: must be at least 0: '-1'",
    ),
    (
        [*RELAY, "--publish", "tcp://127.0.0.1:4", "--metrics-port", "70000"],
        "kvbridge relay: error: argument --metrics-port: not a port number: '70000'",
    ),
    (
        ["replay", "x.kvcap", "--publish", "tcp://*:1", "--pace", "fast"],
        "kvbridge replay: error: argument --pace: invalid choice: 'fast' (choose from 'original', 'max')",
    ),
    (["validate"], "kvbridge validate: error: give at least one capture"),
    # 1. endpoints are checked: port range, scheme, host
    bad_publish(
        "tcp://127.0.0.1:99999", "port 99999 is out of range 1-65535 in 'tcp://127.0.0.1:99999'"
    ),
    (
        ["replay", str(SAMPLE), "--publish", "tcp://127.0.0.1:70000"],
        "kvbridge replay: error: argument --publish: port 70000 is out of range 1-65535 in 'tcp://127.0.0.1:70000'",
    ),
    bad_publish("tcp://127.0.0.1:0", "port 0 is out of range 1-65535 in 'tcp://127.0.0.1:0'"),
    bad_publish(
        "127.0.0.1:45002",
        "not an endpoint: '127.0.0.1:45002' (expected tcp://HOST:PORT, tcp://[IPv6]:PORT or ipc://PATH, optionally after bind: or connect:)",
    ),
    bad_publish("tcp://127.0.0.1", "no port in 'tcp://127.0.0.1' (expected tcp://HOST:PORT)"),
    bad_publish("tcp://127.0.0.1:x", "port 'x' is not a number in 'tcp://127.0.0.1:x'"),
    bad_publish("tcp://:6557", "no host in 'tcp://:6557' (use * for every interface)"),
    bad_publish(
        "tcp://300.1.1.1:6557",
        "'300.1.1.1' is not an IPv4 address or a host name in 'tcp://300.1.1.1:6557'",
    ),
    bad_publish(
        "tcp://::1:6557",
        "'::1' in 'tcp://::1:6557' is not a host: an IPv6 address goes in brackets, tcp://[ADDRESS]:PORT",
    ),
    bad_publish("tcp://[::g]:6557", "'[::g]' is not an IPv6 address in 'tcp://[::g]:6557'"),
    bad_publish(
        "tcp://[1.2.3.4]:6557", "'[1.2.3.4]' is not an IPv6 address in 'tcp://[1.2.3.4]:6557'"
    ),
    bad_publish(
        "udp://127.0.0.1:6557",
        "unsupported transport 'udp' in 'udp://127.0.0.1:6557' (tcp, ipc or inproc)",
    ),
    bad_publish("ipc://", "no path in 'ipc://' (expected ipc://PATH)"),
    bad_publish(
        "ipc:///" + "x" * 120,
        f"ipc path longer than 107 bytes in 'ipc:///{'x' * 120}': use a shorter path",
    ),
    bad_publish(
        "inproc://relay",
        "inproc:// reaches only sockets of the same process: use tcp:// or ipc:// ('inproc://relay')",
    ),
    # 1. ... no duplicates, counting the ports the relay and replay offset per stream
    (
        [
            "relay",
            "--source",
            "tcp://*:5557",
            "--source",
            "tcp://*:5557",
            "--publish",
            "tcp://127.0.0.1:6557",
            "--block-size",
            "16",
        ],
        "kvbridge relay: error: argument --source: tcp://127.0.0.1:5557 is given twice",
    ),
    bad_publish(
        "tcp://127.0.0.1:5557",
        "tcp://127.0.0.1:5557 is the same socket as --source tcp://127.0.0.1:5557",
    ),
    (
        [
            "relay",
            "--source",
            "tcp://[::]:5557",
            "--publish",
            "tcp://[0::1]:5557",
            "--block-size",
            "16",
        ],
        "kvbridge relay: error: argument --publish: tcp://[0::1]:5557 is the same socket as --source tcp://[::1]:5557",
    ),
    (
        [
            "relay",
            "--source",
            "tcp://[::1]:5557",
            "--publish",
            "tcp://[::]:5557",
            "--block-size",
            "16",
        ],
        "kvbridge relay: error: argument --publish: tcp://[::]:5557 is the same socket as --source tcp://[::1]:5557",
    ),
    (
        two_sources("tcp://127.0.0.1:6557", "--publish-replay", "tcp://127.0.0.1:6558"),
        "kvbridge relay: error: argument --publish-replay: tcp://127.0.0.1:6558 is the same socket as --publish tcp://127.0.0.1:6558 (its port + 1, for the 2nd --source)",
    ),
    (
        two_sources("tcp://127.0.0.1:65535"),
        "kvbridge relay: error: argument --publish: port 65535 + 1 is past 65535 in 'tcp://127.0.0.1:65535' (the 2nd --source goes on its port + 1)",
    ),
    (
        two_sources("ipc:///tmp/kvbridge-out"),
        "kvbridge relay: error: argument --publish: 'ipc:///tmp/kvbridge-out' cannot be offset for several streams: use tcp://HOST:PORT (the 2nd --source goes on its port + 1)",
    ),
    (
        [*RELAY, "--publish", "tcp://*:6557", "--metrics-port", "6557"],
        "kvbridge relay: error: argument --metrics-port: tcp://127.0.0.1:6557 is the same socket as --publish tcp://*:6557",
    ),
    (
        [*RELAY, "--publish", "tcp://*:6557", "--metrics-port", "6557", "--metrics-host", "::"],
        "kvbridge relay: error: argument --metrics-port: tcp://[::]:6557 is the same socket as --publish tcp://*:6557",
    ),
    (
        [*RELAY, "--publish", "tcp://*:6557", "--metrics-host", "300.1.1.1"],
        "kvbridge relay: error: argument --metrics-host: not an IPv4 or IPv6 address, a host name or *: '300.1.1.1'",
    ),
    (
        [*RELAY, "--publish", "tcp://*:6557", "--metrics-host", "0.0.0.0"],
        "kvbridge relay: error: argument --metrics-host: serves nothing without --metrics-port",
    ),
    (
        [
            "record",
            "--source",
            "tcp://127.0.0.1:5557",
            "--source",
            "tcp://localhost:5557",
            "--out",
            "x.kvcap",
        ],
        "kvbridge record: error: argument --source: tcp://localhost:5557 is given twice",
    ),
    (
        watch_with_replay("tcp://*:5557"),
        "kvbridge watch: error: argument --source-replay: tcp://127.0.0.1:5557 is the same socket as --source tcp://127.0.0.1:5557",
    ),
    # 2. bind: and connect: where they cannot apply
    (
        watch_with_replay("bind:tcp://*:5558"),
        "kvbridge watch: error: argument --source-replay: kvbridge always connects to a replay endpoint (the engine binds it): drop bind: ('bind:tcp://*:5558')",
    ),
    bad_publish(
        "connect:tcp://127.0.0.1:6557",
        "the relay always binds its outputs (Dynamo connects to them): drop connect: ('connect:tcp://127.0.0.1:6557')",
    ),
    # 2. vLLM's rule binds a non-wildcard source: a remote address cannot be bound
    (
        [*RELAY[:2], "tcp://192.0.2.1:5557", *RELAY[3:], "--publish", "tcp://127.0.0.1:6557"],
        "kvbridge relay: error: argument --source: cannot bind tcp://192.0.2.1:5557: Cannot assign requested address; tcp://192.0.2.1:5557 is not an address of this host (to connect to an engine that binds it: connect:tcp://192.0.2.1:5557)",
    ),
    # 3. validate asked for nothing it can check
    (
        ["validate", "--json-schema", str(SAMPLE)],
        "kvbridge validate: error: --json-schema prints the report's schema: give no capture",
    ),
    (
        ["validate", "--min-frames", "0", str(SAMPLE)],
        "kvbridge validate: error: argument --min-frames: must be at least 1: '0'",
    ),
    (
        ["validate", "--require-medium", "C P U", str(SAMPLE)],
        "kvbridge validate: error: argument --require-medium: not a medium: 'C P U' (e.g. GPU, CPU, DISK)",
    ),
    # 5. every flag does something or is refused
    (
        ["demo", "--metrics-port", "9100"],
        "kvbridge demo: error: argument --metrics-port: kvbridge demo serves no metrics (relay, record and watch do)",
    ),
    (
        ["demo", "--metrics-host", "0.0.0.0"],
        "kvbridge demo: error: argument --metrics-host: kvbridge demo serves no metrics (relay, record and watch do)",
    ),
    (
        ["validate", str(SAMPLE), "--metrics-port", "9100"],
        "kvbridge validate: error: argument --metrics-port: kvbridge validate serves no metrics (relay, record and watch do)",
    ),
    (
        ["replay", str(SAMPLE), "--publish", "tcp://*:5557", "--metrics-port", "9100"],
        "kvbridge replay: error: argument --metrics-port: kvbridge replay serves no metrics (relay, record and watch do)",
    ),
    (
        ["schema", "--log-format", "json"],
        "kvbridge schema: error: argument --log-format: kvbridge schema writes no log",
    ),
    (
        [*RELAY, "--publish", "tcp://127.0.0.1:6557", "--publish", "tcp://127.0.0.1:6558"],
        "kvbridge relay: error: argument --publish: given more than once (it takes one value)",
    ),
    (
        ["replay", str(SAMPLE), "--publish", "tcp://*:5557", "--publish", "tcp://*:5558"],
        "kvbridge replay: error: argument --publish: given more than once (it takes one value)",
    ),
    (
        [*RELAY, "--publish", "tcp://127.0.0.1:6557", "--block-size", "32"],
        "kvbridge relay: error: argument --block-size: given more than once (it takes one value)",
    ),
    (
        ["watch", "--source", "tcp://*:5557", "--block-size", "4", "--interval", "0"],
        "kvbridge watch: error: argument --interval: must be positive: '0'",
    ),
    (
        ["watch", "--source", "tcp://*:5557", "--block-size", "4", "--interval", "-1"],
        "kvbridge watch: error: argument --interval: must be positive: '-1'",
    ),
    (
        ["record", "--source", "tcp://*:5557", "--out", "x.kvcap", "--duration", "0"],
        "kvbridge record: error: argument --duration: must be positive: '0'",
    ),
    (
        ["replay", str(SAMPLE), "--publish", "tcp://*:5557", "--wait-subscribers", "-1"],
        "kvbridge replay: error: argument --wait-subscribers: must be at least 0: '-1'",
    ),
    # upper bounds: past them a socket option or the core would overflow
    (
        ["demo", "--block-size", str(2**32)],
        "kvbridge demo: error: argument --block-size: must be at most 4294967295: '4294967296'",
    ),
    (
        [
            *RELAY[:3],
            "--publish",
            "tcp://127.0.0.1:4",
            "--block-size",
            "4",
            "--output-hwm",
            str(2**31),
        ],
        "kvbridge relay: error: argument --output-hwm: must be at most 2147483647: '2147483648'",
    ),
    (
        [*RELAY, "--publish", "tcp://127.0.0.1:4", "--buffer-steps", "1073741822"],
        "kvbridge relay: error: argument --buffer-steps: must be at most 1073741821: '1073741822'",
    ),
    (
        ["watch", "--source", "tcp://*:5557", "--block-size", "4", "--max-frame-bytes", str(2**63)],
        "kvbridge watch: error: argument --max-frame-bytes: must be at most 9223372036854710271: "
        "'9223372036854775808'",
    ),
    (
        ["record", "--source", "tcp://*:5557", "--out", "x.kvcap", "--duration", "1e10"],
        f"kvbridge record: error: argument --duration: must be at most {threading.TIMEOUT_MAX}: "
        "'1e10'",
    ),
    (
        ["watch", "--source", "tcp://*:5557", "--block-size", "4", "--replay-timeout", "0"],
        "kvbridge watch: error: argument --replay-timeout: must be at least 0.001: '0'",
    ),
    (
        ["record", "--source", "tcp://*:5557", "--out", "x.kvcap", "--replay-timeout", "inf"],
        f"kvbridge record: error: argument --replay-timeout: must be at most "
        f"{threading.TIMEOUT_MAX}: 'inf'",
    ),
    (
        [*RELAY, "--publish", "tcp://127.0.0.1:4", "--clear-burst", "0"],
        "kvbridge relay: error: argument --clear-burst: must be at least 1: '0'",
    ),
    (
        [*RELAY, "--publish", "tcp://127.0.0.1:4", "--clear-interval", "-0.5"],
        "kvbridge relay: error: argument --clear-interval: must be at least 0: '-0.5'",
    ),
    (
        [*RELAY, "--publish", "tcp://127.0.0.1:4", "--clear-interval", "nan"],
        "kvbridge relay: error: argument --clear-interval: not a number: 'nan'",
    ),
    (
        ["replay", str(SAMPLE), "--publish", "tcp://*:5557", "--wait-subscribers", "nan"],
        "kvbridge replay: error: argument --wait-subscribers: not a number: 'nan'",
    ),
    # text that is not what it must be
    (
        ["watch", "--source", "tcp://*:5557", "--block-size", "4", "--source-topic", "\udcff"],
        "kvbridge watch: error: argument --source-topic: not valid UTF-8: '\\udcff'",
    ),
    (
        ["watch", "--source", "tcp://127.0.0.1:\u00b2", "--block-size", "4"],
        "kvbridge watch: error: argument --source: port '\u00b2' is not a number in "
        "'tcp://127.0.0.1:\u00b2'",
    ),
    (
        ["watch", "--source", "tcp://127.0.0.1:\u0665\u0665\u0665\u0667", "--block-size", "4"],
        "kvbridge watch: error: argument --source: port '\u0665\u0665\u0665\u0667' is not a "
        "number in 'tcp://127.0.0.1:\u0665\u0665\u0665\u0667'",
    ),
    (
        ["demo", ""],
        "kvbridge demo: error: argument capture: empty path",
    ),
    (
        ["validate", ""],
        "kvbridge validate: error: argument CAPTURE: empty path",
    ),
    (
        ["record", "--source", "tcp://*:5557", "--out", ""],
        "kvbridge record: error: argument --out: empty path",
    ),
    (
        ["demo", "--bogus"],
        "kvbridge demo: error: unrecognized arguments: --bogus",
    ),
    (
        ["validate", "--compare-dynamo", "--block-size", "65537", str(SAMPLE)],
        "kvbridge validate: error: --compare-dynamo takes a block size of at most 65536, got "
        "--block-size 65537",
    ),
]


@pytest.mark.parametrize(("args", "message"), BAD_ARGUMENTS)
def test_bad_usage_is_one_line_and_exit_2(args: list[str], message: str) -> None:
    result = kvbridge(*args)
    assert result.stderr.splitlines() == [message]
    assert result.returncode == 2
    assert result.stdout == ""


def test_schema_exports_every_layout_and_dynamo() -> None:
    import json

    result = kvbridge("schema")
    assert result.returncode == 0
    schema = json.loads(result.stdout)
    assert list(schema["vllm"]) == [layout.releases for layout in LAYOUTS]
    array = schema["vllm"]["0.22.0-0.23.x"]["$defs"]["BlockStored"]
    assert array["type"] == "array"
    assert len(array["prefixItems"]) == 12
    tagged = schema["vllm"]["0.33.0"]["$defs"]["BlockStored"]
    assert tagged["type"] == "object"
    assert "lookahead_token_ids" in tagged["properties"]
    # vLLM 0.33 declares every field up to lora_name without a default.
    required = STORED_FIELDS[: STORED_FIELDS.index("lora_name") + 1]
    assert tagged["required"] == ["type", *required]
    assert schema["dynamo"]["KvCacheEvent"]["$defs"]["KvCacheEvent"]["required"] == [
        "event_id",
        "data",
    ]


# --------------------------------------------------------------------------- 5. exit codes


@pytest.mark.parametrize(
    "args",
    [
        ["demo", "/nonexistent.kvcap"],
        ["validate", "/nonexistent.kvcap"],
        ["replay", "/nonexistent.kvcap", "--publish", "tcp://*:5557"],
    ],
)
def test_missing_file_is_one_line_and_exit_2(args: list[str]) -> None:
    result = kvbridge(*args)
    assert result.stderr.splitlines() == [
        f"kvbridge {args[0]}: error: /nonexistent.kvcap: No such file or directory"
    ]
    assert result.returncode == 2


def test_demo_of_a_capture_without_block_size_is_exit_2(tmp_path: Path) -> None:
    path = tmp_path / "nameless.kvcap"
    CaptureWriter(path).close()
    result = kvbridge("demo", str(path))
    assert result.stderr.splitlines() == [
        "kvbridge demo: error: the capture names no block size; pass --block-size"
    ]
    assert result.returncode == 2


def test_directory_for_a_file_is_exit_2(tmp_path: Path) -> None:
    result = kvbridge("record", "--source", "tcp://*:5557", "--out", str(tmp_path))
    assert result.stderr.splitlines() == [f"kvbridge record: error: {tmp_path}: Is a directory"]
    assert result.returncode == 2


@pytest.mark.parametrize("command", ["demo", "validate"])
def test_not_a_capture_is_invalid_data_exit_1(tmp_path: Path, command: str) -> None:
    path = tmp_path / "bad.kvcap"
    path.write_bytes(b"garbage")
    result = kvbridge(command, str(path))
    assert result.stderr.splitlines() == [
        f"kvbridge {command}: error: {path}: not a kvcap file (bad magic)"
    ]
    assert result.returncode == 1


def header_capture(path: Path, meta: dict[str, object], records: list[object]) -> Path:
    """A capture whose header meta and records are written as given, unchecked."""
    return raw_capture(path, {**HEADER, "meta": meta}, records)


RECORD = [1_700_000_000_000_000_000, "tcp://127.0.0.1:5557", 1, [b"", bytes(8), b"\x93"]]


@pytest.mark.parametrize(
    ("command", "meta", "records", "error"),
    [
        (
            "demo",
            {"block_size": "4"},
            [],
            "header block_size must be an integer in [1, 4294967295], got '4'",
        ),
        (
            "validate",
            {"block_size": -4},
            [],
            "header block_size must be an integer in [1, 4294967295], got -4",
        ),
        (
            "demo",
            {"block_size": 4, "prompts": [{"token_ids": "12"}]},
            [],
            "header prompts: prompt 0: Expected `array`, got `str` - at `$.token_ids`",
        ),
        (
            "demo",
            {"block_size": 4},
            [[*RECORD[:2], -5, RECORD[3]]],
            "record 0: Expected `int` >= 0 - at `$[2]`",
        ),
        (
            "validate",
            {},
            [[*RECORD[:3], []]],
            "record 0: a message has at least one frame",
        ),
        (
            "validate",
            {"prompts": [[2**32]]},
            [],
            "header prompts: prompt 0: Expected `int` <= 4294967295 - at `$.token_ids[0]`",
        ),
    ],
    ids=["demo block size", "validate block size", "prompts", "worker id", "no frames", "token id"],
)
def test_a_damaged_capture_is_invalid_data_exit_1(
    tmp_path: Path, command: str, meta: dict[str, object], records: list[object], error: str
) -> None:
    path = header_capture(tmp_path / "damaged.kvcap", meta, records)
    result = kvbridge(command, str(path))
    assert result.stderr.splitlines() == [f"kvbridge {command}: error: {path}: {error}"]
    assert result.returncode == 1


def test_replay_of_a_record_without_frames_is_exit_1(tmp_path: Path) -> None:
    path = header_capture(tmp_path / "empty.kvcap", {}, [[*RECORD[:3], []]])
    result = kvbridge("replay", str(path), "--publish", "tcp://*:5557", "--wait-subscribers", "0")
    assert result.stderr.splitlines()[-1] == (
        f"kvbridge replay: error: {path}: record 0: a message has at least one frame"
    )
    assert result.returncode == 1


def test_validate_flags_the_end_marker_as_a_seq(tmp_path: Path) -> None:
    end = [*RECORD[:3], [b"", b"\xff" * 8, msgspec.msgpack.encode([0.0, []])]]
    path = header_capture(tmp_path / "end.kvcap", {"block_size": 4}, [end])
    result = kvbridge("validate", "--format", "json", str(path))
    report = msgspec.json.decode(result.stdout)
    assert [(p["reason"], p["message"], p.get("seq")) for p in report["problems"]] == [
        ("bad_seq", "sequence frame is 2**64 - 1, the replay protocol's end marker", None)
    ]
    assert result.returncode == 1


def test_demo_skips_each_badly_framed_record_for_the_reason_validate_gives(
    tmp_path: Path,
) -> None:
    """A record without vLLM's framing is counted by ``demo`` under the reason ``validate``
    gives it, not decoded from whatever frame it ends with: the prompt whose blocks only such
    records store stays unindexed, while the well-framed record's prompt is found."""
    prompts = {"kept": list(range(8)), "skipped": list(range(100, 108))}
    kept, skipped = (
        encoded([stored(block_hashes(tokens, 4), tokens, block_size=4)], ts=TS0)
        for tokens in prompts.values()
    )
    seq = (3).to_bytes(8, "big")
    frames = [
        [b"", seq, b"\xc1"],  # not msgpack
        [b"", skipped],  # two frames, the last a good batch
        [b"", seq, skipped, b""],  # four frames
        [b"", b"\xff" * 8, skipped],  # the replay protocol's end marker
        [b"", seq[1:], skipped],  # a 7-byte sequence frame
        [b"", seq, kept],
    ]
    meta = {"block_size": 4, "prompts": [{"name": k, "token_ids": v} for k, v in prompts.items()]}
    path = header_capture(tmp_path / "framing.kvcap", meta, [[*RECORD[:3], f] for f in frames])

    demo = kvbridge("demo", str(path))
    validate = kvbridge("validate", "--format", "json", str(path))

    assert demo.returncode == 0, demo.stderr
    lines = demo.stdout.splitlines()
    assert lines[0] == (
        "framing.kvcap: 6 messages, 5 bad (bad_seq 2, frame_count 2, schema 1), block size 4"
    )
    assert [line.split() for line in lines[1:]] == [
        ["worker", "1:", "not", "forwarded:", "none"],
        [],
        ["prompt", "blocks", "worker", "dp", "device", "host", "disk"],
        ["kept", "2", "1", "0", "2", "2", "2"],
        ["skipped", "2", "-"],
    ]
    assert validate.returncode == 1
    report = msgspec.json.decode(validate.stdout)
    assert report["summary"] == {"bad_seq": 2, "frame_count": 2, "schema": 1}
    assert [p["record"] for p in report["problems"]] == [0, 1, 2, 3, 4]


def test_validate_names_a_file_whose_name_is_not_utf8_in_json(tmp_path: Path) -> None:
    path = tmp_path / os.fsdecode(b"bad\xffname.kvcap")
    path.write_bytes(SAMPLE.read_bytes())
    result = kvbridge("validate", "--format", "json", str(path))
    assert result.returncode == 0, result.stderr
    [name] = msgspec.json.decode(result.stdout)["captures"]
    assert name == f"{tmp_path}/bad\\xffname.kvcap"


def test_a_write_that_fails_names_the_file() -> None:
    result = kvbridge(
        "record",
        "--source",
        f"tcp://*:{free_port_range(1)}",
        "--out",
        "/dev/full",
        "--duration",
        "5",
    )
    assert result.stderr.splitlines()[-1] == (
        "kvbridge record: error: /dev/full: No space left on device"
    )
    assert result.returncode == 1


@pytest.mark.parametrize(
    "args",
    [
        ["schema"],
        ["demo"],
        ["validate", str(SAMPLE)],
        ["watch", "--source", "tcp://127.0.0.1:1", "--block-size", "4", "--duration", "5"],
    ],
)
def test_a_full_stdout_exits_1_naming_it(args: list[str]) -> None:
    """A report that cannot be written is a failed run, not a misused command."""
    with open("/dev/full", "w") as full:
        result = kvbridge(*args, stdout=full.fileno())
    assert result.stderr.splitlines()[-1] == (
        f"kvbridge {args[0]}: error: stdout: No space left on device"
    )
    assert result.returncode == 1


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (["schema"], 0),
        (["demo"], 0),
        (["validate", str(SAMPLE)], 0),
        (["validate", "--json-schema"], 0),
    ],
)
def test_a_closed_stdout_ends_quietly(args: list[str], code: int) -> None:
    """``kvbridge schema | head``: the reader has gone before the command writes."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = kvbridge(*args, stdout=write_end)
    finally:
        os.close(write_end)
    assert result.stderr == ""
    assert result.returncode == code


def test_schema_into_head_in_a_shell() -> None:
    result = subprocess.run(
        f"{sys.executable} -m kvbridge.cli schema | head -n 1; exit ${{PIPESTATUS[0]}}",
        shell=True,
        executable="/bin/bash",
        capture_output=True,
        text=True,
        check=False,
        timeout=TIMEOUT,
    )
    assert (result.returncode, result.stdout, result.stderr) == (0, "{\n", "")


def test_a_port_in_use_names_the_argument() -> None:
    port = free_port_range(1)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        result = kvbridge(
            "record", "--source", f"tcp://127.0.0.1:{port}", "--out", "/dev/null", "--count", "1"
        )
    assert result.stderr.splitlines() == [
        f"kvbridge record: error: argument --source: cannot bind tcp://127.0.0.1:{port}: "
        "Address already in use"
    ]
    assert result.returncode == 2


@pytest.mark.parametrize(
    ("host", "taken", "line"),
    [
        (None, True, "argument --metrics-port: cannot bind 127.0.0.1:{port}: Address already in use"),
        ("127.0.0.1", True, "argument --metrics-port: cannot bind 127.0.0.1:{port}: Address already in use"),
        ("192.0.2.1", False, "argument --metrics-host: cannot bind 192.0.2.1:{port}: Cannot assign requested address"),
    ],
)  # fmt: skip
def test_metrics_that_cannot_be_served_name_the_argument_at_fault(
    host: str | None, taken: bool, line: str
) -> None:
    """A port in use is --metrics-port's fault; an address not of this host, --metrics-host's."""
    port = free_port_range(2)
    given = [] if host is None else ["--metrics-host", host]
    with socket.socket() as holder:
        if taken:
            holder.bind(("127.0.0.1", port + 1))
            holder.listen()
        result = kvbridge(
            "record", "--source", f"tcp://127.0.0.1:{port}", "--out", "/dev/null", "--count", "1",
            "--metrics-port", str(port + 1), *given,
        )  # fmt: skip
    assert result.stderr.splitlines() == [f"kvbridge record: error: {line.format(port=port + 1)}"]
    assert result.returncode == 2


# --------------------------------------------------------------------------- 3. validate


def test_validate_fails_on_an_empty_capture(tmp_path: Path) -> None:
    empty = tmp_path / "empty.kvcap"
    CaptureWriter(empty).close()
    result = kvbridge("validate", str(empty))
    assert result.stdout.splitlines() == [
        "INVALID: 0 frames, 0 events, 0 invalid frames in 1 capture(s)",
        f"  {empty}: no frames (--allow-empty accepts an empty capture)",
    ]
    assert result.returncode == 1
    allowed = kvbridge("validate", "--allow-empty", str(empty))
    assert allowed.stdout.splitlines() == [
        "valid: 0 frames, 0 events, 0 invalid frames in 1 capture(s)"
    ]
    assert allowed.returncode == 0


# --------------------------------------------------------------------------- 2. bind or connect


def test_connect_prefix_subscribes_to_a_remote_engine_and_reports_its_silence() -> None:
    """``--source tcp://192.0.2.1:P`` cannot be bound here (see BAD_ARGUMENTS); with
    ``connect:`` the relay connects, and says after 5 s that nothing came."""
    port = free_port_range(2)
    result = kvbridge(
        "relay",
        "--source", f"connect:tcp://192.0.2.1:{port}",
        "--publish", f"tcp://127.0.0.1:{port + 1}",
        "--block-size", "4",
        "--duration", "6",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "[warning" in line]
    assert len(warnings) == 1, result.stderr
    assert warnings[0].split("] ", 1)[1].rstrip() == (
        f"no batch from tcp://192.0.2.1:{port} after 5 s: is the engine publishing there? "
        f"kvbridge connects to tcp://192.0.2.1:{port}, so the engine must bind it (both sides "
        f"binding or both connecting deliver nothing; bind:tcp://192.0.2.1:{port} says the "
        "opposite)"
    )


def test_both_sides_connecting_is_reported_by_both() -> None:
    """``watch --source tcp://*:P`` connects (vLLM binds a wildcard), and so does ``replay
    --publish tcp://127.0.0.1:P`` (vLLM connects to an address): nothing can flow."""
    port = free_port_range(2)
    watch = start(
        "watch", "--source", f"tcp://*:{port}", "--block-size", "4", "--duration", "6.5",
        "--interval", "3",
    )  # fmt: skip
    replay, (code, out, err) = replay_sample_into(
        watch, f"tcp://127.0.0.1:{port}", "--wait-subscribers", "1"
    )
    assert replay.returncode == 0, replay.stderr
    replay_warnings = [
        line.split("] ", 1)[1].rstrip() for line in replay.stderr.splitlines() if "[warning" in line
    ]
    assert replay_warnings == [
        f"no subscriber on tcp://127.0.0.1:{p} after 1 s: is anyone subscribed there? "
        f"replay connects to tcp://127.0.0.1:{p}, so the subscriber must bind it (both "
        "sides binding or both connecting deliver nothing)"
        for p in (port, port + 1)  # the sample's second stream goes on the next port
    ]
    assert code == 0, err
    watch_warnings = [
        line.split("] ", 1)[1].rstrip() for line in err.splitlines() if "[warning" in line
    ]
    assert watch_warnings == [
        f"no batch from tcp://*:{port} after 5 s: is the engine publishing there? kvbridge "
        f"connects to tcp://127.0.0.1:{port}, so the engine must bind it (both sides binding or "
        f"both connecting deliver nothing; bind:tcp://*:{port} says the opposite)"
    ]
    assert (
        out.rstrip("\n").splitlines()[-3]
        == "batches 0 | gaps 0 | replays 0 (recovered 0) | lost 0 | restarts 0"
    )


def test_replay_binds_when_told_and_a_connecting_source_meets_it(tmp_path: Path) -> None:
    """``replay --publish bind:tcp://127.0.0.1:P`` binds (vLLM's rule would connect), and
    ``record --source connect:tcp://127.0.0.1:P`` connects to it."""
    port = free_port_range(2)
    out = tmp_path / "again.kvcap"
    replay, code, err = record_the_replay(
        out, f"connect:tcp://127.0.0.1:{port}", f"connect:tcp://127.0.0.1:{port + 1}",
        publish=f"bind:tcp://127.0.0.1:{port}",
    )  # fmt: skip
    assert replay.returncode == 0, replay.stderr
    assert f"subscribe with: --source connect:tcp://127.0.0.1:{port} --worker-id 1" in replay.stderr
    assert code == 0, err
    assert len(list(CaptureReader(out))) == 7


@pytest.mark.parametrize("publish", ["tcp://127.0.0.1:{port}", "connect:tcp://*:{port}"])
def test_bind_prefix_meets_a_replay_that_connects(tmp_path: Path, publish: str) -> None:
    """``bind:tcp://*:P`` binds where vLLM's rule would connect; the replay connects to it, at
    127.0.0.1, or at a wildcard, which it connects to on 127.0.0.1 as the clash check takes it."""
    port = free_port_range(2)
    out = tmp_path / "again.kvcap"
    replay, code, err = record_the_replay(
        out, f"bind:tcp://*:{port}", f"bind:tcp://*:{port + 1}", "--block-size", "4",
        publish=publish.format(port=port),
    )  # fmt: skip
    assert replay.returncode == 0, replay.stderr
    assert code == 0, err
    assert len(list(CaptureReader(out))) == 7


# --------------------------------------------------------------------------- 4. replay and watch


def test_replay_keeps_each_stream_apart_and_says_how_to_subscribe(tmp_path: Path) -> None:
    """Replayed into ``record``: two workers, each with its own sequence, and the block size
    kept, so that ``demo`` of the new capture finds the sample's two workers and block size
    (the prompts it prints overlaps for are the sample's own metadata, not recorded)."""
    port = free_port_range(2)
    out = tmp_path / "again.kvcap"
    replay, code, err = record_the_replay(
        out, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}", "--block-size", "4",
        publish=f"tcp://127.0.0.1:{port}",
    )  # fmt: skip
    assert replay.returncode == 0, replay.stderr
    assert code == 0, err
    assert "stream reset" not in err and "restarted" not in err, err
    events = [line.split("] ", 1)[1] for line in replay.stderr.splitlines()]
    assert [" ".join(line.split()) for line in events] == [
        f"replaying block_size=4 messages=4 mode=connect publish=tcp://127.0.0.1:{port} stream=tcp://127.0.0.1:5557 worker_id=1",
        f"replaying block_size=4 messages=3 mode=connect publish=tcp://127.0.0.1:{port + 1} stream=tcp://127.0.0.1:5558 worker_id=2",
        f"subscribe with: --source tcp://127.0.0.1:{port} --worker-id 1 --source tcp://127.0.0.1:{port + 1} --worker-id 2 --block-size 4",
        f"replayed capture={SAMPLE} messages=7 publish=tcp://127.0.0.1:{port} resets=0",
    ]
    records = list(CaptureReader(out))
    by_worker = {w: [r.seq for r in records if r.worker_id == w] for w in (1, 2)}
    assert by_worker == {1: [0, 1, 2, 3], 2: [0, 1, 2]}
    assert CaptureReader(out).meta["block_size"] == 4
    again, sample = kvbridge("demo", str(out)), kvbridge("demo")
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines()[:3] == [
        "again.kvcap: 7 messages, 0 bad, block size 4",
        *sample.stdout.splitlines()[1:3],  # worker 1: ..., worker 2: ...
    ]


def test_replay_warns_of_a_socket_without_subscriber_before_it_publishes(tmp_path: Path) -> None:
    """The warning comes when ``--wait-subscribers`` ends, not when the replay does: this one
    would take two minutes at the recorded pace, and is stopped once the warnings are out."""
    port = free_port_range(1)
    records = [
        [RECORD[0] + step * 120 * 10**9, *RECORD[1:3], [b"", step.to_bytes(8, "big"), b"\x90"]]
        for step in (0, 1)
    ]
    path = header_capture(tmp_path / "slow.kvcap", {"block_size": 4}, records)
    endpoint = f"tcp://127.0.0.1:{port}"
    replay = start("replay", str(path), "--publish", endpoint, "--wait-subscribers", "0.5")
    assert replay.stderr is not None
    warnings = []
    try:
        for line in replay.stderr:  # ends with the process, if it never warns
            if "[warning" in line:
                warnings.append(line.split("] ", 1)[1].rstrip())
            if len(warnings) == 2:
                break
    finally:
        replay.send_signal(signal.SIGINT)
    code, _, err = finish(replay)
    assert warnings[0] == (
        f"no subscriber on {endpoint} after 0.5 s: is anyone subscribed there? replay connects "
        f"to {endpoint}, so the subscriber must bind it (both sides binding or both connecting "
        "deliver nothing)"
    )
    assert warnings[1].split() == [
        "long", "wait:", "the", "capture's", "receive", "times", "are", "this", "far", "apart",
        "seconds=120.0", "sent=1", f"stream={endpoint}",
    ]  # fmt: skip
    assert code == 0, err
    assert err.splitlines()[-1].split("] ", 1)[1].split() == [
        "replayed", f"capture={path}", "messages=1", f"publish={endpoint}", "resets=0",
    ]  # fmt: skip


def test_replay_into_the_relay_shows_two_workers(tmp_path: Path) -> None:
    port = free_port_range(5)
    with RelayProcess(
        [
            *two_workers(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}"),
            "--publish", f"tcp://127.0.0.1:{port + 2}", "--block-size", "4",
        ],
        metrics_port=port + 4,
        log_path=tmp_path / "relay.log",
    ) as relay:  # fmt: skip
        replay = kvbridge(
            "replay", str(SAMPLE), "--publish", f"tcp://127.0.0.1:{port}", "--pace", "max"
        )
        assert replay.returncode == 0, replay.stderr
        assert relay.wait_value("kvbridge_batches_total", 7, direction="in"), relay.log()
        samples = relay.metrics()
    resident = {
        (labels["worker"], labels["tier"]): value
        for (name, items), value in samples.items()
        if name == "kvbridge_resident_blocks"
        for labels in [dict(items)]
    }
    expected = {
        (str(worker), tier.value): count
        for worker, counts in sample_residency().items()
        for tier, count in zip(Tier, counts, strict=True)
    }
    assert resident == expected
    assert samples["kvbridge_restarts_total", frozenset()] == 0


@requires_ipv6
@pytest.mark.parametrize(
    ("metrics_host", "logged", "answering", "refusing"),
    [
        (None, "127.0.0.1", ["127.0.0.1"], ["[::1]"]),
        ("::1", "[::1]", ["[::1]"], ["127.0.0.1"]),
        ("::", "[::]", ["[::1]", "127.0.0.1"] if DUAL_STACK else ["[::1]"], []),
    ],
)
def test_metrics_are_served_where_metrics_host_says(
    tmp_path: Path,
    metrics_host: str | None,
    logged: str,
    answering: list[str],
    refusing: list[str],
) -> None:
    """By default on 127.0.0.1 alone; ``--metrics-host`` moves them, ``::`` to every interface
    of both families (what a Prometheus outside the relay's host needs)."""
    port = free_port_range(3)
    given = [] if metrics_host is None else ["--metrics-host", metrics_host]
    with RelayProcess(
        [
            "--source", f"tcp://*:{port}", "--publish", f"tcp://127.0.0.1:{port + 1}",
            "--block-size", "4", *given,
        ],
        metrics_port=port + 2,
        log_path=tmp_path / "relay.log",
        metrics_host=answering[0],
    ) as relay:  # fmt: skip
        for host in answering:
            assert "kvbridge_batches_total" in fetch_metrics(port + 2, host=host)
        for host in refusing:
            with pytest.raises(urllib.error.URLError, match="Connection refused"):
                fetch_metrics(port + 2, host=host)
        assert f"url=http://{logged}:{port + 2}/metrics" in relay.log()


def test_watch_prints_columns_and_no_lag_for_a_replay() -> None:
    """Piped, ``watch`` prints the same table as on a terminal, without colours: separate
    columns, and an empty lag cell for batches recorded long ago."""
    port = free_port_range(2)
    watch = start(
        "watch",
        *two_workers(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}"),
        "--block-size", "4", "--duration", "5", "--interval", "4.5",
    )  # fmt: skip
    time.sleep(1.0)
    replay, (code, out, err) = replay_sample_into(watch, f"tcp://127.0.0.1:{port}")
    assert replay.returncode == 0, replay.stderr
    assert code == 0, err
    lines = out.rstrip("\n").splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["worker", "dp"])
    assert lines[header].split() == [
        "worker", "dp", "device", "host", "disk", "external", "blocks/s", "lag", "ms", "gaps",
        "replayed", "lost", "restarts", "drops",
    ]  # fmt: skip
    rows = lines[header + 2 : header + 4]
    lag = lines[header].index("lag ms")
    residency = sample_residency()
    for row, worker in zip(rows, (1, 2), strict=True):
        cells = row.split()
        assert cells[:6] == [str(worker), "0", *map(str, residency[worker])], out
        assert row[lag : lag + len("lag ms")].strip() == "", out
        assert cells[7:] == ["0", "0", "0", "0", "0"], out  # gaps .. drops; no lag cell
    assert lines[-3:] == [
        "batches 7 | gaps 0 | replays 0 (recovered 0) | lost 0 | restarts 0",
        "bad frames: none",
        "not forwarded: none",
    ]


def without(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``kvbridge ARGS`` with ``module`` impossible to import."""
    code = (
        f"import sys; sys.modules[{module!r}] = None\n"
        "from kvbridge.cli import main\n"
        f"sys.exit(main({list(args)!r}))"
    )
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=TIMEOUT
    )


def test_a_missing_extra_is_named() -> None:
    result = without("rich", "watch", "--source", "tcp://*:5557", "--block-size", "4")
    assert result.stderr.splitlines() == [
        "kvbridge watch: error: kvbridge watch needs rich, its extra 'watch': pip install rich "
        "(or, in a clone, pip install '.[watch]')"
    ]
    assert result.returncode == 2
    port = free_port_range(1)
    metrics = without(
        "prometheus_client", "record", "--source", "tcp://*:5557", "--out", "/dev/null",
        "--metrics-port", str(port),
    )  # fmt: skip
    assert metrics.stderr.splitlines() == [
        "kvbridge record: error: --metrics-port needs prometheus-client, the extra 'metrics': "
        "pip install prometheus-client (or, in a clone, pip install '.[metrics]')"
    ]
    assert metrics.returncode == 2


# --------------------------------------------------------------------------- 6. set-up


def test_readme_installs_from_a_clone_or_a_wheel() -> None:
    """kvbridge is on no registry: the README must not send users to ``pip install kvbridge``."""
    readme = (SAMPLE.parents[2] / "README.md").read_text()
    assert "pip install kvbridge" not in readme
    assert "pip install '.[metrics,watch]'" in readme
    assert "pip wheel --no-deps -w dist ." in readme


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_replay_waiting_for_subscribers_stops_within_a_second_of_a_signal(signum: int) -> None:
    port = free_port_range(2)
    proc = start(
        "replay", str(SAMPLE), "--publish", f"tcp://127.0.0.1:{port}", "--wait-subscribers", "30"
    )
    try:
        assert proc.stderr is not None
        # The plan is logged before the wait for subscribers begins.
        for line in proc.stderr:
            if "subscribe with" in line:
                break
        time.sleep(0.3)
        sent = time.monotonic()
        proc.send_signal(signum)
        proc.wait(timeout=5)
        assert time.monotonic() - sent < 1.0
        assert proc.returncode == 0
    finally:
        proc.kill()
        proc.wait()


def test_compare_of_a_capture_whose_blocks_are_too_large_is_exit_1(tmp_path: Path) -> None:
    path = header_capture(tmp_path / "large.kvcap", {"block_size": 65_537}, [RECORD])
    result = kvbridge("validate", "--compare-dynamo", str(path))
    assert result.stderr.splitlines()[-1] == (
        f"kvbridge validate: error: {path}: block size 65537 is above the 65536 a comparison takes"
    )
    assert result.returncode == 1


def test_compare_of_a_stream_with_no_seq_left_for_its_sentinels_is_exit_1(
    tmp_path: Path,
) -> None:
    """A stream of two records needs three seqs above its largest: one for each sentinel that
    may come before a record, and the last one's. Above, it is refused before Dynamo starts."""

    def compare(last: int) -> subprocess.CompletedProcess[str]:
        seqs = [last - 1, last]
        records = [[*RECORD[:3], [b"", seq.to_bytes(8, "big"), b"\x93"]] for seq in seqs]
        path = header_capture(tmp_path / f"{last}.kvcap", {"block_size": 4}, records)
        return kvbridge("validate", "--compare-dynamo", str(path))

    refused = compare(2**64 - 4)
    assert refused.stderr.splitlines() == [
        f"kvbridge validate: error: {tmp_path}/18446744073709551612.kvcap: stream "
        "tcp://127.0.0.1:5557 reaches seq 18446744073709551612, above the 18446744073709551611 "
        "a comparison of its 2 records takes: it numbers its sentinel blocks after them, below "
        "2**64 - 1"
    ]
    assert refused.returncode == 1
    compared = compare(2**64 - 5)
    # One seq lower, the comparison runs: its sentinel takes the last seq a batch can have.
    assert compared.stdout.splitlines()[-1] == (
        "Dynamo alone vs through kvbridge: same (0 missing, 0 stale in 1 capture(s))"
    ), compared.stderr


def test_compare_of_a_stream_with_two_workers_is_exit_1(tmp_path: Path) -> None:
    """A stream is one worker's: with two, the comparison could not tell whose blocks are."""
    other = [RECORD[0], RECORD[1], 2, RECORD[3]]
    path = header_capture(tmp_path / "shared.kvcap", {"block_size": 4}, [RECORD, other])
    result = kvbridge("validate", "--compare-dynamo", str(path))
    assert result.stderr.splitlines()[-1] == (
        f"kvbridge validate: error: {path}: stream tcp://127.0.0.1:5557 names workers 1, 2: a "
        "stream is one worker's, so a comparison cannot tell whose its blocks are"
    )
    assert result.returncode == 1


def test_an_error_in_the_relays_loop_is_exit_1_not_a_usage_error() -> None:
    """A fault injected as a test double of a bug: the relay's step raises a ``ValueError``,
    which before the loop would mean a bad argument (exit 2). In the loop it is one line that
    names the error, exit 1, and its traceback in the log."""
    port = free_port_range(2)
    args = ["relay", "--source", f"tcp://*:{port}", "--publish", f"tcp://127.0.0.1:{port + 1}"]
    code = (
        "import sys\n"
        "from kvbridge.adapters.relay import Relay\n"
        "def fault(self, timeout_ms=100):\n"
        "    raise ValueError('injected fault')\n"
        "Relay.step = fault\n"
        "from kvbridge.cli import main\n"
        f"sys.exit(main({[*args, '--block-size', '16']!r}))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=TIMEOUT
    )
    assert result.stderr.splitlines()[-1:] == [
        "kvbridge relay: error: stopped on an error: ValueError('injected fault')"
    ]
    assert result.returncode == 1
    assert "ValueError: injected fault" in result.stderr  # the traceback, logged
