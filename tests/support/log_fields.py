"""What a test reads of the log lines structlog's ``capture_logs`` caught."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["log_fields"]


def log_fields(logs: Iterable[Mapping[str, Any]], event: str, *keys: str) -> list[tuple[Any, ...]]:
    """The values of ``keys`` in each line of ``event``, in order."""
    return [tuple(line[key] for key in keys) for line in logs if line["event"] == event]
