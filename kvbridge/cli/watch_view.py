"""The view behind ``kvbridge watch``: a table of workers, ranks and tiers, on ``rich``.

One row per worker and dp rank: the distinct blocks resident on each tier, then, on the
worker's first row, what the worker's streams did: blocks per second since the previous render,
the lag of its last batch, the gaps seen in its sequence, the batches recovered by replay, the
batches lost, the engine restarts and the blocks not forwarded (reference counting aside). Three
lines under the table give the totals of the subscriber, the bad frames by reason and the blocks
not forwarded by reason. The table takes the console's width: from :data:`WIDE` columns, full
headers with a space either side of each cell; below, shorter headers and one space between
cells, so that it fits 80 columns.

The lag is left blank for a batch whose engine time is older than the start of the view by more
than :data:`STALE_AFTER_S`: a replayed capture, or batches an engine's replay buffer held from
before, say nothing about how far behind the relay is.

``rich`` comes with the ``watch`` extra; it is imported only when a view is built, and
:class:`~kvbridge.cli.usage.MissingExtra` names the extra when it is absent.
"""

from __future__ import annotations

import io
import time
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING, Final

from kvbridge.adapters.relay import Relay
from kvbridge.adapters.source import Message, Source, StreamReset
from kvbridge.adapters.stream_stats import bad_frames
from kvbridge.cli.usage import MissingExtra
from kvbridge.cli.validation import BENIGN
from kvbridge.schemas.tiers import Tier

if TYPE_CHECKING:
    from rich.console import Console, ConsoleOptions, RenderResult
    from rich.table import Table

__all__ = ["STALE_AFTER_S", "WatchView", "require_rich"]

STALE_AFTER_S: Final = 60.0
"""A batch whose engine time is this much older than the view's start shows no lag."""

COLUMNS: Final = (
    "worker",
    "dp",
    "device",
    "host",
    "disk",
    "external",
    "blocks/s",
    "lag ms",
    "gaps",
    "replayed",
    "lost",
    "restarts",
    "drops",
)
NARROW_COLUMNS: Final = (
    "worker",
    "dp",
    "device",
    "host",
    "disk",
    "ext",
    "blk/s",
    "lag ms",
    "gaps",
    "replay",
    "lost",
    "restart",
    "drops",
)
"""The headers on a screen narrower than :data:`WIDE` columns (80 columns fit them)."""
WIDE: Final = 110
"""The width from which the table has its full headers and a space on each side of a cell."""


def require_rich() -> None:
    """Raise :class:`MissingExtra` unless ``rich`` can be imported."""
    try:
        import rich  # noqa: F401
    except ImportError as error:
        raise MissingExtra(
            "kvbridge watch needs rich, its extra 'watch': pip install rich "
            "(or, in a clone, pip install '.[watch]')"
        ) from error


class _SourceTally:
    """What one source's items said, counted from outside the subscriber."""

    __slots__ = ("gaps", "live", "previous_live", "replayed", "restarts")

    def __init__(self) -> None:
        self.gaps = self.replayed = self.restarts = 0
        self.live = False
        """A live batch was delivered since the start or the last restart."""
        self.previous_live = False
        """The previous item of this source was a live batch."""

    def observe(self, item: Message | StreamReset) -> None:
        recovering = isinstance(item, StreamReset) and item.reason == "lost"
        recovering = recovering or (isinstance(item, Message) and item.replayed)
        if recovering and self.live and self.previous_live:
            self.gaps += 1  # the subscriber recovers a gap before the live batch that shows it
        if isinstance(item, StreamReset):
            if item.reason == "restart":
                self.restarts += 1
                self.live = False
            self.previous_live = False
            return
        if item.replayed:
            self.replayed += 1
        else:
            self.live = True
        self.previous_live = not item.replayed


class WatchView:
    """Drives a relay (without outputs) and renders its state.

    :meth:`poll` takes the place of :meth:`Relay.step`, so that the view sees each item the
    subscriber hands out; rates are per second since the previous :meth:`renderable`.
    """

    def __init__(self, relay: Relay, *, stale_after_s: float = STALE_AFTER_S) -> None:
        require_rich()
        self.relay = relay
        self.stale_after_s = stale_after_s
        self.started = time.time()
        self._tallies: dict[Source, _SourceTally] = {}
        self._engine_ts: dict[int, float] = {}
        self._last = time.monotonic()
        self._last_blocks: Counter[int] = Counter()

    # -- input ---------------------------------------------------------------------------

    def poll(self, timeout_ms: int = 50) -> int:
        """Feed whatever the relay's subscriber delivers within ``timeout_ms``."""
        items = self.relay.subscriber.poll(timeout_ms)
        self.observe(items)
        return len(items)

    def observe(self, items: Iterable[Message | StreamReset]) -> None:
        """Feed items to the relay's pipeline and count what they say per source."""
        pipeline = self.relay.pipeline
        for item in items:
            pipeline.feed(item)
            self._tallies.setdefault(item.source, _SourceTally()).observe(item)
            if isinstance(item, Message):
                worker = pipeline.worker(item.source.worker_id)
                self._engine_ts[item.source.worker_id] = time.time() - worker.lag

    def delivered(self) -> list[str]:
        """The endpoints of the sources that delivered at least one batch."""
        return [
            source.endpoint
            for source, tally in self._tallies.items()
            if tally.live or tally.replayed
        ]

    # -- output --------------------------------------------------------------------------

    def _worker_tally(self, worker_id: int) -> _SourceTally:
        total = _SourceTally()
        for source, tally in self._tallies.items():
            if source.worker_id == worker_id:
                total.gaps += tally.gaps
                total.replayed += tally.replayed
                total.restarts += tally.restarts
        return total

    def _lost(self, worker_id: int) -> int:
        """The batches the subscriber counted lost from ``worker_id``'s sources: a suspended
        stream's loss is known only when it starts over, after its reset went out, so the
        resets' ``lost_batches`` would undercount it."""
        subscriber = self.relay.subscriber
        return sum(
            subscriber.lost_batches(source)
            for source in subscriber.sources
            if source.worker_id == worker_id
        )

    def _lag(self, worker_id: int) -> str:
        ts = self._engine_ts.get(worker_id)
        if ts is None or ts < self.started - self.stale_after_s:
            return ""
        return f"{self.relay.workers[worker_id].lag * 1000:.1f}"

    def rows(self) -> list[list[str]]:
        """One row per worker and rank, cells in :data:`COLUMNS` order; updates the rates."""
        now = time.monotonic()
        elapsed = max(now - self._last, 1e-9)
        self._last = now
        rows: list[list[str]] = []
        for worker_id, worker in sorted(self.relay.workers.items()):
            normalizer = worker.normalizer
            blocks = sum(
                count for (kind, _), count in normalizer.forwarded.items() if kind != "cleared"
            ) + sum(normalizer.dropped.values())
            rate = (blocks - self._last_blocks[worker_id]) / elapsed
            self._last_blocks[worker_id] = blocks
            tally, lost = self._worker_tally(worker_id), self._lost(worker_id)
            drops = sum(n for reason, n in normalizer.stats.items() if reason not in BENIGN)
            figures: list[str] = [
                f"{rate:.1f}",
                self._lag(worker_id),
                *map(str, (tally.gaps, tally.replayed, lost, tally.restarts, drops)),
            ]
            for rank in normalizer.dp_ranks or [0]:
                tiers = (str(normalizer.resident_blocks(rank, tier)) for tier in Tier)
                rows.append([str(worker_id), str(rank), *tiers, *figures])
                figures = [""] * len(figures)
        return rows

    def footer(self) -> list[str]:
        """The subscriber's totals, the bad frames and the blocks not forwarded, by reason."""
        subscriber = self.relay.subscriber.stats
        bad = {
            reason.value: count
            for reason, count in bad_frames(self.relay.stats, subscriber).items()
        }
        drops: Counter[str] = Counter()
        for worker in self.relay.workers.values():
            drops.update(worker.normalizer.stats)
        return [
            f"batches {self.relay.stats.batches_in} | gaps {subscriber.gaps}"
            f" | replays {subscriber.replays} (recovered {subscriber.replayed})"
            f" | lost {subscriber.lost} | restarts {subscriber.restarts}",
            "bad frames: " + _counts(bad),
            "not forwarded: " + _counts(drops),
        ]

    def renderable(self) -> _Screen:
        """The table and the footer as they are now, for a :class:`rich.live.Live` display:
        the table takes the headers that fit the console's width."""
        return _Screen(self.rows(), self.footer())

    def render(self, width: int = 120) -> str:
        """The view as plain text, ``width`` columns wide (for pipes, logs and tests)."""
        from rich.console import Console

        screen = self.renderable()
        out = io.StringIO()
        console = Console(file=out, width=width, color_system=None, force_terminal=False)
        console.print(screen.table(width))
        lines = [line.rstrip() for line in out.getvalue().splitlines()]
        return "\n".join([*lines, "", *screen.footer])


class _Screen:
    """One render of the view: rows and footer, laid out for the width rich offers."""

    def __init__(self, rows: list[list[str]], footer: list[str]) -> None:
        self.rows = rows
        self.footer = footer

    def table(self, width: int) -> Table:
        from rich import box
        from rich.table import Table

        wide = width >= WIDE
        table = Table(
            box=box.SIMPLE_HEAD,
            show_edge=False,
            pad_edge=False,
            padding=(0, 1) if wide else (0, 0),
        )
        for name in COLUMNS if wide else NARROW_COLUMNS:
            table.add_column(name, justify="right", no_wrap=True)
        for row in self.rows:
            table.add_row(*row)
        return table

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        from rich.text import Text

        yield self.table(options.max_width)
        yield Text("")
        for line in self.footer:
            yield Text(line, no_wrap=True, overflow="crop")


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{key}={value}" for key, value in sorted(counts.items()) if value) or "none"
