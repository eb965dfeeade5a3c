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
    if mm_hashes.is_empty() && cfg!(target_endian = "little") {
        // A little-endian machine holds the ids in their packed form already: hashed in place.
        return xxh3_64_with_seed(bytemuck::cast_slice(tokens), seed);
    }
    scratch.clear();
    pack_tokens(tokens, scratch);
    append_mm_hashes(scratch, mm_hashes);
    xxh3_64_with_seed(scratch, seed)
}

/// Appends a block's multimodal object hashes as Dynamo hashes them after its tokens: sorted,
/// little-endian.
fn append_mm_hashes(block: &mut Vec<u8>, mm_hashes: &mut [u64]) {
    mm_hashes.sort_unstable();
    for hash in mm_hashes.iter() {
        block.extend_from_slice(&hash.to_le_bytes());
    }
}

/// Dynamo's `tokens_hash` of each full block of `packed` (token ids as little-endian u32, as
/// [`pack_tokens`] writes them), hashed where they lie; a trailing partial block, and every
/// block when `block_size` is 0, is left out. `mm_hashes[i]` are block `i`'s multimodal object
/// hashes (see [`tokens_hash`]); blocks past the list have none. What a router hashes a prompt
/// with, bit for bit `dynamo.llm.compute_block_hash_for_seq`.
pub fn packed_tokens_hashes(
    packed: &[u8],
    block_size: usize,
    seed: u64,
    mm_hashes: &mut [Vec<u64>],
) -> Vec<u64> {
    let Some(width) = block_size.checked_mul(4).filter(|&width| width > 0) else {
        return Vec::new();
    };
    let mut scratch = Vec::new();
    packed
        .chunks_exact(width)
        .enumerate()
        .map(|(index, block)| match mm_hashes.get_mut(index) {
            Some(block_mm) if !block_mm.is_empty() => {
                scratch.clear();
                scratch.extend_from_slice(block);
                append_mm_hashes(&mut scratch, block_mm);
                xxh3_64_with_seed(&scratch, seed)
            }
            _ => xxh3_64_with_seed(block, seed),
        })
        .collect()
}

/// The rolling sequence hash of each block whose `tokens_hash` is given, continuing from
/// `parent`'s (see [`sequence_hash`]).
pub fn sequence_hashes(tokens_hashes: &[u64], mut parent: Option<u64>) -> Vec<u64> {
    tokens_hashes
        .iter()
        .map(|&block_tokens_hash| {
            let hash = sequence_hash(parent, block_tokens_hash);
            parent = Some(hash);
            hash
        })
        .collect()
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
    fn packed_blocks_hash_as_their_tokens_do() {
        let tokens: Vec<u32> = (0..37u32).map(|i| i.wrapping_mul(2_654_435_761)).collect();
        let mut packed = Vec::new();
        pack_tokens(&tokens, &mut packed);
        let mut mm = vec![vec![], vec![u64::MAX, 3, 1 << 63]];
        let hashes = packed_tokens_hashes(&packed, 8, 99, &mut mm);
        let mut scratch = Vec::new();
        let expected: Vec<u64> = tokens
            .chunks_exact(8)
            .enumerate()
            .map(|(index, block)| {
                let mut block_mm = if index == 1 {
                    vec![3, 1 << 63, u64::MAX]
                } else {
                    vec![]
                };
                tokens_hash(block, 99, &mut block_mm, &mut scratch)
            })
            .collect();
        assert_eq!(hashes, expected);
        assert_eq!(hashes.len(), 4);
        assert!(packed_tokens_hashes(&packed, 0, 99, &mut []).is_empty());
        assert!(packed_tokens_hashes(&packed, usize::MAX, 99, &mut []).is_empty());
        assert!(packed_tokens_hashes(&packed[..31], 8, 99, &mut []).is_empty());
    }

    #[test]
    fn sequence_hashes_roll_from_the_parent() {
        let roots = sequence_hashes(&[5, 6, 7], None);
        assert_eq!(roots[0], 5);
        assert_eq!(roots[1], sequence_hash(Some(5), 6));
        assert_eq!(roots[2], sequence_hash(Some(roots[1]), 7));
        assert_eq!(sequence_hashes(&[6, 7], Some(5)), roots[1..]);
        assert!(sequence_hashes(&[], Some(5)).is_empty());
    }

    #[test]
    fn sequence_hash_of_a_root_is_its_tokens_hash() {
        assert_eq!(sequence_hash(None, 42), 42);
        assert_ne!(sequence_hash(Some(1), 42), 42);
    }
}
