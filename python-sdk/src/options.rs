//! Task and actor options from Python: the argument list (`("v", bytes, refs)` values and
//! `("r", ref)` refs), scheduling strategies, and the option dicts `tpuray._private.options`
//! builds, as `tpuray::TaskOptions` / `ActorOptions`.

use std::collections::BTreeMap;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};
use tpuray::raw::Arg;
use tpuray::{ActorOptions, Scheduling, TaskOptions};

use crate::objects::PyRef;

/// Arguments from Python: `("v", bytes, [RefCore...])` values with their nested refs, or
/// `("r", RefCore)` top-level refs the executor resolves.
pub(crate) fn args_from(items: &Bound<'_, PyList>) -> PyResult<Vec<Arg>> {
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
pub(crate) fn scheduling_from(v: Option<&Bound<'_, PyAny>>) -> PyResult<Scheduling> {
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

pub(crate) fn get_opt<'py, T: FromPyObjectOwned<'py>>(
    d: &Bound<'py, PyDict>,
    k: &str,
) -> PyResult<Option<T>> {
    match d.get_item(k)? {
        Some(v) if !v.is_none() => Ok(Some(v.extract().map_err(Into::into)?)),
        _ => Ok(None),
    }
}

pub(crate) fn task_options(d: &Bound<'_, PyDict>) -> PyResult<TaskOptions> {
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

pub(crate) fn actor_options(d: &Bound<'_, PyDict>) -> PyResult<ActorOptions> {
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
