"""``kvbridge watch``: a :class:`~kvbridge.cli.watch_view.WatchView` of live sources, redrawn
every ``--interval`` seconds: in place on a terminal, or as plain tables one after another when
stdout is a pipe or a file, so that ``kvbridge watch ... | tee`` keeps a readable log."""

from __future__ import annotations

import argparse
import shutil
import sys
import time

from kvbridge.adapters.relay import Relay
from kvbridge.cli import live
from kvbridge.cli.output import stdout_failed, write
from kvbridge.cli.sockets import check_uses, source_uses
from kvbridge.cli.watch_view import WatchView, require_rich

__all__ = ["run_watch"]


def run_watch(args: argparse.Namespace) -> int:
    """Watch until SIGINT, SIGTERM, ``--duration`` or a reader that closes stdout."""
    require_rich()
    sources = live.sources(args)
    check_uses(args, source_uses(args))
    with (
        Relay(
            sources,
            block_size=args.block_size,
            replay_on_start=True,
            **live.stream_options(args),
        ) as relay,
        live.metrics_served(args, relay),
    ):
        stop = live.until(args)
        view = WatchView(relay)
        silence = live.silence(sources)

        def wait() -> None:
            deadline = time.monotonic() + args.interval
            while not stop.is_set() and time.monotonic() < deadline:
                view.poll(50)
                silence.check(view.delivered())

        if sys.stdout.isatty():
            from rich.live import Live

            try:
                with Live(auto_refresh=False, vertical_overflow="crop") as screen:
                    while not stop.is_set():
                        wait()
                        screen.update(view.renderable(), refresh=True)
            except OSError as error:  # the terminal went away
                raise stdout_failed(error) from None
        else:
            width = shutil.get_terminal_size((120, 24)).columns
            while not stop.is_set():
                wait()
                if not write(view.render(width) + "\n"):
                    break
    return 0
