"""Parity with the pure-Python normalizer: every stream recorded in ``tests/fixtures/normalizer``
(by ``tools/record_normalizer_golden.py``) is replayed through ``kvbridge.Normalizer`` and must
give exactly the recorded output, step by step.

Per step (a batch, or a ``reset``) the recording holds the number of events, a digest of
``msgspec.msgpack.encode(events)`` (token ids as lists, as recorded) and a digest of the relay's canonical payloads; at the end
of a stream (before its final ``reset()``) the counters and residency. For the small streams
(captures and fixtures) it also holds every step's events and canonical payloads, shown when a
step differs. Only the public API is used, so the test holds for any implementation of it.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import lzma
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvbridge import Normalizer, SchemaError, Tier, TieredEvent, decode_batch
from kvbridge.adapters.capture import CaptureReader

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "normalizer"
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())
STREAMS: list[str] = MANIFEST["streams"]

StepEvents = tuple[list[TieredEvent], list[bytes]] | None
"""A step's events and canonical payloads (``None`` for a payload that does not decode)."""


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:32]


def listed(events: list[TieredEvent]) -> list[TieredEvent]:
    """The events with their token ids as plain lists, the form they were recorded in (the
    normalizer packs them, and ``TokenIds`` encodes as its packed bytes)."""
    return [msgspec.structs.replace(e, token_ids=list(e.token_ids)) for e in events]


def canonical_digest(payloads: list[bytes]) -> str:
    return digest(b"".join(len(p).to_bytes(4, "little") + p for p in payloads))


def expectation(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((FIXTURES / "streams" / f"{name}.json").read_text())
    return loaded


def source_payloads(source: dict[str, Any]) -> list[tuple[bytes, int]]:
    """The stream's ``(payload, seq)`` in order."""
    kind = source["kind"]
    if kind == "payloads":
        raw = lzma.decompress((FIXTURES / source["file"]).read_bytes())
        payloads = msgspec.msgpack.decode(raw, type=list[bytes])
        return [(payload, seq) for seq, payload in enumerate(payloads)]
    if kind == "kvcap":
        out = []
        for record in CaptureReader(ROOT / source["path"]):
            if record.worker_id == source["worker_id"]:
                assert record.seq is not None
                out.append((record.frames[2], record.seq))
        return out
    assert kind == "payload", kind
    return [((ROOT / source["path"]).read_bytes(), 0)]


def state_of(normalizer: Normalizer) -> dict[str, Any]:
    ranks = list(normalizer.dp_ranks)
    state = {
        "stats": dict(sorted(normalizer.stats.items())),
        "forwarded": sorted(
            [kind, tier.value, n] for (kind, tier), n in normalizer.forwarded.items()
        ),
        "dropped": sorted([*key, n] for key, n in normalizer.dropped.items()),
        "unknown_fields": normalizer.unknown_fields,
        "dp_ranks": ranks,
        "resident_blocks": [
            [rank, tier.value, normalizer.resident_blocks(rank, tier)]
            for rank in ranks
            for tier in Tier
        ],
    }
    as_json: dict[str, Any] = json.loads(json.dumps(state))  # lists, not tuples, as recorded
    return as_json


def replay(
    expected: dict[str, Any],
) -> tuple[list[dict[str, Any]], list[StepEvents], dict[str, Any] | None]:
    """Runs the recorded schedule: the steps, their events, the state before the final reset."""
    normalizer = Normalizer(expected["worker_id"], expected["block_size"])
    payloads = iter(source_payloads(expected["source"]))
    steps: list[dict[str, Any]] = []
    full: list[StepEvents] = []
    state = None
    last = len(expected["steps"]) - 1
    for index, planned in enumerate(expected["steps"]):
        if planned["op"] == "batch":
            payload_seq = next(payloads, None)
            assert payload_seq is not None, f"{expected['name']}: fewer payloads than recorded"
            payload, seq = payload_seq
            step: dict[str, Any] = {"op": "batch", "seq": seq}
            try:
                batch = decode_batch(payload)
            except SchemaError:
                steps.append({**step, "error": "SchemaError"})
                full.append(None)
                continue
            # The payload's own bytes go to the core; decode_batch gives the recorded ts.
            output = normalizer.process(payload, seq)
            ts = batch.ts
        else:
            if index == last:
                state = state_of(normalizer)
            dp_rank = planned["dp_rank"]
            step = {"op": "reset", "dp_rank": dp_rank}
            output = normalizer.process_reset(dp_rank)
            ts = 0.0
        events = list(output.events)
        canonical = output.canonical_payloads(ts)
        step.update(
            events=len(events),
            digest=digest(msgspec.msgpack.encode(listed(events))),
            canonical=canonical_digest(canonical),
        )
        steps.append(step)
        full.append((events, canonical))
    assert next(payloads, None) is None, f"{expected['name']}: more payloads than recorded"
    return steps, full, state


LINE = 1_000
"""Characters shown of one event of a stream recorded as digests only."""


def _lines(step: StepEvents) -> list[str]:
    """A step's events, then the events of its canonical payloads, one JSON line each."""
    if step is None:
        return ["(the payload did not decode: SchemaError)"]
    events, canonical = step
    lines = [
        f"event {i}: {json.dumps(msgspec.to_builtins(e))}" for i, e in enumerate(listed(events))
    ]
    for i, payload in enumerate(canonical):
        ts, vllm_events, *rank = msgspec.to_builtins(msgspec.msgpack.decode(payload))
        lines.append(f"canonical {i}: ts {ts!r}, dp_rank {rank[0] if rank else None}")
        lines += [f"canonical {i} event {j}: {json.dumps(e)}" for j, e in enumerate(vllm_events)]
    return lines


def describe(
    name: str,
    index: int,
    want: dict[str, Any],
    got: dict[str, Any],
    want_full: StepEvents | str,
    got_full: StepEvents,
) -> str:
    lines = [
        f"stream {name}: step {index} differs (the first that does)",
        f"  expected: {json.dumps(want)}",
        f"  actual:   {json.dumps(got)}",
    ]
    actual = _lines(got_full)
    if isinstance(want_full, str):
        lines.append(f"({want_full}) actual events and canonical payloads:")
        lines += [line if len(line) <= LINE else line[:LINE] + " ..." for line in actual]
    else:
        lines.append("expected vs actual events and canonical payloads:")
        lines += difflib.unified_diff(_lines(want_full), actual, "expected", "actual", lineterm="")
    return "\n".join(lines)


@pytest.mark.parametrize("name", STREAMS)
def test_stream_matches_recording(name: str) -> None:
    expected = expectation(name)
    assert expected["name"] == name
    final = expected["steps"][-1]
    assert final["op"] == "reset" and final["dp_rank"] is None, "a stream ends with reset()"
    steps, full, state = replay(expected)
    recorded_full: list[StepEvents] | None = None
    if expected["events_file"] is not None:
        raw = (FIXTURES / expected["events_file"]).read_bytes()
        recorded_full = msgspec.msgpack.decode(raw, type=list[StepEvents])
        assert len(recorded_full) == len(expected["steps"])
    for index, (want, got) in enumerate(zip(expected["steps"], steps, strict=True)):
        want = {key: value for key, value in want.items() if key != "message"}
        if want != got:
            want_full = (
                recorded_full[index]
                if recorded_full is not None
                else "digests only were recorded for this stream"
            )
            pytest.fail(describe(name, index, want, got, want_full, full[index]), pytrace=False)
    assert state == expected["state_before_final_reset"], (
        f"stream {name}: the state before the final reset differs"
    )


def test_manifest_lists_every_recorded_stream() -> None:
    recorded = sorted(path.stem for path in (FIXTURES / "streams").glob("*.json"))
    assert sorted(STREAMS) == recorded
    assert len(STREAMS) == len(set(STREAMS))
