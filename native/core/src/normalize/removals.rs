//! Removals and clears: references released, blocks retired, what left every tier
//! forwarded.

use super::{Action, DropReason, Normalizer};
use crate::media::Tier;
use crate::output::{Body, OutEvent, Output};
use crate::state::Rank;

impl Normalizer {
    /// Counts one reference less on `tier` for each block; collects in `gone` those whose last
    /// reference went.
    pub(super) fn removed(
        &mut self,
        rank: &mut Rank,
        tier: Tier,
        medium: Option<&str>,
        hashes: &[u64],
        gone: &mut Vec<u64>,
    ) {
        let mut evicted = std::mem::take(&mut self.evicted);
        evicted.clear();
        for &key in hashes {
            let live = rank.live(key).map(|slot| (slot, rank.canonical(slot)));
            let owner = live.and_then(|(slot, canonical)| rank.owner_of(slot, canonical));
            let count = owner.map_or(0, |owner| rank.count(owner, tier));
            if let (Some((slot, canonical)), Some(owner)) = (live.filter(|_| count >= 1), owner) {
                rank.release_ref(owner, canonical, tier);
                if count == 1 {
                    gone.push(canonical);
                    // The owner leaves the index with its last reference: then no tier holds
                    // the block (the count on this tier is now 0, so any left is elsewhere).
                    if !rank.holds_refs(owner) {
                        evicted.push(slot);
                    }
                } else {
                    self.count_drop(Action::Removed, tier, DropReason::StillReferenced, 1);
                }
            } else if rank.cleared.remove(&key) {
                self.count_drop(Action::Removed, tier, DropReason::ClearedEarlier, 1);
            } else {
                self.drop_blocks(
                    Action::Removed,
                    Some(tier),
                    DropReason::UnknownBlock,
                    1,
                    medium,
                );
            }
        }
        rank.retire(&evicted, self.retain_evicted);
        self.evicted = evicted;
    }

    pub(super) fn flush_removal(
        &mut self,
        dp_rank: u32,
        event_id: u64,
        tier: Option<Tier>,
        gone: &mut Vec<u64>,
        out: &mut Output,
    ) {
        let tier = tier.expect("removals have a tier");
        self.counters.forwarded[Action::Removed as usize][tier as usize] += gone.len() as u64;
        let start = out.hashes.len();
        out.hashes.append(gone);
        out.events.push(OutEvent {
            dp_rank,
            tier,
            event_id,
            body: Body::Removed {
                hashes: start..out.hashes.len(),
            },
        });
    }

    pub(super) fn clear(&mut self, rank: &mut Rank, dp_rank: u32, event_id: u64, out: &mut Output) {
        let live = rank.live_slots();
        if rank.cleared.len() + live.len() > self.retain_evicted {
            rank.cleared.clear();
        }
        for &slot in &live {
            rank.cleared.insert(rank.engine(slot));
        }
        rank.clear_refs();
        rank.retire(&live, self.retain_evicted);
        for tier in Tier::ALL {
            self.counters.forwarded[Action::Cleared as usize][tier as usize] += 1;
            out.events.push(OutEvent {
                dp_rank,
                tier,
                event_id,
                body: Body::Cleared,
            });
        }
    }
}
