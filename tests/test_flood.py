"""A ``kvbridge relay`` subprocess flooded faster than it drains.

Two engine processes publish at full speed for ``FLOOD_S`` seconds (valid batches: each stores a
block and removes the one before, so the engines' state stays small and only the relay's
buffers can grow). Meanwhile, on the relay's outputs: a consumer that reads, a SUB that never
reads, and 10 replay DEALERs that ask for replays and never read; and a third source sends one
100 MB frame. The relay's RSS is sampled all along and must stay under ``RSS_BOUND_MB`` (the
README's "Limits"); the consumer must keep receiving throughout; the shed frames must show in
the metrics as gaps and lost batches; the 100 MB frame must be refused by ZMQ (a disconnect in
the log) without the relay's RSS growing by it.

The relay merges its backlog, as it does by default, into payloads of up to 64 KiB. Those queued
for the SUB that never reads are bounded by the outputs' ``SNDHWM``, which the relay sets from
that size (256 payloads, about 16 MiB an output; ``tests/test_relay.py`` checks the sockets).
In 8 s an output sends a few hundred merged payloads: with 10,000 as the bound, all of them
could queue, and the RSS once grew by 117 MB, past the 100 MB frame's check.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import zmq
from support.memory import rss_mb
from support.relay_process import RelayProcess

from kvbridge.adapters.ports import free_port_range

FLOOD_S = 8.0
RSS_BOUND_MB = 512
ENGINES = 2
BIG_FRAME = 100 * 1024 * 1024

ENGINE = """
import sys, time
import zmq
from kvbridge.testing.events import encoded, removed, stored

port, seconds = int(sys.argv[1]), float(sys.argv[2])
payloads = []
for k in range(1000):
    tokens = [k * 4 + t for t in range(4)]
    events = [stored([10_000 + k], tokens)]
    if k:
        events.append(removed([10_000 + k - 1]))
    payloads.append(encoded(events, ts=1.0 + k))
ctx = zmq.Context()
pub = ctx.socket(zmq.PUB)
pub.setsockopt(zmq.LINGER, 0)
pub.bind(f"tcp://127.0.0.1:{port}")
time.sleep(1.0)
end = time.monotonic() + seconds
seq = 0
while time.monotonic() < end:
    for _ in range(100):
        pub.send_multipart([b"", seq.to_bytes(8, "big"), payloads[seq % 1000]])
        seq += 1
print(seq, flush=True)
"""


def test_a_flood_keeps_the_relay_bounded_and_publishing(tmp_path: Path) -> None:
    base = free_port_range(3 * (ENGINES + 1) + 1)
    sources = [base + i for i in range(ENGINES + 1)]  # the last one sends the 100 MB frame
    publish = base + ENGINES + 1
    replay = publish + ENGINES + 1
    metrics_port = replay + ENGINES + 1
    script = tmp_path / "engine.py"
    script.write_text(ENGINE)
    args: list[str] = []
    for port in sources:
        args += ["--source", f"tcp://*:{port}"]
    args += ["--publish", f"tcp://127.0.0.1:{publish}"]
    args += ["--publish-replay", f"tcp://127.0.0.1:{replay}", "--block-size", "4"]

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    big = ctx.socket(zmq.PUB)
    big.setsockopt(zmq.LINGER, 0)
    big.bind(f"tcp://127.0.0.1:{sources[-1]}")
    engines = [
        subprocess.Popen(
            [sys.executable, str(script), str(port), str(FLOOD_S)], stdout=subprocess.PIPE
        )
        for port in sources[:-1]
    ]
    received = [0]
    stop = threading.Event()
    try:
        with RelayProcess(
            args, metrics_port=metrics_port, log_path=tmp_path / "relay.log"
        ) as relay:
            pid = relay.process.pid
            start_rss = rss_mb(pid)
            consumer = ctx.socket(zmq.SUB)
            consumer.setsockopt(zmq.SUBSCRIBE, b"")
            consumer.connect(f"tcp://127.0.0.1:{publish}")
            stalled = ctx.socket(zmq.SUB)  # subscribes and never reads
            stalled.setsockopt(zmq.SUBSCRIBE, b"")
            stalled.setsockopt(zmq.RCVHWM, 1)
            stalled.setsockopt(zmq.RCVBUF, 4096)
            for offset in range(ENGINES):
                stalled.connect(f"tcp://127.0.0.1:{publish + offset}")
            dealers = []
            for _ in range(10):
                dealer = ctx.socket(zmq.DEALER)
                dealer.setsockopt(zmq.LINGER, 0)
                dealer.setsockopt(zmq.RCVHWM, 1)
                dealer.setsockopt(zmq.RCVBUF, 4096)
                dealer.connect(f"tcp://127.0.0.1:{replay}")
                dealers.append(dealer)

            def consume() -> None:
                while not stop.is_set():
                    if consumer.poll(50):
                        while True:
                            try:
                                consumer.recv_multipart(zmq.NOBLOCK)
                            except zmq.Again:
                                break
                            received[0] += 1

            reader = threading.Thread(target=consume, daemon=True)
            reader.start()
            samples: list[tuple[float, float, int]] = []
            started = time.monotonic()
            big_sent = False
            while any(engine.poll() is None for engine in engines):
                elapsed = time.monotonic() - started
                if not big_sent and elapsed > 3.0:
                    big.send_multipart([b"", (0).to_bytes(8, "big"), b"\0" * BIG_FRAME])
                    big_sent = True
                for dealer in dealers:  # replays asked for, never read
                    dealer.send_multipart([b"", (0).to_bytes(8, "big")], zmq.NOBLOCK)
                samples.append((elapsed, rss_mb(pid), received[0]))
                time.sleep(0.5)
                assert elapsed < FLOOD_S + 30
            published = sum(int(engine.communicate()[0]) for engine in engines)
            assert relay.process.poll() is None, relay.log()[-3000:]
            samples.append((time.monotonic() - started, rss_mb(pid), received[0]))
            batches_in = relay.value("kvbridge_batches_total", direction="in")
            batches_out = relay.value("kvbridge_batches_total", direction="out")
            gaps = relay.value("kvbridge_gaps_total")
            lost = relay.value("kvbridge_lost_batches_total")
            log = relay.log()
            stop.set()
            reader.join()
            for socket in (consumer, stalled, *dealers):
                socket.close(0)
    finally:
        stop.set()
        for engine in engines:
            if engine.poll() is None:
                engine.kill()
        ctx.destroy(linger=0)  # every socket, also those an assertion left open

    peak = max(rss for _, rss, _ in samples)
    print(
        f"\nflood: {published:,} batches published by {ENGINES} engines in {FLOOD_S:.0f} s, "
        f"{batches_in:,.0f} in and {batches_out:,.0f} out of the relay, {gaps:,.0f} gaps, "
        f"{lost:,.0f} lost; {received[0]:,} received by the consumer; relay RSS "
        f"{start_rss:.0f} MB at start, peak {peak:.0f} MB (bound {RSS_BOUND_MB} MB)"
    )
    assert peak < RSS_BOUND_MB
    # The relay kept publishing: the consumer received something in every 2 s of the flood.
    during = [(t, n) for t, _, n in samples if 1.5 < t < FLOOD_S]
    for (t0, n0), (t1, n1) in zip(during, during[4:], strict=False):
        assert n1 > n0, f"nothing received between {t0:.1f} s and {t1:.1f} s"
    # It was fed faster than it drained, and the shed frames are counted.
    assert batches_in < published
    assert gaps > 0 and lost > 0
    assert batches_in + lost <= published + 1
    # The 100 MB frame was refused by ZMQ before it was buffered.
    assert "source disconnected" in log
    assert peak < start_rss + BIG_FRAME / 2**20  # it was never held whole
