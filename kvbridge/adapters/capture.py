"""``.kvcap`` capture files: raw ZMQ frames with their receive time and stream identity.

The format is small enough to read with any msgpack library::

    file    = magic record*
    magic   = b"KVCAP\\x01\\n"                      (7 bytes: name, format version 1, newline)
    record  = length:u32 big-endian, body:msgpack  (length counts the body only)

The first record is the header, a map: ``{"format": "kvcap", "version": 1, "created_ns": int,
"meta": {...}}``; ``meta`` is free-form (kvbridge puts the recording command, the engine
arguments of a golden capture, or the prompts of the bundled sample there). The one key kvbridge
reads back besides ``block_size`` is ``prompts``: the prompts the capture's traffic was made of,
as ``[{"name": str, "token_ids": [int, ...]}, ...]`` (``kvbridge record --prompts``), so that
``demo`` and ``validate --compare-dynamo`` can speak of prompts as well as blocks. Every following
record is a frame record, an array ``[received_ns, stream, worker_id, frames]``:

- ``received_ns``: wall-clock receive time, integer nanoseconds since the epoch;
- ``stream``: the endpoint the message came from (``"tcp://127.0.0.1:5557"``), or ``"replay:"``
  plus the endpoint for a message recovered through the replay socket;
- ``worker_id``: the worker the stream belongs to;
- ``frames``: the message's frames as bytes, untouched (``[topic, seq, payload]`` for vLLM).

Frames are stored exactly as received, so a malformed message is captured as it was.
"""

from __future__ import annotations

import contextlib
import heapq
import struct
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO, Annotated, Any, Final, Literal

import msgspec

from kvbridge._closing import ClosedOnExit
from kvbridge.adapters.publisher import Publisher

__all__ = [
    "MAGIC",
    "CaptureError",
    "CaptureReader",
    "CaptureWriter",
    "FrameRecord",
    "Prompt",
    "StreamReplay",
    "capture_streams",
    "in_receipt_order",
    "prompts_of",
    "read_prompts",
    "replay_capture",
    "replay_streams",
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


class Prompt(msgspec.Struct, frozen=True, omit_defaults=True):
    """A prompt as token ids, the way Dynamo is asked about it (no tokenizer needed to read it)."""

    name: str
    token_ids: list[Annotated[int, msgspec.Meta(ge=0, le=0xFFFF_FFFF)]]
    """Token ids are u32, as Dynamo keeps them."""
    lora_name: str | None = None
    cache_salt: str | None = None
    """The request's cache salt as vLLM takes it, without Dynamo's prefix."""


def prompts_of(items: Any) -> list[Prompt]:
    """Prompts from a list whose items are token-id lists or objects with ``token_ids``.

    An object's ``name`` names it, else its ``index`` (a golden capture's manifest), else its
    position. Other keys are ignored, so a manifest's prompts read as they are.

    Raises:
        ValueError: not such a list.
    """
    if not isinstance(items, list):
        raise ValueError("prompts must be a list of token-id lists or objects with token_ids")
    prompts = []
    for position, item in enumerate(items):
        fields = {"token_ids": item} if isinstance(item, list) else item
        if not isinstance(fields, dict):
            raise ValueError(f"prompt {position}: neither a token-id list nor an object")
        name = fields.get("name", fields.get("index", position))
        known = {
            key: fields[key] for key in ("token_ids", "lora_name", "cache_salt") if key in fields
        }
        try:
            prompts.append(msgspec.convert({**known, "name": str(name)}, Prompt))
        except msgspec.ValidationError as error:
            raise ValueError(f"prompt {position}: {error}") from None
    return prompts


def read_prompts(path: str | Path) -> list[Prompt]:
    """Prompts from a JSON file: a list (see :func:`prompts_of`), or an object whose
    ``prompts`` is one, such as a golden capture's manifest.

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not JSON of that shape.
    """
    try:
        data = msgspec.json.decode(Path(path).read_bytes())
    except msgspec.DecodeError as error:
        raise ValueError(f"{path}: not JSON: {error}") from None
    items = data.get("prompts") if isinstance(data, dict) else data
    try:
        return prompts_of(items)
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None


class _Header(msgspec.Struct):
    format: str
    version: int
    created_ns: int
    meta: dict[str, Any] = {}


_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(_Header)
_record_decoder = msgspec.msgpack.Decoder(FrameRecord)


class CaptureWriter(ClosedOnExit):
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

    @property
    def prompts(self) -> list[Prompt]:
        """The prompts the header carries (``meta["prompts"]``), none if it carries none.

        Raises:
            CaptureError: the header's ``prompts`` is not a list of prompts.
        """
        try:
            return prompts_of(self.meta.get("prompts", []))
        except ValueError as error:
            raise CaptureError(f"{self.path}: header prompts: {error}") from None

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


def capture_streams(records: Iterable[FrameRecord]) -> dict[str, list[FrameRecord]]:
    """The records of each recorded stream, by stream, in order of first appearance. A record
    recovered through a replay socket (stream ``replay:<endpoint>``) goes with its live stream,
    where it was received."""
    streams: dict[str, list[FrameRecord]] = {}
    for record in records:
        streams.setdefault(record.stream.removeprefix("replay:"), []).append(record)
    return streams


class StreamReplay(msgspec.Struct):
    """What :func:`replay_streams` did with one stream."""

    endpoint: str
    """The endpoint it was published on, as given."""
    sent: int = 0
    subscribed: bool = False
    """Whether a subscriber was connected before the first message went out."""


def replay_streams(
    streams: Sequence[tuple[str, Sequence[FrameRecord]]],
    *,
    bind: bool | None = None,
    pace: Literal["original", "max"] = "original",
    wait_subscribers: float = 5.0,
    stop: threading.Event | None = None,
) -> list[StreamReplay]:
    """Publish each stream's frames on a PUB socket of its own, byte for byte.

    ``streams`` are ``(endpoint, records)`` pairs. Each endpoint follows vLLM's bind/connect rule
    unless ``bind`` says otherwise, so a subscriber configured for the recorded engine works
    unchanged. The messages of all streams go out in the order of their receive times (each
    stream's own order kept): ``pace="original"`` keeps the recorded gaps between them, ``"max"``
    sends as fast as the sockets take them. Waits up to ``wait_subscribers`` seconds in all for a
    first subscriber on every socket, since a PUB socket drops what it sends before anyone
    listens.
    """
    results = [StreamReplay(endpoint) for endpoint, _ in streams]
    with contextlib.ExitStack() as sockets:
        publishers = [
            sockets.enter_context(Publisher(endpoint, bind=bind)) for endpoint, _ in streams
        ]
        deadline = time.monotonic() + wait_subscribers
        for publisher, result in zip(publishers, results, strict=True):
            result.subscribed = wait_subscribers > 0 and _wait_for_subscriber(
                publisher, deadline, stop
            )
        ordered = in_receipt_order([records for _, records in streams])
        start = time.monotonic()
        first_ns = min((records[0].received_ns for _, records in streams if records), default=0)
        for index, record in ordered:
            if stop is not None and stop.is_set():
                break
            if pace == "original":
                delay = (record.received_ns - first_ns) / 1e9 - (time.monotonic() - start)
                if delay > 0 and stop is not None:
                    stop.wait(delay)
                elif delay > 0:
                    time.sleep(delay)
            publishers[index].send_frames(record.frames)
            results[index].sent += 1
        time.sleep(0.1)  # let ZMQ flush before the sockets close (linger is 0)
    return results


_STOP_CHECK_S: Final = 0.1
"""How often a wait for subscribers looks at the stop event: a signal ends it this fast."""


def _wait_for_subscriber(
    publisher: Publisher, deadline: float, stop: threading.Event | None
) -> bool:
    """Wait until ``deadline`` for one subscriber, in short slices so that ``stop`` ends it."""
    while stop is None or not stop.is_set():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        if publisher.wait_for_subscribers(timeout=min(_STOP_CHECK_S, remaining)):
            return True
    return False


def in_receipt_order(
    streams: Sequence[Iterable[FrameRecord]],
) -> Iterator[tuple[int, FrameRecord]]:
    """``(stream index, record)`` over all streams, merged by receive time; each stream keeps
    its own order, and a tie goes to the earlier stream."""
    tagged = [_tagged(index, records) for index, records in enumerate(streams)]
    for _, index, record in heapq.merge(*tagged, key=lambda item: item[0]):
        yield index, record


def _tagged(index: int, records: Iterable[FrameRecord]) -> Iterator[tuple[int, int, FrameRecord]]:
    return ((record.received_ns, index, record) for record in records)


def replay_capture(
    records: Sequence[FrameRecord],
    endpoint: str,
    *,
    pace: Literal["original", "max"] = "original",
    wait_subscribers: float = 5.0,
    stop: threading.Event | None = None,
    bind: bool | None = None,
) -> int:
    """Publish the captured frames on one PUB socket, byte for byte, in capture order (every
    stream merged: see :func:`replay_streams` to keep them apart).

    ``endpoint`` follows vLLM's bind/connect rule unless ``bind`` says otherwise.
    ``pace="original"`` keeps the recorded gaps between messages; ``"max"`` sends as fast as the
    socket takes them. Waits up to ``wait_subscribers`` seconds for a first subscriber, since a
    PUB socket drops what it sends before anyone listens. Returns the number of messages sent.
    """
    (result,) = replay_streams(
        [(endpoint, records)], bind=bind, pace=pace, wait_subscribers=wait_subscribers, stop=stop
    )
    return result.sent
