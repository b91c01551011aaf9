//! The `tpuray` command line as a library function ([`run`]), called by the
//! native binary and by the Python package's console script (DESIGN.md §1).
//!
//! Verbs follow Ray's CLI (DESIGN.md §6): `start`, `status`, `list`, `stop`,
//! `memory`, `microbenchmark`, `serve status`, `timeline`, `k8s manifests` ([`k8s`]),
//! `job submit|status|logs|stop|list|delete`
//! (the client of the head's Jobs REST API is [`job`], also used by the Python package).
//! Hidden verbs `_head`, `_agent` and `_worker` are the long-running
//! processes that `start` spawns; they are not for users.

mod args;
pub mod job;
pub mod k8s;
mod logs;
mod microbench;
mod procs;
mod serve;
mod show;
pub mod timeline;

use clap::Parser;

pub use args::Cli;

/// Runs the CLI with `argv` (program name first); returns the exit code.
/// Errors are printed to stderr as `tpuray: <message>`.
pub fn run(argv: Vec<String>) -> i32 {
    let cli = match Cli::try_parse_from(argv) {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() { 2 } else { 0 };
        }
    };
    match args::dispatch(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("tpuray: {e:#}");
            1
        }
    }
}
