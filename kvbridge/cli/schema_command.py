"""``kvbridge schema``: print the JSON Schema of every vLLM layout and of Dynamo's event, for
tools outside Python that check streams against the same types kvbridge decodes with."""

from __future__ import annotations

import argparse

import msgspec

from kvbridge.cli.output import write
from kvbridge.schemas.export import json_schema

__all__ = ["run_schema"]


def run_schema(args: argparse.Namespace) -> int:
    """Print the schema, indented; a reader that closes stdout early ends the command quietly."""
    write(msgspec.json.format(msgspec.json.encode(json_schema()), indent=2).decode())
    return 0
