"""The code base stays ruff-clean and passes mypy --strict."""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import msgspec

from kvbridge.schemas import Tier

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


NATIVE = ROOT / "native"


def _cargo(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``cargo ARGS`` in native/, with ``env`` added to this process's environment."""
    return subprocess.run(
        ["cargo", *args],
        cwd=NATIVE,
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, **env},
    )


def test_cargo_fmt() -> None:
    result = _cargo("fmt", "--all", "--check")
    assert result.returncode == 0, result.stdout + result.stderr


def test_cargo_clippy() -> None:
    result = _cargo("clippy", "--locked", "--all-targets", "--", "-D", "warnings")
    assert result.returncode == 0, result.stdout + result.stderr


def test_cargo_test() -> None:
    result = _cargo("test", "--locked", "-p", "kvbridge-core")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "test result: ok" in result.stdout


def _code_lines(path: Path) -> int:
    """A Rust file's lines before its unit tests (a ``#[cfg(test)]`` module at its end)."""
    lines = path.read_text().splitlines()
    for number, (line, following) in enumerate(itertools.pairwise(lines)):
        if line == "#[cfg(test)]" and following.split("{")[0].strip().endswith("mod tests"):
            return number
    return len(lines)


def test_every_rust_module_is_small() -> None:
    """The Rust crates keep the Python package's bound: no file has more than MAX_MODULE_LINES
    lines of code (its unit tests aside), so that each keeps to one job."""
    sources = sorted(path for path in NATIVE.rglob("*.rs") if "target" not in path.parts)
    assert len(sources) >= 30, sources
    lines = {path.relative_to(ROOT).as_posix(): _code_lines(path) for path in sources}
    assert {path: count for path, count in lines.items() if count > MAX_MODULE_LINES} == {}


def test_fuzz_lock_is_current() -> None:
    """native/fuzz is a workspace of its own, with its own Cargo.lock: a dependency added to
    kvbridge-core must reach that lock too, or the fuzz run resolves it afresh each time."""
    result = _cargo(
        "metadata", "--locked", "--format-version", "1", "--manifest-path", "fuzz/Cargo.toml"
    )
    assert result.returncode == 0, result.stderr


def test_cargo_doc() -> None:
    """The crates' docs build without a warning: no link to a private item, to nothing, or
    to a name that means two things."""
    result = _cargo("doc", "--locked", "--no-deps", "--workspace", RUSTDOCFLAGS="-D warnings")
    assert result.returncode == 0, result.stderr


def test_layout_table_has_one_meaning_in_both_languages() -> None:
    """The Rust core's field table and the Python layout table describe the same wire format."""
    from kvbridge import _core
    from kvbridge.schemas import vllm

    assert tuple(_core.STORED_FIELDS) == vllm.STORED_FIELDS
    assert tuple(_core.REMOVED_FIELDS) == vllm.REMOVED_FIELDS
    array_era = [layout for layout in vllm.LAYOUTS if layout.encoding == "array"][-1]
    assert array_era.stored_fields == _core.STORED_ARRAY_FIELDS
    assert array_era.removed_fields == _core.REMOVED_ARRAY_FIELDS
    required = {
        tag: sum(1 for f in msgspec.structs.fields(cls) if f.required)
        for tag, cls in (("stored", vllm.BlockStored), ("removed", vllm.BlockRemoved))
    }
    assert (
        required["stored"],
        required["removed"],
    ) == (_core.STORED_REQUIRED, _core.REMOVED_REQUIRED)
    from kvbridge.normalizers.media import MEDIA

    assert dict(_core.MEDIA) == {name: tier.value for name, tier in MEDIA.items()}
    assert [tier.value for tier in Tier] == _core.TIERS


def test_architecture_doc_names_only_files_that_exist() -> None:
    """docs/architecture.md's picture and steps name the modules an event passes through: a
    rename or a split that leaves the doc behind fails here."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"\b((?:kvbridge|native|docs|tests|tools)/[\w/.-]*\w)", text))
    assert len(named) >= 30, sorted(named)
    assert sorted(path for path in named if not (ROOT / path).exists()) == []


MAX_MODULE_LINES = 400


def test_every_module_is_small_and_named_once() -> None:
    """No module of kvbridge/ is over MAX_MODULE_LINES lines, and no two share a file name
    (``__init__.py`` aside): a file's name says its one job, so it says it once."""
    modules = sorted((ROOT / "kvbridge").rglob("*.py"))
    lines = {
        path.relative_to(ROOT).as_posix(): len(path.read_text().splitlines()) for path in modules
    }
    assert {path: count for path, count in lines.items() if count > MAX_MODULE_LINES} == {}
    by_name: dict[str, list[str]] = {}
    for path in modules:
        if path.name != "__init__.py":
            by_name.setdefault(path.name, []).append(path.relative_to(ROOT).as_posix())
    assert {name: paths for name, paths in by_name.items() if len(paths) > 1} == {}
