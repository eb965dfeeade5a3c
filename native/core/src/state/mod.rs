//! The state of one dp rank's stream: what each engine hash stands for, and what is resident.
//!
//! Memory is the point of this module's layout. A tracked block costs 36 bytes of fields, its
//! tokens at 3 bytes each (4 once a token id needs more than 24 bits), and a slot in each of two
//! index tables of `u32` (about 5 to 10 bytes each, by the tables' load):
//!
//! - the blocks live in one slab of parallel arrays, addressed by slot;
//! - the engine-hash index and the canonical-hash index hold only slots, and compare by the
//!   slab's fields, so a key is stored once;
//! - the canonical hash is not stored: it is Dynamo's sequence hash of the parent and the
//!   tokens hash, recomputed where it is needed;
//! - reference counts live in the slot that owns the canonical block (the first live slot that
//!   made it resident), as one byte per tier, with larger counts kept aside.
//!
//! This file holds the slab, its lookups and its accounting; `tokens` stores the token ids,
//! `refs` the reference counts, `scans` the walks over a whole rank, and `retired` the
//! retired blocks and the anchors a loss leaves.

mod refs;
mod retired;
mod scans;
mod tokens;

use std::collections::VecDeque;
use std::hash::BuildHasher;

use foldhash::fast::FixedState;
use hashbrown::{HashMap, HashSet, HashTable};

use crate::hashing::sequence_hash;
use tokens::Tokens;

/// The hasher of every table. Keys are engine or Dynamo hashes; a fixed seed keeps runs
/// reproducible, and foldhash's mixing keeps crafted hashes from clustering.
pub type Hasher = FixedState;

const SEED: u64 = 0x6b76_6272_6964_6765;

pub type Map<K, V> = HashMap<K, V, Hasher>;
pub type Set<K> = HashSet<K, Hasher>;

pub fn map<K, V>() -> Map<K, V> {
    HashMap::with_hasher(Hasher::with_seed(SEED))
}

pub fn set<K>() -> Set<K> {
    HashSet::with_hasher(Hasher::with_seed(SEED))
}

fn hash_u64(value: u64) -> u64 {
    Hasher::with_seed(SEED).hash_one(value)
}

/// A slot of the slab.
pub type Slot = u32;

const LIVE: u32 = 1 << 31;
const RETIRED: u32 = 1 << 30;
const HAS_PARENT: u32 = 1 << 29;
/// The slot is the one the canonical-hash index holds for its canonical block: it owns the
/// block's reference counts.
const OWNER: u32 = 1 << 28;
const CONTEXT_MASK: u32 = OWNER - 1;
/// Contexts a slot can name.
pub const MAX_CONTEXTS: usize = CONTEXT_MASK as usize + 1;
/// A reference count of this value or more is kept in the spill table.
const SPILLED: u8 = u8::MAX;

/// One slot's fields, together: a lookup touches one or two cache lines rather than one per
/// field. Packed to 4-byte alignment, so that a slot takes its 36 bytes and no padding; no
/// reference to a 64-bit field is ever taken (the compiler refuses one), fields are copied.
#[derive(Debug, Clone, Copy, Default)]
#[repr(C, packed(4))]
struct Block {
    engine: u64,
    tokens_hash: u64,
    parent: u64,
    /// Residence bits, parent and owner bits, and the interned context.
    meta: u32,
    /// When the slot last became live or retired: orders the live blocks as they were
    /// inserted, and tells the retired queue's stale entries from current ones.
    order: u32,
    /// Per tier: the references to the slot's canonical block, if the slot owns it.
    refs: [u8; 4],
}

impl Block {
    fn parent(self) -> Option<u64> {
        (self.meta & HAS_PARENT != 0).then_some(self.parent)
    }

    /// The canonical block hash: Dynamo's sequence hash of the parent and the tokens hash.
    fn canonical(self) -> u64 {
        sequence_hash(self.parent(), self.tokens_hash)
    }
}

/// The blocks of one rank, live and retired.
#[derive(Debug)]
pub struct Rank {
    blocks: Vec<Block>,
    tokens: Tokens,
    free: Vec<Slot>,
    by_engine: HashTable<Slot>,
    by_canonical: HashTable<Slot>,
    spill: Map<(Slot, u8), u32>,
    resident: [usize; 4],
    live: usize,
    retired: VecDeque<(Slot, u32)>,
    retired_count: usize,
    next_order: u32,
    /// The kind of each KV-cache group, as stores named it.
    pub group_kinds: Map<u32, Box<str>>,
    /// The last group an event named without a kind, and whether it is a main group: what
    /// [`Rank::group_kinds`] says of it, kept until the kinds change.
    pub group_main: Option<(u32, bool)>,
    /// Engine hashes that were live when the rank was last cleared.
    pub cleared: Set<u64>,
    /// After a loss: the blocks the rank held, by canonical hash, whose residency is unknown.
    /// A store whose parent is one of them shows that the engine still holds that chain.
    anchors: Map<u64, Slot>,
}

impl Rank {
    pub fn new(block_size: usize) -> Self {
        Rank {
            blocks: Vec::new(),
            tokens: Tokens::new(block_size),
            free: Vec::new(),
            by_engine: HashTable::new(),
            by_canonical: HashTable::new(),
            spill: map(),
            resident: [0; 4],
            live: 0,
            retired: VecDeque::new(),
            retired_count: 0,
            next_order: 0,
            group_kinds: map(),
            group_main: None,
            cleared: set(),
            anchors: map(),
        }
    }

    // -- fields -------------------------------------------------------------------------------

    pub fn engine(&self, slot: Slot) -> u64 {
        self.blocks[slot as usize].engine
    }

    pub fn tokens_hash(&self, slot: Slot) -> u64 {
        self.blocks[slot as usize].tokens_hash
    }

    pub fn parent(&self, slot: Slot) -> Option<u64> {
        self.blocks[slot as usize].parent()
    }

    /// The canonical block hash: Dynamo's sequence hash of the parent and the tokens hash.
    pub fn canonical(&self, slot: Slot) -> u64 {
        self.blocks[slot as usize].canonical()
    }

    pub fn context(&self, slot: Slot) -> u32 {
        self.blocks[slot as usize].meta & CONTEXT_MASK
    }

    /// Appends the block's tokens to `out`.
    pub fn read_tokens(&self, slot: Slot, out: &mut Vec<u32>) {
        self.tokens.read(slot, out);
    }

    fn is_live(&self, slot: Slot) -> bool {
        self.blocks[slot as usize].meta & LIVE != 0
    }

    fn is_retired(&self, slot: Slot) -> bool {
        self.blocks[slot as usize].meta & RETIRED != 0
    }

    fn next(&mut self) -> u32 {
        if self.next_order == u32::MAX {
            self.renumber();
        }
        self.next_order += 1;
        self.next_order
    }

    // -- lookups ------------------------------------------------------------------------------

    /// The block of an engine hash, live or retired, left where it is.
    pub fn lookup(&self, engine: u64) -> Option<Slot> {
        let blocks = &self.blocks;
        self.by_engine
            .find(hash_u64(engine), |&slot| {
                blocks[slot as usize].engine == engine
            })
            .copied()
    }

    /// The live block of an engine hash.
    pub fn live(&self, engine: u64) -> Option<Slot> {
        self.lookup(engine).filter(|&slot| self.is_live(slot))
    }

    /// The block of an engine hash for a store: a retired one becomes live again.
    pub fn revive(&mut self, engine: u64) -> Option<Slot> {
        let slot = self.lookup(engine)?;
        if self.is_retired(slot) {
            let order = self.next();
            let meta = &mut self.blocks[slot as usize].meta;
            *meta = (*meta & !RETIRED) | LIVE;
            self.blocks[slot as usize].order = order;
            self.retired_count -= 1;
            self.live += 1;
        }
        Some(slot)
    }

    /// Records a new live block.
    pub fn insert(
        &mut self,
        engine: u64,
        tokens_hash: u64,
        parent: Option<u64>,
        context: u32,
        tokens: &[u32],
    ) -> Slot {
        debug_assert!(context <= CONTEXT_MASK);
        let order = self.next();
        let meta = LIVE | if parent.is_some() { HAS_PARENT } else { 0 } | context;
        let slot = match self.free.pop() {
            Some(slot) => {
                let index = slot as usize;
                self.blocks[index].engine = engine;
                self.blocks[index].tokens_hash = tokens_hash;
                self.blocks[index].parent = parent.unwrap_or(0);
                self.blocks[index].meta = meta;
                self.blocks[index].order = order;
                self.blocks[index].refs = [0; 4];
                slot
            }
            None => {
                self.blocks.push(Block {
                    engine,
                    tokens_hash,
                    parent: parent.unwrap_or(0),
                    meta,
                    order,
                    refs: [0; 4],
                });
                (self.blocks.len() - 1) as Slot
            }
        };
        self.tokens.put(slot, tokens);
        let blocks = &self.blocks;
        self.by_engine.insert_unique(hash_u64(engine), slot, |&s| {
            hash_u64(blocks[s as usize].engine)
        });
        self.live += 1;
        slot
    }

    // -- accounting ---------------------------------------------------------------------------

    pub fn live_count(&self) -> usize {
        self.live
    }

    pub fn retired_count(&self) -> usize {
        self.retired_count
    }

    /// Bytes held, by the allocations' capacities.
    pub fn heap_bytes(&self) -> usize {
        self.blocks.capacity() * std::mem::size_of::<Block>()
            + self.tokens.bytes.capacity()
            + self.free.capacity() * 4
            + table_bytes(self.by_engine.capacity(), 4)
            + table_bytes(self.by_canonical.capacity(), 4)
            + table_bytes(self.spill.capacity(), 12)
            + self.retired.capacity() * 8
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
        (capacity + 1).next_power_of_two()
    } else {
        (capacity * 8 / 7).next_power_of_two()
    };
    buckets * (entry + 1)
}
