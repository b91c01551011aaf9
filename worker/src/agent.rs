//! The node agent: the node's resources, its pool of worker processes,
//! worker leases with spillback, and actor workers started for the head.
//!
//! Threads: the gRPC service and the worker pool run on the caller's tokio
//! runtime; heartbeats run on a dedicated OS thread with its own runtime
//! (AGENT-1), so no amount of RPC or worker load delays them. No user code
//! runs in the agent process.
//!
//! The node's resources, bundles, chips and GPUs are a plain ledger (`ledger.rs`, no
//! locks or clocks of its own) held under the agent's state lock; its errors become
//! gRPC statuses here, at the service edge.
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

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{Notify, oneshot};
use tonic::{Request, Response, Status};
use tpuray_proto::convert::{labels_from_proto, resources_from_proto, resources_to_proto};
use tpuray_proto::ids::{ActorId, JobId, LeaseId, NodeId, WorkerId};
use tpuray_proto::pb::node_agent_service_server::NodeAgentService;
use tpuray_proto::runtime_env::SETUP_FAILED_PREFIX;
use tpuray_proto::{check_protocol_version, now_ms, pb};
use tpuray_scheduler::{Amount, Decision, Labels, NodeView, ResourceSet};

use crate::ledger::{Hold, Ledger, LedgerError};
use crate::registry;

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

/// The environment of a worker started for a task's runtime environment record: its
/// `env_vars`, and the whole record as `TPURAY_RUNTIME_ENV` for the worker's language
/// runtime.
fn runtime_env_vars(v: &serde_json::Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    if let Some(vars) = v.get("env_vars").and_then(|e| e.as_object()) {
        for (k, val) in vars {
            let val = match val {
                serde_json::Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            out.push((k.clone(), val));
        }
    }
    out.push(("TPURAY_RUNTIME_ENV".to_string(), v.to_string()));
    out
}

/// How to start a worker process.
#[derive(Clone, Debug, Default)]
struct WorkerCommand {
    argv: Vec<String>,
    env: Vec<(String, String)>,
    cwd: Option<PathBuf>,
}

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

    /// This node's info as sent at registration.
    pub fn node_info(&self) -> pb::NodeInfo {
        let st = self.lock();
        pb::NodeInfo {
            node_id: self.config.node_id.to_string(),
            address: self.config.advertise_address.clone(),
            hostname: hostname(),
            total: resources_to_proto(&self.config.total),
            available: resources_to_proto(st.ledger.available()),
            labels: self.config.labels.0.clone().into_iter().collect(),
            state: pb::NodeState::Alive as i32,
            is_head_node: self.config.is_head_node,
            death_reason: String::new(),
            start_time_ms: now_ms(),
            last_heartbeat_ms: 0,
            pending: vec![],
            num_workers: st.workers.len() as u32,
            session_dir: self.config.session_dir.display().to_string(),
            pid: std::process::id(),
            object_store_dir: self.config.store.dir().display().to_string(),
            metrics_export_port: u32::from(self.metrics.port.get().copied().unwrap_or(0)),
        }
    }

    /// What `/metrics` reads from the agent's state (`metrics.rs`).
    pub fn metrics_view(&self) -> crate::metrics::AgentView {
        let st = self.lock();
        crate::metrics::AgentView {
            total: st.ledger.total().clone(),
            available: st.ledger.available().clone(),
            workers: st
                .workers
                .iter()
                .map(|(id, w)| crate::metrics::WorkerView {
                    worker_id: id.to_string(),
                    pid: w.pid,
                    job_id: w.key.job_id.clone(),
                    state: match w.state {
                        WorkerState::Starting => "STARTING",
                        WorkerState::Idle { .. } => "IDLE",
                        WorkerState::Leased(_) => "LEASED",
                        WorkerState::Actor(_) => "ACTOR",
                    },
                    tpu_chips: w.key.tpu_chips.clone(),
                })
                .collect(),
            tpu_chips: st.ledger.host_chips(),
        }
    }

    /// What a heartbeat carries: total and available resources, demand, worker count.
    pub fn heartbeat_snapshot(&self) -> (ResourceSet, ResourceSet, Vec<pb::ResourceDemand>, u32) {
        let mut st = self.lock();
        st.demands.retain(|_, d| {
            d.waiting > 0 || (d.infeasible && d.last_seen.elapsed() < INFEASIBLE_TTL)
        });
        let demands = st
            .demands
            .values()
            .map(|d| pb::ResourceDemand {
                shape: resources_to_proto(&d.shape),
                count: d.waiting.max(1),
                infeasible: d.infeasible,
                reason: d.reason.clone(),
                placement_group_id: String::new(),
            })
            .collect();
        (st.ledger.total().clone(), st.ledger.available().clone(), demands, st.workers.len() as u32)
    }

    /// Records the head's view of the other nodes from a heartbeat reply: the whole view,
    /// or with `delta` (HEAD-13) the nodes that changed, applied over the view held, and
    /// the ids of those `removed`.
    pub fn set_cluster_view(&self, nodes: Vec<pb::NodeInfo>, delta: bool, removed: &[String]) {
        let views: Vec<(NodeView<String>, String)> = nodes
            .into_iter()
            .filter(|n| n.node_id != self.config.node_id.as_str())
            .filter_map(|n| {
                let total = resources_from_proto(&n.total).ok()?;
                let available = resources_from_proto(&n.available).ok()?;
                Some((
                    NodeView {
                        id: n.node_id,
                        total,
                        available,
                        labels: Labels(n.labels.into_iter().collect()),
                        alive: true,
                    },
                    n.address,
                ))
            })
            .collect();
        let mut st = self.lock();
        if !delta {
            st.cluster = views;
            return;
        }
        apply_view_delta(&mut st.cluster, views, removed);
    }

    /// Reads the live nodes from the head now, instead of waiting for the next
    /// heartbeat's view (a node that joined a moment ago, named by node affinity).
    async fn refresh_cluster_view(&self) {
        let Ok(mut head) =
            tpuray_proto::client::head(&self.head_leader(), self.config.token.as_deref())
        else {
            return;
        };
        let mut req = Request::new(pb::GetClusterStatusRequest {});
        req.set_timeout(Duration::from_secs(2));
        if let Ok(r) = head.get_cluster_status(req).await {
            let alive = r
                .into_inner()
                .nodes
                .into_iter()
                .filter(|n| n.state == pb::NodeState::Alive as i32)
                .collect();
            self.set_cluster_view(alive, false, &[]);
        }
    }

    fn local_view(&self, st: &AgentState) -> NodeView<String> {
        NodeView {
            id: self.config.node_id.to_string(),
            total: st.ledger.total().clone(),
            available: st.ledger.available().clone(),
            labels: self.config.labels.clone(),
            alive: true,
        }
    }

    /// Takes `r` from the node's available resources (a job entrypoint's), all or none.
    ///
    /// # Errors
    /// A message naming what is needed and what is free.
    pub(crate) fn take_resources(&self, r: &ResourceSet) -> Result<(), String> {
        self.lock()
            .ledger
            .take("a job entrypoint's resources", r)
            .map_err(|e| format!("node {}: {e}", self.config.node_id))
    }

    /// Gives back what [`Agent::take_resources`] took (once, AGENT-2).
    pub(crate) fn give_back_resources(&self, r: &ResourceSet) {
        self.lock().ledger.release(r);
        self.freed.notify_waiters();
    }

    /// AGENT-11: a leased worker blocked in get/wait lends its lease's CPUs back to the
    /// node (so the work it waits for can run here, as on Ray) and takes them back when it
    /// runs again (the node may be oversubscribed for a moment). Unknown or unleased
    /// workers are ignored; repeated notifications change nothing.
    fn set_blocked(&self, worker: &WorkerId, blocked: bool) {
        if self.lend_cpus(worker, blocked) && blocked {
            self.freed.notify_waiters();
        }
    }

    /// [`Agent::set_blocked`]'s bookkeeping; whether anything changed.
    fn lend_cpus(&self, worker: &WorkerId, blocked: bool) -> bool {
        let mut st = self.lock();
        let st = &mut *st;
        match st.leases.values_mut().find(|l| &l.worker_id == worker) {
            Some(lease) => st.ledger.lend_cpus(&mut lease.hold, blocked),
            None => false,
        }
    }

    /// The names the bundles `indexes` of `pg` here touch ([`Ledger::bundle_names`]).
    fn bundle_names(&self, pg: &str, indexes: &[u32]) -> std::collections::BTreeSet<String> {
        self.lock().ledger.bundle_names(pg, indexes)
    }

    /// The amounts of `names` now, for the head's view ([`Ledger::resources_of`]).
    fn resources_of(&self, names: &std::collections::BTreeSet<String>) -> pb::NodeResourcesNow {
        self.lock().ledger.resources_of(names)
    }

    /// AGENT-6 phase one ([`Ledger::prepare_bundles`]).
    ///
    /// # Errors
    /// `RESOURCE_EXHAUSTED` naming what is missing when they do not all fit now.
    pub fn prepare_bundles(&self, pg: &str, bundles: &[(u32, ResourceSet)]) -> Result<(), Status> {
        self.lock()
            .ledger
            .prepare_bundles(pg, bundles, Instant::now())
            .map_err(|e| e.into_status(&self.config.node_id))
    }

    /// AGENT-6 phase two ([`Ledger::commit_bundles`]).
    ///
    /// # Errors
    /// `NOT_FOUND` when a bundle is not prepared here (it expired or was returned).
    pub fn commit_bundles(&self, pg: &str, indexes: &[u32]) -> Result<(), Status> {
        self.lock()
            .ledger
            .commit_bundles(pg, indexes)
            .map_err(|e| e.into_status(&self.config.node_id))?;
        self.freed.notify_waiters();
        Ok(())
    }

    /// Gives back bundles of `pg` on this node (all of them when `indexes` is empty) and
    /// stops the workers that used them (AGENT-6). Returns how many workers were stopped.
    pub fn return_bundles(&self, pg: &str, indexes: &[u32]) -> u32 {
        let mut kill = Vec::new();
        {
            let mut st = self.lock();
            let st = &mut *st;
            st.ledger.return_bundles(pg, indexes);
            let uses = |r: &ResourceSet| crate::ledger::uses_bundles(r, pg, indexes);
            let mut doomed: Vec<WorkerId> = st
                .leases
                .values()
                .filter(|l| uses(&l.hold.resources))
                .map(|l| l.worker_id.clone())
                .collect();
            doomed.extend(
                st.actor_resources.values().filter(|(_, r)| uses(r)).map(|(w, _)| w.clone()),
            );
            for wid in doomed {
                if let Some(w) = st.workers.get_mut(&wid) {
                    w.exit_intended = true;
                    kill.push(w.pid);
                }
            }
        }
        for &pid in &kill {
            signal(pid, libc::SIGKILL);
        }
        self.freed.notify_waiters();
        kill.len() as u32
    }

    /// Returns prepared bundles whose commit never came (AGENT-6).
    pub fn expire_prepared_bundles(&self) {
        let expired = self.lock().ledger.expired_bundles(Instant::now());
        for (pg, i) in expired {
            tracing::warn!(%pg, bundle = i, "prepared bundle was never committed; returning it");
            self.return_bundles(&pg, &[i]);
        }
    }

    /// Takes the lowest free aligned block of `k` chips, or exactly `exact` (AGENT-7,
    /// [`Ledger::allocate_chips`]). When none is free but idle workers hold chips, stops
    /// them and asks the caller to retry (`UNAVAILABLE`).
    fn allocate_chips(&self, k: u32, exact: Option<&[u32]>) -> Result<Vec<u32>, Status> {
        let mut st = self.lock();
        match st.ledger.allocate_chips(k, exact) {
            Ok(c) => Ok(c),
            Err(LedgerError::DevicesBusy(e)) => {
                let stopped = stop_idle_holders(&mut st, |k| !k.tpu_chips.is_empty());
                Err(Status::unavailable(format!(
                    "{e}; stopped {stopped} idle worker(s) holding chips, retry shortly"
                )))
            }
            Err(e) => Err(e.into_status(&self.config.node_id)),
        }
    }

    /// Gives back the chips and GPUs a worker of `key` held (AGENT-7, AGENT-10).
    fn release_devices(&self, key: &PoolKey) {
        self.lock().ledger.release_devices(&key.tpu_chips, &key.gpus);
    }

    /// GPU ids for a worker needing `amount` of GPU (AGENT-10, [`Ledger::allocate_gpus`]).
    /// When the GPUs are held by idle workers, stops them and asks the caller to retry,
    /// as for chips.
    fn allocate_gpus(&self, amount: Amount) -> Result<Vec<(u32, Amount)>, Status> {
        let mut st = self.lock();
        match st.ledger.allocate_gpus(amount) {
            Ok(g) => Ok(g),
            Err(LedgerError::DevicesBusy(e)) => {
                let stopped = stop_idle_holders(&mut st, |k| !k.gpus.is_empty());
                Err(Status::unavailable(format!(
                    "{e}; stopped {stopped} idle worker(s) holding GPUs, retry shortly"
                )))
            }
            Err(e) => Err(e.into_status(&self.config.node_id)),
        }
    }

    /// This host's TPU generation, from its `accelerator-type` label (v6e when unknown: it
    /// only changes the bounds of v7x).
    fn tpu_generation(&self) -> tpuray_scheduler::TpuGeneration {
        self.config
            .labels
            .get("tpuray.io/accelerator-type")
            .and_then(tpuray_scheduler::TpuGeneration::parse)
            .unwrap_or(tpuray_scheduler::TpuGeneration::V6e)
    }

    async fn start_worker(
        self: &Arc<Self>,
        key: PoolKey,
        chips: u32,
        gpus: Amount,
        state: WorkerState,
        actor: Option<(&ActorId, &[u8])>,
    ) -> Result<(WorkerId, String, u32), Status> {
        if self.stopping.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(Status::unavailable("node agent is stopping"));
        }
        let worker_id = WorkerId::random();
        let logs = self.config.session_dir.join("logs");
        let _ = std::fs::create_dir_all(&logs);
        // Named as Ray names them once the pid is known (LOGS-2, below).
        let out_path = logs.join(format!("worker-{}-{}.out", worker_id.as_str(), key.job_id));
        let err_path = logs.join(format!("worker-{}-{}.err", worker_id.as_str(), key.job_id));
        let open = |p: &PathBuf| {
            std::fs::File::create(p).map_err(|e| {
                Status::internal(format!("cannot create worker log {}: {e}", p.display()))
            })
        };
        let (out, err) = (open(&out_path)?, open(&err_path)?);
        // The task's or actor's environment (already merged with its job's by the SDK).
        let task_env = if key.runtime_env_hash.is_empty() {
            None
        } else {
            Some(self.runtime_env_record(&key.runtime_env_hash).await?)
        };
        let (command, env_uses) = if key.language == "python" {
            self.python_worker_command(&key.job_id, task_env.as_ref()).await?
        } else {
            (
                WorkerCommand {
                    argv: self.worker_command_for(&key.job_id).await?,
                    ..Default::default()
                },
                None,
            )
        };
        let (prog, args) = command
            .argv
            .split_first()
            .ok_or_else(|| Status::internal("no worker command configured"))?;
        let mut cmd = tokio::process::Command::new(prog);
        // Where the worker sends its output (Python workers; Ray prints it at the driver).
        if let Ok((_, driver)) = self.job_record(&key.job_id).await
            && !driver.is_empty()
        {
            cmd.env("TPURAY_DRIVER_ADDRESS", driver);
        }
        if let Some(dir) = &command.cwd {
            cmd.current_dir(dir);
        }
        cmd.envs(command.env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        let runtime_vars = task_env.as_ref().map(runtime_env_vars).unwrap_or_default();
        for (k, v) in &runtime_vars {
            cmd.env(k, v);
        }
        cmd.args(args)
            .env("TPURAY_AGENT_ADDRESS", &self.config.advertise_address)
            .env("TPURAY_HEAD_ADDRESS", &self.config.head_address)
            .env("TPURAY_NODE_ID", self.config.node_id.as_str())
            .env("TPURAY_WORKER_ID", worker_id.as_str())
            .env("TPURAY_JOB_ID", &key.job_id)
            .env("TPURAY_SESSION_DIR", &self.config.session_dir)
            .env("TPURAY_AGENT_PID", std::process::id().to_string())
            .env("TPURAY_OBJECT_STORE_DIR", self.config.store.dir())
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .kill_on_drop(false);
        if let Some(t) = &self.config.token {
            cmd.env(tpuray_proto::auth::TOKEN_ENV, t);
        }
        let required = self.auth_required.load(std::sync::atomic::Ordering::SeqCst);
        cmd.env(tpuray_proto::auth::AUTH_MODE_ENV, if required { "token" } else { "disabled" });
        if let Some((a, creation)) = actor {
            cmd.env("TPURAY_ACTOR_ID", a.as_str());
            if !creation.is_empty() {
                let path = self.config.session_dir.join(format!(
                    "actor-{}-{}.task",
                    a.short(),
                    worker_id.short()
                ));
                std::fs::write(&path, creation).map_err(|e| {
                    Status::internal(format!(
                        "cannot write actor creation task {}: {e}",
                        path.display()
                    ))
                })?;
                cmd.env("TPURAY_ACTOR_CREATION_FILE", &path);
            }
        }
        let mut key = key;
        if gpus.0 > 0 {
            key.gpus = self.allocate_gpus(gpus)?;
            cmd.env("CUDA_VISIBLE_DEVICES", tpuray_scheduler::gpu::cuda_visible_devices(&key.gpus));
        }
        if chips > 0 {
            // A gang member started for one chip names it (TPU_VISIBLE_CHIPS).
            let exact: Option<Vec<u32>> = runtime_vars
                .iter()
                .find(|(k, _)| k == "TPU_VISIBLE_CHIPS")
                .map(|(_, v)| v.split(',').filter_map(|c| c.trim().parse().ok()).collect());
            key.tpu_chips = match self.allocate_chips(chips, exact.as_deref()) {
                Ok(c) => c,
                Err(e) => {
                    self.release_devices(&key);
                    return Err(e);
                }
            };
            let port = free_local_port();
            let port = match port {
                Ok(p) => p,
                Err(e) => {
                    self.release_devices(&key);
                    return Err(e);
                }
            };
            let host_chips = self.lock().ledger.host_chips().unwrap_or(chips);
            for (k, v) in
                tpuray_scheduler::chip_env(self.tpu_generation(), host_chips, &key.tpu_chips, port)
            {
                cmd.env(k, v);
            }
            // A gang's own environment (process bounds of a gang spread over a host's
            // processes, its ports) wins over the independent-process defaults.
            for (k, v) in runtime_vars.iter().filter(|(k, _)| k.starts_with("TPU_")) {
                cmd.env(k, v);
            }
        }
        let (tx, rx) = oneshot::channel();
        self.lock().starting.insert(worker_id.clone(), tx);
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                self.lock().starting.remove(&worker_id);
                self.release_devices(&key);
                return Err(Status::internal(format!("cannot start worker process {prog:?}: {e}")));
            }
        };
        let pid = child.id().unwrap_or(0);
        // LOGS-2: a worker's output files are `worker-<worker id>-<job id>-<pid>.out|err`
        // under `<session>/logs`, Ray's names, so `tpuray logs worker --pid` and the
        // actor and task lookups find them by name (the open descriptors follow).
        let named = |ext: &str| {
            logs.join(format!("worker-{}-{}-{pid}.{ext}", worker_id.as_str(), key.job_id))
        };
        let _ = std::fs::rename(&out_path, named("out"));
        let err_path =
            if std::fs::rename(&err_path, named("err")).is_ok() { named("err") } else { err_path };
        if let Some(e) = registry::ProcEntry::for_pid(
            pid,
            "worker",
            &self.config.session_dir.display().to_string(),
            "",
        ) {
            let _ = registry::record(&e);
        }
        self.lock().workers.insert(
            worker_id.clone(),
            WorkerEntry {
                pid,
                key,
                address: String::new(),
                state: WorkerState::Starting,
                exit_intended: false,
                _env_uses: env_uses,
            },
        );
        // Wait for registration, or for the process to die first.
        let registered = tokio::select! {
            r = rx => r.ok(),
            status = child.wait() => {
                let status = status.ok();
                self.on_worker_exit(&worker_id, pid, status);
                let tail = tail_of(&err_path, 2000);
                // Exit code 3: the actor's constructor failed; not worth retrying.
                let constructor_failed = status.and_then(|s| s.code()) == Some(3);
                let msg = if constructor_failed {
                    format!("its constructor raised:\n{}", tail.trim_start_matches("tpuray worker: "))
                } else {
                    format!(
                        "worker process exited before registering ({}); stderr tail:\n{tail}",
                        describe_exit(status)
                    )
                };
                return Err(if constructor_failed {
                    Status::failed_precondition(msg)
                } else {
                    Status::internal(msg)
                });
            }
            _ = tokio::time::sleep(self.config.worker_register_timeout) => None,
        };
        let Some((address, _)) = registered else {
            let _ = child.start_kill();
            self.lock().starting.remove(&worker_id);
            let agent = Arc::clone(self);
            let wid = worker_id.clone();
            tokio::spawn(async move {
                let status = child.wait().await.ok();
                agent.on_worker_exit(&wid, pid, status);
            });
            return Err(Status::deadline_exceeded(format!(
                "worker process {pid} did not register within {:?}; see {}",
                self.config.worker_register_timeout,
                err_path.display()
            )));
        };
        {
            let mut st = self.lock();
            if let Some(w) = st.workers.get_mut(&worker_id) {
                w.address = address.clone();
                w.state = state;
            }
        }
        // A pre-started worker is idle now: a waiting lease may take it.
        self.freed.notify_waiters();
        // Reap the process whenever it exits (AGENT-2).
        let agent = Arc::clone(self);
        let wid = worker_id.clone();
        tokio::spawn(async move {
            let status = child.wait().await.ok();
            agent.on_worker_exit(&wid, pid, status);
        });
        Ok((worker_id, address, pid))
    }

    /// The command that starts a Python worker of `job_id`: the interpreter the driver runs
    /// (from the job's runtime record in the KV, `job_runtime/<job id>`, written by the
    /// Python driver at `init`) with `-m tpuray._worker`, in the driver's working directory
    /// with its `sys.path`, when they exist on this node; `python3` otherwise.
    ///
    /// `task_env`: the task's or actor's runtime environment record (merged with the
    /// job's); it is built instead of the job's when given.
    async fn python_worker_command(
        &self,
        job_id: &str,
        task_env: Option<&serde_json::Value>,
    ) -> Result<(WorkerCommand, Option<crate::runtime_env::EnvUses>), Status> {
        let mut head =
            tpuray_proto::client::head(&self.head_leader(), self.config.token.as_deref())
                .map_err(|e| Status::internal(e.to_string()))?;
        let rec = head
            .kv_get(pb::KvGetRequest {
                namespace: JOB_RUNTIME_NAMESPACE.into(),
                key: job_id.as_bytes().to_vec(),
            })
            .await?
            .into_inner();
        let v: serde_json::Value = if rec.found {
            serde_json::from_slice(&rec.value).map_err(|e| {
                Status::failed_precondition(format!(
                    "job {job_id}'s runtime record is not JSON: {e}"
                ))
            })?
        } else {
            serde_json::Value::Null
        };
        // AGENT-13: a job submitted with `pip`, `uv`, `py_modules` or an uploaded
        // `working_dir` runs its workers in the same environment, built on this node on
        // first use; a task's or actor's own environment replaces it.
        let mut built = self.build_environment(task_env.unwrap_or(&v["runtime_env"])).await?;
        let python = built
            .python()
            .map(|p| p.display().to_string())
            .or_else(|| {
                v["python"].as_str().filter(|p| std::path::Path::new(p).exists()).map(String::from)
            })
            .unwrap_or_else(|| "python3".into());
        let mut env = built.env();
        let mut paths: Vec<String> = built.python_path();
        if let Some(sys_path) = v["sys_path"].as_array() {
            paths.extend(
                sys_path
                    .iter()
                    .filter_map(|p| p.as_str())
                    .filter(|p| !p.is_empty())
                    .map(String::from),
            );
        }
        if !paths.is_empty() {
            env.push(("PYTHONPATH".to_string(), paths.join(":")));
        }
        if let Some(vars) = v["env_vars"].as_object() {
            for (k, val) in vars {
                if let Some(val) = val.as_str() {
                    env.push((k.clone(), val.to_string()));
                }
            }
        }
        if let Some(rt) = v.get("runtime_env").filter(|r| r.is_object()) {
            env.push(("TPURAY_JOB_RUNTIME_ENV".to_string(), rt.to_string()));
        }
        env.push(("PYTHONUNBUFFERED".to_string(), "1".to_string()));
        let cwd = built.working_dir.clone().or_else(|| {
            v["cwd"].as_str().filter(|d| std::path::Path::new(d).is_dir()).map(PathBuf::from)
        });
        let uses = built.uses.take();
        Ok((
            WorkerCommand { argv: vec![python, "-m".into(), "tpuray._worker".into()], env, cwd },
            uses,
        ))
    }

    /// What `runtime_env` (a job's record, or a task's merged one) needs built on this
    /// node (cached, AGENT-15), within its `setup_timeout_seconds` (AGENT-14).
    ///
    /// # Errors
    /// `FAILED_PRECONDITION` starting with [`SETUP_FAILED_PREFIX`] and carrying the setup
    /// error (the installer's output, a missing package, a malformed environment).
    async fn build_environment(
        &self,
        runtime_env: &serde_json::Value,
    ) -> Result<crate::runtime_env::Prepared, Status> {
        let failed = |e: String| Status::failed_precondition(format!("{SETUP_FAILED_PREFIX}{e}"));
        if !runtime_env.is_object() {
            return Ok(Default::default());
        }
        let env = tpuray_proto::runtime_env::JobRuntimeEnv::parse(runtime_env).map_err(failed)?;
        if !env.needs_build() {
            return Ok(Default::default());
        }
        let logs = self.config.session_dir.join("logs");
        let _ = std::fs::create_dir_all(&logs);
        self.supervisors
            .envs
            .prepare(
                &self.head_leader(),
                self.config.token.as_deref(),
                &self.config.session_dir.join("runtime_resources"),
                &env,
                &logs.join("runtime_env_setup-workers.log"),
            )
            .await
            .map_err(failed)
    }

    /// The record of runtime environment `hash` (KV namespace `runtime_env`, JSON written
    /// by the submitting SDK: the task's environment merged with its job's).
    ///
    /// # Errors
    /// `FAILED_PRECONDITION` when the record is missing or not a JSON object.
    async fn runtime_env_record(&self, hash: &str) -> Result<serde_json::Value, Status> {
        let mut head =
            tpuray_proto::client::head(&self.head_leader(), self.config.token.as_deref())
                .map_err(|e| Status::internal(e.to_string()))?;
        let rec = head
            .kv_get(pb::KvGetRequest {
                namespace: RUNTIME_ENV_NAMESPACE.into(),
                key: hash.as_bytes().to_vec(),
            })
            .await?
            .into_inner();
        if !rec.found {
            return Err(Status::failed_precondition(format!(
                "runtime environment {hash} is not in the cluster's KV (namespace {RUNTIME_ENV_NAMESPACE:?})"
            )));
        }
        serde_json::from_slice(&rec.value).map_err(|e| {
            Status::failed_precondition(format!("runtime environment {hash} is not JSON: {e}"))
        })
    }

    /// The command that starts a worker of `job_id`: the job's own binary
    /// (fetched through the cluster, BIN-1) or the default worker.
    /// The job's worker binary hash ("" without one) and its driver's address, asked of
    /// the head once per job.
    async fn job_record(&self, job_id: &str) -> Result<(String, String), Status> {
        if let Some(r) = self.lock().job_binaries.get(job_id).cloned() {
            return Ok(r);
        }
        let mut head =
            tpuray_proto::client::head(&self.head_leader(), self.config.token.as_deref())
                .map_err(|e| Status::internal(e.to_string()))?;
        let jobs = head.list_jobs(pb::ListJobsRequest {}).await?.into_inner().jobs;
        let r = jobs
            .iter()
            .find(|j| j.job_id == job_id)
            .map(|j| (j.worker_binary_hash.clone(), j.driver_address.clone()))
            .unwrap_or_default();
        self.lock().job_binaries.insert(job_id.to_string(), r.clone());
        Ok(r)
    }

    async fn worker_command_for(&self, job_id: &str) -> Result<Vec<String>, Status> {
        let (hash, _) = self.job_record(job_id).await?;
        if hash.is_empty() {
            return Ok(self.config.worker_command.clone());
        }
        let mut head =
            tpuray_proto::client::head(&self.head_leader(), self.config.token.as_deref())
                .map_err(|e| Status::internal(e.to_string()))?;
        let path = crate::binaries::ensure_binary(
            &mut head,
            &self.config.session_dir.join("binaries"),
            &hash,
        )
        .await
        .map_err(|e| {
            let msg = format!("cannot fetch the job's worker binary: {e}");
            // A binary that was never uploaded will not appear; anything else
            // (disk, network) may pass on a retry.
            if e.contains("never uploaded") {
                Status::failed_precondition(msg)
            } else {
                Status::unavailable(msg)
            }
        })?;
        Ok(vec![path.display().to_string()])
    }

    /// Called once per worker process exit: frees what it held, reports an
    /// actor worker's exit to the head.
    fn on_worker_exit(
        self: &Arc<Self>,
        worker_id: &WorkerId,
        pid: u32,
        status: Option<std::process::ExitStatus>,
    ) {
        registry::remove(pid);
        let mut report = None;
        {
            let mut st = self.lock();
            st.starting.remove(worker_id);
            let Some(entry) = st.workers.remove(worker_id) else {
                return;
            };
            // AGENT-7/10: chips and GPUs come back however the process ended.
            st.ledger.release_devices(&entry.key.tpu_chips, &entry.key.gpus);
            match &entry.state {
                WorkerState::Leased(lease_id) => {
                    if let Some(lease) = st.leases.remove(lease_id) {
                        st.ledger.release(&lease.hold.resources);
                    }
                }
                WorkerState::Actor(actor_id) => {
                    if let Some((_, r)) = st.actor_resources.remove(actor_id) {
                        st.ledger.release(&r);
                    }
                    report = Some((actor_id.clone(), entry.exit_intended));
                }
                WorkerState::Starting | WorkerState::Idle { .. } => {}
            }
        }
        self.freed.notify_waiters();
        let detail = describe_exit(status);
        tracing::info!(%worker_id, pid, %detail, "worker exited");
        if let Some((actor_id, intended)) = report {
            let agent = Arc::clone(self);
            let worker_id = worker_id.clone();
            tokio::spawn(async move {
                agent.report_actor_exit(actor_id, worker_id, intended, detail).await;
            });
        }
    }

    async fn report_actor_exit(
        &self,
        actor_id: ActorId,
        worker_id: WorkerId,
        intended: bool,
        detail: String,
    ) {
        let req = pb::ReportActorWorkerExitRequest {
            request_id: tpuray_proto::new_request_id(),
            node_id: self.config.node_id.to_string(),
            actor_id: actor_id.to_string(),
            worker_id: worker_id.to_string(),
            intended,
            detail: format!("the actor's worker process {detail}"),
        };
        // Retry with the same request id until the head takes it (HEAD-2).
        for attempt in 0..30 {
            let Ok(mut head) =
                tpuray_proto::client::head(&self.head_leader(), self.config.token.as_deref())
            else {
                return;
            };
            match head.report_actor_worker_exit(req.clone()).await {
                Ok(_) => return,
                Err(s) if s.code() == tonic::Code::NotFound => return,
                Err(s) => {
                    tracing::warn!(%actor_id, attempt, %s, "reporting actor exit failed; retrying");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
        }
    }

    fn head_leader(&self) -> String {
        // Every head's address: the head client follows the leader (CLIENT-1).
        self.config.head_address.clone()
    }

    /// Stops idle workers beyond the pool's soft limit once they have been
    /// idle for the idle timeout.
    pub fn reap_idle_workers(&self) {
        let mut victims = Vec::new();
        {
            let mut st = self.lock();
            let mut idle: Vec<(Instant, WorkerId)> = st
                .workers
                .iter()
                .filter_map(|(id, w)| match w.state {
                    WorkerState::Idle { since } => Some((since, id.clone())),
                    _ => None,
                })
                .collect();
            if idle.len() <= self.config.max_idle_workers {
                return;
            }
            idle.sort();
            let excess = idle.len() - self.config.max_idle_workers;
            for (since, id) in idle.into_iter().take(excess) {
                if since.elapsed() >= self.config.idle_worker_timeout
                    && let Some(w) = st.workers.get_mut(&id)
                {
                    w.exit_intended = true;
                    // Not idle any more: nobody may lease it while it exits.
                    w.state = WorkerState::Starting;
                    victims.push(w.pid);
                }
            }
        }
        for pid in victims {
            signal(pid, libc::SIGTERM);
        }
    }

    /// Whether this node is draining (AGENT-16).
    pub fn is_draining(&self) -> bool {
        self.draining.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// AGENT-16: waits until no worker of this node runs a task or an actor call, at most
    /// `grace`; returns how many still ran when it gave up (0: all finished). What runs is
    /// what each live worker last reported (every 0.5 s, `ReportMetrics`); a live worker
    /// holding a lease counts as running for the first second, until its first report
    /// can arrive.
    pub async fn wait_drained(&self, grace: Duration) -> usize {
        let started = Instant::now();
        loop {
            let running = self.metrics.running_by_pid();
            let (busy, leased): (usize, usize) = {
                let st = self.lock();
                // Workers that exited (`tpuray stop` stops workers before agents) run
                // nothing, whatever they last reported.
                let live: Vec<&WorkerEntry> = st
                    .workers
                    .values()
                    .filter(|w| registry::proc_start_time(w.pid).is_some())
                    .collect();
                let busy =
                    live.iter().filter(|w| running.get(&w.pid).copied().unwrap_or(0) > 0).count();
                let leased =
                    live.iter().filter(|w| matches!(w.state, WorkerState::Leased(_))).count();
                (busy, leased)
            };
            let settling = leased > 0 && started.elapsed() < Duration::from_secs(1);
            if busy == 0 && !settling {
                return 0;
            }
            if started.elapsed() >= grace {
                return busy.max(usize::from(settling));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Stops every worker (agent shutdown) and waits up to `grace` for them.
    pub async fn stop_all_workers(&self, grace: Duration) {
        self.stopping.store(true, std::sync::atomic::Ordering::SeqCst);
        let pids: Vec<u32> = {
            let mut st = self.lock();
            st.workers
                .values_mut()
                .map(|w| {
                    w.exit_intended = true;
                    w.pid
                })
                .collect()
        };
        for &pid in &pids {
            signal(pid, libc::SIGTERM);
        }
        // Job entrypoints: their whole process groups (AGENT-13).
        let groups = self.supervisors.process_groups();
        for &g in &groups {
            // SAFETY: kill(2) on an entrypoint's own process group.
            unsafe { libc::kill(-(g as i32), libc::SIGTERM) };
        }
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline
            && pids.iter().any(|&p| registry::proc_start_time(p).is_some())
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        for &pid in &pids {
            if registry::proc_start_time(pid).is_some() {
                signal(pid, libc::SIGKILL);
            }
            registry::remove(pid);
        }
        for &g in &groups {
            // SAFETY: as above; whatever of the group is left.
            unsafe { libc::kill(-(g as i32), libc::SIGKILL) };
        }
    }

    fn note_demand(
        &self,
        st: &mut AgentState,
        shape: &ResourceSet,
        infeasible: bool,
        reason: &str,
        delta: i32,
    ) {
        let key = format!("{shape}|{infeasible}");
        let d = st.demands.entry(key).or_insert_with(|| Demand {
            shape: shape.clone(),
            infeasible,
            reason: reason.to_string(),
            waiting: 0,
            last_seen: Instant::now(),
        });
        d.last_seen = Instant::now();
        d.reason = reason.to_string();
        d.waiting = (d.waiting as i32 + delta).max(0) as u32;
    }

    /// Takes an idle worker with `key`, if any, and marks it leased.
    fn take_idle(
        &self,
        st: &mut AgentState,
        key: &PoolKey,
        chips: u32,
        gpus: Amount,
        lease: &LeaseId,
    ) -> Option<(WorkerId, String, u32)> {
        // AGENT-3/7: same job, language and env, and a block of the same size.
        let fits = |w: &WorkerEntry| {
            w.key.job_id == key.job_id
                && w.key.language == key.language
                && w.key.runtime_env_hash == key.runtime_env_hash
                && w.key.tpu_chips.len() == chips as usize
                && w.key.gpus.iter().map(|(_, a)| a.0).sum::<i64>() == gpus.0
        };
        let id = st
            .workers
            .iter()
            .filter(|(_, w)| fits(w) && matches!(w.state, WorkerState::Idle { .. }))
            .map(|(id, _)| id.clone())
            .next()?;
        let w = st.workers.get_mut(&id)?;
        w.state = WorkerState::Leased(lease.clone());
        Some((id, w.address.clone(), w.pid))
    }

    /// Grants a lease. The grant runs as a task of its own; if the caller's
    /// request is dropped before the answer (the client hung up), the lease
    /// is returned as soon as the grant finishes (AGENT-2).
    async fn grant_lease(
        self: &Arc<Self>,
        key: PoolKey,
        demand: ResourceSet,
        owner: String,
    ) -> Result<pb::request_worker_lease_reply::Granted, Status> {
        struct ReturnIfDropped {
            agent: Arc<Agent>,
            handle: Option<
                tokio::task::JoinHandle<Result<pb::request_worker_lease_reply::Granted, Status>>,
            >,
        }
        impl Drop for ReturnIfDropped {
            fn drop(&mut self) {
                if let Some(h) = self.handle.take() {
                    let agent = Arc::clone(&self.agent);
                    tokio::spawn(async move {
                        if let Ok(Ok(g)) = h.await {
                            agent.return_lease(&LeaseId::from_wire(g.lease_id), false);
                        }
                    });
                }
            }
        }
        let agent = Arc::clone(self);
        let mut guard = ReturnIfDropped {
            agent: Arc::clone(self),
            handle: Some(tokio::spawn(
                async move { agent.grant_lease_now(key, demand, owner).await },
            )),
        };
        let result = guard.handle.as_mut().expect("handle is set").await;
        guard.handle = None;
        result.map_err(|e| Status::internal(format!("lease grant failed: {e}")))?
    }

    /// Returns a lease: its resources come back, its worker goes idle (or is
    /// killed with `disconnect`). Returning twice is harmless (AGENT-2).
    pub fn return_lease(&self, lease_id: &LeaseId, disconnect: bool) {
        let kill = {
            let mut st = self.lock();
            let Some(lease) = st.leases.remove(lease_id) else {
                return;
            };
            st.ledger.release(&lease.hold.resources);
            match st.workers.get_mut(&lease.worker_id) {
                Some(w) if disconnect => {
                    w.exit_intended = true;
                    w.state = WorkerState::Starting;
                    Some(w.pid)
                }
                Some(w) => {
                    w.state = WorkerState::Idle { since: Instant::now() };
                    None
                }
                None => None,
            }
        };
        if let Some(pid) = kill {
            signal(pid, libc::SIGKILL);
        }
        self.freed.notify_waiters();
    }

    /// Starts the worker of a lease. When the chips it needs are held by idle workers
    /// that are being stopped (AGENT-7), waits for them to exit and tries again (up to
    /// 10 s) rather than failing the lease.
    async fn start_leased_worker(
        self: &Arc<Self>,
        key: PoolKey,
        chips: u32,
        gpus: Amount,
        lease_id: &LeaseId,
    ) -> Result<(WorkerId, String, u32), Status> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let freed = self.freed.notified();
            match self
                .start_worker(key.clone(), chips, gpus, WorkerState::Leased(lease_id.clone()), None)
                .await
            {
                Err(e)
                    if e.code() == tonic::Code::Unavailable
                        && (chips > 0 || gpus.0 > 0)
                        && Instant::now() < deadline =>
                {
                    tracing::debug!(%e, "waiting for TPU chips to be freed");
                    let _ = tokio::time::timeout(Duration::from_millis(200), freed).await;
                }
                other => return other,
            }
        }
    }

    /// AGENT-5: returns the leases of holders that no longer answer (a
    /// driver or worker that exited without returning them). Their workers
    /// may still run the dead holder's task, so they are stopped.
    pub async fn reclaim_orphaned_leases(&self) {
        let owners: std::collections::HashSet<String> = self
            .lock()
            .leases
            .values()
            .map(|l| l.owner.clone())
            .filter(|o| !o.is_empty())
            .collect();
        for owner in owners {
            let Ok(mut c) = tpuray_proto::client::worker(&owner, self.config.token.as_deref())
            else {
                continue;
            };
            let mut req = Request::new(pb::GetWorkerInfoRequest {});
            req.set_timeout(Duration::from_secs(2));
            let gone = matches!(c.get_worker_info(req).await, Err(s) if s.code() == tonic::Code::Unavailable);
            if gone {
                let ids: Vec<LeaseId> = self
                    .lock()
                    .leases
                    .iter()
                    .filter(|(_, l)| l.owner == owner)
                    .map(|(id, _)| id.clone())
                    .collect();
                tracing::info!(%owner, leases = ids.len(), "lease holder is gone; reclaiming its leases");
                for id in ids {
                    self.return_lease(&id, true);
                }
            }
        }
    }

    async fn grant_lease_now(
        self: &Arc<Self>,
        key: PoolKey,
        demand: ResourceSet,
        owner: String,
    ) -> Result<pb::request_worker_lease_reply::Granted, Status> {
        let lease_id = LeaseId::random();
        let chips = match chips_wanted(&demand, self.lock().ledger.host_chips()) {
            Ok(c) => c,
            Err(e) => {
                // The decision took the demand (AGENT-2): it goes back with the refusal.
                let mut st = self.lock();
                st.ledger.release(&demand);
                drop(st);
                self.freed.notify_waiters();
                return Err(e);
            }
        };
        let gpus = tpuray_scheduler::bundles::plain_amount(&demand, "GPU");
        let reused = {
            let mut st = self.lock();
            // The demand was taken from `available` when the lease was decided (under the
            // same lock as the decision: see `request_worker_lease`).
            st.leases.insert(
                lease_id.clone(),
                Lease {
                    worker_id: WorkerId::from_wire(""),
                    hold: Hold::new(demand.clone()),
                    owner,
                },
            );
            let reused = self.take_idle(&mut st, &key, chips, gpus, &lease_id);
            if let (Some((wid, _, _)), Some(l)) = (&reused, st.leases.get_mut(&lease_id)) {
                l.worker_id = wid.clone();
            }
            reused
        };
        // AGENT-8: wait for a start slot, taking an idle worker instead if one frees up.
        let mut permit = None;
        let mut reused = reused;
        while reused.is_none() && permit.is_none() {
            let freed = self.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            reused = {
                let mut st = self.lock();
                let r = self.take_idle(&mut st, &key, chips, gpus, &lease_id);
                if let (Some((wid, _, _)), Some(l)) = (&r, st.leases.get_mut(&lease_id)) {
                    l.worker_id = wid.clone();
                }
                r
            };
            if reused.is_none() {
                tokio::select! {
                    p = Arc::clone(&self.starts).acquire_owned() => permit = Some(p),
                    _ = freed => {}
                }
            }
        }
        let (worker_id, address, pid) = match reused {
            Some(w) => w,
            None => match self.start_leased_worker(key, chips, gpus, &lease_id).await {
                Ok(w) => {
                    if let Some(l) = self.lock().leases.get_mut(&lease_id) {
                        l.worker_id = w.0.clone();
                    }
                    w
                }
                Err(e) => {
                    let mut st = self.lock();
                    if let Some(l) = st.leases.remove(&lease_id) {
                        st.ledger.release(&l.hold.resources);
                    }
                    drop(st);
                    self.freed.notify_waiters();
                    return Err(e);
                }
            },
        };
        Ok(pb::request_worker_lease_reply::Granted {
            lease_id: lease_id.to_string(),
            worker_id: worker_id.to_string(),
            worker_address: address,
            worker_pid: pid,
            node_id: self.config.node_id.to_string(),
        })
    }
}

/// Takes a waiting lease request off the pending demand when it is dropped
/// while still counted.
struct WaitingGuard<'a> {
    agent: &'a Agent,
    demand: ResourceSet,
    waiting: std::cell::Cell<bool>,
}

impl Drop for WaitingGuard<'_> {
    fn drop(&mut self) {
        if self.waiting.get() {
            let mut st = self.agent.lock();
            self.agent.note_demand(&mut st, &self.demand, false, "", -1);
        }
    }
}

/// AGENT-8: worker processes started at once on a node with `total` resources: its
/// CPUs, at least 1 (Ray's `maximum_startup_concurrency` default).
fn startup_concurrency(total: &ResourceSet) -> usize {
    let cpus = total.get("CPU").0 / tpuray_scheduler::resources::UNITS_PER_WHOLE;
    usize::try_from(cpus).unwrap_or(1).max(1)
}

/// Stops the idle workers whose pool key `holds` devices (chips or GPUs) that a request
/// could not otherwise get; they give them back when they exit (AGENT-7, AGENT-10).
/// Returns how many were stopped.
fn stop_idle_holders(st: &mut AgentState, holds: impl Fn(&PoolKey) -> bool) -> usize {
    let mut stopped = 0;
    for w in st.workers.values_mut() {
        if holds(&w.key) && matches!(w.state, WorkerState::Idle { .. }) {
            w.exit_intended = true;
            w.state = WorkerState::Starting;
            signal(w.pid, libc::SIGKILL);
            stopped += 1;
        }
    }
    stopped
}

/// How many chips work needing `demand` takes (AGENT-7), directly or through a bundle.
///
/// # Errors
/// `INVALID_ARGUMENT` naming the valid counts (SCHED-13) for 3, 0.5, ...
fn chips_wanted(demand: &ResourceSet, host_chips: Option<u32>) -> Result<u32, Status> {
    let amount = tpuray_scheduler::bundles::plain_amount(demand, "TPU");
    if amount.0 == 0 || host_chips.is_none() {
        return Ok(0);
    }
    tpuray_scheduler::chip_count(amount, host_chips)
        .map_err(|e| Status::invalid_argument(e.to_string()))
}

/// A TCP port free on this host now, for a process's libtpu services (TPU.md: one port per
/// process, or processes on one host collide on the default).
fn free_local_port() -> Result<u16, Status> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| Status::internal(format!("cannot find a free port for libtpu: {e}")))
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

fn describe_exit(status: Option<std::process::ExitStatus>) -> String {
    use std::os::unix::process::ExitStatusExt;
    match status {
        Some(s) => match (s.code(), s.signal()) {
            (Some(c), _) => format!("exited with code {c}"),
            (None, Some(sig)) => format!("was killed by signal {sig}"),
            _ => "exited".to_string(),
        },
        None => "exited (status unknown)".to_string(),
    }
}

fn tail_of(path: &PathBuf, max: usize) -> String {
    let s = std::fs::read_to_string(path).unwrap_or_default();
    let start = s.len().saturating_sub(max);
    let start = (start..s.len()).find(|&i| s.is_char_boundary(i)).unwrap_or(s.len());
    s[start..].to_string()
}

/// The gRPC service over a shared [`Agent`].
#[derive(Clone)]
pub struct AgentSvc(pub Arc<Agent>);

#[tonic::async_trait]
impl NodeAgentService for AgentSvc {
    async fn get_node_info(
        &self,
        _req: Request<pb::GetNodeInfoRequest>,
    ) -> Result<Response<pb::GetNodeInfoReply>, Status> {
        Ok(Response::new(pb::GetNodeInfoReply { node: Some(self.0.node_info()) }))
    }

    async fn request_worker_lease(
        &self,
        req: Request<pb::RequestWorkerLeaseRequest>,
    ) -> Result<Response<pb::RequestWorkerLeaseReply>, Status> {
        use pb::request_worker_lease_reply::{Busy, Infeasible, Outcome, SetupFailed, Spillback};
        let req = req.into_inner();
        let agent = &self.0;
        // AGENT-16: a draining node takes no new work; the head already counts it dead,
        // so the caller's next request goes elsewhere.
        if agent.is_draining() {
            return Err(Status::unavailable(format!(
                "node {} is draining (it received SIGTERM) and grants no leases",
                agent.config.node_id
            )));
        }
        let demand = resources_from_proto(&req.resources)
            .map_err(|e| Status::invalid_argument(format!("lease resources: {e}")))?;
        let label_selector =
            labels_from_proto(&req.label_selector).map_err(Status::invalid_argument)?;
        let strategy = tpuray_proto::convert::strategy_from_proto(req.strategy.as_ref());
        let key = PoolKey {
            job_id: req.job_id.clone(),
            language: if req.language.is_empty() { "rust".into() } else { req.language.clone() },
            runtime_env_hash: req.runtime_env_hash.clone(),
            tpu_chips: vec![],
            gpus: vec![],
        };
        let request =
            tpuray_scheduler::Request { demand: demand.clone(), strategy, label_selector };
        let deadline = (req.queue_timeout_ms > 0)
            .then(|| Instant::now() + Duration::from_millis(req.queue_timeout_ms));
        let local_id = agent.config.node_id.to_string();
        // AGENT-12: node affinity to a node this agent's view lacks (it joined after the
        // last heartbeat's view) asks the head first, so a soft affinity does not fall
        // back and a hard one is not refused for a node that is there.
        if let tpuray_scheduler::Strategy::NodeAffinity { node, .. } = &request.strategy
            && *node != local_id
            && !req.grant_or_reject
            && !agent.lock().cluster.iter().any(|(v, _)| v.id == *node)
        {
            agent.refresh_cluster_view().await;
        }
        // Counts this request as pending demand while it waits; if the
        // request is dropped mid-wait (the client hung up), the guard takes
        // it off the books (AGENT-4).
        let guard =
            WaitingGuard { agent, demand: demand.clone(), waiting: std::cell::Cell::new(false) };
        let outcome = loop {
            let freed = agent.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            let decision = {
                let mut st = agent.lock();
                let mut views: Vec<NodeView<String>> = vec![agent.local_view(&st)];
                if !req.grant_or_reject {
                    views.extend(st.cluster.iter().map(|(v, _)| v.clone()));
                }
                let d = tpuray_scheduler::schedule(&request, &views, Some(&local_id), now_ms());
                match &d {
                    Decision::Place(n) if *n == local_id => {
                        if guard.waiting.get() {
                            agent.note_demand(&mut st, &demand, false, "", -1);
                        }
                        guard.waiting.set(false);
                        // AGENT-2: take the demand now, under the lock the decision saw the
                        // node under; taken later (at grant), two requests deciding at once
                        // both fitted the same free CPU, the second subtraction saturated at
                        // 0, and the node's available resources stayed above the truth after
                        // both returned (phantom CPUs, seen in `ray_resources`).
                        st.ledger.take_anyway(&demand);
                    }
                    Decision::Infeasible { reason } => {
                        if guard.waiting.get() {
                            agent.note_demand(&mut st, &demand, false, "", -1);
                            guard.waiting.set(false);
                        }
                        agent.note_demand(&mut st, &demand, true, reason, 0);
                    }
                    Decision::Queue { reason } => {
                        if !guard.waiting.get() {
                            agent.note_demand(&mut st, &demand, false, reason, 1);
                            guard.waiting.set(true);
                        }
                    }
                    Decision::Place(_) => {
                        if guard.waiting.get() {
                            agent.note_demand(&mut st, &demand, false, "", -1);
                        }
                        guard.waiting.set(false);
                    }
                }
                // Feasible here but busy: queue locally. Feasible only elsewhere: spill there.
                if let Decision::Queue { .. } = &d {
                    let local_fits = st.ledger.total().is_superset_of(&demand)
                        && request.label_selector.iter().all(|c| c.matches(&agent.config.labels));
                    if !local_fits && !req.grant_or_reject {
                        let best = st
                            .cluster
                            .iter()
                            .filter(|(v, _)| {
                                v.total.is_superset_of(&demand)
                                    && request.label_selector.iter().all(|c| c.matches(&v.labels))
                            })
                            .min_by_key(|(v, _)| v.id.clone())
                            .map(|(v, a)| (v.id.clone(), a.clone()));
                        if let Some((node_id, address)) = best {
                            if guard.waiting.get() {
                                agent.note_demand(&mut st, &demand, false, "", -1);
                            }
                            break Outcome::Spillback(Spillback { node_id, address });
                        }
                    }
                }
                (
                    d,
                    st.cluster
                        .iter()
                        .map(|(v, a)| (v.id.clone(), a.clone()))
                        .collect::<HashMap<_, _>>(),
                )
            };
            match decision {
                (Decision::Place(n), _) if n == local_id => {
                    match agent
                        .grant_lease(key.clone(), demand.clone(), req.owner_address.clone())
                        .await
                    {
                        Ok(g) => break Outcome::Granted(g),
                        // AGENT-14: a failed environment is an answer, not an RPC error
                        // (which the owner would retry forever).
                        Err(e)
                            if e.code() == tonic::Code::FailedPrecondition
                                && e.message().starts_with(SETUP_FAILED_PREFIX) =>
                        {
                            break Outcome::SetupFailed(SetupFailed {
                                message: e.message()[SETUP_FAILED_PREFIX.len()..].to_string(),
                            });
                        }
                        Err(e) => return Err(e),
                    }
                }
                (Decision::Place(n), addrs) => {
                    let address = addrs.get(&n).cloned().unwrap_or_default();
                    break Outcome::Spillback(Spillback { node_id: n, address });
                }
                (Decision::Infeasible { reason }, _) => {
                    break Outcome::Infeasible(Infeasible { reason });
                }
                (Decision::Queue { reason }, _) => {
                    // Wake when resources free up here, and re-check every
                    // 200 ms anyway: other nodes' views change with heartbeats
                    // and the request may now spill to one of them.
                    let _ = tokio::time::timeout(Duration::from_millis(200), freed).await;
                    if deadline.is_some_and(|d| Instant::now() >= d) {
                        // The guard takes it off the pending demand.
                        break Outcome::Busy(Busy { reason });
                    }
                }
            }
        };
        Ok(Response::new(pb::RequestWorkerLeaseReply { outcome: Some(outcome) }))
    }

    async fn notify_worker_blocked(
        &self,
        req: Request<pb::NotifyWorkerBlockedRequest>,
    ) -> Result<Response<pb::NotifyWorkerBlockedReply>, Status> {
        let req = req.into_inner();
        self.0.set_blocked(&WorkerId::from_wire(req.worker_id), req.blocked);
        Ok(Response::new(pb::NotifyWorkerBlockedReply {}))
    }

    async fn return_worker_lease(
        &self,
        req: Request<pb::ReturnWorkerLeaseRequest>,
    ) -> Result<Response<pb::ReturnWorkerLeaseReply>, Status> {
        let req = req.into_inner();
        self.0.return_lease(&LeaseId::from_wire(req.lease_id), req.disconnect_worker);
        Ok(Response::new(pb::ReturnWorkerLeaseReply {}))
    }

    async fn report_metrics(
        &self,
        req: Request<pb::ReportMetricsRequest>,
    ) -> Result<Response<pb::ReportMetricsReply>, Status> {
        let defs_known = self.0.metrics.report(req.into_inner());
        Ok(Response::new(pb::ReportMetricsReply { defs_known }))
    }

    async fn register_worker(
        &self,
        req: Request<pb::RegisterWorkerRequest>,
    ) -> Result<Response<pb::RegisterWorkerReply>, Status> {
        let req = req.into_inner();
        check_protocol_version("worker", req.protocol_version)?; // PROTO-1
        let worker_id = WorkerId::from_wire(req.worker_id);
        let tx = self.0.lock().starting.remove(&worker_id).ok_or_else(|| {
            Status::not_found(format!(
                "unknown worker id {worker_id}: this node agent did not start it"
            ))
        })?;
        let _ = tx.send((req.address, req.pid));
        Ok(Response::new(pb::RegisterWorkerReply {
            node_id: self.0.config.node_id.to_string(),
            head_address: self.0.config.head_address.clone(),
        }))
    }

    async fn start_actor_worker(
        &self,
        req: Request<pb::StartActorWorkerRequest>,
    ) -> Result<Response<pb::StartActorWorkerReply>, Status> {
        let req = req.into_inner();
        let actor_id = ActorId::from_wire(req.actor_id);
        let resources = resources_from_proto(&req.resources)
            .map_err(|e| Status::invalid_argument(format!("actor resources: {e}")))?;
        {
            let mut st = self.0.lock();
            // A retried request for an actor already running here: same answer.
            if let Some((wid, _)) = st.actor_resources.get(&actor_id)
                && let Some(w) = st.workers.get(wid)
                && !w.address.is_empty()
            {
                return Ok(Response::new(pb::StartActorWorkerReply {
                    worker_id: wid.to_string(),
                    worker_address: w.address.clone(),
                    pid: w.pid,
                }));
            }
            st.ledger
                .take(&format!("actor {actor_id}"), &resources)
                .map_err(|e| e.into_status(&self.0.config.node_id))?;
            st.actor_resources
                .insert(actor_id.clone(), (WorkerId::from_wire(""), resources.clone()));
        }
        // The actor's language and runtime environment are its creation task's.
        let creation = <pb::TaskSpec as prost::Message>::decode(req.creation_task.as_slice()).ok();
        let language = creation
            .as_ref()
            .and_then(|t| t.function.as_ref())
            .map(|f| f.language.clone())
            .filter(|l| !l.is_empty())
            .unwrap_or_else(|| "rust".into());
        let key = PoolKey {
            job_id: JobId::from_wire(req.job_id).to_string(),
            language,
            runtime_env_hash: creation.map(|t| t.runtime_env_hash).unwrap_or_default(),
            tpu_chips: vec![],
            gpus: vec![],
        };
        let chips = match chips_wanted(&resources, self.0.lock().ledger.host_chips()) {
            Ok(c) => c,
            Err(e) => {
                let mut st = self.0.lock();
                if let Some((_, r)) = st.actor_resources.remove(&actor_id) {
                    st.ledger.release(&r);
                }
                return Err(e);
            }
        };
        match self
            .0
            .start_worker(
                key,
                chips,
                tpuray_scheduler::bundles::plain_amount(&resources, "GPU"),
                WorkerState::Actor(actor_id.clone()),
                Some((&actor_id, &req.creation_task)),
            )
            .await
        {
            Ok((wid, address, pid)) => {
                if let Some(e) = self.0.lock().actor_resources.get_mut(&actor_id) {
                    e.0 = wid.clone();
                }
                tracing::info!(%actor_id, worker_id = %wid, pid, "actor worker started");
                Ok(Response::new(pb::StartActorWorkerReply {
                    worker_id: wid.to_string(),
                    worker_address: address,
                    pid,
                }))
            }
            Err(e) => {
                let mut st = self.0.lock();
                if let Some((_, r)) = st.actor_resources.remove(&actor_id) {
                    st.ledger.release(&r);
                }
                drop(st);
                self.0.freed.notify_waiters();
                Err(e)
            }
        }
    }

    async fn kill_actor_worker(
        &self,
        req: Request<pb::KillActorWorkerRequest>,
    ) -> Result<Response<pb::KillActorWorkerReply>, Status> {
        let req = req.into_inner();
        let actor_id = ActorId::from_wire(req.actor_id);
        let only = (!req.worker_id.is_empty()).then(|| WorkerId::from_wire(req.worker_id));
        let pid = {
            let mut st = self.0.lock();
            st.workers
                .iter_mut()
                .find(|(id, w)| {
                    w.state == WorkerState::Actor(actor_id.clone())
                        && only.as_ref().is_none_or(|o| o == *id)
                })
                .map(|(_, w)| {
                    w.exit_intended = !req.restart;
                    w.pid
                })
        };
        if let Some(pid) = pid {
            signal(pid, if req.force { libc::SIGKILL } else { libc::SIGTERM });
        }
        Ok(Response::new(pb::KillActorWorkerReply { killed: pid.is_some() }))
    }

    async fn prepare_bundles(
        &self,
        req: Request<pb::PrepareBundlesRequest>,
    ) -> Result<Response<pb::PrepareBundlesReply>, Status> {
        let req = req.into_inner();
        if req.placement_group_id.is_empty() {
            return Err(Status::invalid_argument("missing placement_group_id"));
        }
        let bundles = req
            .bundles
            .iter()
            .map(|b| {
                resources_from_proto(&b.resources)
                    .map(|r| (b.index, r))
                    .map_err(|e| Status::invalid_argument(format!("bundle {}: {e}", b.index)))
            })
            .collect::<Result<Vec<_>, _>>()?;
        self.0.prepare_bundles(&req.placement_group_id, &bundles)?;
        if !req.commit {
            return Ok(Response::new(pb::PrepareBundlesReply { resources: None }));
        }
        let indexes: Vec<u32> = bundles.iter().map(|b| b.0).collect();
        self.0.commit_bundles(&req.placement_group_id, &indexes)?;
        let names = self.0.bundle_names(&req.placement_group_id, &indexes);
        Ok(Response::new(pb::PrepareBundlesReply { resources: Some(self.0.resources_of(&names)) }))
    }

    async fn commit_bundles(
        &self,
        req: Request<pb::CommitBundlesRequest>,
    ) -> Result<Response<pb::CommitBundlesReply>, Status> {
        let req = req.into_inner();
        self.0.commit_bundles(&req.placement_group_id, &req.indexes)?;
        let names = self.0.bundle_names(&req.placement_group_id, &req.indexes);
        Ok(Response::new(pb::CommitBundlesReply { resources: Some(self.0.resources_of(&names)) }))
    }

    async fn return_bundles(
        &self,
        req: Request<pb::ReturnBundlesRequest>,
    ) -> Result<Response<pb::ReturnBundlesReply>, Status> {
        let req = req.into_inner();
        let names = self.0.bundle_names(&req.placement_group_id, &req.indexes);
        let workers_stopped = self.0.return_bundles(&req.placement_group_id, &req.indexes);
        if workers_stopped > 0 {
            tracing::info!(pg = %req.placement_group_id, workers_stopped, "stopped workers of a returned placement group");
        }
        Ok(Response::new(pb::ReturnBundlesReply {
            workers_stopped,
            resources: Some(self.0.resources_of(&names)),
        }))
    }

    async fn start_job_supervisor(
        &self,
        req: Request<pb::StartJobSupervisorRequest>,
    ) -> Result<Response<pb::StartJobSupervisorReply>, Status> {
        let job = req.into_inner().job.ok_or_else(|| Status::invalid_argument("missing job"))?;
        self.0.start_job_supervisor(job).await?;
        Ok(Response::new(pb::StartJobSupervisorReply {}))
    }

    async fn stop_job_supervisor(
        &self,
        req: Request<pb::StopJobSupervisorRequest>,
    ) -> Result<Response<pb::StopJobSupervisorReply>, Status> {
        let found = self.0.stop_job_supervisor(&req.into_inner().submission_id);
        Ok(Response::new(pb::StopJobSupervisorReply { found }))
    }

    async fn list_logs(
        &self,
        req: Request<pb::ListLogsRequest>,
    ) -> Result<Response<pb::ListLogsReply>, Status> {
        let dir = self.0.config.session_dir.join("logs");
        let glob = req.into_inner().glob;
        let files = tokio::task::spawn_blocking(move || crate::logfiles::list(&dir, &glob))
            .await
            .map_err(|e| Status::internal(e.to_string()))??;
        Ok(Response::new(pb::ListLogsReply { files }))
    }

    async fn read_log(
        &self,
        req: Request<pb::ReadLogRequest>,
    ) -> Result<Response<pb::ReadLogReply>, Status> {
        let dir = self.0.config.session_dir.join("logs");
        let req = req.into_inner();
        let r = tokio::task::spawn_blocking(move || crate::logfiles::read(&dir, &req))
            .await
            .map_err(|e| Status::internal(e.to_string()))??;
        Ok(Response::new(r))
    }

    async fn read_job_logs(
        &self,
        req: Request<pb::ReadJobLogsRequest>,
    ) -> Result<Response<pb::ReadJobLogsReply>, Status> {
        self.0.read_job_logs(req.into_inner()).await.map(Response::new)
    }

    async fn prestart_workers(
        &self,
        req: Request<pb::PrestartWorkersRequest>,
    ) -> Result<Response<pb::PrestartWorkersReply>, Status> {
        let req = req.into_inner();
        if req.job_id.is_empty() {
            return Err(Status::invalid_argument("missing job_id"));
        }
        let key = PoolKey {
            job_id: req.job_id,
            language: if req.language.is_empty() { "rust".into() } else { req.language },
            runtime_env_hash: req.runtime_env_hash,
            tpu_chips: vec![],
            gpus: vec![],
        };
        // Up to the node's CPUs, counting workers this job already has here.
        let cpus = (self.0.lock().ledger.total().get("CPU").0
            / tpuray_scheduler::resources::UNITS_PER_WHOLE)
            .max(1) as u32;
        let have = self.0.lock().workers.values().filter(|w| w.key == key).count() as u32;
        let n = req.count.min(cpus).saturating_sub(have);
        for _ in 0..n {
            let agent = Arc::clone(&self.0);
            let key = key.clone();
            tokio::spawn(async move {
                let _permit = Arc::clone(&agent.starts).acquire_owned().await;
                let idle = WorkerState::Idle { since: Instant::now() };
                if let Err(e) = agent.start_worker(key, 0, Amount::ZERO, idle, None).await {
                    tracing::warn!(%e, "pre-starting a worker failed");
                }
            });
        }
        Ok(Response::new(pb::PrestartWorkersReply { started: n }))
    }

    async fn list_workers(
        &self,
        _req: Request<pb::ListWorkersRequest>,
    ) -> Result<Response<pb::ListWorkersReply>, Status> {
        let st = self.0.lock();
        let workers = st
            .workers
            .iter()
            .map(|(id, w)| {
                let (state, lease_id, actor_id, resources) = match &w.state {
                    WorkerState::Starting => {
                        ("STARTING", String::new(), String::new(), ResourceSet::new())
                    }
                    WorkerState::Idle { .. } => {
                        ("IDLE", String::new(), String::new(), ResourceSet::new())
                    }
                    WorkerState::Leased(l) => (
                        "LEASED",
                        l.to_string(),
                        String::new(),
                        st.leases.get(l).map(|l| l.hold.resources.clone()).unwrap_or_default(),
                    ),
                    WorkerState::Actor(a) => (
                        "ACTOR",
                        String::new(),
                        a.to_string(),
                        st.actor_resources.get(a).map(|r| r.1.clone()).unwrap_or_default(),
                    ),
                };
                pb::WorkerInfo {
                    worker_id: id.to_string(),
                    pid: w.pid,
                    address: w.address.clone(),
                    key: Some(pb::WorkerPoolKey {
                        job_id: w.key.job_id.clone(),
                        language: w.key.language.clone(),
                        runtime_env_hash: w.key.runtime_env_hash.clone(),
                        tpu_chips: w.key.tpu_chips.clone(),
                    }),
                    state: state.to_string(),
                    lease_id,
                    actor_id,
                    resources: resources_to_proto(&resources),
                }
            })
            .collect();
        Ok(Response::new(pb::ListWorkersReply { workers }))
    }
}

/// HEAD-13: `changed` nodes replace their entries in `view` (or join it), `removed` ones
/// leave it; the other entries stay as they are.
fn apply_view_delta(
    view: &mut Vec<(NodeView<String>, String)>,
    changed: Vec<(NodeView<String>, String)>,
    removed: &[String],
) {
    if changed.is_empty() && removed.is_empty() {
        return;
    }
    let gone: std::collections::HashSet<&str> = removed.iter().map(String::as_str).collect();
    let fresh: std::collections::HashSet<&str> =
        changed.iter().map(|(v, _)| v.id.as_str()).collect();
    view.retain(|(v, _)| !gone.contains(v.id.as_str()) && !fresh.contains(v.id.as_str()));
    view.extend(changed);
}

#[cfg(test)]
mod view_tests {
    use super::*;

    fn entry(id: &str, cpu: u64) -> (NodeView<String>, String) {
        let mut total = ResourceSet::new();
        total.set("CPU", tpuray_scheduler::Amount::whole(cpu));
        let view = NodeView {
            id: id.to_string(),
            total: total.clone(),
            available: total,
            labels: Labels::default(),
            alive: true,
        };
        (view, format!("{id}:1"))
    }

    #[test]
    fn a_view_delta_replaces_changed_nodes_drops_removed_ones_and_keeps_the_rest() {
        let mut view = vec![entry("a", 1), entry("b", 1), entry("c", 1)];
        apply_view_delta(&mut view, vec![entry("b", 8), entry("d", 2)], &["c".to_string()]);
        let mut got: Vec<(String, f64)> =
            view.iter().map(|(v, _)| (v.id.clone(), v.total.get("CPU").to_f64())).collect();
        got.sort_by(|x, y| x.0.cmp(&y.0));
        let want = [("a", 1.0), ("b", 8.0), ("d", 2.0)].map(|(k, v)| (k.to_string(), v));
        assert_eq!(got, want.to_vec());
        // An empty delta changes nothing.
        apply_view_delta(&mut view, vec![], &[]);
        assert_eq!(view.len(), 3);
    }
}
