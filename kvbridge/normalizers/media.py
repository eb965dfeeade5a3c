"""vLLM's ``medium`` strings mapped to Dynamo's storage tiers, without regard to case."""

from __future__ import annotations

from typing import Final

from kvbridge.schemas.tiers import Tier

__all__ = ["MEDIA", "tier_for_medium"]

MEDIA: Final[dict[str, Tier]] = {
    **dict.fromkeys(("", "GPU", "DEVICE"), Tier.DEVICE),
    **dict.fromkeys(("CPU", "CPU_PINNED", "CPU_TIER1"), Tier.HOST_PINNED),
    **dict.fromkeys(("DISK", "NVME", "STORAGE", "FS", "OBJ", "CPU_TIER2"), Tier.DISK),
    **dict.fromkeys(("EXTERNAL", "NETWORK", "REMOTE", "SHARED"), Tier.EXTERNAL),
}
"""Every medium kvbridge understands, upper case. ``FS`` and ``OBJ`` are vLLM 0.26.0's names
for what later releases call ``STORAGE``; Mooncake and LMCache send lower-case ``cpu``."""


def tier_for_medium(medium: str | None) -> Tier | None:
    """The tier of a medium, or ``None`` for a medium nobody has defined (never guessed)."""
    if medium is None:
        return Tier.DEVICE
    tier = MEDIA.get(medium)
    return tier if tier is not None else MEDIA.get(medium.upper())
