//! Tasks: `submit`, streaming generator tasks (`submit_streaming`, `next_item`,
//! `generator_ready`, `drop_stream`) and cancellation (`cancel`, `cancel_task`,
//! `is_cancelled`).

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use tpuray::raw;

use crate::errors::{cancel_err, cluster_err, options_err};
use crate::objects::{PyRef, wrap};
use crate::options::{args_from, task_options};

/// Submits a task of `function` (a function-table key); returns its return refs.
#[pyfunction]
fn submit(
    py: Python<'_>,
    function: String,
    args: &Bound<'_, PyList>,
    options: &Bound<'_, PyDict>,
) -> PyResult<Vec<PyRef>> {
    let args = args_from(args)?;
    let opts = task_options(options)?;
    let refs = py.detach(|| raw::submit(&function, args, &opts)).map_err(options_err)?;
    Ok(refs.into_iter().map(wrap).collect())
}

/// Submits a streaming generator task (`num_returns="streaming"`); returns its task id.
#[pyfunction]
fn submit_streaming(
    py: Python<'_>,
    function: String,
    args: &Bound<'_, PyList>,
    options: &Bound<'_, PyDict>,
) -> PyResult<String> {
    let args = args_from(args)?;
    let opts = task_options(options)?;
    py.detach(|| raw::submit_streaming(&function, args, &opts)).map_err(cluster_err)
}

/// Whether streaming task `task_id` has an item after its first `index`, or ended
/// (`wait` on an `ObjectRefGenerator`). Does not block.
#[pyfunction]
fn generator_ready(task_id: String, index: u64) -> bool {
    raw::generator_ready(&task_id, index)
}

/// Cancels streaming task `task_id` (an `ObjectRefGenerator`'s), as [`cancel`].
#[pyfunction]
fn cancel_task(py: Python<'_>, task_id: String, force: bool, recursive: bool) -> PyResult<()> {
    py.detach(|| raw::cancel_task(&task_id, force, recursive)).map_err(cancel_err)
}

/// Whether the task running on this thread (or task `task_id`, running in this
/// process) was cancelled (Ray's `RuntimeContext.is_canceled`).
#[pyfunction]
#[pyo3(signature = (task_id=None))]
fn is_cancelled(task_id: Option<String>) -> bool {
    raw::is_cancelled(task_id.as_deref())
}

/// The `index`-th item of a streaming task as a ref: `None` after the last. A failure of
/// the task is one more item, a ref whose `get` raises it (Ray 2.60's streaming
/// generators). Blocks without the GIL.
#[pyfunction]
fn next_item(py: Python<'_>, task_id: String, name: String, index: u64) -> Option<PyRef> {
    py.detach(|| raw::next_item_ref(&task_id, &name, index)).map(wrap)
}

/// Forgets a streaming task once its consumer took `consumed` items.
#[pyfunction]
fn drop_stream(task_id: String, consumed: u64) {
    raw::drop_stream(&task_id, consumed);
}

/// Cancels the task that makes `r` (Ray's `cancel`: `force` kills its worker,
/// `recursive` cancels what it submitted). Raises `ValueError` for `force` on an actor
/// call.
#[pyfunction]
#[pyo3(signature = (r, force, recursive=true))]
fn cancel(py: Python<'_>, r: Bound<'_, PyRef>, force: bool, recursive: bool) -> PyResult<()> {
    let raw = r.get().inner.clone();
    py.detach(|| raw::cancel(&raw, force, recursive)).map_err(cancel_err)
}

/// Adds this module's functions and classes to the extension module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(submit, m)?)?;
    m.add_function(wrap_pyfunction!(submit_streaming, m)?)?;
    m.add_function(wrap_pyfunction!(generator_ready, m)?)?;
    m.add_function(wrap_pyfunction!(cancel_task, m)?)?;
    m.add_function(wrap_pyfunction!(is_cancelled, m)?)?;
    m.add_function(wrap_pyfunction!(next_item, m)?)?;
    m.add_function(wrap_pyfunction!(drop_stream, m)?)?;
    m.add_function(wrap_pyfunction!(cancel, m)?)?;
    Ok(())
}
