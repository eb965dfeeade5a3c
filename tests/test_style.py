"""The code base stays ruff-clean and passes mypy --strict."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)


def test_ruff_check() -> None:
    result = _run(sys.executable, "-m", "ruff", "check", "kvbridge", "tests", "tools", "benchmarks")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format() -> None:
    result = _run(
        sys.executable,
        "-m",
        "ruff",
        "format",
        "--check",
        "kvbridge",
        "tests",
        "tools",
        "benchmarks",
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_strict() -> None:
    result = _run(sys.executable, "-m", "mypy", "--strict", "kvbridge")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Success: no issues found" in result.stdout
