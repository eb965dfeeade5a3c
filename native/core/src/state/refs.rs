//! Reference counts: per canonical block and tier, held by the slot that owns the block.

use super::{hash_u64, Rank, Slot, OWNER, SPILLED};
use crate::media::Tier;

impl Rank {
    /// The slot holding the counts of a canonical block, if any tier holds it.
    fn owner(&self, canonical: u64) -> Option<Slot> {
        self.by_canonical
            .find(hash_u64(canonical), |&slot| {
                self.canonical(slot) == canonical
            })
            .copied()
    }

    /// The slot holding the counts of `slot`'s canonical block (`canonical`), if any tier
    /// holds it. Candidates are compared by parent and tokens hash, whose sequence hash the
    /// canonical hash is, so no hash is recomputed.
    pub fn owner_of(&self, slot: Slot, canonical: u64) -> Option<Slot> {
        if self.blocks[slot as usize].meta & OWNER != 0 {
            return Some(slot); // the index's entry for this canonical block is the slot itself
        }
        let (tokens_hash, parent) = (self.blocks[slot as usize].tokens_hash, self.parent(slot));
        self.by_canonical
            .find(hash_u64(canonical), |&other| {
                self.blocks[other as usize].tokens_hash == tokens_hash
                    && self.parent(other) == parent
            })
            .copied()
    }

    /// The references on `tier` that `owner` (from [`Rank::owner_of`]) holds.
    pub fn count(&self, owner: Slot, tier: Tier) -> u32 {
        match self.blocks[owner as usize].refs[tier as usize] {
            SPILLED => self.spill[&(owner, tier as u8)],
            small => u32::from(small),
        }
    }

    fn set_count(&mut self, owner: Slot, tier: Tier, count: u32) {
        let key = (owner, tier as u8);
        if count >= u32::from(SPILLED) {
            self.blocks[owner as usize].refs[tier as usize] = SPILLED;
            self.spill.insert(key, count);
        } else {
            if self.blocks[owner as usize].refs[tier as usize] == SPILLED {
                self.spill.remove(&key);
            }
            self.blocks[owner as usize].refs[tier as usize] = count as u8;
        }
    }

    /// Counts one more reference to the block's canonical block (`canonical`) on `tier`;
    /// returns the count before.
    pub fn add_ref(&mut self, slot: Slot, canonical: u64, tier: Tier) -> u32 {
        let owner = if self.blocks[slot as usize].meta & OWNER != 0 {
            slot
        } else {
            // One probe finds the owner or the place for a new one.
            let index = slot as usize;
            let blocks = &self.blocks;
            let (hash, parent_of) = (blocks[index].tokens_hash, blocks[index].parent());
            let entry = self.by_canonical.entry(
                hash_u64(canonical),
                |&other| {
                    blocks[other as usize].tokens_hash == hash
                        && blocks[other as usize].parent() == parent_of
                },
                |&s| hash_u64(blocks[s as usize].canonical()),
            );
            match entry {
                hashbrown::hash_table::Entry::Occupied(entry) => *entry.get(),
                hashbrown::hash_table::Entry::Vacant(entry) => {
                    entry.insert(slot);
                    self.blocks[index].meta |= OWNER;
                    slot
                }
            }
        };
        let before = self.count(owner, tier);
        if before == 0 {
            self.resident[tier as usize] += 1;
        }
        self.set_count(owner, tier, before + 1);
        before
    }

    /// The references to a canonical block on `tier`.
    pub fn refs_of(&self, canonical: u64, tier: Tier) -> u32 {
        self.owner(canonical)
            .map_or(0, |owner| self.count(owner, tier))
    }

    /// Counts one reference less on `tier` (`owner` must hold one); the canonical block
    /// (`canonical`) leaves the index when no tier holds it any more.
    pub fn release_ref(&mut self, owner: Slot, canonical: u64, tier: Tier) {
        let count = self.count(owner, tier) - 1;
        self.set_count(owner, tier, count);
        if count == 0 {
            self.resident[tier as usize] -= 1;
            if self.blocks[owner as usize].refs == [0; 4] {
                let found = self
                    .by_canonical
                    .find_entry(hash_u64(canonical), |&slot| slot == owner);
                if let Ok(entry) = found {
                    entry.remove();
                    self.blocks[owner as usize].meta &= !OWNER;
                }
            }
        }
    }

    /// Whether `owner` (from [`Rank::owner_of`]) holds references on any tier.
    pub fn holds_refs(&self, owner: Slot) -> bool {
        self.blocks[owner as usize].refs != [0; 4]
    }

    /// The blocks resident on a tier.
    pub fn resident(&self, tier: Tier) -> usize {
        self.resident[tier as usize]
    }

    /// Forgets every reference count (a clear).
    pub fn clear_refs(&mut self) {
        for block in &mut self.blocks {
            block.refs = [0; 4];
            block.meta &= !OWNER;
        }
        self.spill.clear();
        self.by_canonical.clear();
        self.resident = [0; 4];
    }

    /// Takes every reference to `slot`'s canonical block off `tier`; returns whether it had
    /// any.
    pub fn drop_refs(&mut self, slot: Slot, canonical: u64, tier: Tier) -> bool {
        let Some(owner) = self.owner_of(slot, canonical) else {
            return false;
        };
        if self.count(owner, tier) == 0 {
            return false;
        }
        self.set_count(owner, tier, 1);
        self.release_ref(owner, canonical, tier);
        true
    }
}
