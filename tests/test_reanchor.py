"""After batches are lost for good, what was lost is re-learned as soon as the engine uses it
again: a store whose parent chain the normalizer knows by identity announces that chain anew."""

from __future__ import annotations

from kvbridge import Normalizer, Tier, TieredIndex
from kvbridge.schemas.vllm import BlockStored
from kvbridge.testing.events import encoded, stored

BS = 4
PROMPT = list(range(100, 100 + 6 * BS))


def store(first: int, last: int, parent: int | None, medium: str = "GPU") -> BlockStored:
    """Blocks ``first..last-1`` of PROMPT, engine hash ``10 + i`` for block ``i``."""
    hashes = [10 + i for i in range(first, last)]
    return stored(hashes, PROMPT[first * BS : last * BS], parent=parent, medium=medium)


def device(index: TieredIndex, tokens: list[int]) -> dict[tuple[int, int], int]:
    return {key: overlap.device for key, overlap in index.overlap(tokens).items()}


def test_a_store_on_a_chain_known_before_the_loss_announces_the_chain_again() -> None:
    normalizer, index = Normalizer(1, BS), TieredIndex(BS)
    index.apply(normalizer.normalize(encoded([store(0, 4, None)]), 1))
    assert device(index, PROMPT) == {(1, 0): 4}

    # Batches were lost for good: downstream is cleared, identities are kept.
    index.apply(normalizer.process_reset(0, keep_identities=True))
    assert index.overlap(PROMPT) == {}

    # The engine extends its cached blocks 0-3 with block 4: it holds the whole chain.
    events = normalizer.normalize(encoded([store(4, 5, parent=13)]), 2)
    [announced] = events
    assert announced.event.data.stored is not None
    assert announced.event.data.stored.parent_hash is None
    assert len(announced.event.data.stored.blocks) == 5
    assert announced.token_ids == PROMPT[: 5 * BS]
    index.apply(events)
    assert device(index, PROMPT) == {(1, 0): 5}
    assert normalizer.reanchored_blocks == 4
    assert normalizer.resident_blocks(0, Tier.DEVICE) == 5
    assert normalizer.stats == {}


def test_only_the_part_of_the_chain_not_resident_is_announced() -> None:
    normalizer, index = Normalizer(1, BS), TieredIndex(BS)
    index.apply(normalizer.normalize(encoded([store(0, 4, None)]), 1))
    index.apply(normalizer.process_reset(0, keep_identities=True))
    # Blocks 0-1 are stored again first, then a store under block 3 arrives.
    index.apply(normalizer.normalize(encoded([store(0, 2, None)]), 2))
    events = normalizer.normalize(encoded([store(4, 5, parent=13)]), 3)
    [announced] = events
    assert announced.event.data.stored is not None
    assert announced.event.data.stored.parent_hash == index_block_hash(normalizer, 1)
    assert len(announced.event.data.stored.blocks) == 3
    index.apply(events)
    assert device(index, PROMPT) == {(1, 0): 5}
    assert normalizer.reanchored_blocks == 2


def index_block_hash(normalizer: Normalizer, block: int) -> int:
    """The canonical hash of PROMPT's block ``block`` as the normalizer derives it."""
    from kvbridge.normalizers import sequence_hashes, tokens_hashes

    return sequence_hashes(tokens_hashes(PROMPT, BS))[block]


def test_without_keeping_identities_the_store_is_an_orphan() -> None:
    normalizer = Normalizer(1, BS)
    normalizer.normalize(encoded([store(0, 4, None)]), 1)
    normalizer.process_reset(0)
    assert normalizer.normalize(encoded([store(4, 5, parent=13)]), 2) == []
    assert normalizer.stats == {"orphan_parent": 1}
    assert normalizer.reanchored_blocks == 0
