"""ZMQ endpoints as the command line gives them: parsed, checked, and bound or connected on purpose.

An endpoint argument is ``[bind:|connect:]ADDRESS`` where ``ADDRESS`` is one of ZMQ's
transports:

- ``tcp://HOST:PORT``: ``HOST`` is ``*`` (every IPv4 interface), an IPv4 address, a host name
  or an interface name, or an IPv6 address in brackets (``[::1]``; ``[::]`` is every
  interface, IPv4 included); ``PORT`` is from 1 to 65535;
- ``ipc://PATH`` (a Unix socket; ``ipc://@NAME`` for Linux's abstract namespace);
- ``inproc://NAME`` (only inside one process, so the command line refuses it).

Without a prefix, a KV-event source follows vLLM's own rule for ``KVEventsConfig.endpoint``
(:func:`should_bind`): a wildcard host, an address with ``::`` in it (or ``ipc://``) means the
engine binds and kvbridge connects, on the loopback for a wildcard (:func:`loopback`); any
other address means the engine connects, so kvbridge binds it. ``connect:tcp://10.1.2.3:5557``
subscribes to a remote engine that binds; ``bind:`` says the opposite. A replay endpoint of a
source is always connected to (the engine binds it), and the relay always binds its own outputs
(Dynamo connects to them).

A socket for an IPv6 address needs ZMQ's ``IPV6`` option, which :func:`allow_ipv6` sets on every
socket kvbridge opens. vLLM's KV-event publisher does not set it, so an engine's own endpoint
stays IPv4; kvbridge's outputs, and the engines it simulates, may be IPv6. A host name is
resolved to IPv4, as by vLLM's sockets.

Two arguments of one command must not name the same socket (:func:`clash`), and a source that
has delivered nothing after a few seconds is reported once, with what to check
(:class:`SilenceWatch`).
"""

from __future__ import annotations

import ipaddress
import re
import time
from collections.abc import Iterable
from typing import Final, Literal

import msgspec
import structlog
import zmq

__all__ = [
    "MAX_HWM",
    "SILENCE_AFTER_S",
    "Endpoint",
    "EndpointError",
    "Mode",
    "SilenceWatch",
    "allow_ipv6",
    "clash",
    "is_ipv6",
    "loopback",
    "offset_endpoint",
    "parse_endpoint",
    "should_bind",
    "tcp_address",
]

Mode = Literal["bind", "connect"]

MAX_HWM: Final = 2**31 - 1
"""The largest high-water mark ZMQ takes (a C ``int``)."""

SILENCE_AFTER_S: Final = 5.0
"""Seconds without a batch after which a source is reported as silent."""

_TRANSPORTS: Final = ("tcp", "ipc", "inproc")
_IPC_PATH_MAX: Final = 107
"""Longest Unix socket path (``sun_path`` is 108 bytes with its terminating NUL)."""
_HOST_NAME = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9_]([A-Za-z0-9_-]*[A-Za-z0-9_])?(\.[A-Za-z0-9_]([A-Za-z0-9_-]*[A-Za-z0-9_])?)*$"
)
_WILDCARDS: Final = {"*": "127.0.0.1", "0.0.0.0": "127.0.0.1", "[::]": "[::1]"}
"""Each host that binds every interface, and the loopback a connection to it goes to."""
_LOOPBACK_NAMES: Final = frozenset(("localhost", "127.0.0.1"))
_SYNTAX: Final = (
    "expected tcp://HOST:PORT, tcp://[IPv6]:PORT or ipc://PATH, optionally after bind: or connect:"
)

log = structlog.get_logger("kvbridge.endpoints")


def should_bind(endpoint: str) -> bool:
    """Return whether vLLM would *bind* its PUB socket to ``endpoint`` (otherwise it connects)."""
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
    )


def is_ipv6(address: str) -> bool:
    """Whether ``address`` is TCP to an IPv6 address (``tcp://[...]:PORT``)."""
    return address.startswith("tcp://[")


def allow_ipv6(socket: zmq.Socket[bytes], address: str) -> None:
    """Let ``socket`` bind or connect to ``address`` if it is IPv6 (ZMQ's sockets are IPv4
    unless told otherwise); other addresses leave the socket as it is."""
    if is_ipv6(address):
        socket.setsockopt(zmq.IPV6, 1)


def tcp_address(host: str, port: int | str) -> str:
    """``tcp://HOST:PORT``, with an IPv6 host in brackets (given with or without them)."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


def offset_endpoint(endpoint: str, offset: int) -> str:
    """``tcp://host:port`` with the port moved up by ``offset``, as vLLM offsets dp ranks."""
    if offset == 0:
        return endpoint
    head, sep, port = endpoint.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()) or not endpoint.startswith("tcp://"):
        raise ValueError(f"cannot offset {endpoint!r}: several workers need tcp://host:port")
    return f"{head}:{int(port) + offset}"


def loopback(address: str) -> str:
    """The address to connect to for one a peer binds: a wildcard host (``*``, ``0.0.0.0``,
    ``[::]``) becomes the loopback of its family, on the same port."""
    if not address.startswith("tcp://"):
        return address
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    if _unspecified_ipv6(host):
        host = "[::]"
    if host not in _WILDCARDS:
        return address
    return f"tcp://{_WILDCARDS[host]}:{port}"


def _unspecified_ipv6(host: str) -> bool:
    """Whether ``host`` is ``[::]`` however it is written (``[::0]``, ``[0:0::0]``...)."""
    if not (host.startswith("[") and host.endswith("]")):
        return False
    try:
        return ipaddress.IPv6Address(host[1:-1]).is_unspecified
    except ValueError:
        return False


class EndpointError(ValueError):
    """An endpoint argument that is not a usable ZMQ address; the message says what is wrong."""


class Endpoint(msgspec.Struct, frozen=True):
    """One parsed endpoint argument."""

    address: str
    """The ZMQ address, without the ``bind:``/``connect:`` prefix."""
    transport: str
    """``tcp``, ``ipc`` or ``inproc``."""
    mode: Mode | None = None
    """The prefix given, or ``None`` for the default rule of the argument."""
    host: str | None = None
    """For ``tcp``: the host as given (``*`` for every interface, an IPv6 address in brackets)."""
    port: int | None = None
    """For ``tcp``: the port."""

    @property
    def engine_binds(self) -> bool:
        """Whether vLLM, given this address as ``KVEventsConfig.endpoint``, binds it."""
        return should_bind(self.address)

    def offset(self, offset: int) -> Endpoint:
        """The same endpoint with the port moved up by ``offset``, as vLLM offsets dp ranks and
        the relay offsets its outputs.

        Raises:
            EndpointError: not a ``tcp://`` endpoint (and ``offset`` is not 0), or a port past
                65535.
        """
        if offset == 0:
            return self
        if self.port is None or self.host is None:
            raise EndpointError(
                f"{self.address!r} cannot be offset for several streams: use tcp://HOST:PORT"
            )
        port = self.port + offset
        if port > 65535:
            raise EndpointError(f"port {self.port} + {offset} is past 65535 in {self.address!r}")
        return msgspec.structs.replace(self, address=f"tcp://{self.host}:{port}", port=port)

    def dialled(self, mode: Mode) -> str:
        """The address a socket in ``mode`` binds or connects to: connecting to a wildcard host
        connects to the loopback (:func:`loopback`)."""
        return loopback(self.address) if mode == "connect" else self.address


def parse_endpoint(text: str) -> Endpoint:
    """Parse ``[bind:|connect:]ADDRESS``.

    Raises:
        EndpointError: with a message that names what is wrong and quotes ``text``.
    """
    mode: Mode | None = None
    address = text
    for prefix in ("bind", "connect"):
        if text.startswith(prefix + ":") and not text.startswith(prefix + "://"):
            mode = "bind" if prefix == "bind" else "connect"
            address = text[len(prefix) + 1 :]
            break
    scheme, sep, rest = address.partition("://")
    if not sep:
        raise EndpointError(f"not an endpoint: {text!r} ({_SYNTAX})")
    if scheme not in _TRANSPORTS:
        raise EndpointError(f"unsupported transport {scheme!r} in {text!r} (tcp, ipc or inproc)")
    if scheme == "ipc":
        if not rest:
            raise EndpointError(f"no path in {text!r} (expected ipc://PATH)")
        try:
            path = rest.encode()
        except UnicodeEncodeError:
            raise EndpointError(f"ipc path is not valid UTF-8 in {text!r}") from None
        if len(path) > _IPC_PATH_MAX:
            raise EndpointError(
                f"ipc path longer than {_IPC_PATH_MAX} bytes in {text!r}: use a shorter path"
            )
        return Endpoint(address, scheme, mode)
    if scheme == "inproc":
        if not rest:
            raise EndpointError(f"no name in {text!r} (expected inproc://NAME)")
        return Endpoint(address, scheme, mode)
    host, sep, port_text = rest.rpartition(":")
    if not sep or (rest.startswith("[") and rest.endswith("]")):
        raise EndpointError(f"no port in {text!r} (expected tcp://HOST:PORT)")
    _check_host(host, text)
    if not (port_text.isascii() and port_text.isdigit()):
        raise EndpointError(f"port {port_text!r} is not a number in {text!r}")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise EndpointError(f"port {port} is out of range 1-65535 in {text!r}")
    return Endpoint(f"tcp://{host}:{port}", scheme, mode, host, port)


def _check_host(host: str, text: str) -> None:
    if not host:
        raise EndpointError(f"no host in {text!r} (use * for every interface)")
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise EndpointError(f"{host!r} is not an IPv6 address in {text!r}") from None
        return
    if ":" in host or "[" in host or "]" in host:
        raise EndpointError(
            f"{host!r} in {text!r} is not a host: an IPv6 address goes in brackets, "
            "tcp://[ADDRESS]:PORT"
        )
    if host == "*":
        return
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        if re.fullmatch(r"[0-9.]+", host) or not _HOST_NAME.match(host):
            raise EndpointError(
                f"{host!r} is not an IPv4 address or a host name in {text!r}"
            ) from None


def _local(host: str) -> str:
    """A host as far as clashes go: ``*`` for every IPv4 interface, ``[::]`` for every
    interface, 127.0.0.1 for loopback names, an IPv6 address in its compressed form."""
    if host in ("*", "0.0.0.0"):
        return "*"
    if host in _LOOPBACK_NAMES or host.startswith("127."):
        return "127.0.0.1"
    if host.startswith("["):
        address = ipaddress.IPv6Address(host[1:-1])
        if address.ipv4_mapped is not None:  # ::ffff:a.b.c.d is a.b.c.d
            return _local(str(address.ipv4_mapped))
        return f"[{address.compressed}]"
    return host.lower()


def _meets(wildcard: tuple[str, Mode], other: tuple[str, Mode]) -> bool:
    """Whether a socket bound to every interface (``*``, or ``[::]`` for both families, as ZMQ
    binds it) meets another socket on the same port: any bind of a family it covers, and a
    connection to the loopback of one."""
    host, (other_host, other_mode) = wildcard[0], other
    if host == "[::]":
        return other_mode == "bind" or other_host in ("127.0.0.1", "[::1]")
    if host == "*":
        ipv4 = not other_host.startswith("[")
        return (other_mode == "bind" and ipv4) or other_host == "127.0.0.1"
    return False


def clash(first: Endpoint, first_mode: Mode, second: Endpoint, second_mode: Mode) -> bool:
    """Whether two sockets of one process, binding or connecting as given, would meet on the same
    address: the same path or name, or the same TCP port where one binds every interface of a
    family and the other binds in that family or connects to its loopback, or the same host."""
    if first.transport != second.transport:
        return False
    if first.port is None or second.port is None:
        return first.address == second.address
    if first.port != second.port:
        return False
    one, two = (
        (_local(e.dialled(m).removeprefix("tcp://").rpartition(":")[0]), m)
        for e, m in ((first, first_mode), (second, second_mode))
    )
    return one[0] == two[0] or _meets(one, two) or _meets(two, one)


class SilenceWatch:
    """Reports, once per source, a source that has delivered nothing after ``after_s`` seconds.

    Call :meth:`check` with the sources that have delivered something so far; it logs a warning
    for each other source once ``after_s`` seconds have passed since construction.
    """

    def __init__(
        self, sources: Iterable[tuple[str, bool]], *, after_s: float = SILENCE_AFTER_S
    ) -> None:
        """``sources``: each source's endpoint and whether kvbridge binds it."""
        self.after_s = after_s
        self._pending = dict(sources)
        self._start = time.monotonic()

    def check(self, delivered: Iterable[str]) -> list[str]:
        """Log the sources still silent after ``after_s``; returns their endpoints."""
        for endpoint in delivered:
            self._pending.pop(endpoint, None)
        if not self._pending or time.monotonic() - self._start < self.after_s:
            return []
        silent = list(self._pending)
        for endpoint in silent:
            log.warning(silence_message(endpoint, self._pending[endpoint], self.after_s))
        self._pending.clear()
        return silent


def silence_message(endpoint: str, binds: bool, after_s: float) -> str:
    """What to check about a source that delivered nothing."""
    if binds:
        how = f"kvbridge binds {endpoint}, so the engine must connect to it"
        fix = f"connect:{endpoint}"
    else:
        how = f"kvbridge connects to {loopback(endpoint)}, so the engine must bind it"
        fix = f"bind:{endpoint}"
    return (
        f"no batch from {endpoint} after {after_s:g} s: is the engine publishing there? "
        f"{how} (both sides binding or both connecting deliver nothing; {fix} says the "
        "opposite)"
    )
