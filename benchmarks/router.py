#!/usr/bin/env python3
"""Decision latency of ``DynamoKVRouter.choose_replicas`` against Ray Serve's power of two choices.

Both routers are built in this process the way Serve builds a deployment handle's router
(``ray.serve._private.router``): its internal constructor keywords, ``initialize_state``, then
``RunningReplicaInfo`` records turned into ``RunningReplica`` objects and ``update_replicas``.
No Serve replica runs. Serve resolves each replica's actor by name, and power of two choices
probes new replicas' queue lengths, so every replica points at one small actor that answers the
probe, in a local Ray started for the run.

Each replica's routing stats carry a :class:`~kvbridge.ray_integration.KVEventsAdvert`, and
DynamoKVRouter registers every replica with its real Dynamo ``SelectionService``, which
subscribes to the advertised streams. One replica in four runs a real relay
(:class:`~kvbridge.ray_integration.KVEventsReplica`) fed by a
:class:`~kvbridge.testing.SimulatedEngine` (block size 32, 1,024 blocks) that has served three
prompts of 8,192 tokens; the other replicas advertise bound streams on which nothing is
published. The clock starts once Dynamo has indexed every served prompt.

The queries are 8,192-token prompts: three in four repeat a served prompt's first 25-100% and
continue with new tokens, one in four is all new. For each replica count both routers take the
same queries in the same order, alternately, and which router goes first alternates too. Every
call gets a new ``PendingRequest`` with ``kwargs={"prompt_token_ids": tokens}`` and a unique
``internal_request_id``, and the router's candidates are its replica list, as Serve passes them.
The clock (``time.perf_counter``) is around ``await router.choose_replicas(...)`` alone.
``on_request_completed`` follows each decision, outside it, and the script waits until Dynamo
has freed the reservation, so that every decision starts from idle replicas.

Dynamo logs every selection at INFO level (and each new worker at WARN): the script sets
``DYN_LOG=error`` unless it is set, so the figures leave out writing those lines. kvbridge's own
logs are shown from WARNING up.

Run: python benchmarks/router.py [--replicas 4 16 64] [--iterations N] [--warmup N] [--profile]
"""

from __future__ import annotations

import os

os.environ.setdefault("DYN_LOG", "error")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# One actor answers the queue-length probes of all the replicas: 64 take longer than Serve's
# 0.1 s deadline on a busy machine.
os.environ.setdefault("RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S", "1")

import argparse
import asyncio
import cProfile
import gc
import logging
import math
import platform
import pstats
import random
import string
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from importlib.metadata import version
from typing import Any

import ray
import structlog
import zmq
from ray.serve._private.common import (
    DeploymentHandleSource,
    DeploymentID,
    ReplicaID,
    RequestMetadata,
    RunningReplicaInfo,
)
from ray.serve._private.constants import SERVE_NAMESPACE
from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from kvbridge.adapters.publisher import Publisher
from kvbridge.ray_integration import DynamoKVRouter, KVEventsAdvert, KVEventsReplica
from kvbridge.ray_integration.routing import close_routing_states, worker_id_for
from kvbridge.testing import SimulatedEngine

BLOCK_SIZE = 32
PROMPT_TOKENS = 8_192
PROMPT_BLOCKS = PROMPT_TOKENS // BLOCK_SIZE
ENGINE_BLOCKS = 1_024
ENGINE_EVERY = 4
"""One replica in this many runs an engine."""
SERVED_PER_ENGINE = 3
QUERIES = 64
NEW_QUERY_SHARE = 0.25
VOCAB = 151_936
MAX_ONGOING_REQUESTS = 5
"""Serve's default."""
INDEX_TIMEOUT_S = 30.0
ACTOR_NAME = "kvbridge-benchmark-replica"
ROUTERS = ("pow2", "dynamo")


@ray.remote(num_cpus=0)
class ReplicaActor:
    """Every replica's actor: answers the queue-length probe of power of two choices."""

    async def get_num_ongoing_requests(self) -> int:
        return 0


@contextmanager
def ray_session() -> Iterator[str]:
    """A local Ray with the replicas' actor; yields the node id."""
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=128 * 1024 * 1024,
        logging_level="WARNING",
    )
    try:
        actor = ReplicaActor.options(name=ACTOR_NAME, namespace=SERVE_NAMESPACE).remote()
        ray.get(actor.get_num_ongoing_requests.remote())
        yield ray.get_runtime_context().get_node_id()
    finally:
        ray.shutdown()


# -- replicas and queries ----------------------------------------------------------------------


@dataclass(frozen=True)
class Query:
    tokens: list[int]
    replica: str | None
    """The replica whose engine served the prompt this one repeats the start of."""
    blocks: int
    """Full blocks this prompt shares with that served prompt."""


@dataclass
class Fleet:
    """The replicas of one run: their adverts, engines and the prompts the engines served."""

    replica_ids: list[str]
    adverts: list[KVEventsAdvert]
    engines: dict[str, SimulatedEngine] = field(default_factory=dict)
    served: dict[str, list[list[int]]] = field(default_factory=dict)


def random_tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(count)]


def build_fleet(stack: ExitStack, count: int, rng: random.Random) -> Fleet:
    """``count`` replicas; every ``ENGINE_EVERY``-th runs a relay and an engine, the others
    advertise silent streams (a bound PUB and replay ROUTER, nothing published)."""
    context = zmq.Context.instance()
    fleet = Fleet([], [])
    for index in range(count):
        replica_id = "".join(rng.choices(string.ascii_lowercase + string.digits, k=8))
        fleet.replica_ids.append(replica_id)
        if index % ENGINE_EVERY == 0:
            replica = KVEventsReplica(block_size=BLOCK_SIZE, host="127.0.0.1")
            stack.callback(replica.close_kv_events)
            config = replica.kv_events_config()
            engine = SimulatedEngine(
                config["endpoint"],
                replay_endpoint=config["replay_endpoint"],
                bind=None,  # vLLM's rule: the engine connects to its relay, which binds
                block_size=BLOCK_SIZE,
                num_blocks=ENGINE_BLOCKS,
            )
            stack.callback(engine.close)
            fleet.engines[replica_id] = engine
            fleet.adverts.append(replica.kv_advert)
        else:
            silent = Publisher(
                "tcp://127.0.0.1:0",
                replay_endpoint="tcp://127.0.0.1:0",
                context=context,
                bind=True,
            )
            stack.callback(silent.close)
            fleet.adverts.append(
                KVEventsAdvert(
                    endpoints={0: silent.endpoint},
                    replay_endpoints={0: str(silent.replay_endpoint)},
                    block_size=BLOCK_SIZE,
                )
            )
    return fleet


def serve_prompts(fleet: Fleet, rng: random.Random) -> None:
    """Each engine serves ``SERVED_PER_ENGINE`` new prompts (its relay republishes the events)."""
    for replica_id, engine in fleet.engines.items():
        if not engine.wait_for_subscribers(1, timeout=10.0):
            raise SystemExit(f"the relay of {replica_id} never subscribed to its engine")
        prompts = [random_tokens(rng, PROMPT_TOKENS) for _ in range(SERVED_PER_ENGINE)]
        for prompt in prompts:
            engine.generate(prompt, max_tokens=4)
        fleet.served[replica_id] = prompts


def make_queries(fleet: Fleet, rng: random.Random) -> list[Query]:
    served = [(r, p) for r, prompts in fleet.served.items() for p in prompts]
    queries = []
    for _ in range(QUERIES):
        if rng.random() < NEW_QUERY_SHARE:
            queries.append(Query(random_tokens(rng, PROMPT_TOKENS), None, 0))
            continue
        replica_id, prompt = rng.choice(served)
        shared = rng.randrange(PROMPT_TOKENS // 4, PROMPT_TOKENS + 1)
        tokens = prompt[:shared] + random_tokens(rng, PROMPT_TOKENS - shared)
        common = next(
            (i for i, (a, b) in enumerate(zip(tokens, prompt, strict=True)) if a != b),
            PROMPT_TOKENS,
        )
        queries.append(Query(tokens, replica_id, common // BLOCK_SIZE))
    return queries


def replica_infos(
    fleet: Fleet, deployment_id: DeploymentID, node_id: str
) -> list[RunningReplicaInfo]:
    return [
        RunningReplicaInfo(
            replica_id=ReplicaID(unique_id=replica_id, deployment_id=deployment_id),
            node_id=node_id,
            node_ip="127.0.0.1",
            availability_zone=None,
            actor_name=ACTOR_NAME,
            max_ongoing_requests=MAX_ONGOING_REQUESTS,
            routing_stats=advert.routing_stats(),
        )
        for replica_id, advert in zip(fleet.replica_ids, fleet.adverts, strict=True)
    ]


# -- routers -----------------------------------------------------------------------------------


def make_router(
    router_class: type[RequestRouter],
    deployment_id: DeploymentID,
    node_id: str,
    infos: list[RunningReplicaInfo],
    **router_kwargs: Any,
) -> RequestRouter:
    """A router as Serve makes one for a handle in a driver, with the replicas Serve gives it.

    Call it on the loop the router will run on (Serve starts tasks on it)."""
    router = router_class(
        deployment_id=deployment_id,
        handle_source=DeploymentHandleSource.UNKNOWN,
        self_node_id=node_id,
        self_actor_id=None,
        self_actor_handle=None,
        use_replica_queue_len_cache=True,
        create_replica_wrapper_func=RunningReplica,
        prefer_local_node_routing=False,
        prefer_local_az_routing=False,
        self_availability_zone=None,
    )
    router.initialize_state(**router_kwargs)
    router._update_running_replicas(infos)
    return router


def device_overlap(router: DynamoKVRouter, prompt: list[int], worker_id: int) -> int:
    """The blocks of ``prompt`` Dynamo's index holds on the worker's device tier."""
    scores = router.routing.client.call_sync(
        "overlap_scores", {"token_ids": prompt, "model_name": "default"}
    )
    return sum(int(w["device_blocks"]) for w in scores["workers"] if w["worker_id"] == worker_id)


def wait_until_indexed(router: DynamoKVRouter, fleet: Fleet) -> float:
    """Until Dynamo has indexed every served prompt whole; returns the seconds it took."""
    started = time.monotonic()
    pending = [(p, worker_id_for(r)) for r, prompts in fleet.served.items() for p in prompts]
    while pending:
        if time.monotonic() - started > INDEX_TIMEOUT_S:
            raise SystemExit(f"Dynamo did not index {len(pending)} served prompts in time")
        time.sleep(0.05)
        pending = [(p, w) for p, w in pending if device_overlap(router, p, w) < PROMPT_BLOCKS]
    return time.monotonic() - started


# -- measuring ---------------------------------------------------------------------------------


@dataclass
class Tally:
    """What DynamoKVRouter decided, checked against the queries."""

    decisions: int = 0
    with_overlap: int = 0
    expected: int = 0
    """Queries that repeat a served prompt."""
    found: int = 0
    """Of those, decisions on the serving replica with the whole shared prefix as overlap."""
    overlap_blocks: int = 0


async def decide(router: RequestRouter, tokens: list[int], request_id: str) -> float:
    """One ``choose_replicas`` call, timed; then the request's completion."""
    request = PendingRequest(
        args=[],
        kwargs={"prompt_token_ids": tokens},
        metadata=RequestMetadata(request_id=request_id, internal_request_id=request_id),
    )
    candidates = router._replicas_list  # what Serve passes
    started = time.perf_counter()
    ranked = await router.choose_replicas(candidates, request)
    elapsed = time.perf_counter() - started
    router.on_request_completed(ranked[0][0].replica_id, request_id)
    return elapsed


async def until_freed(router: DynamoKVRouter) -> None:
    """Until Dynamo has freed every reservation the router made, so that each decision starts
    from idle workers (``on_request_completed`` only submits the free)."""
    stats = router.routing.stats
    deadline = time.monotonic() + 5.0
    while stats.registry["freed"] + stats.registry["free_failed"] < stats.outcomes["dynamo"]:
        if time.monotonic() > deadline:
            raise SystemExit("Dynamo did not free a reservation within 5 s")
        await asyncio.sleep(0.0002)


def check(tally: Tally, router: DynamoKVRouter, query: Query) -> None:
    decision = router.routing.stats.decisions[-1]
    tally.decisions += 1
    overlap = decision.overlap.device if decision.overlap is not None else 0
    tally.with_overlap += overlap > 0
    tally.overlap_blocks += overlap
    if query.replica is not None:
        tally.expected += 1
        tally.found += decision.replica_id == query.replica and overlap == query.blocks


async def measure(
    routers: dict[str, RequestRouter],
    queries: list[Query],
    iterations: int,
    warmup: int,
    profiler: cProfile.Profile | None = None,
) -> tuple[dict[str, list[float]], Tally]:
    """Seconds per decision of each router after ``warmup`` rounds, and DynamoKVRouter's tally."""
    dynamo = routers["dynamo"]
    assert isinstance(dynamo, DynamoKVRouter)
    times: dict[str, list[float]] = {name: [] for name in routers}
    tally = Tally()
    for round_ in range(warmup + iterations):
        query = queries[round_ % len(queries)]
        order = ROUTERS if round_ % 2 == 0 else ROUTERS[::-1]
        for name in order:
            profile = profiler is not None and name == "dynamo" and round_ >= warmup
            if profile:
                profiler.enable()
            elapsed = await decide(routers[name], query.tokens, f"{name}-{round_}")
            if profile:
                profiler.disable()
            if name == "dynamo":
                await until_freed(dynamo)
            if round_ >= warmup:
                times[name].append(elapsed)
                if name == "dynamo":
                    check(tally, dynamo, query)
    return times, tally


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


@dataclass(frozen=True)
class Row:
    replicas: int
    engines: int
    p50: dict[str, float]
    p99: dict[str, float]
    tally: Tally
    fallbacks: int
    reservations: int
    indexed_s: float


async def run(
    count: int, node_id: str, args: argparse.Namespace, profiler: cProfile.Profile | None = None
) -> Row:
    rng = random.Random(args.seed + count)
    with ExitStack() as stack:
        fleet = build_fleet(stack, count, rng)
        deployment = DeploymentID(name=f"Engine{count}", app_name="bench")
        infos = replica_infos(fleet, deployment, node_id)
        dynamo = make_router(DynamoKVRouter, deployment, node_id, infos, block_size=BLOCK_SIZE)
        assert isinstance(dynamo, DynamoKVRouter)
        stack.callback(close_routing_states)
        pow2 = make_router(PowerOfTwoChoicesRequestRouter, deployment, node_id, infos)
        routers = {"pow2": pow2, "dynamo": dynamo}
        # Dynamo registers the replicas; let its subscriptions reach the relays before serving.
        deadline = time.monotonic() + INDEX_TIMEOUT_S
        while len(dynamo.routing.ready_workers(fleet.replica_ids)) < count:
            if time.monotonic() > deadline:
                raise SystemExit("Dynamo did not register every replica in time")
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)
        serve_prompts(fleet, rng)
        indexed_s = wait_until_indexed(dynamo, fleet)
        queries = make_queries(fleet, rng)
        gc.collect()
        times, tally = await measure(routers, queries, args.iterations, args.warmup, profiler)
        deadline = time.monotonic() + 5.0
        while dynamo.routing.client.active_reservations() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return Row(
            replicas=count,
            engines=len(fleet.engines),
            p50={name: percentile(t, 50) for name, t in times.items()},
            p99={name: percentile(t, 99) for name, t in times.items()},
            tally=tally,
            fallbacks=dynamo.routing.stats.fallbacks.total(),
            reservations=dynamo.routing.client.active_reservations(),
            indexed_s=indexed_s,
        )


def us(seconds: float) -> str:
    return f"{seconds * 1e6:,.0f} us"


def report(row: Row) -> None:
    tally = row.tally
    mean = tally.overlap_blocks / tally.with_overlap if tally.with_overlap else 0.0
    print(
        f"\n{row.replicas} replicas, {row.engines} with an engine "
        f"(Dynamo indexed their prompts {row.indexed_s:.2f} s after they were served)"
    )
    for name, label in (("pow2", "power of two choices"), ("dynamo", "DynamoKVRouter")):
        print(f"  {label:<21} p50 {us(row.p50[name]):>10}   p99 {us(row.p99[name]):>10}")
    print(
        f"  DynamoKVRouter / pow2  p50 {row.p50['dynamo'] / row.p50['pow2']:>7.1f}x"
        f"   p99 {row.p99['dynamo'] / row.p99['pow2']:>7.1f}x"
    )
    print(
        f"  Dynamo decisions with overlap: {tally.with_overlap}/{tally.decisions} "
        f"(mean {mean:.0f} blocks); repeats routed to their prompt's replica with the whole "
        f"shared prefix: {tally.found}/{tally.expected}"
    )
    print(f"  fallbacks: {row.fallbacks}; active reservations at the end: {row.reservations}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--iterations", type=int, default=500, help="timed decisions per router")
    parser.add_argument("--warmup", type=int, default=50, help="untimed decisions per router")
    parser.add_argument("--seed", type=int, default=20_240_601)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="cProfile DynamoKVRouter's timed decisions at the last replica count and stop",
    )
    args = parser.parse_args(argv)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))

    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} CPUs, "
        f"load average {load}; ray {ray.__version__}, "
        f"ai-dynamo-runtime {version('ai-dynamo-runtime')}, DYN_LOG={os.environ['DYN_LOG']}"
    )
    print(
        f"prompts of {PROMPT_TOKENS:,} tokens ({PROMPT_BLOCKS} blocks of {BLOCK_SIZE}); one "
        f"replica in {ENGINE_EVERY} runs an engine that served {SERVED_PER_ENGINE} of them; "
        f"{QUERIES} queries, {1 - NEW_QUERY_SHARE:.0%} repeating 25-100% of a served prompt"
    )
    print(
        f"per replica count: {args.warmup} warm-up then {args.iterations} timed decisions "
        "per router, alternating"
    )
    started = time.perf_counter()
    if args.profile:
        profiler = cProfile.Profile()
        with ray_session() as node_id:
            report(asyncio.run(run(args.replicas[-1], node_id, args, profiler)))
        print("\ncProfile of DynamoKVRouter's timed decisions (main thread; timings inflated)")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
        return 0

    rows = []
    with ray_session() as node_id:
        for count in args.replicas:
            rows.append(asyncio.run(run(count, node_id, args)))
            report(rows[-1])

    print("\ndecision latency, p50 (p99)")
    header = f"{'replicas':>8} {'pow2':>22} {'DynamoKVRouter':>24} {'ratio':>16}"
    print(header)
    print("-" * len(header))
    for row in rows:
        p50, p99 = row.p50, row.p99
        print(
            f"{row.replicas:>8} {us(p50['pow2']):>10} ({us(p99['pow2']):>9}) "
            f"{us(p50['dynamo']):>11} ({us(p99['dynamo']):>10}) "
            f"{p50['dynamo'] / p50['pow2']:>6.0f}x ({p99['dynamo'] / p99['pow2']:>4.0f}x)"
        )
    print(f"total {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
