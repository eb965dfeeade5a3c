//! `kvbridge._core.Normalizer`: one worker's normalizer, its counters and its first drops.
//!
//! The state sits behind a mutex of its own rather than PyO3's borrow flag: a payload is
//! normalized with the GIL released when it is large or clears a rank, and a reader on
//! another thread (a metrics scrape) then waits for the state instead of failing to borrow
//! it. The Python face needs no lock of its own, which with its `try`/`finally` cost about as
//! much as the call itself on the small payloads of a busy engine.

use std::sync::{Mutex, MutexGuard, PoisonError, TryLockError};

use kvbridge_core::{Action, DropReason, Limits, Normalizer, Output, SchemaError, Tier};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyList, PyType};

use crate::batch::PyOutput;
use crate::tier_of;

/// Payloads of at least this many bytes are normalized with the GIL released. Releasing it and
/// taking it back costs about 50 ns a call here, which the work on a 1 KiB payload (2-3 us)
/// repays many times over; below that, on the one- or two-block batches of an engine's decode
/// steps, the release is a large share of the call and lets another thread overlap little.
pub(crate) const RELEASE_GIL_BYTES: usize = 1024;

/// The tag of the event whose work grows with the state, not with the payload: a clear of
/// every block of the rank.
const CLEAR_TAG: &[u8] = b"AllBlocksCleared";

/// Whether to normalize `payload` with the GIL released: when it is large, or when its work may
/// be long whatever its size, a clear of the rank first (`reset_first`) or an
/// `AllBlocksCleared` in it (its tag anywhere in the bytes, in whatever string form: a payload
/// that merely looks like one is normalized without the GIL, which costs 50 ns).
fn releases_gil(payload: &[u8], reset_first: bool) -> bool {
    if reset_first || payload.len() >= RELEASE_GIL_BYTES {
        return true;
    }
    let mut rest = payload;
    while let Some(at) = rest.iter().position(|&byte| byte == CLEAR_TAG[0]) {
        if rest[at..].starts_with(CLEAR_TAG) {
            return true;
        }
        rest = &rest[at + 1..];
    }
    false
}

/// One worker's normalizer state.
#[pyclass(module = "kvbridge._core", name = "Normalizer", frozen)]
pub(crate) struct PyNormalizer {
    state: Mutex<Normalizer>,
    worker_id: u64,
    block_size: u64,
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
            worker_id,
            block_size: block_size as u64,
            state: Mutex::new(Normalizer::new(
                worker_id,
                block_size,
                retain_evicted,
                &kinds,
                Limits {
                    max_ranks,
                    max_blocks,
                    max_contexts,
                },
            )),
        })
    }

    /// Normalizes one payload (bytes) and adds the `unknown_fields` that a caller's own
    /// decoder counted in it, with the GIL released if the work may be long
    /// ([`releases_gil`]). Raises `kvbridge.schemas.SchemaError` and changes nothing if the
    /// payload does not decode.
    #[pyo3(signature = (payload, seq=None, reset_first=false, unknown_fields=0))]
    fn process(
        &self,
        py: Python<'_>,
        payload: &[u8],
        seq: Option<u64>,
        reset_first: bool,
        unknown_fields: u64,
    ) -> PyResult<PyOutput> {
        let run = |state: &mut Normalizer| {
            let output = state.normalize(payload, seq, reset_first)?;
            state.counters.unknown_fields += unknown_fields;
            Ok(output)
        };
        let output = if releases_gil(payload, reset_first) {
            self.with_state_released(py, run)
        } else {
            self.with_state(py, run)
        };
        let output = output.map_err(|error| schema_error(py, error))?;
        self.wrap(py, output)
    }

    /// Forgets one rank (or all) and returns the clears that undo it downstream.
    #[pyo3(signature = (dp_rank=None))]
    fn reset(&self, py: Python<'_>, dp_rank: Option<u32>) -> PyResult<PyOutput> {
        let output = self.with_state_released(py, |state| state.reset(dp_rank));
        self.wrap(py, output)
    }

    /// Clears one rank downstream after a loss, keeping its blocks' identities (see
    /// `Normalizer::reset_lost`).
    fn reset_lost(&self, py: Python<'_>, dp_rank: u32) -> PyResult<PyOutput> {
        let output = self.with_state_released(py, |state| state.reset_lost(dp_rank));
        self.wrap(py, output)
    }

    /// A clear of one rank, then a store of every block it holds, tier by tier.
    fn snapshot(&self, py: Python<'_>, dp_rank: u32) -> PyResult<PyOutput> {
        let output = self.with_state_released(py, |state| state.snapshot(dp_rank));
        self.wrap(py, output)
    }

    /// Blocks announced again after a loss, because stores named them as ancestors.
    #[getter]
    fn reanchored_blocks(&self, py: Python<'_>) -> u64 {
        self.with_state(py, |state| state.counters.reanchored_blocks)
    }

    #[getter]
    fn unknown_fields(&self, py: Python<'_>) -> u64 {
        self.with_state(py, |state| state.counters.unknown_fields)
    }

    /// State given up to stay within the limits: (ranks forgotten, blocks evicted, context
    /// table compactions).
    fn evictions(&self, py: Python<'_>) -> (u64, u64, u64) {
        self.with_state(py, |state| {
            let counters = &state.counters;
            (
                counters.evicted_ranks,
                counters.evicted_blocks,
                counters.context_compactions,
            )
        })
    }

    /// Blocks forwarded: (action, tier index, count), non-zero entries only.
    fn forwarded(&self, py: Python<'_>) -> Vec<(&'static str, usize, u64)> {
        let forwarded = self.with_state(py, |state| state.counters.forwarded);
        let mut out = Vec::new();
        for action in [Action::Stored, Action::Removed, Action::Cleared] {
            for tier in Tier::ALL {
                let count = forwarded[action as usize][tier as usize];
                if count > 0 {
                    out.push((action.name(), tier as usize, count));
                }
            }
        }
        out
    }

    /// Blocks not forwarded: (action, tier name or "unknown", reason, count), non-zero only.
    fn dropped(&self, py: Python<'_>) -> Vec<(&'static str, &'static str, &'static str, u64)> {
        let dropped = self.with_state(py, |state| state.counters.dropped);
        let mut out = Vec::new();
        for action in [Action::Stored, Action::Removed] {
            for (tier_index, by_reason) in dropped[action as usize].iter().enumerate() {
                let tier = Tier::ALL
                    .get(tier_index)
                    .map_or("unknown", |tier| tier.name());
                for reason in DropReason::ALL {
                    let count = by_reason[reason as usize];
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
    fn take_first_drops<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        self.publish_first_drops(py)?;
        let pending = self.first_drops.bind(py);
        let taken = PyList::new(py, pending.iter())?;
        // What another thread appended meanwhile (making the list can switch threads) stays.
        pending.del_slice(0, taken.len())?;
        Ok(taken)
    }

    fn dp_ranks(&self, py: Python<'_>) -> Vec<u32> {
        self.with_state(py, |state| state.dp_ranks())
    }

    fn resident_blocks(&self, py: Python<'_>, dp_rank: u32, tier: usize) -> PyResult<usize> {
        let tier = tier_of(tier)?;
        Ok(self.with_state(py, |state| state.resident_blocks(dp_rank, tier)))
    }

    /// (live, retired) engine hashes tracked over every rank.
    fn tracked_blocks(&self, py: Python<'_>) -> (usize, usize) {
        self.with_state(py, |state| state.tracked_blocks())
    }

    /// Bytes of heap the state holds.
    fn heap_bytes(&self, py: Python<'_>) -> usize {
        self.with_state(py, |state| state.heap_bytes())
    }
}

impl PyNormalizer {
    /// Runs `work` on the state: at once if no other thread holds it, else once it is free,
    /// waiting with the GIL released, since the holder may have released the GIL to work.
    ///
    /// No deadlock: a thread holds the state either with the GIL held throughout, or with the
    /// GIL released from before it takes the state until after it lets go of it, so a holder
    /// never waits for the GIL. For that, `work` makes no Python object and runs no Python
    /// code (either could run the garbage collector, and with it any code, which may release
    /// the GIL): every caller copies its answer out as plain Rust values first.
    fn with_state<T: Send>(
        &self,
        py: Python<'_>,
        work: impl FnOnce(&mut Normalizer) -> T + Send,
    ) -> T {
        match self.state.try_lock() {
            Ok(mut state) => work(&mut state),
            Err(TryLockError::Poisoned(poisoned)) => work(&mut poisoned.into_inner()),
            Err(TryLockError::WouldBlock) => py.detach(|| work(&mut lock(&self.state))),
        }
    }

    /// Runs `work` on the state with the GIL released, for work whose time grows with the
    /// state rather than with its input (a rank's clear, a snapshot), or with a large input.
    fn with_state_released<T: Send>(
        &self,
        py: Python<'_>,
        work: impl FnOnce(&mut Normalizer) -> T + Send,
    ) -> T {
        py.detach(|| work(&mut lock(&self.state)))
    }

    /// Moves the core's first drops to the Python list.
    fn publish_first_drops(&self, py: Python<'_>) -> PyResult<()> {
        let drops = self.with_state(py, |state| std::mem::take(&mut state.first_drops));
        if drops.is_empty() {
            return Ok(());
        }
        let list = self.first_drops.bind(py);
        for drop in drops {
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
    fn wrap(&self, py: Python<'_>, output: Output) -> PyResult<PyOutput> {
        self.publish_first_drops(py)?;
        let decoder = self.events_decoder.clone_ref(py);
        Ok(PyOutput::new(
            output,
            self.worker_id,
            self.block_size,
            decoder,
        ))
    }
}

/// The state, even if a thread panicked while holding it. That call raised PyO3's
/// `PanicException` (no panic is known; the fuzz targets look for one); a poisoned lock would
/// turn it into the failure of every later call as well.
fn lock(state: &Mutex<Normalizer>) -> MutexGuard<'_, Normalizer> {
    state.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A payload the core cannot decode, as the Python face's `SchemaError`.
fn schema_error(py: Python<'_>, error: SchemaError) -> PyErr {
    static SCHEMA_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();
    let made = SCHEMA_ERROR
        .import(py, "kvbridge.schemas.errors", "SchemaError")
        .and_then(|class| {
            let keywords = PyDict::new(py);
            keywords.set_item("event_index", error.event_index)?;
            keywords.set_item("field", error.field)?;
            class.call((error.message,), Some(&keywords))
        });
    match made {
        Ok(value) => PyErr::from_value(value),
        Err(failure) => failure,
    }
}
