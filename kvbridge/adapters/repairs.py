"""Repairing a stream after a loss whose replay went unanswered.

A replay that times out (or is skipped within its source's back-off) makes the batches it asked
for a loss: a ``"lost"`` clear goes out and the stream goes on (see
:mod:`~kvbridge.adapters.replay_recovery`). The engine may still hold those batches all the while;
its replay socket was only slow, or busy, or a relay started while it was. Left at that, the
worker's chains from before the loss stay unknown downstream, and every store that extends them
is dropped (``orphan_parent``) until the engine evicts and recomputes them.

So the stream remembers where such a loss began
(:attr:`~kvbridge.adapters.stream_state.StreamState.repair_from`). Once the back-off has
passed and a clear is allowed (:meth:`~kvbridge.adapters.stream_state.StreamState.repair_due`),
the subscriber asks the replay for every batch from there. If the answer is whole and holds
them all, from that batch to the last one delivered, unbroken and the last the same bytes (so
the same process), the stream is repaired: a ``"repair"`` clear, those batches again, in order,
then whatever the answer holds past the last (an idle engine's batches that the stream had not
seen). Downstream that is what the engine's batches from the first lost one build: the chains
stored in the lost batches are known again, and the stores that extend them are no longer
dropped. (Blocks stored before the loss, which its clear took, come back as before: re-anchored
by the stores that extend them.) Nothing is invented, since the clear comes first.

An engine that no longer holds the earliest loss may still hold a later one
(:attr:`~kvbridge.adapters.stream_state.StreamState.repair_latest`): if the answer's unbroken
run to the last starts no later than that, the stream is repaired from the run's start, and
only the losses before it stay lost.

An answer that does not come again waits for the next back-off, for at most
:data:`REPAIR_TRIES` tries (a dead replay endpoint is not asked forever, holding up its source
a timeout each time); one that comes without the batches ends the repair (the engine no longer
holds them).
"""

from __future__ import annotations

from typing import Final

from kvbridge.adapters.replay_answer import Fetch, Replaying, run_before
from kvbridge.adapters.replay_recovery import ReplayRecovery
from kvbridge.adapters.source import Message, StreamReset
from kvbridge.adapters.stream_state import StreamState

__all__ = ["REPAIR_TRIES", "repair"]

REPAIR_TRIES: Final = 6
"""Tries of a repair that go unanswered before it is given up: with the default replay
timeout of 2 s, the back-offs between them span about two minutes."""


def repair(recovery: ReplayRecovery, stream: StreamState) -> Replaying[list[Message | StreamReset]]:
    """The repair of ``stream`` (whose :meth:`~StreamState.repair_due` holds): a clear, the
    batches from :attr:`~StreamState.repair_from` (or a later one, no later than
    :attr:`~StreamState.repair_latest`) to the last delivered and the answer's batches after
    it; or nothing."""
    first, last = stream.repair_from, stream.last
    assert first is not None and last is not None
    answer = yield Fetch(stream, first)
    run = run_before(first, last + 1, answer)
    complete = answer.whole and bool(run) and run[0].seq <= stream.repair_latest
    complete = complete and run[-1].payload == stream.last_payload
    endpoint = stream.source.endpoint
    if not complete and stream.replay_failures:  # unanswered again
        stream.repair_tries += 1
        if stream.repair_tries < REPAIR_TRIES:
            return []  # after the back-off
    if not complete:
        stream.repair_from = None
        reason = "unanswered" if stream.replay_failures else "not held"
        recovery.warn(
            "loss not repairable", (endpoint,), stream=endpoint, first=first, last=last, why=reason
        )
        return []
    if not stream.may_clear():  # as every reset's caller checks (repair_due did)
        return []
    stream.repair_from = None
    recovery.stats.repairs += 1
    repaired = run[0].seq
    # Batches before the run: what they stored stays unknown downstream, as after the loss.
    unknown = {"not_restored": f"{first}-{repaired - 1}"} if repaired > first else {}
    recovery.warn(
        "stream repaired", (endpoint,), stream=endpoint, first=repaired, last=last, **unknown
    )
    out: list[Message | StreamReset] = [stream.reset("repair"), *run]
    return out + (yield from recovery.recover(stream, last + 1, None, answer))
