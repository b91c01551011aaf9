//! The `tpuray` command line as a library function ([`run`]), called by the
//! native binary and by the Python package's console script (DESIGN.md §1).
//!
//! Verbs follow Ray's CLI (DESIGN.md §6): `start`, `status`, `list`, `stop`,
//! `memory`, `microbenchmark`, `serve status`, `timeline`, `k8s manifests` ([`k8s`]),
//! `job submit|status|logs|stop|list|delete`, `tls make-ca|make-cert` ([`tls`])
//! (the client of the head's Jobs REST API is [`job`], also used by the Python package).
//! Hidden verbs `_head`, `_agent` and `_worker` are the long-running
//! processes that `start` spawns; they are not for users.
//!
//! Modules: `procs.rs` starts and stops processes; `show.rs` prints `status` and `list`
//! (tables or JSON lists; slices through `tpuray_head::slices`); `timeline.rs` writes
//! `tpuray timeline` (also called by the Python extension for `tpuray.timeline()`);
//! `k8s.rs` builds `tpuray k8s manifests`; `job/` is the Jobs REST API client;
//! `autoscaler/` runs on a thread of the head.

mod args;
pub mod autoscaler;
pub mod job;
pub mod k8s;
mod logs;
mod microbench;
mod procs;
mod serve;
mod show;
pub mod timeline;
pub mod tls;

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_python_serve_verbs_are_in_the_help_and_refused_by_name_without_the_python_sdk() {
        let argv = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let help =
            Cli::try_parse_from(argv(&["tpuray", "serve", "--help"])).unwrap_err().to_string();
        for verb in ["status", "run", "deploy", "build"] {
            assert!(help.contains(&format!("\n  {verb} ")), "{help}");
        }
        // The console script runs these in Python; the native binary names why it cannot.
        let cli =
            Cli::try_parse_from(argv(&["tpuray", "serve", "run", "m:app", "--name", "x"])).unwrap();
        let e = args::dispatch(cli).unwrap_err().to_string();
        assert!(e.contains("are the Python SDK's"), "{e}");
    }
}
