"""``.kvcap`` capture files: raw ZMQ frames with their receive time and stream identity.

The format is small enough to read with any msgpack library::

    file    = magic record*
    magic   = b"KVCAP\\x01\\n"                      (7 bytes: name, framing version 1, newline)
    record  = length:u32 big-endian, body:msgpack  (length counts the body only)

The first record is the header, a map: ``{"format": "kvcap", "version": 2, "created_ns": int,
"meta": {...}}``; ``meta`` is free-form (kvbridge puts the recording command, the engine
arguments of a golden capture, or the prompts of the bundled sample there). The one key kvbridge
reads back besides ``block_size`` is ``prompts``: the prompts the capture's traffic was made of,
as ``[{"name": str, "token_ids": [int, ...]}, ...]`` (``kvbridge record --prompts``), so that
``demo`` and ``validate --compare-dynamo`` can speak of prompts as well as blocks. Every following
record is an array ``[received_ns, stream, worker_id, frames]`` for a message, or
``[received_ns, stream, worker_id, [], reset]`` for a reset of its stream (version 2):

- ``received_ns``: wall-clock receive time, integer nanoseconds since the epoch;
- ``stream``: the endpoint the message came from (``"tcp://127.0.0.1:5557"``), or ``"replay:"``
  plus the endpoint for a message recovered through the replay socket;
- ``worker_id``: the worker the stream belongs to;
- ``frames``: the message's frames as bytes, untouched (``[topic, seq, payload]`` for vLLM);
- ``reset``: a map ``{"reason": "restart" | "lost" | "repair", "lost_batches": int,
  "checked": bool}`` (the last two left out at 0 and ``true``), what the recorder's subscriber
  concluded there (:mod:`~kvbridge.adapters.capture_records`).

Frames are stored exactly as received, so a malformed message is captured as it was.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import struct
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Annotated, Any, Final

import msgspec

from kvbridge._closing import ClosedOnExit
from kvbridge.adapters.capture_records import FrameRecord, RecordedReset
from kvbridge.adapters.source import Message, StreamReset
from kvbridge.normalizers import MAX_BLOCK_SIZE

__all__ = [
    "MAGIC",
    "CaptureError",
    "CaptureReader",
    "CaptureWriteError",
    "CaptureWriter",
    "FrameRecord",
    "Prompt",
    "RecordedReset",
    "capture_name",
    "capture_streams",
    "prompts_of",
    "read_prompts",
]

MAGIC: Final = b"KVCAP\x01\n"
VERSION: Final = 2
"""The header's version: 2 may hold reset records; 1, which this version reads too, holds
messages only."""
READS: Final = (1, 2)
_LENGTH = struct.Struct(">I")


class CaptureError(ValueError):
    """A file that is not a readable ``.kvcap`` capture."""


class CaptureWriteError(OSError):
    """A capture could not be written once it was created (a full disk, an I/O error): the
    recording stopped short, which is a failure of the run, not of its arguments. The error
    names the file."""


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


def _read_whole(path: Path, invalid: type[ValueError]) -> bytes:
    """The whole of a regular file, every error naming it.

    Raises:
        OSError: the file cannot be read (missing, a directory, no permission, an I/O error).
        invalid: it is not a regular file (a FIFO or a device would be read until it ends, which
            it need not ever do), or it is larger than the memory this process can have.
    """
    status = path.stat()
    if not stat.S_ISREG(status.st_mode) and not stat.S_ISDIR(status.st_mode):
        raise invalid(f"{path}: not a regular file")
    try:
        return path.read_bytes()
    except MemoryError:
        raise invalid(f"{path}: too large to read into memory ({status.st_size} bytes)") from None
    except OSError as error:
        raise _named(error, path) from error


def _named(error: OSError, path: Path) -> OSError:
    """``error``, naming ``path`` if it names no file (the OS names none for a failed read or
    write)."""
    if error.filename is not None or error.errno is None:
        return error
    return OSError(error.errno, error.strerror, str(path))


def read_prompts(path: str | Path) -> list[Prompt]:
    """Prompts from a JSON file: a list (see :func:`prompts_of`), or an object whose
    ``prompts`` is one, such as a golden capture's manifest.

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not JSON of that shape.
    """
    try:
        data = msgspec.json.decode(_read_whole(Path(path), ValueError))
    except msgspec.DecodeError as error:
        raise ValueError(f"{path}: not JSON: {error}") from None
    except RecursionError:
        raise ValueError(f"{path}: not JSON this reader takes: nested too deeply") from None
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
        """Creates (or truncates) the file and writes the header.

        Raises:
            OSError: the file cannot be created, named; a FIFO that no process reads is one
                (``ENXIO``): waiting for a reader could not be ended by a signal.
            CaptureWriteError: it was created, and writing the header failed. So can every
                later write, flush and close.
        """
        self.path = Path(path)
        # O_NONBLOCK only changes how a FIFO opens: at once, or ENXIO without a reader.
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK, 0o666)
        except OSError as error:
            if error.errno == errno.ENXIO:
                raise OSError(error.errno, "a FIFO that no process reads", str(path)) from None
            raise
        os.set_blocking(fd, True)
        self._file: IO[bytes] = os.fdopen(fd, "wb")
        try:
            with self._named_errors():
                self._file.write(MAGIC)
            created_ns = time.time_ns()
            self._write(_encoder.encode(_Header("kvcap", VERSION, created_ns, meta or {})))
        except BaseException:
            with contextlib.suppress(OSError):  # the header's error is the one to report
                self._file.close()  # closes the descriptor even if its flush fails
            raise
        self.count = 0
        self.resets = 0
        self._created_ns = created_ns
        self._newest_ns: dict[str, int] = {}
        """The latest receive time written per endpoint (live and replayed messages alike)."""

    def _write(self, body: bytes) -> None:
        with self._named_errors():
            self._file.write(_LENGTH.pack(len(body)))
            self._file.write(body)

    @contextlib.contextmanager
    def _named_errors(self) -> Iterator[None]:
        """A write's error, as a :class:`CaptureWriteError` that names the file; a reader
        of a FIFO that has gone stays a :class:`BrokenPipeError`, which ends a command
        quietly, as a closed stdout does."""
        try:
            yield
        except BrokenPipeError as error:
            raise _named(error, self.path) from error
        except OSError as error:
            strerror = error.strerror or str(error)
            raise CaptureWriteError(error.errno, strerror, str(self.path)) from error

    def write(
        self,
        frames: list[bytes],
        *,
        stream: str,
        worker_id: int = 0,
        received_ns: int | None = None,
    ) -> None:
        """Append a message's frames; :attr:`count` counts the messages."""
        received = time.time_ns() if received_ns is None else received_ns
        self._write(_encoder.encode((received, stream, worker_id, list(frames))))
        self.count += 1
        endpoint = stream.removeprefix("replay:")
        self._newest_ns[endpoint] = max(received, self._newest_ns.get(endpoint, received))

    def write_item(self, item: Message | StreamReset) -> None:
        """Append what a :class:`~kvbridge.adapters.subscriber.Subscriber` handed out: a
        message (one recovered through a replay under the stream ``replay:ENDPOINT``, so that
        a reader can tell it from a live one), or a reset."""
        if isinstance(item, StreamReset):
            self.write_reset(item)
            return
        source = item.source
        self.write(
            item.frames,
            stream=("replay:" if item.replayed else "") + source.endpoint,
            worker_id=source.worker_id,
            received_ns=item.received_ns,
        )

    def write_reset(self, reset: StreamReset, *, received_ns: int | None = None) -> None:
        """Append a reset of ``reset.source``'s stream, where it fell among its messages.

        Its time is by default that of the stream's latest message written (the capture's
        start before any): a subscriber hands out a reset with the messages after it, which
        were received before the reset is written, and a stream's records stay in time order,
        as :func:`~kvbridge.adapters.capture_replay.in_receipt_order` takes them."""
        source = reset.source
        if received_ns is None:
            received_ns = self._newest_ns.get(source.endpoint, self._created_ns)
        kept = RecordedReset(reset.reason, reset.lost_batches, reset.checked)
        self._write(_encoder.encode((received_ns, source.endpoint, source.worker_id, [], kept)))
        self.resets += 1

    def flush(self) -> None:
        with self._named_errors():
            self._file.flush()

    def close(self) -> None:
        with self._named_errors():
            self._file.close()


class CaptureReader:
    """Reads a capture file: :attr:`meta` from its header, then the frame records in order."""

    def __init__(self, path: str | Path) -> None:
        """Reads the whole file and its header.

        Raises:
            OSError: the file cannot be read (missing, a directory, no permission).
            CaptureError: it is not a regular file, or not a capture this version reads, or its
                header's ``block_size`` or ``prompts`` is not one.
        """
        self.path = Path(path)
        self._data = _read_whole(self.path, CaptureError)
        if not self._data.startswith(MAGIC):
            raise CaptureError(f"{self.path}: not a kvcap file (bad magic)")
        records = self._bodies()
        try:
            header = _header_decoder.decode(next(records))
        except StopIteration:
            raise CaptureError(
                f"{self.path}: unreadable header: the file ends after its magic"
            ) from None
        except msgspec.DecodeError as error:
            raise CaptureError(f"{self.path}: unreadable header: {error}") from error
        except RecursionError:
            raise CaptureError(f"{self.path}: unreadable header: nested too deeply") from None
        if header.format != "kvcap":
            raise CaptureError(
                f"{self.path}: not a kvcap capture (its header's format is {header.format!r})"
            )
        if header.version not in READS:
            raise CaptureError(
                f"{self.path}: unsupported capture version {header.version} "
                f"(this kvbridge reads versions {', '.join(map(str, READS))})"
            )
        self.created_ns = header.created_ns
        self.meta = header.meta
        self.block_size = self._block_size()
        """The block size the header carries (``meta["block_size"]``), ``None`` if none."""
        self.prompts = self._prompts()
        """The prompts the header carries (``meta["prompts"]``), none if it carries none."""

    def _block_size(self) -> int | None:
        value = self.meta.get("block_size")
        if value is None:
            return None
        if type(value) is not int or not 1 <= value <= MAX_BLOCK_SIZE:
            raise CaptureError(
                f"{self.path}: header block_size must be an integer in [1, {MAX_BLOCK_SIZE}], "
                f"got {value!r}"
            )
        return value

    def _prompts(self) -> list[Prompt]:
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
            except RecursionError:
                raise CaptureError(f"{self.path}: record {index}: nested too deeply") from None


def capture_name(path: str | Path) -> str:
    """A capture's path as a report names it: text that encodes as UTF-8 (JSON's encoding)
    whatever bytes the file name has, those that are not UTF-8 written as ``\\xNN``."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def capture_streams(records: Iterable[FrameRecord]) -> dict[str, list[FrameRecord]]:
    """The records of each recorded stream, by stream, in order of first appearance. A record
    recovered through a replay socket (stream ``replay:<endpoint>``) goes with its live stream,
    where it was received."""
    streams: dict[str, list[FrameRecord]] = {}
    for record in records:
        streams.setdefault(record.stream.removeprefix("replay:"), []).append(record)
    return streams
