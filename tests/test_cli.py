"""The ``kvbridge`` command: the bundled demo and the one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvbridge.schemas.vllm import LAYOUTS


def kvbridge(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvbridge.cli", *args], capture_output=True, text=True, check=False
    )


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


@pytest.mark.parametrize(
    ("args", "message"),
    [
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
    ],
)
def test_bad_argument_is_one_line_and_exit_2(args: list[str], message: str) -> None:
    result = kvbridge(*args)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [message]


@pytest.mark.parametrize(
    ("args", "message"),
    [
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
            [
                "relay",
                "--source",
                "tcp://*:1",
                "--publish",
                "tcp://127.0.0.1:4",
                "--block-size",
                "16",
                "--metrics-port",
                "70000",
            ],
            "kvbridge relay: error: argument --metrics-port: not a port number: '70000'",
        ),
        (
            ["replay", "x.kvcap", "--publish", "tcp://*:1", "--pace", "fast"],
            "kvbridge replay: error: argument --pace: invalid choice: 'fast' (choose from 'original', 'max')",
        ),
        (["validate"], "kvbridge validate: error: give at least one capture"),
    ],
)
def test_bad_subcommand_argument_is_one_line_and_exit_2(args: list[str], message: str) -> None:
    result = kvbridge(*args)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [message]


def test_schema_exports_every_layout_and_dynamo() -> None:
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
    assert tagged["required"] == [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ]
    assert schema["dynamo"]["KvCacheEvent"]["$defs"]["KvCacheEvent"]["required"] == [
        "event_id",
        "data",
    ]


def test_unreadable_capture_is_one_line_and_exit_1(tmp_path: object) -> None:
    result = kvbridge("demo", "/nonexistent.kvcap")
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "kvbridge demo: error: [Errno 2] No such file or directory: '/nonexistent.kvcap'"
    ]
