"""Subscribing to vLLM's KV-event publishers: sequence tracking, gap replay, restart detection.

Each source gets its own SUB socket, because a SUB socket connected to several publishers
cannot tell whose message it received, and sequence numbers only mean something per publisher
(:class:`~kvbridge.adapters.stream_state.StreamState` is what is kept per source). The
subscriber hands on raw frames and never decodes a payload; its consumer (the relay, the
recorder) decides what a batch means. Replays, from the first batch of a stream or of a gap,
go through :class:`~kvbridge.adapters.replay_client.ReplayClient`, and what their answers
mean through :class:`~kvbridge.adapters.replay_recovery.ReplayRecovery`.

What the sequence numbers of each message mean (gaps, restarts, duplicates, jumps, bad
frames) is decided by :class:`~kvbridge.adapters.sequencing.Sequencer`; the subscriber itself
handles the sockets:

- **reconnects**: a SUB socket's connection that drops (the engine exited, a frame ZMQ refused,
  ZMTP heartbeats unanswered) is seen by a socket monitor (``disconnects``, see
  :mod:`~kvbridge.adapters.sub_socket`). The engine may have been replaced by a new process
  whose sequence has already passed the old last, which the sequence numbers alone cannot
  show. So the publisher is checked (``reconnect_checks``,
  :meth:`~kvbridge.adapters.replay_recovery.ReplayRecovery.check_publisher`) as soon as the SUB is
  connected again (the handshake, seen by the same monitor), without waiting for a batch that
  an idle engine may not send: the same process's batches that the drop cost are replayed, a
  new one is a restart (``restarts``), see
  :meth:`~kvbridge.adapters.sequencing.Sequencer.catch_up`. (A message that gets there first
  checks it instead.) Consistency comes before stale hits. A drop also ends the source's
  replay back-off.
- **replays**: a stream that waits for a replay is not read until the answer is in (or timed
  out); the others are read meanwhile (:mod:`~kvbridge.adapters.replays_in_flight`,
  ``max_replays`` answers at a time). With ``replay_on_start``, each source with a replay
  endpoint is asked for everything from 0 before any of its live messages, so that the
  batches of an engine gone idle arrive too. A loss whose replay went unanswered is
  repaired once the engine answers with it (``repairs``, :mod:`~kvbridge.adapters.repairs`).

Limits, so that no input can take the subscriber's memory or time (defaults in brackets):

- **a budget per poll**: :meth:`Subscriber.poll` reads the ready sources round-robin, at most
  ``source_budget`` [:data:`~kvbridge.adapters.round_robin.DEFAULT_SOURCE_BUDGET`] messages
  from one source and ``poll_budget`` [:data:`~kvbridge.adapters.round_robin.DEFAULT_POLL_BUDGET`]
  in all
  (:mod:`~kvbridge.adapters.round_robin`), so that a fast source cannot starve the others.
- **frame size**: ``MAXMSGSIZE`` on the SUB and DEALER sockets is ``max_frame_bytes`` plus
  :data:`MAXMSGSIZE_MARGIN`. A frame a little over ``max_frame_bytes`` is received and counted
  ``oversized``; ZMQ refuses a larger one at its size header, before buffering any of it, and
  drops the connection without reconnecting after that protocol error; the subscriber does.
- **high-water marks**: ``RCVHWM`` [:data:`DEFAULT_RCVHWM` messages] on every SUB, and on a
  replay DEALER room for a whole answer (``replay_max_messages`` + 1). Under a flood, ZMQ sheds
  what does not fit (the engine's PUB drops it); the shed batches are gaps, replayed or lost.
- **replay answers** are bounded in batches and bytes (:mod:`~kvbridge.adapters.replay_client`);
  a forward **sequence jump** of more than ``max_gap`` [:data:`DEFAULT_MAX_GAP`] is bad input,
  not a replay of 10**22 batches (:mod:`~kvbridge.adapters.sequencing`).
- **clears**: every :class:`StreamReset` takes a token from its source's bucket
  (``clear_burst`` [:data:`DEFAULT_CLEAR_BURST`], one more per ``clear_interval`` s
  [:data:`DEFAULT_CLEAR_INTERVAL_S`], see :mod:`~kvbridge.adapters.stream_state`); a stream
  that needs one while the bucket is empty is suspended (``throttled``) until one is back, and
  then cleared at once, whether or not it sends (each poll looks at the suspended streams).
- **logs**: every per-frame line goes through a :class:`~kvbridge.adapters.logs.LogLimiter`, per
  stream and reason; the stats count every frame.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import Final

import structlog
import zmq

from kvbridge._closing import ClosedOnExit
from kvbridge.adapters.endpoints import allow_ipv6, loopback
from kvbridge.adapters.logs import LogLimiter
from kvbridge.adapters.monitors import close_monitor, watch
from kvbridge.adapters.repairs import repair
from kvbridge.adapters.replay_client import (
    DEFAULT_REPLAY_MAX_BYTES,
    DEFAULT_REPLAY_MAX_MESSAGES,
    ReplayClient,
)
from kvbridge.adapters.replay_recovery import ReplayRecovery
from kvbridge.adapters.replays_in_flight import DEFAULT_MAX_REPLAYS, ReplaysInFlight
from kvbridge.adapters.round_robin import DEFAULT_POLL_BUDGET, DEFAULT_SOURCE_BUDGET, RoundRobin
from kvbridge.adapters.sequencing import Sequencer
from kvbridge.adapters.source import Message, Source, StreamReset
from kvbridge.adapters.stream_state import StreamState
from kvbridge.adapters.stream_stats import SubscriberStats
from kvbridge.adapters.sub_socket import WATCHED, open_sub, read_events, recv_frames
from kvbridge.adapters.wakeup import Wakeup

__all__ = [
    "DEFAULT_CLEAR_BURST",
    "DEFAULT_CLEAR_INTERVAL_S",
    "DEFAULT_MAX_FRAME_BYTES",
    "DEFAULT_REPLAY_TIMEOUT_S",
    "MAX_FRAME_BYTES",
    "MIN_REPLAY_TIMEOUT_S",
    "Subscriber",
]

DEFAULT_MAX_FRAME_BYTES: Final = 64 * 1024 * 1024
MAXMSGSIZE_MARGIN: Final = 64 * 1024
"""How far past ``max_frame_bytes`` a frame is still received (to be counted oversized)."""
MAX_FRAME_BYTES: Final = 2**63 - 1 - MAXMSGSIZE_MARGIN
"""The largest ``max_frame_bytes``: ZMQ's ``MAXMSGSIZE`` is a signed 64-bit integer."""
DEFAULT_RCVHWM: Final = 10_000
"""Messages ZMQ queues per SUB socket before it sheds (0: unbounded); a replay DEALER's holds
a whole answer (:attr:`~kvbridge.adapters.replay_client.ReplayClient.answer_hwm`)."""
DEFAULT_MAX_GAP: Final = 1 << 20
"""A forward sequence jump larger than this is bad input, not a gap to replay."""
DEFAULT_CLEAR_BURST: Final = 3
DEFAULT_CLEAR_INTERVAL_S: Final = 1.0
DEFAULT_REPLAY_TIMEOUT_S: Final = 2.0
MIN_REPLAY_TIMEOUT_S: Final = 0.001
"""ZMQ waits in whole milliseconds; a shorter timeout would also keep the back-off after
timeouts (which doubles from the timeout) from reaching its cap."""
log = structlog.get_logger("kvbridge.zmq")


class Subscriber(ClosedOnExit):
    """Receives vLLM KV-event frames from several publishers and keeps each stream whole."""

    def __init__(
        self,
        sources: Iterable[Source],
        *,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        replay_timeout: float = DEFAULT_REPLAY_TIMEOUT_S,
        replay_on_start: bool = False,
        rcvhwm: int = DEFAULT_RCVHWM,
        poll_budget: int = DEFAULT_POLL_BUDGET,
        source_budget: int = DEFAULT_SOURCE_BUDGET,
        max_gap: int = DEFAULT_MAX_GAP,
        clear_burst: int = DEFAULT_CLEAR_BURST,
        clear_interval: float = DEFAULT_CLEAR_INTERVAL_S,
        replay_max_messages: int = DEFAULT_REPLAY_MAX_MESSAGES,
        replay_max_bytes: int = DEFAULT_REPLAY_MAX_BYTES,
        max_replays: int = DEFAULT_MAX_REPLAYS,
        monitor: bool = True,
    ) -> None:
        if min(poll_budget, source_budget, max_gap, clear_burst, replay_max_messages) < 1:
            raise ValueError("budgets, max_gap, clear_burst and replay bounds must be >= 1")
        if max_replays < 1:
            raise ValueError(f"max_replays must be >= 1, got {max_replays}")
        sources = list(sources)
        keys = [(source.endpoint, source.topic) for source in sources]
        for index, (endpoint, topic) in enumerate(keys):
            if (endpoint, topic) in keys[:index]:  # its batches would come twice
                raise ValueError(f"source {endpoint} (topic {topic!r}) is given twice")
        if not MIN_REPLAY_TIMEOUT_S <= replay_timeout <= threading.TIMEOUT_MAX:
            raise ValueError(
                f"replay_timeout must be in [{MIN_REPLAY_TIMEOUT_S}, {threading.TIMEOUT_MAX}] "
                f"seconds, got {replay_timeout}"
            )
        if not 0 <= clear_interval <= threading.TIMEOUT_MAX:
            raise ValueError(
                f"clear_interval must be in [0, {threading.TIMEOUT_MAX}] seconds (0: clears "
                f"are not rate-limited), got {clear_interval}"
            )
        if not 1 <= max_frame_bytes <= MAX_FRAME_BYTES:
            raise ValueError(
                f"max_frame_bytes must be in [1, {MAX_FRAME_BYTES}], got {max_frame_bytes}"
            )
        self.context = context or zmq.Context.instance()
        self.max_frame_bytes = max_frame_bytes
        self._maxmsgsize = max_frame_bytes + MAXMSGSIZE_MARGIN
        self.rcvhwm = rcvhwm
        self.stats = SubscriberStats()
        """Every source's counts: messages, gaps, replays, losses, restarts, bad frames..."""
        self._warn = LogLimiter(log.warning)
        self.replay_client = ReplayClient(
            self.context,
            self.stats,
            self._warn,
            timeout=replay_timeout,
            max_messages=replay_max_messages,
            max_bytes=replay_max_bytes,
            max_frame_bytes=max_frame_bytes,
            maxmsgsize=self._maxmsgsize,
            rcvhwm=rcvhwm,
        )
        """Replay answers, over a DEALER per request."""
        self._recovery = ReplayRecovery(self.stats, self._warn, max_gap)
        self._sequencer = Sequencer(
            self.stats, self._warn, self._recovery, max_frame_bytes=max_frame_bytes
        )
        self._poller = zmq.Poller()
        self.wakeup = Wakeup(self._poller)  # ends a waiting poll, from any thread
        self._replays = ReplaysInFlight(self.replay_client, self._poller, max_replays)
        """The streams that wait for a replay, and the answers being read."""
        self._streams: dict[zmq.Socket[bytes], StreamState] = {}
        self._by_source: dict[Source, StreamState] = {}
        """The same streams by source (a stream keeps its source when its socket is replaced)."""
        self._monitors: dict[zmq.Socket[bytes], StreamState] = {}
        self._round_robin = RoundRobin[zmq.Socket[bytes]](
            poll_budget=poll_budget, source_budget=source_budget
        )
        self._catching_up: dict[StreamState, None] = {}  # connected again, to catch up
        self._monitor = monitor
        self._polled_at = time.monotonic()
        self._taken: list[Message | StreamReset] = []  # by a poll that raised
        for source in sources:
            stream = StreamState(
                source, self._open(source), clear_burst=clear_burst, clear_interval=clear_interval
            )
            self._round_robin.add(stream.socket)
            self._by_source[source] = stream
            self._attach(stream)
        starting = self._streams.values() if replay_on_start else ()
        self._starting = [stream for stream in starting if stream.source.replay_endpoint]

    def last_seq(self, source: Source) -> int | None:
        """The seq of the last batch delivered from ``source`` (``None`` before the first)."""
        return self._by_source[source].last

    def lost_batches(self, source: Source) -> int:
        """Batches of ``source`` that no replay could recover (its share of ``stats.lost``)."""
        return self._by_source[source].lost

    @property
    def progressed_at(self) -> float:
        """When the loop that polls this subscriber last began a poll (``time.monotonic()``).
        A loop that stopped, dead or stuck, is what a health check looks for (see
        :mod:`~kvbridge.adapters.status_server`); a poll waits for no replay."""
        return self._polled_at

    @property
    def sources(self) -> list[Source]:
        """The sources read, in the order given."""
        return list(self._by_source)

    def suspended(self, source: Source) -> bool:
        """Whether ``source``'s stream is suspended: it needed a clear when none was allowed,
        and what it sends is skipped until one is (see :mod:`~kvbridge.adapters.stream_state`)."""
        return self._by_source[source].suspended

    def _open(self, source: Source) -> zmq.Socket[bytes]:
        return open_sub(self.context, source.topic, rcvhwm=self.rcvhwm, maxmsgsize=self._maxmsgsize)

    def _attach(self, stream: StreamState) -> None:
        """Monitor (if it connects), bind or connect and poll ``stream.socket``."""
        source, socket = stream.source, stream.socket
        if self._monitor:
            stream.monitor = watch(socket, WATCHED)
            self._monitors[stream.monitor] = stream
            self._poller.register(stream.monitor, zmq.POLLIN)
        allow_ipv6(socket, source.endpoint)
        if source.subscriber_binds:
            socket.bind(source.endpoint)
        else:
            stream.address = loopback(source.endpoint)
            socket.connect(stream.address)
        self._streams[socket] = stream
        self._poller.register(socket, 0 if self._replays.waiting(stream) else zmq.POLLIN)

    def _detach(self, stream: StreamState) -> None:
        if stream.monitor is not None:
            self._poller.unregister(stream.monitor)
            del self._monitors[stream.monitor]
            close_monitor(stream.socket, stream.monitor)
            stream.monitor = None
        self._poller.register(stream.socket, 0)  # unregistered, if it is registered
        del self._streams[stream.socket]
        stream.socket.close(0)

    def poll(self, timeout_ms: int = 100) -> list[Message | StreamReset]:
        """What arrived within ``timeout_ms``, within the budget, in stream order per source.

        First the clears of suspended streams whose token is back and the repairs that are due
        (a poll ends early when one falls due; the next sends it), then what the replays that
        came in complete. Then it reads the ready sources round-robin (the module's "limits"):
        at most ``source_budget`` messages from one source and ``poll_budget`` in all; the rest
        waits in ZMQ's queue (up to ``RCVHWM``). An error raised in a poll (a bug: no input is
        known to cause one) keeps what it had taken for the next: the streams are past it.
        """
        self._polled_at = time.monotonic()
        out, self._taken = self._taken, []
        try:
            self._read(self._ready(timeout_ms, out), out)
        except BaseException:
            self._taken = out
            raise
        return out

    def _ready(self, timeout_ms: int, out: list[Message | StreamReset]) -> list[zmq.Socket[bytes]]:
        """The sources ready to be read, after the clears, monitors and replays (onto ``out``)."""
        stats, warn, replays = self.stats, self._warn, self._replays
        for stream in self._streams.values():
            if stream.suspended and (reset := stream.release(stats, warn)) is not None:
                out.append(reset)
                if not replays.waiting(stream):
                    replays.run(stream, self._sequencer.start_over.released(stream), out)
        for stream in self._starting:
            replays.run(stream, self._recovery.recover(stream, 0, None), out)
        self._starting = []
        for stream in self._streams.values():
            if stream.repair_due() and not replays.waiting(stream):
                replays.run(stream, repair(self._recovery, stream), out)
        events = self._poller.poll(replays.wait_ms(timeout_ms, self._streams.values()))
        self.wakeup.woken(events)
        for socket, _ in events:
            monitored = self._monitors.get(socket)
            if monitored is not None:
                self._monitored(monitored)
        replays.read({socket for socket, _ in events}, out)
        for stream in [s for s in self._catching_up if not replays.waiting(s)]:
            del self._catching_up[stream]
            replays.run(stream, self._sequencer.catch_up(stream), out)
        # A dropped SUB's queue is a gap of its new socket; a waiting stream is read later.
        streams = self._streams
        return [s for s, _ in events if s in streams and not replays.waiting(streams[s])]

    def _read(self, ready: list[zmq.Socket[bytes]], out: list[Message | StreamReset]) -> None:
        """Read the ``ready`` sources round-robin within the budgets, onto ``out``."""
        streams, replays, receive = self._streams, self._replays, self._sequencer.receive

        def read_from(socket: zmq.Socket[bytes], quota: int) -> tuple[int, bool]:
            stream, read = streams[socket], 0
            while read < quota and (frames := recv_frames(socket)) is not None:
                read += 1
                items = receive(stream, frames)
                if isinstance(items, list):
                    out.extend(items)
                    continue
                replays.run(stream, items, out)
                if replays.waiting(stream):
                    return read, True  # its next messages come after the answer
            return read, False

        self._round_robin.read(ready, read_from)

    def _monitored(self, stream: StreamState) -> None:
        """``stream``'s drops, then a handshake after them: its catch-up, a bound SUB's too."""
        assert stream.monitor is not None
        drops, connected = read_events(stream.monitor)
        if drops:
            self.stats.disconnects += drops
            self._catching_up.pop(stream, None)  # connected before the drop
            self._disconnected(stream)
        if not connected or (drops and stream.address is not None):
            return  # no handshake, or the replaced socket's
        if stream.address is None:  # reading the old peer's leftovers checked that one
            stream.reconnected = stream.reconnected or stream.last is not None
        stream.connected = True
        self._catching_up[stream] = None

    def _disconnected(self, stream: StreamState) -> None:
        """A peer dropped: ZMQ refused a frame over ``MAXMSGSIZE`` (after which it does not
        reconnect), the engine went away, or its heartbeats stopped. A connecting SUB is
        reopened (a bound one is reconnected by its peer); the publisher is to be checked, or
        a stream with nothing delivered replayed from 0 (see the module's "reconnects")."""
        stream.reconnected = True
        stream.connected = False
        stream.drops += 1
        stream.skipped_last = None  # what the old connection read says nothing of the new one
        stream.end_replay_back_off()
        self._warn("source disconnected", (stream.source.endpoint,), stream=stream.source.endpoint)
        if stream.address is not None:
            # A new socket: reconnecting the old one (disconnect, connect) can abort libzmq
            # 4.3.5 (fq.cpp "!_more") when the refused message was half queued.
            old = stream.socket
            self._detach(stream)
            stream.socket = self._open(stream.source)
            self._round_robin.replace(old, stream.socket)
            self._attach(stream)

    def close(self) -> None:
        self._replays.close()
        self._catching_up.clear()
        for stream in list(self._streams.values()):
            self._detach(stream)
        self._by_source.clear()
        self._round_robin.clear()
        self.wakeup.close()
