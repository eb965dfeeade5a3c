"""``.kvcap`` capture files: raw ZMQ frames with their receive time and stream identity.

The format is small enough to read with any msgpack library::

    file    = magic record*
    magic   = b"KVCAP\\x01\\n"                      (7 bytes: name, format version 1, newline)
    record  = length:u32 big-endian, body:msgpack  (length counts the body only)

The first record is the header, a map: ``{"format": "kvcap", "version": 1, "created_ns": int,
"meta": {...}}``; ``meta`` is free-form (kvbridge puts the recording command, the engine
arguments of a golden capture, or the prompts of the bundled sample there). Every following
record is a frame record, an array ``[received_ns, stream, worker_id, frames]``:

- ``received_ns``: wall-clock receive time, integer nanoseconds since the epoch;
- ``stream``: the endpoint the message came from (``"tcp://127.0.0.1:5557"``), or ``"replay:"``
  plus the endpoint for a message recovered through the replay socket;
- ``worker_id``: the worker the stream belongs to;
- ``frames``: the message's frames as bytes, untouched (``[topic, seq, payload]`` for vLLM).

Frames are stored exactly as received, so a malformed message is captured as it was.
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Final, Literal, Self

import msgspec

from kvbridge.adapters.publisher import Publisher

__all__ = [
    "MAGIC",
    "CaptureError",
    "CaptureReader",
    "CaptureWriter",
    "FrameRecord",
    "replay_capture",
]

MAGIC: Final = b"KVCAP\x01\n"
VERSION: Final = 1
_LENGTH = struct.Struct(">I")


class CaptureError(ValueError):
    """A file that is not a readable ``.kvcap`` capture."""


class FrameRecord(msgspec.Struct, array_like=True, frozen=True):
    """One captured ZMQ message."""

    received_ns: int
    stream: str
    worker_id: int
    frames: list[bytes]

    @property
    def seq(self) -> int | None:
        """The vLLM sequence number, if the message has vLLM's three-frame shape."""
        if len(self.frames) == 3 and len(self.frames[1]) == 8:
            return int.from_bytes(self.frames[1], "big")
        return None


class _Header(msgspec.Struct):
    format: str
    version: int
    created_ns: int
    meta: dict[str, Any] = {}


_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(_Header)
_record_decoder = msgspec.msgpack.Decoder(FrameRecord)


class CaptureWriter:
    """Appends frame records to a new capture file."""

    def __init__(self, path: str | Path, *, meta: dict[str, Any] | None = None) -> None:
        self.path = Path(path)
        self._file: IO[bytes] = self.path.open("wb")
        self._file.write(MAGIC)
        self._write(_encoder.encode(_Header("kvcap", VERSION, time.time_ns(), meta or {})))
        self.count = 0

    def _write(self, body: bytes) -> None:
        self._file.write(_LENGTH.pack(len(body)))
        self._file.write(body)

    def write(
        self,
        frames: list[bytes],
        *,
        stream: str,
        worker_id: int = 0,
        received_ns: int | None = None,
    ) -> None:
        received = time.time_ns() if received_ns is None else received_ns
        self._write(_encoder.encode(FrameRecord(received, stream, worker_id, list(frames))))
        self.count += 1

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class CaptureReader:
    """Reads a capture file: :attr:`meta` from its header, then the frame records in order."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._data = self.path.read_bytes()
        if not self._data.startswith(MAGIC):
            raise CaptureError(f"{self.path}: not a kvcap file (bad magic)")
        records = self._bodies()
        try:
            header = _header_decoder.decode(next(records))
        except (StopIteration, msgspec.DecodeError) as error:
            raise CaptureError(f"{self.path}: unreadable header: {error}") from error
        if header.format != "kvcap" or header.version != VERSION:
            raise CaptureError(f"{self.path}: unsupported capture version {header.version}")
        self.created_ns = header.created_ns
        self.meta = header.meta

    def _bodies(self) -> Iterator[memoryview]:
        view = memoryview(self._data)
        offset = len(MAGIC)
        while offset < len(view):
            if offset + 4 > len(view):
                raise CaptureError(f"{self.path}: truncated record length at byte {offset}")
            (length,) = _LENGTH.unpack_from(view, offset)
            offset += 4
            if offset + length > len(view):
                raise CaptureError(f"{self.path}: truncated record at byte {offset}")
            yield view[offset : offset + length]
            offset += length

    def __iter__(self) -> Iterator[FrameRecord]:
        bodies = self._bodies()
        next(bodies)
        for index, body in enumerate(bodies):
            try:
                yield _record_decoder.decode(body)
            except msgspec.DecodeError as error:
                raise CaptureError(f"{self.path}: record {index}: {error}") from error


def replay_capture(
    records: Sequence[FrameRecord],
    endpoint: str,
    *,
    pace: Literal["original", "max"] = "original",
    wait_subscribers: float = 5.0,
    stop: threading.Event | None = None,
) -> int:
    """Publish the captured frames on a PUB socket, byte for byte, in capture order.

    ``endpoint`` follows vLLM's bind/connect rule, so a subscriber configured for the recorded
    engine works unchanged. ``pace="original"`` keeps the recorded gaps between messages;
    ``"max"`` sends as fast as the socket takes them. Waits up to ``wait_subscribers`` seconds
    for a first subscriber, since a PUB socket drops what it sends before anyone listens.
    Returns the number of messages sent.
    """
    with Publisher(endpoint) as publisher:
        if wait_subscribers > 0:
            publisher.wait_for_subscribers(timeout=wait_subscribers)
        start = time.monotonic()
        first_ns = records[0].received_ns if records else 0
        sent = 0
        for record in records:
            if stop is not None and stop.is_set():
                break
            if pace == "original":
                delay = (record.received_ns - first_ns) / 1e9 - (time.monotonic() - start)
                if delay > 0 and stop is not None:
                    stop.wait(delay)
                elif delay > 0:
                    time.sleep(delay)
            publisher.send_frames(record.frames)
            sent += 1
        time.sleep(0.1)  # let ZMQ flush before the socket closes (linger is 0)
        return sent
