"""vLLM's default block hashing (``sha256``), so that simulated engines publish the hashes of a
real vLLM 0.29+ engine for the same tokens (docs/simulator.md, "Block hashes").

Pickle only serialises the engine's own tuples before hashing, as vLLM does; nothing is ever
unpickled.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from typing import Final

from kvbridge.normalizers.hashing import engine_hash_u64
from kvbridge.schemas.vllm import BlockHash

__all__ = [
    "DEFAULT_HASH_SEED",
    "block_digests",
    "block_hashes",
    "checked_token_ids",
    "none_hash",
    "published_hash",
    "sha256",
]

DEFAULT_HASH_SEED: Final = "vllm-none-hash"
"""The seed of vLLM 0.29+'s NONE_HASH for sha256 when ``PYTHONHASHSEED`` is not set."""

_MAX_TOKEN: Final = 0xFFFF_FFFF


def sha256(value: object) -> bytes:
    """vLLM's ``sha256`` hash function: SHA-256 of the pickled value (highest protocol)."""
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def none_hash(seed: bytes | str | None = None) -> bytes:
    """vLLM's ``NONE_HASH``, the parent of block 0: :func:`sha256` of the seed. ``None`` is
    vLLM 0.29+'s default; another seed plays ``PYTHONHASHSEED``, for engines that disagree."""
    return sha256(DEFAULT_HASH_SEED if seed is None else seed)


def block_digests(
    tokens: Sequence[int],
    block_size: int,
    root: bytes,
    *,
    parent: bytes | None = None,
    start: int = 0,
    cache_salt: str | None = None,
) -> list[bytes]:
    """The digests of the full blocks of ``tokens`` from block ``start`` on, chained from
    ``parent`` (``root``, a :func:`none_hash`, for block 0).

    Block ``i`` hashes ``(digest of block i-1, tuple(tokens of block i), extra keys)``; the
    extra keys are ``None`` but for block 0 of a salted request, whose are ``(cache_salt,)``
    (vLLM's ``generate_block_hash_extra_keys``).
    """
    digests: list[bytes] = []
    for begin in range(start * block_size, len(tokens) - block_size + 1, block_size):
        extra = (cache_salt,) if cache_salt is not None and begin == 0 else None
        parent = sha256(
            (root if parent is None else parent, tuple(tokens[begin : begin + block_size]), extra)
        )
        digests.append(parent)
    return digests


def block_hashes(
    tokens: Sequence[int],
    block_size: int,
    *,
    seed: bytes | str | None = None,
    cache_salt: str | None = None,
    as_bytes: bool = False,
) -> list[BlockHash]:
    """The hashes an engine seeded with ``seed`` publishes for the full blocks of ``tokens``
    (:func:`block_digests` from :func:`none_hash`, in :func:`published_hash` form), for streams
    written by hand."""
    root = none_hash(seed)
    digests = block_digests(tokens, block_size, root, cache_salt=cache_salt)
    return [published_hash(digest, as_bytes=as_bytes) for digest in digests]


def published_hash(digest: bytes, *, as_bytes: bool) -> BlockHash:
    """A digest as an engine publishes it: the 32 bytes (vLLM with
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``), or by default its last 8 bytes as a big-endian
    u64."""
    return digest if as_bytes else engine_hash_u64(digest)


def checked_token_ids(values: Sequence[int]) -> list[int]:
    """``values`` as a list, checked to be token ids (ints in ``[0, 2**32)``, as vLLM and
    Dynamo keep them), so that a bad prompt fails where it is given.

    Raises:
        ValueError: a value is not a u32 int.
    """
    tokens = list(values)
    for token in tokens:
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token <= _MAX_TOKEN:
            raise ValueError(f"token ids must be ints in [0, 2**32), got {token!r}")
    return tokens
