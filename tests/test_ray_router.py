"""DynamoKVRouter in a real local Ray Serve: session affinity, replica death, the CPU tier and
the fallback.

Three replicas run a SimulatedEngine each (GPU pool of 48 blocks, CPU tier of 2,048, block size
16) behind their own relay; the router's real Dynamo SelectionService subscribes to the relays.
The workload is 30 sessions of 4 turns: each session starts with its own 80-160 token prompt, and
every turn appends the previous answer and 24-56 new tokens. A turn waits for the previous turn
of its session; sessions run three at a time.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from ray.serve.config import RequestRouterConfig  # noqa: E402
from support import ray_apps  # noqa: E402
from support.ray_apps import (  # noqa: E402
    Session,
    SimulatedReplica,
    ray_session,
    replica_ids,
    sessions,
    wait_until,
)

from kvbridge.ray_integration import (  # noqa: E402
    DynamoKVRouter,
    RoutingState,
    worker_id_for,
)
from kvbridge.ray_integration.decisions import Release  # noqa: E402
from kvbridge.ray_integration.routing_states import close_routing_states  # noqa: E402
from kvbridge.schemas import Overlap  # noqa: E402

BLOCK_SIZE = 16
GPU_BLOCKS = 128  # room for about 3 sessions per replica: the rest goes to CPU
CPU_BLOCKS = 2048
SESSIONS = 30
TURNS = 4
MAX_TOKENS = 8
CONCURRENCY = 1
APP = "kv"
DEPLOYMENT = "Engine"


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    with ray_session():
        yield
    close_routing_states()


def deploy(
    router: type | None,
    *,
    app: str = APP,
    select_timeout_s: float = 1.0,
    num_replicas: int = 3,
    token_shift: int = 0,
    health_check_period_s: float | None = None,
    tokenizer: str | None = None,
    max_ongoing_requests: int = 8,
    hold_s: float = 0.0,
    silent_ranks: tuple[int, ...] = (),
) -> Any:
    """Run the app: ``router=None`` keeps Serve's default (power of two choices). Serve keeps
    one router per deployment per process, so each router needs an app name of its own."""
    options: dict[str, Any] = {
        "name": DEPLOYMENT,
        "num_replicas": num_replicas,
        "ray_actor_options": {"num_cpus": 0},
        "max_ongoing_requests": max_ongoing_requests,
    }
    if health_check_period_s is not None:
        options["health_check_period_s"] = health_check_period_s
    if router is not None:
        router_kwargs: dict[str, Any] = {
            "block_size": BLOCK_SIZE,
            "select_timeout_s": select_timeout_s,
        }
        if tokenizer is not None:
            router_kwargs["tokenizer"] = tokenizer
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=router,
            request_router_kwargs=router_kwargs,
            request_routing_stats_period_s=0.5,
        )
    bound = serve.deployment(**options)(SimulatedReplica).bind(
        block_size=BLOCK_SIZE,
        num_blocks=GPU_BLOCKS,
        cpu_blocks=CPU_BLOCKS,
        token_shift=token_shift,
        hold_s=hold_s,
        silent_ranks=silent_ranks,
    )
    return serve.run(bound, name=app, route_prefix=None)


def routing_state(app: str = APP) -> RoutingState:
    return ray_apps.routing_state(app, DEPLOYMENT)


def wait_registered(handle: Any, replicas: set[str], app: str = APP) -> RoutingState:
    return ray_apps.wait_registered(handle, replicas, app, DEPLOYMENT)


def run_turn(handle: Any, session: Session) -> None:
    if session.answers:  # a follow-up: the previous answer and a new user message
        session.tokens = session.tokens + session.answers[-1]["output"]
        session.tokens += [
            session.rng.randrange(1, 30_000) for _ in range(session.rng.randrange(24, 57))
        ]
    answer = handle.remote(prompt_token_ids=session.tokens, max_tokens=MAX_TOKENS).result()
    session.answers.append(answer)
    session.replicas.append(answer["replica"])


def run_workload(
    handle: Any, work: list[Session], turns: range, between: Callable[[int], None] | None = None
) -> None:
    with ThreadPoolExecutor(max_workers=CONCURRENCY) as pool:
        for turn in turns:
            list(pool.map(lambda s: run_turn(handle, s), work))
            if between is not None:
                between(turn)


def affinity(work: list[Session]) -> tuple[int, int]:
    """(follow-ups on the replica that served the session's previous turn, follow-ups)."""
    stayed = sum(
        s.replicas[turn] == s.replicas[turn - 1] for s in work for turn in range(1, len(s.replicas))
    )
    return stayed, sum(len(s.replicas) - 1 for s in work)


@dataclass
class AffinityRun:
    sessions: list[Session]
    pow2_sessions: list[Session]
    decisions: list[Any]
    """The router's decisions for the workload, in request order (turn by turn)."""
    state: RoutingState


@pytest.fixture(scope="module")
def affinity_run(ray_cluster: None) -> Iterator[AffinityRun]:
    """The workload through power of two choices, then through DynamoKVRouter."""
    handle = deploy(None, app="pow2")
    pow2 = sessions(seed=7)
    run_workload(handle, pow2, range(TURNS))
    serve.delete("pow2")

    handle = deploy(DynamoKVRouter)
    state = wait_registered(handle, replica_ids(handle, 3))
    first = len(state.stats.decisions)
    work = sessions(seed=7)
    run_workload(handle, work, range(TURNS))
    decisions = list(state.stats.decisions)[first:]
    yield AffinityRun(work, pow2, decisions, state)
    serve.delete(APP)


def test_session_affinity_against_power_of_two(affinity_run: AffinityRun) -> None:
    work, state = affinity_run.sessions, affinity_run.state
    stayed, follow_ups = affinity(work)
    pow2_stayed, _ = affinity(affinity_run.pow2_sessions)
    print(
        f"\nfollow-up turns on the replica holding the session's prefix: DynamoKVRouter "
        f"{stayed}/{follow_ups} = {stayed / follow_ups:.1%}, power of two choices "
        f"{pow2_stayed}/{follow_ups} = {pow2_stayed / follow_ups:.1%}"
    )
    assert follow_ups == SESSIONS * (TURNS - 1)
    assert stayed / follow_ups >= 0.95
    # Every follow-up that stayed found its history cached, on the GPU or in the CPU tier.
    for session in work:
        for turn in range(1, TURNS):
            if session.replicas[turn] == session.replicas[turn - 1]:
                answer = session.answers[turn]
                assert answer["gpu_hit"] + answer["cpu_hit"] > 0, (session.replicas, answer)
    decisions = affinity_run.decisions
    assert len(decisions) == SESSIONS * TURNS
    assert all(d.fallback is None for d in decisions)
    assert [d.replica_id for d in decisions] == [
        s.replicas[turn] for turn in range(TURNS) for s in work
    ]
    wait_until(lambda: state.client.active_reservations() == 0, what="reservations freed")
    assert state.reservations == 0
    # Every completed request's prompt is in Dynamo's index for its replica, from the engine's
    # own token ids: the router tokenized (here: passed on) what the engine ran.
    checks = state.stats.token_checks
    wait_until(lambda: sum(checks.values()) == SESSIONS * TURNS, what="token checks")
    assert checks == Counter(confirmed=SESSIONS * TURNS)


def test_a_tokenizer_mismatch_is_counted(ray_cluster: None) -> None:
    """Engines that run other token ids than the router hashed (a test double: each shifts
    every prompt token by one) store blocks the router's prompts never match: every decision
    finds zero hits, and the router's token check says why, request by request."""
    handle = deploy(DynamoKVRouter, app="shifted", token_shift=1)
    state = wait_registered(handle, replica_ids(handle, 3), app="shifted")
    prompt = list(range(1000, 1000 + 3 * BLOCK_SIZE + 5))
    for _ in range(3):
        handle.remote(prompt_token_ids=prompt, max_tokens=2).result()
    checks = state.stats.token_checks
    wait_until(lambda: sum(checks.values()) == 3, what="token checks")
    assert checks == Counter(unconfirmed=3)
    decisions = list(state.stats.decisions)[-3:]
    assert [d.overlap for d in decisions] == [Overlap(0, 0, 0)] * 3
    serve.delete("shifted")


def test_a_tokenizer_hook_that_fails_routes_the_request_without_dynamo(
    ray_cluster: None,
) -> None:
    """The ``tokenizer`` hook is the user's code. One that raises on a body (here: chat
    ``messages`` that are not a list) costs that request Dynamo's pick, counted and logged,
    not its answer: it is routed by Serve's power of two choices. A body the hook reads is
    routed by Dynamo."""
    handle = deploy(
        DynamoKVRouter, app="hook", num_replicas=1, tokenizer="support.tokenizers:bytes_tokenizer"
    )
    state = wait_registered(handle, replica_ids(handle, 1), app="hook")
    fallbacks = Counter(state.stats.fallbacks)  # replica_ids' requests carry no tokens
    bodies = (
        {"messages": 5},
        {"prompt": "a text prompt of two blocks or more"},
        {"messages": None},
    )
    answers = [handle.remote(body).result(timeout_s=30) for body in bodies]
    assert [sorted(answer) for answer in answers] == [["actor", "replica"]] * 3
    assert state.stats.registry.tokenize_failed == 1
    assert state.stats.fallbacks - fallbacks == Counter(no_tokens=2)
    decisions = list(state.stats.decisions)[-3:]
    assert [decision.fallback for decision in decisions] == ["no_tokens", None, "no_tokens"]
    serve.delete("hook")


def test_a_request_given_up_before_it_is_placed_frees_its_reservation(
    ray_cluster: None,
) -> None:
    """The only replica is busy (one request at a time), so the next request, reserved by
    Dynamo's pick, waits for it; its caller gives it up. Serve then reports neither a placement
    nor a completion, and the reservation would price the replica as loaded for its hour to
    live: it is freed at once, counted ``cancelled``, and the busy request's stays."""
    handle = deploy(
        DynamoKVRouter, app="given-up", num_replicas=1, max_ongoing_requests=1, hold_s=3.0
    )
    state = wait_registered(handle, replica_ids(handle, 1), app="given-up")
    releases = Counter(state.stats.registry.releases)
    busy = handle.remote(prompt_token_ids=list(range(1, 65)), max_tokens=1)
    wait_until(lambda: state.reservations == 1, what="the busy request's reservation")
    waiting = handle.remote(prompt_token_ids=list(range(100, 164)), max_tokens=1)
    wait_until(lambda: state.reservations == 2, what="the waiting request's reservation")
    waiting.cancel()
    wait_until(lambda: state.reservations == 1, timeout=5.0, what="the given-up one freed")
    # A free is counted when Dynamo has applied it, a moment after the reservation is let go.
    cancelled = Counter({Release.CANCELLED: 1})
    wait_until(lambda: state.stats.registry.releases - releases == cancelled, what="counted")
    busy.result()
    wait_until(lambda: state.client.active_reservations() == 0, what="reservations freed")
    assert state.reservations == 0
    both = Counter({Release.CANCELLED: 1, Release.FREED: 1})
    wait_until(lambda: state.stats.registry.releases - releases == both, what="both counted")
    serve.delete("given-up")


def test_a_replica_dynamo_has_not_registered_is_the_last_resort(ray_cluster: None) -> None:
    """Two replicas taking one request at a time, of which Dynamo has registered one (the
    other advertises nothing). While the registered one is busy, the next request goes to the
    other, ranked after every registered replica, rather than waiting for the busy one. Its
    reservation, on Dynamo's pick, is freed when Serve places it there, counted
    ``unregistered``: Dynamo cannot book its load on a replica it does not know."""
    app = "unregistered"
    handle = deploy(
        DynamoKVRouter,
        app=app,
        num_replicas=2,
        max_ongoing_requests=1,
        hold_s=3.0,
        silent_ranks=(1,),
    )
    replicas = sorted(replica_ids(handle, 2))
    state = routing_state(app)
    wait_until(
        lambda: handle.remote().result() is not None and len(state.ready_workers(replicas)) == 1,
        what="one replica registered",
    )
    (registered,) = state.ready_workers(replicas).values()
    (unregistered,) = set(replicas) - {registered}
    releases = Counter(state.stats.registry.releases)
    busy = handle.remote(prompt_token_ids=list(range(1, 65)), max_tokens=1)
    wait_until(lambda: state.reservations == 1, what="the busy request's reservation")
    other = handle.remote(prompt_token_ids=list(range(100, 164)), max_tokens=1)
    assert other.result()["replica"] == unregistered
    assert busy.result()["replica"] == registered
    both = Counter({Release.UNREGISTERED: 1, Release.FREED: 1})
    wait_until(lambda: state.stats.registry.releases - releases == both, what="both counted")
    assert state.client.active_reservations() == 0
    serve.delete(app)


def test_cpu_tier_prefix_routes_back_to_its_replica(affinity_run: AffinityRun) -> None:
    """The GPU pool holds three sessions' worth of blocks, so by a session's next turn its
    history has been evicted to the CPU tier: Dynamo sees it as host_pinned overlap only, and
    still sends the session back."""
    work, decisions = affinity_run.sessions, affinity_run.decisions
    from_cpu = []
    for index, decision in enumerate(decisions):
        turn, session = divmod(index, SESSIONS)
        answer = work[session].answers[turn]
        if turn and answer["gpu_hit"] == 0 and answer["cpu_hit"] > 0:
            from_cpu.append((decision, work[session], turn, answer))
    assert len(from_cpu) >= 10, f"only {len(from_cpu)} follow-ups found their prefix on CPU"
    for decision, session, turn, answer in from_cpu:
        assert session.replicas[turn] == session.replicas[turn - 1]
        # Dynamo's view may trail the engine by the last request's evictions (a few ms), so a
        # block the engine has just evicted can still count as on the device.
        assert decision.overlap.device < decision.overlap.host_pinned
        # The engine loads whole blocks from CPU; Dynamo saw at least those on host_pinned.
        assert decision.overlap.host_pinned >= answer["cpu_hit"] // BLOCK_SIZE > 0
    stats = affinity_run.state.stats.overlap_blocks
    print(f"\n{len(from_cpu)} follow-ups served from the CPU tier; overlap blocks: {dict(stats)}")
    assert stats["host_pinned"] == sum(d.overlap.host_pinned for d in decisions)
    assert stats["device"] == sum(d.overlap.device for d in decisions)
    assert stats["host_pinned"] > stats["device"]


def test_replica_death_moves_its_sessions(ray_cluster: None) -> None:
    """A replica is killed between turns 2 and 3: its sessions go to the others and stay there,
    the others' sessions stay where they were, every request succeeds, and Dynamo no longer
    lists the dead worker."""
    handle = deploy(DynamoKVRouter, app="death")
    replicas = replica_ids(handle, 3)
    state = wait_registered(handle, replicas, app="death")
    work = sessions(seed=11)[:12]
    run_workload(handle, work, range(2))
    by_replica = {r: [s for s in work if s.replicas[-1] == r] for r in replicas}
    victim = max(by_replica, key=lambda r: len(by_replica[r]))
    moved = by_replica[victim]
    assert moved, "no session on any replica"
    ray.kill(ray.get_actor(moved[0].answers[-1]["actor"], namespace="serve"), no_restart=True)
    dead = worker_id_for(victim)

    def dead_gone() -> bool:
        return all(int(w["worker_id"]) != dead for w in state.client.service.list_workers())

    run_workload(handle, work, range(2, TURNS))  # raises if any request fails
    wait_until(dead_gone, what="the dead worker deregistered")
    assert all(len(s.answers) == TURNS for s in work)
    for session in moved:
        assert victim not in session.replicas[2:], session.replicas
    kept = [s for s in work if s not in moved]
    stayed = sum(s.replicas[2] == s.replicas[1] for s in kept)
    restuck = sum(s.replicas[3] == s.replicas[2] for s in moved)
    assert (restuck, stayed) == (len(moved), len(kept)), [s.replicas for s in work]
    print(
        f"\n{len(moved)} sessions moved off the killed replica {victim}, {restuck} stayed on "
        f"their new replica for the next turn; {stayed}/{len(kept)} others kept their replica; "
        f"registry counters {state.stats.registry}"
    )
    assert state.stats.registry.deregistered >= 1
    wait_until(lambda: state.client.active_reservations() == 0, what="reservations freed")
    serve.delete("death")


def test_a_replica_whose_relay_stopped_is_replaced(ray_cluster: None) -> None:
    """A fault injected into a replica's relay (a test double of a bug: its step raises) ends
    the relay's thread. The replica's ``check_health`` then fails with the relay's error, Serve
    replaces the replica, and Dynamo drops the stale worker and registers the new one."""
    handle = deploy(DynamoKVRouter, app="health", num_replicas=1, health_check_period_s=2.0)
    (first,) = replica_ids(handle, 1)
    state = wait_registered(handle, {first}, app="health")
    handle.inject_relay_fault.remote().result()

    failures: list[str] = []

    def unhealthy() -> bool:
        try:
            handle.check_health.remote().result(timeout_s=10)
        except Exception as error:  # the replica's RuntimeError, as Serve raises it here
            failures.append(str(error))
            return "relay stopped" in failures[-1]
        return False

    wait_until(unhealthy, timeout=10, what="the health check failing")
    assert "the KV-event relay stopped: RuntimeError('injected fault')" in failures[-1]

    errors: list[Exception] = []

    def replaced() -> bool:
        try:
            return bool(handle.remote().result(timeout_s=10)["replica"] != first)
        except Exception as error:  # a request that meets the replica Serve is stopping
            errors.append(error)
            return False

    try:
        wait_until(replaced, timeout=90, what="the replica replaced")
    except AssertionError as timeout:
        raise AssertionError(f"{timeout}; the last error: {errors[-1:]!r}") from None
    (second,) = replica_ids(handle, 1)
    wait_registered(handle, {second}, app="health")
    stale = worker_id_for(first)
    wait_until(
        lambda: all(int(w["worker_id"]) != stale for w in state.client.service.list_workers()),
        what="the stale worker deregistered",
    )
    answer = handle.remote(prompt_token_ids=[7] * 40, max_tokens=2).result()
    assert answer["replica"] == second and len(answer["output"]) == 2
    serve.delete("health")


def test_fallback_without_tokens_or_answer(ray_cluster: None) -> None:
    """Requests without tokens, and requests whose selection outlives its timeout, complete
    through power of two choices; each fallback is counted by reason, and the reservations
    Dynamo makes late are freed. The router awaits Dynamo's answer on its own loop, so the
    late answers are Dynamo's own: the timeout is shrunk to 1 us, which no selection meets."""
    handle = deploy(DynamoKVRouter, app="fallback", select_timeout_s=0.3)
    replicas = replica_ids(handle, 3)
    state = wait_registered(handle, replicas, app="fallback")
    before = state.stats.fallbacks.copy()

    answers = [handle.remote().result() for _ in range(5)]
    assert {a["replica"] for a in answers} <= replicas
    assert state.stats.fallbacks["no_tokens"] - before["no_tokens"] == 5

    prompts = [[1000 + i] * 40 for i in range(4)]
    state.select_timeout_s = 1e-6
    try:
        answers = [handle.remote(prompt_token_ids=p, max_tokens=2).result() for p in prompts]
    finally:
        state.select_timeout_s = 0.3
    assert all(len(a["output"]) == 2 for a in answers)
    assert state.stats.fallbacks["timeout"] - before["timeout"] == 4
    assert state.stats.outcomes["fallback"] == sum(state.stats.fallbacks.values())
    wait_until(
        lambda: state.stats.registry.releases[Release.LATE_FREED] == 4,
        what="late reservations freed",
    )
    assert state.client.active_reservations() == 0

    # Once Dynamo has time to answer again, requests go through Dynamo.
    dynamo_before = state.stats.outcomes["dynamo"]
    handle.remote(prompt_token_ids=prompts[0], max_tokens=2).result()
    assert state.stats.outcomes["dynamo"] == dynamo_before + 1
    wait_until(lambda: state.client.active_reservations() == 0, what="reservations freed")
    serve.delete("fallback")


def test_data_parallel_ranks(ray_cluster: None) -> None:
    """Two replicas with two dp ranks each: Dynamo scores every (replica, rank), the router passes
    the picked rank to the replica (``dp_rank_kwarg``), and each session's follow-ups return to
    the rank of the same replica that holds its history."""
    bound = serve.deployment(
        name=DEPLOYMENT,
        num_replicas=2,
        ray_actor_options={"num_cpus": 0},
        request_router_config=RequestRouterConfig(
            request_router_class=DynamoKVRouter,
            request_router_kwargs={"block_size": BLOCK_SIZE, "dp_rank_kwarg": "data_parallel_rank"},
            request_routing_stats_period_s=0.5,
        ),
    )(SimulatedReplica).bind(
        block_size=BLOCK_SIZE, num_blocks=GPU_BLOCKS, cpu_blocks=CPU_BLOCKS, dp_size=2
    )
    handle = serve.run(bound, name="dp", route_prefix=None)
    replicas = replica_ids(handle, 2)
    state = wait_registered(handle, replicas, app="dp")
    records = {int(w["worker_id"]): w for w in state.client.service.list_workers()}
    for replica in replicas:
        assert sorted(records[worker_id_for(replica)]["kv_events_endpoints"]) == [0, 1]
    first = len(state.stats.decisions)
    work = sessions(seed=5)[:16]
    run_workload(handle, work, range(3))
    decisions = list(state.stats.decisions)[first:]
    placed = [
        (s.answers[turn]["replica"], s.answers[turn]["dp_rank"]) for turn in range(3) for s in work
    ]
    assert [(d.replica_id, d.dp_rank) for d in decisions] == placed
    # Dynamo scores every (replica, rank). A first turn, with no cache and nothing in flight,
    # goes where Dynamo breaks the tie: 16 of them left one of the four unused in one run
    # (4 * (3/4)**16, about 1 in 25, if ties fall at random), so only both ranks are asserted
    # to be picked (and passed to the replica).
    scored = state.client.call_sync(
        "overlap_scores", {"token_ids": work[0].tokens, "model_name": state.model_name}
    )["workers"]
    assert sorted((int(w["worker_id"]), int(w["dp_rank"])) for w in scored) == sorted(
        (worker_id_for(replica), rank) for replica in replicas for rank in (0, 1)
    )
    assert {rank for _, rank in placed[: len(work)]} == {0, 1}
    for session in work:
        pairs = [(a["replica"], a["dp_rank"]) for a in session.answers]
        assert pairs == [pairs[0]] * 3, pairs
        assert all(a["gpu_hit"] + a["cpu_hit"] > 0 for a in session.answers[1:])
    print(f"\nsessions per (replica, dp rank): {Counter(placed[: len(work)])}")
    wait_until(lambda: state.client.active_reservations() == 0, what="reservations freed")
    serve.delete("dp")
