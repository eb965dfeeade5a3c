"""The back-off after failures in a row, written once for whoever retries: a source's replay
endpoint, a router's relay."""

from __future__ import annotations

__all__ = ["doubling_backoff_s"]


def doubling_backoff_s(first_s: float, failures: int, max_s: float) -> float:
    """The wait after ``failures`` (>= 1) failures in a row: ``first_s``, doubled after each
    further one, up to ``max_s`` (past 16 doublings no larger powers are taken)."""
    return min(max_s, first_s * 2.0 ** min(failures - 1, 16))
