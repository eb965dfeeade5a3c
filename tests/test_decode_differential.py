"""The two payload decoders agree: ``kvbridge.schemas.decode_batch`` (msgspec) and the Rust core's
``kvbridge._core.decode_view``.

On every fixture, every frame of the golden captures and a generated corpus, both give the same
batch (ts, dp rank, unknown fields, every field of every event) or fail at the same place (batch
or event, event index, field; the messages may differ). The comparison lives in
``tools/fuzz_decoders.py``, which runs the same check on larger corpora. Any disagreement
fails.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from kvbridge import _core
from kvbridge.schemas.vllm import MAX_NESTING
from kvbridge.testing.corpus import payload_corpus

ROOT = Path(__file__).resolve().parents[1]


def _load_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "fuzz_decoders", ROOT / "tools" / "fuzz_decoders.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("fuzz_decoders", module)
    spec.loader.exec_module(module)
    return module


fd = _load_tool()

CORPUS_SEED = 20261201
CORPUS_COUNT = 100_000

HEAD = "93cb0000000000000000"
"""``[0.0, ...``: a batch array of three, its ``ts`` a float64."""
TYPE = "a474797065"
CLEARED = "b0416c6c426c6f636b73436c6561726564"
REMOVED = "ac426c6f636b52656d6f766564"
STORED = "ab426c6f636b53746f726564"
HASHES = "ac626c6f636b5f686173686573"
MEDIUM = "a66d656469756d"
EXTRA_KEYS = "aa65787472615f6b657973"
LOOKAHEAD = "b36c6f6f6b61686561645f746f6b656e5f696473"
# A map BlockStored's required fields: one block of one token, no parent, no LoRA.
STORE = (
    f"{TYPE} {STORED} {HASHES} 9101 b1706172656e745f626c6f636b5f68617368 c0"
    " a9746f6b656e5f696473 9105 aa626c6f636b5f73697a65 01 a76c6f72615f6964 c0"
)


def stored_with(field: str, value: str, want: tuple[Any, ...], case: str) -> Any:
    """A case of one map BlockStored, :data:`STORE` plus ``field`` (its msgpack key) holding
    ``value`` (msgpack hex), in a batch of one event; ``want``: the outcome both decoders give."""
    return pytest.param(HEAD + f"91 87 {STORE} {field} {value} c0", want, id=case)


def _payload(text: str) -> bytes:
    return bytes.fromhex(text.replace(" ", ""))


def _summary(outcome: tuple[Any, ...]) -> tuple[Any, ...]:
    """An outcome without its values: ("ok", unknown fields) or ("error", index, field)."""
    return ("ok", outcome[3]) if outcome[0] == "ok" else outcome


def _agree(payload: bytes) -> tuple[Any, ...]:
    python: tuple[Any, ...]
    python, core = fd.compare(payload)
    assert python == core, fd.describe(payload, python, core)
    return python


def test_limits_are_shared() -> None:
    assert _core.MAX_DEPTH == MAX_NESTING


@pytest.mark.parametrize(
    ("payload", "want"),
    [
        # Nesting: 64 levels are decoded (and fail as events), 65 fail on the nesting, inside the
        # event they lie in, before a bad ts; elsewhere at batch level.
        pytest.param(HEAD + "91" + "91" * 62 + "c0c0", ("error", 0, "type"), id="depth-64"),
        pytest.param(HEAD + "91" + "91" * 63 + "c0c0", ("error", 0, None), id="depth-65"),
        pytest.param("93c3 92 c0" + "91" * 63 + "c0 c0", ("error", 1, None), id="depth-before-ts"),
        pytest.param(HEAD + "90" + "91" * 64 + "c0", ("error", None, None), id="depth-in-rank"),
        pytest.param(
            HEAD + "91" + "dc0001" * 62 + "dc00", ("error", 0, None), id="depth-65-truncated"
        ),
        # The first problem in wire order wins: a type error before a string that is not UTF-8,
        # which is malformed (no field) when read first.
        pytest.param(
            HEAD + f"91 83 {TYPE} {REMOVED} {HASHES} a178 {MEDIUM} a1ff c0",
            ("error", 0, "block_hashes"),
            id="type-error-then-invalid-utf8",
        ),
        pytest.param(
            HEAD + f"91 83 {TYPE} {REMOVED} {MEDIUM} a1ff {HASHES} a178 c0",
            ("error", 0, None),
            id="invalid-utf8-then-type-error",
        ),
        pytest.param(
            HEAD + f"91 92 {CLEARED} a1ff c0", ("error", 0, None), id="array-unknown-invalid-utf8"
        ),
        pytest.param(
            HEAD + f"91 82 {TYPE} {CLEARED} a178 a1ff c0",
            ("error", 0, None),
            id="map-unknown-value-invalid-utf8",
        ),
        pytest.param(
            HEAD + f"91 82 a1ff 01 {TYPE} {CLEARED} c0",
            ("error", 0, None),
            id="map-unknown-key-invalid-utf8",
        ),
        pytest.param(
            HEAD + f"91 82 {TYPE} {REMOVED} a1ff 01 c0",
            ("error", 0, None),
            id="map-unknown-key-invalid-utf8-then-missing-field",
        ),
        pytest.param(
            HEAD + f"91 82 {TYPE} {CLEARED} {TYPE} {REMOVED} c0",
            ("error", 0, "type"),
            id="second-tag-differs",
        ),
        pytest.param(HEAD + "91 91 a1ff c0", ("error", 0, None), id="tag-invalid-utf8"),
        pytest.param(HEAD + f"91 81 {HASHES} 90 c0", ("error", 0, "event"), id="map-without-tag"),
        # Unknown fields: map keys counted once each; array positions past the array era
        # counted unless the strict pass takes the batch (nil there); batch fields past three.
        pytest.param(
            HEAD + f"91 83 {TYPE} {CLEARED} a178 01 a178 02 c0", ("ok", 1), id="unknown-key-twice"
        ),
        pytest.param(
            HEAD + f"91 95 {REMOVED} 9101 c0 c0 c0 c0", ("ok", 0), id="array-nil-past-era"
        ),
        pytest.param(
            HEAD + f"92 95 {REMOVED} 9101 c0 c0 c0 81 {TYPE} {CLEARED} c0",
            ("ok", 1),
            id="array-nil-past-era-mixed-eras",
        ),
        pytest.param(
            HEAD + f"91 95 {REMOVED} 9101 c0 c0 a178 c0", ("ok", 1), id="array-value-past-era"
        ),
        pytest.param(
            f"94cb0000000000000000 91 92 {CLEARED} a1ff c0 01",
            ("error", None, None),
            id="batch-field-past-three-then-invalid-utf8",
        ),
        # Bounds: the dp rank, token ids, lookahead tokens as u32.
        pytest.param(HEAD + "90 ff", ("error", None, "data_parallel_rank"), id="rank-negative"),
        pytest.param(
            HEAD + "90 cf0000000100000000",
            ("error", None, "data_parallel_rank"),
            id="rank-past-u32",
        ),
        pytest.param(HEAD + "90 a178", ("error", None, None), id="rank-str"),
        stored_with(
            LOOKAHEAD,
            "92 90 92 01 ff",
            ("error", 0, "lookahead_token_ids[1][1]"),
            "lookahead-token-negative",
        ),
        # Extra keys are `Any`: timestamps must be datetimes, map keys hashable.
        stored_with(EXTRA_KEYS, "91 91 d6ff00000001", ("ok", 0), "ek-timestamp"),
        stored_with(
            EXTRA_KEYS, "91 92 01 d4ff00", ("error", 0, "extra_keys[0][1]"), "ek-bad-timestamp"
        ),
        stored_with(
            EXTRA_KEYS,
            "91 91 81 a178 d4ff00",
            ("error", 0, "extra_keys[0][0][...]"),
            "ek-bad-timestamp-in-map",
        ),
        stored_with(
            EXTRA_KEYS, "91 91 81 d4ff00 01", ("error", 0, "event"), "ek-bad-timestamp-as-key"
        ),
        stored_with(EXTRA_KEYS, "91 91 81 9101 01", ("ok", 0), "ek-array-key"),
        stored_with(EXTRA_KEYS, "91 91 81 91 8101 01 01", ("error", 0, None), "ek-unhashable-key"),
        stored_with(
            EXTRA_KEYS, "91 91 c70cff 00000000 0000003afff4417f", ("ok", 0), "ek-timestamp-9999"
        ),
        stored_with(
            EXTRA_KEYS,
            "91 91 c70cff 3b9ac9ff 0000003afff4417f",
            ("error", 0, "extra_keys[0][0]"),
            "ek-timestamp-rounds-past-9999",
        ),
    ],
)
def test_edge_cases_agree(payload: str, want: tuple[Any, ...]) -> None:
    assert _summary(_agree(_payload(payload))) == want


@pytest.mark.parametrize(
    ("payload", "want"),
    [
        # token_ids[2] is a string that is not UTF-8, in an array event: the field is named
        # from the event's header, not by decoding the whole event.
        pytest.param(
            HEAD + f"91 96 {STORED} 9101 c0 9301 02 a1ff 01 c0 c0",
            ("error", 0, "token_ids[2]"),
            id="array-field-beside-bad-utf8",
        ),
        # A str8 tag: position 4 of an array BlockRemoved is past the array era, unknown.
        pytest.param(
            HEAD + "91 95 d90c426c6f636b52656d6f766564 9101 c0 c0 a178 c0",
            ("ok", 1),
            id="str8-tag",
        ),
    ],
)
def test_formerly_divergent_cases_agree(payload: str, want: tuple[Any, ...]) -> None:
    assert _summary(_agree(_payload(payload))) == want


def test_fixtures_and_captures_agree() -> None:
    outcomes = [(name, *fd.compare(payload)) for name, payload in fd.fixture_payloads()]
    assert len(outcomes) > 100
    disagree = [name for name, python, core in outcomes if python != core]
    assert not disagree
    assert all(python[0] == "ok" for _, python, _ in outcomes)


def test_corpus_agrees() -> None:
    """100k generated payloads (valid, mutated, random): no unexplained disagreement."""
    kinds: dict[str, int] = {}
    failures: list[str] = []
    for payload in payload_corpus(CORPUS_SEED, CORPUS_COUNT):
        python, core = fd.compare(payload)
        if python == core:
            kinds[fd.kind(python)] = kinds.get(fd.kind(python), 0) + 1
            continue
        if len(failures) < 5:
            failures.append(fd.describe(payload, python, core))
        else:
            failures.append("")
    assert not failures, f"{len(failures)} disagreements, first ones:\n" + "\n".join(failures[:5])
    # The corpus reaches every outcome.
    assert set(kinds) == {"ok", "ok, unknown fields", "batch error", "event error"}, kinds
