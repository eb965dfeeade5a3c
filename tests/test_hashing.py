"""Dynamo hashing parity: kvbridge's hashes against the real ``ai-dynamo-runtime`` binary.

* ``tokens_hashes`` against ``dynamo.llm.compute_block_hash_for_seq`` on seeded random inputs
  (block sizes 1..64, u32 tokens, partial blocks, LoRA names, cache salts, multimodal hashes);
* ``sequence_hashes`` against the ``sequence_hashes`` a real ``SelectionService`` reports from
  ``select_and_reserve`` (signed i64 there, unsigned here);
* ``engine_hash_u64`` and the documented test vectors.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import xxhash
from dynamo.llm import SelectionService, compute_block_hash_for_seq

from kvbridge.normalizers.hashing import (
    DYNAMO_SEED,
    block_seed,
    engine_hash_u64,
    pack_tokens,
    prompt_hashes,
    sequence_hash,
    sequence_hashes,
    tokens_hash,
    tokens_hashes,
)

U64 = 2**64 - 1
U32 = 2**32 - 1
CASES = 1200
SERVICE_CASES = 1200
SERVICE_BLOCK_SIZES = (1, 2, 3, 4, 5, 7, 8, 13, 16, 31, 32, 33, 48, 63, 64)

LORAS: tuple[str | None, ...] = (None, "", "my-lora", "adapter_v2-ÄÖÜ", "ロラ-日本語", "😀 lora")
SALTS: tuple[str | None, ...] = (None, "", "tenantA", "dynamo-cache-salt:x", "sälz-多", "0")


@dataclass
class Case:
    tokens: list[int]
    block_size: int
    lora_name: str | None = None
    cache_salt: str | None = None
    mm_hashes: list[list[int]] = field(default_factory=list)
    """Per block (possibly empty); may be shorter than the block count."""

    @property
    def block_mm_infos(self) -> list[dict[str, Any] | None] | None:
        """The binary's form: one entry per block, ``None`` or ``{"mm_objects": [...]}``."""
        if not self.mm_hashes:
            return None
        return [
            {"mm_objects": [{"mm_hash": h, "offsets": [[0, 1]]} for h in hashes]}
            if hashes
            else None
            for hashes in self.mm_hashes
        ]

    def expected(self) -> list[int]:
        return tokens_hashes(
            self.tokens,
            self.block_size,
            lora_name=self.lora_name,
            cache_salt=self.cache_salt,
            mm_hashes=self.mm_hashes,
        )


def _token(rng: random.Random) -> int:
    kind = rng.random()
    if kind < 0.05:
        return rng.choice((0, 1, U32, U32 - 1, 2**31, 2**31 - 1, 2**16, 2**24))
    if kind < 0.5:
        return rng.randrange(200_000)
    return rng.getrandbits(32)


def _mm_hash(rng: random.Random) -> int:
    if rng.random() < 0.1:
        return rng.choice((0, 1, U64, U64 - 1, 2**63, 2**63 - 1))
    return rng.getrandbits(64)


def random_case(rng: random.Random, index: int, block_sizes: tuple[int, ...]) -> Case:
    block_size = block_sizes[index % len(block_sizes)]
    blocks = rng.randrange(0, 7)
    partial = rng.randrange(block_size) if rng.random() < 0.5 else 0
    tokens = [_token(rng) for _ in range(blocks * block_size + partial)]
    lora_name = LORAS[index % len(LORAS)] if rng.random() < 0.7 else None
    cache_salt = SALTS[(index // len(LORAS)) % len(SALTS)] if rng.random() < 0.7 else None
    if rng.random() < 0.15:  # random printable strings too
        lora_name = "".join(chr(rng.randrange(32, 0x3000)) for _ in range(rng.randrange(1, 12)))
    if rng.random() < 0.15:
        cache_salt = "".join(chr(rng.randrange(32, 0x3000)) for _ in range(rng.randrange(1, 12)))
    mm_hashes: list[list[int]] = []
    if blocks and rng.random() < 0.35:
        # Several unsorted hashes per block, some blocks without, sometimes fewer entries than
        # blocks; duplicates allowed.
        for _ in range(rng.randrange(1, blocks + 1)):
            if rng.random() < 0.3:
                mm_hashes.append([])
            else:
                hashes = [_mm_hash(rng) for _ in range(rng.randrange(1, 5))]
                if rng.random() < 0.1:
                    hashes.append(hashes[0])
                mm_hashes.append(hashes)
        if not any(mm_hashes):
            mm_hashes[0] = [_mm_hash(rng), _mm_hash(rng)]
    return Case(tokens, block_size, lora_name, cache_salt, mm_hashes)


def _cases(seed: int, count: int, block_sizes: tuple[int, ...]) -> list[Case]:
    rng = random.Random(seed)
    return [random_case(rng, index, block_sizes) for index in range(count)]


# -- tokens_hash against compute_block_hash_for_seq --------------------------------------------


def test_tokens_hashes_match_compute_block_hash_for_seq() -> None:
    cases = _cases(20260101, CASES, tuple(range(1, 65)))
    mismatches = []
    for case in cases:
        actual = compute_block_hash_for_seq(
            case.tokens,
            case.block_size,
            block_mm_infos=case.block_mm_infos,
            lora_name=case.lora_name,
            cache_namespace=case.cache_salt,
        )
        expected = case.expected()
        if actual != expected:
            mismatches.append((case, actual, expected))
    assert not mismatches, mismatches[:3]

    # The generator really covered what it claims to.
    assert {case.block_size for case in cases} == set(range(1, 65))
    assert any(len(case.tokens) % case.block_size for case in cases)
    assert any(len(case.tokens) < case.block_size for case in cases)
    assert any(U32 in case.tokens for case in cases)
    assert {case.lora_name for case in cases} >= set(LORAS)
    assert {case.cache_salt for case in cases} >= set(SALTS)
    with_mm = [case for case in cases if case.mm_hashes]
    assert len(with_mm) > 100
    assert any(any(len(h) > 1 and h != sorted(h) for h in case.mm_hashes) for case in with_mm)
    assert any(U64 in h for case in with_mm for h in case.mm_hashes)


def test_multimodal_hashes_are_sorted_and_offsets_ignored() -> None:
    tokens = list(range(16))
    hashes = [U64, 3, 2**63, 0]
    unsorted = compute_block_hash_for_seq(
        tokens,
        8,
        block_mm_infos=[{"mm_objects": [{"mm_hash": h, "offsets": [[0, 1]]} for h in hashes]}],
    )
    other_order = compute_block_hash_for_seq(
        tokens,
        8,
        block_mm_infos=[
            {
                "mm_objects": [
                    {"mm_hash": h, "offsets": [[i, i + 3], [5, 8]]}
                    for i, h in reversed(list(enumerate(hashes)))
                ]
            },
            None,
        ],
    )
    ours = tokens_hashes(tokens, 8, mm_hashes=[hashes])
    assert ours == unsorted
    assert ours[0] == other_order[0]
    assert ours == tokens_hashes(tokens, 8, mm_hashes=[sorted(hashes), []])
    # An mm object changes its block only, and an empty list is the same as none.
    plain = tokens_hashes(tokens, 8)
    assert ours[0] != plain[0] and ours[1] == plain[1]
    assert tokens_hashes(tokens, 8, mm_hashes=[[], []]) == plain


def test_out_of_range_tokens_rejected_like_dynamo() -> None:
    for bad in ([U32 + 1], [-1]):
        with pytest.raises(OverflowError):
            compute_block_hash_for_seq(bad, 1)
        with pytest.raises(OverflowError):
            tokens_hashes(bad, 1)
    with pytest.raises(ValueError):
        compute_block_hash_for_seq([1], 0)
    with pytest.raises(ValueError):
        tokens_hashes([1], 0)


def test_seed_terms() -> None:
    assert block_seed() == DYNAMO_SEED == 1337
    assert block_seed("", "") == 1337
    lora = xxhash.xxh3_64_intdigest(b"my-lora", 0)
    salt = xxhash.xxh3_64_intdigest(b"tenantA", 1)
    assert block_seed("my-lora") == 1337 + lora
    assert block_seed(cache_salt="tenantA") == 1337 + salt
    assert block_seed("my-lora", "tenantA") == (1337 + lora + salt) & U64
    # The salt term differs from the LoRA term for the same string (seed 1 vs 0).
    assert block_seed("x") != block_seed(cache_salt="x")
    assert tokens_hash(pack_tokens([1, 2, 3, 4]), 1337) == 14643705804678351452


# -- the rolling sequence hash against the SelectionService -------------------------------------


async def _reserve_all(cases: list[Case]) -> list[list[int]]:
    service = SelectionService()
    try:
        for block_size in sorted({case.block_size for case in cases}):
            await service.upsert_worker(
                {
                    "worker_id": 1000 + block_size,
                    "model_name": f"bs{block_size}",
                    "endpoint": f"http://bs{block_size}",
                    "block_size": block_size,
                    "kv_events_endpoint": "tcp://127.0.0.1:1",
                }
            )
        results = []
        for case in cases:
            request: dict[str, Any] = {
                "model_name": f"bs{case.block_size}",
                "token_ids": case.tokens,
            }
            if case.lora_name is not None:
                request["lora_name"] = case.lora_name
            if case.cache_salt is not None:
                request["cache_salt"] = case.cache_salt
            if case.block_mm_infos is not None:
                request["block_mm_infos"] = case.block_mm_infos
            result = await asyncio.wait_for(service.select_and_reserve(request), 5)
            assert result["worker_id"] == 1000 + case.block_size
            assert result["block_size"] == case.block_size
            results.append(list(result["sequence_hashes"]))
            await asyncio.wait_for(service.free_reservation(result["selection_id"]), 5)
        return results
    finally:
        service.shutdown()


@dataclass
class ServiceRun:
    cases: list[Case]
    reported: list[list[int]]


@pytest.fixture(scope="module")
def service_run() -> Iterator[ServiceRun]:
    cases = _cases(7, SERVICE_CASES, SERVICE_BLOCK_SIZES)
    cases = [case for case in cases if case.tokens]  # an empty prompt is not a request
    reported = asyncio.run(_reserve_all(cases))
    yield ServiceRun(cases, reported)


def test_sequence_hashes_match_selection_service(service_run: ServiceRun) -> None:
    assert len(service_run.cases) >= 1000
    mismatches = []
    for case, reported in zip(service_run.cases, service_run.reported, strict=True):
        unsigned = [value & U64 for value in reported]
        expected = sequence_hashes(case.expected())
        if unsigned != expected:
            mismatches.append((case, unsigned, expected))
    assert not mismatches, mismatches[:3]
    flat = [value for reported in service_run.reported for value in reported]
    assert any(value < 0 for value in flat), "signed i64 conversion never exercised"
    assert sum(1 for case in service_run.cases if len(case.tokens) // case.block_size >= 3) > 300
    assert any(case.mm_hashes for case in service_run.cases)


def test_prompt_hashes_are_what_the_selection_service_reports(service_run: ServiceRun) -> None:
    """The precomputed form a router sends: each block's tokens_hash and sequence hash as signed
    i64, in one call to the core; its sequence hashes are the service's own for the same tokens
    and LoRA name, whether the ids come as a list or packed in an ``array("I")``."""
    plain = [
        (case, reported)
        for case, reported in zip(service_run.cases, service_run.reported, strict=True)
        if not case.cache_salt and not case.mm_hashes
    ]
    assert len(plain) > 200
    assert any(case.lora_name for case, _ in plain)
    for case, reported in plain:
        blocks, sequence = prompt_hashes(case.tokens, case.block_size, lora_name=case.lora_name)
        assert sequence == reported, case
        assert [value & U64 for value in blocks] == case.expected(), case
        packed = prompt_hashes(array("I", case.tokens), case.block_size, lora_name=case.lora_name)
        assert packed == (blocks, sequence)
    assert any(value < 0 for _, reported in plain for value in reported)
    with pytest.raises(ValueError, match="block_size must be positive, got 0"):
        prompt_hashes([1, 2], 0)


def test_selection_service_hashes_follow_lora_and_salt(service_run: ServiceRun) -> None:
    """The service folds LoRA and salt in exactly as ``tokens_hashes`` does: a non-empty one
    changes every sequence hash, an empty one changes nothing."""
    changed = unchanged = 0
    for case, reported in zip(service_run.cases, service_run.reported, strict=True):
        if not reported:
            continue
        plain = sequence_hashes(
            tokens_hashes(case.tokens, case.block_size, mm_hashes=case.mm_hashes)
        )
        unsigned = [value & U64 for value in reported]
        if case.lora_name or case.cache_salt:
            assert all(a != b for a, b in zip(unsigned, plain, strict=True)), case
            changed += 1
        else:
            assert unsigned == plain, case
            unchanged += 1
        lora_only = sequence_hashes(
            tokens_hashes(
                case.tokens, case.block_size, lora_name=case.lora_name, mm_hashes=case.mm_hashes
            )
        )
        if case.cache_salt and unsigned == lora_only:
            pytest.fail(f"cache_salt ignored by the service for {case}")
    assert changed > 500 and unchanged > 50
    assert any(case.lora_name and not case.cache_salt for case in service_run.cases)
    assert any(case.cache_salt and not case.lora_name for case in service_run.cases)
    assert any(case.lora_name == "" or case.cache_salt == "" for case in service_run.cases)


# -- engine hashes -----------------------------------------------------------------------------


def test_engine_hash_u64_documented_vectors() -> None:
    assert engine_hash_u64(hashlib.sha256(b"a").digest()) == 13366815110101616827
    assert engine_hash_u64(hashlib.sha256(b"b").digest()) == 14660323646696587421
    digest = hashlib.sha256(b"a").digest()
    assert engine_hash_u64(digest) == int.from_bytes(digest, "big") % 2**64
    assert engine_hash_u64(digest) == int.from_bytes(digest[24:], "big")
    assert digest[24:].hex() == "b9807785afee48bb"


def test_engine_hash_u64_ints() -> None:
    assert engine_hash_u64(0) == 0
    assert engine_hash_u64(5) == 5
    assert engine_hash_u64(U64) == U64
    assert engine_hash_u64(-1) == U64
    assert engine_hash_u64(-5) == 2**64 - 5
    assert engine_hash_u64(-(2**63)) == 2**63
    assert engine_hash_u64(2**64) == 0
    assert engine_hash_u64(2**64 + 7) == 7
    assert engine_hash_u64(2**200 + 2**64 + 9) == 9
    rng = random.Random(3)
    for _ in range(200):
        value = rng.getrandbits(256) - 2**255
        assert engine_hash_u64(value) == value % 2**64


def test_engine_hash_u64_xxhash_digests() -> None:
    """16-byte XXH3-128 digests (vLLM's xxhash / xxhash_cbor) keep their low 64 bits."""
    rng = random.Random(11)
    for _ in range(200):
        data = rng.randbytes(rng.randrange(64))
        digest = xxhash.xxh3_128_digest(data)
        assert len(digest) == 16
        expected = xxhash.xxh3_128_intdigest(data) & U64
        assert engine_hash_u64(digest) == expected
        assert engine_hash_u64(digest) == int.from_bytes(digest, "big") % 2**64
    # Bytes and the equivalent int agree, whichever mode vLLM publishes in.
    digest = hashlib.sha256(b"block").digest()
    assert engine_hash_u64(digest) == engine_hash_u64(int.from_bytes(digest, "big"))


# -- documented test vectors -------------------------------------------------------------------


def test_documented_tokens_hash_vectors() -> None:
    assert tokens_hashes([1, 2, 3, 4], 4) == [14643705804678351452]
    assert tokens_hashes(list(range(100, 116)), 4) == [
        6320977984009303047,
        16988655349664461655,
        6717274780279712737,
        10507561201108444448,
    ]
    # A trailing partial block is dropped.
    assert tokens_hashes(list(range(100, 119)), 4) == tokens_hashes(list(range(100, 116)), 4)
    assert tokens_hashes([1, 2, 3], 4) == []
    # An empty LoRA name or salt is the same as none.
    assert tokens_hashes([1, 2, 3, 4], 4, lora_name="", cache_salt="") == [14643705804678351452]
    assert tokens_hashes([1, 2, 3, 4], 4, lora_name="x") != [14643705804678351452]


def test_documented_sequence_hash_vectors() -> None:
    hashes = tokens_hashes(list(range(100, 116)), 4)
    expected = [
        6320977984009303047,
        3184517425968952090,
        3284552213212070830,
        4799968867515202603,
    ]
    assert sequence_hashes(hashes) == expected
    assert sequence_hashes(hashes[2:], parent=expected[1]) == expected[2:]
    assert sequence_hash(None, hashes[0]) == expected[0]
    assert sequence_hash(expected[0], hashes[1]) == expected[1]
    pair = expected[0].to_bytes(8, "little") + hashes[1].to_bytes(8, "little")
    assert xxhash.xxh3_64_intdigest(pair, 1337) == expected[1]
    assert xxhash.xxh3_64_intdigest(pair, 0) != expected[1]  # seed 0 is not Dynamo's
    assert sequence_hashes([]) == []
