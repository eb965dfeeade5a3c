"""Starting a local Ray for the tests, once more if its head was slow to come up.

``ray.init`` waits 30 s for its GCS server to publish its port and a fixed 30 s for its raylet
to register (Ray's ``node.py``); on a loaded 2-core machine either can run out while the node is
still starting (the GCS wait ran out once in a whole-suite run on an otherwise idle machine, with
no GCS log written). Both the router tests and the Serve LLM apps (run by the Serve LLM venv's
python, which imports nothing else of ``tests/``) start Ray through :func:`init_ray`.
"""

from __future__ import annotations

from typing import Any, Final

import ray

__all__ = ["STARTUP_TIMEOUTS", "init_ray"]

STARTUP_TIMEOUTS: Final = ("timed out during startup", "Timed out waiting for file")
"""What Ray's errors say when the raylet did not register in time, and when the GCS server did
not publish its port file in time."""


STARTS: Final = 3
"""Attempts at a start: a clean-clone run saw a retried start time out a second time."""


def init_ray(**options: Any) -> None:
    """``ray.init(**options)``; after a startup timeout, from scratch again, up to
    :data:`STARTS` attempts in all. Any other error, and the last timeout, are raised."""
    for attempt in range(1, STARTS + 1):
        try:
            ray.init(**options)
            return
        except Exception as error:
            timed_out = any(timeout in str(error) for timeout in STARTUP_TIMEOUTS)
            if not timed_out or attempt == STARTS:
                raise
            ray.shutdown()
