//! `kvbridge._core`: the Python face of `kvbridge-core`.
//!
//! A batch crosses as bytes in both directions: the payload in, and out either the relay's
//! canonical payloads or the msgpack of `TieredEvent`s that msgspec builds in one pass. The GIL
//! is released while the core works, and no Python object is made per event, block or token.

mod huge_pages;

use kvbridge_core::decode::{Arena, Event};
use kvbridge_core::msgpack::MAX_DEPTH;
use kvbridge_core::{decode, Action, DropReason, Limits, Normalizer, Output, SchemaError, Tier};
use kvbridge_core::{hashing, layout};
use pyo3::buffer::PyBuffer;
use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};
use pyo3::PyTraverseError;
use std::sync::OnceLock;

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

/// One worker's normalizer state.
#[pyclass(module = "kvbridge._core", name = "Normalizer")]
struct PyNormalizer {
    inner: Normalizer,
    /// Reasons dropped for the first time, appended as they happen: a list Python can test
    /// for emptiness without a call.
    first_drops: Py<PyList>,
    /// What turns [`Output::tiered_events`] bytes into `list[TieredEvent]` (msgspec's
    /// `Decoder.decode`, given by the Python face), shared by every output.
    events_decoder: Py<PyAny>,
}

#[pymethods]
impl PyNormalizer {
    #[new]
    #[pyo3(signature = (worker_id, block_size, retain_evicted, main_kinds, max_ranks, max_blocks, max_contexts, events_decoder))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        worker_id: u64,
        block_size: usize,
        retain_evicted: usize,
        main_kinds: Vec<String>,
        max_ranks: usize,
        max_blocks: usize,
        max_contexts: usize,
        events_decoder: Py<PyAny>,
    ) -> PyResult<Self> {
        if block_size == 0 {
            return Err(PyValueError::new_err("block_size must be positive"));
        }
        let kinds: Vec<&str> = main_kinds.iter().map(String::as_str).collect();
        Ok(PyNormalizer {
            first_drops: PyList::empty(py).unbind(),
            events_decoder,
            inner: Normalizer::new(
                worker_id,
                block_size,
                retain_evicted,
                &kinds,
                Limits {
                    max_ranks,
                    max_blocks,
                    max_contexts,
                },
            ),
        })
    }

    /// Normalizes one payload (bytes) with the GIL released. Raises `PayloadError`.
    #[pyo3(signature = (payload, seq=None, reset_first=false))]
    fn normalize(
        &mut self,
        py: Python<'_>,
        payload: &[u8],
        seq: Option<u64>,
        reset_first: bool,
    ) -> PyResult<PyOutput> {
        let inner = &mut self.inner;
        let output = py
            .detach(|| inner.normalize(payload, seq, reset_first))
            .map_err(payload_error)?;
        self.wrap(py, output)
    }

    /// Forgets one rank (or all) and returns the clears that undo it downstream.
    #[pyo3(signature = (dp_rank=None))]
    fn reset(&mut self, py: Python<'_>, dp_rank: Option<u32>) -> PyResult<PyOutput> {
        let output = self.inner.reset(dp_rank);
        self.wrap(py, output)
    }

    /// Clears one rank downstream after a loss, keeping its blocks' identities (see
    /// `Normalizer::reset_lost`).
    fn reset_lost(&mut self, py: Python<'_>, dp_rank: u32) -> PyResult<PyOutput> {
        let output = self.inner.reset_lost(dp_rank);
        self.wrap(py, output)
    }

    /// A clear of one rank, then a store of every block it holds, tier by tier.
    fn snapshot(&mut self, py: Python<'_>, dp_rank: u32) -> PyResult<PyOutput> {
        let output = self.inner.snapshot(dp_rank);
        self.wrap(py, output)
    }

    /// Blocks announced again after a loss, because stores named them as ancestors.
    #[getter]
    fn reanchored_blocks(&self) -> u64 {
        self.inner.counters.reanchored_blocks
    }

    /// Adds unknown fields a caller's own decoder counted.
    fn add_unknown_fields(&mut self, count: u64) {
        self.inner.counters.unknown_fields += count;
    }

    #[getter]
    fn unknown_fields(&self) -> u64 {
        self.inner.counters.unknown_fields
    }

    /// State given up to stay within the limits: (ranks forgotten, blocks evicted, context
    /// table compactions).
    fn evictions(&self) -> (u64, u64, u64) {
        let counters = &self.inner.counters;
        (
            counters.evicted_ranks,
            counters.evicted_blocks,
            counters.context_compactions,
        )
    }

    /// Blocks forwarded: (action, tier index, count), non-zero entries only.
    fn forwarded(&self) -> Vec<(&'static str, usize, u64)> {
        let mut out = Vec::new();
        for action in [Action::Stored, Action::Removed, Action::Cleared] {
            for tier in Tier::ALL {
                let count = self.inner.counters.forwarded[action as usize][tier as usize];
                if count > 0 {
                    out.push((action.name(), tier as usize, count));
                }
            }
        }
        out
    }

    /// Blocks not forwarded: (action, tier name or "unknown", reason, count), non-zero only.
    fn dropped(&self) -> Vec<(&'static str, &'static str, &'static str, u64)> {
        let mut out = Vec::new();
        for action in [Action::Stored, Action::Removed] {
            for tier_index in 0..5 {
                let tier = if tier_index == 4 {
                    "unknown"
                } else {
                    Tier::ALL[tier_index].name()
                };
                for reason in DropReason::ALL {
                    let count =
                        self.inner.counters.dropped[action as usize][tier_index][reason as usize];
                    if count > 0 {
                        out.push((action.name(), tier, reason.name(), count));
                    }
                }
            }
        }
        out
    }

    /// Reasons dropped for the first time and not yet taken, as they happen: (reason, action,
    /// tier, medium) tuples. The same list every time; empty while there is nothing to log.
    #[getter]
    fn first_drops(&self, py: Python<'_>) -> Py<PyList> {
        self.first_drops.clone_ref(py)
    }

    /// Reasons dropped for the first time since the last call: (reason, action, tier, medium).
    fn take_first_drops<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        self.publish_first_drops(py)?;
        let pending = self.first_drops.bind(py);
        let taken = PyList::new(py, pending.iter())?;
        pending.del_slice(0, pending.len())?;
        Ok(taken)
    }

    fn dp_ranks(&self) -> Vec<u32> {
        self.inner.dp_ranks()
    }

    fn resident_blocks(&self, dp_rank: u32, tier: usize) -> PyResult<usize> {
        Ok(self.inner.resident_blocks(dp_rank, tier_of(tier)?))
    }

    /// (live, retired) engine hashes tracked over every rank.
    fn tracked_blocks(&self) -> (usize, usize) {
        self.inner.tracked_blocks()
    }

    /// Bytes of heap the state holds.
    fn heap_bytes(&self) -> usize {
        self.inner.heap_bytes()
    }
}

impl PyNormalizer {
    /// Moves the core's first drops to the Python list.
    fn publish_first_drops(&mut self, py: Python<'_>) -> PyResult<()> {
        if self.inner.first_drops.is_empty() {
            return Ok(());
        }
        let list = self.first_drops.bind(py);
        for drop in self.inner.first_drops.drain(..) {
            list.append((
                drop.reason.name(),
                drop.action.name(),
                drop.tier.map(Tier::name),
                drop.medium,
            ))?;
        }
        Ok(())
    }

    /// The Python face of an output, once the drops it recorded first are published.
    fn wrap(&mut self, py: Python<'_>, output: Output) -> PyResult<PyOutput> {
        self.publish_first_drops(py)?;
        Ok(PyOutput {
            output,
            worker_id: self.inner.worker_id,
            block_size: self.inner.block_size as u64,
            decoder: self.events_decoder.clone_ref(py),
            events: OnceLock::new(),
        })
    }
}

/// The canonical events of one batch, kept as the core wrote them until a view is asked for:
/// `kvbridge.normalizers.batch.NormalizedBatch`, a sequence of `TieredEvent`s built on first
/// use.
#[pyclass(module = "kvbridge._core", name = "NormalizedBatch", frozen, sequence)]
struct PyOutput {
    output: Output,
    worker_id: u64,
    block_size: u64,
    decoder: Py<PyAny>,
    events: OnceLock<Py<PyList>>,
}

#[pymethods]
impl PyOutput {
    fn __len__(&self) -> usize {
        self.output.events.len()
    }

    /// The decoder and the events are the only Python objects a batch holds. Neither is
    /// cleared here: the events list is mutable and clears itself, which breaks any cycle
    /// through it (a caller appending the batch to its own events, say).
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.decoder)?;
        if let Some(events) = self.events.get() {
            visit.call(events)?;
        }
        Ok(())
    }

    /// The events as `TieredEvent` values, built in one msgspec pass on first use.
    #[getter]
    fn events<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        if let Some(events) = self.events.get() {
            return Ok(events.bind(py).clone());
        }
        let events = self.decoder.call1(py, (self.tiered_events(py),))?;
        let events = events.extract::<Py<PyList>>(py).map_err(PyErr::from)?;
        // Another thread may have built them meanwhile (the writer runs without the GIL):
        // the first to finish is kept, so that every reader gets the same list.
        Ok(self.events.get_or_init(|| events).bind(py).clone())
    }

    fn __getitem__<'py>(
        &self,
        py: Python<'py>,
        index: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.events(py)?.as_any().get_item(index)
    }

    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        Ok(self.events(py)?.as_any().try_iter()?.into_any())
    }

    fn __reversed__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.events(py)?.as_any().call_method0("__reversed__")
    }

    fn __contains__(&self, py: Python<'_>, value: &Bound<'_, PyAny>) -> PyResult<bool> {
        self.events(py)?.contains(value)
    }

    /// The index of the first event equal to `value`, as `list.index` (its bounds too).
    #[pyo3(signature = (value, *args))]
    fn index<'py>(
        &self,
        py: Python<'py>,
        value: &Bound<'py, PyAny>,
        args: &Bound<'py, PyTuple>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let mut call = vec![value.clone()];
        call.extend(args.iter());
        self.events(py)?
            .as_any()
            .call_method1("index", PyTuple::new(py, call)?)
    }

    /// How many events equal `value`, as `list.count`.
    fn count<'py>(
        &self,
        py: Python<'py>,
        value: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.events(py)?.as_any().call_method1("count", (value,))
    }

    /// The input batch's engine time, or `None` for a reset.
    #[getter]
    fn ts(&self) -> Option<f64> {
        self.output.batch.map(|(ts, _)| ts)
    }

    /// The input batch's dp rank (0 when it names none), or `None` for a reset.
    #[getter]
    fn dp_rank(&self) -> Option<u32> {
        self.output.batch.map(|(_, rank)| rank)
    }

    /// The relay's canonical vLLM payloads, one per dp-rank run.
    fn canonical_payloads<'py>(&self, py: Python<'py>, ts: f64) -> PyResult<Bound<'py, PyList>> {
        let payloads = py.detach(|| self.output.canonical_payloads(self.block_size, ts));
        PyList::new(py, payloads.iter().map(|payload| PyBytes::new(py, payload)))
    }

    /// The msgpack of `list[TieredEvent]`.
    fn tiered_events<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        let bytes = py.detach(|| self.output.tiered_events(self.worker_id));
        PyBytes::new(py, &bytes)
    }
}

/// The canonical payloads of consecutive outputs of one normalizer, each with its engine time,
/// merged into as few batches as fit in about `max_bytes` each (see
/// `kvbridge_core::canonical_payloads`), written with the GIL released.
#[pyfunction]
fn canonical_payloads<'py>(
    py: Python<'py>,
    outputs: Vec<(Py<PyOutput>, f64)>,
    max_bytes: usize,
) -> PyResult<Bound<'py, PyList>> {
    let Some((first, _)) = outputs.first() else {
        return Ok(PyList::empty(py));
    };
    let block_size = first.get().block_size;
    if outputs
        .iter()
        .any(|(output, _)| output.get().block_size != block_size)
    {
        return Err(PyValueError::new_err(
            "outputs of normalizers with different block sizes",
        ));
    }
    let payloads = py.detach(|| {
        let outputs: Vec<(&Output, f64)> = outputs
            .iter()
            .map(|(output, ts)| (&output.get().output, *ts))
            .collect();
        kvbridge_core::canonical_payloads(&outputs, block_size, max_bytes)
    });
    PyList::new(py, payloads.iter().map(|payload| PyBytes::new(py, payload)))
}

/// Dynamo's `tokens_hash` of each full block of `packed` (token ids as little-endian u32 in a
/// bytes-like object of format `B`), as u64; `mm_hashes[i]` are block `i`'s multimodal object
/// hashes. A block size of 0 is refused.
#[pyfunction]
#[pyo3(signature = (packed, block_size, seed, mm_hashes = Vec::new()))]
fn tokens_hashes(
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
fn sequence_hashes(tokens_hashes: Vec<u64>, parent: Option<u64>) -> Vec<u64> {
    hashing::sequence_hashes(&tokens_hashes, parent)
}

/// A prompt in the form Dynamo's router takes precomputed: the `tokens_hash` and the sequence
/// hash of each full block of `packed` (as [`tokens_hashes`] reads it), both as the signed
/// i64 values Dynamo's Python binding takes. The GIL stays held: hashing an 8k-token prompt
/// takes a few microseconds, less than handing the GIL over and back can cost.
#[pyfunction]
fn prompt_hashes(
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
fn block_seed(lora_name: Option<&str>, cache_salt: Option<&str>) -> u64 {
    hashing::block_seed(lora_name, cache_salt)
}

/// The core's decoding of a payload, as plain values, for differential tests against the
/// msgspec decoder: `(ts, dp_rank, unknown_fields, events)`, each event a tuple of its tag and
/// its fields in layout order (hashes as u64, extra keys as msgpack bytes).
#[pyfunction]
fn decode_view<'py>(py: Python<'py>, payload: &[u8]) -> PyResult<Bound<'py, PyTuple>> {
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

#[pymodule]
fn _core(module: &Bound<'_, PyModule>) -> PyResult<()> {
    module.add_class::<PyNormalizer>()?;
    module.add_class::<PyOutput>()?;
    module.add_function(wrap_pyfunction!(decode_view, module)?)?;
    module.add_function(wrap_pyfunction!(canonical_payloads, module)?)?;
    module.add_function(wrap_pyfunction!(tokens_hashes, module)?)?;
    module.add_function(wrap_pyfunction!(sequence_hashes, module)?)?;
    module.add_function(wrap_pyfunction!(prompt_hashes, module)?)?;
    module.add_function(wrap_pyfunction!(block_seed, module)?)?;
    module.add("PayloadError", module.py().get_type::<PayloadError>())?;
    module.add("STORED_FIELDS", layout::STORED_FIELDS.to_vec())?;
    module.add("REMOVED_FIELDS", layout::REMOVED_FIELDS.to_vec())?;
    module.add("STORED_REQUIRED", layout::STORED_REQUIRED)?;
    module.add("REMOVED_REQUIRED", layout::REMOVED_REQUIRED)?;
    module.add("STORED_ARRAY_FIELDS", layout::STORED_ARRAY_FIELDS)?;
    module.add("REMOVED_ARRAY_FIELDS", layout::REMOVED_ARRAY_FIELDS)?;
    module.add("MAX_DEPTH", MAX_DEPTH)?;
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
