//! The stateful translation of one worker's stream into canonical, tiered Dynamo events.
//!
//! Every engine hash is rewritten to Dynamo's rolling sequence hash of the block's content,
//! residency is reference-counted per (dp rank, tier, block), CPU placeholders are resolved
//! through the engine hashes seen before, and whatever is not forwarded is counted by reason.
//!
//! This module holds the normalizer and its entry points; a batch's events go through
//! `admission` (which tier takes them), then `stores` or `removals`, which keep the
//! per-rank state of `crate::state`. `caps` keeps that state within its [`Limits`],
//! `extra_keys` reads what a store's extra keys add to its hashes, and `counters` holds
//! what is counted.

mod admission;
mod caps;
mod counters;
mod extra_keys;
mod removals;
mod stores;

use std::sync::Arc;

pub use counters::{Action, Counters, DropReason, FirstDrop, Limits};

use crate::decode::{decode, Arena, Batch, Event, SchemaError};
use crate::hashing::block_seed;
use crate::media::Tier;
use crate::output::{Body, OutEvent, Output};
use crate::state::{map, Map, Rank, Slot};

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
}
