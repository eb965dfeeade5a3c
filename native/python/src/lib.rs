//! `kvbridge._core`: the Python face of `kvbridge-core`.
//!
//! A batch crosses as bytes in both directions: the payload in, and out either the relay's
//! canonical payloads or the msgpack of `TieredEvent`s that msgspec builds in one pass. The GIL
//! is released while the core works on a large batch, and no Python object is made per event,
//! block or token.

mod batch;
mod decode_view;
mod hashing;
mod huge_pages;
mod normalizer;

use kvbridge_core::layout;
use kvbridge_core::msgpack::MAX_DEPTH;
use kvbridge_core::{SchemaError, Tier};
use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use batch::PyOutput;
use normalizer::PyNormalizer;

#[global_allocator]
static ALLOCATOR: huge_pages::HugePages = huge_pages::HugePages;

create_exception!(
    _core,
    PayloadError,
    PyValueError,
    "A payload the core cannot decode; args are (message, event_index, field)."
);

fn payload_error(error: SchemaError) -> PyErr {
    PayloadError::new_err((error.message, error.event_index, error.field))
}

fn tier_of(index: usize) -> PyResult<Tier> {
    Tier::ALL
        .get(index)
        .copied()
        .ok_or_else(|| PyValueError::new_err(format!("no tier {index}")))
}

#[pymodule]
fn _core(module: &Bound<'_, PyModule>) -> PyResult<()> {
    module.add_class::<PyNormalizer>()?;
    module.add_class::<PyOutput>()?;
    module.add_function(wrap_pyfunction!(decode_view::decode_view, module)?)?;
    module.add_function(wrap_pyfunction!(batch::canonical_payloads, module)?)?;
    module.add_function(wrap_pyfunction!(hashing::tokens_hashes, module)?)?;
    module.add_function(wrap_pyfunction!(hashing::sequence_hashes, module)?)?;
    module.add_function(wrap_pyfunction!(hashing::prompt_hashes, module)?)?;
    module.add_function(wrap_pyfunction!(hashing::block_seed, module)?)?;
    module.add("PayloadError", module.py().get_type::<PayloadError>())?;
    module.add("STORED_FIELDS", layout::STORED_FIELDS.to_vec())?;
    module.add("REMOVED_FIELDS", layout::REMOVED_FIELDS.to_vec())?;
    module.add("STORED_REQUIRED", layout::STORED_REQUIRED)?;
    module.add("REMOVED_REQUIRED", layout::REMOVED_REQUIRED)?;
    module.add("STORED_ARRAY_FIELDS", layout::STORED_ARRAY_FIELDS)?;
    module.add("REMOVED_ARRAY_FIELDS", layout::REMOVED_ARRAY_FIELDS)?;
    module.add("MAX_DEPTH", MAX_DEPTH)?;
    module.add("RELEASE_GIL_BYTES", normalizer::RELEASE_GIL_BYTES)?;
    module.add(
        "MEDIA",
        kvbridge_core::media::MEDIA
            .iter()
            .map(|(name, tier)| (*name, tier.name()))
            .collect::<Vec<_>>(),
    )?;
    module.add(
        "TIERS",
        Tier::ALL.iter().map(|tier| tier.name()).collect::<Vec<_>>(),
    )?;
    Ok(())
}
