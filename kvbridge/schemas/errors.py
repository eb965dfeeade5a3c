"""The one error kvbridge raises for input it cannot decode without losing meaning."""

from __future__ import annotations

__all__ = ["SchemaError"]


class SchemaError(ValueError):
    """A payload that does not follow any known vLLM layout.

    ``event_index`` and ``field`` locate the problem when it lies inside one event; both are
    ``None`` for batch-level problems such as truncated msgpack.
    """

    def __init__(self, message: str, *, event_index: int | None = None, field: str | None = None):
        super().__init__(message)
        self.event_index = event_index
        self.field = field
