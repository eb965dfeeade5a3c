"""``.kvcap`` captures: the file format, its errors, and ``kvbridge record`` / ``kvbridge replay``
end to end as subprocesses over real sockets on 127.0.0.1 (acceptance 5).

The wire format: README.md, "The relay in front of Dynamo" and "Captures".
"""

from __future__ import annotations

import os
import re
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import msgspec
import pytest
import structlog
import zmq
from support.raw_capture import HEADER, raw_capture
from support.reference import dump_rows, index_of
from support.relay_process import start_kvbridge

from kvbridge.adapters.capture import (
    MAGIC,
    CaptureError,
    CaptureReader,
    CaptureWriteError,
    CaptureWriter,
    FrameRecord,
    RecordedReset,
    capture_name,
    capture_streams,
    read_prompts,
)
from kvbridge.adapters.capture_replay import in_receipt_order, replay_streams
from kvbridge.adapters.pipeline import IndexSink, StreamPipeline
from kvbridge.adapters.ports import free_port_range
from kvbridge.adapters.publisher import Publisher
from kvbridge.adapters.source import Source, StreamReset
from kvbridge.adapters.tiered_index import TieredIndex
from kvbridge.cli.validation import validate_captures
from kvbridge.testing.workload import seeded_stream

BS = 4
TIMEOUT = 20.0  # subprocesses import dynamo first
T0 = 1_700_000_000_000_000_000


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def seq8(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def kvbridge(*args: str) -> subprocess.Popen[str]:
    return start_kvbridge(*args)


def finish(process: subprocess.Popen[str]) -> str:
    """Wait for a subprocess; return its stderr, failing on a non-zero exit."""
    try:
        _, stderr = process.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        process.kill()
        _, stderr = process.communicate()
        pytest.fail(f"timed out: {process.args!r}\n{stderr}")
    assert process.returncode == 0, stderr
    return stderr


def subscriber(ctx: zmq.Context[zmq.Socket[bytes]], port: int) -> zmq.Socket[bytes]:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, int(TIMEOUT * 1000))
    sub.connect(f"tcp://127.0.0.1:{port}")
    return sub


# --------------------------------------------------------------------------- the file format

RECORDS = [
    FrameRecord(T0, "tcp://127.0.0.1:5557", 1, [b"", seq8(0), b"\x93\xcb..."]),
    FrameRecord(T0 + 5, "replay:tcp://127.0.0.1:5557", 1, [b"kv", seq8(2**64 - 2), b""]),
    FrameRecord(T0 + 9, "tcp://10.0.0.5:5557", 2**64 - 1, [b"t", b"x"]),  # 2 frames
    FrameRecord(T0 + 9, "tcp://10.0.0.5:5557", 7, [b"", b"\x00" * 7, b"p"]),  # 7-byte seq
    FrameRecord(T0 + 10, "s", 0, [b""]),  # one empty frame
]


def write(path: Path, records: list[FrameRecord], meta: dict[str, object] | None = None) -> None:
    with CaptureWriter(path, meta=meta) as writer:
        for record in records:
            writer.write(
                record.frames,
                stream=record.stream,
                worker_id=record.worker_id,
                received_ns=record.received_ns,
            )
        assert writer.count == len(records)


def test_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "x.kvcap"
    meta = {"block_size": 16, "prompts": [{"name": "p", "token_ids": [1, 2]}], "note": "é"}
    before = time.time_ns()
    write(path, RECORDS, meta)
    reader = CaptureReader(path)
    assert reader.meta == meta
    assert before <= reader.created_ns <= time.time_ns()
    assert list(reader) == RECORDS
    assert list(reader) == RECORDS  # iterating twice reads the same
    assert [record.seq for record in reader] == [0, 2**64 - 2, None, None, None]
    assert path.read_bytes().startswith(MAGIC)


def test_default_meta_and_receive_time(tmp_path: Path) -> None:
    path = tmp_path / "x.kvcap"
    before = time.time_ns()
    with CaptureWriter(path) as writer:
        writer.write([b"", seq8(5), b"p"], stream="s")
    reader = CaptureReader(path)
    assert reader.meta == {}
    [record] = list(reader)
    assert (record.stream, record.worker_id, record.frames, record.seq) == (
        "s",
        0,
        [b"", seq8(5), b"p"],
        5,
    )
    assert before <= record.received_ns <= time.time_ns()


def record_offsets(data: bytes) -> list[int]:
    """Where each record (length prefix) starts."""
    offsets, offset = [], len(MAGIC)
    while offset < len(data):
        offsets.append(offset)
        offset += 4 + struct.unpack_from(">I", data, offset)[0]
    return offsets


def test_bad_magic(tmp_path: Path) -> None:
    path = tmp_path / "bad.kvcap"
    path.write_bytes(b"KVCAP\x02\n" + b"\x00" * 20)
    with pytest.raises(CaptureError, match=re.escape(f"{path}: not a kvcap file (bad magic)")):
        CaptureReader(path)
    empty = tmp_path / "empty.kvcap"
    empty.write_bytes(b"")
    with pytest.raises(CaptureError, match=re.escape(f"{empty}: not a kvcap file (bad magic)")):
        CaptureReader(empty)


def test_truncated_files(tmp_path: Path) -> None:
    whole = tmp_path / "whole.kvcap"
    write(whole, RECORDS)
    data = whole.read_bytes()
    last = record_offsets(data)[-1]

    body = tmp_path / "body.kvcap"
    body.write_bytes(data[:-3])
    reader = CaptureReader(body)  # the header is intact
    with pytest.raises(
        CaptureError, match=re.escape(f"{body}: truncated record at byte {last + 4}")
    ):
        list(reader)

    length = tmp_path / "length.kvcap"
    length.write_bytes(data + b"\x00\x00")
    with pytest.raises(
        CaptureError, match=re.escape(f"{length}: truncated record length at byte {len(data)}")
    ):
        list(CaptureReader(length))

    header = tmp_path / "header.kvcap"
    header.write_bytes(data[: len(MAGIC) + 6])
    with pytest.raises(
        CaptureError, match=re.escape(f"{header}: truncated record at byte {len(MAGIC) + 4}")
    ):
        CaptureReader(header)

    magic_only = tmp_path / "magic.kvcap"
    magic_only.write_bytes(MAGIC)
    with pytest.raises(CaptureError, match=re.escape(f"{magic_only}: unreadable header")):
        CaptureReader(magic_only)


def test_undecodable_record_and_unknown_version(tmp_path: Path) -> None:
    whole = tmp_path / "whole.kvcap"
    write(whole, RECORDS[:1])
    data = whole.read_bytes()
    garbage = tmp_path / "garbage.kvcap"
    garbage.write_bytes(data + struct.pack(">I", 3) + msgspec.msgpack.encode([1, 2]))
    reader = CaptureReader(garbage)
    with pytest.raises(CaptureError, match=re.escape(f"{garbage}: record 1: ")):
        list(reader)

    header = msgspec.msgpack.encode({"format": "kvcap", "version": 3, "created_ns": 0})
    future = tmp_path / "future.kvcap"
    future.write_bytes(MAGIC + struct.pack(">I", len(header)) + header)
    with pytest.raises(CaptureError, match=re.escape(f"{future}: unsupported capture version 3")):
        CaptureReader(future)
    assert issubclass(CaptureError, ValueError)


def reading_error(path: Path) -> str:
    """The error opening ``path`` as a capture raises."""
    with pytest.raises(CaptureError) as raised:
        CaptureReader(path)
    return str(raised.value)


@pytest.mark.parametrize("value", ["4", 4.0, True, 0, -4, 2**32, [4]])
def test_a_header_block_size_that_is_no_block_size(tmp_path: Path, value: object) -> None:
    path = raw_capture(tmp_path / "x.kvcap", {**HEADER, "meta": {"block_size": value}}, [])
    assert reading_error(path) == (
        f"{path}: header block_size must be an integer in [1, 4294967295], got {value!r}"
    )


def test_header_block_size(tmp_path: Path) -> None:
    sized = raw_capture(tmp_path / "a.kvcap", {**HEADER, "meta": {"block_size": 2**32 - 1}}, [])
    assert CaptureReader(sized).block_size == 2**32 - 1
    assert CaptureReader(raw_capture(tmp_path / "b.kvcap", HEADER, [])).block_size is None


@pytest.mark.parametrize(
    ("record", "error"),
    [
        ([T0, "s", -1, [b""]], "Expected `int` >= 0 - at `$[2]`"),
        ([T0, "s", 1, []], "a message has at least one frame"),
        (
            [T0, "s", 1, [b"f"], {"reason": "lost"}],
            "a record has frames (a message) or a reset, not both",
        ),
        ([T0, "s", 1, [], {"reason": "gone"}], "Invalid enum value 'gone' - at `$[4].reason`"),
        (
            [T0, "s", 1, [], {"reason": "lost", "lost_batches": -1}],
            "Expected `int` >= 0 - at `$[4].lost_batches`",
        ),
    ],
    ids=["negative worker id", "no frames", "frames and a reset", "no reason", "negative loss"],
)
def test_a_record_no_message_could_make(tmp_path: Path, record: list[object], error: str) -> None:
    path = raw_capture(tmp_path / "x.kvcap", HEADER, [[T0, "s", 1, [b"f"]], record])
    reader = CaptureReader(path)
    with pytest.raises(CaptureError) as raised:
        list(reader)
    assert str(raised.value) == f"{path}: record 1: {error}"


def test_resets_are_kept_where_they_fell(tmp_path: Path) -> None:
    """A reset record sits between the messages it came between, with its reason, its count
    of lost batches and whether it was checked; the default fields are left out of the file,
    and a reset record has no seq and no framing error."""
    source = Source("tcp://127.0.0.1:5557", worker_id=3)
    path = tmp_path / "resets.kvcap"
    with CaptureWriter(path) as writer:
        writer.write([b"", seq8(0), b"p"], stream=source.endpoint, worker_id=3, received_ns=T0)
        writer.write_reset(StreamReset(source, "lost", 4, False), received_ns=T0 + 1)
        writer.write_reset(StreamReset(source, "repair"), received_ns=T0 + 2)
        assert (writer.count, writer.resets) == (1, 2)
    records = list(CaptureReader(path))
    lost = RecordedReset("lost", lost_batches=4, checked=False)
    assert records[1:] == [
        FrameRecord(T0 + 1, source.endpoint, 3, [], lost),
        FrameRecord(T0 + 2, source.endpoint, 3, [], RecordedReset("repair")),
    ]
    assert [(record.seq, record.framing_error) for record in records] == [(0, None)] + [
        (None, None)
    ] * 2
    assert records[1].stream_reset(source) == StreamReset(source, "lost", 4, False)
    assert records[0].stream_reset(source) is None
    data = path.read_bytes()
    assert data.endswith(
        msgspec.msgpack.encode([T0 + 2, source.endpoint, 3, [], {"reason": "repair"}])
    )
    assert msgspec.msgpack.encode({"format": "kvcap", "version": 2})[1:] in data


def test_a_reset_is_timed_by_its_streams_latest_message(tmp_path: Path) -> None:
    """A subscriber hands out a reset with the messages after it, received before the reset
    is written: the reset takes the time of its stream's latest message written (live or
    replayed), or the capture's start, so that each stream's records stay in time order and
    a merge by receive time keeps every stream's order."""
    a, b = Source("tcp://127.0.0.1:5557", worker_id=1), Source("tcp://127.0.0.1:5558", worker_id=2)
    path = tmp_path / "timed.kvcap"
    with CaptureWriter(path) as writer:
        t = time.time_ns() + 10**9  # received after the capture began
        writer.write_reset(StreamReset(b, "lost", 1))
        writer.write(
            [b"", seq8(0), b"p"], stream=f"replay:{a.endpoint}", worker_id=1, received_ns=t
        )
        writer.write([b"", seq8(0), b"q"], stream=b.endpoint, worker_id=2, received_ns=t + 60)
        writer.write_reset(StreamReset(a, "repair"))
        writer.write([b"", seq8(1), b"p"], stream=a.endpoint, worker_id=1, received_ns=t + 55)
    reader = CaptureReader(path)
    records = list(reader)
    assert [record.received_ns for record in records] == [
        reader.created_ns, t, t + 60, t, t + 55
    ]  # fmt: skip
    merged = in_receipt_order(list(capture_streams(records).values()))
    assert [(index, record.received_ns, record.reset is None) for index, record in merged] == [
        (0, reader.created_ns, False), (1, t, True), (1, t, False), (1, t + 55, True),
        (0, t + 60, True),
    ]  # fmt: skip


def test_a_version_1_capture_is_read(tmp_path: Path) -> None:
    """Captures written before reset records (version 1) read as before."""
    record = [T0, "s", 1, [b"", seq8(5), b"p"]]
    path = raw_capture(tmp_path / "old.kvcap", {**HEADER, "version": 1}, [record])
    assert list(CaptureReader(path)) == [FrameRecord(T0, "s", 1, [b"", seq8(5), b"p"])]


def test_headers_that_are_not_this_format(tmp_path: Path) -> None:
    other = raw_capture(tmp_path / "other.kvcap", {**HEADER, "format": "pcap"}, [])
    assert reading_error(other) == f"{other}: not a kvcap capture (its header's format is 'pcap')"
    future = raw_capture(tmp_path / "future.kvcap", {**HEADER, "version": 3}, [])
    assert reading_error(future) == (
        f"{future}: unsupported capture version 3 (this kvbridge reads versions 1, 2)"
    )
    magic_only = tmp_path / "magic.kvcap"
    magic_only.write_bytes(MAGIC)
    assert (
        reading_error(magic_only)
        == f"{magic_only}: unreadable header: the file ends after its magic"
    )


def test_a_fifo_is_refused_unread(tmp_path: Path) -> None:
    """A FIFO's reader would wait for a writer forever."""
    fifo = tmp_path / "fifo.kvcap"
    os.mkfifo(fifo)
    assert reading_error(fifo) == f"{fifo}: not a regular file"


def test_a_header_nested_too_deeply(tmp_path: Path) -> None:
    deep = b"\x91" * 100_000 + b"\xc0"  # msgspec's decoder recurses once per level
    header = b"\x84" + b"".join(
        msgspec.msgpack.encode(key) + value
        for key, value in [
            ("format", msgspec.msgpack.encode("kvcap")),
            ("version", b"\x01"),
            ("created_ns", b"\x00"),
            ("meta", b"\x81" + msgspec.msgpack.encode("deep") + deep),
        ]
    )
    path = tmp_path / "deep.kvcap"
    path.write_bytes(MAGIC + struct.pack(">I", len(header)) + header)
    assert reading_error(path) == f"{path}: unreadable header: nested too deeply"


def test_prompts_files_that_are_not_prompts(tmp_path: Path) -> None:
    deep = tmp_path / "deep.json"
    deep.write_bytes(b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(ValueError) as raised:
        read_prompts(deep)
    assert str(raised.value) == f"{deep}: not JSON this reader takes: nested too deeply"
    fifo = tmp_path / "prompts.fifo"
    os.mkfifo(fifo)
    with pytest.raises(ValueError) as raised:
        read_prompts(fifo)  # read, it would wait for a writer forever
    assert str(raised.value) == f"{fifo}: not a regular file"


def test_a_read_error_names_the_file() -> None:
    """Reading /proc/self/mem at offset 0 (unmapped) fails with EIO, and the OS names no file."""
    with pytest.raises(OSError) as raised:
        CaptureReader("/proc/self/mem")
    assert (raised.value.filename, raised.value.strerror) == (
        "/proc/self/mem",
        "Input/output error",
    )


@pytest.mark.skipif(
    Path("/proc/sys/vm/overcommit_memory").read_text().strip() == "1",
    reason="with overcommit always on, the allocation succeeds and the read takes hours",
)
def test_a_capture_larger_than_memory(tmp_path: Path) -> None:
    huge = tmp_path / "huge.kvcap"
    with huge.open("wb") as file:
        file.write(MAGIC)
        file.truncate(2**40)  # sparse: a TiB that takes no disk
    assert reading_error(huge) == f"{huge}: too large to read into memory ({2**40} bytes)"


def test_a_fifo_no_process_reads_is_refused_at_once(tmp_path: Path) -> None:
    """Waiting for a reader to open it could not be ended by a signal."""
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    with pytest.raises(OSError) as raised:
        CaptureWriter(fifo)
    assert (raised.value.filename, raised.value.strerror) == (
        str(fifo),
        "a FIFO that no process reads",
    )


def test_a_fifo_with_a_reader_is_written(tmp_path: Path) -> None:
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        with CaptureWriter(fifo) as writer:
            writer.write([b"p"], stream="s", received_ns=T0)
        data = os.read(reader, 1 << 16)
    finally:
        os.close(reader)
    assert data.startswith(MAGIC)
    assert data.endswith(msgspec.msgpack.encode([T0, "s", 0, [b"p"]]))


def test_the_end_marker_is_no_seq() -> None:
    """2**64 - 1 is the replay protocol's end marker: no batch has it."""
    assert FrameRecord(T0, "s", 1, [b"", b"\xff" * 8, b"p"]).seq is None
    assert FrameRecord(T0, "s", 1, [b"", b"\xff" * 7 + b"\xfe", b"p"]).seq == 2**64 - 2


def test_capture_name_is_text_json_can_hold() -> None:
    assert capture_name("a/b.kvcap") == "a/b.kvcap"
    assert capture_name(Path(os.fsdecode(b"bad\xffname.kvcap"))) == "bad\\xffname.kvcap"
    assert msgspec.json.encode(capture_name(os.fsdecode(b"\xff"))) == b'"\\\\xff"'


def test_a_failed_write_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(CaptureWriteError) as raised, CaptureWriter("/dev/full") as writer:
        writer.write([b"p"], stream="s")
        writer.flush()
    assert (raised.value.filename, raised.value.strerror) == (
        "/dev/full",
        "No space left on device",
    )


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_header_that_cannot_be_written_closes_the_file() -> None:
    """A header larger than the write buffer fails at once; the descriptor must not stay open."""
    before = _open_descriptors()
    with pytest.raises(CaptureWriteError) as raised:
        CaptureWriter("/dev/full", meta={"prompts": "x" * 100_000})
    assert (raised.value.filename, raised.value.strerror) == (
        "/dev/full",
        "No space left on device",
    )
    assert _open_descriptors() == before


def test_an_error_inside_the_with_is_not_replaced_by_a_failed_close() -> None:
    before = _open_descriptors()
    with pytest.raises(KeyError, match="the body's"), CaptureWriter("/dev/full") as writer:
        writer.write([b"p"], stream="s")
        raise KeyError("the body's")
    assert _open_descriptors() == before


def test_a_fifo_whose_reader_has_gone_is_a_broken_pipe(tmp_path: Path) -> None:
    """As a closed stdout: the command ends quietly rather than failing."""
    fifo = tmp_path / "capture.fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    writer = CaptureWriter(fifo)
    os.close(reader)
    with pytest.raises(BrokenPipeError) as raised, writer:
        writer.write([b"p"], stream="s")
        writer.flush()
    assert raised.value.filename == str(fifo)


def test_a_long_wait_in_an_original_paced_replay_is_logged() -> None:
    """A damaged receive time far in the future would stall the replay silently."""
    records = [
        FrameRecord(T0, "s", 1, [b"", seq8(0), b"a"]),
        FrameRecord(T0 + 3_600 * 10**9, "s", 1, [b"", seq8(1), b"b"]),
    ]
    stop = threading.Event()
    endpoint = f"tcp://127.0.0.1:{free_port_range(1)}"
    timer = threading.Timer(0.5, stop.set)
    timer.start()
    try:
        with structlog.testing.capture_logs() as lines:
            [result] = replay_streams(
                [(endpoint, records)], bind=True, wait_subscribers=0, stop=stop
            )
    finally:
        timer.cancel()
    assert result.sent == 1
    [line] = [line for line in lines if line["log_level"] == "warning"]
    assert line["event"] == "long wait: the capture's receive times are this far apart"
    assert (line["stream"], line["sent"]) == (endpoint, 1)
    assert 3_599 <= line["seconds"] <= 3_600


def test_bundled_sample() -> None:
    reader = CaptureReader(Path(str(resources.files("kvbridge") / "data" / "sample.kvcap")))
    records = list(reader)
    assert len(records) == 7
    assert reader.meta["block_size"] == 4
    assert [(r.worker_id, r.seq) for r in records] == [
        (1, 0),
        (1, 1),
        (1, 2),
        (1, 3),
        (2, 0),
        (2, 1),
        (2, 2),
    ]


# --------------------------------------------------------------------------- the CLI


def replayable_engine(ctx: zmq.Context[zmq.Socket[bytes]]) -> Publisher:
    """An engine's publisher bound on 127.0.0.1, its replay thread serving."""
    publisher = Publisher(
        "tcp://127.0.0.1:0", bind=True, replay_endpoint="tcp://127.0.0.1:0", context=ctx
    )
    publisher.start_replay_thread()
    return publisher


def record_engine(
    publisher: Publisher, out: Path, count: int
) -> tuple[str, str, subprocess.Popen[str]]:
    """``kvbridge record`` of ``publisher``'s stream as worker 3 into ``out`` until ``count``
    messages, once it has subscribed: its source and replay endpoints, and the process."""
    endpoint = f"tcp://*:{publisher.endpoint.rsplit(':', 1)[1]}"
    replay_endpoint = publisher.replay_endpoint
    assert replay_endpoint is not None
    recorder = kvbridge(
        "record",
        "--source", endpoint,
        "--source-replay", replay_endpoint,
        "--worker-id", "3",
        "--out", str(out),
        "--count", str(count),
    )  # fmt: skip
    if not publisher.wait_for_subscribers(timeout=TIMEOUT):
        finish(recorder)
        pytest.fail("the recorder never subscribed")
    return endpoint, replay_endpoint, recorder


def test_record_then_replay_byte_for_byte(
    tmp_path: Path, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    payloads = seeded_stream(3, 8, block_size=BS).payloads
    payloads.insert(4, b"\xc1 not msgpack at all")  # framed right, payload malformed
    dropped = 6  # recovered through the replay socket
    count = len(payloads)
    out = tmp_path / "rec.kvcap"

    with replayable_engine(ctx) as publisher:
        endpoint, replay_endpoint, recorder = record_engine(publisher, out, count)
        try:
            for seq, payload in enumerate(payloads):
                assert publisher.publish(payload, send=seq != dropped) == seq
                time.sleep(0.02)
        finally:
            finish(recorder)

    sent = [[b"", seq8(seq), payload] for seq, payload in enumerate(payloads)]
    reader = CaptureReader(out)
    records = list(reader)
    assert reader.meta == {
        "command": "kvbridge record",
        "sources": [
            {
                "endpoint": endpoint,
                "replay_endpoint": replay_endpoint,
                "worker_id": 3,
                "topic": "",
                "bind": None,
            }
        ],
    }
    assert [record.frames for record in records] == sent
    assert [record.seq for record in records] == list(range(count))
    assert {record.worker_id for record in records} == {3}
    assert [record.stream for record in records[:dropped]] == [endpoint] * dropped
    assert records[dropped].stream == f"replay:{endpoint}"
    assert {record.stream for record in records[dropped:]} <= {endpoint, f"replay:{endpoint}"}
    stamps = [record.received_ns for record in records]
    assert stamps == sorted(stamps)

    # Replayed at full speed to a plain SUB: the recorded frames, in order, byte for byte.
    port = free_port_range(1)
    sub = subscriber(ctx, port)
    replayer = kvbridge("replay", str(out), "--publish", f"tcp://*:{port}", "--pace", "max")
    try:
        received = [sub.recv_multipart() for _ in range(count)]
    finally:
        stderr = finish(replayer)
    assert received == [record.frames for record in records] == sent
    assert f"messages={count}" in stderr


def test_record_keeps_an_engine_restart_and_a_reader_clears_at_it(
    tmp_path: Path, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    """An engine that restarts while recorded: the capture holds the first process's batches,
    the ``restart`` reset where the recorder's subscriber found it, and the new process's
    batches. Read back through a pipeline (as ``demo`` and ``validate`` read it), the index is
    the new process's alone, as a relay's would be; ``validate`` counts the reset, and
    ``replay`` publishes the messages and passes over the reset."""
    before = seeded_stream(4, 3, block_size=BS).payloads
    after = seeded_stream(5, 3, block_size=BS).payloads
    out = tmp_path / "restart.kvcap"
    with replayable_engine(ctx) as publisher:
        _, _, recorder = record_engine(publisher, out, 6)
        try:
            for payloads in (before, after):
                for payload in payloads:
                    publisher.publish(payload)
                    time.sleep(0.05)
                publisher.restart()
        finally:
            stderr = finish(recorder)

    records = list(CaptureReader(out))
    assert [(r.seq, r.reset) for r in records] == [
        (0, None), (1, None), (2, None), (None, RecordedReset("restart")),
        (0, None), (1, None), (2, None),
    ]  # fmt: skip
    assert [r.frames[2] for r in records if r.reset is None] == before + after
    assert logged(stderr, "recorded", "messages", "resets") == ["6", "1"]

    index = TieredIndex(BS)
    pipeline = StreamPipeline(BS, sinks=[IndexSink(index)])
    for record in records:
        pipeline.feed_record(record)
    assert dump_rows(index) == dump_rows(index_of(after, worker_id=3, block_size=BS))
    assert dump_rows(index) != dump_rows(index_of(before + after, worker_id=3, block_size=BS))

    report = validate_captures([out], block_size=BS)
    assert (report.valid, report.frames, report.resets) == (True, 6, 1)

    port = free_port_range(1)
    sub = subscriber(ctx, port)
    replayer = kvbridge("replay", str(out), "--publish", f"tcp://*:{port}", "--pace", "max")
    try:
        received = [sub.recv_multipart()[2] for _ in range(6)]
    finally:
        stderr = finish(replayer)
    assert received == before + after
    assert logged(stderr, "replayed", "messages", "resets") == ["6", "1"]


def logged(stderr: str, event: str, *keys: str) -> list[str]:
    """The values of ``keys`` in the one log line of ``event``."""
    (line,) = [line for line in stderr.splitlines() if f"] {event} " in line]
    values = dict(re.findall(r" (\w+)=(\S+)", line))
    return [values[key] for key in keys]


def test_replay_keeps_the_original_pace(
    tmp_path: Path, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    path = tmp_path / "paced.kvcap"
    gap_ns, count = 100_000_000, 6
    records = [
        FrameRecord(T0 + i * gap_ns, "tcp://127.0.0.1:5557", 1, [b"", seq8(i), b"p%d" % i])
        for i in range(count)
    ]
    write(path, records)
    span = (count - 1) * gap_ns / 1e9

    port = free_port_range(1)
    sub = subscriber(ctx, port)
    replayer = kvbridge("replay", str(path), "--publish", f"tcp://*:{port}", "--pace", "original")
    received, stamps = [], []
    try:
        for _ in range(count):
            received.append(sub.recv_multipart())
            stamps.append(time.monotonic())
    finally:
        finish(replayer)
    assert received == [record.frames for record in records]
    assert stamps[-1] - stamps[0] >= 0.9 * span


def test_replay_of_a_corrupt_capture_fails_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.kvcap"
    path.write_bytes(b"garbage")
    result = subprocess.run(
        [sys.executable, "-m", "kvbridge.cli", "replay", str(path), "--publish", "tcp://*:1"],
        capture_output=True,
        text=True,
        check=False,
        timeout=TIMEOUT,
    )
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"kvbridge replay: error: {path}: not a kvcap file (bad magic)"
    ]
