"""Run a real, in-process ``dynamo.llm.SelectionService`` for tests and read its overlap scores.

:class:`SelectionHarness` is a blocking, test-shaped API over
:class:`kvbridge.adapters.selection_client.SelectionClient`, which runs the service on an event loop of
its own.

Slow joiners. ``upsert_worker`` returns *before* the service's ZMQ SUB is connected: the listener
logs "ZMQ listener starting" / "ZMQ listener ready" about 3-5 ms later and the PUB sees the
handshake about 5 ms after ``upsert_worker`` returned (localhost, idle machine). A batch published
right after :meth:`SelectionHarness.add_worker` is silently dropped by the PUB. Two reliable ways
out, both used by ``tests/test_publisher.py``:

* :func:`wait_connected` (``Publisher.wait_for_subscribers`` + a short settle) before publishing;
* give the worker the Publisher's replay endpoint and serve replays: when the first batch the
  service receives has seq > 0 it logs "Gap detected: expected seq 0, got N" and replays from
  seq 0. This only helps once *some* batch gets through, so still wait before the last one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from dynamo.llm.exceptions import SelectionServiceError

from kvbridge._closing import ClosedOnExit
from kvbridge.adapters.publisher import Publisher
from kvbridge.adapters.selection_client import SelectionClient

__all__ = ["Overlap", "SelectionHarness", "wait_connected"]

Overlap = dict[tuple[int, int], tuple[int, int, int]]
"""``{(worker_id, dp_rank): (device_blocks, host_pinned_blocks, disk_blocks)}``."""

_CALL_TIMEOUT_S = 10.0


def wait_connected(publisher: Publisher, count: int = 1, timeout: float = 5.0) -> None:
    """Block until ``count`` subscribers (e.g. one SelectionService worker rank) are connected.

    Waits for the ZMTP handshake on the publisher's PUB socket plus a 50 ms settle for the
    subscription that follows it. Call from the thread that publishes.

    Raises:
        TimeoutError: no subscriber within ``timeout`` seconds.
    """
    if not publisher.wait_for_subscribers(count, timeout=timeout):
        raise TimeoutError(f"no subscriber connected to {publisher.endpoint} within {timeout}s")


class SelectionHarness(ClosedOnExit):
    """A real ``SelectionService`` driven from synchronous test code (through
    :class:`kvbridge.adapters.selection_client.SelectionClient`).

    Use it as a context manager, or call :meth:`close`.
    """

    def __init__(self) -> None:
        self.client = SelectionClient()
        self.service: Any = self.client.service

    def _call(self, method: str, *args: Any) -> Any:
        return self.client.call_sync(method, *args, timeout=_CALL_TIMEOUT_S)

    def add_worker(
        self,
        worker_id: int,
        *,
        block_size: int,
        endpoints: dict[int, str],
        replay_endpoint: str | None = None,
        model_name: str = "m",
    ) -> dict[str, Any]:
        """Register (upsert) a worker whose ranks publish on ``endpoints`` ({dp_rank: address}).

        One rank 0 is registered with ``kv_events_endpoint``; otherwise ``kv_events_endpoints``
        (int keys) with ``data_parallel_start_rank`` = the lowest rank. Returns the catalog record.
        Remember the slow joiner: see the module docstring and :func:`wait_connected`.

        Dynamo 1.6.1 accepts a ``replay_endpoint`` only with one rank: with two ranks the record
        comes back ``lifecycle="incomplete"``, ``not_schedulable_reasons=["replay_endpoint is
        supported only for data_parallel_size 1"]`` and no listener is started at all. Register
        one worker per rank (e.g. ``endpoints={1: ...}``) to get replay for DP engines.
        Upserting an existing worker again with the same endpoints changes nothing (no new
        listener, same seq watermark); use :meth:`remove_worker` first to reset it.
        """
        if not endpoints:
            raise ValueError("endpoints must name at least one dp rank")
        worker: dict[str, Any] = {
            "worker_id": worker_id,
            "model_name": model_name,
            "endpoint": f"http://w{worker_id}",
            "block_size": block_size,
            "data_parallel_start_rank": min(endpoints),
            "data_parallel_size": len(endpoints),
        }
        if list(endpoints) == [0]:
            worker["kv_events_endpoint"] = endpoints[0]
        else:
            worker["kv_events_endpoints"] = {int(rank): addr for rank, addr in endpoints.items()}
        if replay_endpoint is not None:
            worker["replay_endpoint"] = replay_endpoint

        record: dict[str, Any] = self._call("upsert_worker", worker)
        return record

    def remove_worker(self, worker_id: int) -> dict[str, Any]:
        """``delete_worker``: drop the worker, its listeners and its indexed blocks.

        Re-adding it afterwards starts from an empty index and a fresh seq watermark (the way to
        make the service accept seq 0 again after an engine restart).
        """

        record: dict[str, Any] = self._call("delete_worker", worker_id)
        return record

    def overlap_raw(self, request: dict[str, Any]) -> dict[str, Any]:
        """Return the service's ``overlap_scores`` answer for ``request`` unchanged.

        ``request`` is either the tokens form (``token_ids`` ...) or the precomputed form
        (``block_hashes``, ``sequence_hashes``, ``isl_tokens``), plus ``model_name``.
        """

        result: dict[str, Any] = self._call("overlap_scores", request)
        return result

    def overlap_request(self, request: dict[str, Any]) -> Overlap:
        """Like :meth:`overlap` for an arbitrary ``overlap_scores`` request.

        With no schedulable worker the service raises ``SelectionServiceError`` (kind
        ``not_ready``, "no schedulable workers are available"); that is reported as ``{}``.
        """
        try:
            raw = self.overlap_raw(request)
        except SelectionServiceError as exc:
            if getattr(exc, "kind", None) == "not_ready":
                return {}
            raise
        out: Overlap = {}
        for w in raw["workers"]:
            counts = (int(w["device_blocks"]), int(w["host_pinned_blocks"]), int(w["disk_blocks"]))
            if any(counts):
                out[(int(w["worker_id"]), int(w["dp_rank"]))] = counts
        return out

    def overlap(
        self,
        token_ids: list[int],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        model_name: str = "m",
    ) -> Overlap:
        """Return ``{(worker_id, dp_rank): (device, host_pinned, disk)}`` overlap, in blocks.

        The counts are cumulative as Dynamo reports them (host includes device, disk includes
        host). Workers whose three counts are all 0 are left out (the service lists them).
        """
        request: dict[str, Any] = {"token_ids": token_ids, "model_name": model_name}
        if lora_name is not None:
            request["lora_name"] = lora_name
        if cache_salt is not None:
            request["cache_salt"] = cache_salt
        return self.overlap_request(request)

    @staticmethod
    def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
        """Poll ``predicate`` every 10 ms until it is true (``True``) or ``timeout`` (``False``)."""
        deadline = time.monotonic() + timeout
        while True:
            if predicate():
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    def close(self) -> None:
        """Shut the service down and stop its loop thread. Idempotent."""
        self.client.close()
