"""The ``kvbridge`` command: the bundled demo and the one-line errors."""

from __future__ import annotations

import subprocess
import sys

import pytest


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
            "kvbridge demo: error: argument --block-size: must be positive: '0'",
        ),
        (
            ["demo", "--block-size", "x"],
            "kvbridge demo: error: argument --block-size: not an integer: 'x'",
        ),
        (
            ["frobnicate"],
            "kvbridge: error: argument command: invalid choice: 'frobnicate' (choose from 'demo')",
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


def test_unreadable_capture_is_one_line_and_exit_1(tmp_path: object) -> None:
    result = kvbridge("demo", "/nonexistent.kvcap")
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "kvbridge demo: error: [Errno 2] No such file or directory: '/nonexistent.kvcap'"
    ]
