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
- **bad frames** (wrong frame count, a frame over ``max_frame_bytes``, a sequence frame that is
  not 8 bytes): counted by reason and skipped.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable
from typing import Final, Literal

import msgspec
import structlog
import zmq

from kvbridge.adapters.publisher import END_SEQ, should_bind

__all__ = [
    "Message",
    "Source",
    "StreamReset",
    "Subscriber",
    "connect_address",
]

DEFAULT_MAX_FRAME_BYTES: Final = 64 * 1024 * 1024

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


def connect_address(endpoint: str, host: str = "127.0.0.1") -> str:
    """The address to connect to for an endpoint a peer binds (its wildcard host replaced)."""
    return endpoint.replace("*", host, 1) if "*" in endpoint else endpoint


class Source(msgspec.Struct, frozen=True):
    """One vLLM publisher: its configured ``endpoint`` (vLLM's ``KVEventsConfig.endpoint``),
    its replay endpoint, and the worker it belongs to.

    ``bind`` overrides vLLM's bind/connect rule, e.g. to connect to a remote engine that binds
    ``tcp://*:5557`` (give ``tcp://10.0.0.5:5557`` with ``bind=False``).
    """

    endpoint: str
    replay_endpoint: str | None = None
    worker_id: int = 0
    topic: str = ""
    bind: bool | None = None

    @property
    def subscriber_binds(self) -> bool:
        return not should_bind(self.endpoint) if self.bind is None else self.bind


class Message(msgspec.Struct, frozen=True):
    """One batch as received, live or through a replay."""

    source: Source
    seq: int
    topic: bytes
    payload: bytes
    received_ns: int
    replayed: bool = False

    @property
    def frames(self) -> list[bytes]:
        return [self.topic, self.seq.to_bytes(8, "big"), self.payload]


class StreamReset(msgspec.Struct, frozen=True):
    """The consumer must clear everything it derived from this source."""

    source: Source
    reason: Literal["restart", "lost"]
    lost_batches: int = 0
    """For ``"lost"``: batches that no replay could recover (a lower bound if unknown)."""


class _Stream:
    __slots__ = ("dealer", "last", "live_last", "replayed_through", "socket", "source")

    def __init__(self, source: Source, socket: zmq.Socket[bytes]) -> None:
        self.source = source
        self.socket = socket
        self.dealer: zmq.Socket[bytes] | None = None
        self.last: int | None = None
        """Highest sequence delivered, live or through a replay."""
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
    ) -> None:
        self.context = context or zmq.Context.instance()
        self.max_frame_bytes = max_frame_bytes
        self.replay_timeout = replay_timeout
        self.stats: Counter[str] = Counter()
        """``messages``, ``gaps``, ``replays``, ``replayed``, ``lost``, ``restarts``,
        ``duplicates`` and ``bad_frame:<reason>``."""
        self._poller = zmq.Poller()
        self._streams: dict[zmq.Socket[bytes], _Stream] = {}
        for source in sources:
            socket = self.context.socket(zmq.SUB)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.RCVHWM, 0)
            socket.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
            if source.subscriber_binds:
                socket.bind(source.endpoint)
            else:
                socket.connect(connect_address(source.endpoint))
            self._streams[socket] = _Stream(source, socket)
            self._poller.register(socket, zmq.POLLIN)
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

    def poll(self, timeout_ms: int = 100) -> list[Message | StreamReset]:
        """Everything that arrived within ``timeout_ms``, in stream order per source."""
        out: list[Message | StreamReset] = []
        while self._starting:
            stream = self._starting.pop(0)
            if stream.last is None:
                out.extend(self._recover(stream, 0, None))
        for socket, _ in self._poller.poll(timeout_ms):
            stream = self._streams[socket]
            while (frames := _recv_frames(socket)) is not None:
                out.extend(self._receive(stream, frames))
        return out

    def close(self) -> None:
        for stream in self._streams.values():
            stream.socket.close(0)
            if stream.dealer is not None:
                stream.dealer.close(0)
        self._streams.clear()

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one live message ----------------------------------------------------------------

    def _bad(self, stream: _Stream, reason: str, seq: int | None = None) -> None:
        self.stats[f"bad_frame:{reason}"] += 1
        log.warning("bad frame skipped", stream=stream.source.endpoint, seq=seq, reason=reason)

    def _check(self, stream: _Stream, frames: list[bytes]) -> int | None:
        if len(frames) != 3:
            self._bad(stream, "frame_count")
            return None
        seq_frame = frames[1]
        if len(seq_frame) != 8:
            self._bad(stream, "bad_seq")
            return None
        seq = int.from_bytes(seq_frame, "big")
        if max(map(len, frames)) > self.max_frame_bytes:
            self._bad(stream, "oversized", seq)
            return None
        return seq

    def _receive(self, stream: _Stream, frames: list[bytes]) -> list[Message | StreamReset]:
        seq = self._check(stream, frames)
        if seq is None:
            return []
        self.stats["messages"] += 1
        out: list[Message | StreamReset] = []
        last = stream.last
        if last is not None and seq <= last:
            if stream.live_last < seq <= stream.replayed_through:
                self.stats["duplicates"] += 1
                stream.live_last = seq
                return out
            self.stats["restarts"] += 1
            log.warning("publisher restarted", stream=stream.source.endpoint, seq=seq, last=last)
            out.append(StreamReset(stream.source, "restart"))
            stream.last, last = None, None
            stream.live_last = stream.replayed_through = -1
        expected = 0 if last is None else last + 1
        if seq > expected:
            if last is not None:
                self.stats["gaps"] += 1
                log.info("gap detected", stream=stream.source.endpoint, expected=expected, seq=seq)
            out.extend(self._recover(stream, expected, seq))
            stream.live_last = seq
            if stream.last is not None and seq <= stream.last:
                self.stats["duplicates"] += 1
                return out  # the replay already delivered this one
        stream.last = stream.live_last = seq
        out.append(Message(stream.source, seq, frames[0], frames[2], time.time_ns()))
        return out

    # -- replay ------------------------------------------------------------------------------

    def _recover(
        self, stream: _Stream, start: int, live_seq: int | None
    ) -> list[Message | StreamReset]:
        """Fetch ``start .. live_seq - 1`` (or everything buffered, without ``live_seq``) from the
        replay socket. Whatever it cannot deliver is lost: a :class:`StreamReset` goes out at
        the point of the loss, in stream order."""
        replayed = self._replay(stream, start) if stream.source.replay_endpoint else []
        out: list[Message | StreamReset] = []
        expected = start
        for message in [*replayed, None]:
            if message is None and live_seq is None:
                break
            seq = live_seq if message is None else message.seq
            assert seq is not None
            if seq < expected:
                continue  # already delivered
            if seq > expected:
                lost = seq - expected
                self.stats["lost"] += lost
                log.warning(
                    "batches lost", stream=stream.source.endpoint, first=expected, count=lost
                )
                out.append(StreamReset(stream.source, "lost", lost))
            if message is None:
                break
            expected = seq + 1
            stream.last = seq
            stream.replayed_through = max(stream.replayed_through, seq)
            self.stats["replayed"] += 1
            out.append(message)
        return out

    def _replay(self, stream: _Stream, start: int) -> list[Message]:
        """Ask the replay socket for every batch from ``start``; both vLLM reply layouts."""
        self.stats["replays"] += 1
        source = stream.source
        assert source.replay_endpoint is not None
        if stream.dealer is None:
            stream.dealer = self.context.socket(zmq.DEALER)
            stream.dealer.setsockopt(zmq.LINGER, 0)
            stream.dealer.connect(connect_address(source.replay_endpoint))
        dealer = stream.dealer
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        messages: list[Message] = []
        deadline = time.monotonic() + self.replay_timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not dealer.poll(int(remaining * 1000) + 1):
                log.warning("replay timed out", stream=source.replay_endpoint, start=start)
                self.stats["replay_timeouts"] += 1
                dealer.close(0)  # late replies must not be read as the next replay's
                stream.dealer = None
                break
            frames = dealer.recv_multipart()
            body = frames[1:] if frames and frames[0] == b"" else frames
            if len(body) == 3:
                topic, seq_frame, payload = body
            elif len(body) == 2:
                topic, (seq_frame, payload) = source.topic.encode(), body
            else:
                self._bad(stream, "replay_frame_count")
                continue
            if seq_frame == END_SEQ or not payload:
                break
            if len(seq_frame) != 8:
                self._bad(stream, "bad_seq")
                continue
            seq = int.from_bytes(seq_frame, "big")
            if len(payload) > self.max_frame_bytes:
                self._bad(stream, "oversized", seq)
                continue
            messages.append(Message(source, seq, topic, payload, time.time_ns(), replayed=True))
        return messages
