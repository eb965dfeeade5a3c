"""Capture files written byte by byte, unchecked: what no CaptureWriter would write, for the
tests of what reading one refuses."""

from __future__ import annotations

from pathlib import Path

import msgspec

from kvbridge.adapters.capture import MAGIC

HEADER = {"format": "kvcap", "version": 2, "created_ns": 0}
"""A header as CaptureWriter writes it, without meta."""


def raw_capture(path: Path, header: dict[str, object], records: list[object]) -> Path:
    """A capture whose header and records are written as given, unchecked."""
    bodies = [msgspec.msgpack.encode(header), *map(msgspec.msgpack.encode, records)]
    path.write_bytes(MAGIC + b"".join(len(body).to_bytes(4, "big") + body for body in bodies))
    return path
