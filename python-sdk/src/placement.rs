//! Placement groups: create, look up, wait for, list and remove them, and TPU slice
//! groups (`slice_placement_group`).

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::errors::cluster_err;

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

/// Adds this module's functions and classes to the extension module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(create_placement_group, m)?)?;
    m.add_function(wrap_pyfunction!(placement_group_state, m)?)?;
    m.add_function(wrap_pyfunction!(placement_group_table, m)?)?;
    m.add_function(wrap_pyfunction!(remove_placement_group, m)?)?;
    m.add_function(wrap_pyfunction!(get_placement_group, m)?)?;
    m.add_function(wrap_pyfunction!(slice_placement_group, m)?)?;
    Ok(())
}
