"""A ZMQ publisher of vLLM-format KV-event frames, with vLLM's replay protocol.

:class:`Publisher` behaves like the ``ZmqEventPublisher`` of a vLLM engine, so tests and
simulators can stand in for a real engine in front of a subscriber (``kvbridge`` itself, Dynamo's
``SelectionService``, the standalone indexer...). Unlike vLLM's, it can use an IPv6 address
(:func:`~kvbridge.adapters.endpoints.allow_ipv6`).

Live stream (PUB socket)
    Every batch is one three-frame message ``[topic, seq8, payload]``: the UTF-8 topic, the
    sequence number as 8 bytes unsigned big-endian, and the msgpack batch exactly as given.
    Sequence numbers start at 0 and go up by one per batch; :meth:`Publisher.restart` sends them
    back to 0, as an engine restart does.

Bind or connect
    Like vLLM, the PUB socket *binds* when the endpoint contains ``*`` or ``::`` or starts with
    ``ipc://`` or ``inproc://``, and *connects* otherwise (then the subscriber must bind). The
    ``bind`` argument overrides the rule, e.g. to bind ``tcp://127.0.0.1:0`` in tests. The replay
    endpoint is always bound.

Replay (ROUTER socket)
    Every batch is also kept in a ring buffer (``buffer_steps`` batches) that a ROUTER socket
    answers vLLM's replay requests from; :mod:`kvbridge.adapters.replay_server` has that side.
    Batches that have left the buffer are not signalled: the first replayed seq is simply larger
    than the one requested, unless a ``snapshot`` provider is set (:attr:`Publisher.snapshot`):
    a request older than the buffer is then answered with the provider's payloads (a clear,
    then every resident block), numbered from the seq asked for, then the buffered batches from
    the provider's ``next_seq`` on.

Threads
    ZMQ sockets are not thread-safe. The PUB socket (and its monitor) belongs to the thread that
    calls :meth:`Publisher.publish` and :meth:`Publisher.wait_for_subscribers` (keep that to one
    thread). The ROUTER socket belongs to whoever
    serves replays: the caller of :meth:`Publisher.serve_replays`, or, after
    :meth:`Publisher.start_replay_thread`, the background thread alone (calling
    :meth:`Publisher.serve_replays` from another thread then raises :class:`RuntimeError`). The
    ring buffer is shared and guarded by a lock.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Final

import zmq

from kvbridge._closing import ClosedOnExit
from kvbridge.adapters.endpoints import MAX_HWM, allow_ipv6, should_bind
from kvbridge.adapters.monitors import close_monitor, monitor_events, watch
from kvbridge.adapters.replay_buffer import ReplayBuffer, SnapshotProvider
from kvbridge.adapters.replay_protocol import MAX_SEQ
from kvbridge.adapters.replay_server import AnswerCut, ReplaySocket, last_endpoint

__all__ = [
    "DEFAULT_BUFFER_STEPS",
    "MAX_BUFFER_STEPS",
    "MAX_SEQ",
    "SUBSCRIPTION_MAX_BYTES",
    "Publisher",
]

DEFAULT_BUFFER_STEPS: Final = 10_000
"""Batches a replay buffer holds by default, as vLLM's (``KVEventsConfig.buffer_steps``)."""

PEERS_READ_INTERVAL_S: Final = 1.0
"""How often at most :meth:`Publisher.publish` reads the PUB's monitor (see
:mod:`~kvbridge.adapters.monitors`)."""

MAX_BUFFER_STEPS: Final = MAX_HWM // 2 - 2
"""The most batches a replay buffer may hold: the replay socket's high-water mark has room for
two whole answers of them (``2 * (buffer_steps + 2)`` messages), within :data:`MAX_HWM`."""

SUBSCRIPTION_MAX_BYTES: Final = 64 * 1024
"""``MAXMSGSIZE`` of the PUB socket, which receives only its subscribers' handshakes and
subscriptions (a topic prefix: a SUB whose topic is longer gets nothing): a peer that announces
a larger frame is disconnected at its header, before libzmq makes room for it (see
:data:`~kvbridge.adapters.replay_server.REQUEST_MAX_BYTES`)."""

_SNDMORE: Final[int] = int(zmq.SNDMORE)
_send: Final = zmq.backend.Socket.send
"""pyzmq's own ``send``, beneath ``zmq.Socket.send``, whose Python wrapper only adds the
``routing_id`` and ``group`` arguments of draft sockets: 1.5 us less per three-frame message."""


class Publisher(ClosedOnExit):
    """Publishes [topic, seq8, payload] frames on a PUB socket and serves replays on a ROUTER
    socket, the way a vLLM engine does.

    Args:
        endpoint: PUB address. Bound or connected according to vLLM's rule
            (:func:`~kvbridge.adapters.endpoints.should_bind`) unless ``bind`` says otherwise.
        replay_endpoint: ROUTER address, always bound. ``None`` (the default) means no replay
            socket, as in vLLM.
        topic: frame 0 of every live message (and of 0.26+ replay replies).
        buffer_steps: size of the replay ring buffer, in batches.
        buffer_bytes: at most this many payload bytes in the ring buffer (the newest batch is
            kept whatever its size); ``None``, the default, bounds it in batches only, as vLLM
            does.
        replay_topic_frame: ``True`` for the vLLM 0.26+ replay layout (with the topic frame),
            ``False`` for the legacy one.
        context: ZMQ context to create the sockets in. If omitted the publisher creates its own
            and terminates it on :meth:`close`.
        bind: force the PUB socket to bind (``True``) or connect (``False``); ``None`` applies
            vLLM's rule.
        hwm: PUB high-water mark (vLLM's ``KVEventsConfig.hwm``); messages beyond it are dropped.
        first_seq: the seq of the first batch (a vLLM engine starts at 0).

    Raises:
        ValueError: ``buffer_steps``, ``buffer_bytes`` or ``hwm`` is negative.
        zmq.ZMQError: a socket could not bind or connect.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = DEFAULT_BUFFER_STEPS,
        buffer_bytes: int | None = None,
        replay_topic_frame: bool = True,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        bind: bool | None = None,
        hwm: int = 100_000,
        first_seq: int = 0,
    ) -> None:
        if not 0 <= buffer_steps <= MAX_BUFFER_STEPS:
            raise ValueError(f"buffer_steps must be in [0, {MAX_BUFFER_STEPS}], got {buffer_steps}")
        if buffer_bytes is not None and buffer_bytes < 0:
            raise ValueError(f"buffer_bytes must be >= 0, got {buffer_bytes}")
        if not 0 <= hwm <= MAX_HWM:
            raise ValueError(f"hwm must be in [0, {MAX_HWM}], got {hwm}")
        self._topic: Final[bytes] = topic.encode()
        self._buffer: Final = ReplayBuffer(buffer_steps, first_seq, buffer_bytes)
        self._closed = False

        self._owns_context = context is None
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context() if context is None else context
        self._pub: zmq.Socket[bytes] | None = None
        self._monitor: zmq.Socket[bytes] | None = None
        self._replays: ReplaySocket | None = None
        self._peers = 0
        self.last_sent = time.monotonic()
        """When :meth:`publish` last sent a batch (monotonic), for heartbeats."""
        self._peers_read_at = self.last_sent
        """When the PUB's monitor was last read; :meth:`publish` reads it every
        :data:`PEERS_READ_INTERVAL_S` at most, so that what it queues stays small."""
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.setsockopt(zmq.SNDHWM, hwm)
            self._pub.setsockopt(zmq.MAXMSGSIZE, SUBSCRIPTION_MAX_BYTES)
            # Watch handshakes before any peer can arrive, for wait_for_subscribers().
            self._monitor = watch(self._pub, zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
            allow_ipv6(self._pub, endpoint)
            if should_bind(endpoint) if bind is None else bind:
                self._pub.bind(endpoint)
            else:
                self._pub.connect(endpoint)
            self._endpoint: Final[str] = last_endpoint(self._pub)
            self.hwm: Final = int(self._pub.getsockopt(zmq.SNDHWM))
            """The PUB socket's high-water mark, as the socket has it: the messages queued for
            a subscriber that does not read, past which they are dropped for it."""
            if replay_endpoint is not None:
                self._replays = ReplaySocket(
                    self._ctx,
                    replay_endpoint,
                    self._buffer,
                    topic=self._topic,
                    topic_frame=replay_topic_frame,
                )
        except BaseException:
            self._close_sockets()
            raise

    # ------------------------------------------------------------------ properties

    @property
    def endpoint(self) -> str:
        """The PUB socket's actual address (ephemeral ports resolved, e.g. ``tcp://127.0.0.1:41234``)."""
        return self._endpoint

    @property
    def replay_endpoint(self) -> str | None:
        """The ROUTER socket's actual bound address, or ``None`` without a replay socket."""
        return None if self._replays is None else self._replays.endpoint

    @property
    def replay_answers_cut(self) -> Counter[AnswerCut]:
        """Replay answers stopped before their end marker because the peer could not take
        them, by reason (empty without a replay socket)."""
        return Counter() if self._replays is None else Counter(self._replays.answers_cut)

    @property
    def topic(self) -> str:
        """The topic sent as frame 0."""
        return self._topic.decode()

    @property
    def next_seq(self) -> int:
        """The seq the next :meth:`publish` without an explicit ``seq`` will use."""
        return self._buffer.next_seq

    @property
    def snapshot(self) -> SnapshotProvider | None:
        """The replay buffer's :attr:`~kvbridge.adapters.replay_buffer.ReplayBuffer.snapshot`
        provider. ``None`` by default."""
        return self._buffer.snapshot

    @snapshot.setter
    def snapshot(self, provider: SnapshotProvider | None) -> None:
        self._buffer.snapshot = provider

    # ------------------------------------------------------------------ live stream

    def publish(self, payload: bytes, *, seq: int | None = None, send: bool = True) -> int:
        """Publish one batch and keep it for replay.

        Args:
            payload: the msgpack-encoded batch, sent unchanged as frame 2.
            seq: the sequence number to use; by default the next one. The counter continues from
                ``seq + 1`` afterwards, so an explicit seq can open (or close) a gap.
            send: ``False`` stores the batch for replay without sending it, simulating a message
                the subscriber never received.

        Returns:
            The seq used.

        Raises:
            ValueError: ``seq`` is outside ``[0, 2**64 - 2]``.
            RuntimeError: the publisher is closed.
        """
        if seq is not None and not 0 <= seq <= MAX_SEQ:
            raise ValueError(f"seq must be in [0, {MAX_SEQ}], got {seq}")
        pub = self._pub
        if self._closed or pub is None:
            raise RuntimeError("publisher is closed")
        used = self._buffer.append(payload, seq)
        if send:
            now = self.last_sent = time.monotonic()
            if now >= self._peers_read_at + PEERS_READ_INTERVAL_S:
                self._count_peers()  # what the monitor queued, so that it does not grow
            if type(payload) is bytes:
                # send_multipart's work without its costs: an IntFlag ``|`` per frame (1.7 us
                # each), a buffer check per part, which bytes pass anyway, and the wrapper.
                _send(pub, self._topic, _SNDMORE)
                _send(pub, used.to_bytes(8, "big"), _SNDMORE)
                _send(pub, payload)
            else:  # checked before any frame goes out, as before
                pub.send_multipart((self._topic, used.to_bytes(8, "big"), payload))
        return used

    def send_frames(self, frames: list[bytes]) -> None:
        """Send a message's frames exactly as given, outside the sequence and replay buffer
        (to reproduce a capture, malformed messages included)."""
        pub = self._pub
        if self._closed or pub is None:
            raise RuntimeError("publisher is closed")
        pub.send_multipart(frames)

    def wait_for_subscribers(
        self, count: int = 1, *, timeout: float = 5.0, settle: float = 0.05
    ) -> bool:
        """Block until ``count`` peers are connected to the PUB socket, then ``settle`` s more.

        A PUB socket silently drops what it sends before a subscriber's subscription has reached
        it (ZMQ's "slow joiner"). This waits for the ZMTP handshake of ``count`` peers (counting
        handshakes minus disconnects, as seen by a socket monitor set up at construction). The
        subscription is sent right after the handshake, so it can still be in flight when the
        handshake completes: on localhost about 1 message in 100 published at that instant was
        lost, and none after 1 ms, hence ``settle``. When the subscriber *binds* (connect mode),
        its subscription to a new peer is only sent once the subscriber's own thread next polls
        or receives on its socket, so an idle bound SUB can stay unsubscribed after this returns.

        Call it from the publishing thread. Returns ``False`` on timeout.

        Raises:
            RuntimeError: the publisher is closed.
        """
        monitor = self._monitor
        if self._closed or monitor is None:
            raise RuntimeError("publisher is closed")
        deadline = time.monotonic() + timeout
        self._count_peers()
        while self._peers < count:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0 or not monitor.poll(remaining_ms, zmq.POLLIN):
                return False
            self._count_peers()
        if settle > 0:
            time.sleep(settle)
        return True

    def _count_peers(self) -> None:
        """Count the handshakes and drops the PUB's monitor reported since the last look."""
        self._peers_read_at = time.monotonic()
        if self._monitor is None:
            return
        for event in monitor_events(self._monitor):
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._peers += 1
            else:
                self._peers = max(0, self._peers - 1)

    def restart(self) -> None:
        """Simulate an engine restart: the next seq is 0 again and the replay buffer is emptied."""
        self._buffer.restart()

    # ------------------------------------------------------------------ replay

    def serve_replays(self, timeout_ms: int = 0) -> int:
        """Answer the replay requests waiting on the ROUTER socket (see
        :meth:`ReplaySocket.serve <kvbridge.adapters.replay_server.ReplaySocket.serve>`).

        Returns:
            The number of requests served (0 without a replay socket, or once closed).

        Raises:
            RuntimeError: the background replay thread is running and this is another thread.
        """
        return 0 if self._replays is None else self._replays.serve(timeout_ms)

    def start_replay_thread(self) -> None:
        """Serve replays from a daemon thread until :meth:`close`.

        From then on only that thread touches the ROUTER socket.

        Raises:
            RuntimeError: there is no replay socket, the thread already runs, or the publisher is
                closed.
        """
        self.replay_socket().start_thread()

    def replay_socket(self) -> ReplaySocket:
        """The replay side, for a :class:`~kvbridge.adapters.replay_server.ReplayServer` to
        serve; it stops when this publisher closes.

        Raises:
            RuntimeError: there is no replay socket, or the publisher is closed.
        """
        if self._replays is None:
            raise RuntimeError("no replay_endpoint was configured")
        if self._closed:
            raise RuntimeError("publisher is closed")
        return self._replays

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Stop the replay thread, close both sockets (linger 0) and, if owned, the context.

        Idempotent. Call it from the thread that publishes.
        """
        if self._closed:
            return
        self._closed = True
        if self._replays is not None:
            self._replays.stop()
        self._close_sockets()

    def _close_sockets(self) -> None:
        if self._pub is not None and self._monitor is not None:
            close_monitor(self._pub, self._monitor)
        if self._pub is not None:
            self._pub.close(linger=0)
        self._pub = None
        self._monitor = None
        if self._replays is not None:
            self._replays.close()
        if self._owns_context:
            self._ctx.term()

    def __repr__(self) -> str:
        return (
            f"Publisher(endpoint={self._endpoint!r}, replay_endpoint={self.replay_endpoint!r}, "
            f"topic={self.topic!r}, closed={self._closed})"
        )
