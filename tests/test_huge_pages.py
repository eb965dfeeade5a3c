"""The core's large arrays are advised to the kernel as huge-page backed (``madvise`` with
``MADV_HUGEPAGE``, what ``VmFlags: hg`` shows in ``/proc/self/smaps``): a state of a million
blocks filled in 0.5 s instead of 0.9 s with them (``benchmarks/memory.py``). Python's own
heap is never advised, so without the core's allocator no mapping of the process is; and since
each large block is a mapping of its own, the advice goes when the block does, and nothing
malloc hands out afterwards (to Python, say) inherits it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")

CHILD = r"""
import gc
import sys
from kvbridge import Normalizer
from kvbridge.testing.events import encoded, stored

def advised_kib():
    kib, flags = 0, []
    for line in open("/proc/self/smaps"):
        if line.startswith("Size:"):
            size = int(line.split()[1])
        elif line.startswith("VmFlags:"):
            if "hg" in line.split()[1:]:
                kib += size
    return kib

before = advised_kib()
normalizer = Normalizer(worker_id=1, block_size=4)
for chain in range(int(sys.argv[1])):
    hashes = [chain * 64 + index + 1 for index in range(64)]
    tokens = [(chain * 256 + token) % 150_000 for token in range(256)]
    normalizer.process(encoded([stored(hashes, tokens, block_size=4)]), chain)
filled, blocks = advised_kib(), normalizer.tracked_blocks()[0]
del normalizer
gc.collect()
blobs = [bytearray(3 << 20) for _ in range(4)]  # large Python objects, made after the state
print(before, filled, blocks, advised_kib())
"""


def _advised(chains: int) -> tuple[int, int, int, int]:
    """KiB advised before, with the state of ``chains`` chains, its blocks, KiB advised after
    the state was freed and Python allocated large objects."""
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(chains)], capture_output=True, text=True, check=True
    ).stdout
    before, filled, blocks, freed = map(int, out.split())
    return before, filled, blocks, freed


@pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages"
)
def test_a_large_state_is_advised_as_huge_pages_until_freed_and_a_small_one_never() -> None:
    # 2,000 chains of 64: 128,000 blocks, a slab of 4.6 MB, which holds at least one whole
    # aligned huge page wherever it lies
    before, filled, blocks, freed = _advised(2_000)
    assert (before, blocks, freed) == (0, 128_000, 0)
    assert filled >= 2 * 1024
    # 10 chains: every array of the state is far below one huge page
    assert _advised(10) == (0, 0, 640, 0)
