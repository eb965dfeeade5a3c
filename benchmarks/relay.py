#!/usr/bin/env python3
"""Ingest-to-publish throughput of ``kvbridge relay`` on one core, against plain ZMQ forwarding.

Both runs carry the same payloads (the workload of ``benchmarks/normalize.py``: 0.32 map
events, int hashes, block size 16) over real sockets on 127.0.0.1:

    publisher --PUB--> [middle process, pinned to one core] --PUB--> sink

- baseline: the middle process forwards each message's frames unchanged (SUB → PUB), which is
  the least any relay must do;
- relay: the middle process is a :class:`kvbridge.adapters.relay.Relay` (subscriber with
  sequence tracking, decode, normalize, canonical re-encode, publish with a replay buffer).

The clock runs from the first message sent until the sink has received the last output
message; throughput is input blocks (one per event block hash) per second. Publisher and sink
share the other core. All high-water marks are unlimited, so nothing is dropped: the sink
checks it received exactly the expected number of messages.

Run: python benchmarks/relay.py [--blocks N] [--repeat R]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))

from normalize import VARIANTS, count_blocks, encode_steps, simulate

from kvbridge import Normalizer
from kvbridge.adapters.relay import Relay
from kvbridge.adapters.zmq import Source

TOPIC = b"kv-events"


def _pin(core: int) -> None:
    if hasattr(os, "sched_setaffinity") and core < (os.cpu_count() or 1):
        os.sched_setaffinity(0, {core})


def forward(source: str, out: str, ready: Connection, stop: mp.synchronize.Event) -> None:
    """The baseline middle: frames in, the same frames out."""
    _pin(1)
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(source)
    pub = context.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.bind(out)
    ready.send(True)
    while not stop.is_set():
        if sub.poll(50):
            while True:
                try:
                    frames = sub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                pub.send_multipart(frames)
    context.destroy(linger=0)


def relay(source: str, out: str, ready: Connection, stop: mp.synchronize.Event) -> None:
    """The kvbridge middle: a Relay from one source to one canonical stream."""
    _pin(1)
    with Relay([Source(source, worker_id=1, bind=False)], block_size=16, publish=out) as middle:
        ready.send(True)
        while not stop.is_set():
            middle.step(50)


def sink(endpoint: str, expected: int, ready: Connection, done: Connection) -> None:
    _pin(0)
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    ready.send(True)
    received = 0
    while received < expected:
        if sub.poll(10_000) == 0:
            break
        sub.recv_multipart()
        received += 1
    done.send((received, time.perf_counter()))
    context.destroy(linger=0)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def run(middle: str, payloads: Sequence[bytes], expected: int) -> float:
    """Seconds from the first message sent to the last received, through one middle."""
    ctx = mp.get_context("spawn")
    source, out = f"tcp://127.0.0.1:{_free_port()}", f"tcp://127.0.0.1:{_free_port()}"
    context = zmq.Context()
    pub = context.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.bind(source)
    stop = ctx.Event()
    middle_ready, middle_ready_child = ctx.Pipe()
    sink_ready, sink_ready_child = ctx.Pipe()
    done, done_child = ctx.Pipe()
    target = forward if middle == "forward" else relay
    worker = ctx.Process(target=target, args=(source, out, middle_ready_child, stop))
    worker.start()
    middle_ready.recv()
    receiver = ctx.Process(target=sink, args=(out, expected, sink_ready_child, done_child))
    receiver.start()
    sink_ready.recv()
    time.sleep(1.0)  # let both subscriptions reach their publishers
    _pin(0)
    start = time.perf_counter()
    for seq, payload in enumerate(payloads):
        pub.send_multipart([TOPIC, seq.to_bytes(8, "big"), payload])
    received, end = done.recv()
    stop.set()
    worker.join(10)
    receiver.join(10)
    context.destroy(linger=0)
    if received != expected:
        raise SystemExit(f"{middle}: the sink got {received} messages, expected {expected}")
    elapsed: float = end - start
    return elapsed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=100_000, help="input blocks per run")
    parser.add_argument("--repeat", type=int, default=3, help="runs per middle")
    args = parser.parse_args(argv)

    variant = VARIANTS[0]
    payloads = encode_steps(simulate(variant.block_size, args.blocks, 20_240_601), variant)
    blocks = sum(count_blocks(payloads)[0].values())
    normalizer = Normalizer(1, variant.block_size)
    outputs = sum(
        len(normalizer.process(p, s).canonical_payloads(0.0)) for s, p in enumerate(payloads)
    )
    print(f"workload: {variant.name.split()[0]} {len(payloads)} payloads, {blocks} blocks in")
    print(f"relay output: {outputs} payloads (a batch whose events were all dropped sends none)")

    results: dict[str, list[float]] = {"forward": [], "relay": []}
    for _ in range(args.repeat):
        for middle, expected in (("forward", len(payloads)), ("relay", outputs)):
            results[middle].append(blocks / run(middle, payloads, expected))

    print(f"\nblocks/s, middle process pinned to one core, best of {args.repeat} (median)")
    for middle, rates in results.items():
        print(f"  {middle:<8} {max(rates) / 1e6:6.3f}M ({statistics.median(rates) / 1e6:.3f}M)")
    ratio = max(results["relay"]) / max(results["forward"])
    print(f"  relay / plain forwarding = {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
