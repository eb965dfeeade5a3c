"""What the subscriber remembers about one source's stream, and the rate limit on its clears.

Sequence numbers only mean something per publisher, so each source has its own
:class:`StreamState`: its sockets, where its sequence stands (live and through replays), the
payload of its last batch (to recognise its publisher after a reconnect) and its clear bucket.

**Clears**: every :class:`~kvbridge.adapters.source.StreamReset` takes a token from its source's
bucket, which holds ``clear_burst`` tokens and refills at one per ``clear_interval`` seconds.
A discontinuity that finds the bucket empty *suspends* the stream (see
:mod:`~kvbridge.adapters.sequencing`) until a token is back, and then the clear goes out, whether
or not the source sends (:meth:`StreamState.release`). So a source gets at most
``clear_burst + T / clear_interval`` clears in ``T`` seconds, whatever its sequence numbers do:
a publisher that sends nonsense cannot make every consumer downstream clear the worker in a
loop.
"""

from __future__ import annotations

import time

import zmq

from kvbridge.adapters.logs import LogLimiter
from kvbridge.adapters.source import ResetReason, Source, StreamReset
from kvbridge.adapters.stream_stats import BadFrame, SubscriberStats, skip_bad_frame

__all__ = ["StreamState"]


class StreamState:
    """One source's stream: sockets, sequence position and clear tokens."""

    __slots__ = (
        "address",
        "clear_burst",
        "clear_interval",
        "connected",
        "drops",
        "jumped_to",
        "last",
        "last_payload",
        "live_last",
        "lost",
        "monitor",
        "reconnected",
        "repair_from",
        "repair_latest",
        "repair_tries",
        "replay_failures",
        "replay_resumes_at",
        "replayed_through",
        "resume_from",
        "skipped_last",
        "socket",
        "source",
        "starting_over",
        "suspended",
        "suspended_for",
        "suspension_checked",
        "tokens",
        "tokens_at",
        "unconfirmed_last",
    )

    def __init__(
        self,
        source: Source,
        socket: zmq.Socket[bytes],
        *,
        clear_burst: int,
        clear_interval: float,
    ) -> None:
        self.source = source
        self.socket = socket
        self.address: str | None = None
        """The address the SUB connects to (``None`` if it binds): reconnected after a drop."""
        self.monitor: zmq.Socket[bytes] | None = None
        self.clear_burst = clear_burst
        self.clear_interval = clear_interval
        self.tokens = float(clear_burst)
        """Clears this source may still send now."""
        self.tokens_at = time.monotonic()
        self.suspended = False
        """A discontinuity found no token: skip everything until one is back, then resync."""
        self.suspended_for: ResetReason = "restart"
        """What the clear that found no token was for, and so the reset a release sends: a
        loss (the same process goes on) keeps the worker's identities downstream, a restart or
        a jump does not (unless :attr:`suspension_checked` is ``False``)."""
        self.suspension_checked = True
        """For a restart's suspension: ``False`` if it was taken from a publisher check that
        went unanswered, whose reset keeps the identities too (see
        :attr:`StreamReset.checked <kvbridge.adapters.source.StreamReset.checked>`); spent by
        the reset that ends the suspension."""
        self.resume_from: int | None = None
        """The first batch a suspension skipped, that the replay may still hold: the loss's
        first batch, or 0 for a new process. When the stream starts over, the run of them that
        the replay holds is delivered (see :mod:`~kvbridge.adapters.sequencing`).
        ``None`` for a jump, whose skipped batches mean nothing."""
        self.starting_over = False
        """Cleared when a token came back after a suspension: the stream is to start over,
        without another clear, from the replay its release asks for or at its next message."""
        self.jumped_to: int | None = None
        """The sequence of the last message skipped as a jump, to notice a stream that moved."""
        self.skipped_last: int | None = None
        """The sequence of the last live message read since the suspension began (skipped, or
        the one whose recovery suspended the stream); ``None`` if none was. Live copies of a
        start-over's batches that come after it are duplicates only above this: one at or
        below it is a new sequence."""
        self.drops = 0
        """Connections of this stream that dropped, to tell a drop during a replay's wait."""
        self.connected = True
        """False from a drop until the handshake after it (when the drop's catch-up runs)."""
        self.last: int | None = None
        """Highest sequence delivered, live or through a replay."""
        self.last_payload = b""
        """The payload of batch ``last``, to tell after a reconnect whether the publisher is
        the same (its replay of that sequence is the same bytes) or a new process."""
        self.reconnected = False
        """The connection dropped since the last message: check the publisher (see the
        subscriber's "reconnects") before the next message is taken as a continuation."""
        self.replay_failures = 0
        """Replays of this source that timed out in a row."""
        self.repair_from: int | None = None
        """The first batch of a loss whose replay went unanswered (it timed out, was skipped
        within a back-off, or could not be sent), while the engine may still hold it: once
        the back-off has passed, the stream is repaired from there (see
        :mod:`~kvbridge.adapters.repairs`). ``None`` when nothing is to be repaired, or the
        loss is for good (an answer without the batches, a new process)."""
        self.repair_latest = 0
        """While :attr:`repair_from` is set: the first batch of the latest loss to repair. A
        repair from a later batch than :attr:`repair_from` (the engine no longer holds the
        earliest loss) still repairs the losses from there."""
        self.repair_tries = 0
        """Repairs from :attr:`repair_from` that went unanswered. A later loss that the same
        repair covers adds no tries: the endpoint is the same."""
        self.replay_resumes_at = 0.0
        """Until then (``time.monotonic()``), after a timeout, no replay is asked for: see
        :meth:`ReplayClient.begin <kvbridge.adapters.replay_client.ReplayClient.begin>`."""
        self.live_last = -1
        """Highest sequence received live."""
        self.replayed_through = -1
        """Highest sequence a replay delivered. A live message above ``live_last`` and up to
        this is a late copy of a replayed batch; anything else that goes back is a restart."""
        self.lost = 0
        """Batches of this stream that no replay could recover: its share of the subscriber's
        ``lost``. A suspended stream's loss is known only when it starts over, after the
        ``"lost"`` reset of its release went out, so the resets alone undercount it."""
        self.unconfirmed_last: int | None = None
        """After a clear for a restart that the publisher check could not confirm (an
        unchecked reset), until the next batch is delivered: the last batch delivered before
        that clear. If the same process goes on, the batches up to it were delivered, so only
        those after it count as lost (:meth:`lose`): the count is a lower bound, exact if the
        process is the same."""

    @property
    def out_of_order(self) -> bool:
        """Whether even the next batch in sequence needs more than delivering: the stream is
        suspended, starting over, or reconnected (its publisher to be checked)."""
        return self.suspended or self.starting_over or self.reconnected

    def counts_lost_from(self, first: int) -> int:
        """Of the missing batches from ``first``, the first that counts as lost: after an
        unconfirmed clear (:attr:`unconfirmed_last`), the first past its old last, since the
        same process delivered those up to it before the clear."""
        if self.unconfirmed_last is None:
            return first
        return max(first, self.unconfirmed_last + 1)

    def lose(self, stats: SubscriberStats, warn: LogLimiter, first: int, count: int) -> None:
        """Count ``count`` batches from ``first`` as lost, and log them: after an unconfirmed
        clear, only those from :meth:`counts_lost_from` (the log gives both). If the replay
        that should have delivered them went unanswered (:attr:`replay_failures`), they are
        to be repaired later (:attr:`repair_from`); if it answered without them, they are
        lost for good, and so is any repair from before them."""
        if not self.replay_failures:
            self.repair_from = None
        elif self.repair_from is None:
            self.repair_from, self.repair_latest, self.repair_tries = first, first, 0
        else:
            self.repair_from = min(first, self.repair_from)
            self.repair_latest = max(first, self.repair_latest)
        end = first + count
        first = self.counts_lost_from(first)
        counted = max(0, end - first)
        if not counted:
            return
        stats.lost += counted
        self.lost += counted
        endpoint = self.source.endpoint
        at_most = {} if counted == count else {"at_most": count}
        warn("batches lost", (endpoint,), stream=endpoint, first=first, count=counted, **at_most)

    def delivered(self, seq: int, payload: bytes) -> None:
        """Batch ``seq`` went out: it is the stream's last, and no clear before it is
        unconfirmed any more."""
        self.last = seq
        self.last_payload = payload
        self.unconfirmed_last = None

    def may_clear(self) -> bool:
        """Whether a token is there for a clear, after refilling the bucket for the time
        since the last look."""
        now = time.monotonic()
        interval = self.clear_interval
        refill = (now - self.tokens_at) / interval if interval > 0 else 1
        self.tokens = min(float(self.clear_burst), self.tokens + refill)
        self.tokens_at = now
        return self.tokens >= 1

    def clear_allowed_at(self) -> float:
        """When (``time.monotonic()``) a token is there for a clear: now or earlier if one is
        there already, else when the bucket's refill brings the next one."""
        if self.tokens >= 1 or self.clear_interval <= 0:
            return self.tokens_at
        return self.tokens_at + (1 - self.tokens) * self.clear_interval

    def due_at(self) -> float | None:
        """When (``time.monotonic()``) this stream has something to do without a message: a
        suspension to release (:meth:`release`), or a repair to start (:meth:`repair_due`), if
        it waits for no replay. ``None`` if neither waits for time alone. The subscriber's poll
        waits no longer than this, so that a long poll does not make either late."""
        if self.suspended:
            return self.clear_allowed_at()
        if self._repair_pending():
            return max(self.clear_allowed_at(), self.replay_resumes_at)
        return None

    def _repair_pending(self) -> bool:
        """Whether a repair waits for time alone: a loss waits for it (:attr:`repair_from`),
        and the stream is in order and has delivered a batch since."""
        return self.repair_from is not None and self.last is not None and not self.out_of_order

    def reset(self, reason: ResetReason, lost: int = 0, *, checked: bool = True) -> StreamReset:
        """A reset of this stream, which takes a token; the caller has checked
        :meth:`may_clear` (``checked``: see :attr:`StreamReset.checked
        <kvbridge.adapters.source.StreamReset.checked>`)."""
        self.tokens -= 1
        self.unconfirmed_last = None if checked else self.last
        if reason == "restart":
            self.repair_from = None  # a new sequence: the old one's batches mean nothing
        return StreamReset(self.source, reason, lost, checked)

    @property
    def suspended_by_restart(self) -> bool:
        """Whether the suspension is a new process's (its batches from 0 to be replayed), not
        a jump's or a loss's. False outside a suspension and the start-over that ends it,
        where :attr:`resume_from` is ``None``."""
        return self.suspended_for == "restart" and self.resume_from == 0

    def count_start_over(self, stats: SubscriberStats) -> str:
        """Count the clear that starts the stream over: a restart for a new process whose
        clear waited for a token, else a resync. Returns which, for the log."""
        if self.suspended_by_restart:
            stats.restarts += 1
            return "restart"
        stats.resyncs += 1
        return "resync"

    def resync(
        self,
        stats: SubscriberStats,
        warn: LogLimiter,
        seq: int,
        reason: ResetReason = "restart",
    ) -> StreamReset:
        """The reset that starts the stream over at ``seq``, counted
        (:meth:`count_start_over`) and logged; the caller has checked :meth:`may_clear`. A
        ``"lost"`` one is for a stream suspended by a loss (see :attr:`suspended_for`)."""
        counted = self.count_start_over(stats)
        endpoint = self.source.endpoint
        warn("stream started over", (endpoint,), stream=endpoint, seq=seq, counted=counted)
        return self.reset(reason, checked=self._spend_suspension_check())

    def release(self, stats: SubscriberStats, warn: LogLimiter) -> StreamReset | None:
        """The clear of a suspended stream, once a token is back; ``None`` before that.

        The clear goes out as soon as it is allowed, not with the source's next message: a
        source gone quiet would otherwise leave its worker's blocks from before the
        discontinuity downstream for as long as it stays quiet. The stream then starts over
        (:attr:`starting_over`), from the replay the subscriber asks for at once or at its
        next message. The reset is of the kind the suspension was
        for (:attr:`suspended_for`), and counted as a restart or a resync
        (:meth:`count_start_over`)."""
        if not (self.suspended and self.may_clear()):
            return None
        self.suspended = False
        self.starting_over = True
        self.jumped_to = None
        counted = self.count_start_over(stats)
        endpoint = self.source.endpoint
        warn(
            "clears allowed again, stream cleared",
            (endpoint,),
            stream=endpoint,
            last=self.last,
            counted=counted,
        )
        return self.reset(self.suspended_for, checked=self._spend_suspension_check())

    def _spend_suspension_check(self) -> bool:
        """:attr:`suspension_checked` for the reset that ends a suspension, and ``True`` again
        for any later one."""
        checked, self.suspension_checked = self.suspension_checked, True
        return checked

    def repair_due(self) -> bool:
        """Whether the stream is to be repaired now: a loss waits for it (:attr:`repair_from`),
        the stream is in order and has delivered a batch since, the replay back-off has passed
        and a clear is allowed."""
        return (
            self._repair_pending()
            and time.monotonic() >= self.replay_resumes_at
            and self.may_clear()
        )

    def forget_process(self) -> None:
        """The publisher is a new process: what was kept of the old one's stream (a clear it
        could not confirm, a loss to repair, its replay endpoint's back-off) means nothing."""
        self.unconfirmed_last = None
        self.repair_from = None
        self.end_replay_back_off()

    def end_replay_back_off(self) -> None:
        """Ask this source's replay endpoint again from now on: its publisher dropped or was
        replaced, so the timeouts before say nothing of it."""
        self.replay_failures = 0
        self.replay_resumes_at = 0.0

    def skip_frame(
        self, stats: SubscriberStats, warn: LogLimiter, reason: BadFrame, seq: int | None = None
    ) -> None:
        """Count and log a frame of this stream skipped for ``reason``
        (:func:`~kvbridge.adapters.stream_stats.skip_bad_frame`)."""
        skip_bad_frame(stats.bad_frames, warn, self.source.endpoint, reason, seq)

    def suspend(
        self,
        warn: LogLimiter,
        reason: ResetReason,
        seq: int | None = None,
        *,
        resume_from: int | None = None,
        checked: bool = True,
    ) -> None:
        """No token for the clear a discontinuity needs (a ``reason`` reset, ``checked`` as
        :attr:`suspension_checked`): skip until one is back, then resync, replaying from
        ``resume_from`` (:attr:`resume_from`). Logs the suspension once; the caller counts what
        it skips."""
        if self.suspended:
            return
        self.suspended = True
        self.suspended_for = reason
        self.suspension_checked = checked
        self.resume_from = resume_from
        self.skipped_last = seq
        endpoint = self.source.endpoint
        at = {} if seq is None else {"seq": seq}
        warn("clears throttled, stream suspended", (endpoint,), stream=endpoint, **at)
