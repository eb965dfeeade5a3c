"""Two router processes in front of one deployment, as Serve has one in each process holding a
handle (each ingress replica): each DynamoKVRouter has its own Dynamo ``SelectionService``, fed by
the same relays, so they share the cache view but not the load view (each sees only its own
reservations).

Three replicas run a SimulatedEngine each (GPU pool of 128 blocks, CPU tier, block size 16).
The workload: 30 multi-turn sessions of 4 turns, three sessions at a time, each request held
0.1 s by its replica so that the three are in flight together; turn ``t`` of session ``s`` goes
through router process ``(s + t) % 2``, so every session alternates between the two.
The same workload through one router process is the reference. Measured: session affinity (a
follow-up on the replica that served the session's previous turn), and the load as new
sessions per replica.

Dynamo's replica sync (``replica_sync_port``/``replica_sync_peers``) is not used: the figures
below show the two processes route as one does. README.md, "Several router processes", gives
the bound.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from ray.serve.config import RequestRouterConfig  # noqa: E402
from support.ray_apps import (  # noqa: E402
    RouterProcess,
    Session,
    SimulatedReplica,
    ray_session,
    replica_ids,
    sessions,
    wait_until,
)

from kvbridge.ray_integration import DynamoKVRouter  # noqa: E402
from kvbridge.ray_integration.routing_states import close_routing_states  # noqa: E402

BLOCK_SIZE = 16
GPU_BLOCKS = 128
CPU_BLOCKS = 2048
SESSIONS = 30
TURNS = 4
CONCURRENCY = 3
DEPLOYMENT = "Engine"
AFFINITY_BOUND = 0.5
"""A follow-up stays on its replica unless that replica is busier by more than its cached
prefix saves, which with three sessions in flight happens, the more often the more of the three
a process sees: in eleven runs affinity was 58.9-97.8% through one process (58.9% in a CI run
under the load of the whole suite, 74.4% and 76.7% with a busy loop on one of the two cores)
and 91.1-100% through two; a hold of 0.3 s instead of 0.1 did not narrow it (63.3-84.4% through
one process in four runs). A router blind to the cache keeps a third of them (one replica in
three)."""
AFFINITY_SLACK = 0.1
"""Two processes keep sessions as one does: their affinity is at most this below one
process's, or below ``AFFINITY_TWO_FLOOR`` when one process's was higher (in the eleven runs,
never more than 0.011 below; in a later CI run 87.8% through two where one process's run
happened to keep every session, 100%)."""
AFFINITY_TWO_FLOOR = 0.9
"""What two processes are held to at the most: one process's affinity above it is luck of the
draw (58.9-100% over the runs above), not a level two processes must match."""
LOAD_BOUND = 1.8
"""New sessions per replica stay under this times the mean (18 of 30 on 3 replicas); measured
10/10/10 or 9/10/11 through one process, and 6/11/13 to 9/10/11 through two."""
HOLD_S = 0.1
"""How long each request takes at least. A session's first turn matches no cache, so only the
load view tells the replicas apart: with requests that end at once, a first turn often arrives
when no other request is in flight, the replicas tie, and Dynamo (at temperature 0) gives a
tie to the same replica every time (8/17/5 in one run). Held, the other two requests of the
three sent together are in flight when it is decided."""


@dataclass
class Run:
    sessions: list[Session]
    stats: list[dict[str, Any]]

    @property
    def affinity(self) -> float:
        stayed = sum(
            s.replicas[t] == s.replicas[t - 1] for s in self.sessions for t in range(1, TURNS)
        )
        return stayed / (SESSIONS * (TURNS - 1))

    @property
    def new_sessions(self) -> Counter[str]:
        return Counter(s.replicas[0] for s in self.sessions)


def run(app: str, processes: int, seed: int) -> Run:
    """The workload through ``processes`` router processes, on a new app of 3 replicas."""
    bound = serve.deployment(
        name=DEPLOYMENT,
        num_replicas=3,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=8,
        request_router_config=RequestRouterConfig(
            request_router_class=DynamoKVRouter,
            request_router_kwargs={"block_size": BLOCK_SIZE},
            request_routing_stats_period_s=0.5,
        ),
    )(SimulatedReplica).bind(
        block_size=BLOCK_SIZE, num_blocks=GPU_BLOCKS, cpu_blocks=CPU_BLOCKS, hold_s=HOLD_S
    )
    handle = serve.run(bound, name=app, route_prefix=None)
    replicas = sorted(replica_ids(handle, 3))
    routers = [RouterProcess.remote(app, DEPLOYMENT) for _ in range(processes)]
    ray.get([router.wait_registered.remote(replicas) for router in routers])
    before = ray.get([router.stats.remote() for router in routers])  # registration's requests
    work = sessions(seed, SESSIONS)

    def turn(index: int, session: Session, number: int) -> None:
        if number:
            session.tokens += [session.rng.randrange(1, 30_000) for _ in range(40)]
        router = routers[(index + number) % processes]
        answer = ray.get(router.call.remote(prompt_token_ids=session.tokens, max_tokens=8))
        session.tokens += answer["output"]
        session.replicas.append(answer["replica"])

    with ThreadPoolExecutor(max_workers=CONCURRENCY) as pool:
        for number in range(TURNS):
            list(pool.map(turn, range(SESSIONS), work, [number] * SESSIONS))
    stats = [
        {
            key: dict(Counter(after[key]) - Counter(earlier[key]))
            for key in ("outcomes", "fallbacks")
        }
        for earlier, after in zip(before, ray.get([r.stats.remote() for r in routers]), strict=True)
    ]
    for router in routers:
        wait_until(
            lambda r=router: ray.get(r.stats.remote())["active_reservations"] == 0,
            what="reservations freed",
        )
        ray.kill(router)
    serve.delete(app)
    return Run(work, stats)


@pytest.fixture(scope="module")
def runs() -> Iterator[tuple[Run, Run]]:
    with ray_session():
        yield run("one", 1, seed=11), run("two", 2, seed=11)
    close_routing_states()


def test_two_router_processes_keep_sessions_and_load_as_one(runs: tuple[Run, Run]) -> None:
    one, two = runs
    for name, result in (("1 router process", one), ("2 router processes", two)):
        print(
            f"\n{name}: affinity {result.affinity:.1%}, new sessions per replica "
            f"{sorted(result.new_sessions.values())}, outcomes "
            f"{[s['outcomes'] for s in result.stats]}"
        )
    decided = [sum(s["outcomes"].get("dynamo", 0) for s in r.stats) for r in runs]
    assert decided == [SESSIONS * TURNS] * 2, "every request decided by Dynamo"
    assert all(s["fallbacks"] == {} for r in runs for s in r.stats)
    # With two processes, each took half of every session's turns.
    assert [s["outcomes"]["dynamo"] for s in two.stats] == [SESSIONS * TURNS // 2] * 2
    assert two.affinity >= min(one.affinity, AFFINITY_TWO_FLOOR) - AFFINITY_SLACK
    for result in runs:
        assert result.affinity >= AFFINITY_BOUND
        assert len(result.new_sessions) == 3
        assert max(result.new_sessions.values()) <= LOAD_BOUND * SESSIONS / 3
