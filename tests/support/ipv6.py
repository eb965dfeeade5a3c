"""Whether this host can run the IPv6 tests: an IPv6 loopback to bind, and what binding ``::``
covers."""

from __future__ import annotations

import contextlib
import socket
from pathlib import Path

import pytest

__all__ = ["DUAL_STACK", "requires_ipv6"]


def _has_ipv6_loopback() -> bool:
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET6) as probe:
        probe.bind(("::1", 0))
        return True
    return False


requires_ipv6 = pytest.mark.skipif(
    not _has_ipv6_loopback(), reason="this host has no IPv6 loopback (::1) to bind"
)
"""Marks a test that binds ``[::1]``: skipped where IPv6 is off (Docker's default network)."""


def _dual_stack() -> bool:
    setting = Path("/proc/sys/net/ipv6/bindv6only")
    return setting.exists() and setting.read_text().strip() == "0"


DUAL_STACK = _dual_stack()
"""Whether a socket bound to ``::`` also takes IPv4 connections (Linux's default)."""
