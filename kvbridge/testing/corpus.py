"""A deterministic corpus of vLLM KV-event payloads, valid and broken, for decoder robustness.

:func:`payload_corpus` yields msgpack payloads (ZMQ frame 2) of every kind a decoder may meet:
valid batches of every layout in :data:`~kvbridge.schemas.vllm.LAYOUTS` (built with
:func:`~kvbridge.schemas.vllm.encode_batch`), the bundled fixtures, batches with fields no
release has, and broken ones: flipped, truncated, inserted and spliced bytes, integers out of
their range, values of the wrong type, invalid UTF-8, deep nesting, random msgpack values and
random bytes. The same seed and count always yield the same payloads (given the same fixture
files), so that two decoders (kvbridge's and a native one) can be run over the same corpus and
compared payload by payload.

The corpus asserts nothing: :func:`kvbridge.decode_batch` must turn each payload into a
:class:`~kvbridge.schemas.vllm.VllmBatch` or raise :class:`~kvbridge.SchemaError`, and
``tests/test_decode_robustness.py`` and ``tools/fuzz_decode.py`` check that it does.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Final

from kvbridge.schemas.vllm import (
    LAYOUTS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    VllmBatch,
    encode_batch,
)
from kvbridge.testing.corpus_mutations import (
    EDGE_INTS,
    MUTATIONS,
    encode_value,
    random_value,
    splice,
)

__all__ = [
    "KINDS",
    "base_payloads",
    "fixture_payloads",
    "labelled_corpus",
    "payload_corpus",
    "valid_payload",
]

_FIXTURES: Final = Path(__file__).resolve().parents[2] / "tests" / "fixtures"
_FIXTURE_DIRS: Final = ("layouts", "releases")

_MEDIA: Final = ("GPU", "CPU", "cpu", "DISK", "CPU_TIER2", "EXTERNAL", "HBM", None)


def fixture_payloads(root: Path | None = None) -> list[bytes]:
    """The bundled fixture payloads (``tests/fixtures/layouts`` and ``releases``), in path
    order; empty outside a source checkout."""
    root = _FIXTURES if root is None else root
    return [
        path.read_bytes()
        for directory in _FIXTURE_DIRS
        for path in sorted((root / directory).glob("*.msgpack"))
    ]


def _hash(rng: random.Random, as_bytes: bool) -> int | bytes:
    if as_bytes:
        return rng.randbytes(32 if rng.random() < 0.8 else rng.randrange(17))
    pick = rng.random()
    if pick < 0.6:
        return rng.getrandbits(64)  # u64, as from vLLM 0.10.2
    if pick < 0.9:
        return rng.getrandbits(63) - (1 << 62)  # signed, as before
    return rng.choice(EDGE_INTS)


def _tokens(rng: random.Random, count: int) -> list[int]:
    """``count`` token ids of a 152k vocabulary, with the u32 edges now and then."""
    tokens = [word % 152_064 for word in struct.unpack(f"<{count}I", rng.randbytes(4 * count))]
    if tokens and rng.random() < 0.2:
        tokens[rng.randrange(count)] = rng.choice((0, 2**32 - 1))
    return tokens


_EXTRA_KEYS: Final[tuple[Callable[[random.Random], Any], ...]] = (
    lambda rng: "adapter-1",  # a LoRA name
    lambda rng: "tenant-7",  # a cache salt
    lambda rng: rng.randbytes(32).hex(),  # a multimodal digest (up to vLLM 0.18)
    lambda rng: [rng.randbytes(32).hex(), rng.randrange(4096)],  # (identifier, offset), 0.19+
    lambda rng: rng.randbytes(32),  # a prompt-embeddings digest
    lambda rng: rng.randrange(2**31),
)


def _extra_key(rng: random.Random) -> Any:
    return rng.choice(_EXTRA_KEYS)(rng)


def _event(rng: random.Random) -> Event:
    """One event with every field set to a valid value (a layout keeps the fields it has)."""
    kind = rng.random()
    as_bytes = rng.random() < 0.4
    if kind < 0.08:
        return AllBlocksCleared()
    blocks = rng.choice((1, 1, 2, 3, 8, rng.randrange(1, 65)))
    hashes = [_hash(rng, as_bytes) for _ in range(blocks)]
    medium = rng.choice(_MEDIA)
    group = rng.choice((None, 0, 1, 2**32 - 1))
    locality = rng.choice((None, "LOCAL", "REMOTE"))
    ownership = rng.choice((None, "OWNED", "SHARED"))
    if kind < 0.4:
        return BlockRemoved(hashes, medium, group, locality, ownership)
    block_size = rng.choice((1, 4, 16, 16, 32))
    placeholder = rng.random() < 0.15
    tokens = [] if placeholder else _tokens(rng, blocks * block_size)
    extra = None
    if rng.random() < 0.3:
        extra = [[_extra_key(rng) for _ in range(rng.randrange(3))] or None for _ in hashes]
    return BlockStored(
        hashes,
        None if placeholder or rng.random() < 0.5 else _hash(rng, as_bytes),
        tokens,
        block_size,
        rng.choice((None, None, 1, 2**31 - 1)),
        medium,
        rng.choice((None, "adapter-1")),
        extra,
        group,
        rng.choice((None, "full_attention", "sliding_window", "mla_attention")),
        rng.choice((None, 128, 4096)),
        locality,
        ownership,
        rng.choice((None, "session-1")),
        rng.choice((None, [_tokens(rng, rng.randrange(4))])),
    )


def valid_payload(rng: random.Random) -> bytes:
    """A valid batch of random events in the layout of a random vLLM release."""
    layout = rng.choice(LAYOUTS)
    events = [_event(rng) for _ in range(rng.choice((0, 1, 1, 2, 3, 5, rng.randrange(1, 40))))]
    rank = rng.choice((None, 0, 0, 1, 7, 2**32 - 1))
    return encode_batch(VllmBatch(rng.random() * 2e9, events, rank), layout)


def base_payloads(seed: int = 0, built: int = 4) -> list[bytes]:
    """The valid payloads the corpus mutates: the fixtures, then ``built`` payloads built with
    ``encode_batch`` for every layout of ``LAYOUTS``."""
    rng = random.Random(seed)
    payloads = fixture_payloads()
    for layout in LAYOUTS:
        for _ in range(built):
            events = [_event(rng) for _ in range(rng.randrange(1, 8))]
            payloads.append(encode_batch(VllmBatch(1.5, events, rng.choice((None, 0, 3))), layout))
    return payloads


KINDS: Final = (
    "valid",
    "base",
    "flip",
    "truncate",
    "insert",
    "splice",
    "out_of_range",
    "wrong_type",
    "invalid_utf8",
    "deep",
    "unknown_fields",
    "shuffle_keys",
    "random_msgpack",
    "random_bytes",
)
"""The kinds of payload :func:`payload_corpus` draws from, in equal shares."""


def _one(rng: random.Random, kind: str, bases: Sequence[bytes]) -> bytes | None:
    """One payload of ``kind``, or ``None`` if the mutation drawn cannot apply."""
    if kind == "valid":
        return valid_payload(rng)
    if kind == "random_msgpack":
        return encode_value(random_value(rng))
    if kind == "random_bytes":
        return rng.randbytes(rng.choice((rng.randrange(1, 16), rng.randrange(1, 512))))
    base = rng.choice(bases) if rng.random() < 0.5 else valid_payload(rng)
    if kind == "base" or not base:
        return base
    if kind == "splice":
        return splice(rng, base, rng.choice(bases))
    return MUTATIONS[kind](rng, base)


def labelled_corpus(
    seed: int, count: int, *, bases: Sequence[bytes] | None = None
) -> Iterator[tuple[str, bytes]]:
    """:func:`payload_corpus` with the kind (one of :data:`KINDS`) of each payload."""
    rng = random.Random(seed)
    pool = list(base_payloads(seed) if bases is None else bases) or [valid_payload(rng)]
    for _ in range(count):
        kind = rng.choice(KINDS)
        payload = _one(rng, kind, pool)
        yield ("valid", valid_payload(rng)) if payload is None else (kind, payload)


def payload_corpus(
    seed: int, count: int, *, bases: Sequence[bytes] | None = None
) -> Iterator[bytes]:
    """``count`` payloads drawn from :data:`KINDS`, the same ones for the same ``seed``.

    Args:
        seed: seeds the only random generator used.
        count: how many payloads to yield.
        bases: the valid payloads to mutate; by default :func:`base_payloads` (the fixtures of
            a source checkout, then payloads built for every layout).

    A mutation that cannot apply to the payload drawn (no string to break, say) yields a valid
    payload instead, so that exactly ``count`` payloads come out.
    """
    for _, payload in labelled_corpus(seed, count, bases=bases):
        yield payload
