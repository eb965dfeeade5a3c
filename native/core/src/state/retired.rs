//! Blocks that left every tier but keep their identity for a while (retired), and the
//! anchors a loss leaves: blocks whose residency is unknown until a store names them.

use std::collections::VecDeque;

use hashbrown::HashTable;

use super::tokens::Tokens;
use super::{hash_u64, map, Rank, Slot, LIVE, RETIRED};

impl Rank {
    /// Remembers every tracked block as an anchor (see [`Rank::anchor`]).
    pub fn set_anchors(&mut self) {
        self.anchors.clear();
        for slot in 0..self.blocks.len() as Slot {
            if self.blocks[slot as usize].meta & (LIVE | RETIRED) != 0 {
                let canonical = self.canonical(slot);
                self.anchors.insert(canonical, slot);
            }
        }
    }

    /// Whether the rank still has anchors from a loss.
    pub fn anchoring(&self) -> bool {
        !self.anchors.is_empty()
    }

    /// Takes the anchor of a canonical block: the slot that held it before the loss, if it is
    /// still tracked.
    pub fn anchor(&mut self, canonical: u64) -> Option<Slot> {
        let slot = self.anchors.remove(&canonical)?;
        let tracked = self.blocks[slot as usize].meta & (LIVE | RETIRED) != 0;
        (tracked && self.canonical(slot) == canonical).then_some(slot)
    }

    /// Revives a slot taken as an anchor (a no-op for a live one).
    pub fn revive_slot(&mut self, slot: Slot) {
        let engine = self.blocks[slot as usize].engine;
        self.revive(engine);
    }

    // -- retiring -----------------------------------------------------------------------------

    /// Moves live blocks to the retired ones, then forgets the oldest retired past `retain`.
    pub fn retire(&mut self, slots: &[Slot], retain: usize) {
        for &slot in slots {
            debug_assert!(self.is_live(slot));
            let order = self.next();
            let meta = &mut self.blocks[slot as usize].meta;
            *meta = (*meta & !LIVE) | RETIRED;
            self.blocks[slot as usize].order = order;
            self.retired.push_back((slot, order));
            self.retired_count += 1;
            self.live -= 1;
        }
        while self.retired_count > retain {
            let Some((slot, order)) = self.retired.pop_front() else {
                break;
            };
            if !self.is_retired(slot) || self.blocks[slot as usize].order != order {
                continue; // revived since, or retired again later
            }
            self.forget(slot);
        }
        if self.retired.len() > 2 * self.retired_count + 1024 {
            self.retired = self.retired_queue();
        }
        self.compact_if_sparse();
    }

    pub(super) fn forget(&mut self, slot: Slot) {
        let engine = self.blocks[slot as usize].engine;
        if let Ok(entry) = self.by_engine.find_entry(hash_u64(engine), |&s| s == slot) {
            entry.remove();
        }
        self.blocks[slot as usize].meta = 0;
        self.free.push(slot);
        self.retired_count -= 1;
    }

    /// The retired slots, oldest first, without stale entries.
    fn retired_queue(&self) -> VecDeque<(Slot, u32)> {
        let mut queue: Vec<(u32, Slot)> = (0..self.blocks.len() as Slot)
            .filter(|&slot| self.is_retired(slot))
            .map(|slot| (self.blocks[slot as usize].order, slot))
            .collect();
        queue.sort_unstable();
        queue
            .into_iter()
            .map(|(order, slot)| (slot, order))
            .collect()
    }

    /// Every live block, oldest first.
    pub fn live_slots(&self) -> Vec<Slot> {
        let mut live: Vec<(u32, Slot)> = (0..self.blocks.len() as Slot)
            .filter(|&slot| self.is_live(slot))
            .map(|slot| (self.blocks[slot as usize].order, slot))
            .collect();
        live.sort_unstable();
        live.into_iter().map(|(_, slot)| slot).collect()
    }

    /// Renumbers the orders from 1 when the counter would wrap, keeping their sequence.
    pub(super) fn renumber(&mut self) {
        let mut used: Vec<(u32, Slot)> = (0..self.blocks.len() as Slot)
            .filter(|&slot| self.blocks[slot as usize].meta & (LIVE | RETIRED) != 0)
            .map(|slot| (self.blocks[slot as usize].order, slot))
            .collect();
        used.sort_unstable();
        for (order, (_, slot)) in used.iter().enumerate() {
            self.blocks[*slot as usize].order = order as u32 + 1;
        }
        self.next_order = used.len() as u32;
        self.retired = self.retired_queue();
    }

    /// Moves the blocks down over the free slots once most slots are free, or once no block
    /// is live and an eighth are free (what is left is the retained blocks), so that the
    /// state shrinks back to what it holds after a mass eviction. Each compaction follows at
    /// least an eighth of the slots' frees: its cost, linear in the slots, is amortized.
    fn compact_if_sparse(&mut self) {
        let slots = self.blocks.len();
        let free = self.free.len();
        let sparse = free * 2 >= slots || (self.live == 0 && free * 8 >= slots);
        if slots < 4096 || !sparse {
            return;
        }
        let keep: Vec<Slot> = (0..slots as Slot)
            .filter(|&slot| self.blocks[slot as usize].meta & (LIVE | RETIRED) != 0)
            .collect();
        let mut remap = vec![Slot::MAX; slots];
        let mut tokens = Tokens {
            block_size: self.tokens.block_size,
            width: self.tokens.width,
            bytes: Vec::with_capacity(keep.len() * self.tokens.stride()),
        };
        let mut scratch = Vec::with_capacity(self.tokens.block_size);
        let mut spill = map();
        for (new, &old) in keep.iter().enumerate() {
            remap[old as usize] = new as Slot;
            scratch.clear();
            self.tokens.read(old, &mut scratch);
            tokens.put(new as Slot, &scratch);
            for tier in 0..4u8 {
                if let Some(count) = self.spill.get(&(old, tier)) {
                    spill.insert((new as Slot, tier), *count);
                }
            }
        }
        fn pick<T: Copy>(values: &[T], keep: &[Slot]) -> Vec<T> {
            keep.iter().map(|&slot| values[slot as usize]).collect()
        }
        self.blocks = pick(&self.blocks, &keep);
        self.tokens = tokens;
        self.spill = spill;
        self.free = Vec::new();
        let mut by_engine = HashTable::with_capacity(keep.len());
        let mut by_canonical = HashTable::with_capacity(self.by_canonical.len());
        for slot in 0..keep.len() as Slot {
            let blocks = &self.blocks;
            by_engine.insert_unique(hash_u64(blocks[slot as usize].engine), slot, |&s| {
                hash_u64(blocks[s as usize].engine)
            });
        }
        for &old in self.by_canonical.iter() {
            let new = remap[old as usize];
            if new == Slot::MAX {
                continue; // unreachable: an owner holds references, so it is live
            }
            let canonical = self.canonical(new);
            let this = &*self;
            by_canonical.insert_unique(hash_u64(canonical), new, |&s| hash_u64(this.canonical(s)));
        }
        self.by_engine = by_engine;
        self.by_canonical = by_canonical;
        self.retired = self
            .retired
            .iter()
            .filter_map(|&(slot, order)| {
                let new = remap[slot as usize];
                (new != Slot::MAX).then_some((new, order))
            })
            .collect();
    }
}
