#!/usr/bin/env python3
"""The relay's ingest rate on one core, against plain ZMQ forwarding and Dynamo's own ingest.

All three take the same frames, published by this process on 127.0.0.1, in the same run:

    publisher --PUB--> [middle process, pinned to core 1] --PUB--> sink

- **forward**: the middle forwards each message's frames unchanged (SUB → PUB), the least any
  relay must do;
- **relay**: the middle is a :class:`kvbridge.adapters.relay.Relay` (subscriber with sequence
  tracking, the native core's decode and normalize, canonical payloads, publish with a replay
  buffer), driven by :meth:`~kvbridge.adapters.relay.Relay.step`;
- **dynamo**: no middle and no sink: a real Dynamo ``SelectionService``
  (:class:`~kvbridge.adapters.selection_client.SelectionClient`, default indexer threads) in a
  process pinned to core 1 registers the worker with the publisher's endpoint directly, as a user
  without kvbridge would, and indexes the frames itself.

The workload is the simulator of ``benchmarks/normalize.py`` (block size 16, vLLM 0.32 map
events, int hashes) cut down to what Dynamo indexes correctly on its own: the GPU events only
(no CPU offload, no placeholders) and no LoRA adapter or cache salt, so that the comparison is
fair. Its last batch is a sentinel: a 16-block chain of new tokens.

The clock runs from the first message sent until, for forward and relay, the sink has received
the last output message, and for Dynamo, ``overlap_scores`` of the sentinel's tokens returns its
16 blocks on the device tier (polled every ``--poll-ms`` from the Dynamo process; each poll costs
that process about 0.1 ms). Throughput is input blocks (one per event block hash) per second.
The publisher and the sink share core 0. Every send high-water mark is unlimited (the relay's
output's too, ``output_hwm=0``), so nothing is dropped: the sink checks it received exactly
the expected number of events (the relay merges batches that queue up,
``Relay(merge_bytes=...)``, so its messages are fewer), and after each
Dynamo run the script compares the blocks in Dynamo's index (``indexer_snapshot``) with those
kvbridge's normalizer holds for the same stream.

The script also prints blocks per CPU-second of the middle's process (all its threads:
ZMQ's I/O thread, Dynamo's runtime), which other jobs on the machine disturb less than the wall
clock: for forward and relay from before the first frame until after the last (their idle
polls cost next to nothing), for Dynamo from the first frame until it saw the sentinel.

The three middles alternate in every repetition (the order rotates), and the ratios are taken
within each repetition, so that the load of this shared machine moves all three alike. Targets:
relay / forward >= 0.5 and relay / Dynamo >= 2.

``--profile`` runs the relay middle once more under cProfile (around ``Relay.step`` only) and
prints where its time goes; ``--perf-fifo`` has a ``perf record -a --control fifo:FIFO -D -1``
sample only the timed windows; ``--middles`` runs some of the three.

Run: python benchmarks/relay_throughput.py [--blocks N] [--repeat R] [--poll-ms MS] [--profile]
         [--middles M ...] [--perf-fifo FIFO]
"""

from __future__ import annotations

import os

os.environ.setdefault("DYN_LOG", "error")

import argparse
import cProfile
import io
import multiprocessing as mp
import platform
import pstats
import random
import resource
import statistics
import sys
import time
from collections.abc import Sequence
from importlib.metadata import version
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event as EventType
from pathlib import Path
from typing import Any

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))

from normalize import VARIANTS, Family, count_blocks, encode_steps, simulate
from procs import free_port, pin, subscriber

from kvbridge import Normalizer
from kvbridge.adapters.relay import Relay
from kvbridge.adapters.source import Source
from kvbridge.cli.arguments import positive_float, positive_int
from kvbridge.schemas.tiers import Tier
from kvbridge.testing.events import encoded, stored

TOPIC = b"kv-events"
BLOCK_SIZE = 16
RELEASE = "0.32.0"
SENTINEL_BLOCKS = 16
VOCAB = 151_936
WORKER_ID = 1
MODEL = "bench"
TARGETS = {"forward": 0.5, "dynamo": 2.0}
"""relay / middle, per repetition."""
MIDDLES = ("forward", "relay", "dynamo")
DYNAMO_TIMEOUT_S = 60.0
_PLAIN = Family([], None, None)


def _cpu() -> float:
    """CPU seconds of this process, every thread (ZMQ's I/O thread, Dynamo's runtime)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# -- the workload ------------------------------------------------------------------------------


def gpu_only(steps: list[list[tuple[Any, ...]]]) -> list[list[tuple[Any, ...]]]:
    """The simulated steps with their GPU events only, stores without LoRA or cache salt."""
    out = []
    for step in steps:
        events: list[tuple[Any, ...]] = []
        for event in step:
            if event[0] == "removed" and event[2] == "GPU":
                events.append(event)
            elif event[0] == "stored" and event[-1] == "GPU":
                kind, hashes, parent, tokens, _, _, medium = event
                events.append((kind, hashes, parent, tokens, _PLAIN, [None] * len(hashes), medium))
        if events:
            out.append(events)
    return out


def sentinel(seed: int) -> tuple[list[int], bytes]:
    """A chain of new tokens and the batch that stores it, published last."""
    rng = random.Random(seed)
    tokens = [rng.randrange(VOCAB) for _ in range(SENTINEL_BLOCKS * BLOCK_SIZE)]
    hashes = [rng.getrandbits(63) for _ in range(SENTINEL_BLOCKS)]
    store = stored(hashes, tokens, block_size=BLOCK_SIZE, extra_keys=None)
    return tokens, encoded([store], ts=2_000_000_000.0, release=RELEASE)


# -- the middles -------------------------------------------------------------------------------


def forward(source: str, out: str, ready: Connection, stop: EventType, profile: bool) -> None:
    """The baseline middle: frames in, the same frames out, with the socket calls the relay
    makes (``Frame.more`` rather than ``recv_multipart``, pyzmq's own ``send`` with int flags
    rather than ``send_multipart``, which cost about 7.5 us a message more in all)."""
    pin(1)
    context = zmq.Context()
    sub = subscriber(context, source)
    pub = context.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.bind(out)
    ready.send(True)
    cpu = _cpu()
    noblock, sndmore = int(zmq.NOBLOCK), int(zmq.SNDMORE)
    send = zmq.backend.Socket.send  # unbound, as the relay's publisher calls it
    while not stop.is_set():
        if sub.poll(50):
            while True:
                try:
                    frame = sub.recv(noblock, copy=False)
                except zmq.Again:
                    break
                frames = [frame.bytes]
                while frame.more:
                    frame = sub.recv(noblock, copy=False)
                    frames.append(frame.bytes)
                for part in frames[:-1]:
                    send(pub, part, sndmore)
                send(pub, frames[-1])
    ready.send((_cpu() - cpu, None))
    context.destroy(linger=0)


def relay(source: str, out: str, ready: Connection, stop: EventType, profile: bool) -> None:
    """The kvbridge middle: a Relay from one source to one canonical stream."""
    pin(1)
    profiler = cProfile.Profile() if profile else None
    with Relay(
        [Source(source, worker_id=WORKER_ID, bind=False)],
        block_size=BLOCK_SIZE,
        publish=out,
        output_hwm=0,
    ) as middle:
        ready.send(True)
        cpu = _cpu()
        while not stop.is_set():
            if profiler is not None:
                profiler.enable()
                middle.step(50)
                profiler.disable()
            else:
                middle.step(50)
        cpu = _cpu() - cpu
    if profiler is None:
        ready.send((cpu, None))
        return
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    ready.send((cpu, text.getvalue()))


def dynamo(
    endpoint: str, tokens: list[int], poll_s: float, ready: Connection, done: Connection
) -> None:
    """Dynamo's own ingest: a SelectionService on the publisher's endpoint, polled for the
    sentinel; then the blocks its index holds."""
    pin(1)  # before the service starts its threads, so that they inherit it
    from kvbridge.adapters.selection_client import SelectionClient

    with SelectionClient() as client:
        record = client.call_sync(
            "upsert_worker",
            {
                "worker_id": WORKER_ID,
                "model_name": MODEL,
                "endpoint": f"http://w{WORKER_ID}",
                "block_size": BLOCK_SIZE,
                "data_parallel_start_rank": 0,
                "data_parallel_size": 1,
                "kv_events_endpoint": endpoint,
            },
        )
        ready.send(record.get("lifecycle"))
        request = {"token_ids": tokens, "model_name": MODEL}
        ready.recv()  # the first frame is about to go out
        cpu = _cpu()
        deadline = time.monotonic() + DYNAMO_TIMEOUT_S
        end = None
        while time.monotonic() < deadline:
            scores = client.call_sync("overlap_scores", request)
            found = sum(int(w["device_blocks"]) for w in scores["workers"])
            if found >= SENTINEL_BLOCKS:
                end = time.perf_counter()
                break
            time.sleep(poll_s)
        cpu = _cpu() - cpu
        snapshot = client.call_sync("indexer_snapshot")
        held = sum(
            len(event["event"]["data"]["stored"]["blocks"])
            for model in snapshot.values()
            for event in model["events"]
            if "stored" in event["event"]["data"]
        )
        done.send((end, cpu, held))


def event_count(payload: bytes) -> int:
    """The number of events of a vLLM batch ``[ts, events, dp_rank]``, read from its header
    alone (msgspec writes the time as a float64)."""
    if payload[:2] != b"\x93\xcb":
        raise ValueError(f"not a batch with a float64 time: {payload[:2].hex()}")
    marker = payload[10]
    if 0x90 <= marker <= 0x9F:
        return marker & 0x0F
    if marker == 0xDC:
        return int.from_bytes(payload[11:13], "big")
    if marker == 0xDD:
        return int.from_bytes(payload[11:15], "big")
    raise ValueError(f"not an event list: {marker:#x}")


def sink(endpoint: str, expected: int, ready: Connection, done: Connection) -> None:
    """Receives until ``expected`` events arrived (a relay merges batches in a backlog, so the
    messages are not counted), or nothing came for 10 s."""
    pin(0)
    context = zmq.Context()
    sub = subscriber(context, endpoint)
    ready.send(True)
    received = 0
    while received < expected:
        if sub.poll(10_000) == 0:
            break
        received += event_count(sub.recv_multipart()[-1])
    done.send((received, time.perf_counter()))
    context.destroy(linger=0)


class Run:
    """What one pass of the frames through one middle measured."""

    seconds = 0.0
    """From the first message sent to the end of the middle's work on the last one."""
    cpu = 0.0
    """CPU seconds of the middle's process: for forward and relay from before the first frame
    to after the last (their idle polls before and after cost next to nothing), for Dynamo from
    the first frame until it saw the sentinel (its polls included)."""
    held: int | None = None
    profile: str | None = None


def _perf(fifo: str | None, command: str) -> None:
    """Tell a ``perf record --control fifo:FIFO -D -1`` to start or stop sampling."""
    if fifo is not None:
        with open(fifo, "w") as control:
            control.write(f"{command}\n")


def run(
    middle: str,
    payloads: Sequence[bytes],
    expected: int,
    tokens: list[int],
    poll_s: float,
    profile: bool = False,
    perf_fifo: str | None = None,
) -> Run:
    """Seconds from the first message sent to the end of ``middle``'s work on the last one."""
    ctx = mp.get_context("spawn")
    source, out = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    context = zmq.Context()
    pub = context.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.bind(source)
    stop = ctx.Event()
    ready, ready_child = ctx.Pipe()
    done, done_child = ctx.Pipe()
    receiver = None
    if middle == "dynamo":
        worker = ctx.Process(target=dynamo, args=(source, tokens, poll_s, ready_child, done_child))
        worker.start()
        lifecycle = ready.recv()
        if lifecycle != "schedulable":
            raise SystemExit(f"Dynamo did not accept the worker: {lifecycle}")
    else:
        target = forward if middle == "forward" else relay
        worker = ctx.Process(target=target, args=(source, out, ready_child, stop, profile))
        worker.start()
        ready.recv()
        sink_ready, sink_ready_child = ctx.Pipe()
        receiver = ctx.Process(target=sink, args=(out, expected, sink_ready_child, done_child))
        receiver.start()
        sink_ready.recv()
    time.sleep(1.0)  # let the subscriptions reach their publishers
    pin(0)
    if middle == "dynamo":
        ready.send("go")
    _perf(perf_fifo, "enable")
    start = time.perf_counter()
    for seq, payload in enumerate(payloads):
        pub.send_multipart([TOPIC, seq.to_bytes(8, "big"), payload])
    result = Run()
    if middle == "dynamo":
        end, result.cpu, result.held = done.recv()
        _perf(perf_fifo, "disable")
        if end is None:
            raise SystemExit(f"Dynamo did not index the sentinel within {DYNAMO_TIMEOUT_S} s")
    else:
        received, end = done.recv()
        _perf(perf_fifo, "disable")
        if received != expected:
            raise SystemExit(f"{middle}: the sink got {received} events, expected {expected}")
        stop.set()
        result.cpu, result.profile = ready.recv()
        assert receiver is not None
        receiver.join(10)
    worker.join(20)
    context.destroy(linger=0)
    result.seconds = end - start
    return result


# -- the report --------------------------------------------------------------------------------


def _span(values: Sequence[float], scale: float = 1.0, digits: int = 2) -> str:
    low, high = min(values) * scale, max(values) * scale
    return f"{low:.{digits}f}-{high:.{digits}f}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--blocks", type=positive_int, default=100_000, help="simulated blocks (all tiers)"
    )
    parser.add_argument(
        "--repeat", type=positive_int, default=5, help="repetitions of the three middles"
    )
    parser.add_argument("--poll-ms", type=positive_float, default=2.0, help="Dynamo poll interval")
    parser.add_argument("--seed", type=int, default=20_240_601)
    parser.add_argument("--profile", action="store_true", help="cProfile the relay middle once")
    parser.add_argument(
        "--perf-fifo",
        metavar="FIFO",
        help="sample only the timed windows: perf record -a --control fifo:FIFO -D -1 -- ...",
    )
    parser.add_argument(
        "--middles", nargs="+", choices=MIDDLES, default=list(MIDDLES), help="run only these"
    )
    args = parser.parse_args(argv)

    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} CPUs, "
        f"load average {load}; pyzmq {zmq.__version__}, libzmq {zmq.zmq_version()}, "
        f"ai-dynamo-runtime {version('ai-dynamo-runtime')}"
    )
    variant = next(v for v in VARIANTS if v.release == RELEASE and not v.bytes_hashes)
    steps = gpu_only(simulate(BLOCK_SIZE, args.blocks, args.seed))
    tokens, last = sentinel(args.seed)
    payloads = [*encode_steps(steps, variant), last]
    by_kind, events_by_kind = count_blocks(payloads)
    blocks = by_kind.total()
    normalizer = Normalizer(WORKER_ID, BLOCK_SIZE)
    outputs = sum(
        event_count(canonical)
        for seq, payload in enumerate(payloads)
        for canonical in normalizer.process(payload, seq).canonical_payloads(0.0)
    )
    inputs = events_by_kind.total()
    resident = normalizer.resident_blocks(0, Tier.DEVICE)
    mix = ", ".join(f"{k} {n} in {events_by_kind[k]} events" for k, n in sorted(by_kind.items()))
    drops = ", ".join(f"{k} {v}" for k, v in sorted(normalizer.stats.items())) or "none"
    print(
        f"workload: {RELEASE} map, int hashes, block size {BLOCK_SIZE}, GPU only, no LoRA or "
        f"salt: {len(payloads)} payloads, {blocks} blocks ({mix}), the last a "
        f"{SENTINEL_BLOCKS}-block sentinel"
    )
    print(f"relay: {outputs} output events, not forwarded: {drops}; {resident} blocks resident")

    middles = tuple(m for m in MIDDLES if m in args.middles)
    rates: dict[str, list[float]] = {middle: [] for middle in middles}
    per_cpu: dict[str, list[float]] = {middle: [] for middle in middles}
    held: list[int] = []
    for repetition in range(args.repeat):
        shift = repetition % len(middles)
        for middle in middles[shift:] + middles[:shift]:
            expected = inputs if middle == "forward" else outputs
            result = run(
                middle, payloads, expected, tokens, args.poll_ms / 1000, perf_fifo=args.perf_fifo
            )
            rates[middle].append(blocks / result.seconds)
            per_cpu[middle].append(blocks / result.cpu)
            if result.held is not None:
                held.append(result.held)
        line = "  ".join(
            f"{m} {rates[m][-1] / 1e6:.3f}M ({per_cpu[m][-1] / 1e6:.3f}M/cpu-s)" for m in middles
        )
        print(f"  repetition {repetition + 1}: {line}", flush=True)

    if held:
        print(f"\nDynamo's index held {sorted(set(held))} blocks after its runs", end="")
        print(f" (kvbridge: {resident})")
    tables = (
        ("blocks/s (wall clock)", rates),
        ("blocks per CPU-second of the middle's process", per_cpu),
    )
    for title, table in tables:
        print(f"\n{title}, {args.repeat} repetitions: best (median) [range]")
        for middle in middles:
            values = table[middle]
            print(
                f"  {middle:<8} {max(values) / 1e6:6.3f}M ({statistics.median(values) / 1e6:.3f}M)"
                f" [{_span(values, 1e-6, 3)}M]"
            )
        pairs = [(o, t) for o, t in TARGETS.items() if "relay" in table and o in table]
        if pairs:
            print("  ratios within each repetition: median [range], target")
        for other, target in pairs:
            ratios = [r / o for r, o in zip(table["relay"], table[other], strict=True)]
            median = statistics.median(ratios)
            verdict = "met" if median >= target else "NOT met"
            print(
                f"    relay / {other:<8} {median:5.2f} [{_span(ratios)}]  "
                f"target >= {target}: {verdict}"
            )

    if args.profile:
        result = run("relay", payloads, outputs, tokens, args.poll_ms / 1000, profile=True)
        print(f"\ncProfile of Relay.step in the relay middle ({result.seconds:.3f} s with it on)")
        print(result.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
