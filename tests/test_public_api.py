"""The public API: the names users import, and a malformed payload that changes nothing."""

from __future__ import annotations

import json
import subprocess
import sys

import msgspec
import pytest

import kvbridge
from kvbridge import (
    Normalizer,
    Overlap,
    SchemaError,
    Tier,
    TieredEvent,
    TieredIndex,
    decode_batch,
)
from kvbridge.schemas.vllm import BlockStored, VllmBatch, encode_batch, layout_for

TOKENS = list(range(100, 116))
LAYOUT = layout_for("0.32.0")


def test_public_names() -> None:
    assert {
        "decode_batch",
        "Normalizer",
        "TieredIndex",
        "Tier",
        "TieredEvent",
        "TokenIds",
        "Overlap",
        "SchemaError",
    } <= set(kvbridge.__all__)
    assert [tier.value for tier in Tier] == ["device", "host_pinned", "disk", "external"]
    assert issubclass(SchemaError, ValueError)
    assert TieredEvent.__struct_fields__[:4] == ("worker_id", "dp_rank", "tier", "event")
    assert Overlap() == Overlap(0, 0, 0)


def _valid() -> bytes:
    event = BlockStored([1, 2, 3, 4], None, TOKENS, 4, None, "GPU", None)
    return encode_batch(VllmBatch(1.0, [event], 0), LAYOUT)


def _malformed() -> dict[str, bytes]:
    wrong_type = msgspec.msgpack.decode(_valid())
    wrong_type[1][0]["block_size"] = "4"
    unknown_tag = msgspec.msgpack.decode(_valid())
    unknown_tag[1][0]["type"] = "BlockMoved"
    mismatch = msgspec.msgpack.decode(_valid())
    mismatch[1][0]["token_ids"] = TOKENS[:12]
    return {
        "truncated": _valid()[:-9],
        "wrong_type": msgspec.msgpack.encode(wrong_type),
        "unknown_tag": msgspec.msgpack.encode(unknown_tag),
        "mismatch": msgspec.msgpack.encode(mismatch),
    }


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("truncated", "batch: malformed msgpack: Input data was truncated"),
        ("wrong_type", "event 0: field 'block_size': Expected `int`, got `str`"),
        ("unknown_tag", "event 0: field 'type': Invalid value 'BlockMoved'"),
        ("mismatch", "event 0: field 'token_ids': 12 tokens cannot fill 4 blocks of 4"),
    ],
)
def test_a_malformed_payload_leaves_the_index_unchanged(kind: str, message: str) -> None:
    normalizer, index = Normalizer(1, 4), TieredIndex(4)
    index.apply(normalizer.normalize(decode_batch(_valid()), 0))
    before = (index.dump(), index.overlap(TOKENS), normalizer.stats)
    payload = _malformed()[kind]
    with pytest.raises(SchemaError) as raised:
        decode_batch(payload)
    assert str(raised.value) == message
    # The normalizer reads the payload's bytes itself: it refuses them with the same error,
    # before any of its state or the index has changed.
    with pytest.raises(SchemaError) as raised:
        index.apply(normalizer.normalize(payload, 1))
    assert str(raised.value) == message
    assert (index.dump(), index.overlap(TOKENS), normalizer.stats) == before
    assert index.overlap(TOKENS) == {(1, 0): Overlap(4, 4, 4)}


_LIGHT_IMPORT = """
import json, sys
import kvbridge
loaded = sorted(m for m in ("dynamo", "ray", "zmq", "structlog", "typing") if m in sys.modules)
names = sorted(set(kvbridge.__all__) - set(dir(kvbridge)))
index = kvbridge.TieredIndex(block_size=4)
print(json.dumps({"loaded": loaded, "missing_from_dir": names,
                  "index": type(index).__module__, "dynamo_after": "dynamo" in sys.modules}))
"""


def test_import_kvbridge_is_light() -> None:
    """``import kvbridge`` loads none of Dynamo's binary, Ray or ZMQ; the names still resolve,
    on first use."""
    result = subprocess.run(
        [sys.executable, "-c", _LIGHT_IMPORT], capture_output=True, text=True, check=True
    )
    report = json.loads(result.stdout)
    assert report == {
        "loaded": [],
        "missing_from_dir": [],
        "index": "kvbridge.adapters.tiered_index",
        "dynamo_after": True,
    }


def test_lazy_names_are_the_modules_own() -> None:
    import kvbridge.adapters.tiered_index
    import kvbridge.schemas

    assert kvbridge.Overlap is kvbridge.schemas.Overlap is kvbridge.adapters.tiered_index.Overlap
    assert kvbridge.Overlap.__module__ == "kvbridge.schemas.overlap"
    assert kvbridge.TieredIndex is kvbridge.adapters.tiered_index.TieredIndex
    assert kvbridge.decode_batch is kvbridge.schemas.decode_batch
    for name in kvbridge.__all__:
        assert getattr(kvbridge, name) is not None
    with pytest.raises(AttributeError, match="has no attribute 'Typo'"):
        kvbridge.Typo  # type: ignore[attr-defined]  # noqa: B018
