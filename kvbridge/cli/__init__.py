"""The ``kvbridge`` command, the top layer: it may import everything, and nothing imports it.

Exit codes: 0 when the command did its job, 1 for invalid data (``validate`` found a bad frame or
an unmet requirement; a file that is not a readable capture), a relay that stopped on an error
in its loop (:func:`.live.loop_failures`) or output that could not be written once the command
ran (a capture or stdout on a full disk), 2 for bad usage (an argument that is wrong, missing,
repeated or refused, an endpoint that cannot be bound or connected, a missing file, an output
file that cannot be created, a missing extra). Errors are one line on stderr; a reader that has
gone (``kvbridge schema | head``, or of a FIFO given as a capture) ends the command quietly.

The modules: :mod:`.parser` (every command's arguments) with the argument types in
:mod:`.arguments`; one ``*_command`` module per command (not ``relay.py``: that is the
:class:`~kvbridge.adapters.relay.Relay` itself); the two features that exist only for the
command, :mod:`.validation` (``validate``) and :mod:`.watch_view` (``watch``); and what the
commands share: :mod:`.sockets` (the sockets checked before any is opened), :mod:`.live`
(sources, stop, metrics), :mod:`.output` (stdout and the log) and :mod:`.usage` (the errors
that exit with 2).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

import zmq

from kvbridge.adapters.capture import CaptureError, CaptureWriteError
from kvbridge.adapters.endpoints import EndpointError
from kvbridge.cli.output import OutputError, configure_logging, silence_stdout
from kvbridge.cli.parser import build_parser
from kvbridge.cli.sockets import socket_error
from kvbridge.cli.usage import MissingExtra, UsageError

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command and return its exit status, every failure turned into one line on
    stderr and the status the module docstring gives it."""
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:  # said by the command's parser, so that the line names the command
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    configure_logging(args.log_format)
    run: Callable[[argparse.Namespace], int] = args.run
    prefix = f"kvbridge {args.command}: error:"
    try:
        return run(args)
    except BrokenPipeError:
        silence_stdout()
        return 0
    except (CaptureError, OutputError) as error:
        print(f"{prefix} {error}", file=sys.stderr)
        return 1
    except zmq.ZMQError as error:
        print(f"{prefix} {socket_error(args, error)}", file=sys.stderr)
        return 2
    except OSError as error:
        where = f"{error.filename}: " if error.filename is not None else ""
        print(f"{prefix} {where}{error.strerror or error}", file=sys.stderr)
        return 1 if isinstance(error, CaptureWriteError) else 2  # a run cut short, or usage
    except (UsageError, MissingExtra, EndpointError, ValueError) as error:
        print(f"{prefix} {error}", file=sys.stderr)
        return 2
    except RuntimeError as error:
        print(f"{prefix} {error}", file=sys.stderr)
        return 1
    except MemoryError:
        print(f"{prefix} out of memory", file=sys.stderr)
        return 1
    except SystemExit as exit_:
        if isinstance(exit_.code, str):  # a usage error raised with its message
            print(exit_.code, file=sys.stderr)
            return 2
        raise
