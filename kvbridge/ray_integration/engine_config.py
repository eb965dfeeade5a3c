"""What a replica's vLLM engine needs to publish KV events a router can use: ports, engine
arguments and environment.

Plain helpers with no Ray in them, so that a replica, a launcher script or a test can build the
same engine configuration. Ports are found by :mod:`kvbridge.adapters.ports`.

The engine's event endpoint is a loopback address (``tcp://127.0.0.1:port``). By vLLM's rule the
engine then *connects* its PUB socket to it, and the replica's relay binds it: the raw stream
never leaves the host, and only the relay's canonical stream is published on the node's address.
vLLM always binds the replay endpoint, here on loopback too.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvbridge.adapters.ports import free_port_range

__all__ = [
    "KVEventPorts",
    "engine_env",
    "kv_events_config",
    "vllm_engine_kwargs",
]


class KVEventPorts(msgspec.Struct, frozen=True):
    """The four port ranges of one replica, each ``dp_size`` ports long.

    ``engine`` and ``engine_replay`` are the engine's PUB and replay ROUTER (loopback);
    ``relay`` and ``relay_replay`` are the relay's canonical PUB and replay ROUTER.
    """

    engine: int
    engine_replay: int
    relay: int
    relay_replay: int
    dp_size: int = 1

    @classmethod
    def allocate(cls, dp_size: int = 1) -> KVEventPorts:
        """Pick one free range of ``4 * dp_size`` consecutive ports and split it."""
        base = free_port_range(4 * dp_size)
        return cls(
            engine=base,
            engine_replay=base + dp_size,
            relay=base + 2 * dp_size,
            relay_replay=base + 3 * dp_size,
            dp_size=dp_size,
        )


def kv_events_config(ports: KVEventPorts, *, topic: str = "") -> dict[str, Any]:
    """vLLM's ``kv_events_config`` for an engine that publishes to the replica's relay."""
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{ports.engine}",
        "replay_endpoint": f"tcp://127.0.0.1:{ports.engine_replay}",
        "topic": topic,
    }


def vllm_engine_kwargs(
    ports: KVEventPorts,
    *,
    block_size: int | None = None,
    kv_offloading_backend: str | None = None,
    kv_offloading_size: float | None = None,
    topic: str = "",
    **engine_kwargs: Any,
) -> dict[str, Any]:
    """vLLM engine arguments (``AsyncEngineArgs`` keywords) for KV-aware routing.

    Adds ``kv_events_config`` (see :func:`kv_events_config`), turns prefix caching on (an engine
    without it publishes no events), and with ``kv_offloading_backend="native"`` and a
    ``kv_offloading_size`` (GiB) asks the OffloadingConnector for self-describing CPU events:
    its CPU stores then carry tokens and parents, so a consumer can index them without the GPU
    block they were copied from. ``engine_kwargs`` pass through; a ``kv_transfer_config`` among
    them is kept, with the offloading keys merged in.

    Raises:
        ValueError: ``enable_prefix_caching=False`` was asked for, or only one of the two
            offloading settings is given.
    """
    if engine_kwargs.get("enable_prefix_caching") is False:
        raise ValueError("KV-aware routing needs enable_prefix_caching=True (no events without)")
    if (kv_offloading_backend is None) != (kv_offloading_size is None):
        raise ValueError("give both kv_offloading_backend and kv_offloading_size, or neither")
    kwargs = dict(engine_kwargs)
    kwargs["enable_prefix_caching"] = True
    kwargs["kv_events_config"] = kv_events_config(ports, topic=topic)
    if ports.dp_size > 1:
        kwargs.setdefault("data_parallel_size", ports.dp_size)
    if block_size is not None:
        kwargs["block_size"] = block_size
    if kv_offloading_backend is not None:
        kwargs["kv_offloading_backend"] = kv_offloading_backend
        kwargs["kv_offloading_size"] = kv_offloading_size
        if kv_offloading_backend == "native":
            transfer = dict(kwargs.get("kv_transfer_config") or {})
            transfer.setdefault("kv_connector", "OffloadingConnector")
            transfer.setdefault("kv_role", "kv_both")
            extra = dict(transfer.get("kv_connector_extra_config") or {})
            extra["self_describing_kv_events"] = True
            transfer["kv_connector_extra_config"] = extra
            kwargs["kv_transfer_config"] = transfer
    return kwargs


def engine_env(*, hash_seed: str = "0", offloading: bool = False) -> dict[str, str]:
    """Environment for the engine process.

    ``PYTHONHASHSEED`` makes every replica hash the same tokens to the same block hashes (vLLM
    before 0.29 seeds them per process otherwise). kvbridge does not need it for its own index,
    which re-hashes block content, but a Dynamo fed raw events does. With ``offloading``,
    ``VLLM_USE_SIMPLE_KV_OFFLOAD=0`` keeps the OffloadingConnector, the one that publishes CPU
    events.
    """
    env = {"PYTHONHASHSEED": hash_seed}
    if offloading:
        env["VLLM_USE_SIMPLE_KV_OFFLOAD"] = "0"
    return env
