"""Endpoint arguments with IPv6 hosts: parsed, offset, dialled and checked for clashes as IPv4
ones are, and the sockets kvbridge opens for them carry ZMQ's ``IPV6`` option."""

from __future__ import annotations

import pytest
import zmq

from kvbridge.adapters.endpoints import (
    Endpoint,
    EndpointError,
    Mode,
    allow_ipv6,
    clash,
    is_ipv6,
    loopback,
    parse_endpoint,
    tcp_address,
)


def test_an_ipv6_host_is_parsed_in_brackets() -> None:
    assert parse_endpoint("connect:tcp://[fd00::5]:5557") == Endpoint(
        "tcp://[fd00::5]:5557", "tcp", "connect", "[fd00::5]", 5557
    )
    assert parse_endpoint("tcp://[::]:5557").offset(2).address == "tcp://[::]:5559"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tcp://[::1]", "no port in 'tcp://[::1]' (expected tcp://HOST:PORT)"),
        ("tcp://[::1]:", "port '' is not a number in 'tcp://[::1]:'"),
        ("tcp://[::1:5557", "'[::1' in 'tcp://[::1:5557' is not a host: an IPv6 address goes in "
         "brackets, tcp://[ADDRESS]:PORT"),
    ],
)  # fmt: skip
def test_a_malformed_ipv6_endpoint_says_what_is_missing(text: str, message: str) -> None:
    with pytest.raises(EndpointError) as error:
        parse_endpoint(text)
    assert str(error.value) == message


@pytest.mark.parametrize(
    ("address", "dialled"),
    [
        ("tcp://*:5557", "tcp://127.0.0.1:5557"),
        ("tcp://0.0.0.0:5557", "tcp://127.0.0.1:5557"),
        ("tcp://[::]:5557", "tcp://[::1]:5557"),
        ("tcp://[0:0::0]:5557", "tcp://[::1]:5557"),
        ("tcp://[::1]:5557", "tcp://[::1]:5557"),
        ("tcp://10.1.2.3:5557", "tcp://10.1.2.3:5557"),
        ("ipc:///tmp/kv", "ipc:///tmp/kv"),
    ],
)
def test_a_connection_to_a_wildcard_goes_to_the_loopback_of_its_family(
    address: str, dialled: str
) -> None:
    assert loopback(address) == dialled
    assert parse_endpoint(address).dialled("connect") == dialled
    assert parse_endpoint(address).dialled("bind") == address


@pytest.mark.parametrize(
    ("host", "address"),
    [
        ("10.0.0.5", "tcp://10.0.0.5:7000"),
        ("fd00::5", "tcp://[fd00::5]:7000"),
        ("[fd00::5]", "tcp://[fd00::5]:7000"),
        ("node-1", "tcp://node-1:7000"),
    ],
)
def test_tcp_address_brackets_an_ipv6_host(host: str, address: str) -> None:
    assert tcp_address(host, 7000) == address
    assert is_ipv6(address) is (":" in host)


@pytest.mark.parametrize(
    ("first", "first_mode", "second", "second_mode", "expected"),
    [
        # every interface of both families meets any bind and either loopback
        ("tcp://[::]:5557", "bind", "tcp://*:5557", "bind", True),
        ("tcp://[::]:5557", "bind", "tcp://10.1.2.3:5557", "bind", True),
        ("tcp://[::]:5557", "bind", "tcp://[::1]:5557", "connect", True),
        ("tcp://[::]:5557", "bind", "tcp://127.0.0.1:5557", "connect", True),
        ("tcp://[::]:5557", "bind", "tcp://[::1]:5558", "bind", False),
        # every IPv4 interface meets IPv4 alone
        ("tcp://*:5557", "bind", "tcp://[::1]:5557", "bind", False),
        ("tcp://*:5557", "bind", "tcp://[::1]:5557", "connect", False),
        ("tcp://*:5557", "bind", "tcp://127.0.0.1:5557", "connect", True),
        # one host, however it is written
        ("tcp://[::1]:5557", "bind", "tcp://[0:0::1]:5557", "connect", True),
        ("tcp://[::1]:5557", "bind", "tcp://127.0.0.1:5557", "bind", False),
        ("tcp://[FD00::5]:5557", "bind", "tcp://[fd00::5]:5557", "bind", True),
        # an IPv4-mapped address is the IPv4 address
        ("tcp://*:5557", "bind", "tcp://[::ffff:127.0.0.1]:5557", "connect", True),
        ("tcp://10.0.0.1:5557", "bind", "tcp://[::ffff:10.0.0.1]:5557", "bind", True),
        ("tcp://[::0]:5557", "bind", "tcp://[::1]:5557", "connect", True),
    ],
)
def test_clashes_follow_the_address_families(
    first: str, first_mode: Mode, second: str, second_mode: Mode, expected: bool
) -> None:
    one, two = parse_endpoint(first), parse_endpoint(second)
    assert clash(one, first_mode, two, second_mode) is expected
    assert clash(two, second_mode, one, first_mode) is expected


def test_only_an_ipv6_address_sets_the_sockets_ipv6_option() -> None:
    context = zmq.Context()
    try:
        for address, ipv6 in [("tcp://[::1]:5557", 1), ("tcp://127.0.0.1:5557", 0)]:
            socket = context.socket(zmq.SUB)
            allow_ipv6(socket, address)
            assert socket.getsockopt(zmq.IPV6) == ipv6
            socket.close(linger=0)
    finally:
        context.term()
