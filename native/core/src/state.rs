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

use std::collections::VecDeque;
use std::hash::BuildHasher;

use foldhash::fast::FixedState;
use hashbrown::{HashMap, HashSet, HashTable};

use crate::hashing::sequence_hash;
use crate::media::Tier;

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

/// Token ids at three bytes each while they fit, four after.
#[derive(Debug)]
struct Tokens {
    block_size: usize,
    width: usize,
    bytes: Vec<u8>,
}

impl Tokens {
    fn new(block_size: usize) -> Self {
        Tokens {
            block_size,
            width: 3,
            bytes: Vec::new(),
        }
    }

    fn stride(&self) -> usize {
        self.block_size * self.width
    }

    fn widen(&mut self) {
        let mut wide = Vec::with_capacity(self.bytes.len() / 3 * 4);
        for chunk in self.bytes.chunks_exact(3) {
            wide.extend_from_slice(&[chunk[0], chunk[1], chunk[2], 0]);
        }
        self.bytes = wide;
        self.width = 4;
    }

    fn put(&mut self, slot: Slot, tokens: &[u32]) {
        // (An OR of every token, which vectorizes, rather than a search that stops early.)
        if self.width == 3 && tokens.iter().fold(0, |all, token| all | token) >= 1 << 24 {
            self.widen();
        }
        let stride = self.stride();
        let start = slot as usize * stride;
        if start == self.bytes.len() {
            self.bytes.resize(start + stride, 0);
        }
        let place = &mut self.bytes[start..start + stride];
        // One loop per width, so that each copies a constant number of bytes.
        if self.width == 3 {
            for (place, token) in place.chunks_exact_mut(3).zip(tokens) {
                place.copy_from_slice(&token.to_le_bytes()[..3]);
            }
        } else {
            for (place, token) in place.chunks_exact_mut(4).zip(tokens) {
                place.copy_from_slice(&token.to_le_bytes());
            }
        }
    }

    fn read(&self, slot: Slot, out: &mut Vec<u32>) {
        let start = slot as usize * self.stride();
        let stored = &self.bytes[start..start + self.stride()];
        if self.width == 3 {
            out.extend(
                stored
                    .chunks_exact(3)
                    .map(|chunk| u32::from_le_bytes([chunk[0], chunk[1], chunk[2], 0])),
            );
        } else {
            out.extend(
                stored
                    .chunks_exact(4)
                    .map(|chunk| u32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]])),
            );
        }
    }
}

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

    // -- reference counts ---------------------------------------------------------------------

    /// The slot holding the counts of a canonical block, if any tier holds it.
    fn owner(&self, canonical: u64) -> Option<Slot> {
        self.by_canonical
            .find(hash_u64(canonical), |&slot| {
                self.canonical(slot) == canonical
            })
            .copied()
    }

    /// The slot holding the counts of `slot`'s canonical block (`canonical`), if any tier
    /// holds it. Candidates are compared by parent and tokens hash, whose sequence hash the
    /// canonical hash is, so no hash is recomputed.
    pub fn owner_of(&self, slot: Slot, canonical: u64) -> Option<Slot> {
        if self.blocks[slot as usize].meta & OWNER != 0 {
            return Some(slot); // the index's entry for this canonical block is the slot itself
        }
        let (tokens_hash, parent) = (self.blocks[slot as usize].tokens_hash, self.parent(slot));
        self.by_canonical
            .find(hash_u64(canonical), |&other| {
                self.blocks[other as usize].tokens_hash == tokens_hash
                    && self.parent(other) == parent
            })
            .copied()
    }

    /// The references on `tier` that `owner` (from [`Rank::owner_of`]) holds.
    pub fn count(&self, owner: Slot, tier: Tier) -> u32 {
        match self.blocks[owner as usize].refs[tier as usize] {
            SPILLED => self.spill[&(owner, tier as u8)],
            small => u32::from(small),
        }
    }

    fn set_count(&mut self, owner: Slot, tier: Tier, count: u32) {
        let key = (owner, tier as u8);
        if count >= u32::from(SPILLED) {
            self.blocks[owner as usize].refs[tier as usize] = SPILLED;
            self.spill.insert(key, count);
        } else {
            if self.blocks[owner as usize].refs[tier as usize] == SPILLED {
                self.spill.remove(&key);
            }
            self.blocks[owner as usize].refs[tier as usize] = count as u8;
        }
    }

    /// Counts one more reference to the block's canonical block (`canonical`) on `tier`;
    /// returns the count before.
    pub fn add_ref(&mut self, slot: Slot, canonical: u64, tier: Tier) -> u32 {
        let owner = if self.blocks[slot as usize].meta & OWNER != 0 {
            slot
        } else {
            // One probe finds the owner or the place for a new one.
            let index = slot as usize;
            let blocks = &self.blocks;
            let (hash, parent_of) = (blocks[index].tokens_hash, blocks[index].parent());
            let entry = self.by_canonical.entry(
                hash_u64(canonical),
                |&other| {
                    blocks[other as usize].tokens_hash == hash
                        && blocks[other as usize].parent() == parent_of
                },
                |&s| hash_u64(blocks[s as usize].canonical()),
            );
            match entry {
                hashbrown::hash_table::Entry::Occupied(entry) => *entry.get(),
                hashbrown::hash_table::Entry::Vacant(entry) => {
                    entry.insert(slot);
                    self.blocks[index].meta |= OWNER;
                    slot
                }
            }
        };
        let before = self.count(owner, tier);
        if before == 0 {
            self.resident[tier as usize] += 1;
        }
        self.set_count(owner, tier, before + 1);
        before
    }

    /// The references to a canonical block on `tier`.
    pub fn refs_of(&self, canonical: u64, tier: Tier) -> u32 {
        self.owner(canonical)
            .map_or(0, |owner| self.count(owner, tier))
    }

    /// Counts one reference less on `tier` (`owner` must hold one); the canonical block
    /// (`canonical`) leaves the index when no tier holds it any more.
    pub fn release_ref(&mut self, owner: Slot, canonical: u64, tier: Tier) {
        let count = self.count(owner, tier) - 1;
        self.set_count(owner, tier, count);
        if count == 0 {
            self.resident[tier as usize] -= 1;
            if self.blocks[owner as usize].refs == [0; 4] {
                let found = self
                    .by_canonical
                    .find_entry(hash_u64(canonical), |&slot| slot == owner);
                if let Ok(entry) = found {
                    entry.remove();
                    self.blocks[owner as usize].meta &= !OWNER;
                }
            }
        }
    }

    /// Whether `owner` (from [`Rank::owner_of`]) holds references on any tier.
    pub fn holds_refs(&self, owner: Slot) -> bool {
        self.blocks[owner as usize].refs != [0; 4]
    }

    /// The blocks resident on a tier.
    pub fn resident(&self, tier: Tier) -> usize {
        self.resident[tier as usize]
    }

    /// Forgets every reference count (a clear).
    pub fn clear_refs(&mut self) {
        for block in &mut self.blocks {
            block.refs = [0; 4];
            block.meta &= !OWNER;
        }
        self.spill.clear();
        self.by_canonical.clear();
        self.resident = [0; 4];
    }

    /// Takes every reference to `slot`'s canonical block off `tier`; returns whether it had
    /// any.
    pub fn drop_refs(&mut self, slot: Slot, canonical: u64, tier: Tier) -> bool {
        let Some(owner) = self.owner_of(slot, canonical) else {
            return false;
        };
        if self.count(owner, tier) == 0 {
            return false;
        }
        self.set_count(owner, tier, 1);
        self.release_ref(owner, canonical, tier);
        true
    }

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

    // -- anchors after a loss -------------------------------------------------------------

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

    fn forget(&mut self, slot: Slot) {
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
    fn renumber(&mut self) {
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
