"""The ``kv_transfer_config`` that runs vLLM's OffloadingConnector with the test-only CPU spec
of ``cpu_offload_spec.py``, for every script that starts engines with a CPU tier.

Imports nothing but the standard library, so that a driver that never loads vLLM can use it.
The engine processes import ``cpu_offload_spec`` by name: this directory must be on their
``PYTHONPATH``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

PLACEHOLDER_PORTS_KEY = "placeholder_kv_events_ports"
"""The test-only key of the connector's extra config that ``cpu_offload_spec`` reads."""


def kv_transfer_config(
    cpu_bytes: int, *, self_describing: bool, placeholder_ports: Sequence[int] = ()
) -> dict[str, Any]:
    """The connector's configuration: a CPU tier of ``cpu_bytes``, self-describing KV events
    or vLLM's placeholders, and (test-only, see ``cpu_offload_spec.py``) the KV-events ports of
    the engines that publish placeholders even though ``self_describing`` is set."""
    extra: dict[str, Any] = {
        "spec_name": "SyncCPUOffloadingSpec",
        "spec_module_path": "cpu_offload_spec",
        "cpu_bytes_to_use": cpu_bytes,
        "self_describing_kv_events": self_describing,
    }
    if placeholder_ports:
        extra[PLACEHOLDER_PORTS_KEY] = list(placeholder_ports)
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }
