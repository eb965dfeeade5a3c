"""Hashes: vLLM's engine hashes as u64, and Dynamo's tokens_hash and rolling sequence hash.

The Dynamo functions are bit for bit equal to ``dynamo.llm.compute_block_hash_for_seq`` and to
the ``sequence_hashes`` the SelectionService reports (as unsigned values); the test suite checks
that against the binary on random inputs.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Sequence
from typing import Final, cast

from kvbridge import _core

__all__ = [
    "DYNAMO_SEED",
    "block_seed",
    "engine_hash_u64",
    "engine_hashes_u64",
    "pack_tokens",
    "prompt_hashes",
    "sequence_hash",
    "sequence_hashes",
    "tokens_hash",
    "tokens_hashes",
]

DYNAMO_SEED: Final = 1337
U64_MASK: Final = 0xFFFF_FFFF_FFFF_FFFF
DYNAMO_SALT_PREFIX: Final = "dynamo-cache-salt:"
"""The prefix ``dynamo.vllm`` puts on vLLM's cache salt; Dynamo reads only prefixed salts."""


def engine_hash_u64(value: int | bytes) -> int:
    """vLLM's block hash as u64: ints masked to 64 bits, bytes by their last 8 bytes big-endian.

    This equals vLLM's own int mode for the same block (``int(digest) mod 2**64``).
    """
    if isinstance(value, int):
        return value & U64_MASK
    return int.from_bytes(value[-8:], "big")


def engine_hashes_u64(values: Sequence[int | bytes]) -> list[int]:
    """:func:`engine_hash_u64` of each value: one list comprehension when they share a form,
    as an engine's hashes do (though an offload tier may send bytes where the GPU sent ints)."""
    from_bytes = int.from_bytes
    try:
        if values and isinstance(values[0], bytes):
            return [from_bytes(value[-8:], "big") for value in cast("Sequence[bytes]", values)]
        return [value & U64_MASK for value in cast("Sequence[int]", values)]
    except TypeError:  # both forms in one list
        return [engine_hash_u64(value) for value in values]


def block_seed(lora_name: str | None = None, cache_salt: str | None = None) -> int:
    """The XXH3 seed of Dynamo's tokens_hash: 1337, plus the LoRA name and cache salt terms."""
    return _core.block_seed(lora_name, cache_salt)


def pack_tokens(token_ids: Iterable[int]) -> bytes:
    """Tokens as consecutive little-endian u32, the byte form Dynamo hashes."""
    packed = array("I")  # filled by fromlist: a quarter faster than array("I", a_list)
    packed.fromlist(token_ids if isinstance(token_ids, list) else list(token_ids))
    if sys.byteorder == "big":  # pragma: no cover - every supported host is little-endian
        packed.byteswap()
    return packed.tobytes()


def tokens_hash(block: bytes | memoryview, seed: int, mm_hashes: Sequence[int] = ()) -> int:
    """Dynamo's tokens_hash of one block given as packed tokens (see :func:`pack_tokens`)."""
    block = memoryview(block).cast("B")
    if not block or len(block) % 4:
        raise ValueError(f"a block is one or more packed u32 token ids, got {len(block)} bytes")
    return _core.tokens_hashes(block, len(block) // 4, seed, [mm_hashes])[0]


def tokens_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    mm_hashes: Sequence[Sequence[int]] = (),
) -> list[int]:
    """Dynamo's tokens_hash of each full block; a trailing partial block is dropped.

    ``mm_hashes[i]`` lists the multimodal object hashes of block ``i``. The hashing is the
    native core's, the same code that hashes the relay's blocks.
    """
    packed = _packed(token_ids, block_size)
    return _core.tokens_hashes(packed, block_size, block_seed(lora_name, cache_salt), mm_hashes)


def prompt_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> tuple[list[int], list[int]]:
    """A prompt as Dynamo's router takes it precomputed: the tokens_hash and the sequence hash
    of each full block, both as signed i64 (the same 64 bits as :func:`tokens_hashes` and
    :func:`sequence_hashes` give unsigned), in one call to the native core."""
    seed = block_seed(lora_name, cache_salt)
    return _core.prompt_hashes(_packed(token_ids, block_size), block_size, seed)


def _packed(token_ids: Sequence[int], block_size: int) -> memoryview:
    """The tokens' packed bytes, as the core hashes them in blocks of ``block_size``: an
    ``array("I")`` as it is (no copy) on a little-endian host, anything else through
    :func:`pack_tokens`."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if sys.byteorder == "little" and isinstance(token_ids, array) and token_ids.typecode == "I":
        return memoryview(token_ids).cast("B")
    return memoryview(pack_tokens(token_ids))


def sequence_hash(parent: int | None, block_tokens_hash: int) -> int:
    """One step of Dynamo's rolling sequence hash (``public-xxh3-v1``), as u64."""
    return _core.sequence_hashes([block_tokens_hash], parent)[0]


def sequence_hashes(block_tokens_hashes: Iterable[int], parent: int | None = None) -> list[int]:
    """The rolling sequence hash of every block, continuing from ``parent`` if given."""
    hashes = (
        block_tokens_hashes
        if isinstance(block_tokens_hashes, list | tuple)
        else list(block_tokens_hashes)
    )
    return _core.sequence_hashes(hashes, parent)
