//! Stores: new blocks hashed canonically, placeholders resolved, reference counts taken, and
//! runs of chained blocks forwarded.

use std::sync::Arc;

use super::extra_keys::{block_keys, cache_salt, mm_hashes};
use super::{Action, DropReason, EventTokens, Normalizer};
use crate::decode::{Arena, Stored};
use crate::hashing::{sequence_hash, tokens_hash};
use crate::media::Tier;
use crate::msgpack::write;
use crate::output::{Body, OutEvent, Output, Store};
use crate::state::{Rank, Slot};

impl Normalizer {
    pub(super) fn stored(
        &mut self,
        rank: &mut Rank,
        dp_rank: u32,
        event_id: u64,
        stored: &Stored<'_>,
        arena: &Arena,
        out: &mut Output,
    ) {
        let blocks = stored.hashes.len() as u64;
        if let (Some(spec), Some(group)) = (stored.spec_kind, stored.group_idx) {
            if rank.group_kinds.get(&group).map(|kind| &**kind) != Some(spec) {
                rank.group_kinds.insert(group, Box::from(spec));
                rank.group_main = None;
            }
        }
        let verdict = self.judge(
            rank,
            stored.medium,
            stored.locality,
            stored.group_idx,
            stored.spec_kind,
        );
        let Some(tier) = self.admitted(Action::Stored, blocks, stored.medium, verdict) else {
            return;
        };
        let hashes = &arena.hashes[stored.hashes.clone()];
        if stored.tokens.is_empty() {
            let mut slots = Vec::with_capacity(hashes.len());
            for &key in hashes {
                match rank.revive(key) {
                    Some(slot) => slots.push((slot, rank.canonical(slot))),
                    None => self.drop_blocks(
                        Action::Stored,
                        Some(tier),
                        DropReason::UnresolvedPlaceholder,
                        1,
                        stored.medium,
                    ),
                }
            }
            self.make_resident(rank, dp_rank, event_id, tier, &slots, None, out);
            return;
        }
        if stored.block_size != self.block_size as u64 {
            self.drop_blocks(
                Action::Stored,
                Some(tier),
                DropReason::BlockSizeMismatch,
                blocks,
                stored.medium,
            );
            return;
        }
        let tokens = &arena.tokens[stored.tokens.clone()];
        match self.canonical_blocks(rank, tier, stored, hashes, tokens) {
            Ok((slots, anchored)) => {
                let tokens = (!anchored).then_some(EventTokens {
                    ids: tokens,
                    msgpack: stored.token_msgpack,
                });
                self.make_resident(rank, dp_rank, event_id, tier, &slots, tokens, out);
                self.slots = slots;
            }
            Err(reason) => {
                self.drop_blocks(Action::Stored, Some(tier), reason, blocks, stored.medium)
            }
        }
    }

    /// Hashes the event's new blocks canonically and remembers them by engine hash. A block
    /// whose engine hash is known keeps its canonical identity: an offload tier's copy carries
    /// no extra keys (no salt, no multimodal hashes), so hashing it again would mis-hash it.
    ///
    /// Returns the blocks, preceded (`true`) by the ancestors a loss made unknown downstream
    /// when the store re-anchors them.
    fn canonical_blocks(
        &mut self,
        rank: &mut Rank,
        tier: Tier,
        stored: &Stored<'_>,
        hashes: &[u64],
        tokens: &[u32],
    ) -> Result<(Vec<(Slot, u64)>, bool), DropReason> {
        let mut lora: Option<Arc<str>> = stored
            .lora_name
            .filter(|name| !name.is_empty())
            .map(Arc::from);
        let salt: Option<Arc<str>>;
        let mut parent: Option<u64>;
        match stored.parent {
            None => {
                parent = None;
                salt = cache_salt(stored).map(Arc::from);
            }
            Some(engine) => {
                let slot = rank.lookup(engine).ok_or(DropReason::OrphanParent)?;
                let context = self.context_of(rank.context(slot)).clone();
                parent = Some(rank.canonical(slot));
                salt = context.cache_salt;
                if lora.is_none() {
                    lora = context.lora_name;
                }
            }
        }
        let mut context = self
            .context(rank, lora.as_deref(), salt.as_deref())
            .ok_or(DropReason::StateCap)?;
        let mut seed = self.contexts[context as usize].1;
        let extra = stored.extra_keys.map(block_keys).unwrap_or_default();
        let size = self.block_size;
        let mut scratch = std::mem::take(&mut self.hash_scratch);
        let mut mm = Vec::new();
        let mut slots = std::mem::take(&mut self.slots);
        slots.clear();
        let mut anchored = false;
        if let Some(parent) = parent.filter(|_| rank.anchoring()) {
            slots = self.ancestors_to_anchor(rank, tier, parent);
            anchored = !slots.is_empty();
        }
        for (index, &key) in hashes.iter().enumerate() {
            let (slot, canonical) = match rank.revive(key) {
                Some(slot) => {
                    if rank.context(slot) != context {
                        context = rank.context(slot);
                        seed = self.contexts[context as usize].1;
                    }
                    (slot, rank.canonical(slot))
                }
                None => {
                    let block_tokens = &tokens[index * size..(index + 1) * size];
                    mm.clear();
                    if let Some(Some(keys)) = extra.get(index) {
                        mm_hashes(keys, &mut mm);
                    }
                    let content = tokens_hash(block_tokens, seed, &mut mm, &mut scratch);
                    let slot = rank.insert(key, content, parent, context, block_tokens);
                    (slot, sequence_hash(parent, content))
                }
            };
            parent = Some(canonical);
            slots.push((slot, canonical));
        }
        self.hash_scratch = scratch;
        Ok((slots, anchored))
    }

    /// The chain of anchors that ends at `parent`, root first, up to the first block already
    /// resident on `tier` or a root; empty if the chain reaches a block nobody knows (then the
    /// store goes out as before, and Dynamo's index decides).
    fn ancestors_to_anchor(
        &mut self,
        rank: &mut Rank,
        tier: Tier,
        parent: u64,
    ) -> Vec<(Slot, u64)> {
        let mut chain = Vec::new();
        let mut next = Some(parent);
        while let Some(canonical) = next {
            if rank.refs_of(canonical, tier) > 0 {
                break;
            }
            let Some(slot) = rank.anchor(canonical) else {
                if chain.is_empty() {
                    return chain;
                }
                break; // the rest of the chain is not ours to announce
            };
            chain.push((slot, canonical));
            next = rank.parent(slot);
        }
        chain.reverse();
        for &(slot, _) in &chain {
            rank.revive_slot(slot);
        }
        self.counters.reanchored_blocks += chain.len() as u64;
        chain
    }

    /// Counts one more reference on `tier` for each block, and forwards those that just became
    /// resident as runs of chained blocks. `tokens` are the event's own tokens, or `None` to
    /// take them from the blocks.
    #[allow(clippy::too_many_arguments)]
    fn make_resident(
        &mut self,
        rank: &mut Rank,
        dp_rank: u32,
        event_id: u64,
        tier: Tier,
        slots: &[(Slot, u64)],
        mut tokens: Option<EventTokens<'_>>,
        out: &mut Output,
    ) {
        let mut start = 0;
        let mut run = std::mem::take(&mut self.run);
        run.clear();
        let mut last: Option<u64> = None;
        let mut duplicates = 0;
        for (index, &(slot, canonical)) in slots.iter().enumerate() {
            let parent = rank.parent(slot);
            if rank.add_ref(slot, canonical, tier) > 0 {
                duplicates += 1;
                continue;
            }
            if !run.is_empty() && last != parent {
                self.push_store(rank, dp_rank, event_id, tier, &run, tokens, start, out);
                run.clear();
            }
            if run.is_empty() {
                start = index;
            } else if index != start + run.len() {
                tokens = None; // a duplicate skipped inside the chain: not one token slice
            }
            run.push((slot, canonical));
            last = Some(canonical);
        }
        if !run.is_empty() {
            self.push_store(rank, dp_rank, event_id, tier, &run, tokens, start, out);
        }
        self.run = run;
        self.counters.forwarded[Action::Stored as usize][tier as usize] +=
            (slots.len() - duplicates) as u64;
        if duplicates > 0 {
            self.count_drop(
                Action::Stored,
                tier,
                DropReason::DuplicateStore,
                duplicates as u64,
            );
        }
    }

    /// Appends the store of a chained run of blocks to `out`; `tokens` as for
    /// [`Normalizer::make_resident`].
    #[allow(clippy::too_many_arguments)]
    pub(super) fn push_store(
        &mut self,
        rank: &Rank,
        dp_rank: u32,
        event_id: u64,
        tier: Tier,
        run: &[(Slot, u64)],
        tokens: Option<EventTokens<'_>>,
        start: usize,
        out: &mut Output,
    ) {
        let first = run[0].0;
        let blocks_start = out.blocks.len();
        out.blocks.extend(
            run.iter()
                .map(|&(slot, canonical)| (canonical, rank.tokens_hash(slot))),
        );
        let tokens_start = out.token_msgpack.len();
        let ids_start = out.token_ids.len();
        let size = self.block_size;
        let token_count = run.len() * size;
        match tokens {
            Some(EventTokens { ids: all, msgpack }) => {
                let ids = &all[start * size..(start + run.len()) * size];
                out.token_ids.extend_from_slice(ids);
                match msgpack.filter(|_| token_count == all.len()) {
                    Some(msgpack) => out.token_msgpack.extend_from_slice(msgpack),
                    None => write::small_uints(&mut out.token_msgpack, ids),
                }
            }
            None => {
                for &(slot, _) in run {
                    rank.read_tokens(slot, &mut out.token_ids);
                }
                write::small_uints(&mut out.token_msgpack, &out.token_ids[ids_start..]);
            }
        }
        let context = self.context_of(rank.context(first)).clone();
        out.events.push(OutEvent {
            dp_rank,
            tier,
            event_id,
            body: Body::Stored(Store {
                parent: rank.parent(first),
                blocks: blocks_start..out.blocks.len(),
                tokens: tokens_start..out.token_msgpack.len(),
                ids: ids_start..out.token_ids.len(),
                lora_name: context.lora_name,
                cache_salt: context.cache_salt,
            }),
        });
    }
}
