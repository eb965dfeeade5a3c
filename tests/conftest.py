"""Set-up for the whole suite.

Dynamo's Rust core logs at INFO to stderr (coloured), and pytest shows that in the middle of its
progress output. Dynamo reads its filter, ``DYN_LOG`` (``RUST_LOG`` syntax: ``warn``,
``dynamo_kv_router=debug``...), once, when ``dynamo`` is first imported: this file is loaded
before any test module imports it, and the subprocesses the tests start (relays, Dynamo's
standalone services) inherit it. Set ``DYN_LOG`` yourself to see more.

``ctx`` is a ZMQ context of the test's own, destroyed (without lingering) when the test ends,
so that no socket a failed test left open can hold a port or a thread for the next one.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import zmq

os.environ.setdefault("DYN_LOG", "warn")


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)
