"""The sockets a command will bind or connect, checked before any is opened.

A command lists its :class:`Use` of each socket; :func:`check_uses` refuses two arguments that
name the same socket (a clash ZMQ would report as a bare "Address already in use", or not at
all), and :func:`socket_error` turns a bind or connect that fails later into one line that
names the argument.
"""

from __future__ import annotations

import argparse
import errno
import re
from typing import Final

import msgspec
import zmq

from kvbridge.adapters.endpoints import (
    Endpoint,
    EndpointError,
    Mode,
    clash,
    parse_endpoint,
    tcp_address,
)
from kvbridge.adapters.status_server import METRICS_HOST
from kvbridge.cli.usage import UsageError

__all__ = [
    "Use",
    "check_uses",
    "engine_mode",
    "offset",
    "socket_error",
    "source_mode",
    "source_uses",
]

_ORDINALS: Final = ("1st", "2nd", "3rd")


class Use(msgspec.Struct, frozen=True):
    """One socket a command will bind or connect, and the argument it comes from."""

    flag: str
    endpoint: Endpoint
    mode: Mode
    note: str = ""

    @property
    def address(self) -> str:
        """The address as ZMQ is given it (a wildcard host connected is its loopback:
        127.0.0.1, or ``[::1]`` for ``[::]``)."""
        return self.endpoint.dialled(self.mode)

    def describe(self) -> str:
        """The argument and address, for a message about a clash with this socket."""
        return f"{self.flag} {self.address}" + (f" ({self.note})" if self.note else "")


def source_mode(endpoint: Endpoint) -> Mode:
    """How kvbridge subscribes to a source: the prefix, else the opposite of the engine."""
    if endpoint.mode is not None:
        return endpoint.mode
    return "connect" if endpoint.engine_binds else "bind"


def engine_mode(endpoint: Endpoint) -> Mode:
    """How ``replay`` publishes, as the recorded engine would: the prefix, else vLLM's rule."""
    if endpoint.mode is not None:
        return endpoint.mode
    return "bind" if endpoint.engine_binds else "connect"


def offset(flag: str, endpoint: Endpoint, index: int, what: str, mode: Mode = "bind") -> Use:
    """The ``index``-th socket of an argument that the relay or replay offsets per stream."""
    try:
        shifted = endpoint.offset(index)
    except EndpointError as error:
        raise UsageError(
            f"argument {flag}: {error} (the {_ordinal(index + 1)} {what} goes on its port + "
            f"{index})"
        ) from None
    note = f"its port + {index}, for the {_ordinal(index + 1)} {what}" if index else ""
    return Use(flag, shifted, mode, note)


def _ordinal(n: int) -> str:
    return _ORDINALS[n - 1] if n <= len(_ORDINALS) else f"{n}th"


def source_uses(args: argparse.Namespace) -> list[Use]:
    """The sockets of ``--source`` and ``--source-replay``."""
    uses = [Use("--source", e, source_mode(e)) for e in args.source]
    uses += [Use("--source-replay", e, "connect") for e in args.source_replay or []]
    return uses


def check_uses(args: argparse.Namespace, uses: list[Use]) -> None:
    """Refuse two arguments that name the same socket; remember the uses to name the argument
    of a socket that fails to bind or connect."""
    port, host = getattr(args, "metrics_port", None), getattr(args, "metrics_host", None)
    if host is not None and port is None:
        raise UsageError("argument --metrics-host: serves nothing without --metrics-port")
    if port is not None:
        metrics = parse_endpoint(tcp_address(host or METRICS_HOST, port))
        uses = [*uses, Use("--metrics-port", metrics, "bind")]
    for index, use in enumerate(uses):
        for earlier in uses[:index]:
            if not clash(earlier.endpoint, earlier.mode, use.endpoint, use.mode):
                continue
            if earlier.flag == use.flag and not earlier.note and not use.note:
                raise UsageError(f"argument {use.flag}: {use.address} is given twice")
            own = f" ({use.note})" if use.note else ""
            raise UsageError(
                f"argument {use.flag}: {use.address}{own} is the same socket as "
                f"{earlier.describe()}"
            )
    args.uses = uses


def socket_error(args: argparse.Namespace, error: zmq.ZMQError) -> str:
    """A bind or connect that failed, as one line naming the argument."""
    text = str(error)
    match = re.search(r" \(addr='([^']*)'\)$", text)
    reason = text[: match.start()] if match else text
    address = match.group(1) if match else None
    for use in getattr(args, "uses", []):
        if use.address == address:
            line = f"argument {use.flag}: cannot {use.mode} {address}: {reason}"
            if error.errno == errno.EADDRNOTAVAIL and use.mode == "bind":
                line += f"; {address} is not an address of this host"
                if use.flag == "--source":
                    line += f" (to connect to an engine that binds it: connect:{address})"
            return line
    return reason if address is None else f"cannot use {address}: {reason}"
