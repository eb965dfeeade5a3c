"""The core normalizes large payloads with the GIL released and small ones with it held; either
way a reader on another thread (a metrics scrape) must wait for a batch in progress, never find
the state borrowed, and see the counts of whole batches only."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import msgspec
import pytest

from kvbridge import Normalizer, Tier, _core, decode_batch
from kvbridge.schemas.vllm import LAYOUTS, AllBlocksCleared, VllmBatch, encode_batch
from kvbridge.testing.events import encoded, stored
from kvbridge.testing.vllm_hashes import block_hashes
from kvbridge.testing.workload import seeded_stream

ROUNDS = 5


def merged(payloads: list[bytes], per_payload: int) -> list[bytes]:
    """The same events, ``per_payload`` of them in each payload."""
    events = [event for payload in payloads for event in decode_batch(payload).events]
    return [
        encode_batch(events[at : at + per_payload], LAYOUTS[-1])
        for at in range(0, len(events), per_payload)
    ]


def with_unknown_fields(payload: bytes) -> VllmBatch:
    """The payload decoded, with three unknown fields counted, as a caller's decoder may."""
    return msgspec.structs.replace(decode_batch(payload), unknown_fields=3)


def feed(normalizer: Normalizer, payloads: list[bytes], after: Callable[[], object]) -> None:
    """``ROUNDS`` times: the first payload decoded (with unknown fields), the others as bytes,
    then a reset; ``after()`` after each call."""
    for _ in range(ROUNDS):
        normalizer.normalize(with_unknown_fields(payloads[0]), 0)
        after()
        for seq, payload in enumerate(payloads[1:], start=1):
            normalizer.normalize(payload, seq)
            after()
        normalizer.reset()
        after()


@pytest.mark.parametrize("per_payload", [None, 400], ids=["small, GIL held", "large, released"])
def test_readers_on_other_threads_wait_for_a_batch_in_progress(per_payload: int | None) -> None:
    payloads = seeded_stream(3, 400).payloads
    if per_payload is None:
        # The stream's small payloads alone: its removals of blocks stored by the others are
        # dropped, the same in both normalizers.
        payloads = [payload for payload in payloads if len(payload) < _core.RELEASE_GIL_BYTES]
        assert len(payloads) > 300
    else:
        payloads = merged(payloads, per_payload)
        assert min(map(len, payloads[:-1])) >= _core.RELEASE_GIL_BYTES
    expected = Normalizer(1, 4)
    whole = {frozenset(expected.forwarded.items())}
    feed(expected, payloads, lambda: whole.add(frozenset(expected.forwarded.items())))

    normalizer = Normalizer(1, 4)
    errors: list[BaseException] = []
    torn: list[object] = []
    stop = threading.Event()

    def scrape() -> None:
        while not stop.is_set():
            try:
                forwarded = frozenset(normalizer.forwarded.items())
                if forwarded not in whole:
                    torn.append(forwarded)
                assert normalizer.resident_blocks(0, Tier.DEVICE) >= 0
                normalizer.tracked_blocks()
                _ = normalizer.stats
            except BaseException as error:
                errors.append(error)
                return

    readers = [threading.Thread(target=scrape) for _ in range(2)]
    for reader in readers:
        reader.start()
    try:
        feed(normalizer, payloads, lambda: None)
    finally:
        stop.set()
        for reader in readers:
            reader.join()
    assert errors == []
    assert torn == []
    assert normalizer.forwarded == expected.forwarded
    assert normalizer.forwarded["cleared", Tier.DEVICE] == ROUNDS
    assert normalizer.stats == expected.stats
    assert normalizer.unknown_fields == expected.unknown_fields == 3 * ROUNDS


@contextmanager
def switches_only_at_blocking_calls() -> Iterator[None]:
    """No forced switch between threads: one runs only while the others wait in a blocking
    call (a sleep, or the core's work with the GIL released)."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(100.0)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


def ran_during(call: Callable[[], object]) -> int:
    """How many times a thread that sleeps 0.1 ms in a loop ran while ``call()`` ran: never
    unless ``call`` releases the GIL (and the OS runs the thread meanwhile)."""
    busy, stop = threading.Event(), threading.Event()
    woken = [0]

    def spin() -> None:
        while not stop.is_set():
            time.sleep(0.0001)
            woken[0] += busy.is_set()

    spinner = threading.Thread(target=spin, daemon=True)
    with switches_only_at_blocking_calls():
        spinner.start()
        try:
            busy.set()
            call()
            busy.clear()
        finally:
            stop.set()
            spinner.join()
    return woken[0]


@pytest.mark.parametrize(
    ("event", "reset_first"),
    [("clear", False), ("store", True)],
    ids=["AllBlocksCleared", "store with reset_first"],
)
def test_a_small_payload_that_clears_a_large_state_releases_the_gil(
    event: str, reset_first: bool
) -> None:
    """A clear's work grows with the rank's blocks, not with its payload's bytes: a payload
    under the size that releases the GIL still releases it when it clears the rank, by an
    ``AllBlocksCleared`` or by ``reset_first``, so that other threads run meanwhile."""
    normalizer = Normalizer(1, 4)
    for chunk in range(10):  # 100,000 blocks, as large payloads
        tokens = list(range(chunk * 40_000, (chunk + 1) * 40_000))
        normalizer.normalize(encoded([stored(block_hashes(tokens, 4), tokens, block_size=4)]))
    assert normalizer.tracked_blocks() == (100_000, 0)
    small = (
        encoded([AllBlocksCleared()])
        if event == "clear"
        else encoded([stored(block_hashes([1, 2, 3, 4], 4), [1, 2, 3, 4], block_size=4)])
    )
    assert len(small) < _core.RELEASE_GIL_BYTES
    assert ran_during(lambda: normalizer.process(small, reset_first=reset_first)) > 0
    assert normalizer.resident_blocks(0, Tier.DEVICE) == (0 if event == "clear" else 1)
    if not reset_first:
        return
    # The store alone, which clears nothing, holds the GIL: nothing ran.
    assert ran_during(lambda: normalizer.process(small)) == 0


def test_the_gil_is_released_for_a_large_payload_and_held_for_a_small_one() -> None:
    tokens = list(range(160_000))  # 40,000 blocks: some 10 ms of work
    large = encoded([stored(block_hashes(tokens, 4), tokens, block_size=4)])
    small = encoded([stored(block_hashes([1, 2, 3, 4], 4), [1, 2, 3, 4], block_size=4)])
    assert len(small) < _core.RELEASE_GIL_BYTES <= len(large)
    normalizer = Normalizer(1, 4)
    assert ran_during(lambda: normalizer.process(large)) > 0
    assert ran_during(lambda: normalizer.process(small)) == 0
    assert normalizer.tracked_blocks() == (40_001, 0)
