//! Actors: creation, method calls (plain and streaming) and the head's actor directory
//! (`list_actors`, `get_actor`, `actor_state`, `actor_record`, `kill_actor`).

use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use tpuray::ActorHandle;
use tpuray::raw;

use crate::errors::{call_err, cluster_err};
use crate::objects::{PyRef, wrap};
use crate::options::{actor_options, args_from};

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

/// Adds this module's functions and classes to the extension module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(create_actor, m)?)?;
    m.add_function(wrap_pyfunction!(call_actor, m)?)?;
    m.add_function(wrap_pyfunction!(call_actor_streaming, m)?)?;
    m.add_function(wrap_pyfunction!(list_actors, m)?)?;
    m.add_function(wrap_pyfunction!(kill_actor, m)?)?;
    m.add_function(wrap_pyfunction!(get_actor, m)?)?;
    m.add_function(wrap_pyfunction!(actor_state, m)?)?;
    m.add_function(wrap_pyfunction!(actor_record, m)?)?;
    Ok(())
}
