//! Slice gangs (`tpuray::gang`): task gangs the core supervises (`gang_start`) and
//! generations reserved or adopted for actor gangs that Python supervises, until
//! `gang_release`.

use std::collections::BTreeMap;
use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use tpuray::Error;

use crate::objects::{PyRef, wrap};

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

/// Adds this module's functions and classes to the extension module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(gang_start, m)?)?;
    m.add_function(wrap_pyfunction!(gang_reserve, m)?)?;
    m.add_function(wrap_pyfunction!(gang_adopt, m)?)?;
    m.add_function(wrap_pyfunction!(gang_release, m)?)?;
    Ok(())
}
