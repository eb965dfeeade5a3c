"""Subscribing to vLLM's KV-event publishers: sequence tracking, gap replay, restart detection.

Each source gets its own SUB socket, because a SUB socket connected to several publishers
cannot tell whose message it received, and sequence numbers only mean something per publisher.
The subscriber hands on raw frames and never decodes a payload; its consumer (the relay, the
recorder) decides what a batch means.

What it does about sequence numbers, per source:

- **gap** (``seq > last + 1``): asks the source's replay socket for the missing batches with a
  DEALER, speaking both replay layouts (without a topic frame before vLLM 0.26, with one after);
- **first message** not at sequence 0 and a replay endpoint known: replays from 0; with
  ``replay_on_start`` it asks for that replay before any live message, so that the batches of
  an engine that has gone idle arrive too;
- **aged-out replay** (the first replayed sequence is past the one asked for) or no replay
  endpoint: the missing batches are counted as lost and a :class:`StreamReset` tells the
  consumer to clear the worker, since a lost removal would leave a stale block behind;
- **restart** (the sequence goes backwards, outside a window just covered by a replay): a
  :class:`StreamReset`, then the stream starts over;
- **reconnects**: a SUB socket's connection that drops (the engine exited, a frame ZMQ refused,
  ZMTP heartbeats unanswered for :data:`HEARTBEAT_TIMEOUT_MS`) is seen by a socket monitor
  (``disconnects``). The engine may have been replaced by a new process whose sequence has
  already passed the old last, which the sequence numbers alone cannot show. So the first
  message after a drop that continues the sequence checks the publisher
  (``reconnect_checks``): it asks the replay socket for the last batch delivered. The same
  bytes mean the same process, and that answer also fills the gap; anything else (different
  bytes, nothing, a buffer that no longer holds it) is a restart (``restarts``): a
  :class:`StreamReset`, then a replay from 0. Consistency comes before stale hits. Without a
  replay endpoint the publisher is taken as the same, and a gap after the drop is lost and
  clears the worker downstream anyway;
- **bad frames** (wrong frame count, a frame over ``max_frame_bytes``, a sequence frame that is
  not 8 bytes): counted by reason and skipped.

Limits, so that no input can take the subscriber's memory or time (defaults in brackets):

- **a budget per poll**: :meth:`Subscriber.poll` reads the ready sources round-robin, at most
  :data:`POLL_ROUND` messages from each per round, at most ``source_budget`` from one source
  [:data:`DEFAULT_SOURCE_BUDGET`] and ``poll_budget`` in all [:data:`DEFAULT_POLL_BUDGET`]; the
  next poll starts with the source after the last one served. A fast source cannot starve the
  others, and the consumer processes what it read before reading more.
- **frame size refused by ZMQ**: ``MAXMSGSIZE`` on the SUB and DEALER sockets is
  ``max_frame_bytes`` plus :data:`MAXMSGSIZE_MARGIN`. A frame a little over ``max_frame_bytes``
  is received and counted ``bad_frame:oversized``; a larger one is refused by ZMQ as its size
  header arrives, before any of it is buffered. ZMQ then drops the connection and, after that
  protocol error, does not reconnect by itself: the subscriber watches each SUB socket (a
  socket monitor), counts ``disconnects`` and reconnects. What was sent meanwhile shows up as
  a gap.
- **high-water marks**: ``RCVHWM`` [:data:`DEFAULT_RCVHWM` messages] on every SUB and DEALER.
  Under a flood, ZMQ sheds what does not fit (the engine's PUB drops it); the shed batches are
  sequence gaps, replayed or counted ``lost``.
- **replay answers**: at most ``replay_max_messages`` [:data:`DEFAULT_REPLAY_MAX_MESSAGES`] and
  ``replay_max_bytes`` [:data:`DEFAULT_REPLAY_MAX_BYTES`] are read from one answer; the rest is
  discarded (``replay_truncated``) and what it held counts as lost.
- **sequence jumps**: a forward jump of more than ``max_gap`` [:data:`DEFAULT_MAX_GAP`] is bad
  input (``bad_frame:seq_jump``), skipped, not a replay of 10**22 batches. If the next message
  continues from the jump, the stream did move there: it is *resynchronized* (``resyncs``), a
  :class:`StreamReset` (``"restart"``) and the stream goes on from there. A first message (or a
  first replayed batch) that far past 0 is a resync too, with nothing counted as lost.
- **clears**: every :class:`StreamReset` takes a token from its source's bucket, which holds
  ``clear_burst`` [:data:`DEFAULT_CLEAR_BURST`] and refills at one token per
  ``clear_interval`` s [:data:`DEFAULT_CLEAR_INTERVAL_S`]. A restart, gap or jump that finds the
  bucket empty *suspends* the stream: no replay, every message skipped and counted
  ``bad_frame:throttled`` until a token is back; the first message after that is a resync,
  and the sequence numbers it skips forward (up to ``max_gap``) are counted ``lost``. So
  a source gets at most ``clear_burst + T / clear_interval`` clears in ``T`` seconds, whatever
  its sequence numbers do.
- **logs**: every per-frame line goes through a :class:`~kvbridge.adapters.logs.LogLimiter`, per
  stream and reason; the stats count every frame.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from typing import Final, Literal

import structlog
import zmq

from kvbridge.adapters.logs import LogLimiter
from kvbridge.adapters.replay_protocol import END_SEQ, parse_answer, request_frames
from kvbridge.adapters.source import Message, Source, StreamReset, connect_address
from kvbridge.adapters.stream_stats import BadFrame, SubscriberStats

__all__ = [
    "Message",
    "Source",
    "StreamReset",
    "Subscriber",
    "connect_address",
]

DEFAULT_MAX_FRAME_BYTES: Final = 64 * 1024 * 1024
MAXMSGSIZE_MARGIN: Final = 64 * 1024
"""How far past ``max_frame_bytes`` a frame is still received (to be counted oversized)."""
DEFAULT_RCVHWM: Final = 10_000
"""Messages ZMQ queues per SUB or DEALER socket before it sheds (0 would be unbounded)."""
DEFAULT_POLL_BUDGET: Final = 4096
"""Messages one :meth:`Subscriber.poll` reads at most, over all sources."""
DEFAULT_SOURCE_BUDGET: Final = 256
"""Messages one :meth:`Subscriber.poll` reads at most from one source."""
POLL_ROUND: Final = 32
"""Messages read from a source before the next ready source gets its turn."""
DEFAULT_MAX_GAP: Final = 1 << 20
"""A forward sequence jump larger than this is bad input, not a gap to replay."""
DEFAULT_CLEAR_BURST: Final = 3
DEFAULT_CLEAR_INTERVAL_S: Final = 1.0
DEFAULT_REPLAY_MAX_MESSAGES: Final = 100_000
DEFAULT_REPLAY_MAX_BYTES: Final = 256 * 1024 * 1024
HEARTBEAT_IVL_MS: Final = 2000
HEARTBEAT_TIMEOUT_MS: Final = 6000
"""ZMTP pings on every SUB: a publisher that stops answering (its host gone, no FIN) is
dropped after this, and the drop is handled as any other (see the module's "reconnects")."""

_NOBLOCK: Final = int(zmq.NOBLOCK)

log = structlog.get_logger("kvbridge.zmq")


def _recv_frames(socket: zmq.Socket[bytes]) -> list[bytes] | None:
    """``socket.recv_multipart(zmq.NOBLOCK)``, or ``None`` if no message waits, in half the
    time: pyzmq's version asks for ``RCVMORE`` with a ``getsockopt`` per frame, where a
    frame knows it (``Frame.more``); the bytes are the same copies."""
    try:
        frame = socket.recv(_NOBLOCK, copy=False)
    except zmq.Again:
        return None
    frames = [frame.bytes]
    while frame.more:  # the rest of a multipart message is already there: no Again
        frame = socket.recv(_NOBLOCK, copy=False)
        frames.append(frame.bytes)
    return frames


class _Stream:
    __slots__ = (
        "address",
        "dealer",
        "jumped_to",
        "last",
        "last_payload",
        "live_last",
        "monitor",
        "reconnected",
        "replayed_through",
        "socket",
        "source",
        "suspended",
        "tokens",
        "tokens_at",
    )

    def __init__(self, source: Source, socket: zmq.Socket[bytes], tokens: float) -> None:
        self.source = source
        self.socket = socket
        self.address: str | None = None
        """The address the SUB connects to (``None`` if it binds): reconnected after a drop."""
        self.monitor: zmq.Socket[bytes] | None = None
        self.tokens = tokens
        """Clears this source may still send now (see the module's "clears")."""
        self.tokens_at = time.monotonic()
        self.suspended = False
        """A discontinuity found no token: skip everything until one is back, then resync."""
        self.jumped_to: int | None = None
        """The sequence of the last message skipped as a jump, to notice a stream that moved."""
        self.dealer: zmq.Socket[bytes] | None = None
        self.last: int | None = None
        """Highest sequence delivered, live or through a replay."""
        self.last_payload = b""
        """The payload of batch ``last``, to tell after a reconnect whether the publisher is
        the same (its replay of that sequence is the same bytes) or a new process."""
        self.reconnected = False
        """The connection dropped since the last message: check the publisher (see the
        module's "reconnects") before the next message is taken as a continuation."""
        self.live_last = -1
        """Highest sequence received live."""
        self.replayed_through = -1
        """Highest sequence a replay delivered. A live message above ``live_last`` and up to
        this is a late copy of a replayed batch; anything else that goes back is a restart."""


class Subscriber:
    """Receives vLLM KV-event frames from several publishers and keeps each stream whole."""

    def __init__(
        self,
        sources: Iterable[Source],
        *,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        replay_timeout: float = 2.0,
        replay_on_start: bool = False,
        rcvhwm: int = DEFAULT_RCVHWM,
        poll_budget: int = DEFAULT_POLL_BUDGET,
        source_budget: int = DEFAULT_SOURCE_BUDGET,
        max_gap: int = DEFAULT_MAX_GAP,
        clear_burst: int = DEFAULT_CLEAR_BURST,
        clear_interval: float = DEFAULT_CLEAR_INTERVAL_S,
        replay_max_messages: int = DEFAULT_REPLAY_MAX_MESSAGES,
        replay_max_bytes: int = DEFAULT_REPLAY_MAX_BYTES,
        monitor: bool = True,
    ) -> None:
        if min(poll_budget, source_budget, max_gap, clear_burst, replay_max_messages) < 1:
            raise ValueError("budgets, max_gap, clear_burst and replay bounds must be >= 1")
        self.context = context or zmq.Context.instance()
        self.max_frame_bytes = max_frame_bytes
        self.replay_timeout = replay_timeout
        self.rcvhwm = rcvhwm
        self.poll_budget = poll_budget
        self.source_budget = source_budget
        self.max_gap = max_gap
        self.clear_burst = clear_burst
        self.clear_interval = clear_interval
        self.replay_max_messages = replay_max_messages
        self.replay_max_bytes = replay_max_bytes
        self.stats = SubscriberStats()
        """Every source's counts: messages, gaps, replays, losses, restarts, bad frames by
        :class:`~kvbridge.adapters.stream_stats.BadFrame`..."""
        self._warn = LogLimiter(log.warning)
        self._info = LogLimiter(log.info)
        self._poller = zmq.Poller()
        self._streams: dict[zmq.Socket[bytes], _Stream] = {}
        self._monitors: dict[zmq.Socket[bytes], _Stream] = {}
        self._order: dict[zmq.Socket[bytes], int] = {}
        self._next_first = 0
        """Where the next poll starts its round-robin (the source after the last served)."""
        self._monitor = monitor
        for source in sources:
            stream = _Stream(source, self._open(source), float(clear_burst))
            self._order[stream.socket] = len(self._streams)
            self._attach(stream)
        self._starting = [
            stream
            for stream in self._streams.values()
            if replay_on_start and stream.source.replay_endpoint
        ]

    def last_seq(self, source: Source) -> int | None:
        for stream in self._streams.values():
            if stream.source == source:
                return stream.last
        raise KeyError(source)

    @property
    def _maxmsgsize(self) -> int:
        return self.max_frame_bytes + MAXMSGSIZE_MARGIN

    def _open(self, source: Source) -> zmq.Socket[bytes]:
        socket = self.context.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RCVHWM, self.rcvhwm)
        socket.setsockopt(zmq.MAXMSGSIZE, self._maxmsgsize)
        socket.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        socket.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
        return socket

    def _attach(self, stream: _Stream) -> None:
        """Monitor (if it connects), bind or connect and poll ``stream.socket``."""
        source, socket = stream.source, stream.socket
        if self._monitor:
            stream.monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            self._monitors[stream.monitor] = stream
            self._poller.register(stream.monitor, zmq.POLLIN)
        if source.subscriber_binds:
            socket.bind(source.endpoint)
        else:
            stream.address = connect_address(source.endpoint)
            socket.connect(stream.address)
        self._streams[socket] = stream
        self._poller.register(socket, zmq.POLLIN)

    def _detach(self, stream: _Stream) -> None:
        if stream.monitor is not None:
            self._poller.unregister(stream.monitor)
            del self._monitors[stream.monitor]
            with contextlib.suppress(zmq.ZMQError):
                stream.socket.disable_monitor()
            stream.monitor.close(0)
            stream.monitor = None
        self._poller.unregister(stream.socket)
        del self._streams[stream.socket]
        stream.socket.close(0)

    def poll(self, timeout_ms: int = 100) -> list[Message | StreamReset]:
        """What arrived within ``timeout_ms``, within the budget, in stream order per source.

        Reads the ready sources round-robin (see the module's "limits"): at most
        ``source_budget`` messages from one source and ``poll_budget`` in all. What is left
        waits in ZMQ's queue (up to ``RCVHWM``) for the next poll.
        """
        out: list[Message | StreamReset] = []
        while self._starting:
            stream = self._starting.pop(0)
            if stream.last is None:
                out.extend(self._recover(stream, 0, None))
        events = self._poller.poll(timeout_ms)
        for socket, _ in events:
            monitored = self._monitors.get(socket)
            if monitored is not None:
                self._disconnected(monitored)
        # A SUB that dropped was replaced (closed) above, though it may be in this poll's
        # events: what it still held is a gap of the new socket's stream.
        ready = [socket for socket, _ in events if socket in self._streams]
        if not ready:
            return out
        order, count = self._order, len(self._order)
        first = self._next_first
        ready.sort(key=lambda socket: (order[socket] - first) % count)
        budget = self.poll_budget
        taken = dict.fromkeys(ready, 0)
        last_served, resume = ready[0], 1
        while ready and budget > 0:
            more: list[zmq.Socket[bytes]] = []
            for socket in ready:
                stream = self._streams[socket]
                quota = min(POLL_ROUND, self.source_budget - taken[socket], budget)
                read = 0
                while read < quota and (frames := _recv_frames(socket)) is not None:
                    read += 1
                    out.extend(self._receive(stream, frames))
                taken[socket] += read
                budget -= read
                if read == quota and taken[socket] < self.source_budget:
                    more.append(socket)  # may hold more
                if budget <= 0:
                    # Cut short by the budget: the next poll starts with this source.
                    cut_short = read < POLL_ROUND and read == quota
                    last_served, resume = socket, 0 if cut_short else 1
                    break
                last_served, resume = socket, 1
            ready = more
        self._next_first = (order[last_served] + resume) % count
        return out

    def _disconnected(self, stream: _Stream) -> None:
        """A peer dropped: ZMQ refused a frame over ``MAXMSGSIZE`` (it does not reconnect after
        that), the engine went away, or its heartbeats stopped. A connecting SUB is reopened
        (a bound one is reconnected by its peer); either way the publisher is checked before
        its next message (see the module's "reconnects")."""
        monitor = stream.monitor
        assert monitor is not None
        while True:
            try:
                monitor.recv_multipart(_NOBLOCK)
            except zmq.Again:
                break
            self.stats.disconnects += 1
        stream.reconnected = stream.last is not None
        self._warn("source disconnected", (stream.source.endpoint,), stream=stream.source.endpoint)
        if stream.address is not None:
            # A new socket: reconnecting the old one (disconnect, connect) can abort libzmq
            # 4.3.5 (fq.cpp "!_more") when the refused message was half queued.
            order = self._order.pop(stream.socket)
            self._detach(stream)
            stream.socket = self._open(stream.source)
            self._order[stream.socket] = order
            self._attach(stream)

    def close(self) -> None:
        for stream in self._streams.values():
            if stream.monitor is not None:
                with contextlib.suppress(zmq.ZMQError):
                    stream.socket.disable_monitor()
                stream.monitor.close(0)
            stream.socket.close(0)
            if stream.dealer is not None:
                stream.dealer.close(0)
        self._streams.clear()
        self._monitors.clear()
        self._order.clear()

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one live message ----------------------------------------------------------------

    def _bad(self, stream: _Stream, reason: BadFrame, seq: int | None = None) -> None:
        self.stats.bad_frames[reason] += 1
        endpoint = stream.source.endpoint
        self._warn(
            "bad frame skipped", (endpoint, reason), stream=endpoint, seq=seq, reason=reason.value
        )

    def _check(self, stream: _Stream, frames: list[bytes]) -> int | None:
        if len(frames) != 3:
            self._bad(stream, BadFrame.FRAME_COUNT)
            return None
        seq_frame = frames[1]
        if len(seq_frame) != 8:
            self._bad(stream, BadFrame.BAD_SEQ)
            return None
        seq = int.from_bytes(seq_frame, "big")
        if max(map(len, frames)) > self.max_frame_bytes:
            self._bad(stream, BadFrame.OVERSIZED, seq)
            return None
        return seq

    # -- clears: a token bucket per source -------------------------------------------------

    def _may_clear(self, stream: _Stream) -> bool:
        now = time.monotonic()
        refill = (now - stream.tokens_at) / self.clear_interval if self.clear_interval > 0 else 1
        stream.tokens = min(float(self.clear_burst), stream.tokens + refill)
        stream.tokens_at = now
        return stream.tokens >= 1

    def _reset(
        self, stream: _Stream, reason: Literal["restart", "lost"], lost: int = 0
    ) -> StreamReset:
        """A reset of ``stream``; the caller has checked :meth:`_may_clear`."""
        stream.tokens -= 1
        return StreamReset(stream.source, reason, lost)

    def _suspend(self, stream: _Stream, seq: int | None) -> None:
        """No token for the clear a discontinuity needs: skip until one is back, then resync."""
        if not stream.suspended:
            stream.suspended = True
            endpoint = stream.source.endpoint
            self._warn("clears throttled, stream suspended", (endpoint,), stream=endpoint, seq=seq)
        self.stats.bad_frames[BadFrame.THROTTLED] += 1

    def _resync(
        self, stream: _Stream, frames: list[bytes], seq: int, out: list[Message | StreamReset]
    ) -> list[Message | StreamReset]:
        """Start the stream over at ``seq`` with a clear; the caller has checked the token."""
        self.stats.resyncs += 1
        endpoint = stream.source.endpoint
        self._warn("stream resynchronized", (endpoint,), stream=endpoint, seq=seq)
        stream.suspended = False
        stream.jumped_to = None
        out.append(self._reset(stream, "restart"))
        stream.last = stream.live_last = seq
        stream.last_payload = frames[2]
        stream.replayed_through = -1
        out.append(Message(stream.source, seq, frames[0], frames[2], time.time_ns()))
        return out

    def _receive(self, stream: _Stream, frames: list[bytes]) -> list[Message | StreamReset]:
        seq = self._check(stream, frames)
        if seq is None:
            return []
        self.stats.messages += 1
        out: list[Message | StreamReset] = []
        endpoint = stream.source.endpoint
        if stream.suspended:
            if not self._may_clear(stream):
                self._suspend(stream, seq)
                return out
            last = stream.last
            if last is not None and 0 < seq - last - 1 <= self.max_gap:
                self.stats.lost += seq - last - 1  # shed or skipped while suspended
            return self._resync(stream, frames, seq, out)
        last = stream.last
        checked: list[Message] | None = None
        replaced = False  # a new process, its sequence already past the old last
        if stream.reconnected:
            stream.reconnected = False
            if last is not None and seq > last:
                checked = self._check_publisher(stream, last)
                replaced = checked is None
        if last is not None and (replaced or seq <= last):
            if not replaced and stream.live_last < seq <= stream.replayed_through:
                self.stats.duplicates += 1
                stream.live_last = seq
                return out
            if not self._may_clear(stream):
                self._suspend(stream, seq)
                return out
            self.stats.restarts += 1
            self._warn("publisher restarted", (endpoint,), stream=endpoint, seq=seq, last=last)
            out.append(self._reset(stream, "restart"))
            stream.last, last = None, None
            stream.live_last = stream.replayed_through = -1
        expected = 0 if last is None else last + 1
        if seq > expected:
            if last is not None and seq - expected > self.max_gap:
                if stream.jumped_to is None or seq != stream.jumped_to + 1:
                    stream.jumped_to = seq
                    self._bad(stream, BadFrame.SEQ_JUMP, seq)
                    return out
                if not self._may_clear(stream):  # it did move there: start over
                    self._suspend(stream, seq)
                    return out
                return self._resync(stream, frames, seq, out)
            if last is not None:
                self.stats.gaps += 1
                self._info("gap detected", (endpoint,), stream=endpoint, expected=expected, seq=seq)
            out.extend(self._recover(stream, expected, seq, checked))
            if stream.suspended:
                self.stats.bad_frames[BadFrame.THROTTLED] += 1
                return out
            stream.live_last = seq
            if stream.last is not None and seq <= stream.last:
                self.stats.duplicates += 1
                return out  # the replay already delivered this one
        stream.jumped_to = None
        stream.last = stream.live_last = seq
        stream.last_payload = frames[2]
        out.append(Message(stream.source, seq, frames[0], frames[2], time.time_ns()))
        return out

    def _check_publisher(self, stream: _Stream, last: int) -> list[Message] | None:
        """After a reconnect: the replay from ``last`` if its first batch is the one delivered
        as ``last`` (the same publisher, so the replay fills what the drop cost), else ``None``
        (a new process, or one that cannot show it is not). Without a replay endpoint the
        publisher is taken as the same: a gap then counts as lost and clears downstream."""
        self.stats.reconnect_checks += 1
        if not stream.source.replay_endpoint:
            return []
        answer = self._replay(stream, last)
        if answer and answer[0].seq == last and answer[0].payload == stream.last_payload:
            return answer
        endpoint = stream.source.endpoint
        self._warn("publisher replaced", (endpoint,), stream=endpoint, last=last)
        return None

    # -- replay ------------------------------------------------------------------------------

    def _recover(
        self,
        stream: _Stream,
        start: int,
        live_seq: int | None,
        replayed: list[Message] | None = None,
    ) -> list[Message | StreamReset]:
        """Fetch ``start .. live_seq - 1`` (or everything buffered, without ``live_seq``) from the
        replay socket, unless ``replayed`` is an answer already fetched from ``start`` or
        before. Whatever it cannot deliver is lost: a :class:`StreamReset` goes out at the point
        of the loss, in stream order.

        A loss of more than ``max_gap`` batches (from the start of a stream whose first batch is
        far past 0, as a relay's are, or a replay answering with such a batch) is a resync, with
        nothing counted lost. A loss that finds no clear token suspends the stream and ends the
        recovery there."""
        if replayed is None:
            replayed = self._replay(stream, start) if stream.source.replay_endpoint else []
        out: list[Message | StreamReset] = []
        expected = start
        endpoint = stream.source.endpoint
        for message in [*replayed, None]:
            if message is None and live_seq is None:
                break
            seq = live_seq if message is None else message.seq
            assert seq is not None
            if seq < expected:
                continue  # already delivered
            if seq > expected:
                if not self._may_clear(stream):
                    self._suspend_quietly(stream)
                    return out
                lost = seq - expected
                if lost > self.max_gap:
                    self.stats.resyncs += 1
                    self._warn("stream resynchronized", (endpoint,), stream=endpoint, seq=seq)
                    out.append(self._reset(stream, "restart"))
                else:
                    self.stats.lost += lost
                    self._warn(
                        "batches lost", (endpoint,), stream=endpoint, first=expected, count=lost
                    )
                    out.append(self._reset(stream, "lost", lost))
            if message is None:
                break
            expected = seq + 1
            stream.last = seq
            stream.last_payload = message.payload
            stream.replayed_through = max(stream.replayed_through, seq)
            self.stats.replayed += 1
            out.append(message)
        return out

    def _suspend_quietly(self, stream: _Stream) -> None:
        """:meth:`_suspend` without counting: the live message that led here is counted."""
        if not stream.suspended:
            stream.suspended = True
            endpoint = stream.source.endpoint
            self._warn("clears throttled, stream suspended", (endpoint,), stream=endpoint)

    def _replay(self, stream: _Stream, start: int) -> list[Message]:
        """Ask the replay socket for every batch from ``start``; both vLLM reply layouts.

        Reads at most ``replay_max_messages`` batches and ``replay_max_bytes`` of payload; past
        that the answer is abandoned (its DEALER closed), and what it held counts as lost."""
        self.stats.replays += 1
        source = stream.source
        assert source.replay_endpoint is not None
        if stream.dealer is None:
            stream.dealer = self.context.socket(zmq.DEALER)
            stream.dealer.setsockopt(zmq.LINGER, 0)
            stream.dealer.setsockopt(zmq.RCVHWM, self.rcvhwm)
            stream.dealer.setsockopt(zmq.MAXMSGSIZE, self._maxmsgsize)
            stream.dealer.connect(connect_address(source.replay_endpoint))
        dealer = stream.dealer
        dealer.send_multipart(request_frames(start))
        messages: list[Message] = []
        size = 0
        deadline = time.monotonic() + self.replay_timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not dealer.poll(int(remaining * 1000) + 1):
                self._warn(
                    "replay timed out",
                    (source.replay_endpoint,),
                    stream=source.replay_endpoint,
                    start=start,
                )
                self.stats.replay_timeouts += 1
                dealer.close(0)  # late replies must not be read as the next replay's
                stream.dealer = None
                break
            answer = parse_answer(dealer.recv_multipart(), source.topic.encode())
            if answer is None:
                self._bad(stream, BadFrame.REPLAY_FRAME_COUNT)
                continue
            topic, seq_frame, payload = answer
            if seq_frame == END_SEQ or not payload:
                break
            if len(seq_frame) != 8:
                self._bad(stream, BadFrame.BAD_SEQ)
                continue
            seq = int.from_bytes(seq_frame, "big")
            if len(payload) > self.max_frame_bytes:
                self._bad(stream, BadFrame.OVERSIZED, seq)
                continue
            messages.append(Message(source, seq, topic, payload, time.time_ns(), replayed=True))
            size += len(payload)
            if len(messages) >= self.replay_max_messages or size >= self.replay_max_bytes:
                self.stats.replay_truncated += 1
                self._warn(
                    "replay answer truncated",
                    (source.replay_endpoint,),
                    stream=source.replay_endpoint,
                    messages=len(messages),
                    bytes=size,
                )
                dealer.close(0)  # the rest of this answer must not be read as the next one
                stream.dealer = None
                break
        return messages
