//! `kvbridge._core.NormalizedBatch`: one batch's canonical events, kept as the core wrote them
//! until a view is asked for, and the merge of consecutive batches into few payloads.

use std::sync::OnceLock;

use kvbridge_core::Output;
use pyo3::exceptions::PyValueError;
use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};
use pyo3::PyTraverseError;

use crate::normalizer::RELEASE_GIL_BYTES;

/// The canonical events of one batch, kept as the core wrote them until a view is asked for:
/// `kvbridge.normalizers.batch.NormalizedBatch`, a sequence of `TieredEvent`s built on first
/// use.
#[pyclass(module = "kvbridge._core", name = "NormalizedBatch", frozen, sequence)]
pub(crate) struct PyOutput {
    output: Output,
    worker_id: u64,
    block_size: u64,
    decoder: Py<PyAny>,
    events: OnceLock<Py<PyList>>,
}

impl PyOutput {
    /// The output of a normalizer of `worker_id` and `block_size`, whose events `decoder`
    /// builds.
    pub(crate) fn new(output: Output, worker_id: u64, block_size: u64, decoder: Py<PyAny>) -> Self {
        PyOutput {
            output,
            worker_id,
            block_size,
            decoder,
            events: OnceLock::new(),
        }
    }
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
        // Another thread may have built them meanwhile (a large output's writer runs without
        // the GIL): the first to finish is kept, so that every reader gets the same list.
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
        let write = || self.output.canonical_payloads(self.block_size, ts);
        let payloads = released_if(py, large(&self.output), write);
        PyList::new(py, payloads.iter().map(|payload| PyBytes::new(py, payload)))
    }

    /// The msgpack of `list[TieredEvent]`.
    fn tiered_events<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        let write = || self.output.tiered_events(self.worker_id);
        let bytes = released_if(py, large(&self.output), write);
        PyBytes::new(py, &bytes)
    }
}

/// The canonical payloads of consecutive outputs of one normalizer, each with its engine time,
/// merged into as few batches as fit in about `max_bytes` each (see
/// `kvbridge_core::canonical_payloads`), written with the GIL released if they are large.
#[pyfunction]
pub(crate) fn canonical_payloads<'py>(
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
    let outputs: Vec<(&Output, f64)> = outputs
        .iter()
        .map(|(output, ts)| (&output.get().output, *ts))
        .collect();
    let to_write: usize = outputs.iter().map(|(output, _)| write_size(output)).sum();
    let payloads = released_if(py, to_write >= RELEASE_GIL_BYTES, || {
        kvbridge_core::canonical_payloads(&outputs, block_size, max_bytes)
    });
    PyList::new(py, payloads.iter().map(|payload| PyBytes::new(py, payload)))
}

/// About how many bytes the writers write for `output`: its token bytes, its hashes and each
/// event's own fields (about 48 bytes of keys, tier and ids).
fn write_size(output: &Output) -> usize {
    let hashes = 2 * output.blocks.len() + output.hashes.len();
    output.token_msgpack.len() + 9 * hashes + 48 * output.events.len()
}

/// Whether writing `output` is worth releasing the GIL for: as for a payload
/// ([`RELEASE_GIL_BYTES`]).
fn large(output: &Output) -> bool {
    write_size(output) >= RELEASE_GIL_BYTES
}

/// `work`'s result, computed with the GIL released if `release`.
fn released_if<T: Send>(py: Python<'_>, release: bool, work: impl FnOnce() -> T + Send) -> T {
    if release {
        py.detach(work)
    } else {
        work()
    }
}
