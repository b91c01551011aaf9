//! User metrics (`tpuray.util.metrics`): define, record, and where this process reports.

use pyo3::prelude::*;

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

/// Adds this module's functions and classes to the extension module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(metric_define, m)?)?;
    m.add_function(wrap_pyfunction!(metric_record, m)?)?;
    m.add_function(wrap_pyfunction!(metric_destination, m)?)?;
    Ok(())
}
