//! Walks over a whole rank: its oldest live blocks (for the block cap), the contexts its
//! blocks use (for the context cap), and what is resident on a tier, parents first (for a
//! snapshot).

use super::{Map, Rank, Slot, CONTEXT_MASK, LIVE, RETIRED};
use crate::media::Tier;

impl Rank {
    /// The `count` oldest live blocks, oldest first.
    pub fn oldest_live(&self, count: usize) -> Vec<Slot> {
        let mut live: Vec<(u32, Slot)> = (0..self.blocks.len() as Slot)
            .filter(|&slot| self.is_live(slot))
            .map(|slot| (self.blocks[slot as usize].order, slot))
            .collect();
        if count < live.len() {
            live.select_nth_unstable(count);
            live.truncate(count);
        }
        live.sort_unstable();
        live.into_iter().map(|(_, slot)| slot).collect()
    }

    /// The contexts the rank's live blocks use.
    pub fn contexts_in_use(&self, used: &mut [bool]) {
        for meta in self.blocks.iter().map(|block| block.meta) {
            if meta & LIVE != 0 {
                used[(meta & CONTEXT_MASK) as usize] = true;
            }
        }
    }

    /// Forgets the retired blocks whose context is not `used` (the context is going away).
    pub fn forget_retired_unless(&mut self, used: &[bool]) {
        for slot in 0..self.blocks.len() as Slot {
            let meta = self.blocks[slot as usize].meta;
            if meta & RETIRED != 0 && !used[(meta & CONTEXT_MASK) as usize] {
                self.forget(slot);
            }
        }
    }

    /// Renames the blocks' contexts after the context table was compacted.
    pub fn remap_contexts(&mut self, remap: &[u32]) {
        for meta in self.blocks.iter_mut().map(|block| &mut block.meta) {
            if *meta & (LIVE | RETIRED) != 0 {
                let context = remap[(*meta & CONTEXT_MASK) as usize];
                *meta = (*meta & !CONTEXT_MASK) | context;
            }
        }
    }

    /// The blocks resident on `tier`, parents before their children (by depth in the chain of
    /// blocks resident there), oldest first at each depth.
    pub fn resident_on(&self, tier: Tier) -> Vec<Slot> {
        let owners: Vec<Slot> = self
            .by_canonical
            .iter()
            .copied()
            .filter(|&slot| self.count(slot, tier) > 0)
            .collect();
        let index: Map<u64, usize> = owners
            .iter()
            .enumerate()
            .map(|(at, &slot)| (self.canonical(slot), at))
            .collect();
        let mut depth: Vec<Option<u32>> = vec![None; owners.len()];
        for start in 0..owners.len() {
            // Walk up to the first block whose depth is known (or a root), then fill the path.
            let mut path = Vec::new();
            let mut at = start;
            let base = loop {
                if let Some(known) = depth[at] {
                    break known + 1;
                }
                path.push(at);
                match self
                    .parent(owners[at])
                    .and_then(|parent| index.get(&parent))
                {
                    Some(&up) if !path.contains(&up) => at = up,
                    _ => break 0,
                }
            };
            for (offset, &node) in path.iter().rev().enumerate() {
                depth[node] = Some(base + offset as u32);
            }
        }
        let mut ordered: Vec<(u32, u32, Slot)> = owners
            .iter()
            .enumerate()
            .map(|(at, &slot)| {
                (
                    depth[at].unwrap_or(0),
                    self.blocks[slot as usize].order,
                    slot,
                )
            })
            .collect();
        ordered.sort_unstable();
        ordered.into_iter().map(|(_, _, slot)| slot).collect()
    }
}
