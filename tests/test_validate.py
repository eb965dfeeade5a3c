"""``kvbridge validate``: exit codes, the frame it names, the JSON report and strict mode."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from kvbridge.adapters.capture import CaptureReader, CaptureWriter
from kvbridge.cli.validation import Report
from kvbridge.schemas.vllm import BlockStored, VllmBatch, encode_batch, layout_for

SAMPLE = Path(__file__).resolve().parents[1] / "kvbridge" / "data" / "sample.kvcap"


def validate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvbridge.cli", "validate", *args],
        capture_output=True,
        text=True,
        check=False,
    )


def rewrite(path: Path, change: dict[int, list[bytes]]) -> None:
    """Copy the sample capture to ``path`` with the frames of some records replaced."""
    reader = CaptureReader(SAMPLE)
    with CaptureWriter(path, meta=reader.meta) as writer:
        for index, record in enumerate(reader):
            writer.write(
                change.get(index, record.frames),
                stream=record.stream,
                worker_id=record.worker_id,
                received_ns=record.received_ns,
            )


def test_sample_is_valid() -> None:
    result = validate(str(SAMPLE))
    assert result.returncode == 0, result.stdout
    assert result.stdout.splitlines() == [
        "valid: 7 frames, 10 events, 0 invalid frames in 1 capture(s)"
    ]


def test_one_corrupted_frame_is_named(tmp_path: Path) -> None:
    frames = list(CaptureReader(SAMPLE))[5].frames
    corrupted = tmp_path / "corrupted.kvcap"
    rewrite(corrupted, {5: [frames[0], frames[1], frames[2][:-7]]})
    result = validate(str(corrupted))
    assert result.returncode == 1
    assert result.stdout.splitlines() == [
        f"{corrupted}: record 5, stream tcp://127.0.0.1:5558, worker 2, seq 1: "
        "[schema] batch: malformed msgpack: Input data was truncated",
        "INVALID: 7 frames, 9 events, 1 invalid frames in 1 capture(s)",
        "  schema: 1",
    ]


def test_json_report_follows_its_schema(tmp_path: Path) -> None:
    frames = next(iter(CaptureReader(SAMPLE))).frames
    bad = encode_batch(
        VllmBatch(1.0, [BlockStored([1, 2, 3], None, list(range(8)), 4, None, "GPU", None)], 0),
        layout_for("0.32.0"),
    )
    broken = tmp_path / "broken.kvcap"
    rewrite(broken, {0: [frames[0], frames[1], bad], 1: [b"kv-events", b"\x00" * 8]})
    result = validate("--format", "json", str(broken))
    assert result.returncode == 1
    report = msgspec.json.decode(result.stdout, type=Report)
    assert (report.valid, report.frames, report.invalid_frames) == (False, 7, 2)
    assert report.summary == {"frame_count": 1, "schema": 1}
    first, second = report.problems
    assert (first.record, first.seq, first.event_index, first.field, first.reason) == (
        0,
        0,
        0,
        "token_ids",
        "schema",
    )
    assert first.message == "event 0: field 'token_ids': 8 tokens cannot fill 3 blocks of 4"
    assert (second.record, second.seq, second.reason) == (1, None, "frame_count")
    assert second.message == "expected 3 frames, got 2"
    schema = validate("--json-schema")
    assert schema.returncode == 0
    assert msgspec.json.decode(schema.stdout)["$defs"]["Report"]["required"] == [
        "valid",
        "strict",
        "captures",
        "frames",
        "events",
        "invalid_frames",
        "problems",
        "summary",
        "dropped",
        "unknown_fields",
    ]


@pytest.mark.parametrize(
    ("medium", "extra", "strict_reason"),
    [("FLASH", False, "unknown_medium"), ("GPU", True, "unknown_field")],
)
def test_strict_fails_on_drops_and_unknown_fields(
    tmp_path: Path, medium: str, extra: bool, strict_reason: str
) -> None:
    frames = next(iter(CaptureReader(SAMPLE))).frames
    event = BlockStored([9], None, [1, 2, 3, 4], 4, None, medium, None)
    payload = msgspec.msgpack.decode(encode_batch(VllmBatch(1.0, [event], 0), layout_for("0.32.0")))
    if extra:
        payload[1][0]["future_field"] = 1
    path = tmp_path / "odd.kvcap"
    with CaptureWriter(path) as writer:
        writer.write([frames[0], frames[1], msgspec.msgpack.encode(payload)], stream="s")
    assert validate(str(path)).returncode == 0
    strict = validate("--strict", "--format", "json", str(path))
    assert strict.returncode == 1
    report = msgspec.json.decode(strict.stdout, type=Report)
    assert [(p.record, p.reason, p.count) for p in report.problems] == [(0, strict_reason, 1)]


def test_every_golden_vllm_capture_is_valid_even_strict() -> None:
    golden = sorted((SAMPLE.parents[2] / "tests" / "fixtures" / "vllm-0.32.0").glob("*.kvcap"))
    assert len(golden) == 10
    result = validate("--strict", *map(str, golden))
    assert result.returncode == 0, result.stdout
    assert result.stdout.splitlines() == [
        "valid (strict): 127 frames, 815 events, 0 invalid frames in 10 capture(s)"
    ]


# --------------------------------------------------------------------------- what must be there

GOLDEN = SAMPLE.parents[2] / "tests" / "fixtures" / "vllm-0.32.0"


def test_an_empty_capture_fails_unless_allowed(tmp_path: Path) -> None:
    """A CI recording that caught nothing must not pass."""
    empty = tmp_path / "empty.kvcap"
    CaptureWriter(empty, meta={"command": "kvbridge record"}).close()
    result = validate(str(empty))
    assert result.returncode == 1
    assert result.stdout.splitlines() == [
        "INVALID: 0 frames, 0 events, 0 invalid frames in 1 capture(s)",
        f"  {empty}: no frames (--allow-empty accepts an empty capture)",
    ]
    report = msgspec.json.decode(validate("--format", "json", str(empty)).stdout, type=Report)
    assert (report.valid, report.problems, report.unmet) == (
        False,
        [],
        [f"{empty}: no frames (--allow-empty accepts an empty capture)"],
    )
    allowed = validate("--allow-empty", str(empty))
    assert allowed.returncode == 0, allowed.stdout
    assert allowed.stdout.splitlines() == [
        "valid: 0 frames, 0 events, 0 invalid frames in 1 capture(s)"
    ]


def test_each_empty_capture_is_named(tmp_path: Path) -> None:
    empty = tmp_path / "empty.kvcap"
    CaptureWriter(empty).close()
    result = validate(str(SAMPLE), str(empty))
    assert result.returncode == 1
    assert result.stdout.splitlines() == [
        "INVALID: 7 frames, 10 events, 0 invalid frames in 2 capture(s)",
        f"  {empty}: no frames (--allow-empty accepts an empty capture)",
    ]


def test_require_medium_names_what_is_missing() -> None:
    gpu_only = GOLDEN / "prefix.kvcap"
    result = validate("--require-medium", "CPU", str(gpu_only))
    assert result.returncode == 1
    assert result.stdout.splitlines() == [
        "INVALID: 6 frames, 10 events, 0 invalid frames in 1 capture(s)",
        "  no event with medium CPU (media seen: GPU=10)",
    ]
    # Without regard to case, each missing medium named, the media seen counted in the report.
    both = validate(
        "--require-medium", "cpu", "--require-medium", "Disk", "--format", "json", str(gpu_only)
    )
    assert both.returncode == 1
    report = msgspec.json.decode(both.stdout, type=Report)
    assert report.unmet == [
        "no event with medium CPU (media seen: GPU=10)",
        "no event with medium DISK (media seen: GPU=10)",
    ]
    assert report.media == {"GPU": 10}
    # The offload capture has CPU events; the bundled sample too (its placeholders).
    for capture in (GOLDEN / "offload.kvcap", SAMPLE):
        ok = validate("--require-medium", "CPU", "--require-medium", "GPU", str(capture))
        assert ok.returncode == 0, ok.stdout


def test_min_frames_counts_over_all_captures() -> None:
    a, b = GOLDEN / "xxhash-a.kvcap", GOLDEN / "xxhash-b.kvcap"  # 2 frames each
    short = validate("--min-frames", "5", str(a), str(b))
    assert short.returncode == 1
    assert short.stdout.splitlines() == [
        "INVALID: 4 frames, 6 events, 0 invalid frames in 2 capture(s)",
        "  4 frames, fewer than --min-frames 5",
    ]
    assert validate("--min-frames", "4", str(a), str(b)).returncode == 0
