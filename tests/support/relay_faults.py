"""Faults injected into a relay, as test doubles of a bug: no input is known to make a relay's
threads raise, so a test that shows what happens when one does replaces a method with one that
raises."""

from __future__ import annotations

import time
from typing import NoReturn

from kvbridge.adapters.relay import Relay
from support.polling import wait_until

__all__ = ["fault", "inject_step_fault", "stopped"]


def fault(*_: object) -> NoReturn:
    """Raises ``RuntimeError('injected fault')``, whatever it is called with."""
    raise RuntimeError("injected fault")


def inject_step_fault(relay: Relay) -> None:
    """The relay's next step raises, which ends the thread that runs it."""
    relay.step = fault  # type: ignore[method-assign]


def stopped(relay: Relay) -> Relay:
    """``relay``, once its failure is known (within 5 s)."""
    wait_until(lambda: relay.failure is not None, lambda: time.sleep(0.01), lambda: "no failure")
    return relay
