"""Tests for ``kvbridge.adapters.publisher.Publisher`` over real ZMQ sockets on 127.0.0.1.

(a) live frames seen by a SUB, (b) replay answers seen by a DEALER, in both layouts,
(c) a real ``dynamo.llm.SelectionService`` indexing what the Publisher sends,
(d) the SelectionService recovering unsent batches through the replay socket.

The publisher and replay protocol: README.md, "The relay in front of Dynamo".
"""

from __future__ import annotations

import socket
import struct
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import structlog
import xxhash
import zmq
from support.memory import rss_mb
from support.selection_harness import SelectionHarness, wait_connected

from kvbridge.adapters.endpoints import should_bind
from kvbridge.adapters.publisher import MAX_BUFFER_STEPS, Publisher
from kvbridge.adapters.replay_protocol import END_SEQ
from kvbridge.adapters.replay_server import AnswerCut

LOCAL = "tcp://127.0.0.1:0"
RECV_TIMEOUT_MS = 2000

# tokens 100..115 with block size 4: four blocks (dynamo-indexer.md 2.1).
TOKENS = list(range(100, 116))
BLOCK_SIZE = 4
TOKENS_HASH = [
    6320977984009303047,
    16988655349664461655,
    6717274780279712737,
    10507561201108444448,
]
SEQUENCE_HASH = [
    6320977984009303047,
    3184517425968952090,
    3284552213212070830,
    4799968867515202603,
]
# vLLM-side block hashes: the 64-bit SHA-256 conversions of "a" and "b" (vllm-kv-events.md 13),
# plus two more. Dynamo keys its index on tokens_hash, not on these.
H_A = 13366815110101616827
H_B = 14660323646696587421
H_C = 3
H_D = 4

# BlockStored, map form (0.24+), from vllm-kv-events.md section 13.
BLOCK_STORED_VECTOR = bytes.fromhex(
    "de000ba474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cfb9807785afee48bb"
    "cfcb73eeaed59c009db1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f69647398010203"
    "0405060708aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f7261"
    "5f6e616d65c0aa65787472615f6b65797392c0c0a967726f75705f69647800b26b765f63616368655f73"
    "7065635f6b696e64ae66756c6c5f617474656e74696f6e"
)


# --------------------------------------------------------------------------- encoders


def block_stored(
    hashes: list[int],
    tokens: list[int],
    *,
    parent: int | None = None,
    medium: str = "GPU",
    lora_name: str | None = None,
) -> dict[str, Any]:
    """A vLLM 0.24+ tagged-map BlockStored event, field order as vLLM emits it."""
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BLOCK_SIZE,
        "lora_id": None,
        "medium": medium,
        "lora_name": lora_name,
        "extra_keys": [None] * len(hashes),
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }


def block_removed(hashes: list[int], *, medium: str = "GPU") -> dict[str, Any]:
    """A vLLM 0.24+ tagged-map BlockRemoved event."""
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium, "group_idx": 0}


def batch(events: list[dict[str, Any]], dp_rank: int = 0, ts: float = 1_700_000_000.5) -> bytes:
    """A msgpack batch ``[ts, events, dp_rank]`` (an array in every vLLM version)."""
    return msgspec.msgpack.encode([ts, events, dp_rank])


def seq8(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def tokens_hash(block: list[int], seed: int = 1337) -> int:
    return xxhash.xxh3_64_intdigest(b"".join(t.to_bytes(4, "little") for t in block), seed=seed)


def signed(value: int) -> int:
    return value - 2**64 if value >= 2**63 else value


# --------------------------------------------------------------------------- fixtures


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def harness() -> Iterator[SelectionHarness]:
    with SelectionHarness() as h:
        yield h


def subscriber(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> zmq.Socket[bytes]:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    return sub


def dealer(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
    sock.connect(endpoint)
    return sock


def slow_dealer(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> zmq.Socket[bytes]:
    """A DEALER that takes in one message at a time through a 4 KiB receive buffer: until it
    reads, what is sent to it stays queued at the sender."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
    sock.connect(endpoint)
    return sock


def read_replay(sock: zmq.Socket[bytes]) -> list[list[bytes]]:
    """Every message of one replay answer, end marker included."""
    messages: list[list[bytes]] = []
    while True:
        frames = sock.recv_multipart()
        messages.append(frames)
        if frames[-1] == b"" and frames[-2] == END_SEQ:
            return messages


def request_replay(pub: Publisher, sock: zmq.Socket[bytes], start: int) -> list[list[bytes]]:
    """Send a replay request from a DEALER, serve it in this thread, read the answer."""
    sock.send_multipart([b"", seq8(start)])
    assert pub.serve_replays(timeout_ms=RECV_TIMEOUT_MS) == 1
    return read_replay(sock)


# --------------------------------------------------------------------------- bind/connect


@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [
        ("tcp://*:5557", True),
        ("tcp://[::]:5557", True),
        ("tcp://::1:5557", True),
        ("ipc:///tmp/kv", True),
        ("inproc://kv", True),
        ("tcp://127.0.0.1:5557", False),
        ("tcp://10.0.0.5:5557", False),
        ("tcp://localhost:5557", False),
    ],
)
def test_should_bind_follows_vllm_rule(endpoint: str, expected: bool) -> None:
    assert should_bind(endpoint) is expected


def test_endpoints_resolve_ephemeral_ports() -> None:
    with Publisher(LOCAL, bind=True, replay_endpoint=LOCAL) as pub:
        assert pub.endpoint.startswith("tcp://127.0.0.1:")
        assert pub.replay_endpoint is not None
        assert pub.replay_endpoint.startswith("tcp://127.0.0.1:")
        assert int(pub.endpoint.rsplit(":", 1)[1]) > 0
        assert int(pub.replay_endpoint.rsplit(":", 1)[1]) > 0
        assert pub.endpoint != pub.replay_endpoint
    with Publisher("tcp://*:0") as pub:  # '*' binds by vLLM's rule
        assert pub.endpoint.startswith("tcp://0.0.0.0:")
        assert pub.replay_endpoint is None


# --------------------------------------------------------------------------- (a) live frames


def test_sub_receives_exact_frames(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with Publisher(LOCAL, bind=True, topic="kv@r0") as pub:
        sub = subscriber(ctx, pub.endpoint)
        assert pub.wait_for_subscribers(timeout=5.0)
        assert pub.publish(b"p0") == 0
        assert pub.publish(b"p1") == 1
        assert pub.publish(b"p7", seq=7) == 7
        assert pub.publish(b"p8", send=False) == 8  # stored for replay, never sent
        assert pub.publish(b"p9") == 9
        assert pub.next_seq == 10
        pub.restart()
        assert pub.next_seq == 0
        assert pub.publish(b"again") == 0

        received = [sub.recv_multipart() for _ in range(5)]
        assert received == [
            [b"kv@r0", seq8(0), b"p0"],
            [b"kv@r0", seq8(1), b"p1"],
            [b"kv@r0", seq8(7), b"p7"],
            [b"kv@r0", seq8(9), b"p9"],
            [b"kv@r0", seq8(0), b"again"],
        ]
        assert sub.poll(100) == 0


def test_connect_mode_when_subscriber_binds(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """tcp://127.0.0.1:PORT makes vLLM (and the Publisher, by default) connect."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(LOCAL)
    address = sub.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(address, bytes)
    with Publisher(address.decode(), context=ctx) as pub:
        assert pub.endpoint == address.decode()
        assert pub.wait_for_subscribers(timeout=5.0)
        # A *bound* SUB sends its subscription to a new peer only when its own thread next
        # processes commands (any poll/recv). Without this poll the first batches are dropped.
        assert sub.poll(100) == 0
        payload = batch([block_removed([H_A])])
        assert pub.publish(payload) == 0
        assert sub.recv_multipart() == [b"", seq8(0), payload]


def test_argument_validation() -> None:
    with pytest.raises(ValueError, match="buffer_steps"):
        Publisher(LOCAL, bind=True, buffer_steps=-1)
    # Past these ZMQ's int high-water marks would overflow.
    with pytest.raises(
        ValueError, match=r"^buffer_steps must be in \[0, 1073741821\], got 1073741822$"
    ):
        Publisher(LOCAL, bind=True, buffer_steps=MAX_BUFFER_STEPS + 1)
    with pytest.raises(ValueError, match=r"^hwm must be in \[0, 2147483647\], got 2147483648$"):
        Publisher(LOCAL, bind=True, hwm=2**31)
    pub = Publisher(LOCAL, bind=True)
    with pytest.raises(ValueError, match="seq"):
        pub.publish(b"x", seq=-1)
    with pytest.raises(ValueError, match="seq"):
        pub.publish(b"x", seq=2**64 - 1)  # would read as the end marker
    assert pub.publish(b"x", seq=2**64 - 2) == 2**64 - 2
    with pytest.raises(RuntimeError, match="no replay_endpoint"):
        pub.start_replay_thread()
    assert pub.serve_replays() == 0
    pub.close()
    pub.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        pub.publish(b"x")


# --------------------------------------------------------------------------- (b) replay


def test_replay_topic_layout(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with Publisher(LOCAL, bind=True, replay_endpoint=LOCAL, topic="kv") as pub:
        assert pub.replay_endpoint is not None
        for payload in (b"b0", b"b1", b"b2"):
            pub.publish(payload, send=False)
        sock = dealer(ctx, pub.replay_endpoint)
        assert request_replay(pub, sock, 1) == [
            [b"", b"kv", seq8(1), b"b1"],
            [b"", b"kv", seq8(2), b"b2"],
            [b"", b"", END_SEQ, b""],
        ]
        assert request_replay(pub, sock, 0)[0] == [b"", b"kv", seq8(0), b"b0"]
        assert request_replay(pub, sock, 3) == [[b"", b"", END_SEQ, b""]]


def test_replay_legacy_layout(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with Publisher(
        LOCAL, bind=True, replay_endpoint=LOCAL, topic="kv", replay_topic_frame=False
    ) as pub:
        assert pub.replay_endpoint is not None
        for payload in (b"b0", b"b1", b"b2"):
            pub.publish(payload)
        sock = dealer(ctx, pub.replay_endpoint)
        assert request_replay(pub, sock, 1) == [
            [b"", seq8(1), b"b1"],
            [b"", seq8(2), b"b2"],
            [b"", END_SEQ, b""],
        ]
        assert request_replay(pub, sock, 99) == [[b"", END_SEQ, b""]]


@pytest.mark.parametrize("topic_frame", [True, False])
def test_replay_after_buffer_aged_out(
    ctx: zmq.Context[zmq.Socket[bytes]], topic_frame: bool
) -> None:
    """buffer_steps=3, five batches, ask for 0: batches 2, 3, 4, then the marker, no signal."""
    with Publisher(
        LOCAL, bind=True, replay_endpoint=LOCAL, buffer_steps=3, replay_topic_frame=topic_frame
    ) as pub:
        assert pub.replay_endpoint is not None
        for i in range(5):
            assert pub.publish(f"b{i}".encode()) == i
        answer = request_replay(pub, dealer(ctx, pub.replay_endpoint), 0)
    if topic_frame:
        assert answer == [
            [b"", b"", seq8(2), b"b2"],
            [b"", b"", seq8(3), b"b3"],
            [b"", b"", seq8(4), b"b4"],
            [b"", b"", END_SEQ, b""],
        ]
    else:
        assert answer == [
            [b"", seq8(2), b"b2"],
            [b"", seq8(3), b"b3"],
            [b"", seq8(4), b"b4"],
            [b"", END_SEQ, b""],
        ]


def test_replay_buffer_bounded_in_bytes(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """buffer_bytes=10: of 4-byte batches it keeps the last two (12 bytes would not fit), and a
    batch larger than the bound alone, the newest being kept whatever its size."""
    with Publisher(LOCAL, bind=True, replay_endpoint=LOCAL, buffer_bytes=10) as pub:
        assert pub.replay_endpoint is not None
        for i in range(4):
            pub.publish(f"b{i:03}".encode(), send=False)
        sock = dealer(ctx, pub.replay_endpoint)
        assert request_replay(pub, sock, 0) == [
            [b"", b"", seq8(2), b"b002"],
            [b"", b"", seq8(3), b"b003"],
            [b"", b"", END_SEQ, b""],
        ]
        assert pub.publish(b"x" * 11, send=False) == 4
        assert request_replay(pub, sock, 0) == [
            [b"", b"", seq8(4), b"x" * 11],
            [b"", b"", END_SEQ, b""],
        ]
        pub.restart()
        pub.publish(b"n000", send=False)
        assert request_replay(pub, sock, 0)[0] == [b"", b"", seq8(0), b"n000"]
    with pytest.raises(ValueError, match="buffer_bytes"):
        Publisher(LOCAL, bind=True, buffer_bytes=-1)


def test_restart_empties_replay_buffer(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with Publisher(LOCAL, bind=True, replay_endpoint=LOCAL) as pub:
        assert pub.replay_endpoint is not None
        pub.publish(b"old0")
        pub.publish(b"old1")
        pub.restart()
        sock = dealer(ctx, pub.replay_endpoint)
        assert request_replay(pub, sock, 0) == [[b"", b"", END_SEQ, b""]]
        assert pub.publish(b"new0") == 0
        assert request_replay(pub, sock, 0) == [
            [b"", b"", seq8(0), b"new0"],
            [b"", b"", END_SEQ, b""],
        ]


def test_malformed_replay_requests_are_ignored(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with Publisher(LOCAL, bind=True, replay_endpoint=LOCAL) as pub:
        assert pub.replay_endpoint is not None
        pub.publish(b"b0")
        sock = dealer(ctx, pub.replay_endpoint)
        sock.send_multipart([b"", b"\x00\x00"])  # seq not 8 bytes
        sock.send_multipart([b"x", seq8(0)])  # delimiter not empty
        sock.send_multipart([b"", seq8(0), b"extra"])  # 4 frames at the ROUTER
        sock.send_multipart([seq8(0)])  # REQ-less, delimiter-less
        time.sleep(0.1)
        assert pub.serve_replays(timeout_ms=RECV_TIMEOUT_MS) == 0
        assert sock.poll(100) == 0
        assert request_replay(pub, sock, 0) == [
            [b"", b"", seq8(0), b"b0"],
            [b"", b"", END_SEQ, b""],
        ]


def test_peers_with_the_longest_routing_id_and_a_long_topic_are_served(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """The bounds on what the publisher's sockets receive admit every legitimate peer: a
    DEALER with a routing id of 255 bytes (the longest ZMQ allows; its handshake is about 300
    bytes) is answered, and a SUB of a 60,000-byte topic gets the batches under it."""
    topic = "t" * 60_000
    with Publisher(LOCAL, bind=True, replay_endpoint=LOCAL, topic=topic) as pub:
        assert pub.replay_endpoint is not None
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
        sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        sub.connect(pub.endpoint)
        assert pub.wait_for_subscribers(timeout=5)
        time.sleep(0.2)  # the subscription reaches the PUB after the handshake
        pub.publish(b"b0")
        assert sub.recv_multipart() == [topic.encode(), seq8(0), b"b0"]
        sub.close()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
        sock.setsockopt(zmq.ROUTING_ID, b"i" * 255)
        sock.connect(pub.replay_endpoint)
        assert request_replay(pub, sock, 0) == [
            [b"", topic.encode(), seq8(0), b"b0"],
            [b"", b"", END_SEQ, b""],
        ]
        sock.close()


def _zmtp_peer(port: int, socket_type: bytes) -> socket.socket:
    """A raw ZMTP 3.0 peer of ``socket_type`` (NULL mechanism), handshake done: frames are
    written by hand, so that one can announce a size it never sends."""
    peer = socket.create_connection(("127.0.0.1", port))
    peer.settimeout(3.0)
    peer.sendall(b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\x00") + bytes(32))
    body = b"\x05READY\x0bSocket-Type" + struct.pack(">I", len(socket_type)) + socket_type
    peer.sendall(b"\x04" + bytes([len(body)]) + body)
    greeting = b""
    while b"READY" not in greeting:  # the other side's greeting and READY
        chunk = peer.recv(4096)
        assert chunk, "the handshake was refused"
        greeting += chunk
    return peer


def _disconnected_by_a_huge_frame(peer: socket.socket) -> bool:
    """Announce a 2 GiB frame and send 64 MiB of it: whether the other side then closes the
    connection (a reset, or the end of its stream) rather than read on."""
    try:
        peer.sendall(b"\x02" + struct.pack(">Q", 2**31))
        for _ in range(64):
            peer.sendall(bytes(1 << 20))
        return peer.recv(4096) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


@pytest.mark.parametrize(
    ("socket_type", "which"), [(b"DEALER", "replay ROUTER"), (b"SUB", "PUB")], ids=str
)
def test_a_peer_announcing_a_huge_frame_is_disconnected(socket_type: bytes, which: str) -> None:
    """The publisher's sockets receive only handshakes, replay requests and subscriptions,
    small frames: a peer that announces a 2 GiB frame is disconnected at the frame's header,
    not given the memory it announced (it held 400 MiB of it, sent and left idle, before the
    bound)."""
    with Publisher(LOCAL, bind=True, replay_endpoint=LOCAL) as pub:
        pub.start_replay_thread()
        endpoint = pub.replay_endpoint if which == "replay ROUTER" else pub.endpoint
        assert endpoint is not None
        peer = _zmtp_peer(int(endpoint.rsplit(":", 1)[1]), socket_type)
        before = rss_mb()
        assert _disconnected_by_a_huge_frame(peer)
        peer.close()
        assert rss_mb() - before < 32


def test_replay_thread_owns_router(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    pub = Publisher(LOCAL, bind=True, replay_endpoint=LOCAL, topic="t")
    assert pub.replay_endpoint is not None
    pub.start_replay_thread()
    with pytest.raises(RuntimeError, match="background thread"):
        pub.serve_replays()
    with pytest.raises(RuntimeError, match="already running"):
        pub.start_replay_thread()
    pub.publish(b"b0")
    pub.publish(b"b1", send=False)
    sock = dealer(ctx, pub.replay_endpoint)
    sock.send_multipart([b"", seq8(1)])
    assert read_replay(sock) == [[b"", b"t", seq8(1), b"b1"], [b"", b"", END_SEQ, b""]]
    started = time.monotonic()
    pub.close()
    assert time.monotonic() - started < 1.0
    assert pub.serve_replays() == 0


def test_full_replay_survives_slow_reader(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """ROUTER SNDHWM = 2*(buffer_steps+2): a full replay plus its marker fits even if the client
    reads nothing until it is all queued (with ZMQ's default 1000 only 1000 batches arrive)."""
    steps = 2500
    payload = b"x" * 4096
    with Publisher(LOCAL, bind=True, replay_endpoint=LOCAL, buffer_steps=steps) as pub:
        assert pub.replay_endpoint is not None
        for _ in range(steps):
            pub.publish(payload, send=False)
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 1)
        sock.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
        sock.connect(pub.replay_endpoint)
        sock.send_multipart([b"", seq8(0)])
        assert pub.serve_replays(timeout_ms=RECV_TIMEOUT_MS) == 1
        answer = read_replay(sock)
    assert len(answer) == steps + 1
    assert [int.from_bytes(m[2], "big") for m in answer[:-1]] == list(range(steps))
    assert answer[-1] == [b"", b"", END_SEQ, b""]


def test_peers_that_ask_and_never_read_share_the_buffers_payloads(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """10 DEALERs ask twice each for a buffer of 200 payloads of 60 KB (12 MB) and read none of
    it: the 20 answers queued for them (two fill the ROUTER's high-water mark) hold the
    buffer's own payloads, not a copy each, which would be 240 MB. The answers are whole and
    right when read."""
    steps, peers, asks = 200, 10, 2
    payloads = [bytes([i]) * 60_000 for i in range(steps)]
    with Publisher(LOCAL, bind=True, replay_endpoint=LOCAL, buffer_steps=steps) as pub:
        assert pub.replay_endpoint is not None
        for payload in payloads:
            pub.publish(payload, send=False)
        dealers = [slow_dealer(ctx, pub.replay_endpoint) for _ in range(peers)]
        before = rss_mb()
        served = 0
        for ask in range(1, asks + 1):
            for dealer in dealers:
                dealer.send_multipart([b"", seq8(0)])
            while served < peers * ask:
                newly = pub.serve_replays(timeout_ms=RECV_TIMEOUT_MS)
                assert newly, f"{peers * ask - served} requests were not served"
                served += newly
        grown = rss_mb() - before
        answers = [read_replay(dealers[0]) for _ in range(asks)]
        assert pub.replay_answers_cut == Counter()
    assert served == peers * asks
    assert grown < 12, f"the queued answers grew the RSS by {grown:.0f} MB"
    for answer in answers:
        assert [m[3] for m in answer[:-1]] == payloads
        assert answer[-1] == [b"", b"", END_SEQ, b""]


def test_an_answer_a_peer_cannot_take_stops_and_is_counted(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """A peer asks four times for a buffer of 200 payloads of 60 KB (from 100, then from 0
    three times) and reads nothing until all four are served. The ROUTER's high-water mark,
    2 x (200 + 2) = 404 messages, takes the first two answers (101 and 201 messages); the
    third stops after the 102 that still fit, the fourth at its first. Each cut answer is
    counted (``peer_full``) and logged with how many of its messages went, and nothing after
    the cut is sent, the end marker included: read afterwards, the peer has exactly the two
    whole answers and the first 102 messages of the third."""
    steps = 200
    payloads = [bytes([i]) * 60_000 for i in range(steps)]
    with Publisher(LOCAL, bind=True, replay_endpoint=LOCAL, buffer_steps=steps) as pub:
        assert pub.replay_endpoint is not None
        for payload in payloads:
            pub.publish(payload, send=False)
        peer = slow_dealer(ctx, pub.replay_endpoint)
        with structlog.testing.capture_logs() as lines:
            served = 0
            for start in (100, 0, 0, 0):
                peer.send_multipart([b"", seq8(start)])
                served += pub.serve_replays(timeout_ms=RECV_TIMEOUT_MS)
        assert served == 4
        assert pub.replay_answers_cut == Counter({AnswerCut.PEER_FULL: 2})
        cuts = [
            (line["event"], line["reason"], line["start_seq"], line["sent"], line["of"])
            for line in lines
        ]
        assert cuts == [
            ("replay answer cut", "peer_full", 0, 102, steps + 1),
            ("replay answer cut", "peer_full", 0, 0, steps + 1),
        ]
        whole = [[b"", b"", seq8(seq), payloads[seq]] for seq in range(steps)]
        whole.append([b"", b"", END_SEQ, b""])
        expected = whole[100:] + whole + whole[:102]
        received = [peer.recv_multipart() for _ in expected]
        peer.setsockopt(zmq.RCVTIMEO, 200)
        with pytest.raises(zmq.Again):
            peer.recv_multipart()
    assert received == expected


def test_an_answer_to_a_peer_that_went_away_is_counted(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """A request whose peer disconnects before it is served: the answer's first message is
    refused (the peer is unreachable), so none is sent, and it is counted ``peer_gone``."""
    with Publisher(LOCAL, bind=True, replay_endpoint=LOCAL, buffer_steps=4) as pub:
        assert pub.replay_endpoint is not None
        for payload in (b"b0", b"b1", b"b2"):
            pub.publish(payload, send=False)
        router = pub.replay_socket()._socket  # the ROUTER itself: to see the peer leave
        assert router is not None
        peer = ctx.socket(zmq.DEALER)
        peer.setsockopt(zmq.LINGER, 0)
        peer.setsockopt(zmq.ROUTING_ID, b"leaving")
        peer.connect(pub.replay_endpoint)
        peer.send_multipart([b"", seq8(0)])
        assert router.poll(RECV_TIMEOUT_MS, zmq.POLLIN)  # the request has arrived
        peer.close(linger=0)
        # The ROUTER forgets the peer some time after the disconnect: until a message to it
        # is refused, it is not gone yet (a message it takes meanwhile goes nowhere).
        deadline = time.monotonic() + RECV_TIMEOUT_MS / 1000
        while True:
            try:
                router.send_multipart([b"leaving", b"", b"probe"], zmq.NOBLOCK)
            except zmq.ZMQError as error:
                assert error.errno == zmq.EHOSTUNREACH
                break
            assert time.monotonic() < deadline, "the ROUTER still knows the peer"
            time.sleep(0.01)
        with structlog.testing.capture_logs() as lines:
            assert pub.serve_replays() == 1
        assert pub.replay_answers_cut == Counter({AnswerCut.PEER_GONE: 1})
    assert [(line["event"], line["reason"], line["sent"], line["of"]) for line in lines] == [
        ("replay answer cut", "peer_gone", 0, 4)
    ]


def test_a_payload_changed_after_it_was_published_replays_as_published(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """Answers share the buffer's payloads with ZMQ, so the buffer keeps a ``bytearray`` as a
    copy: changing it afterwards (or freeing it) changes nothing that is replayed."""
    payload = bytearray(b"a" * 60_000)
    with Publisher(LOCAL, bind=True, replay_endpoint=LOCAL, buffer_steps=4) as pub:
        assert pub.replay_endpoint is not None
        pub.publish(payload, send=False)  # type: ignore[arg-type]  # an untyped caller's
        payload[:] = b"b" * 120_000
        answer = request_replay(pub, dealer(ctx, pub.replay_endpoint), 0)
    assert [m[3] for m in answer] == [b"a" * 60_000, b""]


EXIT_WHILE_ANSWERING = """
import atexit
import time


def ask_at_exit():  # registered before pyzmq's exit handler, so it runs after it
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(pub.replay_endpoint)
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    time.sleep(0.5)  # the replay thread serves it meanwhile
    print("asked", flush=True)


atexit.register(ask_at_exit)
import zmq
from kvbridge.adapters.publisher import MAX_BUFFER_STEPS, Publisher

ctx = zmq.Context()
pub = Publisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", context=ctx, bind=True)
pub.start_replay_thread()
pub.publish(b"x" * 4096, send=False)
warm = ctx.socket(zmq.DEALER)  # one shared answer before the exit, read whole
warm.setsockopt(zmq.RCVTIMEO, 2000)
warm.connect(pub.replay_endpoint)
warm.send_multipart([b"", (0).to_bytes(8, "big")])
assert warm.recv_multipart()[-1] == b"x" * 4096
"""


def test_a_publisher_left_open_at_exit_ends_its_replay_thread_quietly(tmp_path: Path) -> None:
    """A process that exits without closing its publisher, while a peer asks for a replay,
    exits cleanly: past pyzmq's exit handler a shared frame cannot be sent, and the replay
    thread ends instead of printing a traceback."""
    script = tmp_path / "exit_while_answering.py"
    script.write_text(EXIT_WHILE_ANSWERING)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60, check=False
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "asked\n", "")


# --------------------------------------------------------------------------- encoders vs facts


def test_event_encoding_matches_vllm_vector() -> None:
    """A plain dict encodes to vLLM's bytes except the map header (fixmap 0x8b vs map16)."""
    event = block_stored([H_A, H_B], [1, 2, 3, 4, 5, 6, 7, 8])
    encoded = msgspec.msgpack.encode(event)
    assert msgspec.msgpack.decode(BLOCK_STORED_VECTOR) == event
    assert encoded[:1] == b"\x8b"
    assert BLOCK_STORED_VECTOR[:3] == bytes.fromhex("de000b")
    assert encoded[1:] == BLOCK_STORED_VECTOR[3:]


def test_tokens_hash_facts() -> None:
    blocks = [TOKENS[i : i + BLOCK_SIZE] for i in range(0, len(TOKENS), BLOCK_SIZE)]
    assert [tokens_hash(b) for b in blocks] == TOKENS_HASH
    assert tokens_hash([1, 2, 3, 4]) == 14643705804678351452


# --------------------------------------------------------------------------- (c) SelectionService


def test_selection_service_indexes_published_blocks(harness: SelectionHarness) -> None:
    with Publisher(LOCAL, bind=True) as pub:
        harness.add_worker(1, block_size=BLOCK_SIZE, endpoints={0: pub.endpoint})
        wait_connected(pub)
        assert harness.overlap(TOKENS) == {}

        # Two stores in one batch, the second chained to the first (vLLM 0.24+ tagged maps).
        pub.publish(
            batch(
                [
                    block_stored([H_A, H_B], TOKENS[:8]),
                    block_stored([H_C, H_D], TOKENS[8:], parent=H_B),
                ]
            )
        )
        assert harness.wait_for(lambda: harness.overlap(TOKENS) == {(1, 0): (4, 4, 4)})
        assert harness.overlap(TOKENS) == {(1, 0): (4, 4, 4)}
        # Prefix match only; a trailing partial block is ignored.
        assert harness.overlap([*TOKENS[:8], 0, 0, 0, 0]) == {(1, 0): (2, 2, 2)}
        assert harness.overlap(TOKENS[:7]) == {(1, 0): (1, 1, 1)}
        assert harness.overlap([*TOKENS, 1, 2, 3]) == {(1, 0): (4, 4, 4)}
        # A LoRA name changes the tokens_hash seed: no match.
        assert harness.overlap(TOKENS, lora_name="adapter") == {}
        # The precomputed form keys on tokens_hash (signed i64), proving which hash is indexed.
        precomputed = {
            "block_hashes": [signed(h) for h in TOKENS_HASH],
            "sequence_hashes": [signed(h) for h in SEQUENCE_HASH],
            "isl_tokens": len(TOKENS),
            "model_name": "m",
        }
        assert harness.overlap_request(precomputed) == {(1, 0): (4, 4, 4)}

        # Offload the last two blocks to CPU, then evict them from the GPU.
        assert (
            pub.publish(
                batch(
                    [
                        block_stored([H_C, H_D], TOKENS[8:], parent=H_B, medium="CPU"),
                        block_removed([H_C, H_D]),
                    ]
                )
            )
            == 1
        )
        assert harness.wait_for(lambda: harness.overlap(TOKENS) == {(1, 0): (2, 4, 4)})
        assert harness.overlap(TOKENS) == {(1, 0): (2, 4, 4)}

        # The batch's dp_rank overrides the registered rank 0.
        pub.publish(batch([block_stored([H_A], TOKENS[:4])], dp_rank=3))
        assert harness.wait_for(lambda: len(harness.overlap(TOKENS)) == 2)
        assert harness.overlap(TOKENS) == {(1, 0): (2, 4, 4), (1, 3): (1, 1, 1)}


def test_selection_service_two_dp_ranks(harness: SelectionHarness) -> None:
    with Publisher(LOCAL, bind=True) as rank0, Publisher(LOCAL, bind=True) as rank1:
        record = harness.add_worker(
            7, block_size=BLOCK_SIZE, endpoints={0: rank0.endpoint, 1: rank1.endpoint}
        )
        assert record["lifecycle"] == "schedulable"
        assert record["kv_events_endpoints"] == {0: rank0.endpoint, 1: rank1.endpoint}
        wait_connected(rank0)
        wait_connected(rank1)
        rank0.publish(batch([block_stored([H_A], TOKENS[:4])], dp_rank=0))
        rank1.publish(batch([block_stored([H_A, H_B, H_C], TOKENS[:12])], dp_rank=1))
        expected = {(7, 0): (1, 1, 1), (7, 1): (3, 3, 3)}
        assert harness.wait_for(lambda: harness.overlap(TOKENS) == expected)
        assert harness.overlap(TOKENS) == expected


# --------------------------------------------------------------------------- (d) recovery by replay


@pytest.mark.parametrize("topic_frame", [True, False])
def test_selection_service_replays_unsent_batches(
    harness: SelectionHarness, topic_frame: bool
) -> None:
    """seq 0 is never sent; the live seq 1 makes Dynamo replay from 0 over the ROUTER.

    Dynamo 1.6.1 logs "Gap detected: expected seq 0, got 1", "Requesting replay from engine
    start_seq=0 end_seq=1" and "Replay complete replayed=2" (it also takes seq 1 from the replay
    and then skips the live copy). Both replay layouts are understood.
    """
    with Publisher(
        LOCAL, bind=True, replay_endpoint=LOCAL, topic="kv", replay_topic_frame=topic_frame
    ) as pub:
        pub.start_replay_thread()
        harness.add_worker(
            1,
            block_size=BLOCK_SIZE,
            endpoints={0: pub.endpoint},
            replay_endpoint=pub.replay_endpoint,
        )
        wait_connected(pub)
        assert pub.publish(batch([block_stored([H_A, H_B], TOKENS[:8])]), send=False) == 0
        assert pub.publish(batch([block_stored([H_C, H_D], TOKENS[8:], parent=H_B)])) == 1
        assert harness.wait_for(lambda: harness.overlap(TOKENS) == {(1, 0): (4, 4, 4)})
        assert harness.overlap(TOKENS) == {(1, 0): (4, 4, 4)}


def test_selection_service_replays_from_zero_when_first_seq_is_late(
    harness: SelectionHarness,
) -> None:
    """Seqs 0-2 were published before anyone listened; the first live batch is seq 3."""
    with Publisher(LOCAL, bind=True, replay_endpoint=LOCAL) as pub:
        pub.start_replay_thread()
        pub.publish(batch([block_stored([H_A], TOKENS[:4])]))
        pub.publish(batch([block_stored([H_B], TOKENS[4:8], parent=H_A)]))
        pub.publish(batch([block_stored([H_C], TOKENS[8:12], parent=H_B)]))
        harness.add_worker(
            1,
            block_size=BLOCK_SIZE,
            endpoints={0: pub.endpoint},
            replay_endpoint=pub.replay_endpoint,
        )
        wait_connected(pub)
        assert pub.publish(batch([block_stored([H_D], TOKENS[12:], parent=H_C)])) == 3
        assert harness.wait_for(lambda: harness.overlap(TOKENS) == {(1, 0): (4, 4, 4)})
        assert harness.overlap(TOKENS) == {(1, 0): (4, 4, 4)}


def test_without_replay_endpoint_unsent_batches_are_lost(harness: SelectionHarness) -> None:
    """Control for (d): "No replay endpoint configured; batches lost gap_size=1"."""
    other = list(range(500, 504))
    with Publisher(LOCAL, bind=True, replay_endpoint=LOCAL) as pub:
        pub.start_replay_thread()
        harness.add_worker(1, block_size=BLOCK_SIZE, endpoints={0: pub.endpoint})
        wait_connected(pub)
        pub.publish(batch([block_stored([H_A, H_B], TOKENS[:8])]), send=False)
        pub.publish(batch([block_stored([H_C, H_D], TOKENS[8:], parent=H_B)]))
        pub.publish(batch([block_stored([99], other)]))
        assert harness.wait_for(lambda: harness.overlap(other) == {(1, 0): (1, 1, 1)})
        assert harness.overlap(TOKENS) == {}


def test_selection_service_ignores_seqs_after_restart_until_re_registered(
    harness: SelectionHarness,
) -> None:
    """Dynamo 1.6.1 keeps its seq watermark across an engine restart and silently drops every
    batch with seq <= the last one seen; delete_worker + upsert resets it (and the index)."""
    with Publisher(LOCAL, bind=True) as pub:
        harness.add_worker(1, block_size=BLOCK_SIZE, endpoints={0: pub.endpoint})
        wait_connected(pub)
        pub.publish(batch([block_stored([H_A], TOKENS[:4])]))
        pub.publish(batch([block_stored([H_B], TOKENS[4:8], parent=H_A)]))
        assert harness.wait_for(lambda: harness.overlap(TOKENS) == {(1, 0): (2, 2, 2)})

        pub.restart()
        assert pub.publish(batch([{"type": "AllBlocksCleared"}])) == 0  # dropped: seq 0 <= 1
        assert pub.publish(batch([block_stored([H_C], TOKENS[8:12], parent=H_B)])) == 1  # dropped
        assert pub.publish(batch([block_removed([H_B])])) == 2  # applied: 2 > 1
        assert harness.wait_for(lambda: harness.overlap(TOKENS) == {(1, 0): (1, 1, 1)})
        assert harness.overlap(TOKENS) == {(1, 0): (1, 1, 1)}

        assert harness.remove_worker(1)["lifecycle"] == "unschedulable"
        assert harness.overlap(TOKENS) == {}
        harness.add_worker(1, block_size=BLOCK_SIZE, endpoints={0: pub.endpoint})
        wait_connected(pub)
        pub.restart()
        assert pub.publish(batch([block_stored([H_A, H_B], TOKENS[:8])])) == 0
        assert harness.wait_for(lambda: harness.overlap(TOKENS) == {(1, 0): (2, 2, 2)})
        assert harness.overlap(TOKENS) == {(1, 0): (2, 2, 2)}


def test_a_publisher_reaches_new_consumers_after_many_came_and_went(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """1,300 consumers connect and go while the publisher sends nothing. Its monitor reports
    each, and ZMQ's I/O thread would stop every socket of the context once that queue was
    full (about 2,000 events); the queue has no bound, so a new consumer still gets a batch."""
    with Publisher("tcp://127.0.0.1:*", bind=True, context=ctx) as publisher:
        consumers: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            for _ in range(1300):
                gone = consumers.socket(zmq.SUB)
                gone.setsockopt(zmq.LINGER, 0)
                gone.connect(publisher.endpoint)
                time.sleep(0.002)
                gone.close(0)
            sub = consumers.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(publisher.endpoint)
            got = None
            for _ in range(50):  # until its subscription is in (no wait: it reads the monitor)
                publisher.publish(b"batch")
                if sub.poll(100):
                    got = sub.recv_multipart()[2]
                    break
            assert got == b"batch", "the new consumer got nothing"
        finally:
            consumers.destroy(linger=0)
