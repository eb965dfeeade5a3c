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
as they are: a :class:`~kvbridge.ray_integration.relay_hop.RelayHop` runs one
:class:`~kvbridge.adapters.relay.Relay` per replica in the router's process, subscribed to the
replica's stream (and its replay socket), and registers the relay's loopback endpoints instead
(a relay that stopped on an error is replaced, looked for before each request). Dynamo's
``SelectionService`` therefore indexes kvbridge's canonical stream: engine hashes rewritten to
Dynamo's, CPU placeholders resolved, tiers reference-counted. Replicas that advertise
kvbridge's own canonical streams (:class:`~kvbridge.ray_integration.KVEventsReplica`) are
registered directly, as before.

A text completion or chat request is tokenized in the router exactly as the deployment's vLLM
will tokenize it (:class:`~kvbridge.ray_integration.tokenize.VllmTokenizer`, built once per
process from the deployment's own ``LLMConfig``, on a thread of its own), unless a
``tokenizer`` hook is given in ``request_router_kwargs``.

Importing ``ray.serve.llm`` loads vLLM (15 s or more), so this module imports it only when
:data:`DynamoLLMRouter` is first looked up; the relay hop needs neither.

Ray pickles a router's module by value, which copies its globals: the hop of a deployment is
kept on that deployment's :class:`~kvbridge.ray_integration.RoutingState` (one per process),
which lives in a module Ray pickles by reference.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final, cast

import structlog

from kvbridge.ray_integration.prompt import TOKEN_FIELDS, _field
from kvbridge.ray_integration.relay_hop import RelayHop, relay_hop
from kvbridge.ray_integration.routing import RoutingState
from kvbridge.ray_integration.tokenize import VllmTokenizer

if TYPE_CHECKING:
    from kvbridge.ray_integration.kv_router import DynamoKVRouter

    DynamoLLMRouter: type[DynamoKVRouter]

__all__ = ["DynamoLLMRouter", "llm_tokenizer"]

_TOKENIZER_KEY: Final = "kvbridge_vllm_tokenizer"


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
            self._relayed_routing = _RelayedRouting(self._routing, self._hop)
            self._routing = self._relayed_routing  # type: ignore[assignment]

        def _rendered_tokens(self, body: Any) -> list[int] | None:
            return self._text_tokens.get(id(body))

        async def choose_replicas(
            self,
            candidate_replicas: list[RunningReplica],
            pending_request: PendingRequest | None = None,
        ) -> list[list[RunningReplica]]:
            self._relayed_routing.resync_failed_relays()
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
        self._last: Mapping[str, Mapping[str, Any] | None] | None = None
        """The last complete set of replicas synced."""

    def sync(self, replicas: Mapping[str, Mapping[str, Any] | None], *, complete: bool) -> Any:
        if complete:
            self._last = replicas
        return self._state.sync(self._hop.translate(replicas, complete=complete), complete=complete)

    def resync_failed_relays(self) -> Any:
        """Sync the last complete set of replicas again if a relay stopped on an error and may
        be replaced (:meth:`RelayHop.needs_resync`), so that its replica is relayed anew;
        ``None`` if there was nothing to do."""
        if self._last is None or not self._hop.needs_resync():
            return None
        return self.sync(self._last, complete=True)

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
