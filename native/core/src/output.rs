//! The events a batch normalizes to, and the bytes they go out as: the relay's canonical vLLM
//! payloads and the msgpack of `kvbridge.TieredEvent`s.

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
    pub token_count: usize,
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
    pub hashes: Vec<u64>,
}

/// The number of entries msgspec sizes a map header by: the struct's fields plus its tag.
#[cfg(test)]
const STORED_MAP_FIELDS: usize = STORED_FIELDS.len() - 1 + 1; // the 0.30-0.32 layout: 14 fields
#[cfg(test)]
const REMOVED_MAP_FIELDS: usize = REMOVED_FIELDS.len() + 1;

impl Output {
    /// The payloads that republish these events, one batch per run of one dp rank, in vLLM
    /// 0.32's layout as Dynamo decodes it: an array batch of tagged-map events, canonical
    /// hashes, a medium Dynamo knows, tokens on every store, and the cache salt tagged the way
    /// Dynamo reads it. The clears of a rank's tiers collapse into one medium-less clear.
    pub fn canonical_payloads(&self, block_size: u64, worker_ts: f64) -> Vec<Vec<u8>> {
        let mut payloads = Vec::new();
        let mut start = 0;
        while start < self.events.len() {
            let rank = self.events[start].dp_rank;
            let end = self.events[start..]
                .iter()
                .position(|event| event.dp_rank != rank)
                .map_or(self.events.len(), |offset| start + offset);
            payloads.push(self.canonical_batch(&self.events[start..end], block_size, worker_ts));
            start = end;
        }
        payloads
    }

    fn canonical_batch(&self, events: &[OutEvent], block_size: u64, ts: f64) -> Vec<u8> {
        let mut kept: Vec<&OutEvent> = Vec::with_capacity(events.len());
        for event in events {
            let repeat = matches!(event.body, Body::Cleared)
                && kept
                    .last()
                    .is_some_and(|last| matches!(last.body, Body::Cleared));
            if !repeat {
                kept.push(event);
            }
        }
        let mut out = Vec::with_capacity(
            64 + kept.len() * 160
                + self.token_msgpack.len()
                + (self.blocks.len() + self.hashes.len()) * 9,
        );
        write::array(&mut out, 3);
        write::float(&mut out, ts);
        write::array(&mut out, kept.len());
        for event in &kept {
            self.write_canonical_event(&mut out, event, block_size);
        }
        write::uint(&mut out, u64::from(events[0].dp_rank));
        out
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
                write::array(out, store.token_count);
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
                    write::str(out, "extra_keys");
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

    /// The events as msgpack of `list[kvbridge.TieredEvent]`, for msgspec to build in one pass.
    pub fn tiered_events(&self, worker_id: u64) -> Vec<u8> {
        let mut out = Vec::with_capacity(64 + self.events.len() * 96 + self.token_msgpack.len());
        write::array(&mut out, self.events.len());
        for event in &self.events {
            let stored = matches!(event.body, Body::Stored(_));
            write::map(&mut out, if stored { 7 } else { 4 }, 7);
            write::str(&mut out, "worker_id");
            write::uint(&mut out, worker_id);
            write::str(&mut out, "dp_rank");
            write::uint(&mut out, u64::from(event.dp_rank));
            write::str(&mut out, "tier");
            write::str(&mut out, event.tier.name());
            write::str(&mut out, "event");
            write::map(&mut out, 3, 3);
            write::str(&mut out, "event_id");
            write::uint(&mut out, event.event_id);
            write::str(&mut out, "data");
            match &event.body {
                Body::Stored(store) => {
                    write::map(&mut out, 1, 2);
                    write::str(&mut out, "stored");
                    write::map(&mut out, 2, 3);
                    write::str(&mut out, "parent_hash");
                    match store.parent {
                        Some(parent) => write::uint(&mut out, parent),
                        None => write::nil(&mut out),
                    }
                    write::str(&mut out, "blocks");
                    write::array(&mut out, store.blocks.len());
                    for (hash, tokens_hash) in &self.blocks[store.blocks.clone()] {
                        write::map(&mut out, 2, 3);
                        write::str(&mut out, "block_hash");
                        write::uint(&mut out, *hash);
                        write::str(&mut out, "tokens_hash");
                        write::uint(&mut out, *tokens_hash);
                    }
                    write_event_tail(&mut out, event.dp_rank);
                    write::str(&mut out, "token_ids");
                    write::array(&mut out, store.token_count);
                    out.extend_from_slice(&self.token_msgpack[store.tokens.clone()]);
                    write::str(&mut out, "lora_name");
                    write_opt_str(&mut out, store.lora_name.as_deref());
                    write::str(&mut out, "cache_salt");
                    write_opt_str(&mut out, store.cache_salt.as_deref());
                }
                Body::Removed { hashes } => {
                    write::map(&mut out, 1, 2);
                    write::str(&mut out, "removed");
                    write::map(&mut out, 1, 1);
                    write::str(&mut out, "block_hashes");
                    write::array(&mut out, hashes.len());
                    for hash in &self.hashes[hashes.clone()] {
                        write::uint(&mut out, *hash);
                    }
                    write_event_tail(&mut out, event.dp_rank);
                }
                Body::Cleared => {
                    write::str(&mut out, "cleared");
                    write_event_tail(&mut out, event.dp_rank);
                }
            }
        }
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
}

fn write_event_tail(out: &mut Vec<u8>, dp_rank: u32) {
    write::str(out, "dp_rank");
    write::uint(out, u64::from(dp_rank));
}

fn write_opt_str(out: &mut Vec<u8>, value: Option<&str>) {
    match value {
        Some(value) => write::str(out, value),
        None => write::nil(out),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strs(parts: &[&str]) -> Vec<u8> {
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
    }
}
