//! The Jobs REST API client for `tpuray.job_submission` ([`tpuray_cli::job`]: HTTP,
//! packaging, auth and address resolution live there, once). JSON crosses as `str`
//! (Python parses it into Ray's types). Every call releases the GIL while it waits.
//!
//! Errors: a server that cannot be reached is `ConnectionError`; 401/403
//! `tpuray.exceptions.AuthenticationError`; any other non-200 answer `RuntimeError`
//! ("Request failed with status code N: <server's text>.", Ray's words); bad input and
//! bad addresses `ValueError`.

use std::collections::BTreeMap;
use std::sync::Mutex;

use pyo3::exceptions::{PyConnectionError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use tpuray_cli::job::{self, ClientOptions, JobError, runtime_env};

fn job_err(py: Python<'_>, e: JobError) -> PyErr {
    let msg = e.to_string();
    match e {
        JobError::Connect { .. } => PyConnectionError::new_err(msg),
        JobError::Auth { .. } => match py
            .import("tpuray.exceptions")
            .and_then(|m| m.getattr("AuthenticationError"))
            .and_then(|c| c.call1((msg.clone(),)))
        {
            Ok(err) => PyErr::from_value(err),
            Err(_) => PyRuntimeError::new_err(msg),
        },
        JobError::Status { status, body } => {
            PyRuntimeError::new_err(format!("Request failed with status code {status}: {body}."))
        }
        JobError::Protocol(_) => PyRuntimeError::new_err(msg),
        JobError::Address(_) | JobError::Invalid(_) | JobError::Package(_) => {
            PyValueError::new_err(msg)
        }
    }
}

fn json_err(e: serde_json::Error) -> PyErr {
    PyValueError::new_err(format!("not JSON: {e}"))
}

/// A client of one job server (`JobSubmissionClient`'s core).
#[pyclass(name = "JobClient", module = "tpuray._tpuray", frozen)]
struct PyJobClient {
    inner: job::JobClient,
}

#[pymethods]
impl PyJobClient {
    /// Resolves `address` (Ray's rules: `RAY_API_SERVER_ADDRESS`/`RAY_ADDRESS` override
    /// it; `None`: `TPURAY_ADDRESS`, then this machine's cluster) and checks the server
    /// answers `/api/version`.
    #[new]
    #[pyo3(signature = (address=None, headers=None, cookies=None, metadata=None))]
    fn new(
        py: Python<'_>,
        address: Option<String>,
        headers: Option<BTreeMap<String, String>>,
        cookies: Option<BTreeMap<String, String>>,
        metadata: Option<BTreeMap<String, String>>,
    ) -> PyResult<Self> {
        let opts = ClientOptions {
            address,
            env_overrides: true,
            headers: headers.unwrap_or_default(),
            cookies: cookies.unwrap_or_default(),
            metadata: metadata.unwrap_or_default(),
        };
        let inner = py.detach(|| job::JobClient::connect(opts)).map_err(|e| job_err(py, e))?;
        Ok(Self { inner })
    }

    /// `http://HOST:PORT` of the server.
    fn address(&self) -> String {
        self.inner.address()
    }

    /// `GET /api/version` as JSON.
    fn version_info(&self, py: Python<'_>) -> PyResult<String> {
        let v = py.detach(|| self.inner.version_info()).map_err(|e| job_err(py, e))?;
        Ok(v.to_string())
    }

    /// Prepares the request's `runtime_env` (uploads local `working_dir`/`py_modules`,
    /// paths relative to `cwd`) and submits it; returns the submission id.
    fn submit(&self, py: Python<'_>, request_json: &str, cwd: &str) -> PyResult<String> {
        let mut request: serde_json::Value =
            serde_json::from_str(request_json).map_err(json_err)?;
        py.detach(|| {
            let env = request.get("runtime_env").cloned().unwrap_or(serde_json::Value::Null);
            let ready =
                runtime_env::prepare(&self.inner, env, std::path::Path::new(cwd), &mut |_| {})?;
            request["runtime_env"] = ready;
            self.inner.submit(request)
        })
        .map_err(|e| job_err(py, e))
    }

    /// `GET /api/jobs/{id}` as JSON.
    fn job_info(&self, py: Python<'_>, job_id: &str) -> PyResult<String> {
        let v = py.detach(|| self.inner.job_info(job_id)).map_err(|e| job_err(py, e))?;
        Ok(v.to_string())
    }

    /// `GET /api/jobs/` as JSON.
    fn list(&self, py: Python<'_>) -> PyResult<String> {
        let v = py.detach(|| self.inner.list()).map_err(|e| job_err(py, e))?;
        Ok(serde_json::Value::Array(v).to_string())
    }

    fn stop(&self, py: Python<'_>, job_id: &str) -> PyResult<bool> {
        py.detach(|| self.inner.stop(job_id)).map_err(|e| job_err(py, e))
    }

    fn delete(&self, py: Python<'_>, job_id: &str) -> PyResult<bool> {
        py.detach(|| self.inner.delete(job_id)).map_err(|e| job_err(py, e))
    }

    fn logs(&self, py: Python<'_>, job_id: &str) -> PyResult<String> {
        py.detach(|| self.inner.logs(job_id)).map_err(|e| job_err(py, e))
    }

    /// `GET path` (with its query) on the same server, the body as text (Ray's state API
    /// for `tpuray.util.state`); `timeout` in seconds (default 600).
    #[pyo3(signature = (path, timeout=None))]
    fn get(&self, py: Python<'_>, path: &str, timeout: Option<f64>) -> PyResult<String> {
        let timeout = match timeout {
            None => std::time::Duration::from_secs(600),
            Some(t) if t.is_finite() && t > 0.0 => std::time::Duration::from_secs_f64(t),
            Some(t) => {
                return Err(PyValueError::new_err(format!(
                    "timeout must be a positive number of seconds (got {t})"
                )));
            }
        };
        py.detach(|| self.inner.get(path, timeout)).map_err(|e| job_err(py, e))
    }

    /// `GET path` read as it arrives (the logs API, `tpuray.util.state.get_log`):
    /// raises for a status other than 200, else a stream of the body's chunks;
    /// `timeout` (seconds, default 30) bounds the wait for the status.
    #[pyo3(signature = (path, timeout=None))]
    fn get_stream(
        &self,
        py: Python<'_>,
        path: &str,
        timeout: Option<f64>,
    ) -> PyResult<PyBodyStream> {
        let timeout = match timeout {
            None => std::time::Duration::from_secs(30),
            Some(t) if t.is_finite() && t > 0.0 => std::time::Duration::from_secs_f64(t),
            Some(t) => {
                return Err(PyValueError::new_err(format!(
                    "timeout must be a positive number of seconds (got {t})"
                )));
            }
        };
        let inner =
            py.detach(|| self.inner.get_stream(path, timeout)).map_err(|e| job_err(py, e))?;
        Ok(PyBodyStream { inner: Mutex::new(inner) })
    }

    /// A follower of the job's logs (see [`PyLogTail::next_chunk`]).
    fn tail(&self, job_id: &str) -> PyLogTail {
        PyLogTail { inner: Mutex::new(self.inner.tail(job_id)) }
    }
}

/// A job's log stream ([`job::LogTail`]).
#[pyclass(name = "LogTail", module = "tpuray._tpuray", frozen)]
struct PyLogTail {
    inner: Mutex<job::LogTail>,
}

#[pymethods]
impl PyLogTail {
    /// The next chunk of text, `None` once the job ended and every chunk was delivered.
    /// Blocks without the GIL until there is one.
    fn next_chunk(&self, py: Python<'_>) -> PyResult<Option<String>> {
        py.detach(|| {
            let mut t = self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            t.next_chunk()
        })
        .map_err(|e| job_err(py, e))
    }
}

/// Packs a local `working_dir` (`field="working_dir"`) or `py_modules` entry
/// (`field="py_modules"`) as Ray's client does (`tpuray_cli::job::runtime_env::package_local`:
/// `excludes` are gitignore patterns relative to the folder; a working_dir also leaves
/// out Ray's default excludes), for a driver to upload itself. Returns `(uri, bytes)`,
/// or `None` when `path` is a URI. Runs without the GIL.
///
/// Raises:
///     ValueError: not a folder or supported file, a bad pattern, too large.
#[pyfunction]
#[pyo3(signature = (field, path, excludes, cwd))]
fn package_local(
    py: Python<'_>,
    field: &str,
    path: &str,
    excludes: Vec<String>,
    cwd: &str,
) -> PyResult<Option<(String, Py<pyo3::types::PyBytes>)>> {
    let pkg = py
        .detach(|| runtime_env::package_local(field, path, std::path::Path::new(cwd), &excludes))
        .map_err(|e| job_err(py, e))?;
    Ok(pkg.map(|p| (p.uri, pyo3::types::PyBytes::new(py, &p.bytes).unbind())))
}

/// An HTTP answer's body, chunk by chunk ([`job::BodyStream`]).
#[pyclass(name = "BodyStream", module = "tpuray._tpuray", frozen)]
struct PyBodyStream {
    inner: Mutex<job::BodyStream>,
}

#[pymethods]
impl PyBodyStream {
    /// The next chunk of bytes, `None` at the body's end. Blocks without the GIL.
    fn next_chunk<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<Option<Bound<'py, pyo3::types::PyBytes>>> {
        let chunk = py
            .detach(|| {
                let mut b = self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                b.next_chunk()
            })
            .map_err(|e| job_err(py, e))?;
        Ok(chunk.map(|c| pyo3::types::PyBytes::new(py, &c)))
    }
}

/// Registers the classes in the extension module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyJobClient>()?;
    m.add_class::<PyLogTail>()?;
    m.add_function(wrap_pyfunction!(package_local, m)?)?;
    m.add_class::<PyBodyStream>()?;
    Ok(())
}
