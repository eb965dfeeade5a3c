"""``with`` for the classes that own sockets, threads or files and have a ``close()``.

Each of them is used as a context manager that closes it on the way out, whatever happened
inside; this base is that protocol, written once.
"""

from __future__ import annotations

from types import TracebackType
from typing import Self

__all__ = ["ClosedOnExit"]


class ClosedOnExit:
    """A context manager that returns itself on entry and calls :meth:`close` on exit.

    If the body raised, that error is the one that leaves: a failure to close after it (a
    capture's last flush to the same full disk, say) goes with it as a note, not in its place.
    """

    def close(self) -> None:
        """Release what the object owns; subclasses define it (idempotent)."""
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except Exception as error:
            exc.add_note(f"closing {type(self).__name__} failed too: {error}")
