#!/usr/bin/env python3
"""A router's prompt hashing: the native core against the same hashing written in Python.

Every decision of kvbridge's Serve routers sends Dynamo the prompt in its precomputed form
(``selection_forms.precomputed_prompt``): each full block's ``tokens_hash`` and rolling sequence
hash, as signed i64. Measured in one run, alternating, on the same prompts (token ids packed in
an ``array("I")``, as ``prompt_tokens`` gives them):

- **baseline**: the hashing in Python, as the routers did it before the core took it over:
  ``xxhash.xxh3_64_intdigest`` of each block's bytes, then of each (parent, hash) pair, then
  both lists turned into i64 through ``array``;
- **core**: ``precomputed_prompt``, one call to ``kvbridge._core.prompt_hashes``.

Both give the same dicts (checked before timing). Printed: microseconds per prompt, best and
median of the repetitions, and baseline/core, the speed-up. Needs the dev extra (``xxhash``).
"""

from __future__ import annotations

import argparse
import random
import statistics
import struct
import time
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import xxhash

from kvbridge.cli import arguments
from kvbridge.normalizers.hashing import DYNAMO_SEED
from kvbridge.ray_integration.selection_forms import precomputed_prompt

_xxh3 = xxhash.xxh3_64_intdigest
_pair = struct.Struct("<QQ").pack


def python_prompt(tokens: array[int], block_size: int, model_name: str) -> dict[str, Any]:
    """The precomputed form hashed in Python (no LoRA name: Dynamo's seed alone)."""
    packed = memoryview(tokens).cast("B")
    width = block_size * 4
    count = len(tokens) // block_size
    blocks = [
        _xxh3(packed[start : start + width], DYNAMO_SEED)
        for start in range(0, count * width, width)
    ]
    sequence: list[int] = []
    parent: int | None = None
    for value in blocks:
        parent = value if parent is None else _xxh3(_pair(parent, value), DYNAMO_SEED)
        sequence.append(parent)
    return {
        "block_hashes": _as_i64(blocks),
        "sequence_hashes": _as_i64(sequence),
        "isl_tokens": len(tokens),
        "model_name": model_name,
    }


def _as_i64(values: list[int]) -> list[int]:
    return array("q", array("Q", values).tobytes()).tolist()


def core_prompt(tokens: array[int], block_size: int, model_name: str) -> dict[str, Any]:
    return precomputed_prompt(tokens, block_size, None, model_name)


def per_prompt_us(
    build: Callable[[array[int], int, str], dict[str, Any]],
    prompts: Sequence[array[int]],
    block_size: int,
) -> float:
    started = time.perf_counter()
    for tokens in prompts:
        build(tokens, block_size, "bench")
    return (time.perf_counter() - started) / len(prompts) * 1e6


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--tokens", type=arguments.positive_int, default=8192, help="token ids per prompt"
    )
    parser.add_argument("--block-size", type=arguments.block_size, default=32)
    parser.add_argument(
        "--prompts", type=arguments.positive_int, default=200, help="prompts per repetition"
    )
    parser.add_argument("--repeat", type=arguments.positive_int, default=9)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    prompts = [array("I", [rng.randrange(151_936) for _ in range(args.tokens)]) for _ in range(16)]
    batch = [prompts[index % len(prompts)] for index in range(args.prompts)]
    for tokens in prompts:
        if python_prompt(tokens, args.block_size, "bench") != core_prompt(
            tokens, args.block_size, "bench"
        ):
            raise SystemExit("the core's precomputed form differs from the Python hashing's")
    timings: dict[str, list[float]] = {"baseline": [], "core": []}
    for _ in range(args.repeat):
        timings["baseline"].append(per_prompt_us(python_prompt, batch, args.block_size))
        timings["core"].append(per_prompt_us(core_prompt, batch, args.block_size))
    blocks = args.tokens // args.block_size
    print(f"{args.tokens} token ids, block size {args.block_size} ({blocks} blocks) per prompt")
    print(f"{'':10}{'best us':>10}{'median us':>11}")
    for name, values in timings.items():
        print(f"{name:10}{min(values):>10.1f}{statistics.median(values):>11.1f}")
    best = min(timings["baseline"]) / min(timings["core"])
    median = statistics.median(timings["baseline"]) / statistics.median(timings["core"])
    print(f"baseline/core: {best:.2f} (best), {median:.2f} (median)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
