//! The stateful translation of one worker's stream into canonical, tiered Dynamo events.
//!
//! Every engine hash is rewritten to Dynamo's rolling sequence hash of the block's content,
//! residency is reference-counted per (dp rank, tier, block), CPU placeholders are resolved
//! through the engine hashes seen before, and whatever is not forwarded is counted by reason.

use std::sync::Arc;

use crate::decode::{decode, Arena, Batch, Event, Removed, SchemaError, Stored};
use crate::hashing::{block_seed, identifier_hash, sequence_hash, tokens_hash, DYNAMO_SALT_PREFIX};
use crate::media::{tier_for_medium, Tier};
use crate::msgpack::{write, Item, Reader};
use crate::output::{Body, OutEvent, Output, Store};
use crate::state::{map, Map, Rank, Slot, MAX_CONTEXTS};

/// Why a block (or a clear) was not forwarded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropReason {
    UnknownMedium = 0,
    RemoteLocality,
    UnknownLocality,
    NonMainGroup,
    BlockSizeMismatch,
    OrphanParent,
    UnresolvedPlaceholder,
    DuplicateStore,
    StillReferenced,
    UnknownBlock,
    ClearedEarlier,
    StateCap,
}

impl DropReason {
    pub const ALL: [DropReason; 12] = [
        DropReason::UnknownMedium,
        DropReason::RemoteLocality,
        DropReason::UnknownLocality,
        DropReason::NonMainGroup,
        DropReason::BlockSizeMismatch,
        DropReason::OrphanParent,
        DropReason::UnresolvedPlaceholder,
        DropReason::DuplicateStore,
        DropReason::StillReferenced,
        DropReason::UnknownBlock,
        DropReason::ClearedEarlier,
        DropReason::StateCap,
    ];

    /// The reason's name in `kvbridge.DropReason` and the metrics.
    pub fn name(self) -> &'static str {
        match self {
            DropReason::UnknownMedium => "unknown_medium",
            DropReason::RemoteLocality => "remote_locality",
            DropReason::UnknownLocality => "unknown_locality",
            DropReason::NonMainGroup => "non_main_group",
            DropReason::BlockSizeMismatch => "block_size_mismatch",
            DropReason::OrphanParent => "orphan_parent",
            DropReason::UnresolvedPlaceholder => "unresolved_placeholder",
            DropReason::DuplicateStore => "duplicate_store",
            DropReason::StillReferenced => "still_referenced",
            DropReason::UnknownBlock => "unknown_block",
            DropReason::ClearedEarlier => "cleared_earlier",
            DropReason::StateCap => "state_cap",
        }
    }
}

/// What an event did: the first index of the counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Stored = 0,
    Removed = 1,
    Cleared = 2,
}

impl Action {
    pub fn name(self) -> &'static str {
        match self {
            Action::Stored => "stored",
            Action::Removed => "removed",
            Action::Cleared => "cleared",
        }
    }
}

/// Blocks forwarded and not forwarded. A drop's tier index 4 means the tier is unknown.
#[derive(Debug, Clone, Default)]
pub struct Counters {
    /// By action and tier; a clear counts once per tier.
    pub forwarded: [[u64; 4]; 3],
    /// By action (stored, removed), tier (or 4: unknown) and reason.
    pub dropped: [[[u64; 12]; 5]; 2],
    pub unknown_fields: u64,
    /// State given up to stay within the [`Limits`]: ranks forgotten (and cleared
    /// downstream), blocks evicted (and removed downstream), context-table compactions.
    pub evicted_ranks: u64,
    pub evicted_blocks: u64,
    pub context_compactions: u64,
    /// Blocks announced again after a loss because a store named them as its ancestors.
    pub reanchored_blocks: u64,
}

/// Caps on the state one normalizer may hold, whatever its input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Ranks tracked; a new rank past it forgets the least recently used one (cleared
    /// downstream, so nothing stays stale).
    pub max_ranks: usize,
    /// Live blocks over every rank; past it the oldest blocks of the rank being written are
    /// evicted (removed downstream).
    pub max_blocks: usize,
    /// Distinct (LoRA name, cache salt) pairs; past it the unused ones are forgotten, and a
    /// store that would need one more is dropped (`state_cap`).
    pub max_contexts: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_ranks: 1024,
            max_blocks: 4_000_000,
            max_contexts: 65_536,
        }
    }
}

/// A reason dropped for the first time, for the one log line it deserves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FirstDrop {
    pub reason: DropReason,
    pub action: Action,
    pub tier: Option<Tier>,
    pub medium: Option<String>,
}

/// The LoRA name and cache salt blocks are hashed with, interned.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Context {
    pub lora_name: Option<Arc<str>>,
    pub cache_salt: Option<Arc<str>>,
}

/// One worker's normalizer.
#[derive(Debug)]
pub struct Normalizer {
    pub worker_id: u64,
    pub block_size: usize,
    pub retain_evicted: usize,
    pub limits: Limits,
    main_kinds: Vec<Box<str>>,
    ranks: Map<u32, Rank>,
    /// When each rank was last written, for the rank cap.
    rank_use: Map<u32, u64>,
    uses: u64,
    /// The ranks in the order they were first seen, as a reset of every rank visits them.
    rank_order: Vec<u32>,
    contexts: Vec<(Context, u64)>,
    context_ids: Map<Context, u32>,
    next_event_id: u64,
    arena: Arena,
    /// Buffers reused from event to event: the slots a removal evicts, the canonical hashes
    /// a run of removals takes off a tier, a store's blocks, the run of them going out and the
    /// bytes a block is hashed from.
    evicted: Vec<Slot>,
    gone: Vec<u64>,
    slots: Vec<(Slot, u64)>,
    run: Vec<(Slot, u64)>,
    hash_scratch: Vec<u8>,
    pub counters: Counters,
    logged: u16,
    pub first_drops: Vec<FirstDrop>,
}

/// A store's own token ids, and their msgpack when the input wrote each in its shortest form
/// (what the output would write for them).
#[derive(Clone, Copy)]
struct EventTokens<'a> {
    ids: &'a [u32],
    msgpack: Option<&'a [u8]>,
}

/// The KV-cache group kinds a prefix index can use; Dynamo indexes exactly these.
pub const MAIN_ATTENTION_KINDS: [&str; 3] =
    ["full_attention", "mla_attention", "sink_full_attention"];

impl Normalizer {
    pub fn new(
        worker_id: u64,
        block_size: usize,
        retain_evicted: usize,
        main_kinds: &[&str],
        limits: Limits,
    ) -> Self {
        let mut normalizer = Normalizer {
            worker_id,
            block_size,
            retain_evicted,
            limits,
            rank_use: map(),
            uses: 0,
            main_kinds: main_kinds.iter().map(|kind| Box::from(*kind)).collect(),
            ranks: map(),
            rank_order: Vec::new(),
            contexts: Vec::new(),
            context_ids: map(),
            next_event_id: 0,
            arena: Arena::default(),
            evicted: Vec::new(),
            gone: Vec::new(),
            slots: Vec::new(),
            run: Vec::new(),
            hash_scratch: Vec::new(),
            counters: Counters::default(),
            logged: 0,
            first_drops: Vec::new(),
        };
        let empty = Context {
            lora_name: None,
            cache_salt: None,
        };
        normalizer
            .contexts
            .push((empty.clone(), block_seed(None, None)));
        normalizer.context_ids.insert(empty, 0);
        normalizer
    }

    /// How many (LoRA name, cache salt) contexts the table may hold.
    fn context_cap(&self) -> usize {
        self.limits.max_contexts.clamp(1, MAX_CONTEXTS)
    }

    /// Live blocks over every rank.
    fn live_blocks(&self) -> usize {
        self.ranks.values().map(Rank::live_count).sum()
    }

    /// Forgets the least recently written ranks until a new one fits, clearing them
    /// downstream.
    fn make_room_for_rank(&mut self, event_id: u64, out: &mut Output) {
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
    fn enforce_block_cap(
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
    fn compact_contexts(&mut self, current: &mut Rank) -> bool {
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

    /// The canonical events of one payload. A payload that does not decode changes nothing.
    /// `seq` becomes the events' id; without it an internal counter is used. `reset_first`
    /// clears the batch's rank before the batch (see [`Normalizer::reset`]), for a stream
    /// that restarted before the rank was known.
    pub fn normalize(
        &mut self,
        payload: &[u8],
        seq: Option<u64>,
        reset_first: bool,
    ) -> Result<Output, SchemaError> {
        let mut arena = std::mem::take(&mut self.arena);
        let result = decode(payload, &mut arena).map(|batch| {
            let dp_rank = batch.dp_rank.unwrap_or(0);
            let mut out = if reset_first {
                self.reset(Some(dp_rank))
            } else {
                Output::new()
            };
            self.apply(&batch, &arena, seq, &mut out);
            out.batch = Some((batch.ts, dp_rank));
            out
        });
        self.arena = arena;
        result
    }

    /// Forgets a rank's state (or every rank's) and returns the clears that undo it downstream.
    /// A named rank is cleared even if it was never seen: a consumer may hold its blocks.
    pub fn reset(&mut self, dp_rank: Option<u32>) -> Output {
        let ranks = match dp_rank {
            Some(rank) => vec![rank],
            None => self.rank_order.clone(),
        };
        let event_id = self.next_id();
        let mut out = Output::new();
        for rank_id in ranks {
            let mut rank = match self.ranks.remove(&rank_id) {
                Some(rank) => {
                    self.rank_order.retain(|known| *known != rank_id);
                    self.rank_use.remove(&rank_id);
                    rank
                }
                None => Rank::new(self.block_size),
            };
            self.clear(&mut rank, rank_id, event_id, &mut out);
        }
        out
    }

    /// Clears a rank downstream after batches were lost for good, but keeps what its engine
    /// hashes stand for: an engine hash's canonical identity is a function of content, so it
    /// stays valid across the loss. A later store whose parent chain is known this way shows
    /// that the engine holds that chain, and the chain is announced again with it.
    pub fn reset_lost(&mut self, dp_rank: u32) -> Output {
        let event_id = self.next_id();
        let mut out = Output::new();
        let mut rank = match self.ranks.remove(&dp_rank) {
            Some(rank) => rank,
            None => {
                self.make_room_for_rank(event_id, &mut out);
                self.rank_order.push(dp_rank);
                Rank::new(self.block_size)
            }
        };
        self.uses += 1;
        self.rank_use.insert(dp_rank, self.uses);
        self.clear(&mut rank, dp_rank, event_id, &mut out);
        rank.set_anchors();
        self.ranks.insert(dp_rank, rank);
        out
    }

    /// Everything a rank holds, as a consumer that knows nothing should receive it: a clear of
    /// the rank, then a store of every resident block on each tier, parents first. For a
    /// replay request older than any buffer, and for a stream that starts over.
    pub fn snapshot(&mut self, dp_rank: u32) -> Output {
        let event_id = self.next_id();
        let mut out = Output::new();
        for tier in Tier::ALL {
            out.events.push(OutEvent {
                dp_rank,
                tier,
                event_id,
                body: Body::Cleared,
            });
        }
        let Some(rank) = self.ranks.remove(&dp_rank) else {
            return out;
        };
        for tier in Tier::ALL {
            for slot in rank.resident_on(tier) {
                let block = [(slot, rank.canonical(slot))];
                self.push_store(&rank, dp_rank, event_id, tier, &block, None, 0, &mut out);
            }
        }
        self.ranks.insert(dp_rank, rank);
        out
    }

    /// The ranks seen, sorted.
    pub fn dp_ranks(&self) -> Vec<u32> {
        let mut ranks = self.rank_order.clone();
        ranks.sort_unstable();
        ranks
    }

    /// How many distinct blocks are resident on one tier of one rank.
    pub fn resident_blocks(&self, dp_rank: u32, tier: Tier) -> usize {
        self.ranks
            .get(&dp_rank)
            .map_or(0, |rank| rank.resident(tier))
    }

    /// Engine hashes tracked (live and retired), over every rank.
    pub fn tracked_blocks(&self) -> (usize, usize) {
        self.ranks.values().fold((0, 0), |(live, retired), rank| {
            (live + rank.live_count(), retired + rank.retired_count())
        })
    }

    /// Bytes the state holds on the heap.
    pub fn heap_bytes(&self) -> usize {
        self.ranks.values().map(Rank::heap_bytes).sum::<usize>()
            + self.arena.hashes.capacity() * 8
            + self.arena.tokens.capacity() * 4
    }

    pub fn context_of(&self, id: u32) -> &Context {
        &self.contexts[id as usize].0
    }

    fn next_id(&mut self) -> u64 {
        let id = self.next_event_id;
        self.next_event_id += 1;
        id
    }

    /// The id of a (LoRA name, cache salt) pair, interned; `None` when the table is full of
    /// pairs in use.
    fn context(
        &mut self,
        current: &mut Rank,
        lora_name: Option<&str>,
        cache_salt: Option<&str>,
    ) -> Option<u32> {
        let key = Context {
            lora_name: lora_name.map(Arc::from),
            cache_salt: cache_salt.map(Arc::from),
        };
        if let Some(id) = self.context_ids.get(&key) {
            return Some(*id);
        }
        if self.contexts.len() >= self.context_cap() && !self.compact_contexts(current) {
            return None;
        }
        let id = self.contexts.len() as u32;
        self.contexts
            .push((key.clone(), block_seed(lora_name, cache_salt)));
        self.context_ids.insert(key, id);
        Some(id)
    }

    fn apply(&mut self, batch: &Batch<'_>, arena: &Arena, seq: Option<u64>, out: &mut Output) {
        let event_id = match seq {
            Some(seq) => seq,
            None => self.next_id(),
        };
        let dp_rank = batch.dp_rank.unwrap_or(0);
        let mut rank = match self.ranks.remove(&dp_rank) {
            Some(rank) => rank,
            None => {
                self.make_room_for_rank(event_id, out);
                self.rank_order.push(dp_rank);
                Rank::new(self.block_size)
            }
        };
        self.uses += 1;
        self.rank_use.insert(dp_rank, self.uses);
        self.counters.unknown_fields += batch.unknown_fields;
        out.events.reserve(batch.events.len());
        out.blocks.reserve(arena.hashes.len());
        out.hashes.reserve(arena.hashes.len());
        // A token id takes 5 bytes at the most.
        out.token_msgpack.reserve(arena.tokens.len() * 5);
        out.token_ids.reserve(arena.tokens.len());
        let mut gone = std::mem::take(&mut self.gone); // empty: flush_removal drains it
        let mut gone_tier: Option<Tier> = None;
        for event in &batch.events {
            match event {
                Event::Removed(removed) => {
                    let Some(tier) = self.admit_removal(&mut rank, removed) else {
                        continue;
                    };
                    if gone_tier != Some(tier) && !gone.is_empty() {
                        self.flush_removal(dp_rank, event_id, gone_tier, &mut gone, out);
                    }
                    gone_tier = Some(tier);
                    self.removed(
                        &mut rank,
                        tier,
                        removed.medium,
                        &arena.hashes[removed.hashes.clone()],
                        &mut gone,
                    );
                }
                other => {
                    if !gone.is_empty() {
                        self.flush_removal(dp_rank, event_id, gone_tier, &mut gone, out);
                    }
                    match other {
                        Event::Stored(stored) => {
                            self.stored(&mut rank, dp_rank, event_id, stored, arena, out)
                        }
                        _ => self.clear(&mut rank, dp_rank, event_id, out),
                    }
                }
            }
        }
        if !gone.is_empty() {
            self.flush_removal(dp_rank, event_id, gone_tier, &mut gone, out);
        }
        self.gone = gone;
        self.enforce_block_cap(&mut rank, dp_rank, event_id, out);
        self.ranks.insert(dp_rank, rank);
    }

    // -- admission ------------------------------------------------------------------------

    fn drop_blocks(
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

    fn count_drop(&mut self, action: Action, tier: Tier, reason: DropReason, count: u64) {
        self.counters.dropped[action as usize][tier as usize][reason as usize] += count;
    }

    fn admit_removal(&mut self, rank: &mut Rank, removed: &Removed<'_>) -> Option<Tier> {
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

    fn admitted(
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
    fn judge(
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

    // -- stores -----------------------------------------------------------------------------

    fn stored(
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
    fn push_store(
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

    // -- removals and clears ----------------------------------------------------------------

    /// Counts one reference less on `tier` for each block; collects in `gone` those whose last
    /// reference went.
    fn removed(
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

    fn flush_removal(
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

    fn clear(&mut self, rank: &mut Rank, dp_rank: u32, event_id: u64, out: &mut Output) {
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

/// Each block's extra keys, as msgpack, from the event's `extra_keys` list (`None` for nil).
fn block_keys(raw: &[u8]) -> Vec<Option<&[u8]>> {
    items(raw)
        .map(|keys| (keys != [0xc0]).then_some(keys))
        .collect()
}

/// A 64-hex-digit multimodal digest: vLLM up to 0.18 puts it bare into the extra keys.
fn is_digest(key: &str) -> bool {
    key.len() == 64 && key.bytes().all(|byte| byte.is_ascii_hexdigit())
}

fn digest_hash(key: &str) -> u64 {
    u64::from_str_radix(&key[..16], 16).unwrap_or(0)
}

/// The multimodal object hashes among one block's extra keys, as Dynamo derives them: a hex
/// digest by its first 16 hex digits, any other identifier by its XXH3-64. A key is an
/// `(identifier, offset)` pair from vLLM 0.19, a bare digest before.
fn mm_hashes(keys: &[u8], out: &mut Vec<u64>) {
    for key in items(keys) {
        let mut reader = Reader::new(key);
        match reader.item() {
            Ok(Item::Str(key)) if is_digest(key) => out.push(digest_hash(key)),
            Ok(Item::Array(len)) if len > 0 => {
                if let Ok(Item::Str(id)) = reader.item() {
                    out.push(if is_digest(id) {
                        digest_hash(id)
                    } else {
                        identifier_hash(id)
                    });
                }
            }
            _ => {}
        }
    }
}

/// The msgpack of each item of a msgpack array (checked by the decoder); none for other values.
fn items(raw: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut reader = Reader::new(raw);
    let len = match reader.item() {
        Ok(Item::Array(len)) => len,
        _ => 0,
    };
    (0..len).map_while(move |_| reader.raw(2).ok())
}

/// The msgpack of the first item of a msgpack array (checked by the decoder).
fn first_item(raw: &[u8]) -> Option<&[u8]> {
    let mut reader = Reader::new(raw);
    match reader.item() {
        Ok(Item::Array(len)) if len > 0 => reader.raw(2).ok(),
        _ => None,
    }
}

/// The cache salt in the first block's extra keys: the first string that is neither a digest
/// nor the LoRA name. Dynamo's own `dynamo-cache-salt:` prefix is removed.
fn cache_salt<'a>(stored: &Stored<'a>) -> Option<&'a str> {
    let first = first_item(stored.extra_keys?).filter(|keys| *keys != [0xc0])?;
    let mut lora_seen = stored.lora_name.is_none();
    for key in items(first) {
        let Ok(Item::Str(key)) = Reader::new(key).item() else {
            continue;
        };
        if is_digest(key) {
            continue;
        }
        if !lora_seen && Some(key) == stored.lora_name {
            lora_seen = true;
            continue;
        }
        let salt = key.strip_prefix(DYNAMO_SALT_PREFIX).unwrap_or(key);
        return (!salt.is_empty()).then_some(salt);
    }
    None
}
