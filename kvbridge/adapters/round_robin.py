"""Reading several sources in one poll, fairly and within budgets.

A poll reads the ready sources round-robin, at most :data:`POLL_ROUND` messages from each per
round, at most ``source_budget`` from one source and ``poll_budget`` in all; the next poll
starts with the source after the last one served (or with the same one, if the budget cut its
round short). A fast source cannot starve the others, and the consumer processes what it read
before reading more: the rest waits in ZMQ's queue.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Final, Generic, TypeVar

__all__ = ["DEFAULT_POLL_BUDGET", "DEFAULT_SOURCE_BUDGET", "POLL_ROUND", "RoundRobin"]

DEFAULT_POLL_BUDGET: Final = 4096
"""Messages one poll reads at most, over all sources."""
DEFAULT_SOURCE_BUDGET: Final = 256
"""Messages one poll reads at most from one source."""
POLL_ROUND: Final = 32
"""Messages read from a source before the next ready source gets its turn."""

_Source = TypeVar("_Source", bound=Hashable)

ReadFrom = Callable[[_Source, int], tuple[int, bool]]
"""Reads at most the given number of messages from a source: how many it read, and whether
the source must not be read again in this poll (it waits for a replay)."""


class RoundRobin(Generic[_Source]):
    """The order of a subscriber's sources, and where the next poll starts in it."""

    def __init__(self, *, poll_budget: int, source_budget: int) -> None:
        self.poll_budget = poll_budget
        self.source_budget = source_budget
        self._order: dict[_Source, int] = {}
        self._next_first = 0

    def add(self, source: _Source) -> None:
        """Put ``source`` last in the order."""
        self._order[source] = len(self._order)

    def replace(self, old: _Source, new: _Source) -> None:
        """Put ``new`` where ``old`` was (a source's socket replaced)."""
        self._order[new] = self._order.pop(old)

    def clear(self) -> None:
        self._order.clear()
        self._next_first = 0

    def read(self, ready: list[_Source], read_from: ReadFrom[_Source]) -> None:
        """Read the ``ready`` sources with ``read_from``, in the order from where the last
        poll stopped, round after round until the budgets are spent or none may hold more."""
        if not ready:
            return
        order, count = self._order, len(self._order)
        first = self._next_first
        ready = sorted(ready, key=lambda source: (order[source] - first) % count)
        budget = self.poll_budget
        taken = dict.fromkeys(ready, 0)
        last_served, resume = ready[0], 1
        while ready and budget > 0:
            more: list[_Source] = []
            for source in ready:
                quota = min(POLL_ROUND, self.source_budget - taken[source], budget)
                read, waits = read_from(source, quota)
                taken[source] += read
                budget -= read
                if read == quota and taken[source] < self.source_budget and not waits:
                    more.append(source)  # may hold more
                if budget <= 0:
                    # Cut short by the budget: the next poll starts with this source.
                    cut_short = read < POLL_ROUND and read == quota
                    last_served, resume = source, 0 if cut_short else 1
                    break
                last_served, resume = source, 1
            ready = more
        self._next_first = (order[last_served] + resume) % count
