"""Argument types the benchmarks share: a size that is not positive (or a count that is
negative) is one ``error:`` line from argparse and exit 2, not a traceback from deep in a run."""

from __future__ import annotations

import argparse
from typing import TypeVar

_Number = TypeVar("_Number", int, float)


def positive_int(text: str) -> int:
    """An int of at least 1: blocks, repetitions, iterations, a block size."""
    return _at_least(int, text, 1, "positive")


def non_negative_int(text: str) -> int:
    """An int of at least 0: an untimed warm-up, say."""
    return _at_least(int, text, 0, "0 or more")


def positive_float(text: str) -> float:
    """A float above 0: seconds of a slice, a rate, a poll interval."""
    value = _at_least(float, text, 0.0, "positive")
    if value == 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """A float of at least 0: seconds to settle or warm up."""
    return _at_least(float, text, 0.0, "0 or more")


def _at_least(kind: type[_Number], text: str, low: _Number, what: str) -> _Number:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    if not value >= low:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
    return value
