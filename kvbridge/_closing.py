"""``with`` for the classes that own sockets, threads or files and have a ``close()``.

Each of them is used as a context manager that closes it on the way out, whatever happened
inside; this base is that protocol, written once.
"""

from __future__ import annotations

from typing import Self

__all__ = ["ClosedOnExit"]


class ClosedOnExit:
    """A context manager that returns itself on entry and calls :meth:`close` on exit."""

    def close(self) -> None:
        """Release what the object owns; subclasses define it (idempotent)."""
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
