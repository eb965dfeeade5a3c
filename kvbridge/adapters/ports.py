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


def _is_held(port: int) -> bool:
    """True if ``port`` is in a range still held."""
    return any(port in held for _, held in _held)


def _first_taken(base: int, count: int) -> int | None:
    """The first port of ``base .. base + count`` that is held or not free, if any."""
    return next((p for p in range(base, base + count) if _is_held(p) or not port_free(p)), None)


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

    The search starts at a random port (so that processes looking at the same time seldom
    meet) and walks up the range, wrapping once to its bottom, each taken port moving the
    start past it: it finds a free range whenever one exists, each port probed at most twice.

    Raises:
        ValueError: ``count`` is not positive.
        OSError: no ``count`` consecutive free ports in the range.
    """
    if count <= 0:
        raise ValueError(f"count must be positive, got {count}")
    rng = rng or random.SystemRandom()
    low, high = _port_range()
    taken_ports: list[int] = []
    with _holding:
        now = time.monotonic()
        _held[:] = [(until, held) for until, held in _held if until > now]
        if count <= high - low:
            start = rng.randrange(low, high - count + 1)
            base, wrapped = start, False
            while not (wrapped and base > start):
                if base + count > high:
                    if wrapped:
                        break
                    base, wrapped = low, True
                    continue
                taken = _first_taken(base, count)
                if taken is None:
                    _held.append((now + _HELD_S, range(base, base + count)))
                    return base
                taken_ports.append(taken)
                base = taken + 1
        held = len(_held)
    in_the_way = ""
    if taken_ports:  # for whoever must find out what holds them
        ports = list(dict.fromkeys(taken_ports))  # a port met again after the wrap, once
        shown = ", ".join(map(str, ports[:12])) + (", ..." if len(ports) > 12 else "")
        in_the_way = f" (in the way: {shown}, {len(ports)} in all; {held} ranges held here)"
    raise OSError(f"no {count} consecutive free TCP ports in {low}-{high}{in_the_way}")
