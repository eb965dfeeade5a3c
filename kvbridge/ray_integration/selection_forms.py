"""The forms of Dynamo's ``SelectionService`` calls: a prompt as the service takes it, and its
answers read back as kvbridge's values.

A decision (:class:`~kvbridge.ray_integration.routing.RoutingState`) sends the prompt in
Dynamo's precomputed form, reads the pick's overlap from ``select_and_reserve``'s answer, and
ranks the other workers from ``overlap_scores``' answer. Those conversions are pure functions of
the dicts, with no state and no I/O, so they have this module: the state's module keeps the
calls, their timeouts and what is booked.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

from kvbridge.normalizers.hashing import prompt_hashes
from kvbridge.schemas import Overlap

__all__ = [
    "pick_overlap",
    "precomputed_prompt",
    "ranking",
    "stored_blocks",
]

_TIER_CREDIT: Final = (1.0, 0.75, 0.25)
"""Dynamo's credit per matched block on device, host and disk (its default weights)."""


def precomputed_prompt(
    token_ids: Sequence[int],
    block_size: int,
    lora_name: str | None,
    model_name: str,
    cache_salt: str | None = None,
) -> dict[str, Any]:
    """The prompt in Dynamo's precomputed form: its blocks hashed here.

    Dynamo converts a token list on the calling thread with the GIL held (about 0.4 ms for
    8k tokens, some 50 ns a token), where the native core hashes the blocks of the packed ids
    in a few microseconds; the precomputed form is also what a moved reservation and the
    ranking's ``overlap_scores`` take. Token ids from
    :func:`~kvbridge.ray_integration.prompt.prompt_tokens` come packed already (an
    ``array("I")``, the little-endian u32s Dynamo hashes), which
    :func:`~kvbridge.normalizers.hashing.prompt_hashes` hashes where they lie. kvbridge's
    hashes are Dynamo's bit for bit (tests/test_hashing.py), LoRA name and cache salt
    included: the relay hashes a salted request's blocks with its salt, so a prompt hashed
    without it would match none of them.
    """
    blocks, sequence = prompt_hashes(
        token_ids, block_size, lora_name=lora_name, cache_salt=cache_salt
    )
    return {
        "block_hashes": blocks,
        "sequence_hashes": sequence,
        "isl_tokens": len(token_ids),
        "model_name": model_name,
    }


def pick_overlap(answer: Mapping[str, Any], block_size: int) -> Overlap:
    """The pick's overlap in blocks, from ``select_and_reserve``'s answer (in tokens).

    ``gpu``, ``cpu`` and ``disk`` are the picked worker's matched tokens, cumulative over
    the tiers, as ``overlap_scores``' ``device_blocks``, ``host_pinned_blocks`` and
    ``disk_blocks`` count them in blocks: in Dynamo 1.6.1 the two agreed on every pick of
    a workload with host-pinned-only prefixes and of a worker with two dp ranks, and
    ``tests/test_ray_router.py``'s CPU-tier assertions hold on these figures. ``dp`` gives
    the device figure of each dp rank of the worker; the picked rank's is the one to report.
    """
    tokens = answer["overlap"]
    device = int(tokens.get("dp", {}).get(str(answer["dp_rank"]), tokens["gpu"]))
    return Overlap(
        device // block_size,
        int(tokens["cpu"]) // block_size,
        int(tokens["disk"]) // block_size,
    )


def _overlap_credit(overlap: Overlap) -> float:
    """What Dynamo credits a worker for ``overlap`` (cumulative blocks), tier by tier."""
    device, host, disk = overlap.device, overlap.host_pinned, overlap.disk
    on_device, on_host, on_disk = _TIER_CREDIT
    return on_device * device + on_host * (host - device) + on_disk * (disk - host)


def ranking(
    picked: int, others: Iterable[int], scores: Mapping[str, Any] | None
) -> list[list[int]]:
    """``[[picked]]`` followed by the ``others`` in groups of equal credit, the most credited
    first, from ``overlap_scores``' answer (each worker's best dp rank); without an answer
    (``None``), the others form one group."""
    credit: dict[int, float] = {}
    for entry in scores["workers"] if scores is not None else ():
        tiers = Overlap(
            int(entry["device_blocks"]),
            int(entry["host_pinned_blocks"]),
            int(entry["disk_blocks"]),
        )
        wid = int(entry["worker_id"])
        credit[wid] = max(credit.get(wid, 0.0), _overlap_credit(tiers))
    ordered = sorted((w for w in others if w != picked), key=lambda w: -credit.get(w, 0.0))
    return [[picked]] + [
        list(group) for _, group in itertools.groupby(ordered, lambda w: credit.get(w, 0.0))
    ]


def stored_blocks(scores: Mapping[str, Any], worker_id: int) -> int:
    """How many of the prompt's leading blocks ``overlap_scores``' answer finds on
    ``worker_id`` in host memory or on the GPU (its best dp rank; 0 if none)."""
    return max(
        (
            int(entry["host_pinned_blocks"])
            for entry in scores["workers"]
            if int(entry["worker_id"]) == worker_id
        ),
        default=0,
    )
