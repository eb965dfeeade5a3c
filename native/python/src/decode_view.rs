//! The core's decoding of a payload as plain Python values, for the differential tests.

use kvbridge_core::decode::{Arena, Event};
use kvbridge_core::{decode, layout};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};

use crate::payload_error;

/// The core's decoding of a payload, as plain values, for differential tests against the
/// msgspec decoder: `(ts, dp_rank, unknown_fields, events)`, each event a tuple of its tag and
/// its fields in layout order (hashes as u64, extra keys as msgpack bytes).
#[pyfunction]
pub(crate) fn decode_view<'py>(py: Python<'py>, payload: &[u8]) -> PyResult<Bound<'py, PyTuple>> {
    let mut arena = Arena::default();
    let batch = decode(payload, &mut arena).map_err(payload_error)?;
    let mut events: Vec<Bound<'py, PyTuple>> = Vec::with_capacity(batch.events.len());
    for event in &batch.events {
        let tuple = match event {
            Event::Stored(s) => {
                let raw = |value: Option<&[u8]>| value.map(|bytes| PyBytes::new(py, bytes));
                let fields: Vec<Bound<'py, PyAny>> = vec![
                    layout::STORED.into_pyobject(py)?.into_any(),
                    arena.hashes[s.hashes.clone()].into_pyobject(py)?.into_any(),
                    s.parent.into_pyobject(py)?.into_any(),
                    arena.tokens[s.tokens.clone()].into_pyobject(py)?.into_any(),
                    s.block_size.into_pyobject(py)?.into_any(),
                    s.lora_id.into_pyobject(py)?.into_any(),
                    s.medium.into_pyobject(py)?.into_any(),
                    s.lora_name.into_pyobject(py)?.into_any(),
                    raw(s.extra_keys).into_pyobject(py)?.into_any(),
                    s.group_idx.into_pyobject(py)?.into_any(),
                    s.spec_kind.into_pyobject(py)?.into_any(),
                    s.sliding_window.into_pyobject(py)?.into_any(),
                    s.locality.into_pyobject(py)?.into_any(),
                    s.ownership.into_pyobject(py)?.into_any(),
                    s.session_id.into_pyobject(py)?.into_any(),
                    raw(s.lookahead).into_pyobject(py)?.into_any(),
                ];
                PyTuple::new(py, fields)?
            }
            Event::Removed(r) => {
                let fields: Vec<Bound<'py, PyAny>> = vec![
                    layout::REMOVED.into_pyobject(py)?.into_any(),
                    arena.hashes[r.hashes.clone()].into_pyobject(py)?.into_any(),
                    r.medium.into_pyobject(py)?.into_any(),
                    r.group_idx.into_pyobject(py)?.into_any(),
                    r.locality.into_pyobject(py)?.into_any(),
                    r.ownership.into_pyobject(py)?.into_any(),
                ];
                PyTuple::new(py, fields)?
            }
            Event::Cleared => PyTuple::new(py, [layout::CLEARED])?,
        };
        events.push(tuple);
    }
    (batch.ts, batch.dp_rank, batch.unknown_fields, events).into_pyobject(py)
}
