"""What one live message means for its stream: the next batch, a gap to replay, a restart, a
duplicate of a replayed batch, a jump, or a bad frame.

The :class:`~kvbridge.adapters.subscriber.Subscriber` owns the sockets and the polling; each
message it reads comes here with its source's
:class:`~kvbridge.adapters.stream_state.StreamState`. Per source:

- **gap** (``seq > last + 1``): the missing batches are replayed
  (:meth:`~kvbridge.adapters.replay_recovery.ReplayRecovery.recover`);
- **first message** not at sequence 0: replayed from 0 (or lost, without a replay endpoint);
- **restart** (the sequence goes backwards, outside a window just covered by a replay): a
  :class:`StreamReset`, then the stream starts over;
- **duplicate**: a live copy of a batch a replay already delivered is skipped;
- **after a reconnect**, the publisher is checked
  (:meth:`~kvbridge.adapters.replay_recovery.ReplayRecovery.check_publisher`) as soon as the SUB
  is connected again (:meth:`Sequencer.catch_up`), or by a message that continues the
  sequence before that: a new process is a restart, whatever its sequence numbers say. So is
  a check that goes unanswered, since consistency comes first, but its reset is marked
  unchecked (:attr:`~kvbridge.adapters.source.StreamReset.checked`): the same process may be
  going on, and the consumer keeps its block identities. What is missing before the next
  batch is delivered needs no clear of its own, and only the batches after the last one
  delivered count as lost, a lower bound
  (:attr:`~kvbridge.adapters.stream_state.StreamState.unconfirmed_last`);
- **sequence jumps**: a forward jump of more than ``max_gap`` is bad input (``seq_jump``),
  skipped, not a replay of 10**22 batches. If the next message continues from the jump, the
  stream did move there: it is *resynchronized* (``resyncs``), a :class:`StreamReset`
  (``"restart"``) and the stream goes on from there;
- **throttled**: a restart, gap or jump that finds no clear token suspends the stream: every
  message is skipped and counted ``throttled`` until a token is back. Then the clear goes out
  at once (a restart for a new process, else a resync:
  :meth:`~kvbridge.adapters.stream_state.StreamState.release`, which the
  subscriber tries at every poll), and the stream starts over at once: the batches the
  suspension skipped (from the loss, or from 0 for a new process) that the replay still holds,
  as the run that ends at the last it holds, so that an engine gone quiet is indexed again
  without waiting for its next batch. If that replay cannot be had, the stream's next message
  starts it over, with the run that reaches it (:mod:`~kvbridge.adapters.start_over`). Either
  way the others (up to ``max_gap``) count as ``lost``. The clear is a ``"lost"`` reset if a
  loss was what found no token (the same process goes on, and the worker's block identities
  are kept downstream), else a ``"restart"``. (A stream released as a loss whose next
  message shows a new process starts over without a second clear: the identities it keeps
  are what the engine hashes stood for, which a new process's hashes do not reuse for other
  blocks);
- **bad frames** (wrong frame count, a frame over ``max_frame_bytes``, a sequence frame that is
  not 8 bytes or is the replay protocol's end marker): counted by
  :class:`~kvbridge.adapters.stream_stats.BadFrame` and skipped.
"""

from __future__ import annotations

import time
from dataclasses import KW_ONLY, dataclass, field

import structlog

from kvbridge.adapters.framing import framing_error
from kvbridge.adapters.logs import LogLimiter
from kvbridge.adapters.replay_answer import Fetch, Replayed, Replaying
from kvbridge.adapters.replay_recovery import ReplayRecovery
from kvbridge.adapters.source import Message, ResetReason, StreamReset
from kvbridge.adapters.start_over import StartOver
from kvbridge.adapters.stream_state import StreamState
from kvbridge.adapters.stream_stats import BadFrame, SubscriberStats

__all__ = ["Sequencer"]

log = structlog.get_logger("kvbridge.zmq")


@dataclass(eq=False)
class Sequencer:
    """The sequence logic of one subscriber's streams, counted in the subscriber's stats."""

    stats: SubscriberStats
    warn: LogLimiter
    """The subscriber's limiter: one budget of lines per stream and event, whoever logs."""
    recovery: ReplayRecovery
    _: KW_ONLY
    max_frame_bytes: int
    info: LogLimiter = field(default_factory=lambda: LogLimiter(log.info), init=False)
    """Gaps, which are expected under load, at info level."""
    start_over: StartOver = field(init=False)
    """How a suspended stream starts over once its clear is out."""

    def __post_init__(self) -> None:
        self.start_over = StartOver(self.stats, self.warn, self.recovery)

    @property
    def max_gap(self) -> int:
        """The largest forward jump that is a gap, not bad input: its recovery's."""
        return self.recovery.max_gap

    def _bad(self, stream: StreamState, reason: BadFrame, seq: int | None = None) -> None:
        stream.skip_frame(self.stats, self.warn, reason, seq)

    def _check(self, stream: StreamState, frames: list[bytes]) -> int | None:
        """The message's sequence number, or ``None`` for a message skipped as a bad frame:
        not vLLM's framing (:func:`~kvbridge.adapters.framing.framing_error`), or too big."""
        error = framing_error(frames)
        if error is not None:
            self._bad(stream, error[0])
            return None
        seq = int.from_bytes(frames[1], "big")
        if max(map(len, frames)) > self.max_frame_bytes:
            self._bad(stream, BadFrame.OVERSIZED, seq)
            return None
        return seq

    def _suspend(
        self, stream: StreamState, seq: int, resume_from: int | None = None, *, checked: bool = True
    ) -> None:
        """No token for the clear a restart or a jump needs: skip until one is back, then
        resync (and replay from ``resume_from``)."""
        stream.suspend(self.warn, "restart", seq, resume_from=resume_from, checked=checked)
        stream.skipped_last = seq
        self.stats.bad_frames[BadFrame.THROTTLED] += 1

    def _resync(
        self,
        stream: StreamState,
        frames: list[bytes],
        seq: int,
        out: list[Message | StreamReset],
        reason: ResetReason = "restart",
    ) -> Replaying[list[Message | StreamReset]]:
        """Start the stream over at ``seq`` with a ``reason`` clear; the caller has checked the
        token."""
        stream.suspended = False
        out.append(stream.resync(self.stats, self.warn, seq, reason))
        return (yield from self._start_over(stream, frames, seq, out))

    def _start_over(
        self, stream: StreamState, frames: list[bytes], seq: int, out: list[Message | StreamReset]
    ) -> Replaying[list[Message | StreamReset]]:
        """Start the stream over at ``seq``, its clear sent (:meth:`StartOver.before
        <kvbridge.adapters.start_over.StartOver.before>`), and deliver ``seq``."""
        out.extend((yield from self.start_over.before(stream, seq)))
        return self._deliver(stream, frames, seq, out)

    def _deliver(
        self, stream: StreamState, frames: list[bytes], seq: int, out: list[Message | StreamReset]
    ) -> list[Message | StreamReset]:
        """Deliver live batch ``seq`` after whatever ``out`` holds, and return ``out``. (The
        next batch in order takes :meth:`receive`'s own shorter path.)"""
        stream.live_last = seq
        stream.delivered(seq, frames[2])
        out.append(Message(stream.source, seq, frames[0], frames[2], time.time_ns()))
        return out

    def _restarted(
        self, stream: StreamState, seq: int | None, *, checked: bool = True
    ) -> StreamReset:
        """The ``"restart"`` reset of a stream whose publisher is a new process (or, not
        ``checked``, may be: its check went unanswered), counted and logged; the stream starts
        afresh. The caller has checked the token."""
        self.stats.restarts += 1
        endpoint = stream.source.endpoint
        self.warn("publisher restarted", (endpoint,), stream=endpoint, seq=seq, last=stream.last)
        reset = stream.reset("restart", checked=checked)
        stream.last = None
        stream.live_last = stream.replayed_through = -1
        return reset

    def catch_up(self, stream: StreamState) -> Replaying[list[Message | StreamReset]]:
        """What a drop cost ``stream``, once its SUB is connected again, without waiting for
        its next message: the batches the old socket held or missed, or a restart.

        The publisher is checked (as for a message after a reconnect): the same process's
        batches after the last are taken from the check's answer (a gap, counted as a live
        batch past them would count it; a hole in the answer is a loss); a
        new process, or a check that came to nothing, is a restart and is replayed from 0 (not
        asked for, after a check that timed out: within the back-off that began).
        Without this, an engine that went idle after the drop (or a restarted one that has
        sent nothing yet) would leave its worker's blocks stale downstream until it sent
        again. A stream that has delivered nothing since it began or was cleared is replayed
        from 0, as its first message past 0 would have it replayed: a new process found by
        the last catch-up may have sent its first batches while the connection was down again.
        That replay, and a start-over's, is asked for within a back-off too: the drop ended
        the back-off before it, so one that runs now began when a replay of the old
        connection's timed out since.
        Nothing to do if the stream's next message got there first, or if there is no replay
        endpoint to ask; a stream released but not yet started over is started over
        (:meth:`StartOver.released <kvbridge.adapters.start_over.StartOver.released>`)."""
        last = stream.last
        if not stream.reconnected or stream.suspended:
            return []
        if stream.starting_over:
            return (yield from self.start_over.released(stream, in_back_off=True))
        if not stream.source.replay_endpoint:
            return []
        stream.reconnected = False
        if last is None:
            # Within a back-off too: the timeout that began it says nothing of this process.
            answer = yield Fetch(stream, 0, in_back_off=True)
            return (yield from self.recovery.recover(stream, 0, None, answer))
        same, answer = yield from self.recovery.check_publisher(stream, last)
        if same:
            reached = max(answer.end or 0, answer[-1].seq + 1 if answer else 0)
            if reached > last + 1:  # a gap, as a live batch past it would have shown
                self.stats.gaps += 1
                endpoint = stream.source.endpoint
                self.info(
                    "batches missed while disconnected",
                    (endpoint,),
                    stream=endpoint,
                    first=last + 1,
                    through=reached - 1,
                )
            return (yield from self.recovery.recover(stream, last + 1, None, answer))
        if same is False:
            stream.end_replay_back_off()
        if not stream.may_clear():
            stream.suspend(self.warn, "restart", resume_from=0, checked=same is False)
            return []
        reset = self._restarted(stream, None, checked=same is False)
        return [reset, *(yield from self.recovery.recover(stream, 0, None))]

    def receive(
        self, stream: StreamState, frames: list[bytes]
    ) -> list[Message | StreamReset] | Replaying[list[Message | StreamReset]]:
        """What one live message of ``stream`` delivers: the batch, the replayed batches and
        resets before it, or nothing (a bad frame, a duplicate, a suspended stream). The next
        batch of a stream in order is delivered at once; any other message is worked out by a
        generator that may wait for replays (:data:`Replaying`)."""
        seq = self._check(stream, frames)
        if seq is None:
            return []
        self.stats.messages += 1
        last = stream.last
        if last is not None and seq == last + 1 and not stream.out_of_order:
            stream.jumped_to = None
            stream.last = stream.live_last = seq
            stream.last_payload = frames[2]
            return [Message(stream.source, seq, frames[0], frames[2], time.time_ns())]
        return self._sequence(stream, frames, seq)

    def _sequence(
        self, stream: StreamState, frames: list[bytes], seq: int
    ) -> Replaying[list[Message | StreamReset]]:
        """What :meth:`receive` delivers for any message but the next in order."""
        out: list[Message | StreamReset] = []
        endpoint = stream.source.endpoint
        if stream.suspended or stream.starting_over:
            if stream.suspended and not stream.may_clear():
                self._suspend(stream, seq)
                return out
            if stream.last is not None and seq <= stream.last:  # a new process since
                if stream.starting_over and not stream.suspended_by_restart:
                    self.start_over.replaced_after_clear(stream, seq)
                stream.suspended_for, stream.resume_from = "restart", 0
                stream.suspension_checked = True
                stream.forget_process()
            if stream.starting_over:  # cleared when its token came back
                return (yield from self._start_over(stream, frames, seq, out))
            return (yield from self._resync(stream, frames, seq, out, stream.suspended_for))
        last = stream.last
        checked: Replayed | None = None
        replaced = False  # a new process, its sequence already past the old last
        unanswered = False  # taken as replaced: consistency comes first
        if stream.reconnected:
            stream.reconnected = False
            if last is not None and seq > last:
                same, answer = yield from self.recovery.check_publisher(stream, last)
                checked, replaced = (answer, False) if same else (None, True)
                unanswered = same is None
        if last is not None and (replaced or seq <= last):
            if not replaced and stream.live_last < seq <= stream.replayed_through:
                self.stats.duplicates += 1
                stream.live_last = seq
                return out
            # A new process's replay endpoint is asked afresh, unless it just did not answer.
            if not unanswered:
                stream.end_replay_back_off()
            if not stream.may_clear():
                # A new process (or, unanswered, maybe): its batches from 0.
                self._suspend(stream, seq, resume_from=0, checked=not unanswered)
                return out
            out.append(self._restarted(stream, seq, checked=not unanswered))
            last = None
        if last is None and stream.unconfirmed_last is not None and seq <= stream.unconfirmed_last:
            stream.unconfirmed_last = None  # the same process would not have gone back
        expected = 0 if last is None else last + 1
        if seq > expected:
            if last is not None and seq - expected > self.max_gap:
                if stream.jumped_to is None or seq != stream.jumped_to + 1:
                    stream.jumped_to = seq
                    self._bad(stream, BadFrame.SEQ_JUMP, seq)
                    return out
                if not stream.may_clear():  # it did move there: start over
                    self._suspend(stream, seq)
                    return out
                return (yield from self._resync(stream, frames, seq, out))
            if last is not None:
                self.stats.gaps += 1
                self.info("gap detected", (endpoint,), stream=endpoint, expected=expected, seq=seq)
            out.extend((yield from self.recovery.recover(stream, expected, seq, checked)))
            if stream.suspended:
                stream.skipped_last = seq
                self.stats.bad_frames[BadFrame.THROTTLED] += 1
                return out
            stream.live_last = seq
            if stream.last is not None and seq <= stream.last:
                self.stats.duplicates += 1
                return out  # the replay already delivered this one
        stream.jumped_to = None
        return self._deliver(stream, frames, seq, out)
