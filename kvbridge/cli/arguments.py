"""The argparse types of the command's arguments: each turns one string into a value or refuses
it with a message that quotes it, which argparse prefixes with the argument's name."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from typing import Any

from kvbridge.adapters.endpoints import Endpoint, EndpointError, parse_endpoint

__all__ = [
    "endpoint",
    "medium",
    "non_negative_float",
    "port",
    "positive_float",
    "positive_int",
    "u64",
]


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


def _number(text: str, kind: Callable[[str], Any], low: float, what: str) -> Any:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be at least {low}: {text!r}")
    return value


def port(text: str) -> int:
    """A TCP port, 1 to 65535."""
    value: int = _number(text, int, 1, "a port number")
    if value > 65535:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}")
    return value


def u64(text: str) -> int:
    """A worker id: Dynamo keeps it in 64 bits."""
    value: int = _number(text, int, 0, "an integer")
    if value >= 2**64:
        raise argparse.ArgumentTypeError(f"does not fit in 64 bits: {text!r}")
    return value


def positive_float(text: str) -> float:
    """A duration or interval: finite and above zero."""
    value: float = _number(text, float, float("-inf"), "a number")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """A wait that may be zero (not waiting), but not infinite."""
    value: float = _number(text, float, 0, "a number")
    if value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be finite: {text!r}")
    return value


def positive_int(text: str) -> int:
    """A count or size: at least 1."""
    value: int = _number(text, int, 1, "an integer")
    return value


def non_negative_int(text: str) -> int:
    """A size where 0 turns something off."""
    value: int = _number(text, int, 0, "an integer")
    return value


def medium(text: str) -> str:
    """A medium name as vLLM spells them (``GPU``, ``CPU``...), upper-cased, as
    :func:`~kvbridge.cli.validation.validate_captures` counts them."""
    if not re.fullmatch(r"[A-Za-z0-9_]+", text):
        raise argparse.ArgumentTypeError(f"not a medium: {text!r} (e.g. GPU, CPU, DISK)")
    return text.upper()
