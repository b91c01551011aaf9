//! Object references and values: `RefCore` (a ref as the core holds it), `get`, `put`,
//! `wait`, `free`, the borrow batch around unpickling, and `ObjectBuffer` (a store object
//! mapped read-only, read through the buffer protocol without a copy).
//!
//! PY-2: blocking calls release the GIL; `get`/`wait` wait in 100 ms slices and check for
//! signals between them (Ctrl-C interrupts). A `get` waits for the driver's own objects
//! by parking its thread, not with a runtime timer (which would wake the runtime thread
//! once more per call). Store objects come back as `ObjectBuffer`s, so arrays are
//! zero-copy views that pin the object while alive.

use std::time::{Duration, Instant};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};
use tpuray::Error;
use tpuray::raw::{self, RawRef};

use crate::errors::{cluster_err, error_tuple};

/// An object reference as the core holds it: id and owner address. Dropping the last
/// Python reference releases it (CORE-2).
#[pyclass(name = "RefCore", module = "tpuray._tpuray", frozen)]
pub(crate) struct PyRef {
    pub(crate) inner: RawRef,
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

pub(crate) fn wrap(r: RawRef) -> PyRef {
    PyRef { inner: r }
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
        // PY-2: waited with the GIL released (`detach`); Ctrl-C interrupts between slices.
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

/// How long a blocking call waits between checks for Ctrl-C (PY-2: the GIL released, signals
/// checked between slices).
pub(crate) const SIGNAL_SLICE: Duration = Duration::from_millis(100);
/// How long a get/wait waits before it counts as blocked (its worker's CPUs go back to the
/// node, AGENT-11).
pub(crate) const FIRST_SLICE: Duration = Duration::from_millis(5);

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

/// Frees objects this process owns (Ray's `ray._private.internal_api.free`).
#[pyfunction]
fn free(py: Python<'_>, refs: Vec<Bound<'_, PyRef>>) -> PyResult<()> {
    let raws: Vec<_> = refs.iter().map(|r| r.get().inner.clone()).collect();
    py.detach(|| raw::free(&raws)).map_err(|e| PyValueError::new_err(e.to_string()))
}

/// Adds this module's functions and classes to the extension module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyRef>()?;
    m.add_class::<ObjectBuffer>()?;
    m.add_function(wrap_pyfunction!(get, m)?)?;
    m.add_function(wrap_pyfunction!(put, m)?)?;
    m.add_function(wrap_pyfunction!(wait, m)?)?;
    m.add_function(wrap_pyfunction!(begin_borrow_batch, m)?)?;
    m.add_function(wrap_pyfunction!(end_borrow_batch, m)?)?;
    m.add_function(wrap_pyfunction!(deserialize_ref, m)?)?;
    m.add_function(wrap_pyfunction!(free, m)?)?;
    Ok(())
}
