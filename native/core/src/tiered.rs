//! The msgpack of `list[kvbridge.TieredEvent]` for an [`Output`], which msgspec builds the
//! Python values from in one pass.
//!
//! A field at its default (a `None` LoRA name or cache salt, dp rank 0 in `KvCacheEvent`) is
//! left out: msgspec fills a default faster than it reads a key and its value.

use crate::hashing::pack_tokens;
use crate::msgpack::write;
use crate::output::{Body, Output};

impl Output {
    /// The events as msgpack of `list[kvbridge.TieredEvent]`, for msgspec to build in one pass.
    /// Hashes go out as uint64 whatever their value (msgspec reads any width), so that a
    /// stored block is one constant-sized stretch.
    pub fn tiered_events(&self, worker_id: u64) -> Vec<u8> {
        let capacity = 64
            + self.events.len() * 128
            + self.blocks.len() * STORED_BLOCK_SIZE
            + self.hashes.len() * 9
            + self.token_ids.len() * 4;
        let mut out = Vec::with_capacity(capacity);
        write::array(&mut out, self.events.len());
        for event in &self.events {
            let fields = match &event.body {
                Body::Stored(store) => {
                    5 + usize::from(store.lora_name.is_some())
                        + usize::from(store.cache_salt.is_some())
                }
                _ => 4,
            };
            write::map(&mut out, fields, 7);
            out.extend_from_slice(keys::WORKER_ID);
            write::uint(&mut out, worker_id);
            out.extend_from_slice(keys::DP_RANK);
            write::uint(&mut out, u64::from(event.dp_rank));
            out.extend_from_slice(keys::TIER[event.tier as usize]);
            // `KvCacheEvent`: event_id, data and, unless it is 0, dp_rank.
            write::map(&mut out, if event.dp_rank == 0 { 2 } else { 3 }, 3);
            out.extend_from_slice(keys::EVENT_ID);
            write::uint(&mut out, event.event_id);
            match &event.body {
                Body::Stored(store) => {
                    out.extend_from_slice(keys::STORED);
                    match store.parent {
                        Some(parent) => write::uint(&mut out, parent),
                        None => write::nil(&mut out),
                    }
                    out.extend_from_slice(keys::BLOCKS);
                    write::array(&mut out, store.blocks.len());
                    for &(hash, tokens_hash) in &self.blocks[store.blocks.clone()] {
                        out.extend_from_slice(&stored_block(hash, tokens_hash));
                    }
                    write_event_dp_rank(&mut out, event.dp_rank);
                    // `kvbridge.TokenIds`: its one field, the ids as u32 little-endian.
                    out.extend_from_slice(keys::TOKEN_IDS);
                    let ids = &self.token_ids[store.ids.clone()];
                    write::bin_header(&mut out, ids.len() * 4);
                    pack_tokens(ids, &mut out);
                    if let Some(name) = store.lora_name.as_deref() {
                        out.extend_from_slice(keys::LORA_NAME);
                        write::str(&mut out, name);
                    }
                    if let Some(salt) = store.cache_salt.as_deref() {
                        out.extend_from_slice(keys::CACHE_SALT);
                        write::str(&mut out, salt);
                    }
                }
                Body::Removed { hashes } => {
                    out.extend_from_slice(keys::REMOVED);
                    write::array(&mut out, hashes.len());
                    for hash in &self.hashes[hashes.clone()] {
                        out.push(0xcf);
                        out.extend_from_slice(&hash.to_be_bytes());
                    }
                    write_event_dp_rank(&mut out, event.dp_rank);
                }
                Body::Cleared => {
                    out.extend_from_slice(keys::CLEARED);
                    write_event_dp_rank(&mut out, event.dp_rank);
                }
            }
        }
        out
    }
}

/// The bytes of one `StoredBlock`: `{"block_hash": hash, "tokens_hash": tokens_hash}`.
const STORED_BLOCK_SIZE: usize = 1 + keys::BLOCK_HASH.len() + 9 + keys::TOKENS_HASH.len() + 9;

fn stored_block(hash: u64, tokens_hash: u64) -> [u8; STORED_BLOCK_SIZE] {
    const HASH_AT: usize = 1 + keys::BLOCK_HASH.len();
    const TOKENS_HASH_AT: usize = HASH_AT + 9 + keys::TOKENS_HASH.len();
    let mut block = [0u8; STORED_BLOCK_SIZE];
    block[0] = 0x82;
    block[1..HASH_AT].copy_from_slice(keys::BLOCK_HASH);
    block[HASH_AT] = 0xcf;
    block[HASH_AT + 1..HASH_AT + 9].copy_from_slice(&hash.to_be_bytes());
    block[HASH_AT + 9..TOKENS_HASH_AT].copy_from_slice(keys::TOKENS_HASH);
    block[TOKENS_HASH_AT] = 0xcf;
    block[TOKENS_HASH_AT + 1..].copy_from_slice(&tokens_hash.to_be_bytes());
    block
}

/// The constant stretches of the `TieredEvent` msgpack (the tests check them against the
/// writers): keys, and the headers between them.
mod keys {
    pub const WORKER_ID: &[u8] = b"\xa9worker_id";
    pub const DP_RANK: &[u8] = b"\xa7dp_rank";
    /// Each tier's `tier` key and value, then the `event` key.
    pub const TIER: [&[u8]; 4] = [
        b"\xa4tier\xa6device\xa5event",
        b"\xa4tier\xabhost_pinned\xa5event",
        b"\xa4tier\xa4disk\xa5event",
        b"\xa4tier\xa8external\xa5event",
    ];
    pub const EVENT_ID: &[u8] = b"\xa8event_id";
    /// `data`, `{"stored": {` and the `parent_hash` key.
    pub const STORED: &[u8] = b"\xa4data\x81\xa6stored\x82\xabparent_hash";
    pub const BLOCKS: &[u8] = b"\xa6blocks";
    pub const BLOCK_HASH: &[u8] = b"\xaablock_hash";
    pub const TOKENS_HASH: &[u8] = b"\xabtokens_hash";
    /// The `token_ids` key and `TokenIds`' map of its one field, `packed`.
    pub const TOKEN_IDS: &[u8] = b"\xa9token_ids\x81\xa6packed";
    pub const LORA_NAME: &[u8] = b"\xa9lora_name";
    pub const CACHE_SALT: &[u8] = b"\xaacache_salt";
    /// `data`, `{"removed": {` and the `block_hashes` key.
    pub const REMOVED: &[u8] = b"\xa4data\x81\xa7removed\x81\xacblock_hashes";
    pub const CLEARED: &[u8] = b"\xa4data\xa7cleared";
}

/// `KvCacheEvent.dp_rank`, unless it is the default, 0.
fn write_event_dp_rank(out: &mut Vec<u8>, dp_rank: u32) {
    if dp_rank != 0 {
        out.extend_from_slice(keys::DP_RANK);
        write::uint(out, u64::from(dp_rank));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::media::Tier;
    use crate::output::tests::strs;

    #[test]
    fn tiered_stretches_are_the_keys_and_headers_they_stand_for() {
        let map = |entries| {
            let mut out = Vec::new();
            write::map(&mut out, entries, entries);
            out
        };
        let join = |parts: &[&[u8]]| parts.concat();
        assert_eq!(keys::WORKER_ID, strs(&["worker_id"]));
        assert_eq!(keys::DP_RANK, strs(&["dp_rank"]));
        for tier in Tier::ALL {
            let expected = strs(&["tier", tier.name(), "event"]);
            assert_eq!(keys::TIER[tier as usize], expected);
        }
        assert_eq!(keys::EVENT_ID, strs(&["event_id"]));
        let stored = join(&[&strs(&["data"]), &map(1), &strs(&["stored"]), &map(2)]);
        assert_eq!(keys::STORED, join(&[&stored, &strs(&["parent_hash"])]));
        assert_eq!(keys::BLOCKS, strs(&["blocks"]));
        let token_ids = join(&[&strs(&["token_ids"]), &map(1), &strs(&["packed"])]);
        assert_eq!(keys::TOKEN_IDS, token_ids);
        assert_eq!(keys::LORA_NAME, strs(&["lora_name"]));
        assert_eq!(keys::CACHE_SALT, strs(&["cache_salt"]));
        let removed = join(&[&strs(&["data"]), &map(1), &strs(&["removed"]), &map(1)]);
        assert_eq!(keys::REMOVED, join(&[&removed, &strs(&["block_hashes"])]));
        assert_eq!(keys::CLEARED, strs(&["data", "cleared"]));
        let mut block = map(2);
        block.extend(strs(&["block_hash"]));
        block.extend([0xcf, 0, 0, 0, 0, 0, 0, 0, 1]);
        block.extend(strs(&["tokens_hash"]));
        block.extend([0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xfe]);
        assert_eq!(stored_block(1, u64::MAX - 1).as_slice(), block);
    }
}
