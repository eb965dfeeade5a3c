"""The token ids of a stored chain of blocks, packed: four bytes a token instead of a Python int.

A ``TieredEvent`` of a 64-block store at block size 16 holds 1,024 token ids. As a list they
cost a pointer and an int object each (about 36 bytes a token) and one allocation each when the
event is built; packed they cost 4 bytes and msgspec builds them with one copy. They are read
rarely (a consumer that re-hashes, a test), so reads may cost a little more.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import overload

import msgspec

__all__ = ["TokenIds"]

_ITEM = "I"
"""The array type code of an unsigned 32-bit integer (``unsigned int``, 4 bytes on every
platform CPython builds kvbridge's core for)."""

_SWAP = sys.byteorder != "little"
"""The packed form is little-endian; a big-endian host swaps each id on the way in and out."""


def _count(packed: bytes) -> int:
    """The ids in ``packed``; raises ``ValueError`` if it is not whole 4-byte ids."""
    count, rest = divmod(len(packed), 4)
    if rest:
        raise ValueError(f"TokenIds: {len(packed)} packed bytes are not whole 4-byte ids")
    return count


def _unpacked(packed: bytes) -> array[int]:
    _count(packed)
    ids = array(_ITEM, packed)
    if _SWAP:
        ids.byteswap()
    return ids


class TokenIds(msgspec.Struct, frozen=True, gc=False):
    """An immutable sequence of token ids (unsigned 32-bit), packed little-endian.

    It compares equal to a list or tuple of the same ints, and hashes as that tuple does.
    msgspec encodes it as ``{"packed": <bytes>}`` and decodes that form back, so ``TieredEvent``
    values round-trip; :meth:`tolist` gives the plain list (for JSON, say). A map, not an
    array, so that ``TokenIds | list[int]`` is a union msgspec decodes: events written with
    plain lists still decode, as lists.

    ``gc=False``: it holds one ``bytes`` and can be part of no reference cycle.
    """

    packed: bytes
    """The ids as unsigned 32-bit little-endian integers, 4 bytes each."""

    @classmethod
    def of(cls, ids: Iterable[int]) -> TokenIds:
        """The packed form of ``ids``; raises ``OverflowError`` for an id outside 0..2**32-1.
        (Built by appending, so that ``bytes`` are taken as the ints they iterate, not as
        machine words.)"""
        packed = array(_ITEM)
        packed.extend(ids)
        if _SWAP:
            packed.byteswap()
        return cls(packed.tobytes())

    def tolist(self) -> list[int]:
        """The ids as a list of ints."""
        return _unpacked(self.packed).tolist()

    def __len__(self) -> int:
        return _count(self.packed)

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> TokenIds: ...

    def __getitem__(self, index: int | slice) -> int | TokenIds:
        if isinstance(index, slice):
            return TokenIds.of(_unpacked(self.packed)[index])
        return _unpacked(self.packed)[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self.tolist())

    def __contains__(self, value: object) -> bool:
        return value in self.tolist()

    def __reversed__(self) -> Iterator[int]:
        return reversed(self.tolist())

    def index(self, value: int, start: int = 0, stop: int = sys.maxsize) -> int:
        """The position of the first ``value`` in ``[start, stop)``, as ``list.index``."""
        return self.tolist().index(value, start, stop)

    def count(self, value: int) -> int:
        """How many times ``value`` occurs."""
        return self.tolist().count(value)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenIds):
            return self.packed == other.packed
        if isinstance(other, list | tuple):
            return len(other) == len(self) and self.tolist() == list(other)
        return NotImplemented

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    def __hash__(self) -> int:
        return hash(tuple(self.tolist()))

    def __repr__(self) -> str:
        return f"TokenIds({self.tolist()!r})"


Sequence.register(TokenIds)

EMPTY = TokenIds(b"")
"""No token ids: what removals and clears carry, shared since it cannot change."""
