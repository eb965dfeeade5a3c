"""What a routing decision is, and what the router counts about its decisions.

:class:`Choice` is Dynamo's answer for one request, :class:`Decision` its record,
:class:`NoChoice` the reason there is none (the fallback's label), and :class:`RouterStats`
the figures a router keeps in its process (the same go to Ray's metrics), with
:class:`RegistryStats` for what happened to replicas and reservations.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final

from kvbridge.schemas import Overlap

__all__ = ["Choice", "Decision", "NoChoice", "RegistryStats", "Rejection", "Release", "RouterStats"]

DECISION_LOG: Final = 10_000
"""Decisions :attr:`RouterStats.decisions` keeps, the newest."""


class NoChoice(Exception):
    """Dynamo gave no answer; ``reason`` says why (the fallback counter's label) and ``detail``
    what happened (the service's error, the timeout), for the log."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Choice:
    """Dynamo's pick for one request, and the other workers ranked by their overlap."""

    selection_id: str
    worker_id: int
    dp_rank: int
    ranking: list[list[int]]
    """Groups of worker ids, best first: the pick alone, then (once Serve asks again for the
    same request, see :meth:`RoutingState.choose`) the others by overlap credit, equal credit
    in one group, so that Serve balances among them by queue length."""
    overlap: Overlap
    """The picked worker's overlap, in blocks (cumulative over tiers)."""


@dataclass(frozen=True)
class Decision:
    """One routing decision, for :attr:`RouterStats.decisions`."""

    request_id: str
    replica_id: str | None
    worker_id: int | None
    dp_rank: int | None
    overlap: Overlap | None
    fallback: str | None
    latency_s: float


class Rejection(StrEnum):
    """Why a replica's advert was not registered with Dynamo."""

    INVALID_ADVERT = "invalid_advert"
    """The routing stats hold an advert that does not validate."""
    BLOCK_SIZE = "block_size"
    """The replica's block size is not the router's."""


class Release(StrEnum):
    """Why a reservation was freed."""

    FREED = "freed"
    """Its request completed."""
    LATE_FREED = "late_freed"
    """Its selection answered after the decision's timeout: nobody uses it."""
    MOVED = "moved"
    """Serve placed the request on another replica than Dynamo's pick; it was booked there."""
    EXPIRED = "expired"
    """No completion arrived within the reservation's time to live."""
    CANCELLED = "cancelled"
    """The caller gave the request up before Serve placed it (Serve then reports neither a
    placement nor a completion)."""
    RESELECTED = "reselected"
    """Serve asked again for the request when its pick was no longer a candidate, and Dynamo
    picked anew."""
    DEREGISTERED = "deregistered"
    """Its worker was deregistered, or registered anew after its advert changed, before the
    free: Dynamo dropped the booking with the registration, so none was sent."""
    UNREGISTERED = "unregistered"
    """Serve placed the request on a replica Dynamo has not registered (the last resort when
    every registered one was full): Dynamo cannot book its load there."""


@dataclass
class RegistryStats:
    """What the router's registry did with replicas, its reservations with what they held,
    and the routers' tokenizers with prompts they could not tokenize."""

    registered: int = 0
    deregistered: int = 0
    rejected: Counter[Rejection] = field(default_factory=Counter)
    """Adverts refused, by reason (counted once per replica and reason in a row)."""
    releases: Counter[Release] = field(default_factory=Counter)
    """Reservations freed, by why."""
    free_failed: int = 0
    """Frees the service failed or that were cancelled."""
    tokenize_failed: int = 0
    """Prompts a tokenizer failed on, the LLM router's or a ``tokenizer`` hook (routed without
    Dynamo, as ``no_tokens``)."""


@dataclass
class RouterStats:
    """What the router did, in this process (the same figures go to Ray's metrics)."""

    outcomes: Counter[str] = field(default_factory=Counter)
    """``dynamo``, ``fallback`` and ``repeat`` (a retry of a request already reserved)."""
    fallbacks: Counter[str] = field(default_factory=Counter)
    """By reason: ``no_tokens``, ``no_workers``, ``timeout``, ``service_error``."""
    overlap_blocks: Counter[str] = field(default_factory=Counter)
    """Sum of the picked workers' overlap by tier: ``device``, ``host_pinned``, ``disk``."""
    registry: RegistryStats = field(default_factory=RegistryStats)
    """Replicas registered, deregistered and rejected; reservations freed, by why, and frees
    that failed; prompts that could not be tokenized."""
    decisions: deque[Decision] = field(default_factory=lambda: deque(maxlen=DECISION_LOG))
    token_checks: Counter[str] = field(default_factory=Counter)
    """After each completed request, whether the engine reported storing the prompt the router
    hashed (Dynamo's index, fed by the engine's own token ids, read for the serving worker):
    ``confirmed`` (every full block), ``partial`` (a leading part: evicted since, or token ids
    that diverge midway), ``unconfirmed`` (none: the router's token ids are not the engine's,
    so every decision for such prompts finds zero hits). Prompts without a full block are not
    checked."""
    relays_replaced: int = 0
    """Router-side relays (a Ray Serve LLM replica's raw stream relayed in the router's
    process) found stopped on an error and replaced: a bug, since no input is known to do it;
    the logs have each one's traceback."""
