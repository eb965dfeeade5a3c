"""Where the command's text goes: the report on stdout, which a reader may close, and the log
on stderr, so that ``kvbridge validate --format json | jq`` gets the report alone."""

from __future__ import annotations

import logging
import os
import sys

import structlog

__all__ = ["OutputError", "configure_logging", "silence_stdout", "stdout_failed", "write"]


def configure_logging(log_format: str) -> None:
    """structlog on stderr: key=value for a terminal (``console``) or one JSON object a line."""
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


class OutputError(Exception):
    """stdout could not be written (a full disk, an I/O error): the report is incomplete, a
    failure of the run rather than of its arguments. stdout is /dev/null from then on, so
    that the interpreter's last flush does not fail again."""


def write(text: str) -> bool:
    """Print to stdout; ``False`` if the reader has gone (stdout is then /dev/null).

    Raises:
        OutputError: stdout cannot be written for another reason.
    """
    try:
        print(text, flush=True)
    except BrokenPipeError:
        silence_stdout()
        return False
    except OSError as error:
        raise stdout_failed(error) from None
    return True


def stdout_failed(error: OSError) -> OutputError:
    """The :class:`OutputError` for a write to stdout that raised ``error``, stdout silenced."""
    silence_stdout()
    return OutputError(f"stdout: {error.strerror or error}")


def silence_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush does not fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
