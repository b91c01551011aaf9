//! `HeadService`: the gRPC face of the head, the node-death monitor and the
//! actor placement loop.
//!
//! Durable changes go through [`Head::commit`]: the command is proposed to the Raft log
//! (`replication.rs`) and the call returns once the log applied it, on this head and on
//! a majority's logs (HEAD-6). Every head applies every command ([`Head::apply_committed`],
//! on the Raft thread); only the leader serves clients, places actors and groups, and
//! watches heartbeats (HEAD-7). Soft state is the leader's alone and is rebuilt from node
//! reports when a head becomes leader (HEAD-8).
//!
//! One `std::sync::Mutex` guards the state machine and soft state; it is held
//! only for in-memory work, never across an `.await`.
//!
//! HEAD-6 in detail: every head applies every committed command in log order on its Raft
//! thread, publishing state changes with the same sequence numbers, so a subscriber
//! resumes on a new leader. A command whose outcome is unknown (leadership lost after
//! proposing) is answered `UNAVAILABLE`: the client's retry with the same request id
//! applies it at most once (HEAD-2, whose memory travels in snapshots). Creation (jobs,
//! actors, named actors, groups) is thereby linearizable and idempotent across failovers.
//!
//! Defaults (`HeadConfig`, read from the environment by `cli/src/procs.rs`): heartbeats
//! every 1 s and a death timeout of 5 s (10 s before issue 21: with CORE-10 the death
//! notice is what recovery waits for), changed by `TPURAY_HEARTBEAT_INTERVAL_MS` and
//! `TPURAY_NODE_DEATH_TIMEOUT_MS`; the head tells agents the interval at registration.
//! Raft ticks every 50 ms (`TPURAY_RAFT_TICK_MS`): elections start after 10 to 20 ticks
//! without a leader, leaders send heartbeats every 2; pre-vote and check-quorum are on. A
//! snapshot is taken every 10,000 applied commands (`TPURAY_HEAD_SNAPSHOT_EVERY`),
//! keeping a tenth as many entries behind it.

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use tokio::sync::{Notify, broadcast};
use tonic::Status;
use tonic::service::interceptor::InterceptedService;
use tpuray_proto::auth::ServerAuth;
use tpuray_proto::ids::{ActorId, JobId, NodeId, PlacementGroupId};
use tpuray_proto::pb::head_service_server::HeadServiceServer;
use tpuray_proto::{now_ms, pb};
use tpuray_replica::{NodeStatus, ProposeError, Replica, Role};

use crate::convert::{actor_to_proto, job_to_proto};
use crate::liveness::NodeSoft;
use crate::service::HeadSvc;
use crate::state::{
    Changed, Command, CommandKind, NodeRecord, NodeStatus as NodeLife, Outcome,
    PlacementGroupRecord, Rejection, StateMachine,
};
use crate::view::ViewLog;

/// How many state changes are kept for subscribers that resume.
const CHANGE_LOG_CAPACITY: usize = 10_000;
/// How many tasks `list tasks` remembers (oldest dropped first).
pub(crate) const MAX_TASKS_KEPT: usize = 100_000;

/// Head settings.
#[derive(Clone, Debug)]
pub struct HeadConfig {
    /// Address to listen on, e.g. `127.0.0.1:6379`.
    pub listen: SocketAddr,
    /// The cluster token; `None` only when auth is disabled.
    pub token: Option<String>,
    /// Whether calls must carry the token (AUTH-1).
    pub auth_required: bool,
    /// How often node agents send heartbeats.
    pub heartbeat_interval: Duration,
    /// A node that sent no heartbeat for this long is declared dead (HEAD-4).
    pub node_death_timeout: Duration,
    /// This head's replica id: its 1-based position in `peers` (1 for a lone head).
    pub replica_id: u64,
    /// Every head's address (`host:port`, by replica id); empty for a lone head.
    pub peers: Vec<String>,
    /// Where the Raft log and snapshots live (`sled`); `None` keeps them in memory.
    pub data_dir: Option<PathBuf>,
    /// Raft's clock: elections start after 10 to 20 ticks without a leader, a leader
    /// sends heartbeats every 2.
    pub raft_tick: Duration,
    /// Applied commands between two snapshots; the log keeps about this many entries.
    pub snapshot_every: u64,
    /// The HTTP server (dashboard port); `None` serves none.
    pub dashboard: Option<crate::http::DashboardConfig>,
    /// The session folder, where the head keeps Prometheus's service-discovery file
    /// (`metrics.rs`); `None` writes none.
    pub session_dir: Option<PathBuf>,
}

impl HeadConfig {
    /// A lone head on `listen` with defaults for the rest.
    pub fn single(listen: SocketAddr) -> Self {
        Self {
            listen,
            token: None,
            auth_required: false,
            heartbeat_interval: Duration::from_secs(1),
            node_death_timeout: Duration::from_secs(10),
            replica_id: 1,
            peers: Vec::new(),
            data_dir: None,
            raft_tick: Duration::from_millis(50),
            snapshot_every: 10_000,
            dashboard: None,
            session_dir: None,
        }
    }

    /// Every replica's address by id (this head's own listen address for a lone head).
    pub fn replicas(&self) -> Vec<String> {
        if self.peers.is_empty() { vec![self.listen.to_string()] } else { self.peers.clone() }
    }

    /// The address of replica `id`, if there is one.
    pub fn replica_address(&self, id: u64) -> Option<String> {
        let i = usize::try_from(id).ok()?.checked_sub(1)?;
        self.replicas().get(i).cloned()
    }
}

pub(crate) struct Inner {
    pub(crate) sm: StateMachine,
    pub(crate) soft: HashMap<NodeId, NodeSoft>,
    pub(crate) changes: VecDeque<pb::StateChange>,
    /// Sequence number of the last state change; every head counts the same way, so a
    /// subscriber resumes on a new leader (it travels in snapshots).
    pub(crate) seq: u64,
    /// Why each unplaced actor waits (soft): (reason, infeasible).
    pub(crate) actor_pending: HashMap<ActorId, (String, bool)>,
    /// Actors whose worker start is in flight.
    pub(crate) placing: HashSet<ActorId>,
    /// Why each unplaced placement group waits (soft): (reason, infeasible).
    pub(crate) pg_pending: HashMap<PlacementGroupId, (String, bool)>,
    /// Groups whose reservation is in flight (HEAD-5).
    pub(crate) pg_placing: HashSet<PlacementGroupId>,
    /// The groups that want placement (pending or rescheduling), kept with the state
    /// machine's changes, so a placement pass need not scan every group ever made.
    pub(crate) pg_waiting: BTreeSet<PlacementGroupId>,
    /// Bundles being given back because no record holds them (HEAD-8).
    pub(crate) returning: HashSet<(PlacementGroupId, NodeId)>,
    /// Task summaries from task events (soft, bounded, lossy).
    pub(crate) tasks: HashMap<String, pb::TaskSummary>,
    pub(crate) task_order: VecDeque<String>,
    pub(crate) tasks_dropped: u64,
    /// Tasks by job, name and owner state, kept with the table, for `ray_tasks`
    /// (`metrics.rs`; finished tasks the table forgets stay counted).
    pub(crate) task_tally: crate::metrics::TaskTally,
    /// The job sweep's soft state (HEAD-11, `jobs.rs`).
    pub(crate) jobs_soft: crate::jobs::JobsSoft,
    /// HEAD-13: change numbers of the nodes' entries in heartbeat replies' cluster view.
    pub(crate) view: ViewLog<NodeId>,
    /// HEAD-13: each node's view entry as last built, with the view version it was built
    /// at. After a join storm every entry goes to every agent, and building one (its
    /// resource maps) per reply cost a quarter of the head's CPU at 3,000 nodes; now it
    /// is built once per change. Cleared with the view log.
    pub(crate) view_entries: HashMap<NodeId, (u64, pb::NodeInfo)>,
}

impl Inner {
    /// HEAD-13: a view log of a new epoch holding every live node: every agent's view is
    /// from another term now, and each starts over.
    fn new_view_log(&mut self) {
        self.view = ViewLog::new(rand::random());
        self.view_entries.clear();
        for n in self.sm.nodes.values().filter(|n| n.status == NodeLife::Alive) {
            self.view.touch(&n.node_id);
        }
    }

    /// Forgets the soft state of a leadership term. `placing` and `pg_placing` stay: their
    /// entries are starts and reservations this process still runs, each removing its own
    /// entry when it ends; should this head lead again meanwhile, it must neither place
    /// those twice nor take their workers and bundles for orphans (HEAD-8).
    fn reset_soft(&mut self) {
        self.new_view_log();
        self.soft.clear();
        self.actor_pending.clear();
        self.pg_pending.clear();
        self.returning.clear();
        self.jobs_soft = Default::default();
    }
}

/// The head's shared state; cheap to clone through `Arc`.
pub struct Head {
    pub(crate) inner: Mutex<Inner>,
    pub(crate) events: broadcast::Sender<pb::StateChange>,
    /// Wakes the placement loop (groups, then actors).
    pub(crate) placement_wake: Notify,
    /// Wakes waiters for actor state (GetActor with wait).
    pub(crate) actor_changed: Notify,
    /// Wakes waiters for placement group state (GetPlacementGroup with wait).
    pub(crate) pg_changed: Notify,
    pub(crate) config: HeadConfig,
    pub(crate) start_time_ms: u64,
    /// The Raft replica (set once at start).
    pub(crate) replica: OnceLock<Arc<Replica<Outcome>>>,
    /// Whether this head is the leader and applied everything before its term (HEAD-7).
    pub(crate) leading: AtomicBool,
    /// The runtime the head's tasks run on (callbacks from the Raft thread spawn here).
    pub(crate) rt: tokio::runtime::Handle,
    /// Node agent clients by address: one HTTP/2 channel per agent, reused by every call
    /// (a fresh connection per call cost more than the call).
    pub(crate) agents: Mutex<HashMap<String, AgentClient>>,
    /// HEAD-12: when each watched driver was first found unreachable (soft).
    pub(crate) driver_misses: Mutex<HashMap<JobId, (Instant, bool)>>,
    /// This head's HTTP server, `http://ADDRESS:PORT` (set once it listens).
    pub(crate) dashboard_url: OnceLock<String>,
    /// What `/metrics` scrapes remember (`metrics.rs`).
    pub(crate) metrics: crate::metrics::HeadMetrics,
}

/// A client of a node agent's `NodeAgentService`.
pub(crate) type AgentClient =
    pb::node_agent_service_client::NodeAgentServiceClient<tpuray_proto::client::AuthChannel>;

impl Head {
    /// A head with no replica yet; needs a tokio runtime (it keeps its handle).
    pub fn new(config: HeadConfig) -> Arc<Self> {
        let (events, _) = broadcast::channel(4096);
        Arc::new(Self {
            inner: Mutex::new(Inner {
                sm: StateMachine::new(),
                soft: HashMap::new(),
                changes: VecDeque::new(),
                seq: 0,
                actor_pending: HashMap::new(),
                placing: HashSet::new(),
                pg_pending: HashMap::new(),
                pg_placing: HashSet::new(),
                pg_waiting: BTreeSet::new(),
                returning: HashSet::new(),
                tasks: HashMap::new(),
                task_order: VecDeque::new(),
                tasks_dropped: 0,
                task_tally: Default::default(),
                jobs_soft: Default::default(),
                view: ViewLog::new(rand::random()),
                view_entries: HashMap::new(),
            }),
            events,
            placement_wake: Notify::new(),
            actor_changed: Notify::new(),
            pg_changed: Notify::new(),
            config,
            start_time_ms: now_ms(),
            replica: OnceLock::new(),
            leading: AtomicBool::new(false),
            rt: tokio::runtime::Handle::current(),
            agents: Mutex::new(HashMap::new()),
            dashboard_url: OnceLock::new(),
            driver_misses: Mutex::new(HashMap::new()),
            metrics: Default::default(),
        })
    }

    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The Raft replica, once started.
    pub(crate) fn replica(&self) -> Option<&Arc<Replica<Outcome>>> {
        self.replica.get()
    }

    /// The cluster's id (set by its first leader; "" before).
    pub(crate) fn cluster_id(&self) -> String {
        self.lock().sm.cluster_id.clone()
    }

    /// Whether this head serves clients now (HEAD-7).
    pub fn is_leader(&self) -> bool {
        self.leading.load(Ordering::Acquire)
    }

    /// The Raft replica's status.
    pub fn replica_status(&self) -> Option<NodeStatus> {
        self.replica.get().map(|r| r.status())
    }

    /// The status a head that cannot serve a call answers: `UNAVAILABLE` naming the
    /// leader's address when known, which clients follow (CLIENT-1).
    pub(crate) fn redirect(&self, why: &str) -> Status {
        let id = self.config.replica_id;
        let Some(st) = self.replica_status() else {
            return tpuray_proto::client::not_leader(None, format!("head {id} is starting"));
        };
        if st.role == Role::Leader {
            let me = self.config.replica_address(id);
            return tpuray_proto::client::not_leader(
                me.as_deref(),
                format!("head {id} is the leader but still applying the log{why}; retry shortly"),
            );
        }
        let leader = self.config.replica_address(st.leader_id);
        let named = leader.clone().unwrap_or_else(|| "none yet, an election is running".into());
        tpuray_proto::client::not_leader(
            leader.as_deref(),
            format!("head {id} is not the leader (leader: {named}){why}"),
        )
    }

    /// `Ok` on the serving leader, else the redirect status (HEAD-7).
    pub(crate) fn route(&self) -> Result<(), Status> {
        if self.is_leader() { Ok(()) } else { Err(self.redirect("")) }
    }

    /// The client of the node agent at `address` (cached: one channel per agent).
    ///
    /// # Errors
    /// `INTERNAL` for an address that is not `HOST:PORT`.
    pub(crate) fn agent_client(&self, address: &str) -> Result<AgentClient, Status> {
        let mut agents = self.agents.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = agents.get(address) {
            return Ok(c.clone());
        }
        let c = tpuray_proto::client::agent(address, self.config.token.as_deref())
            .map_err(|e| Status::internal(e.to_string()))?;
        agents.insert(address.to_string(), c.clone());
        Ok(c)
    }

    /// HEAD-6: proposes a durable command to the Raft log and returns its outcome once
    /// the log applied it. A retry of the same request id after a failover gets the
    /// first outcome (HEAD-2).
    ///
    /// # Errors
    /// `UNAVAILABLE` with the leader's address when this head is not (or stops being)
    /// the leader before the command is applied: the client retries there.
    pub async fn commit(&self, cmd: Command) -> Result<Outcome, Status> {
        self.route()?;
        let replica = self.replica.get().ok_or_else(|| self.redirect(""))?;
        let (tx, rx) = tokio::sync::oneshot::channel();
        replica.propose(
            crate::state::encode_command(&cmd),
            Box::new(move |r| {
                let _ = tx.send(r);
            }),
        );
        match rx.await {
            Ok(Ok(outcome)) => Ok(outcome),
            Ok(Err(ProposeError::NotLeader { .. })) => Err(self.redirect("")),
            Ok(Err(ProposeError::Overwritten)) => {
                Err(self.redirect(" (the command's entry was replaced by a new leader's)"))
            }
            Ok(Err(ProposeError::Stopped)) | Err(_) => {
                Err(Status::unavailable(format!("head {} is stopping", self.config.replica_id)))
            }
        }
    }

    /// Applies a committed command and publishes what changed (HEAD-1). Runs on the Raft
    /// thread of every head, in log order.
    pub(crate) fn apply_committed(&self, cmd: Command) -> Outcome {
        let mut inner = self.lock();
        let (outcome, changed) = inner.sm.apply(cmd);
        let mut actors_changed = false;
        let mut groups_changed = false;
        for c in changed {
            let change = match &c {
                Changed::Node(id) => {
                    // HEAD-13: a node that joined or died changes the agents' view.
                    if inner.sm.nodes.get(id).is_some_and(|n| n.status == NodeLife::Alive) {
                        inner.view.touch(id);
                    } else {
                        inner.view.remove(id);
                        inner.view_entries.remove(id);
                    }
                    inner
                        .sm
                        .nodes
                        .get(id)
                        .map(|n| pb::state_change::Change::Node(self.node_info(&inner, n)))
                }
                Changed::Job(id) => {
                    inner.sm.jobs.get(id).map(|j| pb::state_change::Change::Job(job_to_proto(j)))
                }
                Changed::Actor(id) => {
                    actors_changed = true;
                    inner.sm.actors.get(id).map(|a| {
                        let pending = inner.actor_pending.get(id).map(|p| p.0.as_str());
                        pb::state_change::Change::Actor(actor_to_proto(a, pending))
                    })
                }
                Changed::PlacementGroup(id) => {
                    groups_changed = true;
                    let pg = inner.sm.placement_groups.get(id);
                    if pg.is_some_and(PlacementGroupRecord::wants_placement) {
                        inner.pg_waiting.insert(id.clone());
                    } else {
                        inner.pg_waiting.remove(id);
                    }
                    inner
                        .sm
                        .placement_groups
                        .get(id)
                        .map(|p| pb::state_change::Change::PlacementGroup(self.pg_info(&inner, p)))
                }
            };
            if let Some(change) = change {
                inner.seq += 1;
                let sc = pb::StateChange { seq: inner.seq, change: Some(change) };
                inner.changes.push_back(sc.clone());
                while inner.changes.len() > CHANGE_LOG_CAPACITY {
                    inner.changes.pop_front();
                }
                let _ = self.events.send(sc);
            }
        }
        drop(inner);
        if groups_changed {
            self.pg_changed.notify_waiters();
        }
        if actors_changed || groups_changed {
            self.actor_changed.notify_waiters();
            self.placement_wake.notify_one();
        }
        outcome
    }

    /// The durable state as snapshot bytes (RAFT-4), taken on the Raft thread.
    pub(crate) fn snapshot_state(&self) -> Vec<u8> {
        let inner = self.lock();
        inner.sm.snapshot(inner.seq)
    }

    /// Replaces the durable state with a snapshot's (a restart, or a follower far behind).
    pub(crate) fn restore_state(&self, data: &[u8]) -> Result<(), String> {
        let (sm, seq) = StateMachine::restore(data)?;
        let mut inner = self.lock();
        inner.pg_waiting = sm
            .placement_groups
            .values()
            .filter(|p| p.wants_placement())
            .map(|p| p.pg_id.clone())
            .collect();
        inner.sm = sm;
        inner.seq = seq;
        inner.changes.clear();
        inner.new_view_log();
        drop(inner);
        self.actor_changed.notify_waiters();
        self.pg_changed.notify_waiters();
        Ok(())
    }

    /// Called on the Raft thread when the replica's role or leader changes (HEAD-8): a
    /// head that starts serving rebuilds soft state (every live node gets a fresh death
    /// clock; resources come with its next heartbeat), names the cluster if no leader
    /// did, and places what waits; one that stops serving drops its soft state.
    pub(crate) fn on_replica_change(self: &Arc<Self>, st: &NodeStatus) {
        tracing::info!(
            replica = st.id,
            role = st.role.name(),
            term = st.term,
            leader = st.leader_id,
            ready = st.leader_ready,
            "raft role changed"
        );
        let was = self.is_leader();
        if st.leader_ready && !was {
            {
                let mut inner = self.lock();
                inner.reset_soft();
                let alive: Vec<NodeRecord> = inner
                    .sm
                    .nodes
                    .values()
                    .filter(|n| n.status == NodeLife::Alive)
                    .cloned()
                    .collect();
                let now = Instant::now();
                for n in alive {
                    inner.soft.insert(n.node_id.clone(), NodeSoft::unheard(n.total.clone(), now));
                }
            }
            self.leading.store(true, Ordering::Release);
            tracing::info!(replica = st.id, term = st.term, "this head leads the cluster now");
            let head = Arc::clone(self);
            self.rt.spawn(async move {
                if head.cluster_id().is_empty() {
                    let cmd = Command {
                        request_id: format!("init-cluster-{}", head.config.replica_id),
                        kind: CommandKind::InitCluster {
                            cluster_id: JobId::random().to_string(),
                            created_ms: now_ms(),
                        },
                    };
                    if let Err(s) = head.commit(cmd).await {
                        tracing::warn!(%s, "naming the cluster failed; the next leader will");
                    }
                }
                head.placement_wake.notify_one();
            });
        } else if !st.leader_ready && was {
            self.leading.store(false, Ordering::Release);
            self.lock().reset_soft();
            tracing::info!(replica = st.id, "this head no longer leads");
        }
    }
}

/// Records why `id` waits for placement (soft state shown by `status` and `list`);
/// true when it just became infeasible (so the caller warns once, not every pass).
pub(crate) fn mark_waiting<K: std::hash::Hash + Eq + Clone>(
    waiting: &mut HashMap<K, (String, bool)>,
    id: &K,
    reason: String,
    infeasible: bool,
) -> bool {
    let was_infeasible = waiting.get(id).is_some_and(|p| p.1);
    waiting.insert(id.clone(), (reason, infeasible));
    infeasible && !was_infeasible
}

pub(crate) fn rejection_status(r: Rejection) -> Status {
    match r {
        Rejection::AlreadyExists(m) => Status::already_exists(m),
        Rejection::NotFound(m) => Status::not_found(m),
        Rejection::Invalid(m) => Status::invalid_argument(m),
    }
}

pub(crate) fn require_id(what: &str, v: &str) -> Result<(), Status> {
    if v.is_empty() { Err(Status::invalid_argument(format!("missing {what}"))) } else { Ok(()) }
}

/// Errors starting or running the head.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot listen on {addr}: {detail}")]
    Listen { addr: SocketAddr, detail: String },
    #[error("{0}")]
    Config(String),
    #[error("head log in {dir}: {detail}")]
    Storage { dir: String, detail: String },
}

/// Checks the replica settings: `replica_id` names an entry of `peers`.
fn check_replicas(config: &HeadConfig) -> Result<(), ServeError> {
    let n = config.replicas().len() as u64;
    if config.replica_id == 0 || config.replica_id > n {
        return Err(ServeError::Config(format!(
            "--head-id {} is not a position in --head-peers (expected 1 to {n})",
            config.replica_id
        )));
    }
    for a in config.replicas() {
        tpuray_proto::client::check_address(&a)
            .map_err(|e| ServeError::Config(format!("--head-peers: {e}")))?;
    }
    Ok(())
}

/// Opens the log over `kv` and starts the Raft thread (blocking: run it off the runtime).
fn start_replica<K: tpuray_replica::KvStore>(
    head: &Arc<Head>,
    kv: K,
) -> Result<Arc<Replica<Outcome>>, tpuray_replica::NodeError> {
    let config = &head.config;
    let voters: Vec<u64> = (1..=config.replicas().len() as u64).collect();
    let mut cfg = tpuray_replica::NodeConfig::new(config.replica_id, voters);
    cfg.snapshot_every = config.snapshot_every.max(1);
    cfg.keep_after_snapshot = (config.snapshot_every / 10).max(1);
    let cell: crate::replication::ReplicaCell = Arc::new(OnceLock::new());
    let transport = crate::replication::PeerTransport::start(
        config.replica_id,
        &config.replicas(),
        config.token.clone(),
        &head.rt,
        cell.clone(),
    );
    let incarnation = u64::from_str_radix(&JobId::random().to_string()[..16], 16).unwrap_or(1);
    let on_change = {
        let head = Arc::downgrade(head);
        move |st: &NodeStatus| {
            if let Some(h) = head.upgrade() {
                h.on_replica_change(st);
            }
        }
    };
    let replica = Arc::new(Replica::start(
        cfg,
        config.raft_tick,
        kv,
        crate::replication::HeadMachine(Arc::clone(head)),
        incarnation,
        transport,
        on_change,
        |e| {
            // RAFT-2: a head whose log cannot be written must not serve.
            eprintln!("tpuray: the head's log failed ({e}); the head exits");
            std::process::exit(1);
        },
    )?);
    let _ = cell.set(Arc::downgrade(&replica));
    Ok(replica)
}

/// What [`serve`] tells its caller once the head accepts connections.
#[derive(Clone, Debug)]
pub struct Ready {
    /// The advertised address with the bound port.
    pub address: SocketAddr,
    /// The HTTP server, `http://ADDRESS:PORT`, when one was asked for.
    pub dashboard_url: Option<String>,
}

/// Serves the head on `config.listen` (NET-3: on every address when that is not a
/// loopback address), and its HTTP server when `config.dashboard` asks for one, until
/// `shutdown` resolves. `ready` is called once the servers accept connections (before a
/// leader is elected: calls until then are answered `UNAVAILABLE`, and clients retry).
///
/// # Errors
/// [`ServeError`] when the address cannot be bound, the replica settings are wrong,
/// the log cannot be opened, or the server fails.
pub async fn serve(
    config: HeadConfig,
    ready: impl FnOnce(Ready),
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    check_replicas(&config)?;
    // NET-3: a head advertising a non-loopback address serves on every address.
    let listener = tokio::net::TcpListener::bind(tpuray_proto::net::bind_address(config.listen))
        .await
        .map_err(|e| ServeError::Listen { addr: config.listen, detail: e.to_string() })?;
    let addr = listener
        .local_addr()
        .map(|bound| SocketAddr::new(config.listen.ip(), bound.port()))
        .map_err(|e| ServeError::Listen { addr: config.listen, detail: e.to_string() })?;
    // A lone head given port 0 is at the port it was bound to: its replica list (`tpuray
    // status`, the HTTP API) names that one, not an unreachable port 0.
    let mut config = config;
    if config.peers.is_empty() {
        config.listen = addr;
    }
    let dashboard = match &config.dashboard {
        Some(d) => {
            Some(crate::http::bind(d, config.listen.ip()).await.map_err(ServeError::Config)?)
        }
        None => None,
    };
    let auth = ServerAuth::new(config.token.as_deref().unwrap_or(""), config.auth_required);
    let head = Head::new(config.clone());

    let opener = Arc::clone(&head);
    let replica = tokio::task::spawn_blocking(move || match &opener.config.data_dir {
        Some(dir) => {
            let storage =
                |detail: String| ServeError::Storage { dir: dir.display().to_string(), detail };
            std::fs::create_dir_all(dir).map_err(|e| storage(e.to_string()))?;
            let kv = tpuray_replica::SledKv::open(dir).map_err(|e| storage(e.to_string()))?;
            start_replica(&opener, kv).map_err(|e| storage(e.to_string()))
        }
        None => start_replica(&opener, tpuray_replica::MemKv::new())
            .map_err(|e| ServeError::Storage { dir: "memory".into(), detail: e.to_string() }),
    })
    .await
    .map_err(|e| ServeError::Config(format!("starting the head's log: {e}")))??;
    let _ = head.replica.set(Arc::clone(&replica));

    // HEAD-4: the death monitor runs on its own task, independent of RPC load.
    let monitor = Arc::clone(&head);
    let tick = (config.heartbeat_interval / 2).max(Duration::from_millis(50));
    tokio::spawn(async move {
        let mut iv = tokio::time::interval(tick);
        iv.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            iv.tick().await;
            monitor.check_node_deaths().await;
        }
    });
    // HEAD-12: driver jobs whose driver process is gone end.
    let watcher = Arc::clone(&head);
    tokio::spawn(async move {
        let mut iv = tokio::time::interval(crate::drivers::CHECK_EVERY);
        iv.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            iv.tick().await;
            watcher.check_drivers().await;
        }
    });
    let placer = Arc::clone(&head);
    tokio::spawn(async move {
        loop {
            let _ = tokio::time::timeout(Duration::from_secs(1), placer.placement_wake.notified())
                .await;
            placer.place_actors();
            placer.sweep_jobs();
        }
    });

    let svc = HeadServiceServer::new(HeadSvc(Arc::clone(&head)))
        .max_decoding_message_size(tpuray_proto::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(tpuray_proto::MAX_MESSAGE_BYTES);
    let svc = crate::replication::LeaderGate { inner: svc, head: Arc::clone(&head) };
    let svc = InterceptedService::new(svc, auth.clone());
    let peer = tpuray_proto::pb::head_peer_service_server::HeadPeerServiceServer::new(
        crate::replication::PeerSvc(Arc::clone(&head)),
    )
    .max_decoding_message_size(tpuray_proto::MAX_PEER_MESSAGE_BYTES)
    .max_encoding_message_size(tpuray_proto::MAX_PEER_MESSAGE_BYTES);
    let peer = InterceptedService::new(peer, auth);
    // TLS-1: this process's identity (from the environment `tpuray start` sets).
    let tls = tpuray_proto::tls::current().map_err(ServeError::Config)?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    });
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let mut dashboard_url = None;
    let mut http_task = None;
    if let Some(listener) = dashboard {
        let port = listener
            .local_addr()
            .map_err(|e| ServeError::Config(format!("the dashboard's listener: {e}")))?
            .port();
        let host = match config.dashboard.as_ref().and_then(|d| d.host) {
            Some(h) if !h.is_unspecified() => h,
            _ => addr.ip(),
        };
        let scheme = if tls.is_some() { "https" } else { "http" };
        let url = format!("{scheme}://{}", SocketAddr::new(host, port));
        let _ = head.dashboard_url.set(url.clone());
        let own = if config.peers.is_empty() { addr.to_string() } else { config.peers.join(",") };
        let router = crate::http::router(Arc::clone(&head), &own).map_err(ServeError::Config)?;
        http_task =
            Some(tokio::spawn(crate::http::serve(listener, router, stopped(stop_rx.clone()))));
        dashboard_url = Some(url);
    }
    if let Some(dir) = &config.session_dir {
        crate::metrics::spawn_discovery_writer(Arc::clone(&head), dir.clone());
    }
    ready(Ready { address: addr, dashboard_url });
    // NET-2: the head's services on h2 directly, as a worker's (issue 34: the per-call
    // cost of tonic's server was most of a heartbeat's CPU after the kernel's).
    let routes = tonic::service::Routes::new(svc).add_service(peer);
    tpuray_proto::h2grpc::serve("head", listener, routes, stopped(stop_rx)).await;
    if let Some(t) = http_task {
        let _ = t.await;
    }
    let _ = tokio::task::spawn_blocking(move || replica.stop()).await;
    Ok(())
}
