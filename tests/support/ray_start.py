"""Starting a local Ray for the tests, once more if its raylet was slow to come up.

``ray.init`` waits a fixed 30 s for its raylet to register (Ray's ``node.py``); on a loaded
2-core machine that can run out while the node is still starting. Both the router tests and the
Serve LLM apps (run by the Serve LLM venv's python, which imports nothing else of ``tests/``)
start Ray through :func:`init_ray`.
"""

from __future__ import annotations

from typing import Any, Final

import ray

__all__ = ["init_ray"]

STARTUP_TIMEOUT: Final = "timed out during startup"
"""What Ray's error says when the raylet did not register in time."""


def init_ray(**options: Any) -> None:
    """``ray.init(**options)``; after a startup timeout, from scratch once more. Any other
    error, and a second timeout, are raised."""
    try:
        ray.init(**options)
    except Exception as error:
        if STARTUP_TIMEOUT not in str(error):
            raise
        ray.shutdown()
        ray.init(**options)
