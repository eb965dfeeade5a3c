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
