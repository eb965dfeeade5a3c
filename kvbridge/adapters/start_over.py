"""How a suspended stream starts over once the clear its suspension waited for is out.

A restart, a loss or a jump that finds no clear token suspends its stream
(:mod:`~kvbridge.adapters.sequencing`). When a token is back, the clear goes out
(:meth:`~kvbridge.adapters.stream_state.StreamState.release`) and the stream starts over from
where the suspension began (:attr:`~kvbridge.adapters.stream_state.StreamState.resume_from`):
the batches it skipped that the replay still holds, as one run, then the stream goes on; the
others count as ``lost``. That happens at once, the run up to the last batch the engine holds
(:meth:`StartOver.released`), so that an engine gone quiet is indexed again without waiting
for its next batch; or, if that cannot be had, at the stream's next message, the run that
reaches it (:meth:`StartOver.before`).

Either way a drop of the connection since the suspension began is checked first
(:meth:`~kvbridge.adapters.replay_recovery.ReplayRecovery.check_publisher`): a new process's
batches are replayed from 0, the same one's are taken from the check's answer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvbridge.adapters.logs import LogLimiter
from kvbridge.adapters.replay_answer import Replayed, Replaying, run_before
from kvbridge.adapters.replay_recovery import ReplayRecovery
from kvbridge.adapters.source import Message, StreamReset
from kvbridge.adapters.stream_state import StreamState
from kvbridge.adapters.stream_stats import SubscriberStats

__all__ = ["StartOver"]


@dataclass(eq=False)
class StartOver:
    """The start-overs of one subscriber's streams, counted in the subscriber's stats."""

    stats: SubscriberStats
    warn: LogLimiter
    """The subscriber's limiter: one budget of lines per stream and event, whoever logs."""
    recovery: ReplayRecovery

    def before(self, stream: StreamState, seq: int) -> Replaying[list[Message]]:
        """The start-over of a stream at its live batch ``seq`` (which the caller delivers),
        its clear sent: the run of the skipped batches that reaches ``seq``. A publisher check
        that goes unanswered leaves no run (the check's empty answer is taken as it is)."""
        resume, stream.resume_from = stream.resume_from, None
        stream.starting_over = False
        stream.jumped_to = None
        reconnected, stream.reconnected = stream.reconnected, False
        stream.replayed_through = -1
        answer: Replayed | None = None  # the publisher check's, if one was asked
        if reconnected:
            same, answer = yield from self._check_publisher(stream, resume)
            if same is False:  # a new process: its batches from 0, its replay endpoint afresh
                self.replaced_after_clear(stream, seq)
                stream.forget_process()
                resume, answer = 0, None
        # Past max_gap, what was skipped is a jump's, not a loss; after an unconfirmed clear
        # that is measured from the batches that count (StreamState.counts_lost_from).
        if resume is None or resume >= seq or self._too_far(stream, resume, seq):
            return []
        if answer is None:
            run = yield from self.recovery.run_before(stream, resume, seq)
        else:  # the check's answer, from before the skipped batches (empty if unanswered)
            run = run_before(resume, seq, answer)
        self._count(stream, resume, seq, run)
        return run

    def released(
        self, stream: StreamState, *, in_back_off: bool = False
    ) -> Replaying[list[Message | StreamReset]]:
        """The start-over of a stream whose suspension was just released, its clear sent,
        without waiting for its next message, which an engine gone quiet may not send for a
        long time: the run of the skipped batches that the replay holds, up to the last batch
        the engine holds. Meanwhile the worker's blocks from that run would be unknown
        downstream. If the SUB is not connected again yet after a drop, the drop's own
        catch-up still follows its handshake
        (:meth:`~kvbridge.adapters.sequencing.Sequencer.catch_up`), for what the engine sent
        meanwhile; one that comes before this start-over (and finds the stream still starting
        over) runs it instead.

        Nothing is done (the next message starts the stream over, :meth:`before`) for a
        jump's suspension (its skipped batches mean nothing) or a skip already past
        ``max_gap``, a replay endpoint in its back-off (it did not answer lately; but see
        ``in_back_off``), a publisher
        check that goes unanswered, a drop or a message during the wait, an answer that does
        not say where the engine's batches end, or one with nothing to deliver. Live copies of
        the run's batches that come after it are duplicates, down to the last live message
        read (:attr:`~kvbridge.adapters.stream_state.StreamState.skipped_last`).

        ``in_back_off``: asked within the back-off too, for a drop's catch-up. The drop ended
        the back-off before it, so one that runs then began when a replay asked of the old
        connection timed out (this start-over's own, say), which says nothing of the process
        there now; and no later catch-up would come to start the stream over."""
        resume, skipped = stream.resume_from, stream.skipped_last
        if resume is None:
            return []
        if not in_back_off and time.monotonic() < stream.replay_resumes_at:
            return []
        if skipped is not None and self._too_far(stream, resume, skipped):
            return []  # a jump's distance: left to the next message, as before() leaves it
        drops = stream.drops
        checked: Replayed | None = None
        if stream.reconnected:
            same, checked = yield from self._check_publisher(stream, resume)
            if same is None or stream.drops != drops or not stream.starting_over:
                return []
            if same is False:  # a new process: its batches from 0
                self.replaced_after_clear(stream, None)
                stream.forget_process()
                stream.suspended_for, stream.resume_from = "restart", 0
                resume, checked = 0, None
        if checked is None:
            run, end = yield from self.recovery.run_to_end(stream, resume, in_back_off=in_back_off)
        else:  # the check's answer, from before the skipped batches
            end = resume if checked.end is None else checked.end
            run = run_before(resume, end, checked)
        if not run or stream.drops != drops or not stream.starting_over:
            return []
        if self._too_far(stream, resume, end):
            return []
        stream.starting_over = False
        stream.reconnected = stream.reconnected and not stream.connected  # else its catch-up
        stream.resume_from = stream.jumped_to = None
        self._count(stream, resume, end, run)
        for message in run:
            stream.delivered(message.seq, message.payload)
        if skipped is None:  # no live message read since the suspension began
            read = stream.live_last if resume else -1
        else:
            read = min(skipped, run[-1].seq)
        stream.live_last, stream.replayed_through = read, run[-1].seq
        return [*run]

    def replaced_after_clear(self, stream: StreamState, seq: int | None) -> None:
        """Log a new process found as its stream starts over after a loss's clear. That clear
        went out, counted as a resync; each clear is counted once, so no restart is."""
        endpoint = stream.source.endpoint
        self.warn(
            "publisher restarted",
            (endpoint,),
            stream=endpoint,
            seq=seq,
            last=stream.last,
            counted="resync",
        )

    def _check_publisher(
        self, stream: StreamState, resume: int | None
    ) -> Replaying[tuple[bool | None, Replayed | None]]:
        """After a drop since the suspension began, whether the publisher is the process
        that delivered the stream's last batch, and the check's answer; the same, with no
        answer, when there is nothing to check (a new process's stream, whose batches come
        from 0 anyway)."""
        if not resume or stream.last is None:
            return True, None
        return (yield from self.recovery.check_publisher(stream, stream.last))

    def _too_far(self, stream: StreamState, resume: int, end: int) -> bool:
        """Whether skipped batches ``resume .. end - 1`` are a jump's, not a loss: more than
        ``max_gap`` of them count."""
        return end - stream.counts_lost_from(resume) > self.recovery.max_gap

    def _count(self, stream: StreamState, resume: int, end: int, run: list[Message]) -> None:
        """Count ``run`` replayed, and the batches before ``end`` it leaves out lost."""
        lost = end - resume - len(run)
        if lost:
            stream.lose(self.stats, self.warn, resume, lost)
        self.stats.replayed += len(run)
