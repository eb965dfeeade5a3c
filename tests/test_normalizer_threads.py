"""The core normalizes large payloads with the GIL released and small ones with it held; either
way a reader on another thread (a metrics scrape) must wait for a batch in progress, never find
the state borrowed, and every thread must see the counts of whole batches."""

from __future__ import annotations

import threading

import pytest

from kvbridge import Normalizer, Tier, _core, decode_batch
from kvbridge.schemas.vllm import LAYOUTS, encode_batch
from kvbridge.testing.workload import seeded_stream


def merged(payloads: list[bytes], per_payload: int) -> list[bytes]:
    """The same events, ``per_payload`` batches' worth in each payload."""
    events = [event for payload in payloads for event in decode_batch(payload).events]
    return [
        encode_batch(events[at : at + per_payload], LAYOUTS[-1])
        for at in range(0, len(events), per_payload)
    ]


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
    for seq, payload in enumerate(payloads):
        expected.normalize(payload, seq)

    normalizer = Normalizer(1, 4)
    errors: list[BaseException] = []
    stop = threading.Event()

    def scrape() -> None:
        while not stop.is_set():
            try:
                seen = (
                    normalizer.forwarded,
                    normalizer.stats,
                    normalizer.resident_blocks(0, Tier.DEVICE),
                    normalizer.tracked_blocks(),
                )
                assert seen[2] >= 0
            except BaseException as error:
                errors.append(error)
                return

    readers = [threading.Thread(target=scrape) for _ in range(2)]
    for reader in readers:
        reader.start()
    try:
        for _ in range(5):
            for seq, payload in enumerate(payloads):
                normalizer.normalize(payload, seq)
            normalizer.reset()
    finally:
        stop.set()
        for reader in readers:
            reader.join()
    assert errors == []
    assert normalizer.forwarded["cleared", Tier.DEVICE] == 5
    assert (
        normalizer.forwarded["stored", Tier.DEVICE] == 5 * expected.forwarded["stored", Tier.DEVICE]
    )
    assert (
        normalizer.stats
        == expected.stats + expected.stats + expected.stats + expected.stats + expected.stats
    )
