"""Free TCP ports below the kernel's ephemeral range, for subprocesses that bind them later.

A port picked from the ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999
by default) can be taken by any outgoing connection between the moment it is found free and the
moment a subprocess binds it. Ports below that range are only ever taken by a bind.
"""

from __future__ import annotations

import random
from pathlib import Path

from kvbridge.adapters.ports import port_free

__all__ = ["free_low_ports"]

_LOW = 20_000


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def free_low_ports(count: int) -> int:
    """The first of ``count`` consecutive free ports between 20000 and the ephemeral range."""
    high = _ephemeral_start()
    rng = random.SystemRandom()
    for _ in range(500):
        base = rng.randrange(_LOW, high - count)
        if all(port_free(base + offset) for offset in range(count)):
            return base
    raise OSError(f"no {count} consecutive free TCP ports in {_LOW}-{high}")
