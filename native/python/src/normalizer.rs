//! `kvbridge._core.Normalizer`: one worker's normalizer, its counters and its first drops.

use kvbridge_core::{Action, DropReason, Limits, Normalizer, Output, Tier};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::batch::PyOutput;
use crate::{payload_error, tier_of};

/// One worker's normalizer state.
#[pyclass(module = "kvbridge._core", name = "Normalizer")]
pub(crate) struct PyNormalizer {
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
        let decoder = self.events_decoder.clone_ref(py);
        let (worker_id, block_size) = (self.inner.worker_id, self.inner.block_size as u64);
        Ok(PyOutput::new(output, worker_id, block_size, decoder))
    }
}
