"""The ``kvbridge`` command."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path
from typing import NoReturn

import structlog

from kvbridge.adapters.capture import CaptureError, CaptureReader
from kvbridge.adapters.dynamo import TieredIndex
from kvbridge.normalizers import Normalizer
from kvbridge.schemas import SchemaError, decode_batch

__all__ = ["main"]

log = structlog.get_logger("kvbridge")


class _Parser(argparse.ArgumentParser):
    """Reports a bad argument in one line and exits with status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _configure_logging(log_format: str) -> None:
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if log_format == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )


def _sample_capture() -> Path:
    return Path(str(resources.files("kvbridge") / "data" / "sample.kvcap"))


def _demo(args: argparse.Namespace) -> int:
    """Decode and index a capture, then print each prompt's overlap per worker and tier."""
    path = Path(args.capture) if args.capture else _sample_capture()
    reader = CaptureReader(path)
    block_size = args.block_size or reader.meta.get("block_size")
    if not block_size:
        raise SystemExit("kvbridge demo: error: the capture names no block size; pass --block-size")
    index = TieredIndex(block_size)
    normalizers: dict[int, Normalizer] = {}
    bad = 0
    for record in reader:
        normalizer = normalizers.setdefault(
            record.worker_id, Normalizer(record.worker_id, block_size)
        )
        try:
            batch = decode_batch(record.frames[-1])
        except SchemaError as error:
            bad += 1
            log.warning("bad frame", stream=record.stream, seq=record.seq, error=str(error))
            continue
        index.apply(normalizer.normalize(batch, record.seq))
    print(f"{path.name}: {sum(1 for _ in reader)} messages, {bad} bad, block size {block_size}")
    for worker_id, normalizer in sorted(normalizers.items()):
        drops = ", ".join(f"{k}={v}" for k, v in sorted(normalizer.stats.items())) or "none"
        print(f"worker {worker_id}: not forwarded: {drops}")
    prompts = reader.meta.get("prompts", [])
    print(
        f"\n{'prompt':<16}{'blocks':>7}  {'worker':>6}{'dp':>4}{'device':>8}{'host':>6}{'disk':>6}"
    )
    for prompt in prompts:
        tokens = prompt["token_ids"]
        overlaps = index.overlap(tokens)
        name, blocks = prompt["name"], len(tokens) // block_size
        if not overlaps:
            print(f"{name:<16}{blocks:>7}  {'-':>6}")
        for (worker_id, dp_rank), overlap in overlaps.items():
            print(
                f"{name:<16}{blocks:>7}  {worker_id:>6}{dp_rank:>4}"
                f"{overlap.device:>8}{overlap.host_pinned:>6}{overlap.disk:>6}"
            )
    return 0


def _parser() -> argparse.ArgumentParser:
    common = _Parser(add_help=False)
    common.add_argument("--log-format", choices=("console", "json"), default="console")
    parser = _Parser(prog="kvbridge", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    demo = commands.add_parser(
        "demo",
        parents=[common],
        help="index a capture (the bundled sample by default) and print per-tier overlap",
    )
    demo.add_argument("capture", nargs="?", help="a .kvcap file (default: the bundled sample)")
    demo.add_argument("--block-size", type=_positive_int, help="override the capture's block size")
    demo.set_defaults(run=_demo)
    return parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _configure_logging(args.log_format)
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        return run(args)
    except (CaptureError, OSError) as error:
        print(f"kvbridge {args.command}: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
