"""Prometheus metrics of a relay, read from its live counters at scrape time.

Nothing is counted twice: the collector turns the relay's, subscriber's and normalizers' own
counters into metric families when Prometheus scrapes, so the hot path pays nothing. Needs the
``metrics`` extra (``prometheus-client``).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from kvbridge.adapters.replay_server import AnswerCut
from kvbridge.adapters.stream_stats import (
    OutputStats,
    PipelineStats,
    SubscriberStats,
    bad_frames,
    exported,
)
from kvbridge.schemas.tiers import Tier

if TYPE_CHECKING:
    from kvbridge.adapters.relay import Relay
    from kvbridge.adapters.subscriber import Subscriber

__all__ = ["METRICS", "metrics_registry"]

METRICS: dict[str, str] = {
    "kvbridge_blocks_total": "Blocks by event type, tier and outcome (forwarded or a drop reason)",
    "kvbridge_clears_total": "Tier clears forwarded (AllBlocksCleared, restarts, lost batches)",
    "kvbridge_batches_total": "Batches by direction: in (received), out (published)",
    "kvbridge_bad_frames_total": "Messages skipped, by reason",
    "kvbridge_unknown_fields_total": "Unknown fields ignored by the decoder",
    "kvbridge_gaps_total": "Sequence gaps detected",
    "kvbridge_replays_total": "Replay requests sent to the engine",
    "kvbridge_replayed_batches_total": "Batches recovered through replay",
    "kvbridge_lost_batches_total": "Batches no replay could recover when they were missed (the "
    "worker was cleared; a repair may deliver them later)",
    "kvbridge_restarts_total": "Publisher restarts detected, by the clear each takes (the "
    "sequence went back, or a new process found after a drop)",
    "kvbridge_duplicate_batches_total": "Live batches already delivered by a replay",
    "kvbridge_resyncs_total": "Streams started over at a far sequence (a jump it did take, or "
    "the end of a throttled stretch that was not a restart, when a clear token is back)",
    "kvbridge_disconnects_total": "Connections to a publisher that dropped",
    "kvbridge_reconnect_checks_total": "Publishers checked after a drop (same process or new)",
    "kvbridge_replay_timeouts_total": "Replay requests unanswered within the timeout",
    "kvbridge_replays_skipped_total": "Replays not asked for, as the source's replay endpoint "
    "timed out last time and its back-off has not passed (what they would fetch counts lost)",
    "kvbridge_replay_truncated_total": "Replay answers cut at their bound (the rest counted lost)",
    "kvbridge_repairs_total": "Streams cleared and delivered again from a loss whose replay had "
    "gone unanswered, once the engine's replay answered with the lost batches",
    "kvbridge_replay_answers_cut_total": "Answers to replay requests stopped before their end "
    "marker, by reason: peer_full (a peer that asks and does not read), peer_gone",
    "kvbridge_output_batches_total": "Batches the relay made itself, by kind: opening (the "
    "clear an output opens with), heartbeat, snapshot (answers to replays older than the buffer)",
    "kvbridge_state_evictions_total": "State given up to stay within the caps, by kind: ranks, "
    "blocks, context_compactions",
    "kvbridge_reanchored_blocks_total": "Blocks announced again after a loss (or a restart the "
    "publisher check could not confirm), re-anchored by a store naming them as ancestors",
    "kvbridge_tracked_blocks": "Engine hashes the state holds per worker, by state: live, retired",
    "kvbridge_lag_seconds": "Time from the engine step to the relay, last batch per worker",
    "kvbridge_resident_blocks": "Distinct blocks resident per worker, dp rank and tier",
    "kvbridge_progress_age_seconds": "Seconds since the loop that polls the sources last moved "
    "on (began a poll); /healthz answers 503 past its bound",
    "kvbridge_stream_suspended": "1 while a source's stream is suspended (its clears spent: "
    "skipped until a clear token is back, when the worker is cleared), else 0",
}
"""Every metric kvbridge exports, with its help text."""


class _Collector:
    """Reads a relay's counters, or only a subscriber's (``kvbridge record``)."""

    def __init__(self, relay: Relay | None, subscriber: Subscriber | None) -> None:
        self.relay = relay
        self.subscriber = subscriber or (relay.subscriber if relay else None)

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        if self.relay is not None:
            yield from self._relay_metrics(self.relay)
        if self.subscriber is not None:
            yield from self._subscriber_metrics(self.subscriber)

    def _relay_metrics(self, relay: Relay) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        blocks = _counter("kvbridge_blocks_total", ["worker", "type", "tier", "outcome"])
        clears = _counter("kvbridge_clears_total", ["worker", "tier"])
        unknown = _counter("kvbridge_unknown_fields_total", ["worker"])
        evictions = _counter("kvbridge_state_evictions_total", ["worker", "kind"])
        reanchored = _counter("kvbridge_reanchored_blocks_total", ["worker"])
        tracked = GaugeMetricFamily(
            "kvbridge_tracked_blocks",
            METRICS["kvbridge_tracked_blocks"],
            labels=["worker", "state"],
        )
        lag = GaugeMetricFamily(
            "kvbridge_lag_seconds", METRICS["kvbridge_lag_seconds"], labels=["worker"]
        )
        resident = GaugeMetricFamily(
            "kvbridge_resident_blocks",
            METRICS["kvbridge_resident_blocks"],
            labels=["worker", "dp_rank", "tier"],
        )
        # A copy (made whole under the GIL): the loop adds a worker at its first batch.
        for worker_id, worker in list(relay.workers.items()):
            name = str(worker_id)
            normalizer = worker.normalizer
            for (kind, tier), count in normalizer.forwarded.items():
                if kind == "cleared":
                    clears.add_metric([name, tier.value], count)
                else:
                    blocks.add_metric([name, kind, tier.value, "forwarded"], count)
            for (kind, tier_name, reason), count in normalizer.dropped.items():
                blocks.add_metric([name, kind, tier_name, reason], count)
            unknown.add_metric([name], normalizer.unknown_fields)
            for kind, count in normalizer.evictions.items():
                evictions.add_metric([name, kind], count)
            reanchored.add_metric([name], normalizer.reanchored_blocks)
            for state, count in zip(("live", "retired"), normalizer.tracked_blocks(), strict=True):
                tracked.add_metric([name, state], count)
            lag.add_metric([name], worker.lag)
            for rank in normalizer.dp_ranks:
                for tier in Tier:
                    count = normalizer.resident_blocks(rank, tier)
                    resident.add_metric([name, str(rank), tier.value], count)
        cut = _counter("kvbridge_replay_answers_cut_total", ["reason"])
        cut_answers: Counter[AnswerCut] = Counter()
        for publisher in relay.outputs.values():
            cut_answers.update(publisher.replay_answers_cut)
        for why in AnswerCut:
            cut.add_metric([why.value], cut_answers[why])
        yield from (blocks, clears, unknown, evictions, reanchored, tracked, lag, resident, cut)
        yield from _families(relay.stats, relay.output_stats)

    def _subscriber_metrics(self, subscriber: Subscriber) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        own = () if self.relay is None else (self.relay.stats,)
        bad = _counter("kvbridge_bad_frames_total", ["reason"])
        for reason, count in bad_frames(*own, subscriber.stats).items():
            bad.add_metric([reason.value], count)
        yield bad
        yield from _families(subscriber.stats)
        name = "kvbridge_progress_age_seconds"
        yield GaugeMetricFamily(
            name, METRICS[name], value=time.monotonic() - subscriber.progressed_at
        )
        name = "kvbridge_stream_suspended"
        suspended = GaugeMetricFamily(name, METRICS[name], labels=["worker", "endpoint"])
        for source in subscriber.sources:
            labels = [str(source.worker_id), source.endpoint]
            suspended.add_metric(labels, int(subscriber.suspended(source)))
        yield suspended


def _families(*stats: SubscriberStats | PipelineStats | OutputStats) -> list[Any]:
    """A counter family per metric the fields of ``stats`` declare, a sample per field (see
    :mod:`~kvbridge.adapters.stream_stats`), in field order."""
    families: dict[str, Any] = {}
    for counts in stats:
        for how, count in exported(counts):
            family = families.get(how.metric)
            if family is None:
                labels = [] if how.label is None else [how.label[0]]
                family = families[how.metric] = _counter(how.metric, labels)
            family.add_metric([] if how.label is None else [how.label[1]], count)
    return list(families.values())


def _counter(name: str, labels: list[str]) -> Any:
    from prometheus_client.core import CounterMetricFamily

    return CounterMetricFamily(name.removesuffix("_total"), METRICS[name], labels=labels)


def metrics_registry(relay: Relay | None = None, subscriber: Subscriber | None = None) -> Any:
    """A ``prometheus_client.CollectorRegistry`` holding a relay's (or a bare subscriber's)
    metrics, for an exporter of one's own or a test (``prometheus_client.generate_latest
    (registry)``); :func:`~kvbridge.adapters.status_server.serve_metrics` adds the process's."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    registry.register(_Collector(relay, subscriber))
    return registry
