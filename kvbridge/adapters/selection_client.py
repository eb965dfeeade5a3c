"""A real Dynamo ``SelectionService`` that any thread or event loop can call.

The service's async methods return pyo3 futures bound to the running loop of the thread that
calls them, so they cannot be awaited from an arbitrary loop, and a future is not a coroutine
(``create_task`` refuses it). :class:`SelectionClient` therefore owns an event loop on a daemon
thread and runs every call there, wrapped in a coroutine. Callers await the result from their own
loop (:meth:`SelectionClient.call`), or block on it (:meth:`SelectionClient.call_sync`).

Keeping the service on a loop of its own also means a caller's loop (a Ray Serve router's, say)
is never blocked by the service, and a caller can bound every call with a timeout.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
from collections.abc import Coroutine, Iterator, Mapping
from typing import Any, Final, TypeVar

from dynamo.llm import SelectionService
from dynamo.llm.exceptions import SelectionServiceError

from kvbridge._closing import ClosedOnExit

__all__ = ["TUNING_ENV", "SelectionClient", "SelectionServiceError"]

DEFAULT_CALL_TIMEOUT_S: Final = 10.0

TUNING_ENV: Final = {
    "prefill_load_scale": "DYN_ROUTER_PREFILL_LOAD_SCALE",
    "overlap_score_credit": "DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT",
    "overlap_score_credit_decay": "DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT_DECAY",
    "decode_active_request_weight": "DYN_ROUTER_DECODE_ACTIVE_REQUEST_WEIGHT",
    "host_cache_hit_weight": "DYN_ROUTER_HOST_CACHE_HIT_WEIGHT",
}
"""Dynamo's router weights, by the environment variable it reads them from when a service is
created (version 1.6 ignores them in a request's ``router_config_override``)."""

_ENV_LOCK: Final = threading.Lock()

_T = TypeVar("_T")


class SelectionClient(ClosedOnExit):
    """An in-process ``dynamo.llm.SelectionService`` on an event loop of its own.

    Args:
        indexer_threads: the service's indexer threads (Dynamo's default is 4).
        tuning: Dynamo's router weights for this service, by the names of :data:`TUNING_ENV`
            (e.g. ``{"prefill_load_scale": 2.0}``); unnamed weights keep Dynamo's defaults or
            the process environment's ``DYN_ROUTER_*`` values.

    Raises:
        ValueError: ``tuning`` names an unknown weight.

    Use it as a context manager, or call :meth:`close`.
    """

    def __init__(
        self, *, indexer_threads: int | None = None, tuning: Mapping[str, float] | None = None
    ) -> None:
        env = {}
        for name, value in (tuning or {}).items():
            if name not in TUNING_ENV:
                known = ", ".join(sorted(TUNING_ENV))
                raise ValueError(f"unknown Dynamo router weight {name!r} (known: {known})")
            env[TUNING_ENV[name]] = str(float(value))
        self.loop: Final = asyncio.new_event_loop()
        """The loop every service call runs on (its thread is a daemon)."""
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="kvbridge-selection", daemon=True
        )
        self._thread.start()
        self._closed = False

        async def create() -> Any:
            if indexer_threads is None:
                return SelectionService()
            return SelectionService(indexer_threads=indexer_threads)

        # The service reads its weights from the environment once, when it is created.
        with _ENV_LOCK, _environment(env):
            self.service: Final[Any] = self.run(create()).result(DEFAULT_CALL_TIMEOUT_S)

    def submit(self, method: str, *args: Any) -> concurrent.futures.Future[Any]:
        """Start ``service.<method>(*args)`` on the service's loop; the future gets its result."""

        async def invoke() -> Any:
            return await getattr(self.service, method)(*args)

        return self.run(invoke())

    async def call(self, method: str, *args: Any) -> Any:
        """Await ``service.<method>(*args)`` from any running loop.

        Cancelling the caller cancels the call on the service's loop.
        """
        return await asyncio.wrap_future(self.submit(method, *args))

    def call_sync(self, method: str, *args: Any, timeout: float = DEFAULT_CALL_TIMEOUT_S) -> Any:
        """Run ``service.<method>(*args)`` and block for its result.

        Raises:
            TimeoutError: no result within ``timeout`` seconds.
        """
        return self.submit(method, *args).result(timeout)

    def loads(self, model_name: str | None = None) -> list[dict[str, Any]]:
        """The service's ``loads()``: active reservations per worker and dp rank."""
        loads: list[dict[str, Any]] = self.service.loads(model_name=model_name)
        return loads

    def active_reservations(self, model_name: str | None = None) -> int:
        """Requests booked on any worker and not yet freed, summed over ``loads()``."""
        return sum(
            int(load["active_requests"])
            for group in self.loads(model_name)
            for load in group["loads"]
        )

    def run(self, coro: Coroutine[Any, Any, _T]) -> concurrent.futures.Future[_T]:
        """Schedule ``coro`` on the service's loop (where it may await service calls)."""
        if self._closed:
            coro.close()
            raise RuntimeError("the selection client is closed")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        """Shut the service down and stop its loop. Idempotent."""
        if self._closed:
            return
        self._closed = True

        async def shutdown() -> None:
            self.service.shutdown()

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(DEFAULT_CALL_TIMEOUT_S)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(DEFAULT_CALL_TIMEOUT_S)


@contextlib.contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    """Set environment variables, and restore the previous values after."""
    previous = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value
