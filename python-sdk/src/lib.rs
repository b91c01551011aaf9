//! `tpuray._tpuray`: the Python extension module. For now it exposes the
//! command line ([`tpuray_cli::run`]), so the `tpuray` console script of the
//! Python package runs the same Rust code as the native binary (DESIGN.md §1).

use pyo3::prelude::*;

/// Runs the tpuray CLI with `argv` (program name first) and returns its exit
/// code. The GIL is released while it runs: `start --block`, `_head`,
/// `_agent` and `_worker` run for as long as the process lives.
#[pyfunction]
fn run(py: Python<'_>, argv: Vec<String>) -> i32 {
    py.detach(move || tpuray_cli::run(argv))
}

#[pymodule]
fn _tpuray(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(run, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
