#!/usr/bin/env python3
"""Write one msgpack fixture per vLLM KV-event wire layout, plus the values it must decode to.

The script is deliberately independent of kvbridge (it imports only msgspec, the standard
library and the sample values it shares with ``tools/release_fixtures/samples.py``): for every
distinct layout it re-declares vLLM's own classes from ``vllm/distributed/kv_events.py`` of that
release (``EventBatch``, ``KVCacheEvent``, ``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``) and lets msgspec encode one batch with them, exactly as vLLM's publisher
does (``msgspec.msgpack.Encoder().encode(batch)``). The fixtures therefore cross-check
kvbridge's own layout table rather than echo it.

Everything that varies between releases lives in two tables: ``FIELDS`` (each field with the
release that added it, taken from the "added" columns of the vLLM KV-events fact sheet) and
``RELEASES`` (the twelve release ranges with their event encoding and hash type).

Usage::

    python tools/make_layout_fixtures.py [OUTPUT_DIR]   # default: tests/fixtures/layouts

For each layout it writes ``vllm-<first release>.msgpack`` (the raw payload, ZMQ frame 2) and
``vllm-<first release>.json`` (the expected decoded values; hashes are JSON ints or
``{"bytes": "<hex>"}``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import msgspec
from release_fixtures.samples import DATA_PARALLEL_RANK as DP_RANK
from release_fixtures.samples import (
    OPTIONAL_VALUES,
    SAMPLES,
    SHA_A,
    SHA_B,
    TS,
    U64_A,
    U64_B,
    to_json,
)

# ---------------------------------------------------------------------------------------------
# The tables
# ---------------------------------------------------------------------------------------------

REQUIRED = object()
"""Marks a field declared without a default (always sent, even when nil)."""

_HashVar = TypeVar("_HashVar")
Hash: Any = _HashVar
"""Stands for the release's block-hash type (``Release.hash_type``) in the field types."""


class Field(NamedTuple):
    name: str
    added: str
    type: Any
    default: object


# Declaration order as in vLLM: fields without a default first, then the defaulted-None ones.
FIELDS: dict[str, tuple[Field, ...]] = {
    "EventBatch": (
        Field("ts", "0.9.0", float, REQUIRED),
        Field("events", "0.9.0", list[Any], REQUIRED),
        Field("data_parallel_rank", "0.9.1", int | None, None),
    ),
    "BlockStored": (
        Field("block_hashes", "0.9.0", list[Hash], REQUIRED),
        Field("parent_block_hash", "0.9.0", Hash | None, REQUIRED),
        Field("token_ids", "0.9.0", list[int], REQUIRED),
        Field("block_size", "0.9.0", int, REQUIRED),
        Field("lora_id", "0.9.0", int | None, REQUIRED),
        Field("medium", "0.10.2", str | None, REQUIRED),
        Field("lora_name", "0.14.0", str | None, REQUIRED),
        Field("extra_keys", "0.17.0", list[tuple[Any, ...] | None] | None, None),
        Field("group_idx", "0.20.0", int | None, None),
        Field("kv_cache_spec_kind", "0.22.0", str | None, None),
        Field("kv_cache_spec_sliding_window", "0.22.0", int | None, None),
        Field("locality", "0.26.0", str | None, None),
        Field("ownership", "0.29.0", str | None, None),
        Field("session_id", "0.30.0", str | None, None),
        Field("lookahead_token_ids", "0.33.0", list[list[int]] | None, None),
    ),
    "BlockRemoved": (
        Field("block_hashes", "0.9.0", list[Hash], REQUIRED),
        Field("medium", "0.10.2", str | None, REQUIRED),
        Field("group_idx", "0.20.0", int | None, None),
        Field("locality", "0.26.0", str | None, None),
        Field("ownership", "0.29.0", str | None, None),
    ),
    "AllBlocksCleared": (),
}


class Release(NamedTuple):
    first: str
    last: str
    events_array_like: bool
    """``array_like=True`` on ``KVCacheEvent`` (removed in 0.24.0 by vLLM PR #42892)."""
    hash_type: Any
    """``int`` up to 0.10.1.1, then ``ExternalBlockHash`` (``bytes | int``)."""


# Every distinct layout, oldest first. A release range's fields are those added at or before
# its first release; ``EventBatch`` keeps ``array_like=True`` in every release.
RELEASES: tuple[Release, ...] = (
    Release("0.9.0", "0.9.0.1", True, int),
    Release("0.9.1", "0.10.1.1", True, int),
    Release("0.10.2", "0.13.0", True, bytes | int),
    Release("0.14.0", "0.16.0", True, bytes | int),
    Release("0.17.0", "0.19.1", True, bytes | int),
    Release("0.20.0", "0.21.0", True, bytes | int),
    Release("0.22.0", "0.23.x", True, bytes | int),
    Release("0.24.0", "0.25.1", False, bytes | int),
    Release("0.26.0", "0.28.x", False, bytes | int),
    Release("0.29.0", "0.29.0", False, bytes | int),
    Release("0.30.0", "0.32.0", False, bytes | int),
    Release("0.33.0", "0.33.0", False, bytes | int),
)

# ---------------------------------------------------------------------------------------------
# The sample batch (one for every layout; each layout keeps the fields it has)
# ---------------------------------------------------------------------------------------------

REQUIRED_VALUES = {sample.name: sample.values for sample in SAMPLES if sample.fill}
"""The values the release fixtures' samples set (``stored_int``: its four required fields)."""
NO_OPTIONAL_VALUES = dict.fromkeys(OPTIONAL_VALUES)
"""Every field past the required ones, nil."""

SAMPLE_EVENTS: tuple[tuple[str, dict[str, Any]], ...] = (
    # Int hashes; every optional field set.
    ("BlockStored", {**REQUIRED_VALUES["stored_int"], **OPTIONAL_VALUES}),
    # Negative (legacy builtin hash()) ints; every optional field nil.
    ("BlockStored", {**REQUIRED_VALUES["stored_negative"], **NO_OPTIONAL_VALUES}),
    # Raw 32-byte digests (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 / offload tiers); a mix.
    (
        "BlockStored",
        {
            **REQUIRED_VALUES["stored_bytes"],
            **NO_OPTIONAL_VALUES,
            "lora_id": 0,
            "medium": "CPU",
            "extra_keys": [None, ["salt-2"]],
            "group_idx": 1,
            "kv_cache_spec_kind": "sliding_window",
            "locality": "REMOTE",
        },
    ),
    (
        "BlockRemoved",
        {
            "block_hashes": [U64_A],
            "medium": "GPU",
            "group_idx": 0,
            "locality": "LOCAL",
            "ownership": "kvcr",
        },
    ),
    (
        "BlockRemoved",
        {
            "block_hashes": [-42, -1],
            "medium": None,
            "group_idx": None,
            "locality": None,
            "ownership": None,
        },
    ),
    (
        "BlockRemoved",
        {
            "block_hashes": [SHA_A, SHA_B],
            "medium": "CPU",
            "group_idx": 2,
            "locality": "REMOTE",
            "ownership": None,
        },
    ),
    ("AllBlocksCleared", {}),
)

# ---------------------------------------------------------------------------------------------
# Building vLLM's classes for one release
# ---------------------------------------------------------------------------------------------


def version_key(version: str) -> tuple[int, ...]:
    """``"0.10.1.1"`` -> ``(0, 10, 1, 1)``; a non-numeric part (``x``) sorts after every number."""
    return tuple(int(part) if part.isdigit() else 10**6 for part in version.split("."))


def fields_of(struct: str, release: Release) -> tuple[Field, ...]:
    return tuple(f for f in FIELDS[struct] if version_key(f.added) <= version_key(release.first))


def _resolve(annotation: Any, release: Release) -> Any:
    """Substitute the release's hash type for ``Hash``."""
    return (
        annotation[release.hash_type] if getattr(annotation, "__parameters__", ()) else annotation
    )


def _spec(field: Field, release: Release) -> tuple[Any, ...]:
    if field.default is REQUIRED:
        return (field.name, _resolve(field.type, release))
    return (field.name, _resolve(field.type, release), field.default)


def declare(release: Release) -> dict[str, type[msgspec.Struct]]:
    """The classes of ``vllm/distributed/kv_events.py`` of ``release``.

    Equivalent to::

        class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
            ts: float
            events: list[Any]
            data_parallel_rank: int | None = None          # 0.9.1+

        class KVCacheEvent(msgspec.Struct, array_like=True,  # array_like up to 0.23.x only
                           omit_defaults=True, gc=False, tag=True): ...

        class BlockStored(KVCacheEvent): ...               # fields of FIELDS["BlockStored"]
        class BlockRemoved(KVCacheEvent): ...
        class AllBlocksCleared(KVCacheEvent): pass
    """
    batch = msgspec.defstruct(
        "EventBatch",
        [_spec(f, release) for f in fields_of("EventBatch", release)],
        array_like=True,
        omit_defaults=True,
        gc=False,
    )
    base = msgspec.defstruct(
        "KVCacheEvent",
        [],
        array_like=release.events_array_like,
        omit_defaults=True,
        gc=False,
        tag=True,
    )
    classes: dict[str, type[msgspec.Struct]] = {"EventBatch": batch}
    for name in ("BlockStored", "BlockRemoved", "AllBlocksCleared"):
        classes[name] = msgspec.defstruct(
            name, [_spec(f, release) for f in fields_of(name, release)], bases=(base,)
        )
    return classes


# ---------------------------------------------------------------------------------------------
# Self-check: the declarations reproduce the fact sheet's test vectors (section 13)
# ---------------------------------------------------------------------------------------------

# Copied verbatim from the fact sheet, section 13.
_REMOVED_MAP = (
    "84a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391cfb9807785afee48bba66d6564"
    "69756da3475055a967726f75705f69647800"
)
_REMOVED_ARRAY = "94ac426c6f636b52656d6f76656491cfb9807785afee48bba347505500"
_REMOVED_MAP_BYTES = (
    "84a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391c420ca978112ca1bbdcafac231"
    "b39a23dc4da786eff8147c4e72b9807785afee48bba66d656469756da3475055a967726f75705f69647800"
)
_CLEARED_MAP = "81a474797065b0416c6c426c6f636b73436c6561726564"
_CLEARED_ARRAY = "91b0416c6c426c6f636b73436c6561726564"
_STORED_MAP = (
    "de000ba474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cfb9807785afee48bbcfcb73"
    "eeaed59c009db1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473980102030405060708aa62"
    "6c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0aa65787472"
    "615f6b65797392c0c0a967726f75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c6c5f61"
    "7474656e74696f6e"
)
_STORED_ARRAY = (
    "9cab426c6f636b53746f72656492cfb9807785afee48bbcfcb73eeaed59c009dc098010203040506070804c0a347"
    "5055c092c0c000ae66756c6c5f617474656e74696f6ec0"
)
_BATCH_ARRAY = (
    "93cb41d954fc40200000929cab426c6f636b53746f72656492cfb9807785afee48bbcfcb73eeaed59c009dc09801"
    "0203040506070804c0a3475055c092c0c000ae66756c6c5f617474656e74696f6ec094ac426c6f636b52656d6f76"
    "656491cfb9807785afee48bba34750550000"
)
_PLACEHOLDER = (
    "de0009a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391cfcb73eeaed59c009db17061"
    "72656e745f626c6f636b5f68617368c0a9746f6b656e5f69647390aa626c6f636b5f73697a6500a76c6f72615f69"
    "64c0a66d656469756da3435055a96c6f72615f6e616d65c0a967726f75705f69647800"
)
_VECTOR_REMOVED = {"block_hashes": [U64_A], "medium": "GPU", "group_idx": 0}
_VECTOR_STORED = {
    **REQUIRED_VALUES["stored_int"],
    "lora_id": None,
    "medium": "GPU",
    "lora_name": None,
    "extra_keys": [None, None],
    "group_idx": 0,
    "kv_cache_spec_kind": "full_attention",
}
_VECTOR_PLACEHOLDER = {
    "block_hashes": [U64_B],
    "parent_block_hash": None,
    "token_ids": [],
    "block_size": 0,
    "lora_id": None,
    "medium": "CPU",
    "lora_name": None,
    "group_idx": 0,
}
FACT_SHEET_VECTORS: tuple[tuple[str, str, str, dict[str, Any]], ...] = (
    # (release whose classes encode it, event tag, expected hex, field values)
    ("0.33.0", "BlockRemoved", _REMOVED_MAP, _VECTOR_REMOVED),
    ("0.22.0", "BlockRemoved", _REMOVED_ARRAY, _VECTOR_REMOVED),
    ("0.33.0", "BlockRemoved", _REMOVED_MAP_BYTES, {**_VECTOR_REMOVED, "block_hashes": [SHA_A]}),
    ("0.33.0", "AllBlocksCleared", _CLEARED_MAP, {}),
    ("0.22.0", "AllBlocksCleared", _CLEARED_ARRAY, {}),
    ("0.33.0", "BlockStored", _STORED_MAP, _VECTOR_STORED),
    ("0.22.0", "BlockStored", _STORED_ARRAY, _VECTOR_STORED),
    ("0.33.0", "BlockStored", _PLACEHOLDER, _VECTOR_PLACEHOLDER),
)
BATCH_VECTOR = _BATCH_ARRAY
"""Array-era batch (0.22-0.23): ``[1700000000.5, [the BlockStored, the BlockRemoved], 0]``."""


def release_named(first: str) -> Release:
    return next(r for r in RELEASES if r.first == first)


def check_vectors() -> None:
    """Fail unless the re-declared classes write the fact sheet's bytes exactly."""
    encoder = msgspec.msgpack.Encoder()
    for first, tag, expected, values in FACT_SHEET_VECTORS:
        event = declare(release_named(first))[tag](**values)
        actual = encoder.encode(event).hex()
        if actual != expected:
            raise SystemExit(f"{tag} with the {first} classes:\n {actual}\n!= {expected}")
    classes = declare(release_named("0.22.0"))
    events = [classes["BlockStored"](**_VECTOR_STORED), classes["BlockRemoved"](**_VECTOR_REMOVED)]
    actual = encoder.encode(classes["EventBatch"](1700000000.5, events, 0)).hex()
    if actual != BATCH_VECTOR:
        raise SystemExit(f"batch with the 0.22.0 classes:\n {actual}\n!= {BATCH_VECTOR}")


# ---------------------------------------------------------------------------------------------
# Writing the fixtures
# ---------------------------------------------------------------------------------------------


def build(release: Release) -> tuple[bytes, dict[str, Any]]:
    classes = declare(release)
    batch_fields = [f.name for f in fields_of("EventBatch", release)]
    events = []
    expected_events = []
    for tag, values in SAMPLE_EVENTS:
        names = [f.name for f in fields_of(tag, release)]
        events.append(classes[tag](**{name: values[name] for name in names}))
        expected_events.append({"type": tag, **{name: to_json(values[name]) for name in names}})
    batch_values: dict[str, Any] = {"ts": TS, "events": events, "data_parallel_rank": DP_RANK}
    batch = classes["EventBatch"](**{name: batch_values[name] for name in batch_fields})
    payload = msgspec.msgpack.Encoder().encode(batch)
    expected = {
        "releases": {"first": release.first, "last": release.last},
        "event_encoding": "array" if release.events_array_like else "map",
        "batch_fields": batch_fields,
        "stored_fields": [f.name for f in fields_of("BlockStored", release)],
        "removed_fields": [f.name for f in fields_of("BlockRemoved", release)],
        "msgspec": msgspec.__version__,
        "payload_bytes": len(payload),
        "ts": TS,
        "data_parallel_rank": DP_RANK if "data_parallel_rank" in batch_fields else None,
        "events": expected_events,
    }
    return payload, expected


def main(argv: list[str]) -> int:
    root = Path(__file__).resolve().parent.parent
    out = Path(argv[1]) if len(argv) > 1 else root / "tests" / "fixtures" / "layouts"
    check_vectors()
    out.mkdir(parents=True, exist_ok=True)
    for release in RELEASES:
        payload, expected = build(release)
        stem = f"vllm-{release.first}"
        (out / f"{stem}.msgpack").write_bytes(payload)
        (out / f"{stem}.json").write_text(json.dumps(expected, indent=2) + "\n")
        print(f"{stem}.msgpack  {release.first}-{release.last}  {len(payload)} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
