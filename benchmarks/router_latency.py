#!/usr/bin/env python3
"""Decision latency of kvbridge's Serve routers against a raw Dynamo select and Serve's default.

In one run, for 4, 16 and 64 replicas, on the same replicas and the same 8,192-token prompts:

- ``raw``: Dynamo's ``SelectionService.select_and_reserve`` alone, called as Ray Serve LLM's own
  ``KVTokenTracker`` calls it (awaited on the caller's loop, with the prompt's token ids and the
  candidates as ``allowed_worker_ids``), on DynamoKVRouter's service, so on the same index;
- ``DynamoKVRouter.choose_replicas``;
- ``DynamoLLMRouter.choose_replicas`` (only where ``ray.serve.llm`` imports, which needs vLLM:
  run the script with the Serve LLM venv's python, ``tools/serve_llm/setup.sh``);
- ``PowerOfTwoChoicesRequestRouter.choose_replicas``, Serve's default.

The routers are built in this process the way Serve builds a deployment handle's router
(``ray.serve._private.router``): its internal constructor keywords, ``initialize_state``, then
``RunningReplicaInfo`` records turned into ``RunningReplica`` objects and ``update_replicas``.
No Serve replica runs. Serve resolves each replica's actor by name, and power of two choices
probes new replicas' queue lengths, so every replica points at one small actor that answers the
probe, in a local Ray started for the run.

Every replica advertises what a Ray Serve LLM replica advertises, ``kv_event_metadata`` naming a
raw vLLM stream: one replica in four runs a :class:`~kvbridge.testing.SimulatedEngine` (vLLM
0.32's events, block size 32, 1,024 blocks) that has served three prompts of 8,192 tokens, the
others bind a stream and a replay socket on which nothing is published. DynamoKVRouter registers
the raw streams with its Dynamo as they are (these engines' events need no normalization);
DynamoLLMRouter relays each through a kvbridge relay in this process, as it does in Serve LLM.
The clock starts once both services have indexed every served prompt.

The queries are 8,192-token prompts: three in four repeat a served prompt's first 25-100% and
continue with new tokens, one in four is all new. In each round every router takes the same
query, one after the other, the order rotating from round to round. Every call gets a new
``PendingRequest`` with ``kwargs={"prompt_token_ids": tokens}`` and a unique
``internal_request_id``, and the router's candidates are its replica list, as Serve passes them.
The clock (``time.perf_counter``) is around the awaited call alone. The request's completion
(``on_request_completed``, or ``free_reservation`` for the raw call) follows outside it, and the
script waits until Dynamo has freed the reservation, so that every decision starts from idle
replicas.

With vLLM importable, the last rows time ``VllmTokenizer``, DynamoLLMRouter's tokenizer, on an
8,192-token text completion and chat request, for the tiny model of ``tools/vllm_cpu`` with two
tokenizers (:data:`TOKENIZERS`): its own, which maps one byte to one token, and a 32,000-token
byte-level BPE trained at the start on the standard library's source, standing in for a real
model's tokenizer, which this machine cannot download.

Dynamo logs every selection at INFO level (and each new worker at WARN): the script sets
``DYN_LOG=error`` unless it is set, so the figures leave out writing those lines. kvbridge's own
logs are shown from WARNING up.

Run: python benchmarks/router_latency.py [--replicas 4 16 64] [--iterations N] [--warmup N]
[--profile]
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
import contextlib
import cProfile
import gc
import importlib.util
import json
import logging
import platform
import pstats
import random
import string
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
import structlog
import zmq
from percentiles import percentile
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
from kvbridge.cli.arguments import non_negative_int, positive_int
from kvbridge.ray_integration import DynamoKVRouter
from kvbridge.ray_integration.advert import RAY_LLM_STATS_KEY
from kvbridge.ray_integration.decisions import Release
from kvbridge.ray_integration.routing import worker_id_for
from kvbridge.ray_integration.routing_states import close_routing_states
from kvbridge.testing import SimulatedEngine

if TYPE_CHECKING:
    from tokenizers import Tokenizer

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
MODEL_NAME = "default"
LABELS = {
    "raw": "raw select_and_reserve",
    "dynamo": "DynamoKVRouter",
    "llm": "DynamoLLMRouter",
    "pow2": "power of two choices",
}
TARGET = 1.5
"""A kvbridge router's p99 may be at most this many times the raw call's."""
TOOLS = Path(__file__).resolve().parent.parent / "tools" / "vllm_cpu"


def serve_llm_importable() -> bool:
    """Whether ``ray.serve.llm`` (so DynamoLLMRouter and vLLM) can be imported here."""
    return importlib.util.find_spec("vllm") is not None


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
    """The replicas of one run: their routing stats, engines and the prompts they served."""

    replica_ids: list[str]
    stats: list[dict[str, Any]]
    engines: dict[str, SimulatedEngine] = field(default_factory=dict)
    served: dict[str, list[list[int]]] = field(default_factory=dict)


def random_tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(count)]


def ray_llm_stats(endpoint: str, replay_endpoint: str | None) -> dict[str, Any]:
    """The routing stats of a Ray Serve LLM replica (``LLMServer.record_routing_stats``)."""
    metadata = {
        "endpoint": endpoint,
        "replay_endpoint": replay_endpoint,
        "block_size": BLOCK_SIZE,
        "max_num_batched_tokens": PROMPT_TOKENS,
        "dp_rank": 0,
    }
    return {RAY_LLM_STATS_KEY: metadata}


def build_fleet(stack: ExitStack, count: int, rng: random.Random) -> Fleet:
    """``count`` replicas; every ``ENGINE_EVERY``-th runs an engine, the others advertise silent
    streams (a bound PUB and replay ROUTER, nothing published)."""
    context = zmq.Context.instance()
    fleet = Fleet([], [])
    for index in range(count):
        replica_id = "".join(rng.choices(string.ascii_lowercase + string.digits, k=8))
        fleet.replica_ids.append(replica_id)
        if index % ENGINE_EVERY == 0:
            engine = SimulatedEngine(block_size=BLOCK_SIZE, num_blocks=ENGINE_BLOCKS)
            stack.callback(engine.close)
            fleet.engines[replica_id] = engine
            fleet.stats.append(ray_llm_stats(engine.endpoint, engine.replay_endpoint))
        else:
            silent = Publisher(
                "tcp://127.0.0.1:0",
                replay_endpoint="tcp://127.0.0.1:0",
                context=context,
                bind=True,
            )
            stack.callback(silent.close)
            fleet.stats.append(ray_llm_stats(silent.endpoint, silent.replay_endpoint))
    return fleet


def serve_prompts(fleet: Fleet, rng: random.Random, subscribers: int) -> None:
    """Each engine serves ``SERVED_PER_ENGINE`` new prompts, once ``subscribers`` listen."""
    for replica_id, engine in fleet.engines.items():
        if not engine.wait_for_subscribers(subscribers, timeout=10.0):
            raise SystemExit(f"{replica_id}'s engine has fewer than {subscribers} subscribers")
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
            routing_stats=stats,
        )
        for replica_id, stats in zip(fleet.replica_ids, fleet.stats, strict=True)
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


def make_llm_router(deployment_id: DeploymentID, node_id: str, fleet: Fleet) -> DynamoKVRouter:
    """DynamoLLMRouter as Ray Serve LLM configures it (no router kwargs).

    Its vLLM tokenizer reads the deployment's ``LLMConfig`` from Serve's controller, which this
    script does not run, so it fails to load; token-id prompts never need it. Its loading
    (vLLM's imports) is waited for here, so that it does not run during the timed decisions.
    """
    from kvbridge.ray_integration.llm_router import DynamoLLMRouter

    router = make_router(
        DynamoLLMRouter, deployment_id, node_id, replica_infos(fleet, deployment_id, node_id)
    )
    assert isinstance(router, DynamoKVRouter)
    tokenizer = getattr(router, "_vllm_tokenizer", None)
    if tokenizer is not None:
        with contextlib.suppress(Exception):
            tokenizer.wait_loaded(120)
    return router


def device_overlap(router: DynamoKVRouter, prompt: list[int], worker_id: int) -> int:
    """The blocks of ``prompt`` the router's Dynamo holds on the worker's device tier."""
    scores = router.routing.client.call_sync(
        "overlap_scores", {"token_ids": prompt, "model_name": MODEL_NAME}
    )
    return sum(int(w["device_blocks"]) for w in scores["workers"] if w["worker_id"] == worker_id)


def wait_until_indexed(routers: Sequence[DynamoKVRouter], fleet: Fleet) -> float:
    """Until every router's Dynamo has indexed every served prompt whole; returns the seconds
    it took."""
    started = time.monotonic()
    pending = [
        (router, p, worker_id_for(r))
        for router in routers
        for r, prompts in fleet.served.items()
        for p in prompts
    ]
    while pending:
        if time.monotonic() - started > INDEX_TIMEOUT_S:
            raise SystemExit(f"Dynamo did not index {len(pending)} served prompts in time")
        time.sleep(0.05)
        pending = [(d, p, w) for d, p, w in pending if device_overlap(d, p, w) < PROMPT_BLOCKS]
    return time.monotonic() - started


# -- measuring ---------------------------------------------------------------------------------


@dataclass
class Tally:
    """What a Dynamo path decided, checked against the queries."""

    decisions: int = 0
    with_overlap: int = 0
    expected: int = 0
    """Queries that repeat a served prompt."""
    found: int = 0
    """Of those, decisions on the serving replica with the whole shared prefix as overlap."""
    overlap_blocks: int = 0

    def add(self, query: Query, replica_id: str | None, overlap: int) -> None:
        self.decisions += 1
        self.with_overlap += overlap > 0
        self.overlap_blocks += overlap
        if query.replica is not None:
            self.expected += 1
            self.found += replica_id == query.replica and overlap == query.blocks


Decide = Callable[[Query, str], Awaitable[float]]
"""Times one decision on a query with a request id, checks it, and completes the request."""


def router_decider(router: RequestRouter, tally: Tally | None) -> Decide:
    """``choose_replicas`` timed, then the request's completion; for a kvbridge router, the
    decision checked and Dynamo's free waited for."""

    async def decide(query: Query, request_id: str) -> float:
        request = PendingRequest(
            args=[],
            kwargs={"prompt_token_ids": query.tokens},
            metadata=RequestMetadata(request_id=request_id, internal_request_id=request_id),
        )
        candidates = router._replicas_list  # what Serve passes
        started = time.perf_counter()
        ranked = await router.choose_replicas(candidates, request)
        elapsed = time.perf_counter() - started
        router.on_request_completed(ranked[0][0].replica_id, request_id)
        if isinstance(router, DynamoKVRouter):
            assert tally is not None
            await until_freed(router)
            decision = router.routing.stats.decisions[-1]
            overlap = decision.overlap.device if decision.overlap is not None else 0
            tally.add(query, decision.replica_id, overlap)
        return elapsed

    return decide


def raw_decider(router: DynamoKVRouter, replica_ids: list[str], tally: Tally) -> Decide:
    """Dynamo's ``select_and_reserve`` on ``router``'s service, as Ray's ``KVTokenTracker``
    calls it, timed; then ``free_reservation``."""
    service = router.routing.client.service
    by_worker = {worker_id_for(r): r for r in replica_ids}
    allowed = list(by_worker)

    async def decide(query: Query, request_id: str) -> float:
        request = {
            "model_name": MODEL_NAME,
            "selection_id": request_id,
            "token_ids": query.tokens,
            "allowed_worker_ids": allowed,
            "expected_output_tokens": None,
        }
        started = time.perf_counter()
        answer = await service.select_and_reserve(request)
        elapsed = time.perf_counter() - started
        await service.free_reservation(request_id)
        tally.add(query, by_worker.get(answer["worker_id"]), answer["overlap"]["gpu"] // BLOCK_SIZE)
        return elapsed

    return decide


async def until_freed(router: DynamoKVRouter) -> None:
    """Until Dynamo has freed every reservation the router made, so that each decision starts
    from idle workers (``on_request_completed`` only submits the free)."""
    stats = router.routing.stats
    deadline = time.monotonic() + 5.0
    while (
        stats.registry.releases[Release.FREED] + stats.registry.free_failed
        < stats.outcomes["dynamo"]
    ):
        if time.monotonic() > deadline:
            raise SystemExit("Dynamo did not free a reservation within 5 s")
        await asyncio.sleep(0.0002)


async def measure(
    deciders: dict[str, Decide],
    queries: list[Query],
    iterations: int,
    warmup: int,
    profiler: cProfile.Profile | None = None,
) -> dict[str, list[float]]:
    """Seconds per decision of each path, after ``warmup`` untimed rounds."""
    names = list(deciders)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(warmup + iterations):
        query = queries[round_ % len(queries)]
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            profile = profiler is not None and name == "dynamo" and round_ >= warmup
            if profile:
                assert profiler is not None
                profiler.enable()
            elapsed = await deciders[name](query, f"{name}-{round_}")
            if profile:
                assert profiler is not None
                profiler.disable()
            if round_ >= warmup:
                times[name].append(elapsed)
    return times


@dataclass(frozen=True)
class Row:
    replicas: int
    engines: int
    p50: dict[str, float]
    p99: dict[str, float]
    tallies: dict[str, Tally]
    fallbacks: dict[str, int]
    reservations: dict[str, int]
    indexed_s: float


async def run(
    count: int,
    node_id: str,
    args: argparse.Namespace,
    with_llm: bool,
    profiler: cProfile.Profile | None = None,
) -> Row:
    rng = random.Random(args.seed + count)
    with ExitStack() as stack:
        fleet = build_fleet(stack, count, rng)
        deployment = DeploymentID(name=f"Engine{count}", app_name="bench")
        infos = replica_infos(fleet, deployment, node_id)
        stack.callback(close_routing_states)
        dynamo = make_router(DynamoKVRouter, deployment, node_id, infos, block_size=BLOCK_SIZE)
        assert isinstance(dynamo, DynamoKVRouter)
        kvbridge_routers = {"dynamo": dynamo}
        if with_llm:
            llm_deployment = DeploymentID(name=f"Engine{count}", app_name="bench-llm")
            kvbridge_routers["llm"] = make_llm_router(llm_deployment, node_id, fleet)
        pow2 = make_router(PowerOfTwoChoicesRequestRouter, deployment, node_id, infos)
        # Dynamo registers the replicas; let its subscriptions reach the streams before serving.
        deadline = time.monotonic() + INDEX_TIMEOUT_S
        for router in kvbridge_routers.values():
            while len(router.routing.ready_workers(fleet.replica_ids)) < count:
                if time.monotonic() > deadline:
                    raise SystemExit("Dynamo did not register every replica in time")
                await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)
        serve_prompts(fleet, rng, subscribers=len(kvbridge_routers))
        indexed_s = wait_until_indexed(list(kvbridge_routers.values()), fleet)
        queries = make_queries(fleet, rng)
        gc.collect()

        def deciders() -> tuple[dict[str, Decide], dict[str, Tally]]:
            tallies = {name: Tally() for name in ("raw", *kvbridge_routers)}
            paths: dict[str, Decide] = {
                "raw": raw_decider(dynamo, fleet.replica_ids, tallies["raw"])
            }
            for name, router in kvbridge_routers.items():
                paths[name] = router_decider(router, tallies[name])
            paths["pow2"] = router_decider(pow2, None)
            return paths, tallies

        warm, _ = deciders()
        await measure(warm, queries, 0, args.warmup)
        timed, tallies = deciders()
        times = await measure(timed, queries, args.iterations, 0, profiler)
        deadline = time.monotonic() + 5.0
        while (
            any(r.routing.client.active_reservations() for r in kvbridge_routers.values())
            and time.monotonic() < deadline
        ):
            await asyncio.sleep(0.05)
        return Row(
            replicas=count,
            engines=len(fleet.engines),
            p50={name: percentile(t, 50) for name, t in times.items()},
            p99={name: percentile(t, 99) for name, t in times.items()},
            tallies=tallies,
            fallbacks={n: r.routing.stats.fallbacks.total() for n, r in kvbridge_routers.items()},
            reservations={
                n: r.routing.client.active_reservations() for n, r in kvbridge_routers.items()
            },
            indexed_s=indexed_s,
        )


# -- tokenization ------------------------------------------------------------------------------


TOKENIZERS = {
    "bytes": "the tiny model's own: one byte, one token, no merges",
    "bpe32k": "a byte-level BPE of 32,000 tokens trained here on this Python's standard library",
}
"""The tokenizers the tokenization row times. No real model's tokenizer can be had on this
machine (no hub downloads), so a BPE with merges and a vocabulary of a real one's size stands
in for one."""


def train_bpe(model: Path) -> Tokenizer:
    """Replace ``model``'s tokenizer with a 32,000-token byte-level BPE trained on the .py files
    of this interpreter's standard library (the first 400 by path, tests left out; a few
    seconds), its special tokens at the ids the tiny model's config names."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [str(f) for f in sorted(stdlib.rglob("*.py")) if "test" not in str(f)][:400]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=32_000,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train(files, trainer)
    tokenizer.save(str(model / "tokenizer.json"))
    return tokenizer


def write_model(directory: Path, kind: str) -> tuple[Path, str]:
    """The tiny model in ``directory`` with the ``kind`` tokenizer, and a text of about
    ``PROMPT_TOKENS`` tokens for it (random words for ``bytes``, standard-library source for
    ``bpe32k``)."""
    model = directory / kind
    subprocess.run(
        [sys.executable, str(TOOLS / "tiny_model.py"), str(model)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    config_path = model / "config.json"
    config = json.loads(config_path.read_text())
    config["max_position_embeddings"] = 2 * PROMPT_TOKENS  # room for an 8k prompt
    tokenizer_config_path = model / "tokenizer_config.json"
    tokenizer_config = json.loads(tokenizer_config_path.read_text())
    tokenizer_config["model_max_length"] = 2 * PROMPT_TOKENS
    tokenizer_config_path.write_text(json.dumps(tokenizer_config))
    if kind == "bytes":
        rng = random.Random(8192)
        words = (
            "".join(rng.choices(string.ascii_lowercase, k=rng.randrange(2, 9))) for _ in range(3000)
        )
        text = " ".join(words)[:PROMPT_TOKENS]
    else:
        bpe = train_bpe(model)
        config["vocab_size"] = bpe.get_vocab_size()
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        source = "".join(path.read_text() for path in (stdlib / "email").glob("*.py"))
        text = bpe.decode(bpe.encode(source).ids[:PROMPT_TOKENS])
    config_path.write_text(json.dumps(config))
    return model, text


def tokenizer_bodies(model: str, text: str) -> dict[str, dict[str, Any]]:
    """A text completion of ``text``, and a chat request with a short system message and
    ``text`` as the user's (the tiny model's chat template adds a few tokens)."""
    return {
        "completion": {"model": model, "prompt": text},
        "chat": {
            "model": model,
            "messages": [
                {"role": "system", "content": "You answer briefly."},
                {"role": "user", "content": text},
            ],
        },
    }


def measure_tokenizer(
    iterations: int, warmup: int
) -> dict[tuple[str, str], tuple[int, float, float]]:
    """``{(tokenizer, request): (token count, p50 s, p99 s)}`` of ``VllmTokenizer.submit``
    awaited from a loop, as DynamoLLMRouter awaits it."""
    from kvbridge.ray_integration.tokenize import VllmTokenizer

    out = {}
    with tempfile.TemporaryDirectory() as directory:
        for kind in TOKENIZERS:
            model, text = write_model(Path(directory), kind)
            tokenizer = VllmTokenizer.from_engine_args(
                model=str(model),
                load_format="dummy",
                dtype="bfloat16",
                enforce_eager=True,
                block_size=BLOCK_SIZE,
                max_model_len=2 * PROMPT_TOKENS,
            )
            try:
                tokenizer.wait_loaded(300)

                async def timed(
                    body: dict[str, Any], tokenizer: VllmTokenizer = tokenizer
                ) -> tuple[int, list[float]]:
                    times = []
                    count = 0
                    for index in range(warmup + iterations):
                        started = time.perf_counter()
                        tokens = await asyncio.wrap_future(tokenizer.submit(body))
                        elapsed = time.perf_counter() - started
                        assert tokens is not None
                        count = len(tokens)
                        if index >= warmup:
                            times.append(elapsed)
                    return count, times

                for request, body in tokenizer_bodies(str(model), text).items():
                    count, times = asyncio.run(timed(body))
                    out[kind, request] = (count, percentile(times, 50), percentile(times, 99))
            finally:
                tokenizer.close()
    return out


# -- report ------------------------------------------------------------------------------------


def us(seconds: float) -> str:
    return f"{seconds * 1e6:,.0f} us"


def report(row: Row) -> None:
    print(
        f"\n{row.replicas} replicas, {row.engines} with an engine "
        f"(Dynamo indexed their prompts {row.indexed_s:.2f} s after they were served)"
    )
    raw = row.p99["raw"]
    for name, label in LABELS.items():
        if name not in row.p50:
            continue
        line = f"  {label:<23} p50 {us(row.p50[name]):>10}   p99 {us(row.p99[name]):>10}"
        if name in ("dynamo", "llm"):
            ratio = row.p99[name] / raw
            verdict = "met" if ratio <= TARGET else "MISSED"
            line += f"   p99 / raw {ratio:.2f} ({verdict}: <= {TARGET})"
        print(line)
    for name, tally in row.tallies.items():
        mean = tally.overlap_blocks / tally.with_overlap if tally.with_overlap else 0.0
        extra = ""
        if name in row.fallbacks:
            extra = f"; fallbacks {row.fallbacks[name]}, reservations left {row.reservations[name]}"
        print(
            f"  {LABELS[name]}: decisions with overlap {tally.with_overlap}/{tally.decisions} "
            f"(mean {mean:.0f} blocks); repeats on their prompt's replica with the whole shared "
            f"prefix {tally.found}/{tally.expected}{extra}"
        )


def summary(rows: list[Row]) -> None:
    names = [name for name in LABELS if name in rows[0].p50]
    print("\ndecision latency, p50 / p99 in us; p99 against the raw call's")
    header = f"{'replicas':>8}" + "".join(f" {LABELS[n].split()[0]:>18}" for n in names)
    header += "".join(f" {n + '/raw':>10}" for n in names if n in ("dynamo", "llm"))
    print(header)
    print("-" * len(header))
    for row in rows:
        line = f"{row.replicas:>8}"
        for name in names:
            line += f" {row.p50[name] * 1e6:>8,.0f} / {row.p99[name] * 1e6:>7,.0f}"
        for name in names:
            if name in ("dynamo", "llm"):
                line += f" {row.p99[name] / row.p99['raw']:>10.2f}"
        print(line)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=positive_int, nargs="+", default=[4, 16, 64])
    parser.add_argument(
        "--iterations", type=positive_int, default=500, help="timed decisions per path"
    )
    parser.add_argument(
        "--warmup", type=non_negative_int, default=50, help="untimed decisions per path"
    )
    parser.add_argument("--seed", type=int, default=20_240_601)
    parser.add_argument(
        "--tokenize-iterations",
        type=positive_int,
        default=200,
        help="timed tokenizations per request",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="cProfile DynamoKVRouter's timed decisions at the last replica count and stop",
    )
    args = parser.parse_args(argv)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    with_llm = serve_llm_importable()

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
        "per path, in rotating order"
    )
    if not with_llm:
        print(
            "vLLM is not importable here: no DynamoLLMRouter and no tokenization row "
            "(run with the python of tools/serve_llm/setup.sh for them)"
        )
    started = time.perf_counter()
    if args.profile:
        profiler = cProfile.Profile()
        with ray_session() as node_id:
            report(asyncio.run(run(args.replicas[-1], node_id, args, with_llm, profiler)))
        print("\ncProfile of DynamoKVRouter's timed decisions (main thread; timings inflated)")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
        return 0

    rows = []
    with ray_session() as node_id:
        for count in args.replicas:
            rows.append(asyncio.run(run(count, node_id, args, with_llm)))
            report(rows[-1])
    summary(rows)
    if with_llm:
        print(
            f"\nVllmTokenizer (DynamoLLMRouter's), text to token ids, {args.tokenize_iterations} "
            "timed calls per request after 20 warm-up; the tiny model with the tokenizers"
        )
        for kind, about in TOKENIZERS.items():
            print(f"  {kind}: {about}")
        measured = measure_tokenizer(args.tokenize_iterations, 20)
        for (kind, request), (count, p50, p99) in measured.items():
            print(
                f"  {kind:<7} {request:<10} {count:>6,} tokens   p50 {us(p50):>10}   "
                f"p99 {us(p99):>10}"
            )
    print(f"total {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
