"""The subscriber's side of vLLM's replay protocol: asking a source's replay socket for the
batches a stream missed, within bounds, and turning what cannot be had into resets.

A DEALER per request, closed with its answer, speaks both reply layouts (without a topic
frame before vLLM 0.26, with one after; :mod:`~kvbridge.adapters.replay_protocol` has the
frames): a late reply or the tail of an answer cut short is never read as the next answer's,
and the DEALER's monitor sees the whole of its one connection. Its uses, and the bounds on
one answer:

- **recovery** (:meth:`ReplayClient.recover`): a gap, or the start of a stream, is filled from
  the replay. What it cannot deliver (an aged-out buffer, no replay endpoint, a timeout, a
  back-off) is
  counted ``lost`` and a :class:`~kvbridge.adapters.source.StreamReset` goes out at the point
  of the loss, since a lost removal would leave a stale block downstream (what a timeout or a
  back-off cost is repaired later if it can be, see :mod:`~kvbridge.adapters.repairs`);
- **the publisher check** after a reconnect (:meth:`ReplayClient.check_publisher`): the batch
  delivered last, replayed, must be the same bytes, or the publisher is a new process;
- **a start-over** after a suspension (:meth:`ReplayClient.run_before`): the batches the
  suspension skipped, after the clear, as far as they reach the next live one unbroken;
- **bounds** on one answer: at most ``max_messages`` batches and ``max_bytes`` of payload are
  read [:data:`DEFAULT_REPLAY_MAX_MESSAGES`, :data:`DEFAULT_REPLAY_MAX_BYTES`]; the rest is
  discarded (``replay_truncated``) and what it held counts as lost;
- **refused batches**: a batch past ``MAXMSGSIZE`` (``max_frame_bytes`` and a margin) is
  refused by ZMQ, which drops the DEALER's connection and with it the rest of the answer (see
  :mod:`~kvbridge.adapters.replay_answer`). The batch is counted (``refused``) and the rest
  asked for again, from the batch after it, on a new DEALER, within the same deadline: the
  refused batch is a loss at its place, and the engine's batches after it still come. (A
  batch refused live drops the SUB's connection, and the publisher check's replay meets it
  again.) A refusal before any frame of its request falls on the first batch the engine
  holds from the request's start, taken to be that start; a second such refusal in a row
  cuts the answer, since the engine may no longer hold the start;
- **back-off** after a timeout: while a replay waits for its answer, its source is not read
  (the others are, see :mod:`~kvbridge.adapters.replays_in_flight`). So after a replay of a
  source times out, that source's replays are not asked for (``replays_skipped``, their
  batches count as lost) for as long as the timeout, then twice as long after each further
  timeout in a row, up to :data:`REPLAY_BACKOFF_MAX_S`; an answer ends the back-off. A dead
  replay endpoint then holds up its source one timeout a back-off, not one a gap.

The recovery methods are generators (:data:`Replaying`): they yield a :class:`Fetch` where
they need an answer, and the subscriber sends the request (:meth:`ReplayClient.begin`), reads
the answer as it arrives (:meth:`ReplayClient.read`) and sends it back
(:meth:`ReplayClient.end`).
"""

from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import KW_ONLY, dataclass
from typing import Final, TypeAlias, TypeVar

import zmq

from kvbridge._backoff import doubling_backoff_s
from kvbridge.adapters.endpoints import MAX_HWM, allow_ipv6, loopback
from kvbridge.adapters.logs import LogLimiter
from kvbridge.adapters.monitors import watch
from kvbridge.adapters.replay_answer import (
    WATCHED,
    Answer,
    Fetch,
    Replayed,
    close_replay_sockets,
    run_before,
)
from kvbridge.adapters.replay_protocol import END_SEQ, parse_answer, request_frames
from kvbridge.adapters.source import Message, StreamReset
from kvbridge.adapters.stream_state import StreamState
from kvbridge.adapters.stream_stats import BadFrame, SubscriberStats

__all__ = [
    "DEFAULT_REPLAY_MAX_BYTES",
    "DEFAULT_REPLAY_MAX_MESSAGES",
    "REPLAY_BACKOFF_MAX_S",
    "ReplayClient",
    "Replaying",
]

DEFAULT_REPLAY_MAX_MESSAGES: Final = 100_000
DEFAULT_REPLAY_MAX_BYTES: Final = 256 * 1024 * 1024
REPLAY_BACKOFF_MAX_S: Final = 60.0
"""The longest a source's replays are skipped after timeouts in a row."""


_T = TypeVar("_T")
Replaying: TypeAlias = Generator[Fetch, Replayed, _T]
"""Sequencing that may wait for replays: a generator that yields each :class:`Fetch`, is sent
its batches, and returns its result. Whoever drives it sends the requests and reads the
answers alongside everything else (see :mod:`~kvbridge.adapters.replays_in_flight`)."""


@dataclass(eq=False)
class ReplayClient:
    """Replays for the streams of one subscriber, counted in the subscriber's stats.

    ``max_frame_bytes`` and ``maxmsgsize`` are the subscriber's own, so that a replayed batch
    meets the bounds of a live one; so is ``rcvhwm``, raised on a DEALER to hold a whole
    answer (:attr:`answer_hwm`); ``max_gap`` tells a loss from a resync.
    """

    context: zmq.Context[zmq.Socket[bytes]]
    stats: SubscriberStats
    warn: LogLimiter
    """The subscriber's limiter: one budget of lines per stream and event, whoever logs."""
    _: KW_ONLY
    timeout: float
    """Seconds one answer may take, to its end marker."""
    max_messages: int
    max_bytes: int
    max_frame_bytes: int
    maxmsgsize: int
    rcvhwm: int
    max_gap: int

    @property
    def answer_hwm(self) -> int:
        """The DEALER's ``RCVHWM``: at least a whole answer within the bounds
        (``max_messages`` batches and the end marker). An answer is read at each poll, and
        between two polls it waits in ZMQ's queue; when that is full the engine's ROUTER drops
        the rest, since vLLM before 0.33 queues no more than ZMQ's default of 1,000 messages to
        send. ``rcvhwm`` 0 (no bound) stays 0."""
        if self.rcvhwm == 0:
            return 0
        return min(max(self.rcvhwm, self.max_messages + 1), MAX_HWM)

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

    def begin(self, fetch: Fetch) -> Answer | None:
        """Send ``fetch``'s request (both vLLM reply layouts are read); ``None`` if it is not
        asked for, within the source's back-off after a timeout (see the module's "back-off"),
        unless ``fetch.in_back_off``, or if it cannot be sent (counted and backed off as a
        timeout): its answer is empty."""
        stream = fetch.stream
        if not fetch.in_back_off and time.monotonic() < stream.replay_resumes_at:
            self.stats.replays_skipped += 1
            return None
        sent = self._ask(stream, fetch.start)
        if sent is None:
            return None
        return Answer(stream, fetch.start, *sent, deadline=time.monotonic() + self.timeout)

    def _ask(
        self, stream: StreamState, start: int
    ) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]] | None:
        """Send a request for every batch of ``stream`` from ``start`` (counted in
        ``replays``) on a new DEALER: the DEALER and its monitor, or ``None`` if it cannot be
        sent (counted and backed off as a timeout)."""
        self.stats.replays += 1
        source = stream.source
        assert source.replay_endpoint is not None
        dealer = monitor = None
        try:
            dealer = self.context.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.RCVHWM, self.answer_hwm)
            dealer.setsockopt(zmq.MAXMSGSIZE, self.maxmsgsize)
            monitor = watch(dealer, WATCHED)
            address = loopback(source.replay_endpoint)
            allow_ipv6(dealer, address)
            dealer.connect(address)
            dealer.send_multipart(request_frames(start), zmq.NOBLOCK)
        except zmq.ZMQError as error:  # no socket to be had, or its queue full: unanswered
            close_replay_sockets(dealer, monitor)
            endpoint = source.replay_endpoint
            self.warn("replay not sent", (endpoint,), stream=endpoint, error=str(error))
            self.stats.replay_timeouts += 1
            self._back_off(stream)
            return None
        return dealer, monitor

    def read(self, answer: Answer) -> bool:
        """Read what has arrived of ``answer``, without waiting; whether it is over: its end
        marker came, or its bounds were reached (``max_messages`` batches, ``max_bytes`` of
        payload), past which the rest is discarded and counts as lost (``replay_truncated``),
        or a batch of it was refused and what follows could not be asked for (see the module's
        "refused batches"). After a refusal, ``answer`` reads a new DEALER."""
        if self._read_frames(answer):
            return True
        answer.watch()
        return answer.refused() and not self._ask_past_refused(answer)

    def _ask_past_refused(self, answer: Answer) -> bool:
        """Count the batch of ``answer`` that ZMQ refused and ask for those after it on a new
        DEALER (ZMQ does not connect the old one again); whether they were asked for. If not
        (the refused batch is not known, or is a second in a row before any frame of its
        request, or the last seq there is, or the answer's time is up, or the request could
        not be sent) the answer is cut there."""
        stream, refused = answer.stream, answer.next_seq
        stream.skip_frame(self.stats, self.warn, BadFrame.REFUSED, refused)
        answer.skipped = True
        close_replay_sockets(*answer.sockets)
        sent = None
        if answer.may_ask_past():
            assert refused is not None
            sent = self._ask(stream, refused + 1)
        if sent is None:
            answer.cut = True
            return False
        answer.asked_past(*sent)
        return True

    def _read_frames(self, answer: Answer) -> bool:
        """Read the frames of ``answer`` that have arrived; whether it came to its end marker
        or its bounds."""
        stream = answer.stream
        source = stream.source
        expected_topic = source.topic.encode()
        while True:
            try:
                frames = answer.dealer.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return False
            parsed = parse_answer(frames, expected_topic)
            if parsed is None:
                stream.skip_frame(self.stats, self.warn, BadFrame.REPLAY_FRAME_COUNT)
                answer.skipped = True
                answer.took(None)
                continue
            topic, seq_frame, payload = parsed
            stream.replay_failures = 0  # it answers
            if seq_frame == END_SEQ or not payload:
                answer.ended = True
                return True
            if len(seq_frame) != 8:
                stream.skip_frame(self.stats, self.warn, BadFrame.BAD_SEQ)
                answer.skipped = True
                answer.took(None)
                continue
            seq = int.from_bytes(seq_frame, "big")
            answer.took(seq)
            if len(payload) > self.max_frame_bytes:
                stream.skip_frame(self.stats, self.warn, BadFrame.OVERSIZED, seq)
                answer.skipped = True
                continue
            answer.messages.append(
                Message(source, seq, topic, payload, time.time_ns(), replayed=True)
            )
            answer.size += len(payload)
            if len(answer.messages) >= self.max_messages or answer.size >= self.max_bytes:
                self.stats.replay_truncated += 1
                self.warn(
                    "replay answer truncated",
                    (source.replay_endpoint,),
                    stream=source.replay_endpoint,
                    messages=len(answer.messages),
                    bytes=answer.size,
                )
                answer.cut = True
                return True

    def end(self, answer: Answer, *, timed_out: bool) -> Replayed:
        """The batches of ``answer``, over or past its deadline (a timeout: the source backs
        off); its DEALER is closed. The caller no longer polls it."""
        stream = answer.stream
        if timed_out:
            endpoint = stream.source.replay_endpoint
            self.warn("replay timed out", (endpoint,), stream=endpoint, start=answer.start)
            self.stats.replay_timeouts += 1
            self._back_off(stream)
        close_replay_sockets(*answer.sockets)
        return answer.replayed(timed_out=timed_out)

    def _back_off(self, stream: StreamState) -> None:
        """Skip the replays of ``stream`` for a while after a timeout (see the module's
        "back-off")."""
        stream.replay_failures += 1
        backoff = doubling_backoff_s(self.timeout, stream.replay_failures, REPLAY_BACKOFF_MAX_S)
        stream.replay_resumes_at = time.monotonic() + backoff
        endpoint = stream.source.replay_endpoint
        self.warn(
            "replays skipped after a timeout",
            (endpoint,),
            stream=endpoint,
            seconds=round(backoff, 3),
            timeouts_in_a_row=stream.replay_failures,
        )
