//! Why an agent operation failed: [`AgentError`], the agent's domain error. Agent code
//! returns it; only the gRPC service (`service.rs`) turns it into a gRPC status, as the
//! ledger's [`LedgerError`] is turned at the same edge (and failed head calls into it).

use tpuray_proto::ids::NodeId;

use crate::ledger::LedgerError;

/// Why the agent could not grant a lease, start a worker or take a request. Each variant
/// says how a caller should take it (the gRPC code it is answered with is in brackets).
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The node cannot do it now; the same request may pass shortly: the agent is
    /// stopping or draining, devices are held by idle workers being stopped, a worker
    /// binary could not be fetched (`UNAVAILABLE`).
    #[error("{0}")]
    Unavailable(String),
    /// The request itself is malformed or asks for what can never be given: a chip
    /// count other than TPU.md's, resources that do not parse (`INVALID_ARGUMENT`).
    #[error("{0}")]
    BadRequest(String),
    /// The request is well formed but will not pass on a retry: a runtime environment
    /// record missing or not JSON, a worker binary never uploaded, an actor's
    /// constructor that raised (`FAILED_PRECONDITION`).
    #[error("{0}")]
    Refused(String),
    /// AGENT-14: the runtime environment could not be set up (the installer's output, a
    /// missing package, a malformed environment, the setup timeout). A lease request
    /// answers it as its `SetupFailed` outcome; elsewhere it is `FAILED_PRECONDITION`
    /// with [`tpuray_proto::runtime_env::SETUP_FAILED_PREFIX`] before the message.
    #[error("{0}")]
    SetupFailed(String),
    /// Something the agent named is not here: a worker it did not start (`NOT_FOUND`).
    #[error("{0}")]
    NotFound(String),
    /// A worker process did not register in time (`DEADLINE_EXCEEDED`).
    #[error("{0}")]
    Timeout(String),
    /// The node's resource ledger refused (its own codes, [`LedgerError::into_status`]).
    #[error("node {node}: {error}")]
    Ledger { node: NodeId, error: LedgerError },
    /// A call to the head failed; its code and message are passed on as the head gave
    /// them, so a caller retries a head that is electing a leader as it would itself.
    #[error("{message}")]
    Head { code: tonic::Code, message: String },
    /// A local failure: a log file or creation file that cannot be written, a worker
    /// process that cannot be spawned or died before registering (`INTERNAL`).
    #[error("{0}")]
    Internal(String),
}

impl AgentError {
    /// The ledger's refusal `error` on node `node`.
    pub fn ledger(node: &NodeId, error: LedgerError) -> Self {
        AgentError::Ledger { node: node.clone(), error }
    }

    /// Whether the service answers this error `UNAVAILABLE`: the caller may retry the
    /// same request shortly (AGENT-7's wait for chips retries on it too).
    pub fn is_unavailable(&self) -> bool {
        match self {
            AgentError::Unavailable(_) => true,
            AgentError::Ledger { error, .. } => matches!(error, LedgerError::DevicesBusy(_)),
            AgentError::Head { code, .. } => *code == tonic::Code::Unavailable,
            _ => false,
        }
    }
}
