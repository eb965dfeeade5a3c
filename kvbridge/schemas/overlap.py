"""The answer of an overlap query: how much of a prompt a worker holds, by tier."""

from __future__ import annotations

import msgspec

__all__ = ["Overlap"]


class Overlap(msgspec.Struct, frozen=True):
    """Leading full blocks of a prompt resident on a worker, cumulatively by tier."""

    device: int = 0
    """On the GPU."""
    host_pinned: int = 0
    """On the GPU or in host memory."""
    disk: int = 0
    """On any tier (disk and external storage included)."""
