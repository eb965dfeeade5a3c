"""What a replay's answer means for a stream: the batches a gap, a stream's start or a
suspension missed, the same publisher or a new one after a reconnect, and a reset where the
answer cannot deliver.

The answers themselves are asked for and read by
:class:`~kvbridge.adapters.replay_client.ReplayClient`; :class:`ReplayRecovery` only decides, so its
methods are generators (:data:`~kvbridge.adapters.replay_answer.Replaying`): they yield a
:class:`~kvbridge.adapters.replay_answer.Fetch` where they need an answer, and whoever drives
them (:class:`~kvbridge.adapters.replays_in_flight.ReplaysInFlight`) sends the request, reads
the answer alongside everything else and sends it back. Their uses:

- **recovery** (:meth:`ReplayRecovery.recover`): a gap, or the start of a stream, is filled from the
  replay. What it cannot deliver (an aged-out buffer, no replay endpoint, a timeout, a
  back-off, a refused batch) is counted ``lost`` and a
  :class:`~kvbridge.adapters.source.StreamReset` goes out at the point of the loss, since a
  lost removal would leave a stale block downstream (what a timeout or a back-off cost is
  repaired later if it can be, see :mod:`~kvbridge.adapters.repairs`);
- **the publisher check** after a reconnect (:meth:`ReplayRecovery.check_publisher`): the batch
  delivered last, replayed, must be the same bytes, or the publisher is a new process;
- **a start-over** after a suspension (:meth:`ReplayRecovery.run_before`): the batches the
  suspension skipped, after the clear, as far as they reach the next live one unbroken.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbridge.adapters.logs import LogLimiter
from kvbridge.adapters.replay_answer import Fetch, Replayed, Replaying, run_before
from kvbridge.adapters.source import Message, StreamReset
from kvbridge.adapters.stream_state import StreamState
from kvbridge.adapters.stream_stats import SubscriberStats

__all__ = ["ReplayRecovery"]


@dataclass(eq=False)
class ReplayRecovery:
    """Recoveries for the streams of one subscriber, counted in the subscriber's stats;
    ``max_gap`` tells a loss from a resync."""

    stats: SubscriberStats
    warn: LogLimiter
    """The subscriber's limiter: one budget of lines per stream and event, whoever logs."""
    max_gap: int

    def check_publisher(
        self, stream: StreamState, last: int
    ) -> Replaying[tuple[bool | None, Replayed]]:
        """After a reconnect: whether the publisher is the one that delivered batch ``last``,
        and the replay from ``last``. ``True`` if the replay's first batch is that batch (the
        same publisher, so the replay fills what the drop cost), ``False`` if it is another
        (a new process: so is an empty replay, since the same process would hold ``last`` or
        what came after it), ``None`` if no answer came to tell. Without a replay endpoint the
        publisher is taken as the same: a gap then counts as lost and clears downstream. The
        check is asked for within a back-off too: it decides whether the worker is cleared."""
        self.stats.reconnect_checks += 1
        if not stream.source.replay_endpoint:
            return True, Replayed([], whole=True)
        answer = yield Fetch(stream, last, in_back_off=True)
        endpoint = stream.source.endpoint
        if not answer and stream.replay_failures:  # timed out, or could not be sent
            self.warn("publisher check unanswered", (endpoint,), stream=endpoint, last=last)
            return None, answer
        if not answer:
            self.warn("publisher replaced", (endpoint,), stream=endpoint, last=last, replayed=0)
            return False, answer
        if answer[0].seq == last and answer[0].payload == stream.last_payload:
            return True, answer
        self.warn("publisher replaced", (endpoint,), stream=endpoint, last=last)
        return False, answer

    def recover(
        self,
        stream: StreamState,
        start: int,
        live_seq: int | None,
        replayed: Replayed | None = None,
    ) -> Replaying[list[Message | StreamReset]]:
        """Fetch ``start .. live_seq - 1`` (or everything buffered, without ``live_seq``, up to
        the answer's :attr:`~Replayed.end`) from the replay socket, unless ``replayed`` is an
        answer already fetched from ``start`` or before. Whatever it cannot deliver is lost: a
        :class:`StreamReset` goes out at the point of the loss, in stream order.

        A loss of more than ``max_gap`` batches (from the start of a stream whose first batch is
        far past 0, as a relay's are, or a replay answering with such a batch) is a resync, with
        nothing counted lost. A loss before the first batch after an unconfirmed clear
        (:attr:`~kvbridge.adapters.stream_state.StreamState.unconfirmed_last`) is only counted,
        at its lower bound: that clear covers it. A loss that finds no clear token suspends the
        stream and ends the recovery there (the live message that led here counts the skip).

        Without ``live_seq``, an answer that is not :attr:`~Replayed.whole` and whose
        :attr:`~Replayed.end` is unknown (it timed out, was cut, or skipped a frame of no known
        batch) may have missed batches after its last, whose removals would leave blocks stale
        downstream until the source's next message showed the gap: the stream is cleared after
        what it delivered, a loss of unknown size."""
        if replayed is None:
            replayed = (
                (yield Fetch(stream, start))
                if stream.source.replay_endpoint
                else Replayed([], whole=True)
            )
        out: list[Message | StreamReset] = []
        expected = start
        stop = replayed.end if live_seq is None else live_seq
        for message in [*replayed, None]:
            if message is None and stop is None:
                break
            seq = stop if message is None else message.seq
            assert seq is not None
            if seq < expected:
                continue  # already delivered
            if seq > expected and stream.unconfirmed_last is not None:
                # An unconfirmed clear went out with nothing delivered since: it covers the
                # loss, without a reset of its own. Past max_gap nothing counts, as in a resync.
                if seq - stream.counts_lost_from(expected) <= self.max_gap:
                    stream.lose(self.stats, self.warn, expected, seq - expected)
            elif seq > expected:
                lost = seq - expected
                if not stream.may_clear():
                    if lost > self.max_gap:
                        stream.suspend(self.warn, "restart")
                    else:
                        stream.suspend(self.warn, "lost", resume_from=expected)
                    return out
                if lost > self.max_gap:
                    out.append(stream.resync(self.stats, self.warn, seq))
                else:
                    stream.lose(self.stats, self.warn, expected, lost)
                    out.append(stream.reset("lost", lost))
            if message is None:
                break
            expected = seq + 1
            stream.delivered(seq, message.payload)
            stream.replayed_through = max(stream.replayed_through, seq)
            self.stats.replayed += 1
            out.append(message)
        if stop is None and not replayed.whole and stream.last is not None:
            self._lose_the_tail(stream, out)
        return out

    def _lose_the_tail(self, stream: StreamState, out: list[Message | StreamReset]) -> None:
        """Clear ``stream`` after its last batch, whose successors an answer that is not whole
        may have missed (or suspend it until a clear is allowed, to replay from there)."""
        last = stream.last
        assert last is not None
        endpoint = stream.source.endpoint
        self.warn("replay incomplete, stream cleared", (endpoint,), stream=endpoint, last=last)
        if stream.may_clear():
            out.append(stream.reset("lost"))
        else:
            stream.suspend(self.warn, "lost", resume_from=last + 1)

    def run_before(self, stream: StreamState, start: int, end: int) -> Replaying[list[Message]]:
        """Of the batches ``start .. end - 1``, those the replay still holds as one run that
        ends at ``end - 1``; empty without a replay endpoint or within a back-off.

        For a stream that starts over at ``end`` after a clear: a batch missing before the
        run leaves blocks unknown downstream, which the clear made so anyway, but one missing
        inside it could be the removal of a block the run stored, so the run starts after the
        last hole."""
        if not stream.source.replay_endpoint:
            return []
        return run_before(start, end, (yield Fetch(stream, start)))

    def run_to_end(
        self, stream: StreamState, start: int, *, in_back_off: bool = False
    ) -> Replaying[tuple[list[Message], int]]:
        """Of the batches from ``start``, those the replay holds as one run that ends at the
        last batch it holds, and the batch after that (the answer's :attr:`~Replayed.end`):
        :meth:`run_before` for a stream that has no next message to reach. ``([], start)``
        if the answer does not say where the engine's batches end (no replay endpoint, a
        back-off unless asked ``in_back_off``, a timeout, a cut, an empty buffer)."""
        if not stream.source.replay_endpoint:
            return [], start
        answer = yield Fetch(stream, start, in_back_off=in_back_off)
        if answer.end is None:
            return [], start
        return run_before(start, answer.end, answer), answer.end
