//! The node agent: the node's resources, its pool of worker processes,
//! worker leases with spillback, and actor workers started for the head.
//!
//! Threads: the gRPC service and the worker pool run on the caller's tokio
//! runtime; heartbeats run on a dedicated OS thread with its own runtime
//! (AGENT-1), so no amount of RPC or worker load delays them. No user code
//! runs in the agent process.
//!
//! The node's resources, bundles, chips and GPUs are a plain ledger (`ledger.rs`, no
//! locks or clocks of its own) held under the agent's state lock. Agent code returns
//! [`AgentError`] (`error.rs`); only the gRPC service (`service.rs`) turns it, and the
//! ledger's errors, into gRPC statuses.
//!
//! The modules, by seam:
//! - `mod.rs` (here): the settings, the agent's state (workers, leases, demand, the
//!   cluster view) and its lock.
//! - `soft_state.rs`: what heartbeats, `/metrics` and `ListWorkers` read, the view of the
//!   other nodes and the demand waiting here.
//! - `resources.rs`: the ledger behind the agent: resources taken and given back, CPUs
//!   lent while blocked, bundles, chips and GPUs.
//! - `spawn.rs`: starting worker processes (command, environment, runtime env, logs,
//!   registration) and pre-starting them.
//! - `leases.rs`: lease requests (decide, grant, spill, queue) and returns.
//! - `actors.rs`: actor workers started and killed for the head.
//! - `lifecycle.rs`: worker exits, idle reaping, orphaned leases, draining and shutdown.
//! - `service.rs`: the `NodeAgentService` handlers: wire messages in, domain calls,
//!   statuses out.
//!
//! Invariants:
//! - AGENT-2: resources are taken when a lease or actor worker is granted and
//!   given back exactly once, when the lease is returned or its worker exits,
//!   however it exits.
//! - AGENT-3: a worker is reused only for a lease with the same pool key
//!   (job, language, runtime env, chips: DESIGN.md §11).
//! - AGENT-4: a lease request is granted, spilled, answered infeasible (and
//!   listed as infeasible demand) or waits listed as pending demand; never
//!   silently.
//! - AGENT-5: leases whose holder stops answering are reclaimed.
//! - AGENT-7: on a TPU host, a worker that needs k chips gets the lowest
//!   free aligned block of k (SCHED-12) and TPU.md's environment for it
//!   (`TPU_VISIBLE_CHIPS`, bounds, a libtpu port of its own); it holds the
//!   block until the process exits, however it exits, and is reused only for
//!   work needing the same number of chips (the block is part of its pool
//!   key, AGENT-3). Idle workers holding chips are stopped when a request
//!   cannot otherwise get a block.
//! - AGENT-8: at most the node's CPU count of worker processes start at once
//!   (Ray's `maximum_startup_concurrency`); a lease waiting for a start slot
//!   takes an idle worker instead when one frees up. Python jobs' workers run
//!   the driver's interpreter (`python -m tpuray._worker`) with its `sys.path`
//!   and working directory, from the job's runtime record in the KV.
//! - AGENT-6: placement-group bundles are reserved in two phases: prepare sets
//!   their resources aside (all of a request or none), commit adds the
//!   group's renamed resources (SCHED-19) to the node's total; return gives
//!   the resources back and stops every worker that used the group's
//!   resources. A prepared bundle not committed within
//!   [`PREPARED_BUNDLE_TTL`] is returned on its own (the head gave up).
//!
//! AGENT-6 in detail: returning a bundle SIGKILLs every worker that used it. Each bundle
//! call answers the amounts of the resources it touched (`NodeResourcesNow.partial`),
//! which the head puts into its view of the node at once; the whole sets come with
//! heartbeats.
//!
//! AGENT-9..12 and AGENT-16 are stated in the module that keeps each: `spawn.rs`
//! (AGENT-9), `resources.rs` (AGENT-10, AGENT-11), `leases.rs` (AGENT-12), `lifecycle.rs`
//! and `run.rs` (AGENT-16); AGENT-13..15 in `jobs.rs` and `runtime_env/`.

mod actors;
mod error;
mod leases;
mod lifecycle;
mod resources;
mod service;
mod soft_state;
mod spawn;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{Notify, oneshot};
use tpuray_proto::ids::{ActorId, LeaseId, NodeId, WorkerId};
use tpuray_scheduler::{Amount, Labels, NodeView, ResourceSet};

use crate::ledger::{Hold, Ledger};

pub use error::AgentError;
pub use service::AgentSvc;
use spawn::startup_concurrency;

/// Node agent settings.
#[derive(Clone, Debug)]
pub struct AgentConfig {
    pub node_id: NodeId,
    /// Head address(es), `host:port[,host:port...]`.
    pub head_address: String,
    /// Address other processes use to reach this agent (`host:port`).
    pub advertise_address: String,
    pub total: ResourceSet,
    pub labels: Labels,
    pub is_head_node: bool,
    pub session_dir: PathBuf,
    pub token: Option<String>,
    /// Program and leading arguments that start a worker process.
    pub worker_command: Vec<String>,
    /// Idle workers above this many are stopped after `idle_worker_timeout`.
    pub max_idle_workers: usize,
    pub idle_worker_timeout: Duration,
    /// How long a worker may take to start and register.
    pub worker_register_timeout: Duration,
    /// This node's object store.
    pub store: tpuray_objectstore::LocalStore,
}

/// KV namespace of each Python job's runtime record (interpreter, `sys.path`, working
/// directory, environment variables), keyed by job id.
pub const JOB_RUNTIME_NAMESPACE: &str = "job_runtime";
/// KV namespace of runtime environments (JSON), keyed by their hash.
pub const RUNTIME_ENV_NAMESPACE: &str = "runtime_env";

/// A worker pool key (AGENT-3).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PoolKey {
    pub job_id: String,
    pub language: String,
    pub runtime_env_hash: String,
    pub tpu_chips: Vec<u32>,
    /// GPU ids (and shares) the worker holds, `CUDA_VISIBLE_DEVICES` (AGENT-10).
    pub gpus: Vec<(u32, Amount)>,
}

#[derive(Clone, Debug, PartialEq)]
enum WorkerState {
    Starting,
    Idle { since: Instant },
    Leased(LeaseId),
    Actor(ActorId),
}

struct WorkerEntry {
    pid: u32,
    key: PoolKey,
    address: String,
    state: WorkerState,
    /// Set when the agent itself stops the process (kill, idle reaping).
    exit_intended: bool,
    /// AGENT-15: the cached environment directories it runs in, released when the
    /// entry goes (the process exited).
    _env_uses: Option<crate::runtime_env::EnvUses>,
}

struct Lease {
    worker_id: WorkerId,
    /// What it holds, and the CPUs lent back while its worker is blocked (AGENT-11).
    hold: Hold,
    /// The lease holder's WorkerService address ("" when unknown).
    owner: String,
}

/// A demand shape waiting here, for heartbeats and `tpuray status`.
struct Demand {
    shape: ResourceSet,
    infeasible: bool,
    reason: String,
    /// Requests waiting now (pending) or last seen (infeasible).
    waiting: u32,
    last_seen: Instant,
}

struct AgentState {
    /// Resources, bundles, chips and GPUs (`ledger.rs`).
    ledger: Ledger,
    workers: HashMap<WorkerId, WorkerEntry>,
    leases: HashMap<LeaseId, Lease>,
    actor_resources: HashMap<ActorId, (WorkerId, ResourceSet)>,
    starting: HashMap<WorkerId, oneshot::Sender<(String, u32)>>,
    demands: HashMap<String, Demand>,
    /// Per job, from the head: (worker binary hash, "" without one; driver address).
    job_binaries: HashMap<String, (String, String)>,
    /// Other nodes as of the last heartbeat reply: view and agent address.
    cluster: Vec<(NodeView<String>, String)>,
}

/// The node agent's shared state.
pub struct Agent {
    pub config: AgentConfig,
    st: Mutex<AgentState>,
    /// Signalled whenever resources are given back or a worker becomes idle.
    freed: Notify,
    /// Worker processes starting at once, at most the node's CPUs (Ray's
    /// `maximum_startup_concurrency`): interpreters booting in parallel on a
    /// small machine only slow each other down (AGENT-8).
    starts: Arc<tokio::sync::Semaphore>,
    /// Set once the agent is shutting down: no new workers.
    stopping: std::sync::atomic::AtomicBool,
    /// Set on SIGTERM (AGENT-16): the head was told this node is leaving, no lease is
    /// granted, heartbeats stop, `/readyz` answers 503; running tasks may finish.
    pub draining: std::sync::atomic::AtomicBool,
    /// Set when the agent stops itself because the head refused it or was lost: the
    /// shutdown that follows stops the workers without waiting for them.
    pub exit_without_drain: std::sync::atomic::AtomicBool,
    /// Set once the head registered this node (`/readyz` answers 200 from then on).
    pub joined: std::sync::atomic::AtomicBool,
    /// Whether the cluster checks tokens (AUTH-1), as the head said at registration.
    pub auth_required: std::sync::atomic::AtomicBool,
    /// Jobs API jobs supervised here, and their runtime environments (AGENT-13).
    pub supervisors: crate::jobs::Supervisors,
    /// `/metrics`: reports of this node's processes, samples, series exported (`metrics.rs`).
    pub metrics: crate::metrics::AgentMetrics,
}

/// How long an infeasible shape stays listed after its last request.
const INFEASIBLE_TTL: Duration = Duration::from_secs(10);
pub use crate::ledger::PREPARED_BUNDLE_TTL;

impl Agent {
    pub fn new(config: AgentConfig) -> Arc<Self> {
        Arc::new(Self {
            st: Mutex::new(AgentState {
                ledger: Ledger::new(config.total.clone()),
                workers: HashMap::new(),
                leases: HashMap::new(),
                actor_resources: HashMap::new(),
                starting: HashMap::new(),
                demands: HashMap::new(),
                job_binaries: HashMap::new(),
                cluster: Vec::new(),
            }),
            starts: Arc::new(tokio::sync::Semaphore::new(startup_concurrency(&config.total))),
            config,
            freed: Notify::new(),
            stopping: std::sync::atomic::AtomicBool::new(false),
            draining: std::sync::atomic::AtomicBool::new(false),
            joined: std::sync::atomic::AtomicBool::new(false),
            exit_without_drain: std::sync::atomic::AtomicBool::new(false),
            auth_required: std::sync::atomic::AtomicBool::new(true),
            supervisors: Default::default(),
            metrics: Default::default(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, AgentState> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn head_leader(&self) -> String {
        // Every head's address: the head client follows the leader (CLIENT-1).
        self.config.head_address.clone()
    }

    /// Whether this node is draining (AGENT-16).
    pub fn is_draining(&self) -> bool {
        self.draining.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// Sends a signal to a process, ignoring "no such process".
pub fn signal(pid: u32, sig: i32) {
    if pid > 0 {
        // SAFETY: kill(2) with a positive pid has no memory effects.
        unsafe {
            libc::kill(pid as i32, sig);
        }
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "localhost".to_string())
}
