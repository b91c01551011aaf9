//! The worker side: the `ForeignRuntime` that calls the Python runtime object for each
//! task, actor constructor and method call, Python generators as streams, async actors'
//! calls handed to their event loop without the GIL, and `run_worker`.
//!
//! A Python worker is `python -m tpuray._worker`: it installs the `ForeignRuntime` (PY-1)
//! and runs the same `worker::run_worker` loop as a Rust worker. Async actors run
//! coroutines on one event loop thread; an `async def` call is queued in the extension
//! without the GIL (by the worker's RPC thread, or by an executor thread when an argument
//! had to be fetched first), the loop is woken through a pipe (once per batch) and starts
//! every queued call as a task, which answers when it ends (straight to the RPC's reply),
//! so calls overlap.

use std::collections::HashSet;
use std::io::Write;
use std::sync::mpsc::{SyncSender, sync_channel};
use std::sync::{Mutex, OnceLock, PoisonError};

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use tpuray::error::TaskFailure;
use tpuray::foreign::{AsyncDone, ForeignReturn, ForeignRuntime, ForeignStream, TaskInfo};

use crate::objects::PyRef;

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

/// Adds this module's functions and classes to the extension module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<AsyncReply>()?;
    m.add_function(wrap_pyfunction!(enable_async_calls, m)?)?;
    m.add_function(wrap_pyfunction!(take_async_calls, m)?)?;
    m.add_function(wrap_pyfunction!(run_worker, m)?)?;
    Ok(())
}
