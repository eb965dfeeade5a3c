#!/usr/bin/env python3
"""A relay in the same process does not starve a Python thread: decision latency with and without.

A router that runs kvbridge's relay in its own process (``Relay.start()``, as a Ray Serve
replica can) shares the GIL between the relay's thread and the router's decisions. This
measures a decision's latency, p50 and p99, in short slices that rotate (each round in another
of the six orders, so that each condition follows each other as often) between three conditions:

- **alone**: no stream; the relays below wait in their poll (they wake every 100 ms to look
  at their timers). Their idle heartbeats are off: the relay thread's would fall only in the
  slices where it idles, "alone" and "relay process";
- **relay thread**: a :class:`~kvbridge.adapters.relay.Relay` started with ``Relay.start()``
  in this process relays a stream that another process publishes at ``--rate`` blocks per
  second (250,000 by default) to a sink process; its achieved blocks/s is printed;
- **relay process**, a control: the same relay, started the same way, in a helper process on
  the same core, relays the same stream. The machine's load is then the same as with the relay
  thread but the GIL is not shared, so the difference between the two is the GIL's own share,
  and the difference between this one and "alone" is what a busy core 1 does to core 0 on
  this shared machine (other jobs' processes move to core 0, interrupts), whatever the process.

Both relays run for the whole benchmark; a slice's condition is only where the publisher sends
the stream (to the relay thread's socket, the relay process's, or neither), so conditions switch
in a moment: each slice is ``--settle`` seconds (0.05) untimed, then ``--slice`` seconds (0.3)
of decisions. On this shared guest the p99s move with the machine in spells of seconds. Slices
that short give every condition its share of each spell; windows of seconds, each starting and
stopping its relay, gave one condition all of a spell (round-by-round ratios of 0.69-1.87, in
runs that met the target and in runs that did not). The rounds are reported in ``--groups``
consecutive groups (6), whose ranges show how far the figures move across the run.

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
``AllBlocksCleared`` between cycles; each relay's stream goes on where it paused. Cores: the
measured (main) thread is pinned to core 0; the relay's thread, ZMQ's I/O thread, the helper,
the publisher and the sink to core 1, so that the figures show the GIL, not two threads
time-sharing a core.

Why it holds. The relay's work per batch is mostly in the native core, which releases the GIL
while it decodes, normalizes and writes (``py.detach`` in ``Normalizer.process`` and
``NormalizedBatch.canonical_payloads`` in ``native/python/src/``, about 22 us a batch here,
for payloads and outputs of 1 KiB or more: 64% of this stream's payloads, 93% of its bytes);
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

Run: python benchmarks/gil.py [--rounds N] [--slice S] [--settle S] [--groups G]
         [--rate BLOCKS_PER_S] [--period-ms MS]
"""

from __future__ import annotations

import argparse
import gc
import itertools
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
from kvbridge.cli.arguments import non_negative_float, positive_float, positive_int

BLOCK_SIZE = 16
TOPIC = b"kv-events"
WORKER_ID = 1
TARGET = 1.2
"""p99 with the relay over p99 alone."""
_THREAD = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)
MIN_RATE = 200_000
"""Blocks per second the relay thread must achieve in every slice of its condition."""
CONDITIONS = ("alone", "thread", "process")
ORDERS = tuple(itertools.permutations(CONDITIONS))
"""The rounds' orders, in turn: each condition follows each other equally often."""
LABELS = {"alone": "alone", "thread": "relay thread", "process": "relay process"}
WORKERS = 16
PROMPT_BLOCKS = 512


# -- the other processes -----------------------------------------------------------------------


def publisher(endpoints: dict[str, str], blocks: int, seed: int, control: Connection) -> None:
    """Publishes the workload, cycled, to one of ``endpoints`` at a time: ``("route", name,
    rate)`` sends it to ``name``'s socket at ``rate`` blocks/s (``None``: to none), each
    socket's stream going on from where it paused (from seq 0 at first); ``"quit"`` answers with
    the number of batches each socket sent."""
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
    sockets = {}
    for name, endpoint in endpoints.items():
        pub = context.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, 0)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind(endpoint)
        sockets[name] = pub
    seqs = dict.fromkeys(endpoints, 0)
    control.send(counts)
    target: str | None = None
    rate, sent_blocks, start = 0.0, 0, time.perf_counter()
    while True:
        if control.poll(0 if target else None):
            command = control.recv()
            if command == "quit":
                break
            _, target, rate = command
            sent_blocks, start = 0, time.perf_counter()
            continue
        assert target is not None
        pub, due = sockets[target], rate * (time.perf_counter() - start)
        while sent_blocks < due:
            index = seqs[target] % len(cycle)
            pub.send_multipart([TOPIC, seqs[target].to_bytes(8, "big"), cycle[index]])
            sent_blocks += counts[index]
            seqs[target] += 1
        time.sleep(0.0005)
    control.send(seqs)
    context.destroy(linger=0)


def sink(endpoints: list[str], ready: Connection) -> None:
    """Drains the relays' outputs."""
    pin(1)
    context = zmq.Context()
    sub = subscriber(context, endpoints[0])
    for endpoint in endpoints[1:]:
        sub.connect(endpoint)
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
        heartbeat_s=None,  # idle only outside its own slices: it would load the others
    )


def _last_seq(relay: Relay) -> int | None:
    return relay.subscriber.last_seq(next(iter(relay.outputs)))


def relay_process(source: str, out: str, control: Connection) -> None:
    """The control condition: the same relay, started the same way, in a process of its own.
    Answers ``"seq"`` with the last sequence number relayed, until ``"quit"``."""
    pin(1)
    relay = _relay(source, out)
    relay.start()
    control.send(True)
    while control.recv() == "seq":
        control.send(_last_seq(relay))
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
        return _last_seq(self.relay)

    def close(self) -> None:
        self.relay.close()


class ProcessRelay:
    """The same relay in the helper process (:func:`relay_process`)."""

    def __init__(self, process: mp.process.BaseProcess, control: Connection) -> None:
        self.process = process
        self.control = control
        process.start()
        control.recv()

    def last_seq(self) -> int | None:
        self.control.send("seq")
        seq: int | None = self.control.recv()
        return seq

    def close(self) -> None:
        self.control.send("quit")
        self.control.recv()
        self.process.join(10)


# -- the slices --------------------------------------------------------------------------------


class Slice:
    """One slice's decisions, and the relay's rate during them."""

    def __init__(self, timings: Timings, relay_rate: float | None) -> None:
        self.timings = timings
        self.relay_rate = relay_rate


class Sample:
    """The decisions of some slices of one condition, pooled."""

    def __init__(self, slices: Sequence[Slice]) -> None:
        self.durations = [d for s in slices for d in s.timings.durations]
        self.late = [d for s in slices for d in s.timings.late]
        self.preempted = sum(sum(s.timings.preempted) for s in slices)
        self.blocked = sum(sum(s.timings.blocked) for s in slices)
        self.clean = [
            d
            for s in slices
            for d, p, b in zip(
                s.timings.durations, s.timings.preempted, s.timings.blocked, strict=True
            )
            if not p and not b
        ]
        """Durations of the decisions that neither the OS preempted nor anything blocked."""
        self.rates = [s.relay_rate for s in slices if s.relay_rate is not None]

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
        relays = ("thread", "process")
        sources = {name: f"tcp://127.0.0.1:{free_port()}" for name in relays}
        outs = {name: f"tcp://127.0.0.1:{free_port()}" for name in relays}
        self.control, control = self.ctx.Pipe()
        # daemons: a failure while starting the others must not leave them running
        self.publisher = self.ctx.Process(
            target=publisher, args=(sources, args.blocks, args.seed, control), daemon=True
        )
        self.publisher.start()
        self.counts: list[int] = self.control.recv()
        self.sink_control, sink_control = self.ctx.Pipe()
        self.sink = self.ctx.Process(
            target=sink, args=(list(outs.values()), sink_control), daemon=True
        )
        self.sink.start()
        self.sink_control.recv()
        helper_control, control = self.ctx.Pipe()
        helper = self.ctx.Process(
            target=relay_process, args=(sources["process"], outs["process"], control), daemon=True
        )
        self.relays: dict[str, ThreadRelay | ProcessRelay] = {
            "thread": ThreadRelay(sources["thread"], outs["thread"]),
            "process": ProcessRelay(helper, helper_control),
        }
        self.router = Router(args.seed)
        self.cycle_blocks: int = sum(self.counts)
        self.prefix = [0]
        for count in self.counts:
            self.prefix.append(self.prefix[-1] + count)
        pin(0)
        time.sleep(0.5)  # the relays' subscriptions reach the publisher
        for name in relays:  # a first stretch of each stream, not timed
            self.route(name)
            time.sleep(args.warmup)
        self.route("alone")

    def route(self, condition: str) -> None:
        target = None if condition == "alone" else condition
        self.control.send(("route", target, self.args.rate))

    def blocks_through(self, seq: int | None) -> int:
        """Blocks in the batches of sequence 0 to ``seq``."""
        if seq is None:
            return 0
        cycles, index = divmod(seq + 1, len(self.counts))
        return cycles * self.cycle_blocks + self.prefix[index]

    def slice(self, condition: str) -> Slice:
        self.route(condition)
        gc.collect()
        time.sleep(self.args.settle)
        relay = self.relays.get(condition)
        first = relay.last_seq() if relay else None
        started = time.perf_counter()
        timings = decisions(self.router, self.args.slice, self.period)
        elapsed = time.perf_counter() - started
        if relay is None:
            return Slice(timings, None)
        relayed = self.blocks_through(relay.last_seq()) - self.blocks_through(first)
        return Slice(timings, relayed / elapsed)

    def close(self) -> dict[str, tuple[int, int]]:
        """Stops everything; for each relay, the batches published to it and those it relayed
        (the stream is numbered from 0)."""
        self.route("alone")
        time.sleep(0.2)  # the relays drain what is in flight
        relayed = {name: relay.last_seq() for name, relay in self.relays.items()}
        for relay in self.relays.values():
            relay.close()
        self.control.send("quit")
        published: dict[str, int] = self.control.recv()
        self.publisher.join(10)
        self.sink_control.send("stop")
        self.sink_control.recv()
        self.sink.join(10)
        return {
            name: (published[name], 0 if seq is None else seq + 1) for name, seq in relayed.items()
        }


def us(seconds: float) -> str:
    return f"{seconds * 1e6:,.0f} us"


def report(label: str, sample: Sample) -> str:
    rates = f"  relay {min(sample.rates):,.0f} blocks/s at least" if sample.rates else ""
    return (
        f"  {label:<13} {len(sample.durations):>5} decisions  p50 {us(sample.p50):>7}  "
        f"p99 {us(sample.p99):>7}  max {us(max(sample.durations)):>9}  "
        f"late p99 {us(percentile(sample.late, 99)):>8}  preempted {sample.preempted} "
        f"blocked {sample.blocked}{rates}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=60, help="slices per condition")
    parser.add_argument(
        "--slice", type=positive_float, default=0.3, help="seconds of decisions each"
    )
    parser.add_argument(
        "--settle", type=non_negative_float, default=0.05, help="seconds before a slice"
    )
    parser.add_argument("--groups", type=int, default=6, help="groups of rounds reported")
    parser.add_argument(
        "--warmup", type=non_negative_float, default=0.5, help="each relay's untimed start"
    )
    parser.add_argument(
        "--rate", type=positive_float, default=250_000, help="blocks/s the stream offers"
    )
    parser.add_argument(
        "--period-ms", type=positive_float, default=1.0, help="one decision every ..."
    )
    parser.add_argument(
        "--blocks", type=positive_int, default=100_000, help="simulated blocks a cycle"
    )
    parser.add_argument("--seed", type=int, default=20_240_601)
    args = parser.parse_args(argv)
    if args.groups < 1 or args.rounds < args.groups or args.rounds % args.groups:
        parser.error("--rounds must be a positive multiple of --groups")

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
        f"a decision every {args.period_ms} ms; {args.rounds} rounds of {args.slice} s slices "
        f"({args.settle} s settling first)"
    )
    rounds: list[dict[str, Slice]] = []
    try:
        group_size = args.rounds // args.groups
        for round_ in range(args.rounds):
            order = ORDERS[round_ % len(ORDERS)]
            rounds.append({condition: bench.slice(condition) for condition in order})
            if (round_ + 1) % group_size == 0:
                group = rounds[-group_size:]
                print(f"rounds {round_ + 2 - group_size}-{round_ + 1}", flush=True)
                for condition in CONDITIONS:
                    sample = Sample([r[condition] for r in group])
                    print(report(LABELS[condition], sample), flush=True)
    finally:
        relayed = bench.close()

    groups = [rounds[i : i + group_size] for i in range(0, len(rounds), group_size)]
    print("\nover every slice of a condition (range over the groups)")
    pooled: dict[str, Sample] = {}
    by_group: dict[str, list[Sample]] = {}
    for condition in CONDITIONS:
        pooled[condition] = Sample([r[condition] for r in rounds])
        by_group[condition] = [Sample([r[condition] for r in g]) for g in groups]
        sample, parts = pooled[condition], by_group[condition]
        print(report(LABELS[condition], sample))
        print(
            f"  {'':<13} p50 {us(min(p.p50 for p in parts))}-{us(max(p.p50 for p in parts))}, "
            f"p99 {us(min(p.p99 for p in parts))}-{us(max(p.p99 for p in parts))}; "
            f"p99 of the decisions neither preempted nor blocked {us(percentile(sample.clean, 99))}"
        )
    for name, (published, through) in relayed.items():
        rates = pooled[name].rates
        print(
            f"  {LABELS[name]}: {min(rates):,.0f}-{max(rates):,.0f} blocks/s over its slices "
            f"(needed: {MIN_RATE:,}); {published:,} batches published to it, "
            f"{through:,} relayed"
        )

    def ratios(top: str, bottom: str) -> tuple[float, list[float]]:
        """Pooled p99 ratio, and group by group."""
        per_group = [t.p99 / b.p99 for t, b in zip(by_group[top], by_group[bottom], strict=True)]
        return pooled[top].p99 / pooled[bottom].p99, per_group

    ratio, per_group = ratios("thread", "alone")
    met = ratio <= TARGET and min(pooled["thread"].rates) >= MIN_RATE
    print(
        f"\np99 with the relay thread / p99 alone: {ratio:.2f} over all slices "
        f"({min(per_group):.2f}-{max(per_group):.2f} group by group); target <= {TARGET} "
        f"with the relay at >= {MIN_RATE:,} blocks/s: {'met' if met else 'NOT met'}"
    )
    clean = {c: percentile(pooled[c].clean, 99) for c in CONDITIONS}
    print(
        f"the same over the decisions neither preempted nor blocked: "
        f"{clean['thread'] / clean['alone']:.2f}"
    )
    control, control_groups = ratios("thread", "process")
    print(
        f"p99 with the relay thread / p99 with the relay in another process (the GIL's own "
        f"share): {control:.2f} ({min(control_groups):.2f}-{max(control_groups):.2f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
