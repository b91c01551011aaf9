//! Errors of the SDK. [`TaskFailure`] is what crosses the wire when a task
//! fails; [`Error`] is what `get`, `wait` and submission return to users.

use tpuray_proto::pb;
use tpuray_proto::pb::task_error::Kind;

/// A task's failure as data (it crosses the wire in `PushTaskReply`).
#[derive(Clone, Debug, PartialEq)]
pub struct TaskFailure {
    pub kind: Kind,
    pub message: String,
    /// The error as its language serializes it (empty for Rust).
    pub payload: Vec<u8>,
    /// Never retried, even with `retry_exceptions` (an exception outside the listed ones).
    pub no_retry: bool,
}

impl TaskFailure {
    pub fn application(message: impl Into<String>) -> Self {
        Self::new(Kind::Application, message)
    }
    pub fn bad_arguments(message: impl Into<String>) -> Self {
        Self::new(Kind::BadArguments, message)
    }
    pub fn new(kind: Kind, message: impl Into<String>) -> Self {
        Self { kind, message: message.into(), payload: Vec::new(), no_retry: false }
    }
    /// An application error carrying its serialized exception.
    pub fn with_payload(message: impl Into<String>, payload: Vec<u8>) -> Self {
        Self { kind: Kind::Application, message: message.into(), payload, no_retry: false }
    }
}

/// Errors returned to SDK users; each names what failed. `Debug` prints the same
/// message as `Display`, so `fn main() -> Result<(), tpuray::Error>` ends with
/// `Error: no cluster address: ...` rather than the variant's fields.
#[derive(Clone, PartialEq, thiserror::Error)]
pub enum Error {
    /// The task's function returned an error or panicked (Ray's `RayTaskError`).
    #[error("task {function} failed on node {node} (pid {pid}): {message}")]
    Task {
        function: String,
        message: String,
        node: String,
        pid: u32,
        /// The error as its language serialized it (Python: the pickled exception).
        payload: Vec<u8>,
    },
    /// The worker running the task died and no retries were left (`WorkerCrashedError`).
    #[error("task {function}: the worker running it died: {message}")]
    WorkerDied { function: String, message: String },
    /// The node running the task died or became unreachable while it ran, and no
    /// retries were left: the worker's connection broke and the node's agent did not
    /// answer either (Ray's `NodeDiedError`; Ray decides the same way, asking the raylet
    /// for the failure cause: `GetErrorInfoFromGetTaskFailureCauseReply` in
    /// `src/ray/core_worker/task_submission/`).
    #[error("task {function}: {message}")]
    NodeDied { function: String, message: String },
    /// The actor's process was lost while it ran the call, no retries were left, and the
    /// actor may restart: the call may or may not have run (Ray's
    /// `ActorUnavailableError`, a `RayActorError`).
    #[error("actor {actor}: {message}")]
    ActorUnavailable { actor: String, message: String },
    /// The actor is dead or died during the call (`RayActorError`).
    #[error("actor {actor}: {message}")]
    ActorDied { actor: String, message: String },
    /// The task was cancelled (`TaskCancelledError`).
    #[error("task {function} was cancelled")]
    Cancelled { function: String },
    /// `get` or `wait` ran out of time (`GetTimeoutError`).
    #[error("timed out after {0:?} waiting for {1} object(s)")]
    Timeout(std::time::Duration, usize),
    /// The object's only copy was lost (`ObjectLostError`).
    #[error("object {id} was lost: {message}")]
    ObjectLost { id: String, message: String },
    /// Decoding a value as the requested type failed.
    #[error("{0}")]
    Decode(String),
    /// No live node could ever run the request, and fail-on-infeasible is on.
    #[error("infeasible: {0}")]
    Infeasible(String),
    /// The task's or actor's runtime environment could not be set up; the message is
    /// the installer's output (Ray's `RuntimeEnvSetupError`).
    #[error("task {function}: its runtime environment could not be set up: {message}")]
    RuntimeEnvSetup { function: String, message: String },
    /// A call to an actor was refused at submission: this process already has
    /// `limit` unfinished calls to it (Ray's `PendingCallsLimitExceeded`, from the
    /// actor's `max_pending_calls`).
    #[error("{message}")]
    PendingCallsLimitExceeded { function: String, message: String },
    /// The SDK is not initialised or the cluster cannot be reached.
    #[error("{0}")]
    Cluster(String),
}

impl Error {
    pub(crate) fn from_wire(e: &pb::TaskError, function: &str) -> Self {
        let function =
            if e.function_name.is_empty() { function.to_string() } else { e.function_name.clone() };
        match Kind::try_from(e.kind).unwrap_or(Kind::Application) {
            Kind::WorkerDied => Error::WorkerDied { function, message: e.message.clone() },
            Kind::NodeDied => Error::NodeDied { function, message: e.message.clone() },
            Kind::ActorDied => Error::ActorDied { actor: function, message: e.message.clone() },
            Kind::ActorUnavailable => {
                Error::ActorUnavailable { actor: function, message: e.message.clone() }
            }
            Kind::Cancelled => Error::Cancelled { function },
            Kind::PendingCallsLimitExceeded => {
                Error::PendingCallsLimitExceeded { function, message: e.message.clone() }
            }
            Kind::ObjectLost => Error::ObjectLost { id: function, message: e.message.clone() },
            Kind::Infeasible => Error::Infeasible(format!("task {function}: {}", e.message)),
            Kind::RuntimeEnvSetupFailed => {
                Error::RuntimeEnvSetup { function, message: e.message.clone() }
            }
            _ => Error::Task {
                function,
                message: e.message.clone(),
                node: e.node_id.clone(),
                pid: e.pid,
                payload: e.payload.clone(),
            },
        }
    }
}

impl std::fmt::Debug for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::Error;

    #[test]
    fn debug_reads_as_the_message_so_main_returning_result_prints_it() {
        let e = Error::Cluster("no cluster address: pass one to init()".into());
        assert_eq!(format!("{e:?}"), "no cluster address: pass one to init()");
        assert_eq!(format!("{e:?}"), e.to_string());
    }
}
