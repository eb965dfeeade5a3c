"""TEST-ONLY offloading spec: vLLM 0.32's CPU offloading on vLLM's CPU backend.

Not an upstream vLLM feature, and not for production. It exists so that the golden captures in
``tests/fixtures/vllm-0.32.0/`` contain genuine ``medium="CPU"`` events from a CPU-only machine.

Stock ``CPUOffloadingSpec.get_worker`` refuses to run unless the platform is CUDA-alike or XPU
("CPU Offloading is currently only supported on CUDA-alike and XPU GPUs"), because its worker
copies with CUDA streams and events. This subclass replaces **only the worker-side factory**:

- the scheduler side is untouched: ``get_manager`` is vLLM's own ``CPUOffloadingManager`` (LRU,
  chunking, store/evict bookkeeping and KV-event generation, self-describing mode included),
  so every ``medium="CPU"`` event in a capture is real vLLM output;
- the worker, :class:`SyncCPUOffloadingWorker`, keeps one host buffer per KV tensor (sized in
  chunks of ``blocks_per_chunk`` engine blocks) and performs each store / load as an immediate,
  synchronous tensor copy between the engine's KV pages and that buffer, then reports the
  transfer finished and successful on the next ``get_finished`` poll.

Use it through the OffloadingConnector's out-of-tree spec loading, with the configuration
``offloading.kv_transfer_config(cpu_bytes, self_describing=...)`` makes (this directory on the
engine processes' ``PYTHONPATH``).

One more key, test-only too, makes engines of the same configuration differ:
``"placeholder_kv_events_ports": [5557, ...]`` turns ``self_describing_kv_events`` off for the
engines whose ``kv_events_config.endpoint`` port is listed, so they publish vLLM's CPU
placeholders (``BlockStored`` with hashes only: no tokens, block size 0) as the
OffloadingConnector does by default, while the others stay self-describing. Ray Serve LLM gives
each replica of a deployment one ``LLMConfig`` and offsets only that endpoint's port by the
replica's rank, so the port is what tells one replica's engine from another's. Without the key
(the golden captures), nothing changes.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

import numpy as np
import torch
from offloading import PLACEHOLDER_PORTS_KEY  # beside this file, on the engines' path
from vllm.logger import init_logger
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

__all__ = ["SyncCPUOffloadingSpec", "SyncCPUOffloadingWorker"]

logger = init_logger(f"vllm.{__name__}")  # under "vllm", so vLLM's log config shows it


class SyncCPUOffloadingWorker(OffloadingWorker):
    """Copies KV pages to / from a host buffer synchronously (test-only)."""

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, num_chunks: int):
        self.blocks_per_chunk = blocks_per_chunk
        # Engine KV pages per tensor, as (num_blocks, page_bytes) int8 views.
        self.engine = [t.tensor.view(torch.int8) for t in kv_caches.tensors]
        # Host buffer per tensor: num_chunks * blocks_per_chunk pages (chunk c, sub-block j is
        # row c * blocks_per_chunk + j).
        self.host = [
            torch.zeros((num_chunks * blocks_per_chunk, e.shape[1]), dtype=torch.int8)
            for e in self.engine
        ]
        self.tensors_per_group = [
            sorted({ref.tensor_idx for ref in refs}) for refs in kv_caches.group_data_refs
        ]
        self._done: list[TransferResult] = []
        self.blocks_stored = self.blocks_loaded = 0

    def _rows(self, gpu: GPULoadStoreSpec, cpu: LoadStoreSpec):
        """Yield (group, engine block ids, host rows) for each KV-cache group of a transfer."""
        assert isinstance(cpu, BlockIDsLoadStoreSpec)
        bpc, gpu_at, cpu_at = self.blocks_per_chunk, 0, 0
        for group, (size, first) in enumerate(zip(gpu.group_sizes, gpu.block_indices, strict=True)):
            if size == 0:
                continue
            skip = first % bpc  # the first chunk may be entered part-way
            chunks = cpu.block_ids[cpu_at : cpu_at + -(-(size + skip) // bpc)].astype(np.int64)
            rows = (chunks[:, None] * bpc + np.arange(bpc)).ravel()[skip : skip + size]
            blocks = gpu.block_ids[gpu_at : gpu_at + size].astype(np.int64)
            yield group, torch.from_numpy(blocks), torch.from_numpy(rows)
            gpu_at, cpu_at = gpu_at + size, cpu_at + len(chunks)

    def _copy(self, job_id: int, gpu: GPULoadStoreSpec, cpu: LoadStoreSpec, store: bool) -> bool:
        start, nbytes = time.perf_counter(), 0
        for group, blocks, rows in self._rows(gpu, cpu):
            for t in self.tensors_per_group[group]:
                if store:
                    self.host[t][rows] = self.engine[t][blocks]
                else:
                    self.engine[t][blocks] = self.host[t][rows]
                nbytes += len(blocks) * self.engine[t].shape[1]
            if store:
                self.blocks_stored += len(blocks)
            else:
                self.blocks_loaded += len(blocks)
        self._done.append(TransferResult(job_id, True, nbytes, time.perf_counter() - start))
        if not store:  # record.py reads the last such line from the scenario log
            logger.info(
                "sync-cpu-offload: blocks_stored=%d blocks_loaded=%d",
                self.blocks_stored,
                self.blocks_loaded,
            )
        return True

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        return self._copy(job_id, src_spec, dst_spec, store=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._copy(job_id, dst_spec, src_spec, store=False)

    def get_finished(self) -> list[TransferResult]:
        done, self._done = self._done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return  # every transfer completed when it was submitted


def _kv_events_port() -> int | None:
    """The port of the engine's ``kv_events_config.endpoint``, read from the ``vllm_config`` of
    the caller that builds the spec (vLLM 0.32's ``OffloadingConnector.__init__``, which hands
    the spec only the derived ``OffloadingConfig``); ``None`` if no caller has one."""
    frame = sys._getframe(1)
    while frame is not None:
        config: Any = frame.f_locals.get("vllm_config")
        events = getattr(config, "kv_events_config", None)
        if events is not None:
            endpoint = str(getattr(events, "endpoint", "") or "")
            port = endpoint.rsplit(":", 1)[-1]
            return int(port) if port.isdigit() else None
        frame = frame.f_back  # type: ignore[assignment]
    return None


class SyncCPUOffloadingSpec(CPUOffloadingSpec):
    """vLLM's ``CPUOffloadingSpec`` with a synchronous worker that runs on the CPU backend."""

    def __init__(self, config: OffloadingConfig):
        super().__init__(config)
        ports = self.extra_config.get(PLACEHOLDER_PORTS_KEY)
        if ports and self.kv_events_config.self_describing_kv_events:
            port = _kv_events_port()
            if port in {int(p) for p in ports}:
                # Read by the scheduler side's OffloadingEventsTracker, built after the spec.
                self.kv_events_config = dataclasses.replace(
                    self.kv_events_config, self_describing_kv_events=False
                )
            logger.info(
                "sync-cpu-offload: kv events port %s, self_describing_kv_events=%s",
                port,
                self.kv_events_config.self_describing_kv_events,
            )

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = SyncCPUOffloadingWorker(
                kv_caches, self.blocks_per_chunk, self.num_chunks
            )
        return self._worker
