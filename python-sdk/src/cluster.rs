//! The driver's connection and the cluster's state: `init_driver`, `shutdown`, this
//! process's identity, TPU slice arithmetic, the head's KV, `ray.nodes()`, resources, the
//! timeline, worker output to the driver and prestarted workers.

use std::collections::BTreeMap;

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use tpuray::raw;

use crate::errors::cluster_err;

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

#[pyfunction]
fn cluster_resources(py: Python<'_>) -> PyResult<BTreeMap<String, f64>> {
    py.detach(tpuray::cluster_resources).map_err(cluster_err)
}

#[pyfunction]
fn available_resources(py: Python<'_>) -> PyResult<BTreeMap<String, f64>> {
    py.detach(tpuray::available_resources).map_err(cluster_err)
}

/// Adds this module's functions and classes to the extension module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(init_driver, m)?)?;
    m.add_function(wrap_pyfunction!(tpu_slice_shape, m)?)?;
    m.add_function(wrap_pyfunction!(process_info, m)?)?;
    m.add_function(wrap_pyfunction!(dashboard_url, m)?)?;
    m.add_function(wrap_pyfunction!(is_initialized, m)?)?;
    m.add_function(wrap_pyfunction!(shutdown, m)?)?;
    m.add_function(wrap_pyfunction!(report_logs, m)?)?;
    m.add_function(wrap_pyfunction!(set_log_to_driver, m)?)?;
    m.add_function(wrap_pyfunction!(prestart_workers, m)?)?;
    m.add_function(wrap_pyfunction!(kv_get, m)?)?;
    m.add_function(wrap_pyfunction!(kv_put, m)?)?;
    m.add_function(wrap_pyfunction!(kv_delete, m)?)?;
    m.add_function(wrap_pyfunction!(nodes, m)?)?;
    m.add_function(wrap_pyfunction!(available_resources_per_node, m)?)?;
    m.add_function(wrap_pyfunction!(timeline_json, m)?)?;
    m.add_function(wrap_pyfunction!(cluster_resources, m)?)?;
    m.add_function(wrap_pyfunction!(available_resources, m)?)?;
    Ok(())
}
