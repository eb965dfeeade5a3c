#!/usr/bin/env python3
"""One PNG of the benchmarks, before and after the native core.

Reads the JSON that ``benchmarks/normalize.py --json FILE`` and ``benchmarks/memory.py --json
FILE`` write (one or several runs of each) and draws, side by side:

- throughput, blocks/s per variant: the pure-Python (c) of the code before the core (a run with
  ``--before``), the core's (d) (bytes to the relay's canonical bytes) and (e) (bytes to
  ``TieredEvent`` values), and the untyped msgpack baseline (a); bars at the median over the
  runs of each run's best repetition, whiskers from the lowest to the highest;
- memory per tracked block at the memory run's block count: the pure-Python normalizer (RSS),
  the core (RSS and its own ``heap_bytes``), the core feeding a ``TieredIndex`` (RSS) when
  measured, and the target ``4 * block_size + 48``.

Needs matplotlib: the ``bench`` extra (``pip install -e '.[bench]'``).

Run: python benchmarks/plot.py --normalize r1.json [r2.json ...] --memory m1.json [...]
         [--out docs/benchmarks.png]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

THROUGHPUT = (
    ("before (c)", "pure Python (c), decode + normalize", "#b0b0b0"),
    ("(d) canonical", "core (d): bytes to canonical bytes", "#1f77b4"),
    ("(e) events", "core (e): bytes to TieredEvents", "#2ca02c"),
    ("(a) msgpack", "msgpack.decode, untyped (a)", "#ff7f0e"),
)
MEMORY = (
    ("before", "rss", "pure Python, RSS", "#b0b0b0"),
    ("core", "rss", "core, RSS", "#1f77b4"),
    ("core", "heap_bytes", "core, heap_bytes()", "#6baed6"),
    ("core+index", "rss", "core + TieredIndex, RSS", "#9467bd"),
)


def _load(paths: Sequence[Path], benchmark: str) -> list[dict[str, Any]]:
    documents = []
    for path in paths:
        document = json.loads(path.read_text())
        if document.get("benchmark") != benchmark:
            raise SystemExit(f"{path} is not a {benchmark}.py result")
        documents.append(document)
    return documents


def _spread(values: Sequence[float]) -> tuple[float, float, float]:
    """(median, distance down to the lowest, distance up to the highest)."""
    middle = statistics.median(values)
    return middle, middle - min(values), max(values) - middle


def _bars(
    axes: Any,
    xs: Sequence[float],
    spreads: Sequence[tuple[float, float, float]],
    width: float,
    label: str,
    color: str,
) -> list[float]:
    """One series of bars at ``xs``: each spread's middle, with its spread as error bars; the
    heights drawn."""
    heights = [s[0] for s in spreads]
    errors = [[s[1] for s in spreads], [s[2] for s in spreads]]
    axes.bar(xs, heights, width, yerr=errors, capsize=2, label=label, color=color)
    return heights


def _label(axes: Any, text: str, x: float, height: float, above: int = 3) -> None:
    """``text`` centred ``above`` points over the bar at ``x``."""
    axes.annotate(
        text, (x, height), textcoords="offset points", xytext=(0, above), ha="center", fontsize=7
    )


def throughput(axes: Any, runs: Sequence[dict[str, Any]]) -> None:
    names = [variant["name"] for variant in runs[0]["variants"]]
    series = [s for s in THROUGHPUT if all(s[0] in v["rates"] for v in runs[0]["variants"])]
    width = 0.8 / len(series)
    for offset, (key, label, color) in enumerate(series):
        spreads = []
        for name in names:
            best = [
                variant["rates"][key]["best"] / 1e6
                for run in runs
                for variant in run["variants"]
                if variant["name"] == name and key in variant["rates"]
            ]
            spreads.append(_spread(best))
        xs = [i + (offset - (len(series) - 1) / 2) * width for i in range(len(names))]
        heights = _bars(axes, xs, spreads, width, label, color)
        if (
            key in ("(d) canonical", "(e) events")
            and "before (c)" in runs[0]["variants"][0]["rates"]
        ):
            for x, name, height in zip(xs, names, heights, strict=True):
                speedups = [
                    variant["rates"][key]["best"] / variant["rates"]["before (c)"]["best"]
                    for run in runs
                    for variant in run["variants"]
                    if variant["name"] == name
                ]
                _label(axes, f"{statistics.median(speedups):.1f}x", x, height, above=9)
    axes.set_xticks(range(len(names)), [n.replace("   ", " ") for n in names], fontsize=8)
    axes.tick_params(axis="x", labelrotation=15)
    axes.set_ylabel("million blocks per second (best repetition)")
    host = runs[0]["machine"]
    axes.set_title(
        f"Throughput, {len(runs)} run(s) of normalize.py ({runs[0]['blocks']:,} blocks per "
        f"variant)\nlabels: speed-up over pure Python; kvbridge {host['commit']}",
        fontsize=10,
    )
    axes.set_ylim(0, axes.get_ylim()[1] * 1.3)  # room for the legend above the bars' labels
    axes.legend(fontsize=8, loc="upper left", ncol=2)
    axes.grid(axis="y", alpha=0.3)


def memory(axes: Any, runs: Sequence[dict[str, Any]]) -> None:
    sizes = sorted({case["block_size"] for run in runs for case in run["cases"]})
    present = [
        s
        for s in MEMORY
        if any(c["case"] == s[0] and s[1] in c["full"] for r in runs for c in r["cases"])
    ]
    width = 0.8 / (len(present) + 1)
    for offset, (case_name, key, label, color) in enumerate(present):
        spreads = []
        for size in sizes:
            values = [
                case["full"][key] / case["blocks"]
                for run in runs
                for case in run["cases"]
                if case["case"] == case_name and case["block_size"] == size and key in case["full"]
            ]
            spreads.append(_spread(values) if values else (0.0, 0.0, 0.0))
        xs = [i + (offset - len(present) / 2) * width for i in range(len(sizes))]
        heights = _bars(axes, xs, spreads, width, label, color)
        for x, height in zip(xs, heights, strict=True):
            if height:
                _label(axes, f"{height:.0f}", x, height)
    targets = [4 * size + 48 for size in sizes]
    xs = [i + (len(present) / 2) * width for i in range(len(sizes))]
    axes.bar(xs, targets, width, label="target: 4 x block size + 48", color="white", hatch="//")
    for x, value in zip(xs, targets, strict=True):
        _label(axes, f"{value}", x, value)
    axes.set_xticks(range(len(sizes)), [f"block size {size}" for size in sizes])
    axes.set_ylabel("bytes per tracked block")
    axes.set_ylim(0, axes.get_ylim()[1] * 1.35)  # room for the legend
    blocks = runs[0]["cases"][0]["blocks"]
    axes.set_title(
        f"Memory per block at {blocks:,} resident blocks\n{len(runs)} run(s) of memory.py",
        fontsize=10,
    )
    axes.legend(fontsize=7, loc="upper left", ncol=2)
    axes.grid(axis="y", alpha=0.3)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--normalize", type=Path, nargs="+", required=True, metavar="FILE")
    parser.add_argument("--memory", type=Path, nargs="+", required=True, metavar="FILE")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.png")
    args = parser.parse_args(argv)
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("plot.py needs matplotlib: pip install -e '.[bench]'") from None
    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, (left, right) = pyplot.subplots(
        1, 2, figsize=(15, 5.8), gridspec_kw={"width_ratios": [2.1, 1]}
    )
    throughput(left, _load(args.normalize, "normalize"))
    memory(right, _load(args.memory, "memory"))
    host = json.loads(args.normalize[0].read_text())["machine"]
    figure.suptitle(
        f"kvbridge: pure Python (8950c4a) against the native core. {host['cpu']}, "
        f"{host['cpus']} CPUs, Python {host['python']}, msgspec {host['msgspec']}",
        fontsize=11,
    )
    figure.tight_layout()
    figure.savefig(args.out, dpi=110)
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
