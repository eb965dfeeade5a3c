#!/usr/bin/env python3
"""A relay in the same process does not starve a Python thread: decision latency with and without.

A router that runs kvbridge's relay in its own process (``Relay.start()``, as a Ray Serve
replica can) shares the GIL between the relay's thread and the router's decisions. This
measures a decision's latency, p50 and p99, in windows that alternate (the order rotates each
round) between

- **alone**: no relay anywhere;
- **relay thread**: a :class:`~kvbridge.adapters.relay.Relay` started with ``Relay.start()``
  in this process relays a stream that another process publishes at ``--rate`` blocks per
  second (250,000 by default) to a sink process; its achieved blocks/s in the window is printed;
- **relay process**, a control: the same relay, started the same way, in a helper process on
  the same core. The machine's load is then the same as with the relay thread but the GIL is
  not shared, so the difference between the two is the GIL's own share, and the difference
  between this one and "alone" is what a busy core 1 does to core 0 on this shared machine
  (other jobs' processes move to core 0, interrupts), whatever the process.

One decision is fixed pure-Python work shaped like a KV router's: 16 workers, each with the
cached prefix of a 512-block prompt as a set of block hashes (8 to 480 blocks), and for each
worker the prompt's leading blocks looked up one by one until the first miss, then a score
from the overlap and a load figure, and the best worker. It takes about 0.15 ms and holds the
GIL throughout. Decisions start every ``--period-ms`` (1 ms): a router serving 1,000 requests
a second; one that falls behind still waits half a period before the next. The clock
(``time.perf_counter``) is around the decision alone, as ``benchmarks/router_latency.py``'s is
around ``choose_replicas``; the time from a decision's scheduled start to its actual start (its wait
for the GIL and for the core) is printed apart, as "late".

The stream is the GPU-only workload of ``benchmarks/relay_throughput.py`` (block size 16, vLLM
0.32 map events, int hashes, 37 blocks a batch), paced by the publisher, cycled with an
``AllBlocksCleared`` between cycles, from sequence 0 for every relay window. Cores: the measured
(main) thread is pinned to core 0; the relay's thread, ZMQ's I/O thread, the helper, the
publisher and the sink to core 1, so that the figures show the GIL, not two threads
time-sharing a core.

Why it holds. The relay's work per batch is mostly in the native core, which releases the GIL
while it decodes, normalizes and writes (``py.detach`` around ``Normalizer.normalize`` and
``NormalizedBatch.canonical_payloads`` in ``native/python/src/``, about 22 us a batch here);
pyzmq releases it inside ``zmq_msg_recv``, ``zmq_msg_send`` and ``zmq_poll``. What remains
under the GIL, per batch, is the subscriber's Python (three ``recv`` calls, the sequence
check, a ``Message``), the pipeline's (the worker lookup, the normalizer's wrapper, the rank
and lag) and the publisher's (its lock, the replay buffer, three ``send`` calls): some 6-8 us,
in stretches that each end at the next call releasing the GIL, about 5% of the time at
250,000 blocks/s. CPython 3.11 takes the GIL from a running thread only when another has
waited a whole switch interval (5 ms) without any switch, so a 0.15 ms decision runs to its
end: the relay's thread, wanting the GIL back meanwhile, waits until the decision sleeps. The
relay pays for that wait, which is why its rate is printed.

The GIL can still delay a decision's start. A thread that wakes while the relay is busy waits
for the GIL: the relay releases and retakes it around every native call, a waiter woken by a
release may find it already retaken, and each such wake-up restarts its 5 ms timer, so it gets
the GIL when it wins one of those races or when the relay blocks in its poll. That would show
in "late", not in the decision's own time; on this machine "late" grew as much with the relay
in another process, so it did not stand out from the machine's own delays.

On this shared 2-core guest the p99s move with the machine. A decision the OS preempted (an
involuntary context switch of the thread, from ``getrusage(RUSAGE_THREAD)`` around each
decision) takes as long as another job's time slice; the script counts those, and the ones
that blocked (a voluntary switch: a wait for the GIL would be one), and gives the p99 of the
decisions that did neither. Even those ran slower at p99 in some runs while core 1 was busy,
with the relay in this process or in the other: that is the busy neighbour core (the
hypervisor, the shared cache), which the relay-process control measures, not the GIL.

Run: python benchmarks/gil.py [--rounds N] [--window S] [--rate BLOCKS_PER_S] [--period-ms MS]
"""

from __future__ import annotations

import argparse
import gc
import math
import multiprocessing as mp
import os
import platform
import random
import resource
import sys
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))

from percentiles import percentile
from procs import free_port, pin, subscriber

from kvbridge.adapters.relay import Relay
from kvbridge.adapters.source import Source

BLOCK_SIZE = 16
TOPIC = b"kv-events"
WORKER_ID = 1
TARGET = 1.2
"""p99 with the relay over p99 alone."""
_THREAD = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)
MIN_RATE = 200_000
"""Blocks per second the relay must achieve in a window for the window to count."""
CONDITIONS = ("alone", "thread", "process")
LABELS = {"alone": "alone", "thread": "relay thread", "process": "relay process"}
WORKERS = 16
PROMPT_BLOCKS = 512


# -- the other processes -----------------------------------------------------------------------


def publisher(endpoint: str, blocks: int, seed: int, control: Connection) -> None:
    """Publishes the workload, cycled, at the rate each ``("go", rate)`` asks for, from seq 0,
    until ``"stop"``; answers ``"stop"`` with the number of batches sent."""
    pin(1)
    from normalize import VARIANTS, count_blocks, encode_steps, simulate
    from relay_throughput import gpu_only

    from kvbridge.schemas.vllm import AllBlocksCleared
    from kvbridge.testing.events import TS0, encoded

    variant = next(v for v in VARIANTS if v.release == "0.32.0" and not v.bytes_hashes)
    payloads = encode_steps(gpu_only(simulate(BLOCK_SIZE, blocks, seed)), variant)
    clear = encoded([AllBlocksCleared()], ts=TS0, release="0.32.0")
    cycle = [*payloads, clear]
    counts = [sum(count_blocks([payload])[0].values()) for payload in cycle]
    del payloads
    context = zmq.Context()
    pub = context.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(endpoint)
    control.send(counts)
    while True:
        command = control.recv()
        if command == "quit":
            break
        _, rate = command
        seq, sent_blocks = 0, 0
        start = time.perf_counter()
        while not control.poll(0):
            due = rate * (time.perf_counter() - start)
            while sent_blocks < due:
                index = seq % len(cycle)
                pub.send_multipart([TOPIC, seq.to_bytes(8, "big"), cycle[index]])
                sent_blocks += counts[index]
                seq += 1
            time.sleep(0.0005)
        control.recv()  # "stop"
        control.send(seq)
    context.destroy(linger=0)


def sink(endpoint: str, ready: Connection) -> None:
    """Drains the relay's output (the relay rebinds the same endpoint in every window)."""
    pin(1)
    context = zmq.Context()
    sub = subscriber(context, endpoint)
    ready.send(True)
    received = 0
    while not ready.poll(0):
        if sub.poll(50):
            while True:
                try:
                    sub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                received += 1
    ready.recv()
    ready.send(received)
    context.destroy(linger=0)


# -- the decision ------------------------------------------------------------------------------


class Router:
    """A KV router's decision in pure Python: prefix overlap per worker, a load, the best."""

    def __init__(self, seed: int) -> None:
        rng = random.Random(seed)
        self.prompt = [rng.getrandbits(63) for _ in range(PROMPT_BLOCKS)]
        self.cached = [
            set(self.prompt[: rng.randrange(8, PROMPT_BLOCKS - 31)]) for _ in range(WORKERS)
        ]
        self.loads = [rng.random() for _ in range(WORKERS)]

    def decide(self) -> int:
        best, best_score = -1, -math.inf
        for worker, cached in enumerate(self.cached):
            overlap = 0
            for block in self.prompt:
                if block not in cached:
                    break
                overlap += 1
            score = 2.0 * overlap / PROMPT_BLOCKS - self.loads[worker]
            if score > best_score:
                best, best_score = worker, score
        return best


class Timings:
    """Each decision's duration and lateness, and what the thread went through during it."""

    def __init__(self) -> None:
        self.durations: list[float] = []
        self.late: list[float] = []
        self.preempted: list[bool] = []
        """The OS took the core from the thread (an involuntary context switch)."""
        self.blocked: list[bool] = []
        """The thread waited for something (a voluntary switch: the GIL, a page)."""


def decisions(router: Router, seconds: float, period: float) -> Timings:
    """Decisions every ``period`` for ``seconds``."""
    timings = Timings()
    clock = time.perf_counter
    usage = resource.getrusage
    scheduled = clock()
    end = scheduled + seconds
    while scheduled < end:
        wait = scheduled - clock()
        if wait > 0:
            time.sleep(wait)
        before = usage(_THREAD)
        started = clock()
        router.decide()
        finished = clock()
        after = usage(_THREAD)
        timings.durations.append(finished - started)
        timings.late.append(max(0.0, started - scheduled))
        timings.preempted.append(after.ru_nivcsw > before.ru_nivcsw)
        timings.blocked.append(after.ru_nvcsw > before.ru_nvcsw)
        # Behind schedule, the next one still waits half a period: decisions back to back
        # would hold the GIL for good, which is not the router this stands for.
        scheduled = max(scheduled + period, finished + period / 2)
    return timings


# -- the relays --------------------------------------------------------------------------------


def _relay(source: str, out: str) -> Relay:
    return Relay(
        [Source(source, worker_id=WORKER_ID, bind=False)],
        block_size=BLOCK_SIZE,
        publish=out,
        output_hwm=0,  # unlimited, as the publisher's: nothing is dropped
    )


def relay_process(source: str, out: str, control: Connection) -> None:
    """The control condition: the same relay, started the same way, in a process of its own."""
    pin(1)
    relay: Relay | None = None
    while (command := control.recv()) != "quit":
        if command == "start":
            relay = _relay(source, out)
            relay.start()
            control.send(True)
        elif command == "seq":
            assert relay is not None
            control.send(relay.subscriber.last_seq(next(iter(relay.outputs))))
        elif command == "stop":
            assert relay is not None
            relay.close()
            control.send(True)


class ThreadRelay:
    """``Relay.start()`` in this process: its thread and ZMQ's I/O thread on core 1."""

    def __init__(self, source: str, out: str) -> None:
        pin(1)  # the threads started from here on inherit it
        self.relay = _relay(source, out)
        self.relay.start()
        pin(0)

    def last_seq(self) -> int | None:
        return self.relay.subscriber.last_seq(next(iter(self.relay.outputs)))

    def close(self) -> None:
        self.relay.close()


class ProcessRelay:
    """The same relay in the helper process (:func:`relay_process`)."""

    def __init__(self, control: Connection) -> None:
        self.control = control
        control.send("start")
        control.recv()

    def last_seq(self) -> int | None:
        self.control.send("seq")
        seq: int | None = self.control.recv()
        return seq

    def close(self) -> None:
        self.control.send("stop")
        self.control.recv()


# -- the windows -------------------------------------------------------------------------------


class Window:
    def __init__(self, condition: str, timings: Timings) -> None:
        self.condition = condition
        self.durations = timings.durations
        self.late = timings.late
        self.timings = timings
        self.clean = [
            d
            for d, p, b in zip(timings.durations, timings.preempted, timings.blocked, strict=True)
            if not p and not b
        ]
        """Durations of the decisions that neither the OS preempted nor anything blocked."""
        self.relay_rate: float | None = None
        self.behind = 0
        """Batches published and not relayed when the window closed."""

    @property
    def p50(self) -> float:
        return percentile(self.durations, 50)

    @property
    def p99(self) -> float:
        return percentile(self.durations, 99)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.period = float(args.period_ms) / 1000
        self.ctx = mp.get_context("spawn")
        self.source = f"tcp://127.0.0.1:{free_port()}"
        self.out = f"tcp://127.0.0.1:{free_port()}"
        self.control, control = self.ctx.Pipe()
        self.publisher = self.ctx.Process(
            target=publisher, args=(self.source, args.blocks, args.seed, control)
        )
        self.publisher.start()
        self.counts: list[int] = self.control.recv()
        self.sink_control, sink_control = self.ctx.Pipe()
        self.sink = self.ctx.Process(target=sink, args=(self.out, sink_control))
        self.sink.start()
        self.sink_control.recv()
        self.helper_control, helper_control = self.ctx.Pipe()
        self.helper = self.ctx.Process(
            target=relay_process, args=(self.source, self.out, helper_control)
        )
        self.helper.start()
        self.router = Router(args.seed)
        self.cycle_blocks: int = sum(self.counts)
        self.prefix = [0]
        for count in self.counts:
            self.prefix.append(self.prefix[-1] + count)
        pin(0)

    def blocks_through(self, seq: int | None) -> int:
        """Blocks in the batches of sequence 0 to ``seq``."""
        if seq is None:
            return 0
        cycles, index = divmod(seq + 1, len(self.counts))
        return cycles * self.cycle_blocks + self.prefix[index]

    def window(self, condition: str) -> Window:
        if condition == "alone":
            gc.collect()
            return Window(condition, decisions(self.router, self.args.window, self.period))
        relay: ThreadRelay | ProcessRelay = (
            ThreadRelay(self.source, self.out)
            if condition == "thread"
            else ProcessRelay(self.helper_control)
        )
        try:
            time.sleep(0.3)  # the relay's subscription reaches the publisher
            self.control.send(("go", self.args.rate))
            time.sleep(self.args.warmup)
            gc.collect()
            first = relay.last_seq()
            started = time.perf_counter()
            window = Window(condition, decisions(self.router, self.args.window, self.period))
            elapsed = time.perf_counter() - started
            last = relay.last_seq()
            self.control.send("stop")
            sent: int = self.control.recv()
            window.relay_rate = (self.blocks_through(last) - self.blocks_through(first)) / elapsed
            window.behind = sent - 1 - (last if last is not None else -1)
        finally:
            relay.close()
        return window

    def close(self) -> None:
        self.control.send("quit")
        self.publisher.join(10)
        self.helper_control.send("quit")
        self.helper.join(10)
        self.sink_control.send("stop")
        self.sink_control.recv()
        self.sink.join(10)


def us(seconds: float) -> str:
    return f"{seconds * 1e6:,.0f} us"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6, help="windows per condition")
    parser.add_argument("--window", type=float, default=3.0, help="seconds of decisions each")
    parser.add_argument("--warmup", type=float, default=0.5, help="relay seconds before a window")
    parser.add_argument("--rate", type=float, default=250_000, help="blocks/s the stream offers")
    parser.add_argument("--period-ms", type=float, default=1.0, help="one decision every ...")
    parser.add_argument("--blocks", type=int, default=100_000, help="simulated blocks a cycle")
    parser.add_argument("--seed", type=int, default=20_240_601)
    args = parser.parse_args(argv)

    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} CPUs, "
        f"load average {load}; switch interval {sys.getswitchinterval() * 1e3:.0f} ms"
    )
    bench = Bench(args)
    batches = len(bench.counts) - 1
    print(
        f"stream: {batches} batches of {bench.cycle_blocks} blocks a cycle "
        f"({bench.cycle_blocks / batches:.0f} a batch), offered at {args.rate:,.0f} blocks/s; "
        f"a decision every {args.period_ms} ms, {args.window} s windows"
    )
    windows: list[Window] = []
    try:
        for round_ in range(args.rounds):
            shift = round_ % len(CONDITIONS)
            for condition in CONDITIONS[shift:] + CONDITIONS[:shift]:
                window = bench.window(condition)
                windows.append(window)
                relay = (
                    f"  relay {window.relay_rate:,.0f} blocks/s, {window.behind} batches behind"
                    if window.relay_rate is not None
                    else ""
                )
                print(
                    f"  round {round_ + 1} {LABELS[condition]:<13} "
                    f"{len(window.durations)} decisions  p50 {us(window.p50):>7}  "
                    f"p99 {us(window.p99):>7}  max {us(max(window.durations)):>9}  "
                    f"late p99 {us(percentile(window.late, 99)):>8}  "
                    f"preempted {sum(window.timings.preempted)} blocked "
                    f"{sum(window.timings.blocked)}{relay}",
                    flush=True,
                )
    finally:
        bench.close()

    print("\nover every window of a condition: p50 and p99 (range over its windows)")
    pooled: dict[str, float] = {}
    clean: dict[str, float] = {}
    for condition in CONDITIONS:
        group = [w for w in windows if w.condition == condition]
        durations = [d for w in group for d in w.durations]
        late = [d for w in group for d in w.late]
        pooled[condition] = percentile(durations, 99)
        clean[condition] = percentile([d for w in group for d in w.clean], 99)
        p50s = [w.p50 for w in group]
        p99s = [w.p99 for w in group]
        preempted = sum(sum(w.timings.preempted) for w in group)
        blocked = sum(sum(w.timings.blocked) for w in group)
        print(
            f"  {LABELS[condition]:<13} p50 {us(percentile(durations, 50))} "
            f"({us(min(p50s))}-{us(max(p50s))})  p99 {us(pooled[condition])} "
            f"({us(min(p99s))}-{us(max(p99s))})  late p99 {us(percentile(late, 99))}"
        )
        print(
            f"  {'':<13} of {len(durations)} decisions {preempted} preempted by the OS, "
            f"{blocked} blocked; p99 of the others {us(clean[condition])}"
        )
    for condition in ("thread", "process"):
        rates = [w.relay_rate for w in windows if w.condition == condition and w.relay_rate]
        print(
            f"  {LABELS[condition]}'s achieved rate: {min(rates):,.0f}-{max(rates):,.0f} "
            f"blocks/s (needed: {MIN_RATE:,})"
        )

    def ratios(top: str, bottom: str) -> tuple[float, list[float]]:
        """Pooled p99 ratio, and round by round."""
        by_round = [windows[i : i + len(CONDITIONS)] for i in range(0, len(windows), 3)]
        per_round = [
            next(w for w in r if w.condition == top).p99
            / next(w for w in r if w.condition == bottom).p99
            for r in by_round
        ]
        return pooled[top] / pooled[bottom], per_round

    rates = [w.relay_rate for w in windows if w.condition == "thread" and w.relay_rate]
    ratio, per_round = ratios("thread", "alone")
    verdict = "met" if ratio <= TARGET and min(rates) >= MIN_RATE else "NOT met"
    print(
        f"\np99 with the relay thread / p99 alone: {ratio:.2f} over all windows "
        f"({min(per_round):.2f}-{max(per_round):.2f} round by round); target <= {TARGET} "
        f"with the relay at >= {MIN_RATE:,} blocks/s: {verdict}"
    )
    print(
        f"the same over the decisions neither preempted nor blocked: "
        f"{clean['thread'] / clean['alone']:.2f}"
    )
    control, control_rounds = ratios("thread", "process")
    print(
        f"p99 with the relay thread / p99 with the relay in another process (the GIL's own "
        f"share): {control:.2f} ({min(control_rounds):.2f}-{max(control_rounds):.2f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
