"""The argparse types of the command's arguments: each turns one string into a value or refuses
it with a message that quotes it, which argparse prefixes with the argument's name."""

from __future__ import annotations

import argparse
import math
import re
import threading
from collections.abc import Callable
from typing import Any

from kvbridge.adapters.endpoints import (
    MAX_HWM,
    Endpoint,
    EndpointError,
    parse_endpoint,
    tcp_address,
)
from kvbridge.adapters.publisher import MAX_BUFFER_STEPS
from kvbridge.adapters.subscriber import MAX_FRAME_BYTES, MIN_REPLAY_TIMEOUT_S
from kvbridge.normalizers import MAX_BLOCK_SIZE

__all__ = [
    "block_size",
    "buffer_steps",
    "endpoint",
    "frame_bytes",
    "hwm",
    "medium",
    "metrics_host",
    "non_negative_float",
    "non_negative_int",
    "path",
    "port",
    "positive_float",
    "positive_int",
    "topic",
    "u64",
]

_I64_MAX = 2**63 - 1


def endpoint(flag: str) -> Callable[[str], Endpoint]:
    """The argparse type of an endpoint argument: ``--source``, ``--source-replay``, the relay's
    ``--publish`` and ``--publish-replay``, or ``replay --publish``."""

    def parse(text: str) -> Endpoint:
        try:
            parsed = parse_endpoint(text)
        except EndpointError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        if parsed.transport == "inproc":
            raise argparse.ArgumentTypeError(
                f"inproc:// reaches only sockets of the same process: use tcp:// or ipc:// "
                f"({text!r})"
            )
        if flag == "--source-replay" and parsed.mode == "bind":
            raise argparse.ArgumentTypeError(
                f"kvbridge always connects to a replay endpoint (the engine binds it): "
                f"drop bind: ({text!r})"
            )
        if flag in ("relay --publish", "--publish-replay") and parsed.mode == "connect":
            raise argparse.ArgumentTypeError(
                f"the relay always binds its outputs (Dynamo connects to them): "
                f"drop connect: ({text!r})"
            )
        return parsed

    return parse


def _number(text: str, kind: Callable[[str], Any], low: float, high: float, what: str) -> Any:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None
    if value != value:  # nan
        raise argparse.ArgumentTypeError(f"not {what}: {text!r}")
    if value < low:
        raise argparse.ArgumentTypeError(f"must be at least {low}: {text!r}")
    if value > high:
        raise argparse.ArgumentTypeError(f"must be at most {high}: {text!r}")
    return value


def port(text: str) -> int:
    """A TCP port, 1 to 65535."""
    value: int = _number(text, int, 1, math.inf, "a port number")
    if value > 65535:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}")
    return value


def metrics_host(text: str) -> str:
    """The host of ``--metrics-host``, checked as an endpoint's host is: ``*``, an IPv4
    address, a host name, or an IPv6 address (in brackets or not; ``::`` for every interface).
    Returned as an endpoint writes it (an IPv6 address in brackets), ``*`` as ``0.0.0.0``."""
    try:
        parsed = parse_endpoint(tcp_address(text, 1))
    except EndpointError:
        raise argparse.ArgumentTypeError(
            f"not an IPv4 or IPv6 address, a host name or *: {text!r}"
        ) from None
    assert parsed.host is not None
    return "0.0.0.0" if parsed.host == "*" else parsed.host


def u64(text: str) -> int:
    """A worker id: Dynamo keeps it in 64 bits."""
    value: int = _number(text, int, 0, math.inf, "an integer")
    if value >= 2**64:
        raise argparse.ArgumentTypeError(f"does not fit in 64 bits: {text!r}")
    return value


def positive_float(text: str) -> float:
    """A duration or interval: above zero, and no longer than a timer can wait."""
    value: float = _number(text, float, -math.inf, threading.TIMEOUT_MAX, "a number")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """A wait that may be zero (not waiting), and no longer than a timer can wait."""
    value: float = _number(text, float, 0, threading.TIMEOUT_MAX, "a number")
    return value


def replay_timeout(text: str) -> float:
    """A replay timeout: whole milliseconds at least, as ZMQ waits."""
    value: float = _number(text, float, MIN_REPLAY_TIMEOUT_S, threading.TIMEOUT_MAX, "a number")
    return value


def _int_in(low: int, high: int, doc: str) -> Callable[[str], int]:
    """An integer type bounded on both sides: past ``high`` a socket option or the core would
    refuse the value with an overflow instead of a message."""

    def parse(text: str) -> int:
        value: int = _number(text, int, low, high, "an integer")
        return value

    parse.__doc__ = doc
    return parse


positive_int = _int_in(1, _I64_MAX, "A count or size: at least 1.")
non_negative_int = _int_in(0, _I64_MAX, "A size where 0 turns something off.")
block_size = _int_in(1, MAX_BLOCK_SIZE, "Tokens per KV block, as Dynamo keeps it (32 bits).")
frame_bytes = _int_in(1, MAX_FRAME_BYTES, "A frame size bound, as ZMQ's MAXMSGSIZE holds it.")
hwm = _int_in(1, MAX_HWM, "A ZMQ high-water mark, in messages (a C int).")
buffer_steps = _int_in(1, MAX_BUFFER_STEPS, "A replay buffer's size, in batches.")


def path(text: str) -> str:
    """A file's path: not empty (an empty one would mean the current directory)."""
    if not text:
        raise argparse.ArgumentTypeError("empty path")
    return text


def topic(text: str) -> str:
    """A ZMQ topic: it goes on the wire as UTF-8, so it must have an encoding (an argument of
    bytes that are not UTF-8 reaches Python with surrogates in it)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError(f"not valid UTF-8: {text!r}") from None
    return text


def medium(text: str) -> str:
    """A medium name as vLLM spells them (``GPU``, ``CPU``...), upper-cased, as
    :func:`~kvbridge.cli.validation.validate_captures` counts them."""
    if not re.fullmatch(r"[A-Za-z0-9_]+", text):
        raise argparse.ArgumentTypeError(f"not a medium: {text!r} (e.g. GPU, CPU, DISK)")
    return text.upper()
