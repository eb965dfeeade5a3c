"""One relay, 1,000 sources (issue 10, acceptance 3): every worker right in the index, and the
relay's threads, fds, idle CPU and RSS printed (``pytest -s tests/test_scale.py``).

The engines are 1,000 XPUB sockets in the test process (an XPUB is a PUB that also tells when a
subscriber has subscribed, so nothing is published before the relay listens). Each publishes
three batches: a 3-block prompt, a 2-block prompt, then the removal of the first prompt's last
block. The relay (``Relay(..., index=TieredIndex)``, with outputs and replay sockets bound below
the ephemeral range) must then give every worker exactly (2, 2) blocks of overlap, and nothing
to any other worker. The ``TieredIndex`` is Dynamo's own RadixTree.
"""

from __future__ import annotations

import os
import resource
import threading
import time

import pytest
import zmq
from support.memory import rss_mb

from kvbridge import TieredIndex
from kvbridge.adapters.ports import free_port_range
from kvbridge.adapters.relay import Relay
from kvbridge.adapters.source import Source
from kvbridge.adapters.stream_stats import SubscriberStats
from kvbridge.testing.events import TS0, encoded, removed, stored
from kvbridge.testing.vllm_hashes import block_hashes

SOURCES = 1000
BS = 4
IDLE_S = 5.0


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _prompts(worker: int) -> tuple[list[int], list[int]]:
    base = 1_000_000 + worker * 1000
    return [base + k for k in range(12)], [base + 500 + k for k in range(8)]


@pytest.mark.skipif(
    resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 16_000, reason="needs 16k file descriptors"
)
def test_one_relay_with_1000_sources() -> None:
    engines_ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    engines_ctx.set(zmq.MAX_SOCKETS, SOURCES + 64)
    relay_ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    engines: list[zmq.Socket[bytes]] = []
    try:
        before = (_threads(), _fds(), rss_mb())
        for _ in range(SOURCES):
            socket = engines_ctx.socket(zmq.XPUB)
            socket.setsockopt(zmq.LINGER, 0)
            socket.bind("tcp://127.0.0.1:0")
            engines.append(socket)
        ports = [int(s.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1]) for s in engines]
        sources = [Source(f"tcp://*:{port}", worker_id=i) for i, port in enumerate(ports)]
        engines_only = (_threads(), _fds(), rss_mb())
        publish, replay = free_port_range(SOURCES), free_port_range(SOURCES)
        index = TieredIndex(BS)
        started = time.monotonic()
        with Relay(
            sources,
            block_size=BS,
            index=index,
            context=relay_ctx,
            publish=f"tcp://127.0.0.1:{publish}",
            publish_replay=f"tcp://127.0.0.1:{replay}",
        ) as relay:
            built = time.monotonic() - started
            # Each engine waits for its subscription, then publishes its three batches.
            waiting = set(range(SOURCES))
            deadline = time.monotonic() + 60
            while waiting:
                assert time.monotonic() < deadline, f"{len(waiting)} engines never subscribed"
                relay.step(10)  # a bound SUB's subscription goes out when it polls
                for i in list(waiting):
                    if engines[i].poll(0):
                        engines[i].recv()
                        waiting.discard(i)
            for i, socket in enumerate(engines):
                first, second = _prompts(i)
                hashes = block_hashes(first, BS)
                for seq, events in enumerate(
                    [
                        [stored(hashes, first)],
                        [stored(block_hashes(second, BS), second)],
                        [removed(hashes[-1:])],
                    ]
                ):
                    socket.send_multipart(
                        [b"", seq.to_bytes(8, "big"), encoded(events, ts=TS0 + seq)]
                    )
            while relay.stats.batches_in < 3 * SOURCES:
                assert time.monotonic() < deadline, relay.subscriber.stats
                relay.step(50)
            relayed = time.monotonic() - started
            assert relay.subscriber.stats == SubscriberStats(messages=3 * SOURCES)

            for i in range(SOURCES):
                first, second = _prompts(i)
                assert {k: o.device for k, o in index.overlap(first).items()} == {(i, 0): 2}
                assert {k: o.device for k, o in index.overlap(second).items()} == {(i, 0): 2}

            relay.start()
            time.sleep(0.5)
            cpu0, wall0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
            time.sleep(IDLE_S)
            cpu1, wall1 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
            running = (_threads(), _fds(), rss_mb())
            python_threads = threading.active_count()
        assert relay._thread is not None and not relay._thread.is_alive(), "relay thread stopped"
        idle_cpu = (
            (cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime) / (wall1 - wall0) * 100
        )
        threads = running[0] - engines_only[0]
        fds = running[1] - engines_only[1]
        rss = running[2] - engines_only[2]
        print(
            f"\n1,000 sources: relay built in {built:.1f} s, 3,000 batches relayed after "
            f"{relayed:.1f} s; relay threads {threads} (Python threads in the process "
            f"{python_threads}), relay fds {fds}, idle CPU {idle_cpu:.1f}% of a core over "
            f"{IDLE_S:.0f} s (heartbeats included), relay RSS {rss:.0f} MB "
            f"(process {running[2]:.0f} MB; before the engines {before[2]:.0f} MB)"
        )
        # Not a thread per source: the relay's and the replay server's Python threads, ZMQ's I/O
        # and reaper threads, and pyzmq's garbage collector (a thread with its own context).
        assert threads <= 8
        # About 11 a source: each of the 8 ZMQ sockets' mailbox, the SUB's connection, the PUB's
        # and the ROUTER's listeners.
        assert fds < 12 * SOURCES
        assert rss < 512
    finally:
        for socket in engines:
            socket.close(0)
        # destroy, not term: a socket an assertion left open must not hang the suite.
        engines_ctx.destroy(linger=0)
        relay_ctx.destroy(linger=0)
