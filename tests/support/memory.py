"""A process's resident memory, for the tests that bound it."""

from __future__ import annotations

from pathlib import Path


def rss_mb(pid: int | str = "self") -> float:
    """The resident set of process ``pid`` (this one by default) in MiB, from
    ``/proc/PID/status``; 0.0 for a process that has none (a zombie: it has exited)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0
