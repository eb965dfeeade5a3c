"""Log lines with limits: a flood of bad input must not become a flood of log output.

Every line that input can trigger once per frame (a bad frame, a gap, a lost batch) goes
through a :class:`LogLimiter`. Per key (the message and the stream it is about), at most
``burst`` lines are written in each ``period``; the rest are counted, and the first line of the
next period says how many were held back. Every value is cut to ``max_value`` characters, so a
10 MB bad tag cannot become a 10 MB line. The counts in the metrics stay exact: the limiter only
decides what is written, never what is counted.

With the defaults a line is at most about 1.5 KB, and one key writes at most 6 lines a minute.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import Any, Final

__all__ = ["DEFAULT_BURST", "DEFAULT_MAX_VALUE", "DEFAULT_PERIOD_S", "LogLimiter", "cut"]

DEFAULT_BURST: Final = 5
DEFAULT_PERIOD_S: Final = 60.0
DEFAULT_MAX_VALUE: Final = 200
MAX_KEYS: Final = 4096
"""Keys remembered at once; past it the oldest are forgotten (their next line is written)."""


def cut(value: object, limit: int = DEFAULT_MAX_VALUE) -> object:
    """``value`` itself if short, else its text cut to ``limit`` characters with a note of how
    much was left out. Numbers and ``None`` pass unchanged."""
    if value is None or isinstance(value, bool | int | float):
        return value
    text = value if isinstance(value, str) else repr(value)
    if len(text) <= limit:
        return value
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


class _Window:
    __slots__ = ("held", "start", "written")

    def __init__(self, start: float) -> None:
        self.start = start
        self.written = 0
        self.held = 0


class LogLimiter:
    """Writes at most ``burst`` lines per key and ``period`` through ``log`` (a structlog
    method such as ``logger.warning``)."""

    def __init__(
        self,
        log: Callable[..., Any],
        *,
        burst: int = DEFAULT_BURST,
        period: float = DEFAULT_PERIOD_S,
        max_value: int = DEFAULT_MAX_VALUE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = log
        self.burst = burst
        self.period = period
        self.max_value = max_value
        self._clock = clock
        self._windows: dict[Hashable, _Window] = {}
        self.held = 0
        """Lines held back so far, over every key."""

    def __call__(self, event: str, key: Hashable, **fields: object) -> bool:
        """Write ``event`` with ``fields`` unless ``key`` has used up its lines; returns
        whether the line was written."""
        now = self._clock()
        window = self._windows.get((event, key))
        if window is None or now - window.start >= self.period:
            held = 0 if window is None else window.held
            if window is None and len(self._windows) >= MAX_KEYS:
                del self._windows[next(iter(self._windows))]
            window = self._windows[event, key] = _Window(now)
            if held:
                fields = {**fields, "held_back": held}
        if window.written >= self.burst:
            window.held += 1
            self.held += 1
            return False
        window.written += 1
        self._log(event, **{name: cut(value, self.max_value) for name, value in fields.items()})
        return True
