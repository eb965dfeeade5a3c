"""Schema conformance for every vLLM release that changed ``vllm/distributed/kv_events.py``.

The fixtures in ``tests/fixtures/releases`` were encoded by ``tools/release_fixtures`` with
each release's *own* event classes, extracted from its sdist and executed in a throwaway process
(see the README there). These tests decode them with kvbridge and compare every field with the
sample values recorded in ``manifest.json``, and compare each release's declarations with
kvbridge's layout table. They read files only; nothing is downloaded.
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from support.fixture_json import from_json

from kvbridge import decode_batch
from kvbridge.schemas import (
    LAYOUTS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    encode_batch,
    layout_for,
)
from kvbridge.schemas.vllm import layout_types

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "releases"
TOOL = ROOT / "tools" / "release_fixtures"
MANIFEST: dict[str, Any] = json.loads((FIXTURES / "manifest.json").read_text())
RELEASES: dict[str, dict[str, Any]] = {entry["release"]: entry for entry in MANIFEST["releases"]}
SAMPLES: dict[str, dict[str, Any]] = {sample["name"]: sample for sample in MANIFEST["samples"]}
EVENT_TYPES: dict[str, type[Any]] = {
    "BlockStored": BlockStored,
    "BlockRemoved": BlockRemoved,
    "AllBlocksCleared": AllBlocksCleared,
}
SHA256 = re.compile(r"^[0-9a-f]{64}$")


def _key(release: str) -> tuple[int, ...]:
    return tuple(int(part) for part in release.split("."))


release_ids = pytest.mark.parametrize("release", sorted(RELEASES, key=_key))


def _payload(entry: dict[str, Any]) -> bytes:
    return (FIXTURES / entry["fixture"]).read_bytes()


def _fields(entry: dict[str, Any], name: str) -> list[str]:
    return [field["name"] for field in entry["classes"][name]["fields"]]


@pytest.fixture(autouse=True)
def _no_network(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("test_releases must not use the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    yield


# ---------------------------------------------------------------------------------------------
# The fixture set and its provenance
# ---------------------------------------------------------------------------------------------


def test_at_least_twelve_releases_between_090_and_0330() -> None:
    assert len(RELEASES) == len(MANIFEST["releases"]) >= 12
    assert all((0, 9, 0) <= _key(release) <= (0, 33, 0) for release in RELEASES)
    assert "0.9.0" in RELEASES


def test_fixture_files_match_the_manifest() -> None:
    on_disk = sorted(path.name for path in FIXTURES.glob("*.msgpack"))
    assert on_disk == sorted(entry["fixture"] for entry in RELEASES.values())


def test_kept_releases_are_those_that_changed_kv_events() -> None:
    """The scan covers every release of the range; a fixture exists exactly where
    ``kv_events.py`` (or the definitions it imports) differs from the previous release."""
    scanned = MANIFEST["scanned"]
    assert [e["release"] for e in scanned] == sorted((e["release"] for e in scanned), key=_key)
    previous = None
    for entry in scanned:
        assert entry["source"] in ("sdist", "wheel"), entry
        changed = entry["kv_events_sha256"] != previous
        assert entry["changed"] is changed
        assert (entry["release"] in RELEASES) is (changed or "note" in entry)
        previous = entry["kv_events_sha256"]


@release_ids
def test_provenance(release: str) -> None:
    entry = RELEASES[release]
    source = entry["source"]
    assert source["kind"] == "sdist"
    assert source["filename"] == f"vllm-{release}.tar.gz"
    assert SHA256.match(source["sha256"])
    assert SHA256.match(entry["kv_events_sha256"])
    assert entry["files"]["vllm/distributed/kv_events.py"] == entry["kv_events_sha256"]
    scanned = next(e for e in MANIFEST["scanned"] if e["release"] == release)
    assert scanned["sha256"] == source["sha256"]
    assert scanned["kv_events_sha256"] == entry["kv_events_sha256"]
    payload = _payload(entry)
    assert hashlib.sha256(payload).hexdigest() == entry["payload_sha256"]
    assert len(payload) == entry["payload_bytes"]


def test_tool_does_not_import_kvbridge() -> None:
    """Every module of the tool imports only the standard library, msgspec and its siblings."""
    trees = [ast.parse(module.read_text()) for module in sorted(TOOL.glob("*.py"))]
    assert len(trees) > 1
    imported = {
        alias.name.split(".")[0]
        for tree in trees
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    } | {
        (node.module or "").split(".")[0]
        for tree in trees
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and not node.level
    }
    assert "kvbridge" not in imported
    assert imported - set(sys.stdlib_module_names) == {"msgspec"}


# ---------------------------------------------------------------------------------------------
# Decoding: every field equals the sample value
# ---------------------------------------------------------------------------------------------


@release_ids
def test_manifest_values_are_the_fixed_samples(release: str) -> None:
    """The per-release values in the manifest are those of the fixed sample set (the fields the
    release has), so the decoder below is checked against the samples, not against itself."""
    entry = RELEASES[release]
    optional = MANIFEST["optional_values"]
    for event in entry["events"]:
        sample = SAMPLES[event["sample"]]
        assert event["type"] == sample["event"]
        declared = entry["classes"][event["type"]]["fields"]
        assert list(event["values"]) == [field["name"] for field in declared]
        for field in declared:
            name = field["name"]
            if name in sample["values"]:
                want = sample["values"][name]
            elif sample["fill"] and name in optional:
                want = optional[name]
            else:
                want = field["default"]
            assert event["values"][name] == want, (event["sample"], name)
    included = [event["sample"] for event in entry["events"]]
    skipped = [skip["sample"] for skip in entry["skipped"]]
    assert sorted(included + skipped) == sorted(SAMPLES)
    assert included == [name for name in SAMPLES if name not in skipped]
    assert entry["unsampled_fields"] == {}


@release_ids
def test_only_refused_hash_types_are_skipped(release: str) -> None:
    """A sample is skipped only where the release's own types refuse it: bytes hashes before
    ExternalBlockHash (0.10.2)."""
    entry = RELEASES[release]
    hash_type = entry["classes"]["BlockStored"]["fields"][0]["type"]
    if hash_type == "list[int]":
        assert [skip["sample"] for skip in entry["skipped"]] == ["stored_bytes"]
        assert "Expected `int`, got `bytes`" in entry["skipped"][0]["reason"]
    else:
        assert hash_type == "list[bytes | int]"
        assert entry["skipped"] == []


@release_ids
def test_decodes_to_the_sample_values(release: str) -> None:
    entry = RELEASES[release]
    batch = decode_batch(_payload(entry))
    assert batch.ts == entry["batch"]["ts"] == MANIFEST["ts"]
    has_rank = "data_parallel_rank" in _fields(entry, entry["batch_class"])
    assert batch.data_parallel_rank == (MANIFEST["data_parallel_rank"] if has_rank else None)
    assert batch.data_parallel_rank == entry["batch"]["data_parallel_rank"]
    assert batch.unknown_fields == 0
    assert len(batch.events) == len(entry["events"])
    for event, want in zip(batch.events, entry["events"], strict=True):
        assert isinstance(event, EVENT_TYPES[want["type"]]), want["sample"]
        for field in msgspec.structs.fields(EVENT_TYPES[want["type"]]):
            actual = getattr(event, field.name)
            if field.name in want["values"]:
                expected = from_json(want["values"][field.name])
            else:  # a field this release does not have
                expected = field.default
            assert actual == expected, (want["sample"], field.name)
            assert type(actual) is type(expected), (want["sample"], field.name)


@release_ids
def test_kvbridge_reencodes_byte_for_byte(release: str) -> None:
    """kvbridge's encoder for the release's layout writes the bytes vLLM's own classes wrote."""
    payload = _payload(RELEASES[release])
    assert encode_batch(decode_batch(payload), layout_for(release)) == payload


# ---------------------------------------------------------------------------------------------
# vLLM's declarations vs kvbridge's layout table
# ---------------------------------------------------------------------------------------------


@release_ids
def test_field_order_matches_layout_table(release: str) -> None:
    entry = RELEASES[release]
    layout = layout_for(release)
    assert _fields(entry, "BlockStored") == list(layout.stored)
    assert _fields(entry, "BlockRemoved") == list(layout.removed)
    assert _fields(entry, "AllBlocksCleared") == []
    assert (
        _fields(entry, "EventBatch")
        == ["ts", "events", "data_parallel_rank"][: layout.batch_fields]
    )
    assert _fields(entry, entry["batch_class"]) == _fields(entry, "EventBatch")


@release_ids
def test_encoding_matches_layout_table(release: str) -> None:
    entry = RELEASES[release]
    classes = entry["classes"]
    events_array_like = {classes[name]["array_like"] for name in EVENT_TYPES}
    assert len(events_array_like) == 1
    assert ("array" if events_array_like.pop() else "map") == layout_for(release).encoding
    for name in EVENT_TYPES:
        assert classes[name]["tag_field"] == "type"
        assert classes[name]["tag"] == name
        assert classes[name]["omit_defaults"] is True
    # kvbridge decodes the batch as an array only: vLLM's batch must be array_like.
    assert classes["EventBatch"]["array_like"] is True
    assert classes[entry["batch_class"]]["array_like"] is True


@release_ids
def test_required_fields_match_layout_types(release: str) -> None:
    """The fields vLLM declares without a default (always sent, even nil, in maps) are those
    kvbridge's per-layout structs declare without a default."""
    entry = RELEASES[release]
    types = layout_types(layout_for(release))
    for name in EVENT_TYPES:
        declared = [(f["name"], f["required"]) for f in entry["classes"][name]["fields"]]
        ours = [(f.name, f.required) for f in msgspec.structs.fields(types[name])]
        assert declared == ours, name


def test_every_scanned_release_gets_the_layout_of_its_declarations() -> None:
    """Also the releases without a fixture (their kv_events.py is that of the newest fixture
    release before them): ``layout_for`` gives each the fields and encoding vLLM declared, and
    every row of ``LAYOUTS`` starts at a release that changed kv_events.py."""
    fixtures = sorted(RELEASES, key=_key)
    for scanned in MANIFEST["scanned"]:
        release = scanned["release"]
        governing = RELEASES[[r for r in fixtures if _key(r) <= _key(release)][-1]]
        assert scanned["kv_events_sha256"] == governing["kv_events_sha256"], release
        layout = layout_for(release)
        assert list(layout.stored) == _fields(governing, "BlockStored"), release
        assert list(layout.removed) == _fields(governing, "BlockRemoved"), release
        array_like = governing["classes"]["BlockStored"]["array_like"]
        assert layout.encoding == ("array" if array_like else "map"), release
        last = layout.last.removesuffix(".x")
        assert _key(layout.first) <= _key(release), release
        assert _key(release)[: len(_key(last))] <= _key(last), release
    assert {layout.first for layout in LAYOUTS} <= set(RELEASES)
