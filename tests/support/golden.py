"""The golden real-vLLM captures (``tests/fixtures/vllm-0.32.0``) and an independent reference
model of what they leave resident.

:class:`Golden` is one scenario: its manifest (prompts in order, phases, worker id) and its
captured messages. :class:`Reference` replays a worker's payloads with nothing but
``msgspec.msgpack.decode``: no kvbridge decoder, normaliser or hash. It maps every engine hash
(an int, or a 32-byte digest read as its last 8 bytes big-endian, which is vLLM's int form) to
the block's full token prefix, through the parent links and each store's tokens. Placeholder
stores (OffloadingConnector CPU stores with no tokens) name a hash the GPU published earlier.
Residency is reference-counted per medium (a store adds one, a removal takes one away,
``AllBlocksCleared`` empties every medium).

A prompt's block ``i`` is resident on a set of media if some engine hash whose full prefix is
``prompt[: (i + 1) * block_size]`` is resident on one of them. Two overlaps follow:

* :meth:`Reference.overlap`, union semantics (what :class:`kvbridge.TieredIndex` promises):
  device = leading blocks on the GPU, host_pinned = leading blocks on the GPU or the CPU,
  disk = leading blocks anywhere;
* :meth:`Reference.dynamo_overlap`, Dynamo's tier semantics (dynamo-indexer.md 4.6): the device
  prefix ``d``, then host_pinned = ``d`` plus the run of blocks right after it that are on the
  CPU, then disk likewise on disk (no capture has a disk tier, so disk = host_pinned).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import msgspec

from kvbridge.adapters.capture import CaptureReader, FrameRecord

__all__ = [
    "BLOCK_SIZE",
    "FIXTURES",
    "SCENARIOS",
    "Golden",
    "Reference",
    "engine_key",
    "load",
]

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "vllm-0.32.0"
BLOCK_SIZE = 32
SCENARIOS = (
    "prefix",
    "evict",
    "reset",
    "bytes",
    "two-engines-a",
    "two-engines-b",
    "xxhash-a",
    "xxhash-b",
    "offload",
    "offload-selfdesc",
)

Triple = tuple[int, int, int]
"""(device, host_pinned, disk) blocks."""


@dataclass(frozen=True)
class Golden:
    """One recorded scenario: manifest and captured messages."""

    name: str
    manifest: dict[str, Any]
    records: list[FrameRecord]

    @property
    def worker_id(self) -> int:
        return int(self.manifest["worker_id"])

    @cached_property
    def prompts(self) -> list[list[int]]:
        """Every prompt's token ids, in the order the scenario sent them."""
        return [list(prompt["token_ids"]) for prompt in self.manifest["prompts"]]

    @cached_property
    def outputs(self) -> list[list[int]]:
        """The tokens vLLM generated for each prompt (greedy, ``max_tokens`` 8)."""
        return [list(prompt["output_token_ids"]) for prompt in self.manifest["prompts"]]

    def phase_groups(self) -> list[tuple[str, list[int]]]:
        """``[(phase, [prompt index, ...])]`` in manifest order: the requests sent together.
        A phase with no request (``reset``) is kept with an empty list."""
        groups: list[tuple[str, list[int]]] = []
        by_phase: dict[str, list[int]] = {}
        for phase in self.manifest["phases"]:
            indices: list[int] = []
            by_phase[phase["phase"]] = indices
            groups.append((phase["phase"], indices))
        for prompt in self.manifest["prompts"]:
            by_phase[prompt["phase"]].append(int(prompt["index"]))
        for (name, indices), phase in zip(groups, self.manifest["phases"], strict=True):
            assert len(indices) == phase["requests"], (self.name, name)
        return groups

    def payloads(self) -> list[tuple[int, bytes]]:
        """``(seq, payload)`` of every captured message, in capture order."""
        out = []
        for record in self.records:
            seq = record.seq
            assert seq is not None, f"{self.name}: a message without vLLM's three frames"
            out.append((seq, record.frames[2]))
        return out


def load(name: str) -> Golden:
    manifest = json.loads((FIXTURES / f"{name}.json").read_text())
    records = list(CaptureReader(FIXTURES / f"{name}.kvcap"))
    assert manifest["block_size"] == BLOCK_SIZE
    seqs = [record.seq for record in records]
    assert seqs == list(range(len(records))), f"{name}: seqs not contiguous from 0"
    return Golden(name, manifest, records)


def engine_key(block_hash: int | bytes) -> int:
    """An engine hash as an int: bytes hashes by their last 8 bytes, big-endian."""
    if isinstance(block_hash, bytes):
        assert len(block_hash) == 32, block_hash
        return int.from_bytes(block_hash[-8:], "big")
    assert isinstance(block_hash, int) and not isinstance(block_hash, bool), block_hash
    return block_hash


def decode_events(payload: bytes) -> Iterator[dict[str, Any]]:
    """The events of one vLLM 0.32 batch ``[ts, [event map, ...], dp_rank]``."""
    batch = msgspec.msgpack.decode(payload)
    assert isinstance(batch, list) and len(batch) == 3, batch
    _, events, dp_rank = batch
    assert dp_rank in (0, None), dp_rank  # every capture is one rank
    for event in events:
        assert isinstance(event, dict), event  # vLLM 0.24+ sends tagged maps
        yield event


MEDIA = ("GPU", "CPU")


@dataclass
class Reference:
    """One worker's residency, replayed from its raw payloads (see the module docstring)."""

    block_size: int = BLOCK_SIZE
    prefix: dict[int, tuple[int, ...]] = field(default_factory=dict)
    """Engine hash -> the block's full token prefix."""
    refs: dict[str, Counter[int]] = field(default_factory=lambda: {m: Counter() for m in MEDIA})
    """Medium -> engine hash -> resident copies."""
    unmatched_removals: Counter[str] = field(default_factory=Counter)
    """Removals of a hash with no resident copy on that medium, by medium."""
    events: int = 0

    def apply(self, payload: bytes) -> None:
        for event in decode_events(payload):
            self.events += 1
            kind = event["type"]
            if kind == "AllBlocksCleared":
                for refs in self.refs.values():
                    refs.clear()
            elif kind == "BlockStored":
                self._stored(event)
            elif kind == "BlockRemoved":
                refs = self.refs[_medium(event)]
                for block_hash in map(engine_key, event["block_hashes"]):
                    if refs[block_hash] > 0:
                        refs[block_hash] -= 1
                        if not refs[block_hash]:
                            del refs[block_hash]
                    else:
                        self.unmatched_removals[_medium(event)] += 1
            else:
                raise AssertionError(f"unexpected event {kind}")

    def _stored(self, event: dict[str, Any]) -> None:
        hashes = [engine_key(block_hash) for block_hash in event["block_hashes"]]
        tokens = event["token_ids"]
        size = self.block_size
        if not tokens:  # a placeholder: a block the GPU published earlier
            assert event["block_size"] == 0 and event["parent_block_hash"] is None, event
            for block_hash in hashes:
                assert block_hash in self.prefix, f"placeholder {block_hash} never seen"
        else:
            assert event["block_size"] == size, event
            assert len(tokens) == size * len(hashes), event
            parent_hash = event["parent_block_hash"]
            parent = () if parent_hash is None else self.prefix[engine_key(parent_hash)]
            for index, block_hash in enumerate(hashes):
                full = parent + tuple(tokens[index * size : (index + 1) * size])
                known = self.prefix.setdefault(block_hash, full)
                assert known == full, f"hash {block_hash} published for two prefixes"
                parent = full
        refs = self.refs[_medium(event)]
        for block_hash in hashes:
            refs[block_hash] += 1

    # -- reads ----------------------------------------------------------------------------

    def resident(self, medium: str) -> set[int]:
        """Engine hashes with at least one copy on ``medium``."""
        return set(self.refs[medium])

    def _resident_prefixes(self) -> dict[str, set[tuple[int, ...]]]:
        return {m: {self.prefix[h] for h in refs} for m, refs in self.refs.items()}

    def _blocks(self, prompt: Sequence[int]) -> list[tuple[int, ...]]:
        size = self.block_size
        return [tuple(prompt[: (i + 1) * size]) for i in range(len(prompt) // size)]

    def overlaps(self, prompts: Sequence[Sequence[int]]) -> list[tuple[Triple, Triple]]:
        """For each prompt: (union overlap, Dynamo-semantics overlap)."""
        on = self._resident_prefixes()
        gpu, cpu = on["GPU"], on["CPU"]
        out = []
        for prompt in prompts:
            blocks = self._blocks(prompt)
            device = _leading(blocks, lambda b: b in gpu)
            host = _leading(blocks, lambda b: b in gpu or b in cpu)
            run = _leading(blocks[device:], lambda b: b in cpu)
            out.append(((device, host, host), (device, device + run, device + run)))
        return out

    def overlap(self, prompt: Sequence[int]) -> Triple:
        return self.overlaps([prompt])[0][0]

    def dynamo_overlap(self, prompt: Sequence[int]) -> Triple:
        return self.overlaps([prompt])[0][1]


def _leading(blocks: Sequence[tuple[int, ...]], resident: Any) -> int:
    count = 0
    for block in blocks:
        if not resident(block):
            break
        count += 1
    return count


def _medium(event: dict[str, Any]) -> str:
    medium = event.get("medium") or "GPU"
    assert medium in MEDIA, f"unexpected medium {medium!r}"
    return str(medium)


def phase_ends(golden: Golden) -> dict[str, int]:
    """The seq of the last batch of each phase that published something.

    Phases run one after the other (``LLM.generate`` returns when its requests have finished,
    and vLLM frees a request only once its offloads completed), so the stream is the phases'
    events in order. A batch belongs to the phase of its GPU stores. A GPU block belongs to the
    phases of the prompts whose tokens (prompt and output) it is a prefix of; of those, the
    current phase is kept unless the current phase already stored that hash (then it is a
    later phase storing it anew: ``reset``'s flush, ``evict``'s revisit), and the first later
    one is taken otherwise. Batches without a GPU store stay in the current phase.
    """
    reference = Reference()
    sequences = [
        tuple(prompt + output)
        for prompt, output in zip(golden.prompts, golden.outputs, strict=True)
    ]
    order = [name for name, _ in golden.phase_groups()]
    phase_of = [order.index(prompt["phase"]) for prompt in golden.manifest["prompts"]]
    current = 0
    stored_in_phase: set[int] = set()
    ends: dict[str, int] = {}
    for seq, payload in golden.payloads():
        reference.apply(payload)
        for event in decode_events(payload):
            if event["type"] != "BlockStored" or _medium(event) != "GPU":
                continue
            hashes = [engine_key(block_hash) for block_hash in event["block_hashes"]]
            block = reference.prefix[hashes[-1]]
            candidates = {
                phase_of[i] for i, tokens in enumerate(sequences) if tokens[: len(block)] == block
            }
            again = bool(stored_in_phase.intersection(hashes))
            later = sorted(p for p in candidates if p > current or (p == current and not again))
            assert later or current in candidates, f"{golden.name} seq {seq}: no phase"
            if later and later[0] != current:
                current, stored_in_phase = later[0], set()
            stored_in_phase.update(hashes)
        ends[order[current]] = seq
    return ends
