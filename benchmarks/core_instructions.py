"""Instructions per block of the native core and of msgspec's untyped decoding, counted by
cachegrind: figures that, unlike the clock, do not move with the machine's load.

    python benchmarks/core_instructions.py                  # every variant, about 3 minutes
    python benchmarks/core_instructions.py --variant bs32

On the payloads of ``benchmarks/normalize.py`` (same simulator, seed and variants), each
count is the difference of two runs, with two passes over the payloads and with one, so that
start-up and imports cancel out:

- the core alone, without Python (``native/core/examples/core_loop.rs``): the decoder, the
  decoder and the normalizer state, and both with the relay's canonical writer;
- in Python: (a) ``msgspec.msgpack.decode`` of every payload, normalize.py's baseline, and
  (d) ``Normalizer.process(payload, seq).canonical_payloads(ts)``, the relay's path.

(d)/(a) here is a ratio of instructions, not of time: msgspec's loop allocates a Python object
per value, which costs cycles its instruction count does not show, so this ratio understates
the time ratio of ``normalize.py``; it is a load-proof check of what a change to the core did.
Needs valgrind (Debian's ``valgrind``) and cargo.
"""

from __future__ import annotations

import argparse
import shutil
import struct
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from normalize import VARIANTS, encode_steps, simulate
from run_info import checkout

from kvbridge.cli.arguments import positive_int

CORE_MODES = ("decode", "state", "canonical")

PYTHON_RUNNER = """
import struct
import sys

import msgspec
from kvbridge import Normalizer

block_size, path, measure, passes = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
data = open(path, "rb").read()
payloads, at = [], 4
while at < len(data):
    (size,) = struct.unpack_from("<I", data, at)
    payloads.append(data[at + 4 : at + 4 + size])
    at += 4 + size
for _ in range(passes):
    if measure == "a":
        decode = msgspec.msgpack.decode
        for payload in payloads:
            decode(payload)
    else:
        process = Normalizer(worker_id=1, block_size=block_size).process
        for seq, payload in enumerate(payloads):
            process(payload, seq).canonical_payloads(1.0)
"""


def write_payloads(path: Path, block_size: int, payloads: Sequence[bytes]) -> None:
    """The file ``core_loop`` reads: the block size, then each payload with its length."""
    with path.open("wb") as out:
        out.write(struct.pack("<I", block_size))
        for payload in payloads:
            out.write(struct.pack("<I", len(payload)))
            out.write(payload)


def instructions(command: Sequence[str]) -> int:
    """The instructions cachegrind counts for one run of ``command``."""
    result = subprocess.run(
        [
            "valgrind",
            "--tool=cachegrind",
            "--cache-sim=no",
            "--cachegrind-out-file=/dev/null",
            *command,
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    for line in result.stderr.splitlines():
        if "I" in line and "refs:" in line:
            return int(line.rpartition(":")[2].replace(",", ""))
    raise RuntimeError(f"no instruction count in cachegrind's output:\n{result.stderr}")


def per_block(command: Sequence[str], blocks: int) -> float:
    """Instructions per block of one pass: two passes less one."""
    return (instructions([*command, "2"]) - instructions([*command, "1"])) / blocks


def build_core_loop() -> Path:
    native = checkout() / "native"
    subprocess.run(
        ["cargo", "build", "--quiet", "--release", "--example", "core_loop"],
        cwd=native,
        check=True,
    )
    return native / "target" / "release" / "examples" / "core_loop"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=positive_int, default=100_000, help="blocks per variant")
    parser.add_argument("--seed", type=int, default=20_240_601)
    parser.add_argument("--variant", default="", help="only variants whose name contains this")
    args = parser.parse_args(argv)
    missing = [tool for tool in ("valgrind", "cargo") if shutil.which(tool) is None]
    if missing:
        parser.error(f"needs {' and '.join(missing)} on PATH")
    variants = [variant for variant in VARIANTS if args.variant in variant.name]
    if not variants:
        parser.error(f"no variant's name contains {args.variant!r}")
    core_loop = build_core_loop()
    print("instructions per block (cachegrind; one pass = two passes less one)")
    print(
        f"{'variant':<26}{'decode':>8}{'+state':>8}{'+canon.':>8}{'(a)':>8}{'(d)':>8}{'(d)/(a)':>9}"
    )
    with tempfile.TemporaryDirectory() as scratch:
        runner = Path(scratch) / "runner.py"
        runner.write_text(PYTHON_RUNNER)
        for variant in variants:
            steps = simulate(variant.block_size, args.blocks, args.seed)
            payloads = encode_steps(steps, variant)
            blocks = sum(len(event[1]) for step in steps for event in step)
            path = Path(scratch) / "payloads.bin"
            write_payloads(path, variant.block_size, payloads)
            core = [per_block([str(core_loop), mode, str(path)], blocks) for mode in CORE_MODES]
            python = [sys.executable, str(runner), str(variant.block_size), str(path)]
            baseline = per_block([*python, "a"], blocks)
            canonical = per_block([*python, "d"], blocks)
            cells = "".join(f"{value:>8.0f}" for value in (*core, baseline, canonical))
            print(f"{variant.name:<26}{cells}{baseline / canonical:>9.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
