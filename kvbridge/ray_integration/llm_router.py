"""``DynamoLLMRouter``: :class:`DynamoKVRouter` for Ray Serve LLM, every stream through kvbridge.

Ray 2.60's ``LLMServer`` configures vLLM's KV events, and advertises them in its routing stats as
``kv_event_metadata``, only when the deployment's request router is a subclass of Ray's own
``KVAwareRouter``. :class:`DynamoLLMRouter` is both, so Ray's configuration works with only the
class name changed::

    LLMConfig(
        ...,
        deployment_config={"request_router_config": RequestRouterConfig(
            request_router_class=DynamoLLMRouter)},
        engine_kwargs={"enable_prefix_caching": True, ...},
    )

Those adverts name the engine's *raw* vLLM streams. The router never registers them with Dynamo
as they are: a :class:`RelayHop` runs one :class:`~kvbridge.adapters.relay.Relay` per replica in
the router's process, subscribed to the replica's stream (and its replay socket), and registers
the relay's loopback endpoints instead. Dynamo's ``SelectionService`` therefore indexes
kvbridge's canonical stream: engine hashes rewritten to Dynamo's, CPU placeholders resolved,
tiers reference-counted. Replicas that advertise kvbridge's own canonical streams
(:class:`~kvbridge.ray_integration.KVEventsReplica`) are registered directly, as before.

A text completion or chat request is tokenized in the router exactly as the deployment's vLLM
will tokenize it (:class:`~kvbridge.ray_integration.tokenize.VllmTokenizer`, built once per
process from the deployment's own ``LLMConfig``, on a thread of its own), unless a
``tokenizer`` hook is given in ``request_router_kwargs``.

Importing ``ray.serve.llm`` loads vLLM (15 s or more), so this module imports it only when
:data:`DynamoLLMRouter` is first looked up; :class:`RelayHop` needs neither.

Ray pickles a router's module by value, which copies its globals: the hop of a deployment is
kept on that deployment's :class:`~kvbridge.ray_integration.RoutingState` (one per process),
which lives in a module Ray pickles by reference.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final, cast

import structlog

from kvbridge.adapters.endpoints import tcp_address
from kvbridge.adapters.relay import Relay
from kvbridge.adapters.source import Source
from kvbridge.ray_integration.advert import KVEventsAdvert, read_advert
from kvbridge.ray_integration.prompt import TOKEN_FIELDS, _field
from kvbridge.ray_integration.routing import RoutingState, worker_id_for
from kvbridge.ray_integration.tokenize import VllmTokenizer

if TYPE_CHECKING:
    from kvbridge.ray_integration.kv_router import DynamoKVRouter

    DynamoLLMRouter: type[DynamoKVRouter]

__all__ = ["HOP_KEY", "DynamoLLMRouter", "RelayHop", "llm_tokenizer", "relay_hop"]

RELAY_HOST: Final = "127.0.0.1"
"""Where the router-side relays publish: loopback, for the router's own Dynamo only."""

HOP_KEY: Final = "kvbridge_relay_hop"
"""The relay hop's key on its :class:`RoutingState` (:meth:`RoutingState.attachment`)."""
_TOKENIZER_KEY: Final = "kvbridge_vllm_tokenizer"


class _Relayed:
    """One replica's raw advert, the relay that republishes it, and the advert Dynamo gets."""

    __slots__ = ("advert", "raw", "relay", "stats")

    def __init__(self, raw: KVEventsAdvert, relay: Relay, advert: KVEventsAdvert) -> None:
        self.raw = raw
        self.relay = relay
        self.advert = advert
        self.stats: dict[str, Any] = advert.routing_stats()


class RelayHop:
    """Turns replicas' raw vLLM adverts into adverts of kvbridge relays running in this process.

    :meth:`translate` maps ``{replica id: routing stats}`` as Serve reports them to the stats the
    registry should see: a raw advert (Ray Serve LLM's ``kv_event_metadata``) becomes a
    canonical advert naming the loopback endpoints of a relay that subscribes to the raw stream
    (started on first sight, replaced when the advert changes, closed when the replica leaves);
    anything else passes unchanged. The same input object maps to the same output object, so
    the registry's check for unchanged stats (by identity) stays cheap.

    Args:
        host: the address the relays publish on (loopback by default).
    """

    def __init__(self, host: str = RELAY_HOST) -> None:
        self.host = host
        self._lock = threading.Lock()
        self._relayed: dict[str, _Relayed] = {}
        self._seen: dict[str, tuple[Mapping[str, Any], Mapping[str, Any]]] = {}
        self.started = 0
        """Relays started (a replica whose advert changed, or whose relay failed, counts
        again)."""
        self.closed = 0
        self.failed = 0
        """Relays found stopped on an error: each is closed, and its replica relayed anew."""

    def translate(
        self, replicas: Mapping[str, Mapping[str, Any] | None], *, complete: bool
    ) -> dict[str, Mapping[str, Any] | None]:
        """The stats to register for ``replicas``; with ``complete`` (every replica of the
        deployment is listed), the relays of replicas not listed are closed. A relay that
        stopped on an error is replaced by a new one, on new ports: the registry sees a new
        advert, so the router's Dynamo drops the stalled stream and subscribes to the new."""
        out: dict[str, Mapping[str, Any] | None] = {}
        stale: list[Relay] = []
        with self._lock:
            for replica_id, relayed in list(self._relayed.items()):
                if relayed.relay.failure is not None:
                    structlog.get_logger("kvbridge.ray.llm_router").warning(
                        "relay stopped, replaced", replica=replica_id, error=relayed.relay.failure
                    )
                    self.failed += 1
                    stale.append(self._relayed.pop(replica_id).relay)
                    self._seen.pop(replica_id, None)
            for replica_id, stats in replicas.items():
                seen = self._seen.get(replica_id)
                if stats is not None and seen is not None and seen[0] is stats:
                    out[replica_id] = seen[1]
                    continue
                translated, replaced = self._translate(replica_id, stats)
                if replaced is not None:
                    stale.append(replaced)
                if stats is not None:
                    self._seen[replica_id] = (stats, translated)  # type: ignore[assignment]
                out[replica_id] = translated
            if complete:
                for replica_id in [r for r in self._seen if r not in replicas]:
                    del self._seen[replica_id]
                for replica_id in [r for r in self._relayed if r not in replicas]:
                    stale.append(self._relayed.pop(replica_id).relay)
        self._close(stale)
        return out

    def forget(self, replica_id: str) -> None:
        """Close the relay of a replica that died."""
        with self._lock:
            self._seen.pop(replica_id, None)
            relayed = self._relayed.pop(replica_id, None)
        self._close([] if relayed is None else [relayed.relay])

    def endpoints(self, replica_id: str) -> KVEventsAdvert | None:
        """The advert registered for ``replica_id`` in place of its raw one, if relayed."""
        with self._lock:
            relayed = self._relayed.get(replica_id)
        return None if relayed is None else relayed.advert

    def relay(self, replica_id: str) -> Relay | None:
        """The relay of ``replica_id``, if it has one (for its stats)."""
        with self._lock:
            relayed = self._relayed.get(replica_id)
        return None if relayed is None else relayed.relay

    def close(self) -> None:
        """Close every relay. Idempotent."""
        with self._lock:
            relays = [relayed.relay for relayed in self._relayed.values()]
            self._relayed.clear()
            self._seen.clear()
        self._close(relays)

    def _translate(
        self, replica_id: str, stats: Mapping[str, Any] | None
    ) -> tuple[Mapping[str, Any] | None, Relay | None]:
        try:
            raw = read_advert(stats)
        except ValueError:
            return stats, None  # the registry rejects it, and counts why
        if raw is None or raw.canonical:
            return stats, None
        current = self._relayed.get(replica_id)
        if current is not None and current.raw == raw:
            return current.stats, None
        relayed = self._start(replica_id, raw)
        self._relayed[replica_id] = relayed
        return relayed.stats, None if current is None else current.relay

    def _start(self, replica_id: str, raw: KVEventsAdvert) -> _Relayed:
        worker_id = worker_id_for(replica_id)
        # The advert names the node's address of a socket vLLM binds (tcp://*): connect to it.
        sources = [
            Source(
                endpoint=raw.endpoints[rank],
                replay_endpoint=raw.replay_endpoints.get(rank),
                worker_id=worker_id,
                bind=False,
            )
            for rank in raw.dp_ranks
        ]
        endpoints: dict[int, str] = {}
        replays: dict[int, str] = {}
        relays: list[Relay] = []
        # One relay per rank: each output gets its own ephemeral ports (a relay offsets the
        # ports of several sources from one base, which an ephemeral port cannot give).
        for rank, source in zip(raw.dp_ranks, sources, strict=True):
            relay = Relay(
                [source],
                block_size=raw.block_size,
                publish=tcp_address(self.host, "*"),
                publish_replay=tcp_address(self.host, "*"),
                replay_on_start=source.replay_endpoint is not None,
            )
            relays.append(relay)
            endpoint, replay = relay.endpoints(source)
            endpoints[rank] = endpoint
            if replay is not None:
                replays[rank] = replay
        if len(relays) != 1:
            for relay in relays:
                relay.close()
            raise ValueError(f"replica {replica_id}: one dp rank per replica, got {raw.dp_ranks}")
        relay = relays[0]
        relay.start()
        self.started += 1
        advert = KVEventsAdvert(
            endpoints=endpoints,
            block_size=raw.block_size,
            replay_endpoints=replays,
            canonical=True,
        )
        structlog.get_logger("kvbridge.ray.llm_router").info(
            "relaying a raw vLLM stream",
            replica=replica_id,
            raw=raw.endpoints,
            relayed=endpoints,
            block_size=raw.block_size,
        )
        return _Relayed(raw, relay, advert)

    def _close(self, relays: list[Relay]) -> None:
        for relay in relays:
            relay.close()
            self.closed += 1


def relay_hop(state: RoutingState) -> RelayHop:
    """The hop of ``state``'s deployment in this process (created on first use).

    Kept on the state (:meth:`RoutingState.attached`), not in this module, whose globals Ray
    copies.
    """
    # Another copy of this module may have made it: the same class by value, not by identity.
    return cast(RelayHop, state.attached(HOP_KEY, RelayHop))


def llm_tokenizer(state: RoutingState, app_name: str, deployment_name: str) -> VllmTokenizer:
    """The deployment's :class:`~kvbridge.ray_integration.tokenize.VllmTokenizer` in this
    process, built once from the deployment's own ``LLMConfig`` (read from Serve's controller
    on the tokenizer's thread, never on Serve's loop)."""

    def load() -> tuple[Any, Mapping[str, Any]]:
        from ray import serve
        from ray.llm._internal.serve.engines.vllm.vllm_engine import _get_vllm_engine_config

        client = serve.context._get_global_client()
        assert client is not None, "no Serve controller in this process"
        info, _ = client.get_deployment_info(deployment_name, app_name)
        config = info.replica_config
        llm_config = (config.init_kwargs or {}).get("llm_config")
        if llm_config is None and config.init_args:
            llm_config = config.init_args[0]
        if llm_config is None:
            raise ValueError(f"{app_name}#{deployment_name} was not built with an llm_config")
        _, vllm_config = _get_vllm_engine_config(llm_config, device_type="cpu")
        return vllm_config, dict(llm_config.get_engine_config().frontend_kwargs)

    return cast(VllmTokenizer, state.attached(_TOKENIZER_KEY, lambda: VllmTokenizer(load)))


def _needs_text_tokens(body: Any) -> bool:
    """A text prompt or chat messages, and no token ids the router could read instead."""
    if any(_field(body, name) is not None for name in TOKEN_FIELDS):
        return False
    return isinstance(_field(body, "prompt"), str) or _field(body, "messages") is not None


def _make_router_class() -> type[DynamoKVRouter]:
    # Loads vLLM: only when the class is first asked for.
    from ray.serve.llm.request_router import KVAwareRouter
    from ray.serve.request_router import PendingRequest, RunningReplica

    from kvbridge.ray_integration.kv_router import DynamoKVRouter

    class DynamoLLMRouter(DynamoKVRouter, KVAwareRouter):
        """:class:`DynamoKVRouter` that Ray Serve LLM's engines publish KV events for, with
        their raw streams relayed through kvbridge in this process (see the module's
        documentation), and text and chat requests tokenized as the deployment's vLLM will
        tokenize them. Configure it like Ray's ``KVAwareRouter``; its
        ``request_router_kwargs`` are :class:`DynamoKVRouter`'s (a ``tokenizer`` hook given
        there replaces vLLM's renderer)."""

        def initialize_state(self, **kwargs: Any) -> None:
            super().initialize_state(**kwargs)
            self._hop = relay_hop(self._routing)
            self._text_tokens: dict[int, list[int] | None] = {}
            self._vllm_tokenizer: VllmTokenizer | None = None
            if self._tokenizer is None:
                self._vllm_tokenizer = llm_tokenizer(
                    self._routing, self._deployment_id.app_name, self._deployment_id.name
                )
                self._tokenizer = self._rendered_tokens
            self._routing = _RelayedRouting(self._routing, self._hop)  # type: ignore[assignment]

        def _rendered_tokens(self, body: Any) -> list[int] | None:
            return self._text_tokens.get(id(body))

        async def choose_replicas(
            self,
            candidate_replicas: list[RunningReplica],
            pending_request: PendingRequest | None = None,
        ) -> list[list[RunningReplica]]:
            body = pending_request.args[0] if pending_request and pending_request.args else None
            if self._vllm_tokenizer is None or body is None or not _needs_text_tokens(body):
                return await super().choose_replicas(candidate_replicas, pending_request)
            key = id(body)
            if key not in self._text_tokens:
                try:
                    tokens = await asyncio.wrap_future(self._vllm_tokenizer.submit(body))
                except Exception as error:
                    tokens = None
                    self._routing.stats.registry.tokenize_failed += 1
                    structlog.get_logger("kvbridge.ray.llm_router").warning(
                        "tokenizing failed", error=str(error)
                    )
                self._text_tokens[key] = tokens
            try:
                return await super().choose_replicas(candidate_replicas, pending_request)
            finally:
                self._text_tokens.pop(key, None)

    DynamoLLMRouter.__module__ = __name__
    DynamoLLMRouter.__qualname__ = "DynamoLLMRouter"
    return DynamoLLMRouter


class _RelayedRouting:
    """A deployment's :class:`RoutingState` as a router sees it: registry calls go through the
    hop first (raw adverts become relayed ones); everything else is the state's own."""

    def __init__(self, state: RoutingState, hop: RelayHop) -> None:
        self._state = state
        self._hop = hop

    def sync(self, replicas: Mapping[str, Mapping[str, Any] | None], *, complete: bool) -> Any:
        return self._state.sync(self._hop.translate(replicas, complete=complete), complete=complete)

    def forget(self, replica_id: str) -> Any:
        self._hop.forget(replica_id)
        return self._state.forget(replica_id)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._state, name)


_ROUTER_CLASS: type[DynamoKVRouter] | None = None


def __getattr__(name: str) -> Any:
    global _ROUTER_CLASS
    if name == "DynamoLLMRouter":
        if _ROUTER_CLASS is None:
            _ROUTER_CLASS = _make_router_class()
        return _ROUTER_CLASS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
