//! The fields of vLLM's events, in wire order, with what each era may carry.
//!
//! vLLM appends fields; it never reorders or removes them. So one ordered list per event type,
//! plus how many of its leading fields are required and how many the array era (up to 0.23)
//! ever sent, describes every release. The Python package's layout table
//! (`kvbridge.schemas.vllm.LAYOUTS`) is the per-release view of the same facts; a test fails if
//! the two disagree.

/// `BlockStored`'s fields, oldest first.
pub const STORED_FIELDS: [&str; 15] = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
];

/// `BlockRemoved`'s fields, oldest first.
pub const REMOVED_FIELDS: [&str; 5] = [
    "block_hashes",
    "medium",
    "group_idx",
    "locality",
    "ownership",
];

/// Where each of `BlockRemoved`'s fields stands in [`STORED_FIELDS`]: the removal's fields are
/// a subset of the store's, so one position names a field of either.
pub const REMOVED_AS_STORED: [usize; 5] = [0, 5, 8, 11, 12];

/// The position of a field in [`STORED_FIELDS`], by name.
pub fn stored_position(name: &[u8]) -> Option<usize> {
    Some(match name {
        b"block_hashes" => 0,
        b"parent_block_hash" => 1,
        b"token_ids" => 2,
        b"block_size" => 3,
        b"lora_id" => 4,
        b"medium" => 5,
        b"lora_name" => 6,
        b"extra_keys" => 7,
        b"group_idx" => 8,
        b"kv_cache_spec_kind" => 9,
        b"kv_cache_spec_sliding_window" => 10,
        b"locality" => 11,
        b"ownership" => 12,
        b"session_id" => 13,
        b"lookahead_token_ids" => 14,
        _ => return None,
    })
}

/// Leading fields without a default: every release sends them.
pub const STORED_REQUIRED: usize = 5;
pub const REMOVED_REQUIRED: usize = 1;

/// Fields the array era ever sent: array positions past these are unknown.
pub const STORED_ARRAY_FIELDS: usize = 11;
pub const REMOVED_ARRAY_FIELDS: usize = 3;

/// The largest value of the fields vLLM declares as 32-bit: token ids, block size, group index
/// and data-parallel rank.
pub const U32_MAX: u64 = u32::MAX as u64;

/// The event tags.
pub const STORED: &str = "BlockStored";
pub const REMOVED: &str = "BlockRemoved";
pub const CLEARED: &str = "AllBlocksCleared";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_follow_the_field_lists() {
        for (position, name) in STORED_FIELDS.iter().enumerate() {
            assert_eq!(stored_position(name.as_bytes()), Some(position));
        }
        for (name, position) in REMOVED_FIELDS.iter().zip(REMOVED_AS_STORED) {
            assert_eq!(STORED_FIELDS[position], *name);
        }
        assert_eq!(stored_position(b"type"), None);
    }
}
