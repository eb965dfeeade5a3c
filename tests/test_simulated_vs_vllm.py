"""``kvbridge.testing.SimulatedEngine`` against golden captures of a real vLLM 0.32 engine.

Issue acceptance: "SimulatedEngine is tested against a golden real-vLLM capture of the same
prompts: same event sequence shape and same resident set at the end."

The simulator is configured like the recorded engine and sent the manifest's prompts in the same
order, phase by phase (:mod:`support.twin`). It generates the tokens vLLM generated, so the
blocks decoding fills hash alike. Its sha256 hashes are vLLM's, so hashes compare directly.

Event sequence shape: ``(type, medium, number of hashes, parent is None)`` for every event, over
the whole stream, batch boundaries ignored (they depend on timing), compared phase by phase:

* a phase that sent one request is compared in order;
* a phase that sent several is compared as a sorted multiset: vLLM runs those requests
  concurrently and interleaves their steps (in ``prefix``'s reuse phase, request 7's
  decode-filled block is published after request 8's prefill), while the simulator runs them
  one after the other (its documented "one request at a time");
* consecutive CPU stores are sorted in either case: vLLM publishes a step's finished offloads
  by iterating a set, in no particular order.

The same comparison is then made with the hashes and parents themselves. The resident set at the
end is the set of engine hashes on the GPU (and on the CPU): the reference replay of the capture
(:class:`support.golden.Reference`) against ``SimulatedEngine.resident_hashes``.

Where the simulator does not reproduce a capture the test is marked ``xfail(strict=True)`` with
the first divergence, so that it fails as soon as the simulator does reproduce it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar

import pytest
from support.golden import Golden, Reference, load
from support.twin import Event, TwinRun, real_events, run_twin

_K = TypeVar("_K", bound=Hashable)


def golden(name: str) -> Golden:
    return load(name)


def twin(name: str) -> TwinRun:
    return run_twin(golden(name))


def reference(name: str) -> Reference:
    ref = Reference()
    for _, payload in golden(name).payloads():
        ref.apply(payload)
    return ref


def comparable(events: Sequence[Event], requests: int, key: Callable[[Event], _K]) -> list[_K]:
    """A phase's events in a comparable order (see the module docstring)."""
    out: list[_K] = []
    run: list[_K] = []
    for event in events:
        if event.type == "BlockStored" and event.medium == "CPU":
            run.append(key(event))
            continue
        out += sorted(run, key=repr)
        run = []
        out.append(key(event))
    out += sorted(run, key=repr)
    return out if requests <= 1 else sorted(out, key=repr)


def label(run: TwinRun, block_hash: int) -> str:
    prompt, block = run.block_of.get(block_hash, (-1, -1))
    return f"p{prompt}b{block}" if prompt >= 0 else str(block_hash)


def describe(run: TwinRun, event: Event | None) -> str:
    if event is None:
        return "nothing"
    names = ",".join(label(run, h) for h in event.hashes[:4])
    more = "..." if len(event.hashes) > 4 else ""
    return f"seq {event.seq} {event.shape} [{names}{more}]"


def first_difference(name: str, run: TwinRun) -> str:
    """The first event where the two whole streams differ, batch boundaries ignored."""
    real = [e for events in real_events(golden(name)).values() for e in events]
    sim = [e for events in run.events.values() for e in events]
    for number in range(max(len(real), len(sim))):
        a = real[number] if number < len(real) else None
        b = sim[number] if number < len(sim) else None
        if a is None or b is None or a.key != b.key:
            return (
                f"whole stream ({len(real)} vLLM events, {len(sim)} simulated): first difference "
                f"at event #{number}: vLLM {describe(run, a)}, simulator {describe(run, b)}"
            )
    return "the whole streams are identical"


def compare_phases(name: str, key: Callable[[Event], Any], what: str) -> None:
    g, run = golden(name), twin(name)
    real = real_events(g)
    for phase, indices in g.phase_groups():
        want = comparable(real[phase], len(indices), key)
        got = comparable(run.events[phase], len(indices), key)
        if want != got:
            extra = Counter(map(repr, want)) - Counter(map(repr, got))
            missing = Counter(map(repr, got)) - Counter(map(repr, want))
            pytest.fail(
                f"{name}, phase {phase!r} ({len(indices)} requests): {what} differ "
                f"({len(want)} vLLM events, {len(got)} simulated); only vLLM: "
                f"{dict(list(extra.items())[:4])}; only simulator: "
                f"{dict(list(missing.items())[:4])}\n{first_difference(name, run)}"
            )


IN_ORDER = {"reset"}
"""Scenarios whose whole stream the simulator reproduces in order, event for event (batch
boundaries aside): vLLM published the concurrent warm requests' stores in request order, and the
only block filled by decoding is the last request's."""

CONCURRENT_EVICT = pytest.mark.xfail(
    strict=True,
    reason=(
        "evict ran each phase's 8 requests concurrently in vLLM (max_num_seqs 8, a 512-token "
        "step budget shared by the requests, 63 blocks for about 75): it prefilled prompt 2 in "
        "two chunks (7 blocks in seq 1, the 8th in seq 2) and prompt 4 in 6+2. The simulator "
        "runs one request at a time, so the fill-1 phase differs at event #2 (vLLM "
        "BlockStored GPU 7 hashes, simulator 8), and so do the evictions after it"
    ),
)
CONCURRENT_OFFLOAD = (
    "the fill phase ran its 8 requests concurrently in vLLM, so GPU stores of later prompts "
    "come before prompt 0's CPU stores, and the CPU tier evicts in other groups; the simulator "
    "runs one request at a time and publishes prompt 0's CPU stores in the step after its GPU "
    "store. First difference at event #1: "
)


def concurrent_offload(name: str, difference: str) -> Any:
    """Scenario ``name``, expected to fail (strict) where :data:`CONCURRENT_OFFLOAD` says, at
    this first ``difference``."""
    return pytest.param(
        name, marks=pytest.mark.xfail(strict=True, reason=CONCURRENT_OFFLOAD + difference)
    )


EVICT_RESIDENT = (
    "which blocks survive depends on vLLM's concurrent schedule (8 requests per phase, 4 in the "
    "revisit): the simulator ends with 62 GPU hashes, 3 more than vLLM, which evicted p20b0-b2 "
    "in its concurrent revisit phase"
)


@pytest.mark.parametrize(
    "name",
    [
        "prefix",
        "reset",
        pytest.param("evict", marks=CONCURRENT_EVICT),
        concurrent_offload(
            "offload",
            "vLLM seq 0 BlockStored GPU 7 hashes (prompt 1's first chunk, in prompt 0's step), "
            "simulator seq 1 BlockStored CPU 1 hash (p0b0)",
        ),
        concurrent_offload(
            "offload-selfdesc",
            "vLLM seq 1 BlockStored GPU 8 hashes (prompt 1), "
            "simulator seq 1 BlockStored CPU 1 hash (p0b0)",
        ),
    ],
)
def test_event_sequence_shape(name: str) -> None:
    compare_phases(name, lambda event: event.shape, "event shapes")
    compare_phases(name, lambda event: event.key, "events (hashes and parents)")
    if name in IN_ORDER:
        assert first_difference(name, twin(name)) == "the whole streams are identical"


@pytest.mark.parametrize(
    "name",
    [
        "prefix",
        "reset",
        pytest.param("evict", marks=pytest.mark.xfail(strict=True, reason=EVICT_RESIDENT)),
        "offload",
        pytest.param(
            "offload-selfdesc",
            marks=pytest.mark.xfail(
                strict=True,
                reason="the GPU sets are equal, but not the CPU sets: the CPU tier's LRU order follows the order in which vLLM published the "
                "offloads (a set's), so which fill prompt's blocks survive on the CPU (p4b0-b5 "
                "here; p5b0-b5 in the simulator and in the offload capture) is not reproducible",
            ),
        ),
    ],
)
def test_resident_set_at_end(name: str) -> None:
    ref, run = reference(name), twin(name)
    assert ref.resident("GPU"), "nothing resident: the comparison would prove nothing"
    for medium in ("GPU", "CPU"):
        real, sim = ref.resident(medium), run.resident[medium]
        assert sim == real, (
            f"{medium}: vLLM {len(real)} hashes, simulator {len(sim)}; only vLLM: "
            f"{sorted(label(run, h) for h in real - sim)}; only simulator: "
            f"{sorted(label(run, h) for h in sim - real)}"
        )
