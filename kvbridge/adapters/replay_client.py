"""The subscriber's side of vLLM's replay protocol: asking a source's replay socket for the
batches a stream missed and reading the answer, within bounds.

What an answer means for its stream is decided by
:class:`~kvbridge.adapters.replay_recovery.ReplayRecovery`, which yields a
:class:`~kvbridge.adapters.replay_answer.Fetch` where it needs one; the subscriber's
:class:`~kvbridge.adapters.replays_in_flight.ReplaysInFlight` sends the request
(:meth:`ReplayClient.begin`), reads the answer as it arrives (:meth:`ReplayClient.read`) and
sends it back (:meth:`ReplayClient.end`).

A DEALER per request, closed with its answer, speaks both reply layouts (without a topic
frame before vLLM 0.26, with one after; :mod:`~kvbridge.adapters.replay_protocol` has the
frames): a late reply or the tail of an answer cut short is never read as the next answer's,
and the DEALER's monitor sees the whole of its one connection. The bounds on one answer, and
the back-off:

- **size**: at most ``max_messages`` batches and ``max_bytes`` of payload are read
  [:data:`DEFAULT_REPLAY_MAX_MESSAGES`, :data:`DEFAULT_REPLAY_MAX_BYTES`]; the rest is
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
"""

from __future__ import annotations

import time
from dataclasses import KW_ONLY, dataclass
from typing import Final

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
)
from kvbridge.adapters.replay_protocol import END_SEQ, parse_answer, request_frames
from kvbridge.adapters.source import Message
from kvbridge.adapters.stream_state import StreamState
from kvbridge.adapters.stream_stats import BadFrame, SubscriberStats

__all__ = [
    "DEFAULT_REPLAY_MAX_BYTES",
    "DEFAULT_REPLAY_MAX_MESSAGES",
    "REPLAY_BACKOFF_MAX_S",
    "ReplayClient",
]

DEFAULT_REPLAY_MAX_MESSAGES: Final = 100_000
DEFAULT_REPLAY_MAX_BYTES: Final = 256 * 1024 * 1024
REPLAY_BACKOFF_MAX_S: Final = 60.0
"""The longest a source's replays are skipped after timeouts in a row."""


@dataclass(eq=False)
class ReplayClient:
    """Replays for the streams of one subscriber, counted in the subscriber's stats.

    ``max_frame_bytes`` and ``maxmsgsize`` are the subscriber's own, so that a replayed batch
    meets the bounds of a live one; so is ``rcvhwm``, raised on a DEALER to hold a whole
    answer (:attr:`answer_hwm`).
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
            stream.end_replay_back_off()  # it answers
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
