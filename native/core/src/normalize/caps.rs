//! The caps on a normalizer's state ([`Limits`]): ranks forgotten, blocks evicted and
//! contexts compacted, each undone downstream.

use super::Normalizer;
use crate::media::Tier;
use crate::output::Output;
use crate::state::{map, Rank, MAX_CONTEXTS};

impl Normalizer {
    /// How many (LoRA name, cache salt) contexts the table may hold.
    pub(super) fn context_cap(&self) -> usize {
        self.limits.max_contexts.clamp(1, MAX_CONTEXTS)
    }

    /// Live blocks over every rank.
    fn live_blocks(&self) -> usize {
        self.ranks.values().map(Rank::live_count).sum()
    }

    /// Forgets the least recently written ranks until a new one fits, clearing them
    /// downstream.
    pub(super) fn make_room_for_rank(&mut self, event_id: u64, out: &mut Output) {
        while self.ranks.len() >= self.limits.max_ranks.max(1) {
            let Some((&oldest, _)) = self.rank_use.iter().min_by_key(|(_, used)| **used) else {
                break;
            };
            self.rank_use.remove(&oldest);
            let mut rank = self.ranks.remove(&oldest).expect("a used rank exists");
            self.rank_order.retain(|known| *known != oldest);
            self.clear(&mut rank, oldest, event_id, out);
            self.counters.evicted_ranks += 1;
        }
    }

    /// Evicts the oldest blocks of `rank` while the normalizer holds more live blocks than
    /// its cap, removing them downstream.
    pub(super) fn enforce_block_cap(
        &mut self,
        rank: &mut Rank,
        dp_rank: u32,
        event_id: u64,
        out: &mut Output,
    ) {
        let total = self.live_blocks() + rank.live_count();
        if total <= self.limits.max_blocks {
            return;
        }
        // Evict a sixteenth of the cap at once, so that the scan for the oldest is amortized.
        let excess = (total - self.limits.max_blocks)
            .max(self.limits.max_blocks / 16)
            .max(1);
        let slots = rank.oldest_live(excess.min(rank.live_count()));
        let mut removed: [Vec<u64>; 4] = Default::default();
        for &slot in &slots {
            let canonical = rank.canonical(slot);
            for tier in Tier::ALL {
                if rank.drop_refs(slot, canonical, tier) {
                    removed[tier as usize].push(canonical);
                }
            }
        }
        rank.retire(&slots, self.retain_evicted);
        self.counters.evicted_blocks += slots.len() as u64;
        for tier in Tier::ALL {
            let mut gone = std::mem::take(&mut removed[tier as usize]);
            if !gone.is_empty() {
                self.flush_removal(dp_rank, event_id, Some(tier), &mut gone, out);
            }
        }
    }

    /// Forgets the contexts no live block uses (and the retired blocks that use them);
    /// returns whether there is room for one more.
    /// `current` is the rank being written, which is out of the map meanwhile.
    pub(super) fn compact_contexts(&mut self, current: &mut Rank) -> bool {
        let mut used = vec![false; self.contexts.len()];
        used[0] = true;
        for rank in self.ranks.values() {
            rank.contexts_in_use(&mut used);
        }
        current.contexts_in_use(&mut used);
        // Retired blocks of a context that goes are forgotten with it.
        for rank in self.ranks.values_mut() {
            rank.forget_retired_unless(&used);
        }
        current.forget_retired_unless(&used);
        let mut remap = vec![0u32; self.contexts.len()];
        let mut kept = Vec::new();
        for (id, context) in std::mem::take(&mut self.contexts).into_iter().enumerate() {
            if used[id] {
                remap[id] = kept.len() as u32;
                kept.push(context);
            }
        }
        self.contexts = kept;
        self.context_ids = map();
        for (id, (context, _)) in self.contexts.iter().enumerate() {
            self.context_ids.insert(context.clone(), id as u32);
        }
        for rank in self.ranks.values_mut() {
            rank.remap_contexts(&remap);
        }
        current.remap_contexts(&remap);
        self.counters.context_compactions += 1;
        self.contexts.len() < self.context_cap()
    }
}
