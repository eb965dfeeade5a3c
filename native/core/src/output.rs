//! The events a batch normalizes to, and the bytes they go out as: the relay's canonical vLLM
//! payloads (here) and the msgpack of `kvbridge.TieredEvent`s ([`crate::tiered`]).

use std::cell::{Cell, RefCell};
use std::ops::Range;
use std::sync::Arc;

use crate::hashing::DYNAMO_SALT_PREFIX;
#[cfg(test)]
use crate::layout::{CLEARED, REMOVED, REMOVED_FIELDS, STORED, STORED_FIELDS};
use crate::media::Tier;
use crate::msgpack::write;

/// What a canonical event says.
#[derive(Debug, Clone, PartialEq)]
pub enum Body {
    /// A chain of blocks that just became resident.
    Stored(Store),
    /// Canonical hashes whose last copy on the tier went.
    Removed { hashes: Range<usize> },
    /// Everything of the rank on the tier went.
    Cleared,
}

/// A chain of blocks that just became resident; lists are ranges of the [`Output`].
#[derive(Debug, Clone, PartialEq)]
pub struct Store {
    pub parent: Option<u64>,
    /// (canonical block hash, tokens hash) per block.
    pub blocks: Range<usize>,
    /// The msgpack of the token ids, a range of [`Output::token_msgpack`].
    pub tokens: Range<usize>,
    /// The token ids, a range of [`Output::token_ids`].
    pub ids: Range<usize>,
    pub lora_name: Option<Arc<str>>,
    pub cache_salt: Option<Arc<str>>,
}

/// One Dynamo event for one (dp rank, tier).
#[derive(Debug, Clone, PartialEq)]
pub struct OutEvent {
    pub dp_rank: u32,
    pub tier: Tier,
    pub event_id: u64,
    pub body: Body,
}

/// The canonical events of one batch or reset, with their lists in flat arrays.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Output {
    /// The input batch's engine time and dp rank; none for a reset.
    pub batch: Option<(f64, u32)>,
    pub events: Vec<OutEvent>,
    pub blocks: Vec<(u64, u64)>,
    /// The token ids of every store, each in its shortest msgpack form, as both writers put
    /// them: copied from the input when it wrote them so, and written once otherwise.
    pub token_msgpack: Vec<u8>,
    /// The same token ids as values, which the `TieredEvent` writer packs.
    pub token_ids: Vec<u32>,
    pub hashes: Vec<u64>,
}

/// The number of entries msgspec sizes a map header by: the struct's fields plus its tag.
#[cfg(test)]
const STORED_MAP_FIELDS: usize = STORED_FIELDS.len() - 1 + 1; // the 0.30-0.32 layout: 14 fields
#[cfg(test)]
const REMOVED_MAP_FIELDS: usize = REMOVED_FIELDS.len() + 1;

thread_local! {
    /// The buffers of outputs dropped on this thread, cleared, for the next ones made here.
    static SPARE: RefCell<Vec<Output>> = const { RefCell::new(Vec::new()) };
    /// Whether this thread makes outputs: a thread that only drops them (a consumer's) keeps
    /// no spares, which it would never use.
    static MAKES: Cell<bool> = const { Cell::new(false) };
}

/// Outputs kept in [`SPARE`]: a pipeline holds a few at a time (a relay its burst's).
const SPARES: usize = 8;

/// An output whose buffers hold more than this is freed, not kept: a rare large batch's
/// buffers would otherwise stay allocated for as long as the thread.
const SPARE_BYTES: usize = 256 << 10;

impl Output {
    /// An empty output, with the buffers of one dropped before on this thread if there is
    /// one: each payload's output would otherwise cost five allocations and five frees, about
    /// a tenth of the core's work on the small batches of a busy engine.
    pub fn new() -> Output {
        let _ = MAKES.try_with(|makes| makes.set(true));
        SPARE
            .try_with(|spare| spare.try_borrow_mut().ok()?.pop())
            .ok()
            .flatten()
            .unwrap_or_default()
    }

    /// Bytes the buffers hold, by capacity.
    fn buffer_bytes(&self) -> usize {
        fn bytes<T>(values: &Vec<T>) -> usize {
            values.capacity() * std::mem::size_of::<T>()
        }
        bytes(&self.events)
            + bytes(&self.blocks)
            + bytes(&self.token_msgpack)
            + bytes(&self.token_ids)
            + bytes(&self.hashes)
    }

    /// Empties the output, keeping its buffers.
    fn clear(&mut self) {
        self.batch = None;
        self.events.clear();
        self.blocks.clear();
        self.token_msgpack.clear();
        self.token_ids.clear();
        self.hashes.clear();
    }

    /// The payloads that republish these events, one batch per run of one dp rank, in vLLM
    /// 0.32's layout as Dynamo decodes it: an array batch of tagged-map events, canonical
    /// hashes, a medium Dynamo knows, tokens on every store, and the cache salt tagged the way
    /// Dynamo reads it. The clears of a rank's tiers collapse into one medium-less clear.
    pub fn canonical_payloads(&self, block_size: u64, worker_ts: f64) -> Vec<Vec<u8>> {
        canonical_payloads(&[(self, worker_ts)], block_size, usize::MAX)
    }

    /// At least the bytes of this output's canonical payloads, every number and header taken
    /// at its widest: the room reserved for them, and what [`canonical_payloads`] weighs
    /// outputs by.
    pub fn canonical_size(&self) -> usize {
        let runs = 1 + self
            .events
            .windows(2)
            .filter(|pair| pair[0].dp_rank != pair[1].dp_rank)
            .count();
        let events: usize = self.events.iter().map(Self::canonical_event_size).sum();
        BATCH_SIZE * runs + events
    }

    /// At least the bytes [`Output::write_canonical_event`] writes for `event`.
    fn canonical_event_size(event: &OutEvent) -> usize {
        use canonical::*;
        match &event.body {
            Body::Stored(store) => {
                let blocks = store.blocks.len();
                // "extra_keys", its list, the first block's list of one salt, a nil per other
                let salt = store.cache_salt.as_deref().map_or(0, |salt| {
                    EXTRA_KEYS.len() + 5 + 1 + 5 + DYNAMO_SALT_PREFIX.len() + salt.len() + blocks
                });
                let lora = store.lora_name.as_deref().map_or(0, str::len);
                STORED_HEAD_SALTED.len()
                    + 5
                    + 9 * blocks
                    + PARENT.len()
                    + 9
                    + TOKEN_IDS.len()
                    + 5
                    + store.tokens.len()
                    + BLOCK_SIZE.len()
                    + 9
                    + LORA_ID_MEDIUM.len()
                    + MEDIUM_MAX
                    + LORA_NAME.len()
                    + 5
                    + lora
                    + salt
                    + STORED_TAIL.len()
            }
            Body::Removed { hashes } => {
                REMOVED_HEAD.len()
                    + 5
                    + 9 * hashes.len()
                    + MEDIUM_KEY.len()
                    + MEDIUM_MAX
                    + REMOVED_TAIL.len()
            }
            Body::Cleared => CLEARED.len(),
        }
    }

    fn write_canonical_event(&self, out: &mut Vec<u8>, event: &OutEvent, block_size: u64) {
        match &event.body {
            Body::Stored(store) => {
                let salt = store.cache_salt.as_deref().filter(|salt| !salt.is_empty());
                out.extend_from_slice(if salt.is_some() {
                    canonical::STORED_HEAD_SALTED
                } else {
                    canonical::STORED_HEAD
                });
                write::array(out, store.blocks.len());
                for (hash, _) in &self.blocks[store.blocks.clone()] {
                    write::hash(out, *hash);
                }
                out.extend_from_slice(canonical::PARENT);
                match store.parent {
                    Some(parent) => write::hash(out, parent),
                    None => write::nil(out),
                }
                out.extend_from_slice(canonical::TOKEN_IDS);
                write::array(out, store.ids.len());
                out.extend_from_slice(&self.token_msgpack[store.tokens.clone()]);
                out.extend_from_slice(canonical::BLOCK_SIZE);
                write::uint(out, block_size);
                out.extend_from_slice(canonical::LORA_ID_MEDIUM);
                out.extend_from_slice(canonical::MEDIUM[event.tier as usize]);
                out.extend_from_slice(canonical::LORA_NAME);
                match &store.lora_name {
                    Some(name) => write::str(out, name),
                    None => write::nil(out),
                }
                if let Some(salt) = salt {
                    // Dynamo reads each event's salt from its first block's extra keys.
                    out.extend_from_slice(canonical::EXTRA_KEYS);
                    write::array(out, store.blocks.len());
                    write::array(out, 1);
                    write::str(out, &format!("{DYNAMO_SALT_PREFIX}{salt}"));
                    for _ in 1..store.blocks.len() {
                        write::nil(out);
                    }
                }
                out.extend_from_slice(canonical::STORED_TAIL);
            }
            Body::Removed { hashes } => {
                out.extend_from_slice(canonical::REMOVED_HEAD);
                write::array(out, hashes.len());
                for hash in &self.hashes[hashes.clone()] {
                    write::hash(out, *hash);
                }
                out.extend_from_slice(canonical::MEDIUM_KEY);
                out.extend_from_slice(canonical::MEDIUM[event.tier as usize]);
                out.extend_from_slice(canonical::REMOVED_TAIL);
            }
            Body::Cleared => out.extend_from_slice(canonical::CLEARED),
        }
    }
}

impl Drop for Output {
    /// Gives the buffers to `SPARE`, cleared, unless it is full, they are large, or this
    /// thread makes no outputs.
    fn drop(&mut self) {
        let makes = MAKES.try_with(Cell::get).unwrap_or(false);
        if !makes || self.buffer_bytes() > SPARE_BYTES || self.events.capacity() == 0 {
            return;
        }
        // At the thread's exit the spares are dropped too, and `try_with` fails: they are freed.
        let _ = SPARE.try_with(|spare| {
            let Ok(mut spare) = spare.try_borrow_mut() else {
                return;
            };
            if spare.len() < SPARES {
                let mut kept = std::mem::take(self);
                kept.clear();
                spare.push(kept);
            }
        });
    }
}

/// The canonical payloads of consecutive outputs of one normalizer, each with its engine time,
/// as few as fit: the events of all of them, in order, one batch per run of one dp rank (the
/// clears of a rank's tiers collapsing into one, as [`Output::canonical_payloads`] writes
/// them), a batch closed before the output that would take it past about `max_bytes`. One
/// output's run of a rank is never split, so a batch exceeds `max_bytes` only when one output
/// alone does. A batch is stamped with the time of the last output it holds events of.
///
/// A relay in a backlog sends one message where it would send several: each message costs
/// the sender's and the receiver's ZMQ a wake-up and a write of their own.
pub fn canonical_payloads(
    outputs: &[(&Output, f64)],
    block_size: u64,
    max_bytes: usize,
) -> Vec<Vec<u8>> {
    let mut batches = Vec::new();
    let mut batch = Batch::default();
    for &(output, ts) in outputs {
        // unbounded (one output's payloads, say), no output needs weighing
        let weight = if max_bytes == usize::MAX {
            0
        } else {
            output.canonical_size()
        };
        if !batch.run.is_empty() && batch.weight.saturating_add(weight) > max_bytes {
            batches.push(batch.take(block_size));
        }
        for event in &output.events {
            if let Some(&(_, last)) = batch.run.last() {
                if last.dp_rank != event.dp_rank {
                    batches.push(batch.take(block_size));
                } else if matches!(last.body, Body::Cleared) && matches!(event.body, Body::Cleared)
                {
                    continue;
                }
            }
            batch.run.push((output, event));
            batch.room += Output::canonical_event_size(event);
            batch.ts = ts;
        }
        batch.weight = batch.weight.saturating_add(weight);
    }
    if !batch.run.is_empty() {
        batches.push(batch.take(block_size));
    }
    batches
}

/// A canonical batch being gathered: events of one dp rank, each with the output whose lists
/// it names, the time of the last, the weight of the outputs it holds events of (what the
/// bound is checked against) and at least the bytes of its events.
#[derive(Default)]
struct Batch<'a> {
    run: Vec<(&'a Output, &'a OutEvent)>,
    ts: f64,
    weight: usize,
    room: usize,
}

impl Batch<'_> {
    /// The batch's bytes; it is left empty.
    fn take(&mut self, block_size: u64) -> Vec<u8> {
        let mut out = Vec::with_capacity(BATCH_SIZE + self.room);
        write::array(&mut out, 3);
        write::float(&mut out, self.ts);
        write::array(&mut out, self.run.len());
        for (output, event) in &self.run {
            output.write_canonical_event(&mut out, event, block_size);
        }
        write::uint(&mut out, u64::from(self.run[0].1.dp_rank));
        self.run.clear();
        self.weight = 0;
        self.room = 0;
        out
    }
}

/// The constant stretches of the canonical payloads' events, as msgpack (the tests check them
/// against the writers): map headers sized as msgspec sizes them, keys and constant values.
mod canonical {
    /// A store's map header (10 entries), tag and `block_hashes` key.
    pub const STORED_HEAD: &[u8] = b"\x8a\xa4type\xabBlockStored\xacblock_hashes";
    /// The same with 11 entries: `extra_keys` carries a cache salt.
    pub const STORED_HEAD_SALTED: &[u8] = b"\x8b\xa4type\xabBlockStored\xacblock_hashes";
    pub const PARENT: &[u8] = b"\xb1parent_block_hash";
    pub const TOKEN_IDS: &[u8] = b"\xa9token_ids";
    pub const BLOCK_SIZE: &[u8] = b"\xaablock_size";
    /// A nil `lora_id` and the `medium` key; the medium follows, then `LORA_NAME`.
    pub const LORA_ID_MEDIUM: &[u8] = b"\xa7lora_id\xc0\xa6medium";
    pub const LORA_NAME: &[u8] = b"\xa9lora_name";
    /// Each tier's medium, as a msgpack string.
    pub const MEDIUM: [&[u8]; 4] = [b"\xa3GPU", b"\xa3CPU", b"\xa4DISK", b"\xa8EXTERNAL"];
    pub const STORED_TAIL: &[u8] = b"\xa9group_idx\x00\xb2kv_cache_spec_kind\xaefull_attention";
    /// A removal's map header, tag and `block_hashes` key.
    pub const REMOVED_HEAD: &[u8] = b"\x84\xa4type\xacBlockRemoved\xacblock_hashes";
    pub const MEDIUM_KEY: &[u8] = b"\xa6medium";
    /// A removal's `group_idx`, after its medium.
    pub const REMOVED_TAIL: &[u8] = b"\xa9group_idx\x00";
    pub const CLEARED: &[u8] = b"\x81\xa4type\xb0AllBlocksCleared";
    /// The key a cache salt goes under.
    pub const EXTRA_KEYS: &[u8] = b"\xaaextra_keys";
    /// The longest of [`MEDIUM`].
    pub const MEDIUM_MAX: usize = {
        let (mut max, mut index) = (0, 0);
        while index < MEDIUM.len() {
            if MEDIUM[index].len() > max {
                max = MEDIUM[index].len();
            }
            index += 1;
        }
        max
    };
}

/// A canonical batch's own bytes at their widest: its array header, time, event list header
/// and dp rank.
const BATCH_SIZE: usize = 1 + 9 + 5 + 9;

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::msgpack::Reader;

    fn event(dp_rank: u32, tier: Tier, body: Body) -> OutEvent {
        OutEvent {
            dp_rank,
            tier,
            event_id: 7,
            body,
        }
    }

    fn removal(dp_rank: u32, hashes: &[u64]) -> Output {
        let mut out = Output::default();
        out.hashes.extend_from_slice(hashes);
        let body = Body::Removed {
            hashes: 0..hashes.len(),
        };
        out.events.push(event(dp_rank, Tier::Device, body));
        out
    }

    fn store(dp_rank: u32, blocks: &[(u64, u64)], tokens: &[u32]) -> Output {
        let mut out = Output::default();
        out.blocks.extend_from_slice(blocks);
        write::small_uints(&mut out.token_msgpack, tokens);
        out.token_ids.extend_from_slice(tokens);
        let body = Body::Stored(Store {
            parent: Some(99),
            blocks: 0..blocks.len(),
            tokens: 0..out.token_msgpack.len(),
            ids: 0..tokens.len(),
            lora_name: None,
            cache_salt: None,
        });
        out.events.push(event(dp_rank, Tier::HostPinned, body));
        out
    }

    fn clears(dp_rank: u32) -> Output {
        let mut out = Output::default();
        for tier in [Tier::Device, Tier::HostPinned] {
            out.events.push(event(dp_rank, tier, Body::Cleared));
        }
        out
    }

    /// A canonical batch's (event count, event bytes, dp rank).
    fn parts(payload: &[u8]) -> (usize, &[u8], u64) {
        let mut reader = Reader::new(payload);
        assert_eq!(reader.array_header(), Some(3));
        reader.skip(1).unwrap();
        let count = reader.array_header().unwrap();
        let start = reader.position();
        for _ in 0..count {
            reader.skip(8).unwrap();
        }
        let events = &payload[start..reader.position()];
        let rank = reader.any_int().unwrap();
        assert!(reader.is_empty());
        (count, events, rank)
    }

    fn alone(outputs: &[&Output]) -> Vec<Vec<u8>> {
        outputs
            .iter()
            .flat_map(|output| output.canonical_payloads(16, 1.0))
            .collect()
    }

    #[test]
    fn merged_outputs_are_one_batch_of_all_their_events_in_order() {
        let (a, b, c) = (
            removal(0, &[1, 2]),
            store(0, &[(3, 4), (5, 6)], &[1, 300, 70_000, 9]),
            removal(0, &[3]),
        );
        let merged = canonical_payloads(&[(&a, 1.0), (&b, 2.0), (&c, 3.0)], 16, usize::MAX);
        assert_eq!(merged.len(), 1);
        let (count, events, rank) = parts(&merged[0]);
        let singles = alone(&[&a, &b, &c]);
        let mut expected = Vec::new();
        for single in &singles {
            expected.extend_from_slice(parts(single).1);
        }
        assert_eq!((count, events, rank), (3, expected.as_slice(), 0));
        let mut ts = Vec::new();
        write::float(&mut ts, 3.0);
        assert_eq!(&merged[0][1..10], ts.as_slice()); // the last output's time
    }

    #[test]
    fn canonical_size_bounds_the_payloads() {
        let mut salted = store(1, &[(u64::MAX, 1), (u64::MAX - 1, 2)], &[u32::MAX; 8]);
        if let Body::Stored(stored) = &mut salted.events[0].body {
            stored.lora_name = Some("a-lora-adapter".into());
            stored.cache_salt = Some("salt".repeat(20).into());
        }
        let mut ranks = removal(0, &[u64::MAX, 7]);
        ranks.events.extend(std::mem::take(&mut clears(3).events));
        ranks
            .events
            .extend(std::mem::take(&mut removal(0, &[1]).events));
        for output in [
            salted,
            ranks,
            store(0, &[(1, 1)], &[1]),
            clears(0),
            Output::default(),
        ] {
            let written: usize = output
                .canonical_payloads(u64::MAX, 1.0)
                .iter()
                .map(Vec::len)
                .sum();
            assert!(
                written <= output.canonical_size(),
                "{written} > {}",
                output.canonical_size()
            );
        }
    }

    #[test]
    fn a_batch_closes_before_the_output_that_would_pass_max_bytes() {
        let (a, b, c) = (removal(0, &[1]), removal(0, &[2]), removal(0, &[3]));
        let weight = a.canonical_size();
        let timed = [(&a, 1.0), (&b, 1.0), (&c, 1.0)];
        let merged = canonical_payloads(&timed, 16, 2 * weight);
        let mut first = canonical_payloads(&timed[..2], 16, usize::MAX);
        first.extend(alone(&[&c]));
        assert_eq!(merged, first);
        assert_eq!(canonical_payloads(&timed[..2], 16, 0), alone(&[&a, &b]));
    }

    #[test]
    fn ranks_split_batches_and_clears_collapse_across_outputs() {
        let both = [(&clears(0), 1.0), (&clears(0), 1.0)];
        let merged = canonical_payloads(&both, 16, usize::MAX);
        assert_eq!(merged, clears(0).canonical_payloads(16, 1.0));
        assert_eq!(parts(&merged[0]).0, 1);
        let (a, b) = (removal(0, &[1]), removal(1, &[2]));
        let merged = canonical_payloads(&[(&a, 1.0), (&clears(1), 1.0), (&b, 1.0)], 16, usize::MAX);
        let ranks: Vec<_> = merged.iter().map(|p| (parts(p).0, parts(p).2)).collect();
        assert_eq!(ranks, [(1, 0), (2, 1)]);
        assert_eq!(
            canonical_payloads(&[], 16, usize::MAX),
            Vec::<Vec<u8>>::new()
        );
    }

    /// The msgpack strings of `parts`, one after another.
    pub(crate) fn strs(parts: &[&str]) -> Vec<u8> {
        let mut out = Vec::new();
        for part in parts {
            write::str(&mut out, part);
        }
        out
    }

    #[test]
    fn constant_stretches_are_what_the_writers_write() {
        let tag = |entries, fields, tag: &str| {
            let mut out = Vec::new();
            write::map(&mut out, entries, fields);
            out.extend(strs(&["type", tag]));
            out
        };
        let mut head = tag(10, STORED_MAP_FIELDS, STORED);
        head.extend(strs(&["block_hashes"]));
        assert_eq!(canonical::STORED_HEAD, head);
        let mut head = tag(11, STORED_MAP_FIELDS, STORED);
        head.extend(strs(&["block_hashes"]));
        assert_eq!(canonical::STORED_HEAD_SALTED, head);
        assert_eq!(canonical::PARENT, strs(&["parent_block_hash"]));
        assert_eq!(canonical::TOKEN_IDS, strs(&["token_ids"]));
        assert_eq!(canonical::BLOCK_SIZE, strs(&["block_size"]));
        let mut tail = strs(&["group_idx"]);
        write::uint(&mut tail, 0);
        tail.extend(strs(&["kv_cache_spec_kind", "full_attention"]));
        assert_eq!(canonical::STORED_TAIL, tail);
        let mut head = tag(4, REMOVED_MAP_FIELDS, REMOVED);
        head.extend(strs(&["block_hashes"]));
        assert_eq!(canonical::REMOVED_HEAD, head);
        let mut lora_id = strs(&["lora_id"]);
        write::nil(&mut lora_id);
        lora_id.extend(strs(&["medium"]));
        assert_eq!(canonical::LORA_ID_MEDIUM, lora_id);
        assert_eq!(canonical::LORA_NAME, strs(&["lora_name"]));
        assert_eq!(canonical::MEDIUM_KEY, strs(&["medium"]));
        for tier in Tier::ALL {
            assert_eq!(canonical::MEDIUM[tier as usize], strs(&[tier.medium()]));
        }
        let mut tail = strs(&["group_idx"]);
        write::uint(&mut tail, 0);
        assert_eq!(canonical::REMOVED_TAIL, tail);
        assert_eq!(canonical::CLEARED, tag(1, 1, CLEARED));
        assert_eq!(canonical::EXTRA_KEYS, strs(&["extra_keys"]));
        assert_eq!(canonical::MEDIUM_MAX, strs(&["EXTERNAL"]).len());
    }

    #[test]
    fn a_thread_that_makes_no_outputs_keeps_none_it_drops() {
        let spares = std::thread::spawn(|| {
            drop(store(3, &[(1, 2)], &[5, 6, 7, 8]));
            SPARE.with(|spare| spare.borrow().len())
        });
        assert_eq!(spares.join().unwrap(), 0);
    }

    #[test]
    fn a_dropped_outputs_buffers_are_reused_empty_and_a_large_ones_are_not() {
        // Each test runs on a thread of its own, so the spares start empty.
        drop(Output::new()); // this thread makes outputs
        let mut out = store(3, &[(1, 2), (3, 4)], &[5, 6, 7, 8]);
        out.batch = Some((1.5, 3));
        let events = out.events.as_ptr();
        drop(out);
        let reused = Output::new();
        assert_eq!(reused, Output::default());
        assert_eq!(reused.events.as_ptr(), events);
        assert!(reused.blocks.capacity() >= 2 && reused.token_ids.capacity() >= 4);
        assert_eq!(
            Output::new().events.capacity(),
            0,
            "one output was kept, one is taken"
        );
        drop(reused);
        let mut large = Output::new();
        large.token_msgpack.reserve(SPARE_BYTES + 1);
        drop(large);
        assert_eq!(Output::new().token_msgpack.capacity(), 0);
        let kept: Vec<Output> = (0..SPARES + 2).map(|_| removal(0, &[1])).collect();
        drop(kept);
        let taken: Vec<Output> = (0..SPARES + 1).map(|_| Output::new()).collect();
        let reused = taken.iter().filter(|out| out.events.capacity() > 0).count();
        assert_eq!(reused, SPARES);
    }
}
