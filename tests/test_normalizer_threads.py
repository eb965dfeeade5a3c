"""The core normalizes with the GIL released; a reader on another thread (a metrics scrape)
must wait for it, never find its state borrowed."""

from __future__ import annotations

import threading

from kvbridge import Normalizer, Tier
from kvbridge.testing.workload import seeded_stream


def test_readers_on_other_threads_wait_for_a_batch_in_progress() -> None:
    normalizer = Normalizer(1, 4)
    payloads = seeded_stream(3, 400).payloads
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
