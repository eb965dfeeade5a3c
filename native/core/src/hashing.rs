//! Engine hashes as u64, and Dynamo's block hashes: `tokens_hash` and the rolling sequence hash.
//!
//! Bit for bit what `dynamo.llm.compute_block_hash_for_seq` computes and what Dynamo's router
//! reports as sequence hashes; the Python test suite checks it against the Dynamo binary.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Dynamo's seed of the token hash and of the rolling sequence hash.
pub const DYNAMO_SEED: u64 = 1337;

/// The prefix Dynamo's vLLM integration puts on a cache salt; Dynamo reads only prefixed salts.
pub const DYNAMO_SALT_PREFIX: &str = "dynamo-cache-salt:";

/// A bytes block hash as u64: its last 8 bytes, big-endian, as vLLM's int mode derives it.
pub fn engine_hash_bytes(bytes: &[u8]) -> u64 {
    if let Some(tail) = bytes.last_chunk::<8>() {
        return u64::from_be_bytes(*tail);
    }
    let tail = &bytes[bytes.len().saturating_sub(8)..];
    tail.iter()
        .fold(0u64, |value, byte| (value << 8) | u64::from(*byte))
}

/// The XXH3 seed of `tokens_hash`: 1337 plus the LoRA name and cache salt terms.
pub fn block_seed(lora_name: Option<&str>, cache_salt: Option<&str>) -> u64 {
    let mut seed = DYNAMO_SEED;
    if let Some(name) = lora_name.filter(|name| !name.is_empty()) {
        seed = seed.wrapping_add(xxh3_64_with_seed(name.as_bytes(), 0));
    }
    if let Some(salt) = cache_salt.filter(|salt| !salt.is_empty()) {
        seed = seed.wrapping_add(xxh3_64_with_seed(salt.as_bytes(), 1));
    }
    seed
}

/// Appends tokens as consecutive little-endian u32: the byte form Dynamo hashes, and that of
/// `kvbridge.TokenIds`.
pub fn pack_tokens(tokens: &[u32], out: &mut Vec<u8>) {
    let start = out.len();
    out.resize(start + tokens.len() * 4, 0);
    for (place, token) in out[start..].chunks_exact_mut(4).zip(tokens) {
        place.copy_from_slice(&token.to_le_bytes());
    }
}

/// Dynamo's `tokens_hash` of one block: XXH3 of its packed tokens, followed by its multimodal
/// object hashes (sorted, little-endian) if it has any.
pub fn tokens_hash(tokens: &[u32], seed: u64, mm_hashes: &mut [u64], scratch: &mut Vec<u8>) -> u64 {
    scratch.clear();
    pack_tokens(tokens, scratch);
    if !mm_hashes.is_empty() {
        mm_hashes.sort_unstable();
        for hash in mm_hashes.iter() {
            scratch.extend_from_slice(&hash.to_le_bytes());
        }
    }
    xxh3_64_with_seed(scratch, seed)
}

/// One step of Dynamo's rolling sequence hash (`public-xxh3-v1`).
pub fn sequence_hash(parent: Option<u64>, block_tokens_hash: u64) -> u64 {
    match parent {
        None => block_tokens_hash,
        Some(parent) => {
            let mut pair = [0u8; 16];
            pair[..8].copy_from_slice(&parent.to_le_bytes());
            pair[8..].copy_from_slice(&block_tokens_hash.to_le_bytes());
            xxh3_64_with_seed(&pair, DYNAMO_SEED)
        }
    }
}

/// XXH3-64 of an identifier with seed 0: how Dynamo turns a non-digest multimodal id into a hash.
pub fn identifier_hash(identifier: &str) -> u64 {
    xxh3_64_with_seed(identifier.as_bytes(), 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_hash_is_the_big_endian_tail() {
        assert_eq!(
            engine_hash_bytes(&[0xff, 0, 0, 0, 0, 0, 0, 0, 1, 2]),
            0x0102
        );
        assert_eq!(engine_hash_bytes(&[1, 2]), 0x0102);
        assert_eq!(engine_hash_bytes(&[]), 0);
    }

    #[test]
    fn empty_names_do_not_change_the_seed() {
        assert_eq!(block_seed(Some(""), Some("")), DYNAMO_SEED);
        assert_ne!(block_seed(Some("a"), None), DYNAMO_SEED);
    }

    #[test]
    fn sequence_hash_of_a_root_is_its_tokens_hash() {
        assert_eq!(sequence_hash(None, 42), 42);
        assert_ne!(sequence_hash(Some(1), 42), 42);
    }
}
