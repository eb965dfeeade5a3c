"""The errors that mean the user must change the command line or the install: exit status 2.

argparse reports what it can check by itself; these carry what it cannot, so that
:func:`kvbridge.cli.main` prints them as one line, as it prints argparse's.
"""

from __future__ import annotations

__all__ = ["MissingExtra", "UsageError"]


class UsageError(Exception):
    """A combination of arguments argparse cannot check by itself."""


class MissingExtra(RuntimeError):
    """An optional dependency is not installed; the message names the extra."""
