"""What a benchmark's figures were measured on, and its ``--json`` results file.

Shared by ``normalize.py`` and ``memory.py``, whose results ``plot.py`` reads.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import msgspec


def checkout() -> Path:
    """The checkout whose kvbridge this interpreter imports (the one measured)."""
    import kvbridge

    return Path(kvbridge.__file__).resolve().parents[1]


def machine() -> dict[str, Any]:
    """The CPU, Python, msgspec, the kvbridge measured (its commit, ``+changes`` when its
    ``kvbridge`` or ``native`` differ from it) and the load average at the start."""
    model = "unknown"
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                model = line.partition(":")[2].strip()
                break
    git = ["git", "-C", str(checkout())]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(
        [*git, "status", "--porcelain", "--", "kvbridge", "native"], capture_output=True, text=True
    )
    return {
        "cpu": model,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "msgspec": msgspec.__version__,
        "commit": commit.stdout.strip() + ("+changes" if dirty.stdout.strip() else ""),
        "kvbridge": (checkout() / "kvbridge").as_posix(),
        "load_average": os.getloadavg()[0],
    }


def write_results(path: Path, benchmark: str, host: dict[str, Any], **fields: Any) -> None:
    """``path`` gets ``{"benchmark", "machine", **fields}``, the load average at the end added
    to the machine's."""
    host["load_average_end"] = os.getloadavg()[0]
    document = {"benchmark": benchmark, "machine": host, **fields}
    path.write_text(json.dumps(document, indent=1) + "\n")
    print(f"\nresults written to {path}")
