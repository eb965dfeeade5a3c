//! The state of one dp rank's stream: what each engine hash stands for, and what is resident.

use foldhash::fast::FixedState;
use hashbrown::{HashMap, HashSet};
use std::collections::VecDeque;

use crate::media::Tier;

/// The hasher of every table. Keys are engine or Dynamo hashes, so a fast, seeded mix suffices.
pub type Hasher = FixedState;

pub type Map<K, V> = HashMap<K, V, Hasher>;
pub type Set<K> = HashSet<K, Hasher>;

pub fn map<K, V>() -> Map<K, V> {
    HashMap::with_hasher(Hasher::with_seed(0x6b76_6272_6964_6765))
}

pub fn set<K>() -> Set<K> {
    HashSet::with_hasher(Hasher::with_seed(0x6b76_6272_6964_6765))
}

/// Whether a record's engine hash is live (on some tier, or just stored) or retired (evicted
/// from every tier, remembered for late placeholders and children).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Residence {
    Live,
    Retired,
}

/// What one engine hash stands for: a canonical block and the inputs of its hashes.
#[derive(Debug, Clone)]
pub struct Block {
    pub engine: u64,
    pub canonical: u64,
    pub tokens_hash: u64,
    pub parent: Option<u64>,
    /// The interned (LoRA name, cache salt) of the block (see `Normalizer`).
    pub context: u32,
    pub residence: Residence,
    /// When the block last became live or retired: orders the live blocks as they were
    /// inserted, and tells the retired queue's stale entries from current ones.
    pub order: u64,
}

/// The blocks of one rank, live and retired, with their tokens in one flat array.
#[derive(Debug)]
pub struct Rank {
    block_size: usize,
    slots: Vec<Block>,
    tokens: Vec<u32>,
    free: Vec<u32>,
    index: Map<u64, u32>,
    live: usize,
    retired: VecDeque<(u32, u64)>,
    retired_count: usize,
    next_order: u64,
    /// Per tier: canonical block → reference count.
    pub refs: [Map<u64, u32>; 4],
    /// The kind of each KV-cache group, as stores named it.
    pub group_kinds: Map<u32, Box<str>>,
    /// Engine hashes that were live when the rank was last cleared.
    pub cleared: Set<u64>,
}

impl Rank {
    pub fn new(block_size: usize) -> Self {
        Rank {
            block_size,
            slots: Vec::new(),
            tokens: Vec::new(),
            free: Vec::new(),
            index: map(),
            live: 0,
            retired: VecDeque::new(),
            retired_count: 0,
            next_order: 0,
            refs: [map(), map(), map(), map()],
            group_kinds: map(),
            cleared: set(),
        }
    }

    fn order(&mut self) -> u64 {
        self.next_order += 1;
        self.next_order
    }

    pub fn block(&self, slot: u32) -> &Block {
        &self.slots[slot as usize]
    }

    pub fn tokens(&self, slot: u32) -> &[u32] {
        let start = slot as usize * self.block_size;
        &self.tokens[start..start + self.block_size]
    }

    /// The live block of an engine hash.
    pub fn live(&self, engine: u64) -> Option<u32> {
        let slot = *self.index.get(&engine)?;
        (self.slots[slot as usize].residence == Residence::Live).then_some(slot)
    }

    /// The block of an engine hash, live or retired, left where it is.
    pub fn lookup(&self, engine: u64) -> Option<u32> {
        self.index.get(&engine).copied()
    }

    /// The block of an engine hash for a store: a retired one becomes live again.
    pub fn revive(&mut self, engine: u64) -> Option<u32> {
        let slot = *self.index.get(&engine)?;
        if self.slots[slot as usize].residence == Residence::Retired {
            let order = self.order();
            let block = &mut self.slots[slot as usize];
            block.residence = Residence::Live;
            block.order = order;
            self.retired_count -= 1;
            self.live += 1;
        }
        Some(slot)
    }

    /// Records a new live block.
    pub fn insert(
        &mut self,
        engine: u64,
        canonical: u64,
        tokens_hash: u64,
        parent: Option<u64>,
        context: u32,
        tokens: &[u32],
    ) -> u32 {
        let order = self.order();
        let block = Block {
            engine,
            canonical,
            tokens_hash,
            parent,
            context,
            residence: Residence::Live,
            order,
        };
        let slot = match self.free.pop() {
            Some(slot) => {
                self.slots[slot as usize] = block;
                let start = slot as usize * self.block_size;
                self.tokens[start..start + self.block_size].copy_from_slice(tokens);
                slot
            }
            None => {
                self.slots.push(block);
                self.tokens.extend_from_slice(tokens);
                (self.slots.len() - 1) as u32
            }
        };
        self.index.insert(engine, slot);
        self.live += 1;
        slot
    }

    /// Moves live blocks to the retired ones, then forgets the oldest retired past `retain`.
    pub fn retire(&mut self, slots: &[u32], retain: usize) {
        for &slot in slots {
            let order = self.order();
            let block = &mut self.slots[slot as usize];
            debug_assert_eq!(block.residence, Residence::Live);
            block.residence = Residence::Retired;
            block.order = order;
            self.retired.push_back((slot, order));
            self.retired_count += 1;
            self.live -= 1;
        }
        while self.retired_count > retain {
            let Some((slot, order)) = self.retired.pop_front() else {
                break;
            };
            let block = &self.slots[slot as usize];
            if block.residence != Residence::Retired || block.order != order {
                continue; // revived since, or retired again later
            }
            self.index.remove(&block.engine);
            self.free.push(slot);
            self.retired_count -= 1;
        }
        if self.retired.len() > 2 * self.retired_count + 1024 {
            let slots = &self.slots;
            self.retired.retain(|&(slot, order)| {
                let block = &slots[slot as usize];
                block.residence == Residence::Retired && block.order == order
            });
        }
        if self.index.is_empty() {
            self.slots.clear();
            self.tokens.clear();
            self.free.clear();
        }
    }

    /// Every live block, oldest first.
    pub fn live_slots(&self) -> Vec<u32> {
        let mut live: Vec<(u64, u32)> = self
            .index
            .values()
            .filter(|&&slot| self.slots[slot as usize].residence == Residence::Live)
            .map(|&slot| (self.slots[slot as usize].order, slot))
            .collect();
        live.sort_unstable();
        live.into_iter().map(|(_, slot)| slot).collect()
    }

    pub fn live_count(&self) -> usize {
        self.live
    }

    pub fn retired_count(&self) -> usize {
        self.retired_count
    }

    /// The blocks resident on a tier.
    pub fn resident(&self, tier: Tier) -> usize {
        self.refs[tier as usize].len()
    }

    /// Bytes held, by the allocations' capacities.
    pub fn heap_bytes(&self) -> usize {
        self.slots.capacity() * std::mem::size_of::<Block>()
            + self.tokens.capacity() * 4
            + self.free.capacity() * 4
            + table_bytes(self.index.capacity(), std::mem::size_of::<(u64, u32)>())
            + self.retired.capacity() * std::mem::size_of::<(u32, u64)>()
            + self
                .refs
                .iter()
                .map(|refs| table_bytes(refs.capacity(), std::mem::size_of::<(u64, u32)>()))
                .sum::<usize>()
            + table_bytes(self.cleared.capacity(), 8)
    }
}

/// A hashbrown table's bytes: one control byte per bucket plus the entries, with buckets a
/// power of two of which at most 7/8 are used.
fn table_bytes(capacity: usize, entry: usize) -> usize {
    if capacity == 0 {
        return 0;
    }
    let buckets = if capacity < 8 {
        capacity + 1
    } else {
        (capacity * 8 / 7).next_power_of_two()
    };
    buckets * (entry + 1)
}
