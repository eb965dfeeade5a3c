//! Which events a tier takes: media, locality and KV-cache groups, and the drops counted
//! for the rest.

use super::{Action, DropReason, FirstDrop, Normalizer};
use crate::decode::Removed;
use crate::media::{tier_for_medium, Tier};
use crate::state::Rank;

impl Normalizer {
    pub(super) fn drop_blocks(
        &mut self,
        action: Action,
        tier: Option<Tier>,
        reason: DropReason,
        count: u64,
        medium: Option<&str>,
    ) {
        let tier_index = tier.map_or(4, |tier| tier as usize);
        self.counters.dropped[action as usize][tier_index][reason as usize] += count;
        let bit = 1 << reason as u16;
        if self.logged & bit == 0 {
            self.logged |= bit;
            self.first_drops.push(FirstDrop {
                reason,
                action,
                tier,
                medium: medium.map(str::to_string),
            });
        }
    }

    pub(super) fn count_drop(
        &mut self,
        action: Action,
        tier: Tier,
        reason: DropReason,
        count: u64,
    ) {
        self.counters.dropped[action as usize][tier as usize][reason as usize] += count;
    }

    pub(super) fn admit_removal(&mut self, rank: &mut Rank, removed: &Removed<'_>) -> Option<Tier> {
        let blocks = removed.hashes.len() as u64;
        let verdict = self.judge(
            rank,
            removed.medium,
            removed.locality,
            removed.group_idx,
            None,
        );
        self.admitted(Action::Removed, blocks, removed.medium, verdict)
    }

    pub(super) fn admitted(
        &mut self,
        action: Action,
        blocks: u64,
        medium: Option<&str>,
        verdict: (Option<Tier>, Option<DropReason>),
    ) -> Option<Tier> {
        match verdict {
            (tier, Some(reason)) => {
                self.drop_blocks(action, tier, reason, blocks, medium);
                None
            }
            (tier, None) => tier,
        }
    }

    /// The tier of an event, or the reason it is not indexed.
    pub(super) fn judge(
        &self,
        rank: &mut Rank,
        medium: Option<&str>,
        locality: Option<&str>,
        group: Option<u32>,
        spec: Option<&str>,
    ) -> (Option<Tier>, Option<DropReason>) {
        let Some(tier) = tier_for_medium(medium) else {
            return (None, Some(DropReason::UnknownMedium));
        };
        if let Some(locality) = locality {
            let upper = locality.to_uppercase();
            if upper != "LOCAL" {
                let reason = if upper == "REMOTE" {
                    DropReason::RemoteLocality
                } else {
                    DropReason::UnknownLocality
                };
                return (Some(tier), Some(reason));
            }
        }
        let is_main = |spec: &str| self.main_kinds.iter().any(|kind| &**kind == spec);
        let main = match (spec, group) {
            (Some(spec), _) => is_main(spec),
            // A group's kind is the one stores named it with; group 0 is main without one.
            (None, Some(group)) => match rank.group_main {
                Some((cached, main)) if cached == group => main,
                _ => {
                    let main = rank
                        .group_kinds
                        .get(&group)
                        .map_or(group == 0, |kind| is_main(kind));
                    rank.group_main = Some((group, main));
                    main
                }
            },
            (None, None) => true,
        };
        (Some(tier), (!main).then_some(DropReason::NonMainGroup))
    }
}
