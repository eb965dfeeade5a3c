"""The text view behind ``kvbridge watch``: per-worker residency, rates and recovery counters."""

from __future__ import annotations

import time
from collections import Counter

from kvbridge.adapters.relay import Relay
from kvbridge.schemas.tiers import Tier

__all__ = ["WatchView"]

_CLEAR = "\x1b[H\x1b[2J"


class WatchView:
    """Renders a relay's state; rates are per second since the previous render."""

    def __init__(self, relay: Relay, *, clear_screen: bool = False) -> None:
        self.relay = relay
        self.clear_screen = clear_screen
        self._last = time.monotonic()
        self._last_blocks: Counter[int] = Counter()

    def render(self) -> str:
        now = time.monotonic()
        elapsed = max(now - self._last, 1e-9)
        self._last = now
        lines = [
            f"{'worker':>8}{'dp':>4}{'device':>9}{'host':>9}{'disk':>9}{'external':>10}"
            f"{'blocks/s':>10}{'lag ms':>9}"
        ]
        drops: Counter[str] = Counter()
        for worker_id, worker in sorted(self.relay.workers.items()):
            normalizer = worker.normalizer
            blocks = sum(
                count for (kind, _), count in normalizer.forwarded.items() if kind != "cleared"
            ) + sum(normalizer.dropped.values())
            rate = (blocks - self._last_blocks[worker_id]) / elapsed
            self._last_blocks[worker_id] = blocks
            drops.update(normalizer.stats)
            for rank in normalizer.dp_ranks or [0]:
                device, host, disk, external = (
                    normalizer.resident_blocks(rank, tier) for tier in Tier
                )
                lines.append(
                    f"{worker_id:>8}{rank:>4}{device:>9}{host:>9}{disk:>9}{external:>10}"
                    f"{rate:>10.1f}{worker.lag * 1000:>9.1f}"
                )
        subscriber = self.relay.subscriber.stats
        bad = {
            key.removeprefix("bad_frame:"): count
            for key, count in (*self.relay.stats.items(), *subscriber.items())
            if key.startswith("bad_frame:")
        }
        lines.append("")
        lines.append(
            "batches {} | gaps {} | replays {} (recovered {}) | lost {} | restarts {}".format(
                self.relay.stats["batches_in"],
                subscriber["gaps"],
                subscriber["replays"],
                subscriber["replayed"],
                subscriber["lost"],
                subscriber["restarts"],
            )
        )
        lines.append("bad frames: " + _counts(bad))
        lines.append("not forwarded: " + _counts(drops))
        text = "\n".join(lines)
        return _CLEAR + text if self.clear_screen else text


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{key}={value}" for key, value in sorted(counts.items()) if value) or "none"
