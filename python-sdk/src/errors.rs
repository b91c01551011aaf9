//! How core errors become Python exceptions: `RuntimeError` for cluster failures,
//! `ValueError` for bad options or a refused cancel, `PendingCallsLimitExceeded`, and the
//! `(kind, message, payload, function, node, pid)` tuples `get` hands Python's exception
//! mapping.

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use tpuray::Error;

pub(crate) fn cluster_err(e: Error) -> PyErr {
    PyRuntimeError::new_err(e.to_string())
}

/// Bad task options (a chip or GPU count, a bundle index, a label selector) are Python
/// `ValueError`s, as on Ray; anything else as [`cluster_err`].
pub(crate) fn options_err(e: Error) -> PyErr {
    match e {
        Error::Cluster(m) if m.starts_with("task options:") || m.starts_with("label_selector:") => {
            PyValueError::new_err(m)
        }
        e => cluster_err(e),
    }
}

/// A submission error as Python raises it: `PendingCallsLimitExceeded` (from
/// `tpuray.exceptions`) for a call over the actor's `max_pending_calls`, else as
/// [`cluster_err`].
pub(crate) fn call_err(py: Python<'_>, e: Error) -> PyErr {
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

/// A refused cancel as Python raises it: `force` for an actor call is Ray's
/// `ValueError`.
pub(crate) fn cancel_err(e: Error) -> PyErr {
    match &e {
        Error::Cluster(m) if m.starts_with("force=True is not supported") => {
            PyValueError::new_err(m.clone())
        }
        _ => cluster_err(e),
    }
}

/// The kind of an error as Python's exception mapping names it.
pub(crate) fn error_tuple(py: Python<'_>, e: Error) -> PyResult<Py<PyAny>> {
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
