//! A client of the Jobs REST API that the head serves on its dashboard port (Ray 2.60's
//! routes and JSON, DESIGN.md §13), and the `tpuray job` verbs built on it.
//!
//! - [`address`]: which server to talk to (`http://HOST:PORT`, a head's gRPC `HOST:PORT`
//!   resolved through `GetHeadInfo`, the environment, this machine's cluster).
//! - [`client`]: [`JobClient`], one HTTP/1.1 request per call and the log tail over a
//!   WebSocket; Ray's auth headers.
//! - [`package`]: `working_dir` and `py_modules` zipped as Ray's client zips them, with a
//!   content-hash URI (`gcs://_ray_pkg_<hex>.zip`), deterministic bytes.
//! - [`runtime_env`]: a job's `runtime_env` made ready to send: local paths uploaded and
//!   replaced by URIs, a requirements file read into a pip list.
//! - [`cmd`]: `tpuray job submit|status|logs|stop|list|delete`, printing Ray's lines.
//!
//! The Python package's `tpuray.job_submission` wraps [`JobClient`] (one implementation
//! of HTTP, packaging, auth and address resolution).
//!
//! Blocking: [`JobClient`]'s methods block the calling thread (they run on a small
//! runtime of this module's own, [`block_on`]; called from inside another tokio runtime,
//! they wait on a thread of their own). Nothing here runs user code.

pub mod address;
pub mod client;
pub mod cmd;
pub mod package;
pub mod runtime_env;

use std::future::Future;
use std::sync::OnceLock;

pub use client::{BodyStream, ClientOptions, JobClient, LogTail};

/// What went wrong talking to a job server, or preparing what to send it. The variants
/// are the kinds a caller maps to its own errors (the Python package: `ConnectionError`,
/// `AuthenticationError`, `RuntimeError`, `ValueError`).
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    /// The server could not be reached (refused, unresolvable, timed out).
    #[error("failed to connect to the job server at {address}: {reason}")]
    Connect { address: String, reason: String },
    /// The server refused the credentials: 401 (none sent) or 403 (a wrong one).
    #[error("{}", auth_message(*.status, .body))]
    Auth { status: u16, body: String },
    /// Any other answer than 200: the server's own words.
    #[error("request failed with status code {status}: {body}")]
    Status { status: u16, body: String },
    /// The address could not be used or resolved.
    #[error("{0}")]
    Address(String),
    /// Input that is not what the API expects (a runtime_env, a flag's value).
    #[error("{0}")]
    Invalid(String),
    /// A local file or folder could not be read or packaged.
    #[error("{0}")]
    Package(String),
    /// The server answered 200 with something that is not Ray's reply shape.
    #[error("{0}")]
    Protocol(String),
}

fn auth_message(status: u16, body: &str) -> String {
    let body = body.trim();
    if status == 401 {
        format!(
            "authentication required (401: {body}): the job server's cluster uses token auth; \
             send its token (TPURAY_AUTH_TOKEN, ~/.tpuray/auth_token, or --headers \
             '{{\"Authorization\": \"Bearer <token>\"}}')"
        )
    } else {
        format!(
            "authentication failed (403: {body}): the token sent is not this cluster's \
             (the cluster's is in ~/.tpuray/auth_token of whoever started it)"
        )
    }
}

/// The runtime the blocking calls run on: two worker threads, made on first use.
fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("tpuray-jobs")
            .enable_all()
            .build()
            .expect("the jobs client's runtime starts")
    })
}

/// Runs `f` to completion on this module's runtime, blocking the calling thread. A
/// thread inside some tokio runtime (a task's executor thread in a worker, say) cannot
/// block on another runtime, so from there `f` runs on a scoped thread of its own.
pub fn block_on<F>(f: F) -> F::Output
where
    F: Future + Send,
    F::Output: Send,
{
    if tokio::runtime::Handle::try_current().is_ok() {
        std::thread::scope(|s| {
            s.spawn(|| runtime().block_on(f)).join().expect("the jobs client's call panicked")
        })
    } else {
        runtime().block_on(f)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn blocking_calls_work_from_inside_another_runtime() {
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let v = rt.block_on(async { super::block_on(async { 7 }) });
        assert_eq!(v, 7);
        assert_eq!(super::block_on(async { 8 }), 8);
    }
}
