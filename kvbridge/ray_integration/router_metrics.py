"""The router's metrics, exported through Ray's metrics agent (Prometheus).

``kvbridge_router_decisions_total{outcome}``
    Requests routed, by ``dynamo`` (Dynamo's pick) or ``fallback`` (power of two choices).
``kvbridge_router_fallbacks_total{reason}``
    Fallbacks by reason: ``no_tokens``, ``no_workers``, ``timeout``, ``service_error``.
``kvbridge_router_decision_seconds``
    Time from ``choose_replicas`` to the answer, Dynamo's or the fallback's.
``kvbridge_router_overlap_blocks{tier}``
    The picked replica's overlap with the prompt, in blocks, cumulative over tiers
    (``device``, ``host_pinned``, ``disk``), one observation per Dynamo decision.
``kvbridge_router_token_checks_total{outcome}``
    Completed requests whose prompt the engine reported storing as the router tokenized it:
    ``confirmed``, ``partial`` or ``unconfirmed`` (see ``RouterStats.token_checks``).
``kvbridge_router_relays_replaced_total``
    Router-side relays (Ray Serve LLM's raw streams, see ``relay_hop``) found stopped on an
    error and replaced (see ``RouterStats.relays_replaced``).

Every series carries a ``deployment`` tag (``app#deployment``).
"""

from __future__ import annotations

from typing import Final

from ray.util.metrics import Counter, Histogram

from kvbridge.schemas import Overlap

__all__ = ["RouterMetrics"]

LATENCY_BOUNDARIES: Final = [0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0]
OVERLAP_BOUNDARIES: Final = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0]


class RouterMetrics:
    """Ray metrics of one deployment's router in this process."""

    def __init__(self, deployment: str) -> None:
        tags = {"deployment": deployment}
        self._decisions = Counter(
            "kvbridge_router_decisions_total",
            "Requests routed, by outcome (dynamo or fallback).",
            tag_keys=("deployment", "outcome"),
        )
        self._fallbacks = Counter(
            "kvbridge_router_fallbacks_total",
            "Requests routed by the power-of-two fallback, by reason.",
            tag_keys=("deployment", "reason"),
        )
        self._latency = Histogram(
            "kvbridge_router_decision_seconds",
            "Time the router took to choose a replica.",
            boundaries=LATENCY_BOUNDARIES,
            tag_keys=("deployment",),
        )
        self._overlap = Histogram(
            "kvbridge_router_overlap_blocks",
            "The picked replica's prompt overlap in blocks, cumulative by tier.",
            boundaries=OVERLAP_BOUNDARIES,
            tag_keys=("deployment", "tier"),
        )
        self._token_checks = Counter(
            "kvbridge_router_token_checks_total",
            "Completed requests by whether the engine stored the prompt as the router hashed it.",
            tag_keys=("deployment", "outcome"),
        )
        self._relays_replaced = Counter(
            "kvbridge_router_relays_replaced_total",
            "Router-side relays found stopped on an error and replaced.",
            tag_keys=("deployment",),
        )
        for metric in (
            self._decisions,
            self._fallbacks,
            self._latency,
            self._overlap,
            self._token_checks,
            self._relays_replaced,
        ):
            metric.set_default_tags(tags)

    def record_token_check(self, outcome: str) -> None:
        """One completed request's check: ``confirmed``, ``partial`` or ``unconfirmed``."""
        self._token_checks.inc(tags={"outcome": outcome})

    def record_relay_replaced(self) -> None:
        """A router-side relay that stopped on an error, replaced."""
        self._relays_replaced.inc()

    def record(self, overlap: Overlap | None, fallback: str | None, latency_s: float) -> None:
        """One decision: Dynamo's (with the pick's ``overlap``) or a ``fallback`` by reason."""
        self._latency.observe(latency_s)
        if fallback is not None:
            self._decisions.inc(tags={"outcome": "fallback"})
            self._fallbacks.inc(tags={"reason": fallback})
            return
        assert overlap is not None
        self._decisions.inc(tags={"outcome": "dynamo"})
        self._overlap.observe(overlap.device, tags={"tier": "device"})
        self._overlap.observe(overlap.host_pinned, tags={"tier": "host_pinned"})
        self._overlap.observe(overlap.disk, tags={"tier": "disk"})
