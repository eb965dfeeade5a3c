"""Set-up for the whole suite.

Dynamo's Rust core logs at INFO to stderr (coloured), and pytest shows that in the middle of its
progress output. Dynamo reads its filter, ``DYN_LOG`` (``RUST_LOG`` syntax: ``warn``,
``dynamo_kv_router=debug``...), once, when ``dynamo`` is first imported: this file is loaded
before any test module imports it, and the subprocesses the tests start (relays, Dynamo's
standalone services) inherit it. Set ``DYN_LOG`` yourself to see more.
"""

from __future__ import annotations

import os

os.environ.setdefault("DYN_LOG", "warn")
