//! `tpuray._tpuray`: the Python extension module. It exposes the command line
//! ([`tpuray_cli::run`]) and the Rust core worker through `tpuray::raw` (DESIGN.md §1: one
//! implementation, no second core in Python). The Python package (`python/tpuray`) builds
//! Ray's API on these calls; values cross as bytes that Python pickles itself, and
//! objects of the node's store come back as read-only mappings ([`ObjectBuffer`]), so
//! large buffers (numpy arrays) are read without a copy.
//!
//! `jobs.rs`: the Jobs REST API client behind `tpuray.job_submission` (the CLI's
//! `tpuray_cli::job`).
//!
//! Blocking calls release the GIL. In a worker process, [`run_worker`] installs a
//! [`tpuray::foreign::ForeignRuntime`] that calls back into the Python runtime object for
//! every task, actor constructor and method call.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::Write;
use std::sync::mpsc::{SyncSender, sync_channel};
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};
use tpuray::error::TaskFailure;
use tpuray::foreign::{AsyncDone, ForeignReturn, ForeignRuntime, ForeignStream, TaskInfo};
use tpuray::raw::{self, Arg, RawRef};
use tpuray::{ActorHandle, ActorOptions, Error, Scheduling, TaskOptions};

mod jobs;

/// mimalloc for the extension's own allocations (Python objects keep Python's allocator):
/// the core worker, and the head and node agents that `tpuray start` runs in this
/// process, allocate and free many small strings per task across threads, where glibc's
/// malloc cost a fifth of a driver's CPU (as for the `tpuray` binary, `cli/src/main.rs`).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Runs the tpuray CLI with `argv` (program name first) and returns its exit
/// code. The GIL is released while it runs: `start --block`, `_head`,
/// `_agent` and `_worker` run for as long as the process lives.
#[pyfunction]
fn run(py: Python<'_>, argv: Vec<String>) -> i32 {
    py.detach(move || tpuray_cli::run(argv))
}

/// An object reference as the core holds it: id and owner address. Dropping the last
/// Python reference releases it (CORE-2).
#[pyclass(name = "RefCore", module = "tpuray._tpuray", frozen)]
struct PyRef {
    inner: RawRef,
}

#[pymethods]
impl PyRef {
    /// The object id (32 hex characters).
    fn id(&self) -> &str {
        self.inner.id()
    }
    /// The owner's address (`host:port`).
    fn owner(&self) -> &str {
        self.inner.owner()
    }
}

fn wrap(r: RawRef) -> PyRef {
    PyRef { inner: r }
}

fn cluster_err(e: Error) -> PyErr {
    PyRuntimeError::new_err(e.to_string())
}

/// Bad task options (a chip or GPU count, a bundle index, a label selector) are Python
/// `ValueError`s, as on Ray; anything else as [`cluster_err`].
fn options_err(e: Error) -> PyErr {
    match e {
        Error::Cluster(m) if m.starts_with("task options:") || m.starts_with("label_selector:") => {
            PyValueError::new_err(m)
        }
        e => cluster_err(e),
    }
}

/// Arguments from Python: `("v", bytes, [RefCore...])` values with their nested refs, or
/// `("r", RefCore)` top-level refs the executor resolves.
fn args_from(items: &Bound<'_, PyList>) -> PyResult<Vec<Arg>> {
    let mut out = Vec::with_capacity(items.len());
    for item in items.iter() {
        let t = item.cast::<PyTuple>()?;
        let tag: String = t.get_item(0)?.extract()?;
        match tag.as_str() {
            "v" => {
                let bytes: Vec<u8> = t.get_item(1)?.extract()?;
                let nested: Vec<Bound<'_, PyRef>> = t.get_item(2)?.extract()?;
                out.push(Arg::Value(bytes, nested.iter().map(|r| r.get().inner.clone()).collect()));
            }
            "r" => {
                let r: Bound<'_, PyRef> = t.get_item(1)?.extract()?;
                out.push(Arg::Ref(r.get().inner.clone()));
            }
            _ => return Err(PyValueError::new_err(format!("unknown argument tag {tag:?}"))),
        }
    }
    Ok(out)
}

/// A scheduling strategy from Python: `None`, `"DEFAULT"`, `"SPREAD"`, `("node", id,
/// soft)` or `("pg", id, bundle_index)`.
fn scheduling_from(v: Option<&Bound<'_, PyAny>>) -> PyResult<Scheduling> {
    let Some(v) = v.filter(|v| !v.is_none()) else { return Ok(Scheduling::Default) };
    if let Ok(s) = v.extract::<String>() {
        return match s.to_ascii_uppercase().as_str() {
            "DEFAULT" => Ok(Scheduling::Default),
            "SPREAD" => Ok(Scheduling::Spread),
            _ => Err(PyValueError::new_err(format!(
                "scheduling_strategy {s:?} is not known (expected \"DEFAULT\", \"SPREAD\", or a strategy object)"
            ))),
        };
    }
    let t = v.cast::<PyTuple>()?;
    let kind: String = t.get_item(0)?.extract()?;
    match kind.as_str() {
        "node" => Ok(Scheduling::NodeAffinity {
            node_id: t.get_item(1)?.extract()?,
            soft: t.get_item(2)?.extract()?,
        }),
        "pg" => Ok(Scheduling::PlacementGroup {
            placement_group_id: t.get_item(1)?.extract()?,
            bundle_index: t.get_item(2)?.extract()?,
        }),
        _ => Err(PyValueError::new_err(format!("unknown scheduling strategy kind {kind:?}"))),
    }
}

fn get_opt<'py, T: FromPyObjectOwned<'py>>(d: &Bound<'py, PyDict>, k: &str) -> PyResult<Option<T>> {
    match d.get_item(k)? {
        Some(v) if !v.is_none() => Ok(Some(v.extract().map_err(Into::into)?)),
        _ => Ok(None),
    }
}

fn task_options(d: &Bound<'_, PyDict>) -> PyResult<TaskOptions> {
    let mut o = TaskOptions::default();
    if let Some(v) = get_opt::<f64>(d, "num_cpus")? {
        o.num_cpus = v;
    }
    if let Some(v) = get_opt::<f64>(d, "num_gpus")? {
        o.num_gpus = v;
    }
    if let Some(v) = get_opt::<BTreeMap<String, f64>>(d, "resources")? {
        o.resources = v;
    }
    if let Some(v) = get_opt::<i32>(d, "max_retries")? {
        o.max_retries = v;
    }
    if let Some(v) = get_opt::<bool>(d, "retry_exceptions")? {
        o.retry_exceptions = v;
    }
    if let Some(v) = get_opt::<u32>(d, "num_returns")? {
        o.num_returns = v;
    }
    if let Some(v) = get_opt::<String>(d, "name")? {
        o.name = Some(v);
    }
    if let Some(v) = get_opt::<BTreeMap<String, String>>(d, "label_selector")? {
        o.label_selector = v;
    }
    o.runtime_env_hash = get_opt(d, "runtime_env_hash")?.unwrap_or_default();
    o.scheduling = scheduling_from(d.get_item("scheduling")?.as_ref())?;
    o.max_calls = get_opt(d, "max_calls")?.unwrap_or(0);
    o.capture_child_tasks = get_opt(d, "capture_child_tasks")?.unwrap_or(false);
    Ok(o)
}

fn actor_options(d: &Bound<'_, PyDict>) -> PyResult<ActorOptions> {
    let mut o = ActorOptions { num_cpus: get_opt(d, "num_cpus")?, ..Default::default() };
    if let Some(v) = get_opt::<f64>(d, "num_gpus")? {
        o.num_gpus = v;
    }
    if let Some(v) = get_opt::<BTreeMap<String, f64>>(d, "resources")? {
        o.resources = v;
    }
    o.name = get_opt(d, "name")?;
    o.namespace = get_opt(d, "namespace")?;
    o.detached = get_opt(d, "detached")?.unwrap_or(false);
    o.max_restarts = get_opt(d, "max_restarts")?.unwrap_or(0);
    o.max_concurrency = get_opt(d, "max_concurrency")?.unwrap_or(1);
    o.get_if_exists = get_opt(d, "get_if_exists")?.unwrap_or(false);
    o.runtime_env_hash = get_opt(d, "runtime_env_hash")?.unwrap_or_default();
    if let Some(v) = get_opt::<BTreeMap<String, String>>(d, "label_selector")? {
        o.label_selector = v;
    }
    o.scheduling = scheduling_from(d.get_item("scheduling")?.as_ref())?;
    o.max_pending_calls = get_opt(d, "max_pending_calls")?.unwrap_or(-1);
    o.concurrency_groups = get_opt(d, "concurrency_groups")?.unwrap_or_default();
    o.method_groups = get_opt(d, "method_groups")?.unwrap_or_default();
    o.capture_child_tasks = get_opt(d, "capture_child_tasks")?.unwrap_or(false);
    Ok(o)
}

/// A submission error as Python raises it: `PendingCallsLimitExceeded` (from
/// `tpuray.exceptions`) for a call over the actor's `max_pending_calls`, else as
/// [`cluster_err`].
fn call_err(py: Python<'_>, e: Error) -> PyErr {
    if let Error::PendingCallsLimitExceeded { message, .. } = &e {
        let cls = py
            .import("tpuray.exceptions")
            .and_then(|m| m.getattr("PendingCallsLimitExceeded"))
            .and_then(|c| c.call1((message.clone(),)));
        return match cls {
            Ok(v) => PyErr::from_value(v),
            Err(err) => err,
        };
    }
    cluster_err(e)
}

/// Joins the cluster as a Python driver (no binary upload: workers are Python processes).
/// Returns this process's identity as a dict.
#[pyfunction]
#[pyo3(signature = (address=None, namespace=None, registry_dir=None))]
fn init_driver(
    py: Python<'_>,
    address: Option<String>,
    namespace: Option<String>,
    registry_dir: Option<std::path::PathBuf>,
) -> PyResult<Py<PyDict>> {
    tpuray::foreign::set_language("python").map_err(PyRuntimeError::new_err)?;
    py.detach(|| {
        tpuray::init_with(
            address.as_deref(),
            &tpuray::DriverOptions { upload_binary: false, namespace, registry_dir },
        )
    })
    .map_err(cluster_err)?;
    process_info(py)
}

/// TPU.md's slice arithmetic (`tpuray_scheduler::tpu`, the one implementation): from
/// an accelerator type (`"tpu7x-16"`), or from a topology and a version (`"2x2x2"`,
/// `"v7x"`), returns `(normalised type, chips, hosts, chips per host)`, e.g.
/// `("v7x-16", 8, 2, 4)`. Raises `ValueError` naming what is wrong.
#[pyfunction]
#[pyo3(signature = (accelerator_type=None, topology=None, version=None))]
fn tpu_slice_shape(
    accelerator_type: Option<String>,
    topology: Option<String>,
    version: Option<String>,
) -> PyResult<(String, u32, u32, u32)> {
    use tpuray_scheduler::tpu::AcceleratorType;
    let ty = match (accelerator_type, topology, version) {
        (Some(t), None, None) => AcceleratorType::parse(&t),
        (None, Some(topo), Some(v)) => AcceleratorType::from_topology(&topo, &v),
        _ => {
            return Err(pyo3::exceptions::PyValueError::new_err(
                "tpu_slice_shape takes an accelerator type, or a topology and a version",
            ));
        }
    }
    .map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))?;
    Ok((ty.to_string(), ty.chips, ty.hosts(), ty.chips_per_host()))
}

/// This process's identity: job_id, node_id, worker_id, address, agent_address,
/// head_address.
#[pyfunction]
fn process_info(py: Python<'_>) -> PyResult<Py<PyDict>> {
    let i = raw::process_info().map_err(cluster_err)?;
    let d = PyDict::new(py);
    d.set_item("job_id", i.job_id)?;
    d.set_item("node_id", i.node_id)?;
    d.set_item("worker_id", i.worker_id)?;
    d.set_item("address", i.address)?;
    d.set_item("agent_address", i.agent_address)?;
    d.set_item("head_address", i.head_address)?;
    Ok(d.unbind())
}

/// The head's dashboard, `http://HOST:PORT` (`""` when it serves none).
#[pyfunction]
fn dashboard_url(py: Python<'_>) -> PyResult<String> {
    py.detach(raw::dashboard_url).map_err(cluster_err)
}

#[pyfunction]
fn is_initialized() -> bool {
    raw::is_initialized()
}

/// Finishes the job (its non-detached actors and groups end with it).
#[pyfunction]
fn shutdown(py: Python<'_>) {
    py.detach(tpuray::shutdown);
}

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

/// Creates an actor of `class_key` (a function-table key) shown as `display`; returns
/// `(actor_id, name)`.
#[pyfunction]
fn create_actor(
    py: Python<'_>,
    class_key: String,
    display: String,
    args: &Bound<'_, PyList>,
    options: &Bound<'_, PyDict>,
) -> PyResult<(String, String)> {
    let args = args_from(args)?;
    let opts = actor_options(options)?;
    let h =
        py.detach(|| raw::create_actor(&class_key, &display, args, &opts)).map_err(cluster_err)?;
    Ok((h.actor_id, h.name))
}

/// Calls `method` on actor `actor_id` (class shown as `display`); returns its refs.
/// `concurrency_group` ("": the method's), `retry_exceptions` (retry when the method
/// raises, up to `max_task_retries`), `max_pending_calls` (-1: no limit) as Ray's.
///
/// Raises `PendingCallsLimitExceeded` when this process has `max_pending_calls`
/// unfinished calls to the actor.
#[pyfunction]
#[pyo3(signature = (actor_id, display, method, args, num_returns, max_task_retries=0, concurrency_group=String::new(), retry_exceptions=false, max_pending_calls=-1))]
#[allow(clippy::too_many_arguments)]
fn call_actor(
    py: Python<'_>,
    actor_id: String,
    display: String,
    method: String,
    args: &Bound<'_, PyList>,
    num_returns: u32,
    max_task_retries: i32,
    concurrency_group: String,
    retry_exceptions: bool,
    max_pending_calls: i32,
) -> PyResult<Vec<PyRef>> {
    let args = args_from(args)?;
    let h = ActorHandle {
        actor_id,
        class: display,
        name: String::new(),
        max_task_retries,
        max_pending_calls,
    };
    let call = tpuray::CallOptions {
        concurrency_group,
        max_task_retries: Some(max_task_retries),
        retry_exceptions,
    };
    let refs = py
        .detach(|| raw::call_actor(&h, &method, args, num_returns, &call))
        .map_err(|e| call_err(py, e))?;
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

/// Calls a streaming actor method; returns its task id. Options as [`call_actor`]'s.
#[pyfunction]
#[pyo3(signature = (actor_id, display, method, args, concurrency_group=String::new(), max_pending_calls=-1))]
fn call_actor_streaming(
    py: Python<'_>,
    actor_id: String,
    display: String,
    method: String,
    args: &Bound<'_, PyList>,
    concurrency_group: String,
    max_pending_calls: i32,
) -> PyResult<String> {
    let args = args_from(args)?;
    let h = ActorHandle {
        actor_id,
        class: display,
        name: String::new(),
        max_task_retries: 0,
        max_pending_calls,
    };
    let call = tpuray::CallOptions { concurrency_group, ..Default::default() };
    py.detach(|| raw::call_actor_streaming_with(&h, &method, args, &call))
        .map_err(|e| call_err(py, e))
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

/// A refused cancel as Python raises it: `force` for an actor call is Ray's
/// `ValueError`.
fn cancel_err(e: Error) -> PyErr {
    match &e {
        Error::Cluster(m) if m.starts_with("force=True is not supported") => {
            PyValueError::new_err(m.clone())
        }
        _ => cluster_err(e),
    }
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

/// The kind of an error as Python's exception mapping names it.
fn error_tuple(py: Python<'_>, e: Error) -> PyResult<Py<PyAny>> {
    let (kind, message, payload, function, node, pid) = match e {
        Error::Task { function, message, node, pid, payload } => {
            ("task", message, payload, function, node, pid)
        }
        Error::WorkerDied { function, message } => {
            ("worker_died", message, vec![], function, String::new(), 0)
        }
        Error::NodeDied { function, message } => {
            ("node_died", message, vec![], function, String::new(), 0)
        }
        Error::ActorDied { actor, message } => {
            ("actor_died", message, vec![], actor, String::new(), 0)
        }
        Error::ActorUnavailable { actor, message } => {
            ("actor_unavailable", message, vec![], actor, String::new(), 0)
        }
        Error::Cancelled { function } => {
            ("cancelled", String::new(), vec![], function, String::new(), 0)
        }
        Error::PendingCallsLimitExceeded { function, message } => {
            ("pending_calls", message, vec![], function, String::new(), 0)
        }
        Error::Timeout(d, n) => (
            "timeout",
            format!("timed out after {:.3}s waiting for {n} object(s)", d.as_secs_f64()),
            vec![],
            String::new(),
            String::new(),
            0,
        ),
        Error::ObjectLost { id, message } => ("object_lost", message, vec![], id, String::new(), 0),
        Error::Infeasible(m) => ("infeasible", m, vec![], String::new(), String::new(), 0),
        Error::RuntimeEnvSetup { function, message } => {
            ("runtime_env_setup", message, vec![], function, String::new(), 0)
        }
        Error::Decode(m) => ("decode", m, vec![], String::new(), String::new(), 0),
        Error::Cluster(m) => ("cluster", m, vec![], String::new(), String::new(), 0),
    };
    let t = (kind, message, PyBytes::new(py, &payload), function, node, pid);
    Ok(t.into_pyobject(py)?.into_any().unbind())
}

/// The values of `refs`: per ref `(0, bytes)` (a small object, inline), `(2,
/// ObjectBuffer)` (a store object mapped without copying) or `(1, (kind, message, payload,
/// function, node, pid))`, waiting at most `timeout` seconds for all together.
///
/// Waits in slices of 100 ms, checking for signals between them, so Ctrl-C interrupts a
/// blocked `get` at once (`KeyboardInterrupt`).
#[pyfunction]
#[pyo3(signature = (refs, timeout=None))]
fn get(py: Python<'_>, refs: Vec<Bound<'_, PyRef>>, timeout: Option<f64>) -> PyResult<Py<PyList>> {
    let raws: Vec<RawRef> = refs.iter().map(|r| r.get().inner.clone()).collect();
    let deadline = timeout.map(|t| Instant::now() + Duration::from_secs_f64(t.max(0.0)));
    let mut results: Vec<Option<Result<raw::Data, Error>>> =
        (0..raws.len()).map(|_| None).collect();
    // Set once the first slice did not finish: this worker's CPUs go back meanwhile.
    let mut blocked: Option<raw::Blocked> = None;
    loop {
        let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        // A short first slice: a get that has to wait marks the worker blocked soon.
        let first = if blocked.is_none() { FIRST_SLICE } else { SIGNAL_SLICE };
        let slice = left.unwrap_or(first).min(first);
        let todo: Vec<usize> = (0..raws.len()).filter(|&i| results[i].is_none()).collect();
        let batch: Vec<RawRef> = todo.iter().map(|&i| raws[i].clone()).collect();
        let got = py.detach(|| raw::get(&batch, Some(slice))).map_err(cluster_err)?;
        for (i, r) in todo.into_iter().zip(got) {
            if !matches!(r, Err(Error::Timeout(..))) {
                results[i] = Some(r);
            }
        }
        if results.iter().all(Option::is_some) {
            break;
        }
        if left.is_some_and(|l| l <= slice) {
            let waited = timeout.map(Duration::from_secs_f64).unwrap_or_default();
            let missing = results.iter().filter(|r| r.is_none()).count();
            for r in results.iter_mut().filter(|r| r.is_none()) {
                *r = Some(Err(Error::Timeout(waited, missing)));
            }
            break;
        }
        py.check_signals()?;
        if blocked.is_none() {
            blocked = py.detach(raw::Blocked::enter);
        }
    }
    py.detach(move || drop(blocked));
    let out = PyList::empty(py);
    for r in results.into_iter().flatten() {
        match r {
            Ok(raw::Data::Inline(b)) => out.append((0, PyBytes::new(py, &b)))?,
            Ok(data @ raw::Data::Mapped(_)) => out.append((2, ObjectBuffer { data }))?,
            Err(e) => out.append((1, error_tuple(py, e)?))?,
        }
    }
    Ok(out.unbind())
}

/// A sealed object of this node's store, mapped read-only: `get` hands these out instead
/// of copying the bytes. Python wraps [`ObjectBuffer::address`] in a read-only memoryview
/// that keeps this object alive (`serialization._mapped_view`), so the mapping lives, and
/// the object stays pinned in memory (OBJ-6), as long as any view or array made from it.
#[pyclass(name = "ObjectBuffer", module = "tpuray._tpuray", frozen)]
struct ObjectBuffer {
    data: raw::Data,
}

#[pymethods]
impl ObjectBuffer {
    /// The address of the first byte of the mapping.
    fn address(&self) -> usize {
        self.data.as_ptr() as usize
    }
    /// The object's size in bytes.
    fn __len__(&self) -> usize {
        self.data.len()
    }
}

/// Stores the concatenation of `parts` (bytes-like objects: a pickle and the buffers it
/// refers to) as an object owned by this process, with the refs nested in it. A large
/// object is written part by part into the node's store, without the GIL and without
/// joining the parts first.
#[pyfunction]
fn put(
    py: Python<'_>,
    parts: Vec<Bound<'_, PyAny>>,
    nested: Vec<Bound<'_, PyRef>>,
) -> PyResult<PyRef> {
    let nested: Vec<RawRef> = nested.iter().map(|r| r.get().inner.clone()).collect();
    let views = parts.iter().map(buffer::ByteView::get).collect::<PyResult<Vec<_>>>()?;
    let slices: Vec<&[u8]> = views.iter().map(buffer::ByteView::as_slice).collect();
    py.detach(|| raw::put_parts(&slices, nested)).map(wrap).map_err(cluster_err)
}

/// Reading a Python object's bytes through the buffer protocol.
///
/// pyo3 offers the buffer protocol only for `abi3-py311` and later, but `Py_buffer` and
/// the two functions below have had this exact layout and these signatures since Python
/// 3.3 (3.11 added them to the stable ABI unchanged), so declaring them here keeps one
/// abi3 wheel for Python 3.9 and 3.10 as well.
mod buffer {
    use std::ffi::{c_char, c_int, c_void};

    use pyo3::exceptions::PyBufferError;
    use pyo3::ffi::{Py_ssize_t, PyObject};
    use pyo3::prelude::*;

    #[repr(C)]
    struct PyBuffer {
        buf: *mut c_void,
        obj: *mut PyObject,
        len: Py_ssize_t,
        itemsize: Py_ssize_t,
        readonly: c_int,
        ndim: c_int,
        format: *mut c_char,
        shape: *mut Py_ssize_t,
        strides: *mut Py_ssize_t,
        suboffsets: *mut Py_ssize_t,
        internal: *mut c_void,
    }

    /// `PyBUF_SIMPLE`: one contiguous run of bytes, read-only access is enough.
    const SIMPLE: c_int = 0;

    unsafe extern "C" {
        fn PyObject_GetBuffer(obj: *mut PyObject, view: *mut PyBuffer, flags: c_int) -> c_int;
        fn PyBuffer_Release(view: *mut PyBuffer);
    }

    /// A held export of an object's bytes: the exporter keeps them in place (a
    /// `bytearray` cannot resize, an array cannot be freed) until this is dropped. Create
    /// and drop it with the GIL held; the bytes may be read without it.
    pub(crate) struct ByteView {
        // Boxed: the exporter may keep pointers into the struct until it is released.
        view: Box<PyBuffer>,
    }

    impl ByteView {
        /// Exports the bytes of `obj`, which must be one contiguous buffer.
        pub(crate) fn get(obj: &Bound<'_, PyAny>) -> PyResult<Self> {
            // SAFETY: all-zero is a valid empty Py_buffer; it is filled by the call below.
            let mut view: Box<PyBuffer> = Box::new(unsafe { std::mem::zeroed() });
            // SAFETY: the GIL is held (`obj` is bound) and `view` outlives the export.
            if unsafe { PyObject_GetBuffer(obj.as_ptr(), &mut *view, SIMPLE) } != 0 {
                return Err(PyErr::take(obj.py()).unwrap_or_else(|| {
                    PyBufferError::new_err("object does not export a contiguous buffer")
                }));
            }
            Ok(Self { view })
        }

        pub(crate) fn as_slice(&self) -> &[u8] {
            if self.view.len <= 0 || self.view.buf.is_null() {
                return &[];
            }
            // SAFETY: a PyBUF_SIMPLE export is `len` contiguous bytes at `buf`, held
            // in place until the export is released in `drop`.
            unsafe {
                std::slice::from_raw_parts(self.view.buf as *const u8, self.view.len as usize)
            }
        }
    }

    impl Drop for ByteView {
        fn drop(&mut self) {
            // SAFETY: releases the export made in `get`, with the GIL held (attached
            // again when dropped without it).
            Python::attach(|_| unsafe { PyBuffer_Release(&mut *self.view) });
        }
    }
}

/// The positions of the ready refs (ascending), once `num_returns` are ready or `timeout`
/// seconds pass.
///
/// # Errors
/// `ValueError` when a ref appears twice (Ray's message).
#[pyfunction]
#[pyo3(signature = (refs, num_returns, timeout=None))]
fn wait(
    py: Python<'_>,
    refs: Vec<Bound<'_, PyRef>>,
    num_returns: usize,
    timeout: Option<f64>,
) -> PyResult<Vec<usize>> {
    let raws: Vec<RawRef> = refs.iter().map(|r| r.get().inner.clone()).collect();
    let mut ids = std::collections::HashSet::with_capacity(raws.len());
    if !raws.iter().all(|r| ids.insert(r.id())) {
        return Err(pyo3::exceptions::PyValueError::new_err(
            "Wait requires a list of unique object refs.",
        ));
    }
    let deadline = timeout.map(|t| Instant::now() + Duration::from_secs_f64(t.max(0.0)));
    let want = num_returns.min(raws.len());
    let mut blocked: Option<raw::Blocked> = None;
    loop {
        let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        let first = if blocked.is_none() { FIRST_SLICE } else { SIGNAL_SLICE };
        let slice = left.unwrap_or(first).min(first);
        let ready =
            py.detach(|| raw::wait(&raws, num_returns, Some(slice))).map_err(cluster_err)?;
        if ready.iter().filter(|r| **r).count() >= want || left.is_some_and(|l| l.is_zero()) {
            py.detach(move || drop(blocked));
            return Ok(ready.iter().enumerate().filter(|(_, r)| **r).map(|(i, _)| i).collect());
        }
        py.check_signals()?;
        if blocked.is_none() {
            blocked = py.detach(raw::Blocked::enter);
        }
    }
}

/// How long a blocking call waits between checks for Ctrl-C.
const SIGNAL_SLICE: Duration = Duration::from_millis(100);
/// How long a get/wait waits before it counts as blocked (its worker's CPUs go back to the
/// node, AGENT-11).
const FIRST_SLICE: Duration = Duration::from_millis(5);

/// Sends a worker's output lines to the job's driver: `batches` are (task or actor
/// name, lines). Returns False when the driver takes no worker output.
#[pyfunction]
fn report_logs(
    py: Python<'_>,
    driver: String,
    batches: Vec<(String, Vec<String>)>,
    is_err: bool,
) -> PyResult<bool> {
    py.detach(|| raw::report_logs(&driver, batches, is_err)).map_err(cluster_err)
}

/// Whether this driver prints its workers' output (`init(log_to_driver=...)`).
#[pyfunction]
fn set_log_to_driver(on: bool) {
    tpuray::logs::set_log_to_driver(on);
}

/// Asks the local node agent to pre-start `count` idle workers for this job.
#[pyfunction]
fn prestart_workers(py: Python<'_>, count: u32) -> PyResult<u32> {
    py.detach(|| raw::prestart_workers(count)).map_err(cluster_err)
}

/// Opens a borrow batch around unpickling one value: the refs rebuilt inside register
/// with their owners together (CORE-2).
#[pyfunction]
fn begin_borrow_batch() {
    raw::begin_borrow_batch();
}

/// Closes the batch; the outermost returns once the owners confirmed the registrations.
#[pyfunction]
fn end_borrow_batch(py: Python<'_>) {
    py.detach(raw::end_borrow_batch);
}

/// A ref rebuilt from a pickled value (registers this process as a borrower, CORE-2).
#[pyfunction]
fn deserialize_ref(id: String, owner: String) -> PyRef {
    wrap(raw::deserialized_ref(id, owner))
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

/// Frees objects this process owns (Ray's `ray._private.internal_api.free`).
#[pyfunction]
fn free(py: Python<'_>, refs: Vec<Bound<'_, PyRef>>) -> PyResult<()> {
    let raws: Vec<_> = refs.iter().map(|r| r.get().inner.clone()).collect();
    py.detach(|| raw::free(&raws)).map_err(|e| PyValueError::new_err(e.to_string()))
}

#[pyfunction]
fn kv_get(py: Python<'_>, namespace: String, key: Vec<u8>) -> PyResult<Option<Py<PyBytes>>> {
    let v = py.detach(|| raw::kv_get(&namespace, &key)).map_err(cluster_err)?;
    Ok(v.map(|v| PyBytes::new(py, &v).unbind()))
}

#[pyfunction]
fn kv_put(
    py: Python<'_>,
    namespace: String,
    key: Vec<u8>,
    value: Vec<u8>,
    overwrite: bool,
) -> PyResult<bool> {
    py.detach(|| raw::kv_put(&namespace, &key, value, overwrite)).map_err(cluster_err)
}

/// Deletes a key from the head's KV; returns whether it existed.
#[pyfunction]
fn kv_delete(py: Python<'_>, namespace: String, key: Vec<u8>) -> PyResult<bool> {
    py.detach(|| raw::kv_delete(&namespace, &key)).map_err(cluster_err)
}

/// `(actor_id, class_name, name, namespace, state)`.
type ActorRow = (String, String, String, String, String);

/// Every actor the head knows: [`ActorRow`]s, state as `actor_state` names it (`ALIVE`,
/// `DEAD`, ...).
#[pyfunction]
fn list_actors(py: Python<'_>) -> PyResult<Vec<ActorRow>> {
    let actors = py.detach(raw::list_actors).map_err(cluster_err)?;
    Ok(actors
        .into_iter()
        .map(|a| {
            let state = tpuray_proto::pb::ActorState::try_from(a.state)
                .map(|s| s.as_str_name().trim_start_matches("ACTOR_STATE_").to_string())
                .unwrap_or_default();
            (a.actor_id, a.class_name, a.name, a.namespace, state)
        })
        .collect())
}

#[pyfunction]
#[pyo3(signature = (actor_id, no_restart, reason=String::new()))]
fn kill_actor(py: Python<'_>, actor_id: String, no_restart: bool, reason: String) -> PyResult<()> {
    py.detach(|| tpuray::kill_actor_because(&actor_id, no_restart, &reason)).map_err(cluster_err)
}

/// `(actor_id, class, name)` of the live actor named `name`.
#[pyfunction]
#[pyo3(signature = (name, namespace=None))]
fn get_actor(
    py: Python<'_>,
    name: String,
    namespace: Option<String>,
) -> PyResult<(String, String, String)> {
    let h = py.detach(|| tpuray::get_actor(&name, namespace.as_deref())).map_err(cluster_err)?;
    Ok((h.actor_id, h.class, h.name))
}

/// The actor's state as the head has it: `(state, death_cause, node_id, pid)`, waiting up
/// to `wait` seconds for it to be alive or dead.
#[pyfunction]
fn actor_state(
    py: Python<'_>,
    actor_id: String,
    wait: f64,
) -> PyResult<(String, String, String, u32)> {
    let a = py
        .detach(|| raw::actor_info(&actor_id, Duration::from_secs_f64(wait.max(0.0))))
        .map_err(cluster_err)?;
    let state = tpuray_proto::pb::ActorState::try_from(a.state)
        .map(|s| s.as_str_name().trim_start_matches("ACTOR_STATE_").to_string())
        .unwrap_or_default();
    Ok((state, a.death_cause, a.node_id, a.pid))
}

/// The actor's name, namespace and restart count as the head has them:
/// `(name, namespace, num_restarts)` (`name` is `""` for an unnamed actor).
#[pyfunction]
fn actor_record(py: Python<'_>, actor_id: String) -> PyResult<(String, String, u32)> {
    let a = py.detach(|| raw::actor_info(&actor_id, Duration::ZERO)).map_err(cluster_err)?;
    Ok((a.name, a.namespace, a.num_restarts))
}

/// `ray.nodes()`: one dict per node with Ray's keys.
#[pyfunction]
fn nodes(py: Python<'_>) -> PyResult<Py<PyList>> {
    let ns = py.detach(tpuray::nodes).map_err(cluster_err)?;
    let out = PyList::empty(py);
    for n in ns {
        let d = PyDict::new(py);
        d.set_item("NodeID", n.node_id)?;
        d.set_item("Alive", n.alive)?;
        d.set_item("NodeManagerAddress", n.address)?;
        d.set_item("Resources", n.resources)?;
        d.set_item("Labels", n.labels)?;
        d.set_item("MetricsExportPort", n.metrics_export_port)?;
        d.set_item("NodeManagerPort", n.node_manager_port)?;
        d.set_item("NodeManagerHostname", n.hostname)?;
        // Ray names a node by its IP address unless told otherwise.
        d.set_item("NodeName", d.get_item("NodeManagerAddress")?)?;
        d.set_item("DeathReasonMessage", n.death_reason)?;
        d.set_item("alive", n.alive)?;
        out.append(d)?;
    }
    Ok(out.unbind())
}

/// Free resources of each live node, by node id.
#[pyfunction]
fn available_resources_per_node(
    py: Python<'_>,
) -> PyResult<BTreeMap<String, BTreeMap<String, f64>>> {
    py.detach(tpuray::available_resources_per_node).map_err(cluster_err)
}

/// The cluster's task events as Chrome trace JSON text (a JSON array of trace events,
/// `tpuray_head::timeline`), read from the head this process is connected to; only job
/// `job_id`'s tasks when given.
#[pyfunction]
#[pyo3(signature = (job_id=None))]
fn timeline_json(py: Python<'_>, job_id: Option<String>) -> PyResult<String> {
    let address = raw::process_info().map_err(cluster_err)?.head_address;
    py.detach(|| tpuray_cli::timeline::trace_json(&address, job_id.as_deref()))
        .map_err(|e| PyRuntimeError::new_err(format!("{e:#}")))
}

// ---- metrics (tpuray.util.metrics) ----

fn metric_err(e: tpuray::metrics::MetricError) -> PyErr {
    pyo3::exceptions::PyValueError::new_err(e.to_string())
}

/// Defines a user metric in this process (`kind`: counter, gauge or histogram).
#[pyfunction]
fn metric_define(
    kind: &str,
    name: &str,
    description: &str,
    tag_keys: Vec<String>,
    boundaries: Vec<f64>,
) -> PyResult<()> {
    use tpuray_proto::pb::metric_def::Kind;
    let kind = match kind {
        "counter" => Kind::Counter,
        "gauge" => Kind::Gauge,
        "histogram" => Kind::Histogram,
        other => {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "unknown metric kind {other:?}"
            )));
        }
    };
    tpuray::metrics::define(kind, name, description, &tag_keys, &boundaries).map_err(metric_err)
}

/// Records a value for the series of `tag_values` (in the definition's key order).
#[pyfunction]
fn metric_record(name: &str, tag_values: Vec<String>, value: f64) -> PyResult<()> {
    tpuray::metrics::record(name, tag_values, value).map_err(metric_err)
}

/// Where this process's metrics go: (node agent address, on another host), or None
/// before `init`.
#[pyfunction]
fn metric_destination() -> Option<(String, bool)> {
    tpuray::metrics::destination().map(|d| (d, tpuray::metrics::reports_to_another_host()))
}

#[pyfunction]
fn cluster_resources(py: Python<'_>) -> PyResult<BTreeMap<String, f64>> {
    py.detach(tpuray::cluster_resources).map_err(cluster_err)
}

#[pyfunction]
fn available_resources(py: Python<'_>) -> PyResult<BTreeMap<String, f64>> {
    py.detach(tpuray::available_resources).map_err(cluster_err)
}

// ---- placement groups ----

/// Creates a placement group; returns `(id, bundle_count)`.
#[pyfunction]
#[pyo3(signature = (bundles, strategy, name=None, namespace=None, detached=false, bundle_label_selector=None))]
fn create_placement_group(
    py: Python<'_>,
    bundles: Vec<BTreeMap<String, f64>>,
    strategy: String,
    name: Option<String>,
    namespace: Option<String>,
    detached: bool,
    bundle_label_selector: Option<Vec<BTreeMap<String, String>>>,
) -> PyResult<(String, usize)> {
    let opts = tpuray::PlacementGroupOptions {
        name,
        namespace,
        detached,
        bundle_label_selector: bundle_label_selector.unwrap_or_default(),
    };
    let pg = py
        .detach(|| tpuray::placement_group_with(&bundles, &strategy, &opts))
        .map_err(cluster_err)?;
    Ok((pg.id().to_string(), pg.bundle_count()))
}

fn pg_dict(
    py: Python<'_>,
    s: tpuray::placement_group::PlacementGroupState,
) -> PyResult<Py<PyDict>> {
    let d = PyDict::new(py);
    d.set_item("placement_group_id", s.id)?;
    d.set_item("name", s.name)?;
    d.set_item("state", s.state)?;
    d.set_item("strategy", s.strategy)?;
    let bundles: HashMap<usize, BTreeMap<String, f64>> =
        s.bundles.into_iter().enumerate().collect();
    d.set_item("bundles", bundles)?;
    let nodes: HashMap<usize, String> = s.bundle_nodes.into_iter().enumerate().collect();
    d.set_item("bundles_to_node_id", nodes)?;
    d.set_item("pending_reason", s.pending_reason)?;
    Ok(d.unbind())
}

/// The state of group `id` as a `placement_group_table` entry, waiting up to `wait`
/// seconds for it to be created or removed.
#[pyfunction]
fn placement_group_state(py: Python<'_>, id: String, wait: f64) -> PyResult<Py<PyDict>> {
    let s = py
        .detach(|| {
            tpuray::placement_group::state_of_id(&id, Duration::from_secs_f64(wait.max(0.0)))
        })
        .map_err(cluster_err)?;
    pg_dict(py, s)
}

#[pyfunction]
fn placement_group_table(py: Python<'_>) -> PyResult<Py<PyList>> {
    let all = py.detach(tpuray::placement_group_table).map_err(cluster_err)?;
    let out = PyList::empty(py);
    for s in all {
        out.append(pg_dict(py, s)?)?;
    }
    Ok(out.unbind())
}

#[pyfunction]
fn remove_placement_group(py: Python<'_>, id: String) -> PyResult<()> {
    py.detach(|| tpuray::placement_group::remove_by_id(&id)).map_err(cluster_err)
}

/// `(id, bundle_count)` of the group named `name`.
#[pyfunction]
#[pyo3(signature = (name, namespace=None))]
fn get_placement_group(
    py: Python<'_>,
    name: String,
    namespace: Option<String>,
) -> PyResult<(String, usize)> {
    let pg = py
        .detach(|| tpuray::get_placement_group(&name, namespace.as_deref()))
        .map_err(cluster_err)?;
    Ok((pg.id().to_string(), pg.bundle_count()))
}

/// A TPU slice group: `(id, bundle_count, accelerator_type, num_hosts, chips_per_host)`;
/// `name` as `tpuray status` shows it ("" for none).
#[pyfunction]
#[pyo3(signature = (topology, accelerator_version, resources_per_bundle=None, num_slices=1, name=String::new()))]
fn slice_placement_group(
    py: Python<'_>,
    topology: String,
    accelerator_version: String,
    resources_per_bundle: Option<BTreeMap<String, f64>>,
    num_slices: u32,
    name: String,
) -> PyResult<(String, usize, String, u32, u32)> {
    let s = py
        .detach(|| {
            tpuray::placement_group::slice_placement_group_named(
                &topology,
                &accelerator_version,
                resources_per_bundle.as_ref(),
                num_slices,
                &name,
            )
        })
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    Ok((
        s.placement_group.id().to_string(),
        s.placement_group.bundle_count(),
        s.accelerator_type,
        s.num_hosts,
        s.chips_per_host,
    ))
}

// ---- slice gangs ----

/// Generations reserved through [`gang_reserve`], until [`gang_release`].
static GANGS: std::sync::Mutex<BTreeMap<String, tpuray::gang::GangGeneration>> =
    std::sync::Mutex::new(BTreeMap::new());

#[allow(clippy::too_many_arguments)]
fn gang_options(
    topology: String,
    accelerator_version: String,
    num_slices: u32,
    per_chip: bool,
    max_restarts: u32,
    name: String,
    timeout: f64,
) -> tpuray::gang::GangOptions {
    tpuray::gang::GangOptions {
        topology,
        accelerator_version,
        num_slices,
        mode: if per_chip {
            tpuray::gang::GangMode::PerChip
        } else {
            tpuray::gang::GangMode::PerHost
        },
        max_restarts,
        name,
        ready_timeout: Duration::from_secs_f64(timeout.max(0.0)),
    }
}

/// `(generation, members)` as dicts: the generation's `gang_id`, `generation`,
/// `placement_group_id`, `bundle_count`, `accelerator_type`, `num_hosts`, `chips_per_host`,
/// `base_port`, `hosts` (`address`, `slice_name`, `worker_id`); each member's `index`,
/// `bundle_index`, `chips`, `local_rank`, `env`.
fn gang_dicts<'py>(
    py: Python<'py>,
    g: &tpuray::gang::GangGeneration,
) -> PyResult<(Bound<'py, PyDict>, Bound<'py, PyList>)> {
    let d = PyDict::new(py);
    d.set_item("gang_id", &g.gang_id)?;
    d.set_item("generation", g.number)?;
    d.set_item("placement_group_id", g.slice.placement_group.id())?;
    d.set_item("bundle_count", g.slice.placement_group.bundle_count())?;
    d.set_item("accelerator_type", &g.slice.accelerator_type)?;
    d.set_item("num_hosts", g.slice.num_hosts)?;
    d.set_item("chips_per_host", g.slice.chips_per_host)?;
    d.set_item("base_port", g.base_port)?;
    let hosts = PyList::empty(py);
    for h in &g.hosts {
        let hd = PyDict::new(py);
        hd.set_item("address", &h.address)?;
        hd.set_item("slice_name", &h.slice_name)?;
        hd.set_item("worker_id", h.worker_id)?;
        hosts.append(hd)?;
    }
    d.set_item("hosts", hosts)?;
    let members = PyList::empty(py);
    for m in &g.members {
        members.append(member_dict(py, m)?)?;
    }
    Ok((d, members))
}

fn member_dict<'py>(py: Python<'py>, m: &tpuray::gang::GangMember) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("index", m.index)?;
    d.set_item("bundle_index", m.bundle_index)?;
    d.set_item("chips", m.chips)?;
    d.set_item("local_rank", m.local_rank)?;
    d.set_item("env", m.env.clone())?;
    Ok(d)
}

/// Starts a task gang (see `tpuray::gang::start_task_gang`): `launch(generation, member)`
/// submits one member's task and returns its ref; returns one ref per member, settled by
/// the gang's supervisor.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn gang_start(
    py: Python<'_>,
    topology: String,
    accelerator_version: String,
    num_slices: u32,
    per_chip: bool,
    max_restarts: u32,
    name: String,
    timeout: f64,
    launch: Py<PyAny>,
) -> PyResult<Vec<PyRef>> {
    let opts = gang_options(
        topology,
        accelerator_version,
        num_slices,
        per_chip,
        max_restarts,
        name,
        timeout,
    );
    let refs = py
        .detach(|| {
            tpuray::gang::start_task_gang(opts, move |g, m| {
                Python::attach(|py| {
                    let (gd, _) = gang_dicts(py, g).map_err(|e| Error::Cluster(e.to_string()))?;
                    let md = member_dict(py, m).map_err(|e| Error::Cluster(e.to_string()))?;
                    let r = launch
                        .call1(py, (gd, md))
                        .map_err(|e| Error::Cluster(format!("launching a gang member: {e}")))?;
                    let r = r.cast_bound::<PyRef>(py).map_err(|e| {
                        Error::Cluster(format!("launch must return an ObjectRef: {e}"))
                    })?;
                    Ok(r.get().inner.clone())
                })
            })
        })
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    Ok(refs.into_iter().map(wrap).collect())
}

/// Reserves one generation of a gang (for actor gangs, which Python supervises): `(handle,
/// generation dict, member dicts)`; give the handle to [`gang_release`].
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn gang_reserve<'py>(
    py: Python<'py>,
    topology: String,
    accelerator_version: String,
    num_slices: u32,
    per_chip: bool,
    name: String,
    timeout: f64,
    gang_id: String,
    generation: u32,
) -> PyResult<(String, Bound<'py, PyDict>, Bound<'py, PyList>)> {
    let opts = gang_options(topology, accelerator_version, num_slices, per_chip, 0, name, timeout);
    let g = py
        .detach(|| tpuray::gang::GangGeneration::reserve(&opts, &gang_id, generation))
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    let (d, members) = gang_dicts(py, &g)?;
    let handle = g.slice.placement_group.id().to_string();
    GANGS.lock().unwrap().insert(handle.clone(), g);
    Ok((handle, d, members))
}

/// A generation in a slice group the caller holds (`run_on_slice(..., tpu_slice=...)`):
/// `(handle, generation dict, member dicts)`. Its ports are held until the group is removed.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn gang_adopt<'py>(
    py: Python<'py>,
    placement_group_id: String,
    bundle_count: usize,
    topology: String,
    accelerator_version: String,
    num_slices: u32,
    per_chip: bool,
    name: String,
    timeout: f64,
    gang_id: String,
) -> PyResult<(String, Bound<'py, PyDict>, Bound<'py, PyList>)> {
    let opts = gang_options(topology, accelerator_version, num_slices, per_chip, 0, name, timeout);
    let g = py
        .detach(|| {
            let slice = tpuray::SlicePlacementGroup::from_id(
                &placement_group_id,
                bundle_count,
                &opts.topology,
                &opts.accelerator_version,
                num_slices,
            )?;
            tpuray::gang::GangGeneration::adopt(&opts, slice, &gang_id, 0)
        })
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    let (d, members) = gang_dicts(py, &g)?;
    Ok((placement_group_id, d, members))
}

/// Stops a generation's members and releases its slices and ports.
#[pyfunction]
fn gang_release(py: Python<'_>, handle: String) {
    let g = GANGS.lock().unwrap().remove(&handle);
    if let Some(g) = g {
        py.detach(|| g.release());
    }
}

// ---- worker side ----

/// Calls the Python runtime object for each task the executor runs.
struct PyRuntime {
    obj: Py<PyAny>,
}

fn info_dict<'py>(py: Python<'py>, t: &TaskInfo) -> PyResult<Bound<'py, PyDict>> {
    // Interned keys: made once per process, not once per call.
    let d = PyDict::new(py);
    d.set_item(pyo3::intern!(py, "task_id"), &t.task_id)?;
    d.set_item(pyo3::intern!(py, "job_id"), &t.job_id)?;
    d.set_item(pyo3::intern!(py, "function"), &t.function)?;
    d.set_item(pyo3::intern!(py, "class_name"), &t.class_name)?;
    d.set_item(pyo3::intern!(py, "name"), &t.name)?;
    d.set_item(pyo3::intern!(py, "actor_id"), &t.actor_id)?;
    d.set_item(pyo3::intern!(py, "attempt"), t.attempt)?;
    d.set_item(pyo3::intern!(py, "num_returns"), t.num_returns)?;
    d.set_item(pyo3::intern!(py, "streaming"), t.streaming)?;
    d.set_item(pyo3::intern!(py, "placement_group_id"), &t.placement_group_id)?;
    d.set_item(pyo3::intern!(py, "capture_child_tasks"), t.capture_child_tasks)?;
    d.set_item(pyo3::intern!(py, "resources"), t.resources.clone())?;
    Ok(d)
}

/// Keeps this thread's Python thread state between calls. `attach` on a thread that Python
/// did not start (an executor thread) makes a thread state and deletes it again when it
/// detaches, every call; one `PyGILState_Ensure` never released keeps it (and its
/// `threading.local` values), and each later `attach` only takes the GIL. Executor threads
/// live as long as the process.
fn keep_thread_state(_py: Python<'_>) {
    thread_local! {
        static KEPT: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }
    KEPT.with(|kept| {
        if !kept.get() {
            // SAFETY: the GIL is held (`_py`); this only raises the thread state's count.
            unsafe { pyo3::ffi::PyGILState_Ensure() };
            kept.set(true);
        }
    });
}

impl PyRuntime {
    /// Calls `method(info, args)` on the runtime object, which answers `("ok", [bytes...],
    /// [RefCore...])` or `("err", message, payload)`.
    fn call(
        &self,
        method: &str,
        t: &TaskInfo,
        args: Vec<Vec<u8>>,
    ) -> Result<ForeignReturn, TaskFailure> {
        Python::attach(|py| {
            keep_thread_state(py);
            let run = || -> PyResult<Result<ForeignReturn, TaskFailure>> {
                let info = info_dict(py, t)?;
                let args = PyList::new(py, args.iter().map(|a| PyBytes::new(py, a)))?;
                parse_reply(&self.obj.bind(py).call_method1(method, (info, args))?)
            };
            run().unwrap_or_else(|e| {
                Err(TaskFailure::application(format!("tpuray's Python runtime failed: {e}")))
            })
        })
    }
}

/// A call's answer from the runtime: `("ok", [bytes...], [RefCore...])` or `("err",
/// message, payload[, no_retry])`.
fn parse_reply(r: &Bound<'_, PyAny>) -> PyResult<Result<ForeignReturn, TaskFailure>> {
    let tag: String = r.get_item(0)?.extract()?;
    if tag == "ok" {
        let values: Vec<Vec<u8>> = r.get_item(1)?.extract()?;
        let nested: Vec<Bound<'_, PyRef>> = r.get_item(2)?.extract()?;
        Ok(Ok(ForeignReturn {
            values,
            nested: nested.iter().map(|n| n.get().inner.clone()).collect(),
        }))
    } else {
        let message: String = r.get_item(1)?.extract()?;
        let payload: Vec<u8> = r.get_item(2)?.extract()?;
        let mut f = TaskFailure::with_payload(message, payload);
        // ("err", message, payload, no_retry): outside retry_exceptions' list.
        f.no_retry = r.len()? > 3 && r.get_item(3)?.extract::<bool>()?;
        Ok(Err(f))
    }
}

// ---- async actors: calls handed to the actor's event loop without the GIL ----

/// A method call waiting for the async actor's event loop.
struct AsyncCall {
    task_id: String,
    function: String,
    num_returns: u32,
    args: Vec<Vec<u8>>,
    reply: AsyncAnswer,
}

/// Where an async call's answer goes.
enum AsyncAnswer {
    /// To an executor thread waiting for it.
    Waiting(SyncSender<Result<ForeignReturn, TaskFailure>>),
    /// To the core's reply, straight from the loop's thread (started without an executor
    /// thread: [`ForeignRuntime::start_async_method`]).
    Done(AsyncDone),
}

impl AsyncAnswer {
    fn send(self, r: Result<ForeignReturn, TaskFailure>) {
        match self {
            AsyncAnswer::Waiting(tx) => {
                let _ = tx.send(r);
            }
            AsyncAnswer::Done(done) => done(r),
        }
    }
}

/// The async methods of this worker's actor and the queue of their calls. A call is queued
/// (by an executor thread, or by the core's RPC thread for a call that needs none) and
/// wakes the loop through a pipe (one byte while the loop has not taken the queue since);
/// the loop takes every queued call at once, runs each as a task and sends its answer from
/// there.
struct AsyncCalls {
    methods: HashSet<String>,
    wake: std::fs::File,
    /// The queued calls, and whether the loop has been woken since it last took them.
    queue: Mutex<(Vec<AsyncCall>, bool)>,
}

static ASYNC_CALLS: OnceLock<AsyncCalls> = OnceLock::new();

impl AsyncCalls {
    /// Queues a call for the loop; its answer goes to `reply`.
    fn queue(&self, t: &TaskInfo, args: Vec<Vec<u8>>, reply: AsyncAnswer) {
        let wake = {
            let mut q = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
            q.0.push(AsyncCall {
                task_id: t.task_id.clone(),
                function: t.function.clone(),
                num_returns: t.num_returns,
                args,
                reply,
            });
            !std::mem::replace(&mut q.1, true)
        };
        if wake && let Err(e) = (&self.wake).write_all(&[1]) {
            // Nothing will take the queue: answer every call in it.
            let calls =
                std::mem::take(&mut self.queue.lock().unwrap_or_else(PoisonError::into_inner).0);
            for c in calls {
                c.reply.send(Err(TaskFailure::application(format!(
                    "could not wake the async actor's event loop: {e}"
                ))));
            }
        }
    }

    /// Runs a call on the loop, waiting for its answer on this (executor) thread.
    fn call(&self, t: &TaskInfo, args: Vec<Vec<u8>>) -> Result<ForeignReturn, TaskFailure> {
        let (tx, rx) = sync_channel(1);
        self.queue(t, args, AsyncAnswer::Waiting(tx));
        rx.recv().unwrap_or_else(|_| {
            Err(TaskFailure::application(
                "tpuray's Python runtime dropped the async actor call".to_string(),
            ))
        })
    }
}

/// Where an async method call's result goes: `send(reply)` with the runtime's
/// `("ok", [bytes...], [RefCore...])` or `("err", message, payload[, no_retry])`. One
/// dropped unsent answers that the runtime dropped the call.
#[pyclass(module = "tpuray._tpuray", frozen)]
struct AsyncReply {
    tx: Mutex<Option<AsyncAnswer>>,
}

#[pymethods]
impl AsyncReply {
    fn send(&self, py: Python<'_>, reply: &Bound<'_, PyAny>) {
        let r = parse_reply(reply).unwrap_or_else(|e| {
            Err(TaskFailure::application(format!("tpuray's Python runtime failed: {e}")))
        });
        if let Some(answer) = self.tx.lock().unwrap_or_else(PoisonError::into_inner).take() {
            // Storing the result and telling owners about refs in it may wait: not with
            // the GIL.
            py.detach(|| answer.send(r));
        }
    }
}

impl Drop for AsyncReply {
    fn drop(&mut self) {
        if let Some(answer) = self.tx.get_mut().unwrap_or_else(PoisonError::into_inner).take() {
            answer.send(Err(TaskFailure::application(
                "tpuray's Python runtime dropped the async actor call".to_string(),
            )));
        }
    }
}

/// Sends this worker's calls of `methods` (the actor's `async def` methods) to its event
/// loop: the loop is woken by a byte written to file descriptor `wake_fd` (which this
/// takes over) and collects the calls with [`take_async_calls`].
#[pyfunction]
fn enable_async_calls(methods: Vec<String>, wake_fd: i32) -> PyResult<()> {
    use std::os::fd::FromRawFd;
    if wake_fd < 0 {
        return Err(PyValueError::new_err("wake_fd must be a file descriptor"));
    }
    // SAFETY: the caller hands over an open descriptor that nothing else closes.
    let wake = unsafe { std::fs::File::from_raw_fd(wake_fd) };
    ASYNC_CALLS
        .set(AsyncCalls {
            methods: methods.into_iter().collect(),
            wake,
            queue: Mutex::new((Vec::new(), false)),
        })
        .map_err(|_| PyRuntimeError::new_err("async calls are already enabled in this worker"))
}

/// The queued async method calls, each `(reply, method, num_returns, [arg bytes...],
/// task id)`.
#[pyfunction]
fn take_async_calls(py: Python<'_>) -> PyResult<Py<PyList>> {
    let out = PyList::empty(py);
    let Some(a) = ASYNC_CALLS.get() else { return Ok(out.unbind()) };
    let calls = {
        let mut q = a.queue.lock().unwrap_or_else(PoisonError::into_inner);
        q.1 = false;
        std::mem::take(&mut q.0)
    };
    for c in calls {
        let args = PyList::new(py, c.args.iter().map(|b| PyBytes::new(py, b)))?;
        let reply = Py::new(py, AsyncReply { tx: Mutex::new(Some(c.reply)) })?;
        out.append((reply, &c.function, c.num_returns, args, &c.task_id))?;
    }
    Ok(out.unbind())
}

/// The items of a Python generator: `next_item()` on the runtime's stream object answers
/// `("item", bytes)`, `("done",)` or `("err", message, payload)`.
struct PyStream {
    obj: Py<PyAny>,
}

impl Iterator for PyStream {
    type Item = Result<Vec<u8>, TaskFailure>;
    fn next(&mut self) -> Option<Self::Item> {
        Python::attach(|py| {
            keep_thread_state(py);
            let step = || -> PyResult<Option<Result<Vec<u8>, TaskFailure>>> {
                let r = self.obj.bind(py).call_method0("next_item")?;
                let tag: String = r.get_item(0)?.extract()?;
                Ok(match tag.as_str() {
                    "item" => Some(Ok(r.get_item(1)?.extract()?)),
                    "done" => None,
                    _ => Some(Err(TaskFailure::with_payload(
                        r.get_item(1)?.extract::<String>()?,
                        r.get_item(2)?.extract::<Vec<u8>>()?,
                    ))),
                })
            };
            step().unwrap_or_else(|e| {
                Some(Err(TaskFailure::application(format!("tpuray's Python runtime failed: {e}"))))
            })
        })
    }
}

impl ForeignRuntime for PyRuntime {
    fn start_stream(
        &self,
        task: &TaskInfo,
        args: Vec<Vec<u8>>,
    ) -> Result<ForeignStream, TaskFailure> {
        Python::attach(|py| {
            keep_thread_state(py);
            let run = || -> PyResult<Result<ForeignStream, TaskFailure>> {
                let info = info_dict(py, task)?;
                let args = PyList::new(py, args.iter().map(|a| PyBytes::new(py, a)))?;
                let r = self.obj.bind(py).call_method1("start_stream", (info, args))?;
                let tag: String = r.get_item(0)?.extract()?;
                if tag == "ok" {
                    let stream: ForeignStream = Box::new(PyStream { obj: r.get_item(1)?.unbind() });
                    Ok(Ok(stream))
                } else {
                    Ok(Err(TaskFailure::with_payload(
                        r.get_item(1)?.extract::<String>()?,
                        r.get_item(2)?.extract::<Vec<u8>>()?,
                    )))
                }
            };
            run().unwrap_or_else(|e| {
                Err(TaskFailure::application(format!("tpuray's Python runtime failed: {e}")))
            })
        })
    }

    fn run_task(&self, task: &TaskInfo, args: Vec<Vec<u8>>) -> Result<ForeignReturn, TaskFailure> {
        self.call("run_task", task, args)
    }
    fn create_actor(&self, task: &TaskInfo, args: Vec<Vec<u8>>) -> Result<(), TaskFailure> {
        self.call("create_actor", task, args).map(|_| ())
    }
    fn call_method(
        &self,
        task: &TaskInfo,
        args: Vec<Vec<u8>>,
    ) -> Result<ForeignReturn, TaskFailure> {
        match ASYNC_CALLS.get() {
            Some(a) if a.methods.contains(&task.function) => a.call(task, args),
            _ => self.call("call_method", task, args),
        }
    }
    fn is_async_method(&self, function: &str) -> bool {
        ASYNC_CALLS.get().is_some_and(|a| a.methods.contains(function))
    }
    fn start_async_method(&self, task: &TaskInfo, args: Vec<Vec<u8>>, done: AsyncDone) {
        match ASYNC_CALLS.get() {
            Some(a) => a.queue(task, args, AsyncAnswer::Done(done)),
            None => done(Err(TaskFailure::application("this actor has no async methods"))),
        }
    }
    /// `cancel_task(task_id)` on the runtime object, from a thread of its own (the GIL
    /// may be held by the task being interrupted; the RPC thread must not wait for it).
    fn cancel(&self, task_id: &str) {
        let obj = Python::attach(|py| self.obj.clone_ref(py));
        let task_id = task_id.to_string();
        std::thread::spawn(move || {
            Python::attach(|py| {
                if let Err(e) = obj.bind(py).call_method1("cancel_task", (task_id,)) {
                    e.print(py);
                }
            });
        });
    }
}

/// The worker process's main loop: installs `runtime` (an object with `run_task`,
/// `create_actor` and `call_method`) and serves until the node agent stops the worker.
/// Returns the exit code.
#[pyfunction]
fn run_worker(py: Python<'_>, runtime: Py<PyAny>) -> PyResult<i32> {
    tpuray::foreign::set_language("python").map_err(PyRuntimeError::new_err)?;
    tpuray::foreign::set_runtime("python", Box::new(PyRuntime { obj: runtime }))
        .map_err(PyRuntimeError::new_err)?;
    Ok(py.detach(|| match tpuray::worker::run_worker() {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("tpuray worker: {e}");
            1
        }
    }))
}

#[pymodule]
fn _tpuray(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(run, m)?)?;
    m.add_class::<PyRef>()?;
    m.add_class::<ObjectBuffer>()?;
    m.add_class::<AsyncReply>()?;
    for f in [
        wrap_pyfunction!(init_driver, m)?,
        wrap_pyfunction!(process_info, m)?,
        wrap_pyfunction!(tpu_slice_shape, m)?,
        wrap_pyfunction!(is_initialized, m)?,
        wrap_pyfunction!(dashboard_url, m)?,
        wrap_pyfunction!(free, m)?,
        wrap_pyfunction!(metric_define, m)?,
        wrap_pyfunction!(metric_record, m)?,
        wrap_pyfunction!(metric_destination, m)?,
        wrap_pyfunction!(shutdown, m)?,
        wrap_pyfunction!(submit, m)?,
        wrap_pyfunction!(create_actor, m)?,
        wrap_pyfunction!(call_actor, m)?,
        wrap_pyfunction!(get, m)?,
        wrap_pyfunction!(put, m)?,
        wrap_pyfunction!(wait, m)?,
        wrap_pyfunction!(deserialize_ref, m)?,
        wrap_pyfunction!(begin_borrow_batch, m)?,
        wrap_pyfunction!(end_borrow_batch, m)?,
        wrap_pyfunction!(cancel, m)?,
        wrap_pyfunction!(cancel_task, m)?,
        wrap_pyfunction!(is_cancelled, m)?,
        wrap_pyfunction!(generator_ready, m)?,
        wrap_pyfunction!(kv_get, m)?,
        wrap_pyfunction!(kv_put, m)?,
        wrap_pyfunction!(kv_delete, m)?,
        wrap_pyfunction!(list_actors, m)?,
        wrap_pyfunction!(available_resources_per_node, m)?,
        wrap_pyfunction!(kill_actor, m)?,
        wrap_pyfunction!(get_actor, m)?,
        wrap_pyfunction!(actor_state, m)?,
        wrap_pyfunction!(actor_record, m)?,
        wrap_pyfunction!(nodes, m)?,
        wrap_pyfunction!(timeline_json, m)?,
        wrap_pyfunction!(cluster_resources, m)?,
        wrap_pyfunction!(available_resources, m)?,
        wrap_pyfunction!(create_placement_group, m)?,
        wrap_pyfunction!(placement_group_state, m)?,
        wrap_pyfunction!(placement_group_table, m)?,
        wrap_pyfunction!(remove_placement_group, m)?,
        wrap_pyfunction!(get_placement_group, m)?,
        wrap_pyfunction!(slice_placement_group, m)?,
        wrap_pyfunction!(run_worker, m)?,
        wrap_pyfunction!(report_logs, m)?,
        wrap_pyfunction!(set_log_to_driver, m)?,
        wrap_pyfunction!(submit_streaming, m)?,
        wrap_pyfunction!(call_actor_streaming, m)?,
        wrap_pyfunction!(next_item, m)?,
        wrap_pyfunction!(drop_stream, m)?,
        wrap_pyfunction!(prestart_workers, m)?,
        wrap_pyfunction!(enable_async_calls, m)?,
        wrap_pyfunction!(take_async_calls, m)?,
        wrap_pyfunction!(gang_start, m)?,
        wrap_pyfunction!(gang_reserve, m)?,
        wrap_pyfunction!(gang_release, m)?,
        wrap_pyfunction!(gang_adopt, m)?,
    ] {
        m.add_function(f)?;
    }
    jobs::register(m)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // Ray's `ray._raylet.OPTIMIZED`: whether this extension was compiled with
    // optimisations (benchmarks refuse a debug build: tpuray._private.build).
    m.add("OPTIMIZED", !cfg!(debug_assertions))?;
    Ok(())
}
