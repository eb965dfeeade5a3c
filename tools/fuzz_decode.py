#!/usr/bin/env python3
"""Fuzz ``kvbridge.decode_batch`` with the seeded corpus of ``kvbridge.testing.corpus``.

Every payload must decode to a ``VllmBatch`` or raise ``SchemaError``; anything else (another
exception) is a bug. Prints the counts by outcome, and by kind of payload, the first few
"other" payloads in hex with their exception, and exits 1 if there was any.

Run: python tools/fuzz_decode.py [--count N] [--seed S] [--show K]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from collections.abc import Sequence

from kvbridge import SchemaError, VllmBatch, decode_batch
from kvbridge.testing.corpus import KINDS, labelled_corpus

OUTCOMES = ("decoded", "SchemaError", "other")
HEX_BYTES = 4096
"""Longer "other" payloads are printed up to this many bytes."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=100_000, help="payloads to decode")
    parser.add_argument("--seed", type=int, default=0, help="seed of the corpus")
    parser.add_argument("--show", type=int, default=5, help='"other" payloads to print')
    args = parser.parse_args(argv)

    by_kind: Counter[tuple[str, str]] = Counter()
    others: list[tuple[str, bytes, BaseException]] = []
    started = time.perf_counter()
    decoding = 0.0
    for kind, payload in labelled_corpus(args.seed, args.count):
        start = time.perf_counter()
        try:
            outcome = "decoded" if isinstance(decode_batch(payload), VllmBatch) else "other"
        except SchemaError:
            outcome = "SchemaError"
        except Exception as error:
            outcome = "other"
            if len(others) < args.show:
                others.append((kind, payload, error))
        decoding += time.perf_counter() - start
        by_kind[kind, outcome] += 1
    elapsed = time.perf_counter() - started

    totals = Counter({outcome: 0 for outcome in OUTCOMES})
    for (_, outcome), count in by_kind.items():
        totals[outcome] += count
    print(f"{args.count} payloads, seed {args.seed}: {elapsed:.1f} s ({decoding:.1f} s decoding)")
    print("  ".join(f"{outcome} {totals[outcome]}" for outcome in OUTCOMES))
    print(f"\n{'kind':<16}" + "".join(f"{outcome:>13}" for outcome in OUTCOMES))
    for kind in KINDS:
        print(f"{kind:<16}" + "".join(f"{by_kind[kind, outcome]:>13}" for outcome in OUTCOMES))
    for kind, payload, exception in others:
        shown = payload.hex() if len(payload) <= HEX_BYTES else f"{payload[:HEX_BYTES].hex()}..."
        print(f"\nother ({kind}, {len(payload)} bytes): {type(exception).__name__}: {exception}")
        print(f"  {shown}")
    return 1 if totals["other"] else 0


if __name__ == "__main__":
    sys.exit(main())
