"""The replay side of a :class:`~kvbridge.adapters.publisher.Publisher`: what it keeps of its
stream and how it answers vLLM's replay requests.

It is a module of its own because it is a job of its own, with its own thread and socket: the
publisher's live stream only appends to a
:class:`~kvbridge.adapters.replay_buffer.ReplayBuffer`, while a :class:`ReplaySocket`
(one bound ROUTER socket) answers requests from that buffer, or from a snapshot for a request
older than the buffer, on whichever thread serves replays. A :class:`ReplayServer` serves the
ROUTER sockets of many publishers from one thread.

A request is ``[identity, b"", start_seq8]`` (a DEALER sends ``[b"", start_seq8]``). The answer
is every buffered batch whose seq is >= ``start_seq``, oldest first, followed by an end marker;
the frame layouts are in :mod:`kvbridge.adapters.replay_protocol`.

An answer is never dropped silently. A ROUTER that cannot queue a message for a peer (its queue
is at the socket's high-water mark, or the peer is gone) would drop it without a word and send
the rest, holes and all; this one is ``ROUTER_MANDATORY``, so the answer stops there instead,
and is counted in :attr:`ReplaySocket.answers_cut` by reason and logged. The peer then sees an
answer without its end marker, as it would see a relay that went away: its replay times out
(kvbridge's own :class:`~kvbridge.adapters.replay_client.ReplayClient` keeps what arrived and
counts a replay timeout; its :class:`~kvbridge.adapters.replay_recovery.ReplayRecovery` counts
the rest lost). The high-water mark leaves room for two
whole answers per peer, so a peer that reads is not cut; one that asks again and again
without reading is.
"""

from __future__ import annotations

import enum
import functools
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Final, Self

import structlog
import zmq

from kvbridge.adapters.endpoints import allow_ipv6
from kvbridge.adapters.logs import LogLimiter
from kvbridge.adapters.replay_buffer import ReplayBuffer
from kvbridge.adapters.replay_protocol import answer_frames, end_frames, parse_request
from kvbridge.adapters.wakeup import Wakeup

__all__ = ["REQUEST_MAX_BYTES", "AnswerCut", "ReplayServer", "ReplaySocket", "last_endpoint"]

log = structlog.get_logger("kvbridge.zmq")

_REPLAY_POLL_MS: Final[int] = 50
"""How long a replay thread waits per poll, bounding how fast it stops."""
_SERVER_POLL_MS: Final[int] = 1000
"""How long a :class:`ReplayServer`'s thread waits per poll: its :meth:`~ReplayServer.close`
wakes it, so an idle relay's replay thread wakes once a second, not 20 times."""
_SHARED_FRAME_BYTES: Final = 1024
"""Answer frames from this size up are sent without a copy: ZMQ's message holds the buffer's
own payload. A peer that asks and never reads then costs the relay its queued messages, not a
copy of every payload in them per answer: 10 such peers asking twice for 200 payloads of
60 KB held 212 MB of copies, and hold 2.8 MB of messages shared (``tests/test_publisher.py``).
Sharing costs the replay thread more than a copy (pyzmq frees a shared frame through its
garbage-collector thread, a few us a message), which smaller frames would not repay."""
REQUEST_MAX_BYTES: Final = 1024
"""``MAXMSGSIZE`` of a replay ROUTER: a request's frames are an empty delimiter and 8 bytes,
and the largest frame a peer sends is its handshake's READY (about 300 bytes with a routing id
of 255, the longest ZMQ allows). A peer that announces a larger frame is disconnected at its
header, before libzmq makes room for it: without the bound, a peer that announced gigabytes
and sent part of them held that much of the relay's memory for as long as it stayed
connected."""


class AnswerCut(enum.Enum):
    """Why a replay answer stopped before its end marker."""

    PEER_FULL = "peer_full"
    """The peer's queue is at the ROUTER's high-water mark: it asked again without reading
    (or, for a source whose snapshot spans many dp ranks, an answer longer than the room)."""
    PEER_GONE = "peer_gone"
    """The peer disconnected before or during the answer."""


def _serve_until(stop: threading.Event, serve: Callable[[], object]) -> None:
    """A replay thread's loop: ``serve`` until ``stop`` is set.

    A ZMQ error after ``stop`` (a socket closed under its poll) ends it. So does a
    ``RuntimeError`` once the main thread has ended: the interpreter is running its exit
    handlers, pyzmq's may have shut the collector that a shared frame needs, and a thread
    whose publisher was never closed ends quietly, as the process does. Anything else is
    raised."""
    while not stop.is_set():
        try:
            serve()
        except zmq.ZMQError:
            if stop.is_set():
                return
            raise
        except RuntimeError:
            if threading.main_thread().is_alive():
                raise
            return


def last_endpoint(socket: zmq.Socket[bytes]) -> str:
    """Return the address ``socket`` last bound or connected to, with ephemeral ports resolved."""
    value = socket.getsockopt(zmq.LAST_ENDPOINT)
    if isinstance(value, bytes):
        return value.decode()
    return str(value)


class ReplaySocket:
    """A bound ROUTER socket that answers replay requests from a :class:`ReplayBuffer`.

    The socket belongs to whoever serves replays: the caller of :meth:`serve`, or, once
    :meth:`start_thread` or a :class:`ReplayServer` has taken it, that thread alone.

    Raises:
        zmq.ZMQError: the socket could not bind.
    """

    def __init__(
        self,
        context: zmq.Context[zmq.Socket[bytes]],
        endpoint: str,
        buffer: ReplayBuffer,
        *,
        topic: bytes,
        topic_frame: bool,
    ) -> None:
        self.buffer: Final = buffer
        """The batches the answers come from."""
        self._topic: Final = topic
        self._topic_frame: Final = topic_frame
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._server: ReplayServer | None = None
        self.answers_cut: Final[Counter[AnswerCut]] = Counter(dict.fromkeys(AnswerCut, 0))
        """Answers stopped before their end marker, by reason (see the module's doc). Every
        reason is a key from the start, so that another thread can copy it while this one
        counts."""
        self._warn = LogLimiter(log.warning)
        self._socket: zmq.Socket[bytes] | None = context.socket(zmq.ROUTER)
        try:
            self._socket.setsockopt(zmq.LINGER, 0)
            # Refuse, rather than drop, what a peer cannot take (sends are non-blocking).
            self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self._socket.setsockopt(zmq.MAXMSGSIZE, REQUEST_MAX_BYTES)
            # Room for two whole answers: every buffered batch, or a snapshot of a one-rank
            # source (one payload) and the batches after it, then the end marker.
            self._socket.setsockopt(zmq.SNDHWM, 2 * (buffer.steps + 2))
            self._socket.copy_threshold = _SHARED_FRAME_BYTES
            allow_ipv6(self._socket, endpoint)
            self._socket.bind(endpoint)
            self.endpoint: Final = last_endpoint(self._socket)
            """The actual bound address (ephemeral ports resolved)."""
        except BaseException:
            self.close()
            raise

    def serve(self, timeout_ms: int = 0) -> int:
        """Answer the replay requests waiting on the socket.

        Waits up to ``timeout_ms`` for a first request (0: do not wait; negative: wait forever),
        then serves it and every other request already queued. A request that is not exactly
        ``[identity, b"", start_seq8]`` (8-byte seq) is ignored.

        Returns:
            The number of requests served (0 once closed).

        Raises:
            RuntimeError: a replay thread owns the socket and this is another thread.
        """
        router = self._socket
        if router is None:
            return 0
        owner = self._thread
        if owner is not None and threading.current_thread() is not owner:
            raise RuntimeError("replays are served by the background thread")
        if not router.poll(None if timeout_ms < 0 else timeout_ms, zmq.POLLIN):
            return 0
        served = 0
        while True:
            try:
                frames = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return served
            request = parse_request(frames)
            if request is None:
                continue
            self._answer(router, *request)
            served += 1

    def _answer(self, router: zmq.Socket[bytes], identity: bytes, start_seq: int) -> None:
        """Send ``identity`` the answer from ``start_seq`` on, then the end marker; stop at the
        first message the peer cannot take, and count why."""
        topic_frame = self._topic_frame
        batches = self.buffer.answer(start_seq)
        for sent in range(len(batches) + 1):
            if sent < len(batches):
                seq, payload = batches[sent]
                frames = answer_frames(identity, self._topic, seq, payload, topic_frame=topic_frame)
            else:
                frames = end_frames(identity, topic_frame=topic_frame)
            try:
                router.send_multipart(frames, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                reason = AnswerCut.PEER_FULL
            except zmq.ZMQError as error:
                if error.errno != zmq.EHOSTUNREACH:
                    raise
                reason = AnswerCut.PEER_GONE
            else:
                continue
            self.answers_cut[reason] += 1
            self._warn(
                "replay answer cut",
                (self.endpoint, reason),
                endpoint=self.endpoint,
                reason=reason.value,
                start_seq=start_seq,
                sent=sent,
                of=len(batches) + 1,
            )
            return

    def adopt(self, thread: threading.Thread, server: ReplayServer | None) -> zmq.Socket[bytes]:
        """Give the socket to ``thread`` (run by ``server``, if given) and return it, for that
        thread's poller.

        Raises:
            RuntimeError: a thread has the socket already, or it is closed.
        """
        if self._thread is not None:
            raise RuntimeError("the replay thread is already running")
        if self._socket is None:
            raise RuntimeError("the replay socket is closed")
        self._thread = thread
        self._server = server
        return self._socket

    def start_thread(self) -> None:
        """Serve replays from a daemon thread of this socket's own until :meth:`stop`.

        Raises:
            RuntimeError: a thread has the socket already, or it is closed.
        """
        thread = threading.Thread(target=self._loop, name="kv-replay", daemon=True)
        self.adopt(thread, None)
        thread.start()

    def _loop(self) -> None:
        _serve_until(self._stop, functools.partial(self.serve, _REPLAY_POLL_MS))

    def stop(self) -> None:
        """Stop the thread that serves this socket (its own or its server's); the socket stays
        open. Idempotent."""
        self._stop.set()
        if self._server is not None:
            self._server.close()  # it serves this socket: stop it before the socket closes
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def close(self) -> None:
        """Close the socket (linger 0), after :meth:`stop`. Idempotent."""
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None


class ReplayServer:
    """Serves the replay ROUTERs of many publishers from one thread, with one poller.

    :meth:`~kvbridge.adapters.publisher.Publisher.start_replay_thread` runs a thread per
    publisher; a relay with 1,000 outputs would run 1,000 threads, each waking
    every 50 ms. This one thread sleeps in a single ``zmq_poll`` over every ROUTER and answers
    whichever has requests. Each publisher's ROUTER then belongs to this thread (as after
    ``start_replay_thread``); closing any of the publishers stops the server, so close them all
    together (or :meth:`close` first).

    ``sockets`` are the publishers' :meth:`~kvbridge.adapters.publisher.Publisher.replay_socket`
    (which raises for a publisher without one, or closed).

    Raises:
        RuntimeError: a socket already has a replay thread, or is closed.
    """

    def __init__(self, sockets: Iterable[ReplaySocket]) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kv-replays", daemon=True)
        self.failure: Exception | None = None
        """What ended the thread, if an error did: replay requests go unanswered."""
        self._poller = zmq.Poller()
        self._sockets: dict[zmq.Socket[bytes], ReplaySocket] = {}
        for replays in sockets:
            router = replays.adopt(self._thread, self)
            self._sockets[router] = replays
            self._poller.register(router, zmq.POLLIN)
        self._wakeup = Wakeup(self._poller)  # last: nothing after it can raise

    def start(self) -> Self:
        """Start serving; returns the server."""
        self._thread.start()
        return self

    def _loop(self) -> None:
        try:
            _serve_until(self._stop, self._serve_ready)
        except Exception as error:
            self.failure = error
            raise

    def _serve_ready(self) -> None:
        """Wait for requests (or :meth:`close`), then answer every socket that has."""
        events = self._poller.poll(_SERVER_POLL_MS)
        if self._wakeup.woken(events):
            return
        for router, _ in events:
            self._sockets[router].serve(0)

    def close(self) -> None:
        """Stop the thread, woken at once. Idempotent; the sockets stay open."""
        self._stop.set()
        self._wakeup.wake()
        thread = self._thread
        if thread.is_alive() and thread is not threading.current_thread():
            thread.join()
        self._wakeup.close()
