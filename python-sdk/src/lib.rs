//! `tpuray._tpuray`: the Python extension module. It exposes the command line
//! ([`tpuray_cli::run`]) and the Rust core worker through `tpuray::raw` (DESIGN.md §1: one
//! implementation, no second core in Python). The Python package (`python/tpuray`) builds
//! Ray's API on these calls; values cross as bytes that Python pickles itself, and
//! objects of the node's store come back as read-only mappings (`objects::ObjectBuffer`), so
//! large buffers (numpy arrays) are read without a copy.
//!
//! The bindings, by area: `objects.rs` (refs, get/put/wait, mapped store objects),
//! `tasks.rs` (tasks, streaming generators, cancellation), `actors.rs` (actor creation,
//! calls and the actor directory), `cluster.rs` (the driver's connection, cluster state,
//! KV, resources), `placement.rs` (placement groups), `gangs.rs` (slice gangs),
//! `metrics.rs` (user metrics), `worker.rs` (the worker process's runtime and async actor
//! calls), `jobs.rs` (the Jobs REST API client behind `tpuray.job_submission`, the CLI's
//! `tpuray_cli::job`); `options.rs` and `errors.rs` convert options in and errors out.
//!
//! Blocking calls release the GIL. In a worker process, [`worker`]'s `run_worker` installs
//! a [`tpuray::foreign::ForeignRuntime`] that calls back into the Python runtime object for
//! every task, actor constructor and method call.

use pyo3::prelude::*;

mod actors;
mod cluster;
mod errors;
mod gangs;
mod jobs;
mod metrics;
mod objects;
mod options;
mod placement;
mod tasks;
mod worker;

/// ALLOC-1: mimalloc for the extension's own allocations (Python objects keep Python's
/// allocator):
/// the core worker, and the head and node agents that `tpuray start` runs in this
/// process, allocate and free many small strings per task across threads, where glibc's
/// malloc cost a fifth of a driver's CPU (as for the `tpuray` binary, `cli/src/main.rs`).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
    objects::register(m)?;
    cluster::register(m)?;
    tasks::register(m)?;
    actors::register(m)?;
    metrics::register(m)?;
    placement::register(m)?;
    gangs::register(m)?;
    worker::register(m)?;
    jobs::register(m)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // Ray's `ray._raylet.OPTIMIZED`: whether this extension was compiled with
    // optimisations (benchmarks refuse a debug build: tpuray._private.build).
    m.add("OPTIMIZED", !cfg!(debug_assertions))?;
    Ok(())
}
