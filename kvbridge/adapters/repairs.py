"""Repairing a stream after a loss whose replay went unanswered.

A replay that times out (or is skipped within its source's back-off) makes the batches it asked
for a loss: a ``"lost"`` clear goes out and the stream goes on (see
:mod:`~kvbridge.adapters.replay_client`). The engine may still hold those batches all the while;
its replay socket was only slow, or busy, or a relay started while it was. Left at that, the
worker's chains from before the loss stay unknown downstream, and every store that extends them
is dropped (``orphan_parent``) until the engine evicts and recomputes them.

So the stream remembers where such a loss began
(:attr:`~kvbridge.adapters.stream_state.StreamState.repair_from`). Once the back-off has
passed and a clear is allowed (:meth:`~kvbridge.adapters.stream_state.StreamState.repair_due`),
the subscriber asks the replay for every batch from there. If the answer holds them all, from
that batch to the last one delivered, unbroken and the last the same bytes (so the same
process), the stream is repaired: a ``"repair"`` clear, then those batches again, in order.
Downstream that is the state of a stream that never lost them; nothing was invented, since a
clear comes first. An answer that does not come again waits for the next back-off; one that
comes without them ends the repair (the engine no longer holds them).
"""

from __future__ import annotations

from kvbridge.adapters.replay_client import Fetch, ReplayClient, Replaying, run_before
from kvbridge.adapters.source import Message, StreamReset
from kvbridge.adapters.stream_state import StreamState

__all__ = ["repair"]


def repair(client: ReplayClient, stream: StreamState) -> Replaying[list[Message | StreamReset]]:
    """The repair of ``stream`` (whose :meth:`~StreamState.repair_due` holds): a clear and the
    batches from :attr:`~StreamState.repair_from` to the last delivered, or nothing."""
    first, last = stream.repair_from, stream.last
    assert first is not None and last is not None
    answer = yield Fetch(stream, first)
    run = run_before(first, last + 1, answer)
    complete = bool(run) and run[0].seq == first and run[-1].payload == stream.last_payload
    endpoint = stream.source.endpoint
    if not complete and stream.replay_failures:
        return []  # unanswered again: after the next back-off
    if not complete:
        stream.repair_from = None
        client.warn("loss not repairable", (endpoint,), stream=endpoint, first=first, last=last)
        return []
    if stream.last != last or not stream.may_clear():
        return []  # the stream moved meanwhile, or spent its clears: later
    stream.repair_from = None
    client.stats.repairs += 1
    client.stats.replayed += len(run)
    stream.replayed_through = max(stream.replayed_through, last)
    client.warn("stream repaired", (endpoint,), stream=endpoint, first=first, last=last)
    return [stream.reset("repair"), *run]
