//! Dynamo's block and sequence hashes, for the routers' prompts: the same code that hashes the
//! relay's blocks.

use kvbridge_core::hashing;
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// Dynamo's `tokens_hash` of each full block of `packed` (token ids as little-endian u32 in a
/// bytes-like object of format `B`), as u64; `mm_hashes[i]` are block `i`'s multimodal object
/// hashes. A block size of 0 is refused.
#[pyfunction]
#[pyo3(signature = (packed, block_size, seed, mm_hashes = Vec::new()))]
pub(crate) fn tokens_hashes(
    py: Python<'_>,
    packed: PyBuffer<u8>,
    block_size: usize,
    seed: u64,
    mut mm_hashes: Vec<Vec<u64>>,
) -> PyResult<Vec<u64>> {
    if block_size == 0 {
        return Err(PyValueError::new_err("block_size must be positive, got 0"));
    }
    let packed = packed.to_vec(py)?;
    Ok(hashing::packed_tokens_hashes(
        &packed,
        block_size,
        seed,
        &mut mm_hashes,
    ))
}

/// The rolling sequence hash of each block whose `tokens_hash` is given, continuing from
/// `parent`'s, as u64.
#[pyfunction]
#[pyo3(signature = (tokens_hashes, parent = None))]
pub(crate) fn sequence_hashes(tokens_hashes: Vec<u64>, parent: Option<u64>) -> Vec<u64> {
    hashing::sequence_hashes(&tokens_hashes, parent)
}

/// A prompt in the form Dynamo's router takes precomputed: the `tokens_hash` and the sequence
/// hash of each full block of `packed` (as [`tokens_hashes`] reads it), both as the signed
/// i64 values Dynamo's Python binding takes. The GIL stays held: hashing an 8k-token prompt
/// takes a few microseconds, less than handing the GIL over and back can cost.
#[pyfunction]
pub(crate) fn prompt_hashes(
    py: Python<'_>,
    packed: PyBuffer<u8>,
    block_size: usize,
    seed: u64,
) -> PyResult<(Vec<i64>, Vec<i64>)> {
    let blocks = tokens_hashes(py, packed, block_size, seed, Vec::new())?;
    let sequence = hashing::sequence_hashes(&blocks, None);
    // The same 64 bits read as two's complement, as Dynamo's i64 hashes are.
    let signed = |values: &[u64]| values.iter().map(|&value| value as i64).collect();
    Ok((signed(&blocks), signed(&sequence)))
}

/// The XXH3 seed of a block's `tokens_hash`: Dynamo's, plus the LoRA name and cache salt terms
/// (an empty one adds nothing).
#[pyfunction]
#[pyo3(signature = (lora_name = None, cache_salt = None))]
pub(crate) fn block_seed(lora_name: Option<&str>, cache_salt: Option<&str>) -> u64 {
    hashing::block_seed(lora_name, cache_salt)
}
