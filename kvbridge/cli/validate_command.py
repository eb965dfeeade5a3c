"""``kvbridge validate``: the arguments of :func:`~kvbridge.cli.validation.validate_captures` and
of the comparison with Dynamo (``--compare-dynamo``), and the exit status CI reads: 1 for an
invalid capture, or with ``--fail-on-dynamo-diff`` for a Dynamo that differs."""

from __future__ import annotations

import argparse

import msgspec

from kvbridge.adapters.capture import read_prompts
from kvbridge.adapters.dynamo_compare import MAX_COMPARED_BLOCK_SIZE, compare_captures
from kvbridge.cli.output import write
from kvbridge.cli.usage import UsageError
from kvbridge.cli.validation import Report, render_text, validate_captures

__all__ = ["run_validate"]


def run_validate(args: argparse.Namespace) -> int:
    """Validate the captures (and compare them in Dynamo if asked) and print the report, or
    with ``--json-schema`` print the report's schema instead."""
    if args.json_schema:
        if args.captures:
            raise UsageError("--json-schema prints the report's schema: give no capture")
        write(msgspec.json.format(msgspec.json.encode(msgspec.json.schema(Report))).decode())
        return 0
    if not args.captures:
        raise UsageError("give at least one capture")
    for flag, given in (("--prompts", args.prompts), ("--fail-on-dynamo-diff", args.fail_on_diff)):
        if given and not args.compare_dynamo:
            raise UsageError(f"{flag} goes with --compare-dynamo")
    if args.compare_dynamo and (args.block_size or 0) > MAX_COMPARED_BLOCK_SIZE:
        raise UsageError(
            f"--compare-dynamo takes a block size of at most {MAX_COMPARED_BLOCK_SIZE}, "
            f"got --block-size {args.block_size}"
        )
    prompts = None if args.prompts is None else read_prompts(args.prompts)
    report = validate_captures(
        args.captures,
        strict=args.strict,
        block_size=args.block_size,
        allow_empty=args.allow_empty,
        min_frames=args.min_frames or 0,
        require_media=args.require_medium or (),
    )
    if args.compare_dynamo:
        comparison = compare_captures(args.captures, block_size=args.block_size, prompts=prompts)
        report = msgspec.structs.replace(report, dynamo=comparison)
    if args.format == "json":
        write(msgspec.json.format(msgspec.json.encode(report)).decode())
    else:
        write(render_text(report))
    differs = args.fail_on_diff and report.dynamo is not None and report.dynamo.differs
    return 0 if report.valid and not differs else 1
