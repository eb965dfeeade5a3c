"""Free port ranges: consecutive, free, and never handed out twice before they are bound."""

from __future__ import annotations

import random
import re
import socket
from pathlib import Path

import pytest
from support.ipv6 import requires_ipv6

from kvbridge.adapters.ports import free_port_range, port_free


def test_a_range_is_consecutive_free_ports_below_the_ephemeral_range() -> None:
    ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    base = free_port_range(8, rng=random.Random(7))
    assert base >= 20_000
    assert base + 8 <= ephemeral
    assert all(port_free(base + offset) for offset in range(8))


def test_two_calls_before_binding_never_overlap() -> None:
    """The same seed picks the same first base; the second call must move past the first range."""
    first = free_port_range(1000, rng=random.Random(11))
    second = free_port_range(1000, rng=random.Random(11))
    assert first != second
    assert second >= first + 1000 or second + 1000 <= first


def test_a_bound_port_is_not_free() -> None:
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen()
        assert not port_free(held.getsockname()[1])


@requires_ipv6
def test_a_port_bound_on_ipv6_alone_is_not_free() -> None:
    """A relay output on an IPv6 address takes its port there only."""
    with socket.socket(socket.AF_INET6) as held:
        held.bind(("::1", 0))
        held.listen()
        port = held.getsockname()[1]
        with socket.socket() as ipv4:
            ipv4.bind(("0.0.0.0", port))  # the IPv4 side of the port is free
        assert not port_free(port)


class _Always(random.Random):
    """Picks the same start every time: the search must walk from it."""

    def __init__(self, start: int) -> None:
        super().__init__(0)
        self.start = start

    def randrange(self, *_: object, **__: object) -> int:  # type: ignore[override]
        return self.start


def test_held_and_taken_ports_move_the_search_past_them() -> None:
    """A start inside a range handed out a moment ago, before a port in use: the search is not
    tried again and again from there, it goes on past the held range, then past the port."""
    first = free_port_range(20)  # held for a few seconds
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", first + 25))
        taken.listen()
        base = free_port_range(8, rng=_Always(first + 5))
    assert base == first + 26


def test_no_range_that_long_is_an_error() -> None:
    with pytest.raises(OSError, match=r"^no 40000 consecutive free TCP ports in 20000-\d+$"):
        free_port_range(40_000)


def test_no_free_range_names_the_ports_in_the_way() -> None:
    """A range as long as the whole search range fits only if no port there is taken: the
    error names the first one the search met, in use or held (this test holds one)."""
    with pytest.raises(OSError) as too_long:
        free_port_range(40_000)  # no walk: the error gives the range alone
    limits = re.fullmatch(
        r"no 40000 consecutive free TCP ports in (\d+)-(\d+)", str(too_long.value)
    )
    assert limits is not None, str(too_long.value)
    low, high = map(int, limits.groups())
    held = free_port_range(1)  # so that the search meets at least one port
    with pytest.raises(OSError) as error:
        free_port_range(high - low)
    found = re.fullmatch(
        rf"no {high - low} consecutive free TCP ports in {low}-{high} "
        r"\(in the way: (\d+), 1 in all; (\d+) ranges held here\)",
        str(error.value),
    )
    assert found is not None, str(error.value)
    port, ranges = map(int, found.groups())
    assert low <= port <= held  # the walk wraps to the bottom: the lowest in the way
    assert ranges >= 1


def test_a_count_that_is_not_positive_is_refused() -> None:
    with pytest.raises(ValueError, match="count must be positive, got 0"):
        free_port_range(0)
