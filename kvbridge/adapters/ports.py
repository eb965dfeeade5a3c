"""Free TCP ports, for engines, relays and tests that need them before anything binds.

vLLM offsets a data-parallel rank's ports by its rank, so the ports of one engine (and of the
relay that mirrors it) must be consecutive: :func:`free_port_range` finds such a range. A port
found free can still be taken before it is bound; callers bind soon after. Within one process,
a range is not handed out again for a few seconds, so two calls made before either caller
binds never overlap.
"""

from __future__ import annotations

import random
import socket
import threading
import time
from typing import Final

__all__ = ["free_port_range", "port_free"]

_LOWEST_PORT: Final = 20_000
_PORT_ATTEMPTS: Final = 200
_HELD_S: Final = 10.0
"""How long a range handed out is not handed out again: the time its caller has to bind it."""

_held: list[tuple[float, range]] = []
"""The ranges handed out in the last ``_HELD_S`` seconds, with the time each is released."""
_holding = threading.Lock()


def _port_range() -> tuple[int, int]:
    """Ports from 20000 up to the kernel's ephemeral range: a port there can be taken only by
    a bind, never by an outgoing connection between the moment it is found free and its use."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ranges:
            ephemeral = int(ranges.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32_768
    return _LOWEST_PORT, max(ephemeral, _LOWEST_PORT + 1_000)


def _overlaps_held(base: int, count: int) -> bool:
    """True if ``base .. base + count`` shares a port with a range still held."""
    return any(base < held.stop and held.start < base + count for _, held in _held)


def port_free(port: int) -> bool:
    """True if ``port`` can be bound on every interface, IPv4 (vLLM binds ``tcp://*:port``) and
    IPv6 (a relay output on an IPv6 address) where the host has IPv6."""
    for family, wildcard in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            probe = socket.socket(family)
        except OSError:  # no IPv6 on this host
            continue
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # this family alone: IPv4 was probed already
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind((wildcard, port))
            except OSError:
                return False
    return True


def free_port_range(count: int, *, rng: random.Random | None = None) -> int:
    """The first of ``count`` consecutive TCP ports that are free on every interface.

    Raises:
        ValueError: ``count`` is not positive.
        OSError: no free range after a few hundred attempts.
    """
    if count <= 0:
        raise ValueError(f"count must be positive, got {count}")
    rng = rng or random.SystemRandom()
    low, high = _port_range()
    with _holding:
        now = time.monotonic()
        _held[:] = [(until, held) for until, held in _held if until > now]
        for _ in range(_PORT_ATTEMPTS):
            base = rng.randrange(low, high - count)
            if _overlaps_held(base, count):
                continue
            if all(port_free(base + offset) for offset in range(count)):
                _held.append((now + _HELD_S, range(base, base + count)))
                return base
    raise OSError(f"no {count} consecutive free TCP ports in {low}-{high}")
