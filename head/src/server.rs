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

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use tokio::sync::{Notify, broadcast};
use tokio_stream::Stream;
use tonic::service::interceptor::InterceptedService;
use tonic::{Request, Response, Status};
use tpuray_proto::auth::ServerAuth;
use tpuray_proto::convert::{labels_from_proto, resources_from_proto, resources_to_proto};
use tpuray_proto::ids::{ActorId, JobId, NodeId, PlacementGroupId, WorkerId};
use tpuray_proto::pb::head_service_server::{HeadService, HeadServiceServer};
use tpuray_proto::{PROTOCOL_VERSION, check_protocol_version, now_ms, pb};
use tpuray_replica::{NodeStatus, ProposeError, Replica, Role};
use tpuray_scheduler::{Decision, Labels, NodeView, ResourceSet};

use crate::convert::{actor_to_proto, job_to_proto, node_to_proto};
use crate::state::{
    ActorRecord, ActorStatus, Changed, Command, CommandKind, DEFAULT_NAMESPACE, JobRecord,
    JobStatus, NodeRecord, NodeStatus as NodeLife, Outcome, PlacementGroupRecord, Rejection,
    StateMachine,
};
use crate::view::{ViewLog, ViewUpdate};

/// How many state changes are kept for subscribers that resume.
const CHANGE_LOG_CAPACITY: usize = 10_000;
/// How many tasks `list tasks` remembers (oldest dropped first).
const MAX_TASKS_KEPT: usize = 100_000;
/// Extra time a new leader gives nodes it has not heard from before declaring them dead.
const FAILOVER_GRACE: Duration = Duration::from_secs(5);
/// How often the leader compares a node agent's actor workers with the durable state.
const RECONCILE_EVERY: Duration = Duration::from_secs(30);

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

pub(crate) struct NodeSoft {
    last_heartbeat: Instant,
    last_heartbeat_ms: u64,
    /// Registered resources plus committed bundles' (from the agent).
    pub(crate) total: ResourceSet,
    pub(crate) available: ResourceSet,
    pending: Vec<pb::ResourceDemand>,
    num_workers: u32,
    /// Whether the node reported since this head became leader (its resources are known).
    pub(crate) reported: bool,
    /// When this leader last compared the node's actor workers with the state (HEAD-8).
    reconciled_at: Option<Instant>,
    /// The jobs the node's agent supervises, from its last heartbeat (HEAD-11).
    pub(crate) job_submissions: HashSet<String>,
}

impl NodeSoft {
    /// A node this head has not heard from yet: its death clock starts now.
    fn unheard(rec: &NodeRecord) -> Self {
        Self {
            last_heartbeat: Instant::now(),
            last_heartbeat_ms: 0,
            total: rec.total.clone(),
            available: ResourceSet::new(),
            pending: vec![],
            num_workers: 0,
            reported: false,
            reconciled_at: None,
            job_submissions: HashSet::new(),
        }
    }
}

pub(crate) struct Inner {
    pub(crate) sm: StateMachine,
    pub(crate) soft: HashMap<NodeId, NodeSoft>,
    changes: VecDeque<pb::StateChange>,
    /// Sequence number of the last state change; every head counts the same way, so a
    /// subscriber resumes on a new leader (it travels in snapshots).
    seq: u64,
    /// Why each unplaced actor waits (soft): (reason, infeasible).
    actor_pending: HashMap<ActorId, (String, bool)>,
    /// Actors whose worker start is in flight.
    placing: HashSet<ActorId>,
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
    task_order: VecDeque<String>,
    pub(crate) tasks_dropped: u64,
    /// Tasks by job, name and owner state, kept with the table, for `ray_tasks`
    /// (`metrics.rs`; finished tasks the table forgets stay counted).
    pub(crate) task_tally: crate::metrics::TaskTally,
    /// The job sweep's soft state (HEAD-11, `jobs.rs`).
    pub(crate) jobs_soft: crate::jobs::JobsSoft,
    /// HEAD-13: change numbers of the nodes' entries in heartbeat replies' cluster view.
    pub(crate) view: ViewLog<NodeId>,
}

impl Inner {
    /// HEAD-13: a view log of a new epoch holding every live node: every agent's view is
    /// from another term now, and each starts over.
    fn new_view_log(&mut self) {
        self.view = ViewLog::new(rand::random());
        for n in self.sm.nodes.values().filter(|n| n.status == NodeLife::Alive) {
            self.view.touch(&n.node_id);
        }
    }

    /// Forgets the soft state of a leadership term.
    fn reset_soft(&mut self) {
        self.new_view_log();
        self.soft.clear();
        self.actor_pending.clear();
        self.placing.clear();
        self.pg_pending.clear();
        self.pg_placing.clear();
        self.returning.clear();
        self.jobs_soft = Default::default();
    }
}

/// The head's shared state; cheap to clone through `Arc`.
pub struct Head {
    inner: Mutex<Inner>,
    events: broadcast::Sender<pb::StateChange>,
    /// Wakes the placement loop (groups, then actors).
    pub(crate) placement_wake: Notify,
    /// Wakes waiters for actor state (GetActor with wait).
    actor_changed: Notify,
    /// Wakes waiters for placement group state (GetPlacementGroup with wait).
    pub(crate) pg_changed: Notify,
    pub(crate) config: HeadConfig,
    start_time_ms: u64,
    /// The Raft replica (set once at start).
    replica: OnceLock<Arc<Replica<Outcome>>>,
    /// Whether this head is the leader and applied everything before its term (HEAD-7).
    leading: AtomicBool,
    /// The runtime the head's tasks run on (callbacks from the Raft thread spawn here).
    rt: tokio::runtime::Handle,
    /// Node agent clients by address: one HTTP/2 channel per agent, reused by every call
    /// (a fresh connection per call cost more than the call).
    agents: Mutex<HashMap<String, AgentClient>>,
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
    fn cluster_id(&self) -> String {
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
                for n in alive {
                    inner.soft.insert(n.node_id.clone(), NodeSoft::unheard(&n));
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

    fn node_info(&self, inner: &Inner, n: &NodeRecord) -> pb::NodeInfo {
        let mut info = node_to_proto(n);
        if let Some(s) = inner.soft.get(&n.node_id).filter(|s| s.reported)
            && n.status == NodeLife::Alive
        {
            info.total = resources_to_proto(&s.total);
            info.available = resources_to_proto(&s.available);
            info.pending = s.pending.clone();
            info.num_workers = s.num_workers;
            info.last_heartbeat_ms = s.last_heartbeat_ms;
        }
        info
    }

    /// The live nodes placement may use: those that reported their resources to this
    /// leader (a new leader waits for each node's heartbeat, HEAD-8).
    pub(crate) fn alive_views(inner: &Inner) -> Vec<NodeView<String>> {
        inner
            .sm
            .nodes
            .values()
            .filter(|n| n.status == NodeLife::Alive)
            .filter_map(|n| {
                let s = inner.soft.get(&n.node_id).filter(|s| s.reported)?;
                Some(NodeView {
                    id: n.node_id.to_string(),
                    total: s.total.clone(),
                    available: s.available.clone(),
                    labels: n.labels.clone(),
                    alive: true,
                })
            })
            .collect()
    }

    /// HEAD-4: declares dead every node whose last heartbeat is older than
    /// the death timeout. Runs on its own task, on the leader only; takes the lock briefly.
    async fn check_node_deaths(&self) {
        if !self.is_leader() {
            return;
        }
        let timeout = self.config.node_death_timeout;
        let expired: Vec<(NodeId, Duration)> = {
            let inner = self.lock();
            inner
                .sm
                .nodes
                .values()
                .filter(|n| n.status == NodeLife::Alive)
                .filter_map(|n| {
                    let s = inner.soft.get(&n.node_id)?;
                    let age = s.last_heartbeat.elapsed();
                    // HEAD-8: a node not heard from since this head took over gets extra
                    // time to find the new leader (its heartbeat may be stuck on the old).
                    let limit = if s.reported { timeout } else { timeout + FAILOVER_GRACE };
                    (age > limit).then(|| (n.node_id.clone(), age))
                })
                .collect()
        };
        for (node_id, age) in expired {
            tracing::warn!(%node_id, ?age, "node missed heartbeats; marking it dead");
            let r = self
                .commit(Command {
                    request_id: String::new(),
                    kind: CommandKind::MarkNodeDead {
                        node_id: node_id.clone(),
                        reason: format!(
                            "no heartbeat for {:.1}s (timeout {:.1}s)",
                            age.as_secs_f64(),
                            timeout.as_secs_f64()
                        ),
                    },
                })
                .await;
            if let Err(s) = r {
                tracing::warn!(%node_id, %s, "marking the node dead failed");
                return;
            }
            self.lock().soft.remove(&node_id);
        }
    }

    /// One pass of placement: every placement group, then every actor, waiting
    /// for a node gets a decision; placed groups get reserved on their agents
    /// (HEAD-5), placed actors get a worker started on their node.
    fn place_actors(self: &Arc<Self>) {
        if !self.is_leader() {
            return;
        }
        let mut starts = Vec::new();
        {
            let mut inner = self.lock();
            // Nothing waits: skip building the views (they hold every node's resources,
            // and a pass runs after every group and bundle change).
            let groups_wait = inner.pg_waiting.iter().any(|id| !inner.pg_placing.contains(id));
            let actors_wait = || {
                inner.sm.actors.values().any(|a| {
                    matches!(
                        a.status,
                        ActorStatus::PendingCreation | ActorStatus::Restarting { .. }
                    ) && !inner.placing.contains(&a.actor_id)
                })
            };
            if !groups_wait && !actors_wait() {
                return;
            }
            let mut views = Self::alive_views(&inner);
            self.place_groups(&mut inner, &mut views);
            // Indexed by request class: a decision costs O(log nodes), not a scan of every
            // node per actor (SCHED-17: the same decisions as `schedule`).
            let mut views = tpuray_scheduler::ClusterView::new(views);
            let waiting: Vec<ActorRecord> = inner
                .sm
                .actors
                .values()
                .filter(|a| {
                    matches!(
                        a.status,
                        ActorStatus::PendingCreation | ActorStatus::Restarting { .. }
                    ) && !inner.placing.contains(&a.actor_id)
                })
                .cloned()
                .collect();
            for a in waiting {
                if let Some((pg_id, index)) = &a.placement_group {
                    // SCHED-19: the actor's resources already name the bundle; wait
                    // until the bundle is reserved somewhere.
                    let ready =
                        inner.sm.placement_groups.get(pg_id).is_some_and(
                            |p| match usize::try_from(*index) {
                                Ok(i) => p.bundle_nodes.get(i).is_some_and(Option::is_some),
                                Err(_) => p.bundle_nodes.iter().any(Option::is_some),
                            },
                        );
                    if !ready {
                        let reason = format!("waiting for placement group {pg_id} to be created");
                        inner.actor_pending.insert(a.actor_id.clone(), (reason, false));
                        continue;
                    }
                }
                let strategy = a.strategy();
                let req = tpuray_scheduler::Request {
                    demand: a.placement_resources.clone(),
                    strategy,
                    label_selector: a.label_selector.clone(),
                };
                let seed = now_ms() ^ a.num_restarts as u64;
                // `schedule_in` books the placement in this pass's view, so two actors do
                // not both take the last slot before the next heartbeat.
                match tpuray_scheduler::schedule_in(&mut views, &req, None, seed) {
                    Decision::Place(node) => {
                        let node_id = NodeId::from_wire(node);
                        let Some(address) = inner.sm.nodes.get(&node_id).map(|n| n.address.clone())
                        else {
                            continue;
                        };
                        inner.placing.insert(a.actor_id.clone());
                        inner.actor_pending.remove(&a.actor_id);
                        starts.push((a, node_id, address));
                    }
                    Decision::Queue { reason } => {
                        mark_waiting(&mut inner.actor_pending, &a.actor_id, reason, false);
                    }
                    Decision::Infeasible { reason } => {
                        if mark_waiting(&mut inner.actor_pending, &a.actor_id, reason.clone(), true)
                        {
                            tracing::warn!(actor_id = %a.actor_id, %reason, "actor is infeasible; it stays pending until a node that fits joins");
                        }
                    }
                }
            }
        }
        for (actor, node_id, address) in starts {
            let head = Arc::clone(self);
            tokio::spawn(async move { head.start_actor_worker(actor, node_id, address).await });
        }
    }

    async fn start_actor_worker(
        self: Arc<Self>,
        actor: ActorRecord,
        node_id: NodeId,
        address: String,
    ) {
        let result = async {
            let mut client = self.agent_client(&address)?;
            let req = pb::StartActorWorkerRequest {
                request_id: tpuray_proto::new_request_id(),
                actor_id: actor.actor_id.to_string(),
                job_id: actor.job_id.to_string(),
                resources: resources_to_proto(&actor.resources),
                class_name: actor.class_name.clone(),
                attempt: actor.num_restarts,
                creation_task: actor.creation_task.clone(),
            };
            let mut req = Request::new(req);
            req.set_timeout(Duration::from_secs(60));
            client.start_actor_worker(req).await.map(|r| r.into_inner())
        }
        .await;
        match result {
            Ok(reply) => {
                let outcome = self
                    .commit(Command {
                        request_id: String::new(),
                        kind: CommandKind::ActorAlive {
                            actor_id: actor.actor_id.clone(),
                            node_id: node_id.clone(),
                            worker_id: WorkerId::from_wire(reply.worker_id.clone()),
                            address: reply.worker_address,
                            pid: reply.pid,
                        },
                    })
                    .await;
                // Only now: until the record names the worker, reconciliation must not
                // take it for an orphan (HEAD-8).
                self.lock().placing.remove(&actor.actor_id);
                match outcome {
                    Ok(Outcome::Rejected(r)) => {
                        // Killed while starting: stop the worker we just made.
                        tracing::info!(actor_id = %actor.actor_id, %r, "actor started after it was killed; stopping its worker");
                        let _ =
                            self.kill_actor_worker(&address, &actor.actor_id, None, false).await;
                    }
                    Ok(_) => {}
                    // Not leader any more: the next leader finds the worker when it
                    // reconciles this node (HEAD-8).
                    Err(s) => {
                        tracing::warn!(actor_id = %actor.actor_id, %s, "recording the started actor failed")
                    }
                }
            }
            Err(status) if status.code() == tonic::Code::FailedPrecondition => {
                self.lock().placing.remove(&actor.actor_id);
                // The constructor failed or the binary is missing: retrying
                // elsewhere would fail the same way.
                tracing::warn!(actor_id = %actor.actor_id, %status, "actor creation failed");
                let r = self
                    .commit(Command {
                        request_id: String::new(),
                        kind: CommandKind::ActorWorkerExited {
                            actor_id: actor.actor_id.clone(),
                            worker_id: None,
                            intended: true,
                            cause: format!("the actor's creation failed: {}", status.message()),
                        },
                    })
                    .await;
                if let Err(s) = r {
                    tracing::warn!(actor_id = %actor.actor_id, %s, "recording the failed creation failed");
                }
            }
            Err(status) => {
                self.lock().placing.remove(&actor.actor_id);
                tracing::warn!(actor_id = %actor.actor_id, %node_id, %status, "starting actor worker failed; will retry placement");
                self.lock().actor_pending.insert(
                    actor.actor_id.clone(),
                    (
                        format!("starting a worker on node {node_id} failed: {}", status.message()),
                        false,
                    ),
                );
                // Try again after a pause, on whatever node fits then.
                let head = Arc::clone(&self);
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    head.placement_wake.notify_one();
                });
            }
        }
    }

    /// HEAD-8: compares a node agent's actor workers with the durable state. An actor
    /// recorded alive there whose worker is gone (its exit report was lost, e.g. while
    /// every head was down) is restarted or dies per its `max_restarts`; a worker
    /// hosting an actor that no record places there (started by a leader that failed
    /// before recording it) is stopped.
    pub(crate) async fn reconcile_node(self: Arc<Self>, node_id: NodeId, address: String) {
        if !self.is_leader() {
            return;
        }
        let alive_here = |inner: &Inner| -> HashMap<ActorId, WorkerId> {
            inner
                .sm
                .actors
                .values()
                .filter_map(|a| match &a.status {
                    ActorStatus::Alive { node_id: n, worker_id, .. } if *n == node_id => {
                        Some((a.actor_id.clone(), worker_id.clone()))
                    }
                    _ => None,
                })
                .collect()
        };
        // Recorded before asking: a worker recorded alive now existed when the agent answers.
        let before = alive_here(&self.lock());
        let listed = async {
            let mut c = self.agent_client(&address)?;
            let mut r = Request::new(pb::ListWorkersRequest {});
            r.set_timeout(Duration::from_secs(5));
            c.list_workers(r).await.map(|r| r.into_inner().workers)
        }
        .await;
        let workers = match listed {
            Ok(w) => w,
            Err(s) => {
                tracing::info!(%node_id, %s, "cannot list the node's workers; will try again");
                if let Some(soft) = self.lock().soft.get_mut(&node_id) {
                    soft.reconciled_at = None;
                }
                return;
            }
        };
        let hosted: HashMap<ActorId, WorkerId> = workers
            .into_iter()
            .filter(|w| !w.actor_id.is_empty())
            .map(|w| (ActorId::from_wire(w.actor_id), WorkerId::from_wire(w.worker_id)))
            .collect();
        let (gone, orphans) = {
            let inner = self.lock();
            let now = alive_here(&inner);
            let gone: Vec<(ActorId, WorkerId)> = before
                .into_iter()
                .filter(|(a, w)| hosted.get(a) != Some(w) && now.get(a) == Some(w))
                .collect();
            let orphans: Vec<ActorId> = hosted
                .iter()
                .filter(|(a, w)| now.get(*a) != Some(*w) && !inner.placing.contains(*a))
                .map(|(a, _)| a.clone())
                .collect();
            (gone, orphans)
        };
        for (actor_id, worker_id) in gone {
            tracing::warn!(%actor_id, %worker_id, %node_id, "an actor's worker is gone from its node; restarting the actor");
            let r = self
                .commit(Command {
                    request_id: String::new(),
                    kind: CommandKind::ActorWorkerExited {
                        actor_id: actor_id.clone(),
                        worker_id: Some(worker_id.clone()),
                        intended: false,
                        cause: format!(
                            "the actor's worker {worker_id} was gone from node {node_id} (its exit was not reported)"
                        ),
                    },
                })
                .await;
            if let Err(s) = r {
                tracing::warn!(%actor_id, %s, "recording the lost actor worker failed");
            }
        }
        for actor_id in orphans {
            tracing::warn!(%actor_id, %node_id, "stopping an actor worker that no record places on its node");
            let _ = self.kill_actor_worker(&address, &actor_id, None, false).await;
        }
    }

    /// Kills the actor's worker on the node at `agent_address`: `worker` only, when given,
    /// else whichever runs it. With `restart` the worker's exit is reported as not
    /// intended, so the head restarts the actor if it may (`kill(no_restart=False)`).
    /// Returns whether a worker was found to kill.
    pub(crate) async fn kill_actor_worker(
        &self,
        agent_address: &str,
        actor_id: &ActorId,
        worker: Option<&WorkerId>,
        restart: bool,
    ) -> Result<bool, Status> {
        let mut client = self.agent_client(agent_address)?;
        let mut req = Request::new(pb::KillActorWorkerRequest {
            request_id: tpuray_proto::new_request_id(),
            actor_id: actor_id.to_string(),
            force: true,
            worker_id: worker.map(ToString::to_string).unwrap_or_default(),
            restart,
        });
        req.set_timeout(Duration::from_secs(10));
        Ok(client.kill_actor_worker(req).await?.into_inner().killed)
    }

    fn actor_info(&self, id: &ActorId) -> Option<pb::ActorInfo> {
        let inner = self.lock();
        inner
            .sm
            .actors
            .get(id)
            .map(|a| actor_to_proto(a, inner.actor_pending.get(id).map(|p| p.0.as_str())))
    }
}

/// HEAD-8: the bundles a node holds (its reported total names them, SCHED-19) that no
/// record places on it and no reservation in flight may be placing: (group, indexes).
fn orphan_bundles(
    inner: &Inner,
    node_id: &NodeId,
    total: &ResourceSet,
) -> Vec<(PlacementGroupId, Vec<u32>)> {
    let mut held: std::collections::BTreeMap<&str, Vec<u32>> = Default::default();
    for (name, _) in total.iter() {
        if let Some((_, Some(i), pg)) = tpuray_scheduler::bundles::parse_bundle_resource(name) {
            let v = held.entry(pg).or_default();
            if !v.contains(&i) {
                v.push(i);
            }
        }
    }
    let mut out = Vec::new();
    for (pg, indexes) in held {
        let pg_id = PlacementGroupId::from_wire(pg);
        if inner.pg_placing.contains(&pg_id)
            || inner.returning.contains(&(pg_id.clone(), node_id.clone()))
        {
            continue;
        }
        let orphan: Vec<u32> = match inner.sm.placement_groups.get(&pg_id) {
            Some(rec) if !rec.is_removed() => indexes
                .into_iter()
                .filter(|i| rec.bundle_nodes.get(*i as usize) != Some(&Some(node_id.clone())))
                .collect(),
            _ => indexes,
        };
        if !orphan.is_empty() {
            out.push((pg_id, orphan));
        }
    }
    out
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

fn require_id(what: &str, v: &str) -> Result<(), Status> {
    if v.is_empty() { Err(Status::invalid_argument(format!("missing {what}"))) } else { Ok(()) }
}

/// The gRPC service; wraps the shared [`Head`].
#[derive(Clone)]
pub struct HeadSvc(pub Arc<Head>);

type ChangeStream = Pin<Box<dyn Stream<Item = Result<pb::StateChange, Status>> + Send>>;

#[tonic::async_trait]
impl HeadService for HeadSvc {
    async fn get_head_info(
        &self,
        _req: Request<pb::GetHeadInfoRequest>,
    ) -> Result<Response<pb::GetHeadInfoReply>, Status> {
        let h = &self.0;
        Ok(Response::new(pb::GetHeadInfoReply {
            protocol_version: PROTOCOL_VERSION,
            auth_required: h.config.auth_required,
            tls: tpuray_proto::tls::enabled(),
            cluster_id: h.cluster_id(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            heartbeat_interval_ms: h.config.heartbeat_interval.as_millis() as u64,
            node_death_timeout_ms: h.config.node_death_timeout.as_millis() as u64,
            dashboard_url: h.dashboard_url.get().cloned().unwrap_or_default(),
        }))
    }

    async fn register_node(
        &self,
        req: Request<pb::RegisterNodeRequest>,
    ) -> Result<Response<pb::RegisterNodeReply>, Status> {
        let req = req.into_inner();
        check_protocol_version("node agent", req.protocol_version)?; // PROTO-1
        let node = req.node.ok_or_else(|| Status::invalid_argument("missing node info"))?;
        require_id("node_id", &node.node_id)?;
        require_id("node address", &node.address)?;
        let total = resources_from_proto(&node.total)
            .map_err(|e| Status::invalid_argument(format!("node resources: {e}")))?;
        let available = resources_from_proto(&node.available)
            .map_err(|e| Status::invalid_argument(format!("node available resources: {e}")))?;
        let node_id = NodeId::from_wire(node.node_id.clone());
        let rec = NodeRecord {
            node_id: node_id.clone(),
            address: node.address,
            hostname: node.hostname,
            total: total.clone(),
            labels: Labels(node.labels.into_iter().collect()),
            is_head_node: node.is_head_node,
            start_time_ms: node.start_time_ms,
            session_dir: node.session_dir,
            pid: node.pid,
            status: NodeLife::Alive,
            object_store_dir: node.object_store_dir,
            metrics_export_port: u16::try_from(node.metrics_export_port).unwrap_or(0),
        };
        if let Outcome::Rejected(r) = self
            .0
            .commit(Command { request_id: req.request_id, kind: CommandKind::RegisterNode(rec) })
            .await?
        {
            return Err(rejection_status(r));
        }
        self.0.lock().soft.insert(
            node_id.clone(),
            NodeSoft {
                last_heartbeat: Instant::now(),
                last_heartbeat_ms: now_ms(),
                available: if available.is_empty() { total.clone() } else { available },
                total,
                pending: vec![],
                num_workers: 0,
                reported: true,
                // A new node runs no actors yet: nothing to reconcile.
                reconciled_at: Some(Instant::now()),
                job_submissions: HashSet::new(),
            },
        );
        tracing::info!(%node_id, "node registered");
        self.0.placement_wake.notify_one();
        Ok(Response::new(pb::RegisterNodeReply {
            cluster_id: self.0.cluster_id(),
            heartbeat_interval_ms: self.0.config.heartbeat_interval.as_millis() as u64,
            auth_required: self.0.config.auth_required,
            tls: tpuray_proto::tls::enabled(),
        }))
    }

    async fn heartbeat(
        &self,
        req: Request<pb::HeartbeatRequest>,
    ) -> Result<Response<pb::HeartbeatReply>, Status> {
        let req = req.into_inner();
        let node_id = NodeId::from_wire(req.node_id);
        let available = resources_from_proto(&req.available)
            .map_err(|e| Status::invalid_argument(format!("heartbeat available resources: {e}")))?;
        let mut inner = self.0.lock();
        let status = inner.sm.nodes.get(&node_id).map(|n| n.status.clone());
        match status {
            None => {
                return Ok(Response::new(pb::HeartbeatReply {
                    accepted: false,
                    reason: format!("unknown node {node_id}: register first"),
                    ..Default::default()
                }));
            }
            Some(NodeLife::Dead { reason }) => {
                return Ok(Response::new(pb::HeartbeatReply {
                    accepted: false,
                    reason: format!("node {node_id} was declared dead: {reason}"),
                    ..Default::default()
                }));
            }
            Some(NodeLife::Alive) => {}
        }
        let had_pending = !inner.actor_pending.is_empty() || !inner.pg_pending.is_empty();
        let total = if req.total.is_empty() {
            inner.sm.nodes.get(&node_id).map(|n| n.total.clone()).unwrap_or_default()
        } else {
            resources_from_proto(&req.total)
                .map_err(|e| Status::invalid_argument(format!("heartbeat total resources: {e}")))?
        };
        let first_report = inner.soft.get(&node_id).is_none_or(|s| !s.reported);
        let reconcile = inner
            .soft
            .get(&node_id)
            .and_then(|s| s.reconciled_at)
            .is_none_or(|t| t.elapsed() >= RECONCILE_EVERY);
        let reconciled_at = if reconcile {
            Some(Instant::now())
        } else {
            inner.soft.get(&node_id).and_then(|s| s.reconciled_at)
        };
        let orphans = orphan_bundles(&inner, &node_id, &total);
        for (pg, _) in &orphans {
            inner.returning.insert((pg.clone(), node_id.clone()));
        }
        // HEAD-13: only a change of what the view shows is a change of the view.
        let view_changed = inner
            .soft
            .get(&node_id)
            .is_none_or(|s| !s.reported || s.total != total || s.available != available);
        if view_changed {
            inner.view.touch(&node_id);
        }
        inner.soft.insert(
            node_id.clone(),
            NodeSoft {
                last_heartbeat: Instant::now(),
                last_heartbeat_ms: now_ms(),
                total,
                available,
                pending: req.pending,
                num_workers: req.num_workers,
                reported: true,
                reconciled_at,
                job_submissions: req.job_submissions.into_iter().collect(),
            },
        );
        // HEAD-13: the view as the changes since the version this agent holds, at most
        // this reply's share of the head's per-second budget.
        let limit = crate::view::entries_per_reply(
            inner.view.len(),
            self.0.config.heartbeat_interval.as_secs_f64(),
        );
        let ViewUpdate { full, changed, removed, to } =
            inner.view.since(req.view_epoch, req.view_version, limit);
        let cluster = changed
            .iter()
            .filter_map(|id| inner.sm.nodes.get(id))
            .filter(|n| n.status == NodeLife::Alive)
            .map(|n| self.0.node_info(&inner, n))
            .collect();
        let (view_epoch, view_version) = (inner.view.epoch(), to);
        let (view_delta, view_removed) = (!full, removed.iter().map(ToString::to_string).collect());
        let address = inner.sm.nodes.get(&node_id).map(|n| n.address.clone()).unwrap_or_default();
        drop(inner);
        // A pass can only place more when some node's resources changed (every heartbeat
        // waking it made each heartbeat of a large cluster a placement pass).
        if (had_pending && view_changed) || first_report {
            self.0.placement_wake.notify_one();
        }
        if reconcile {
            let head = Arc::clone(&self.0);
            let (n, a) = (node_id.clone(), address.clone());
            tokio::spawn(async move { head.reconcile_node(n, a).await });
        }
        for (pg, indexes) in orphans {
            let head = Arc::clone(&self.0);
            let (n, a) = (node_id.clone(), address.clone());
            tokio::spawn(async move {
                tracing::warn!(%pg, node_id = %n, ?indexes, "node holds placement group bundles no record names; giving them back");
                head.return_bundles_on(&n, &a, &pg, indexes).await;
                head.lock().returning.remove(&(pg, n));
            });
        }
        Ok(Response::new(pb::HeartbeatReply {
            accepted: true,
            reason: String::new(),
            cluster,
            view_epoch,
            view_version,
            view_delta,
            view_removed,
        }))
    }

    async fn unregister_node(
        &self,
        req: Request<pb::UnregisterNodeRequest>,
    ) -> Result<Response<pb::UnregisterNodeReply>, Status> {
        let req = req.into_inner();
        require_id("node_id", &req.node_id)?;
        let node_id = NodeId::from_wire(req.node_id);
        let reason =
            if req.reason.is_empty() { "node agent stopped".to_string() } else { req.reason };
        if let Outcome::Rejected(r) = self
            .0
            .commit(Command {
                request_id: req.request_id,
                kind: CommandKind::MarkNodeDead { node_id: node_id.clone(), reason },
            })
            .await?
        {
            return Err(rejection_status(r));
        }
        self.0.lock().soft.remove(&node_id);
        Ok(Response::new(pb::UnregisterNodeReply {}))
    }

    async fn get_cluster_status(
        &self,
        _req: Request<pb::GetClusterStatusRequest>,
    ) -> Result<Response<pb::GetClusterStatusReply>, Status> {
        let inner = self.0.lock();
        let mut total = ResourceSet::new();
        let mut available = ResourceSet::new();
        let mut pending = Vec::new();
        let mut infeasible = Vec::new();
        let nodes: Vec<pb::NodeInfo> =
            inner.sm.nodes.values().map(|n| self.0.node_info(&inner, n)).collect();
        for n in inner.sm.nodes.values().filter(|n| n.status == NodeLife::Alive) {
            total.add(&n.total);
            match inner.soft.get(&n.node_id) {
                Some(s) => {
                    // Bundle resources are a node's own, renamed (SCHED-19): not counted twice.
                    available
                        .add(&tpuray_scheduler::bundles::without_bundle_resources(&s.available));
                    for d in &s.pending {
                        if d.infeasible {
                            infeasible.push(d.clone());
                        } else {
                            pending.push(d.clone());
                        }
                    }
                }
                None => available.add(&n.total),
            }
        }
        for (id, (reason, is_infeasible)) in &inner.actor_pending {
            if let Some(a) = inner.sm.actors.get(id) {
                let d = pb::ResourceDemand {
                    shape: resources_to_proto(&a.placement_resources),
                    count: 1,
                    infeasible: *is_infeasible,
                    reason: format!("actor {}: {reason}", a.class_name),
                    placement_group_id: String::new(),
                };
                if *is_infeasible {
                    infeasible.push(d);
                } else {
                    pending.push(d);
                }
            }
        }
        for (id, (reason, is_infeasible)) in &inner.pg_pending {
            let Some(pg) = inner.sm.placement_groups.get(id).filter(|p| p.wants_placement()) else {
                continue;
            };
            // One demand per distinct bundle shape of the group.
            let mut shapes: Vec<(ResourceSet, u32)> = Vec::new();
            for (b, node) in pg.bundles.iter().zip(&pg.bundle_nodes) {
                if node.is_some() {
                    continue;
                }
                match shapes.iter_mut().find(|(s, _)| *s == b.demand) {
                    Some((_, n)) => *n += 1,
                    None => shapes.push((b.demand.clone(), 1)),
                }
            }
            let label = if pg.name.is_empty() { pg.pg_id.to_string() } else { pg.name.clone() };
            for (shape, count) in shapes {
                let d = pb::ResourceDemand {
                    shape: resources_to_proto(&shape),
                    count,
                    infeasible: *is_infeasible,
                    reason: format!("placement group {label} ({}): {reason}", pg.strategy.name()),
                    placement_group_id: pg.pg_id.to_string(),
                };
                if *is_infeasible {
                    infeasible.push(d);
                } else {
                    pending.push(d);
                }
            }
        }
        Ok(Response::new(pb::GetClusterStatusReply {
            nodes,
            total: resources_to_proto(&total),
            available: resources_to_proto(&available),
            pending,
            infeasible,
            cluster_id: inner.sm.cluster_id.clone(),
            head_start_time_ms: self.0.start_time_ms,
        }))
    }

    async fn register_job(
        &self,
        req: Request<pb::RegisterJobRequest>,
    ) -> Result<Response<pb::RegisterJobReply>, Status> {
        let req = req.into_inner();
        check_protocol_version("driver", req.protocol_version)?; // PROTO-1
        let job = JobRecord {
            job_id: JobId::random(),
            status: JobStatus::Running,
            driver_address: req.driver_address,
            driver_pid: req.driver_pid,
            entrypoint: req.entrypoint,
            namespace: if req.namespace.is_empty() {
                DEFAULT_NAMESPACE.to_string()
            } else {
                req.namespace
            },
            start_time_ms: now_ms(),
            end_time_ms: 0,
            worker_binary_hash: req.worker_binary_hash,
            submission_id: req.submission_id,
        };
        let id = match self
            .0
            .commit(Command { request_id: req.request_id, kind: CommandKind::RegisterJob(job) })
            .await?
        {
            Outcome::Job(id) => id,
            Outcome::Rejected(r) => return Err(rejection_status(r)),
            o => return Err(Status::internal(format!("unexpected outcome {o:?}"))),
        };
        let job = self.0.lock().sm.jobs.get(&id).map(job_to_proto);
        Ok(Response::new(pb::RegisterJobReply { job }))
    }

    async fn finish_job(
        &self,
        req: Request<pb::FinishJobRequest>,
    ) -> Result<Response<pb::FinishJobReply>, Status> {
        let req = req.into_inner();
        require_id("job_id", &req.job_id)?;
        let job_id = JobId::from_wire(req.job_id);
        self.0.finish_job(req.request_id, job_id, "finished").await?;
        Ok(Response::new(pb::FinishJobReply {}))
    }

    async fn list_jobs(
        &self,
        _req: Request<pb::ListJobsRequest>,
    ) -> Result<Response<pb::ListJobsReply>, Status> {
        let inner = self.0.lock();
        Ok(Response::new(pb::ListJobsReply {
            jobs: inner.sm.jobs.values().map(job_to_proto).collect(),
        }))
    }

    async fn submit_job(
        &self,
        req: Request<pb::SubmitJobRequest>,
    ) -> Result<Response<pb::SubmitJobReply>, Status> {
        self.0.submit_job(req.into_inner()).await.map(Response::new)
    }

    async fn get_job_submission(
        &self,
        req: Request<pb::GetJobSubmissionRequest>,
    ) -> Result<Response<pb::GetJobSubmissionReply>, Status> {
        Ok(Response::new(self.0.get_job_submission(&req.into_inner().id)))
    }

    async fn list_job_submissions(
        &self,
        _req: Request<pb::ListJobSubmissionsRequest>,
    ) -> Result<Response<pb::ListJobSubmissionsReply>, Status> {
        Ok(Response::new(self.0.list_job_submissions()))
    }

    async fn stop_job(
        &self,
        req: Request<pb::StopJobRequest>,
    ) -> Result<Response<pb::StopJobReply>, Status> {
        let stopped = self.0.stop_job(req.into_inner()).await?;
        Ok(Response::new(pb::StopJobReply { stopped }))
    }

    async fn delete_job(
        &self,
        req: Request<pb::DeleteJobRequest>,
    ) -> Result<Response<pb::DeleteJobReply>, Status> {
        let deleted = self.0.delete_job(req.into_inner()).await?;
        Ok(Response::new(pb::DeleteJobReply { deleted }))
    }

    async fn report_job_status(
        &self,
        req: Request<pb::ReportJobStatusRequest>,
    ) -> Result<Response<pb::ReportJobStatusReply>, Status> {
        self.0.report_job_status(req.into_inner()).await?;
        Ok(Response::new(pb::ReportJobStatusReply {}))
    }

    async fn create_actor(
        &self,
        req: Request<pb::CreateActorRequest>,
    ) -> Result<Response<pb::CreateActorReply>, Status> {
        let req = req.into_inner();
        require_id("job_id", &req.job_id)?;
        let resources = resources_from_proto(&req.resources)
            .map_err(|e| Status::invalid_argument(format!("actor resources: {e}")))?;
        tpuray_scheduler::tpu::check_tpu_demand(&resources)
            .map_err(|e| Status::invalid_argument(format!("actor resources: {e}")))?;
        tpuray_scheduler::gpu::check_gpu_demand(&resources)
            .map_err(|e| Status::invalid_argument(format!("actor resources: {e}")))?;
        let label_selector =
            labels_from_proto(&req.label_selector).map_err(Status::invalid_argument)?;
        if req.max_restarts < -1 {
            return Err(Status::invalid_argument(format!(
                "max_restarts is {} (expected -1 for infinite, or a number >= 0)",
                req.max_restarts
            )));
        }
        let job_id = JobId::from_wire(req.job_id);
        if !self.0.lock().sm.jobs.contains_key(&job_id) {
            return Err(Status::not_found(format!("no job {job_id}: register the job first")));
        }
        // Ray: an actor needs 1 CPU to be placed and 0 while it runs, unless
        // it names resources itself, `num_cpus=0` included (DESIGN.md §3;
        // Ray's `DEFAULT_ACTOR_CREATION_CPU_SIMPLE`).
        let placement_resources = if req.resources.is_empty() {
            ResourceSet::from_json(r#"{"CPU": 1}"#).expect("static resource set")
        } else {
            resources.clone()
        };
        let placement_group =
            tpuray_proto::convert::placement_group_from_proto(req.strategy.as_ref());
        let (placement_resources, resources) = match &placement_group {
            Some((pg, index)) => {
                self.0.check_bundle(pg, *index)?;
                let i = u32::try_from(*index).ok();
                (
                    tpuray_scheduler::bundles::demand_in_bundle(&placement_resources, pg, i),
                    tpuray_scheduler::bundles::demand_in_bundle(&resources, pg, i),
                )
            }
            None => (placement_resources, resources),
        };
        let strategy = tpuray_proto::convert::strategy_from_proto(req.strategy.as_ref());
        let (affinity, spread) = match strategy {
            tpuray_scheduler::Strategy::NodeAffinity { node, soft } => {
                (Some((NodeId::from_wire(node), soft)), false)
            }
            tpuray_scheduler::Strategy::Spread => (None, true),
            tpuray_scheduler::Strategy::Default => (None, false),
        };
        let actor = ActorRecord {
            actor_id: ActorId::random(),
            job_id,
            name: req.name,
            namespace: if req.namespace.is_empty() {
                DEFAULT_NAMESPACE.to_string()
            } else {
                req.namespace
            },
            class_name: req.class_name,
            resources,
            placement_resources,
            label_selector,
            affinity,
            spread,
            max_restarts: req.max_restarts,
            num_restarts: 0,
            detached: req.detached,
            status: ActorStatus::PendingCreation,
            creation_task: req.creation_task,
            last_placement: None,
            placement_group: placement_group
                .map(|(pg, i)| (tpuray_proto::ids::PlacementGroupId::from_wire(pg), i)),
        };
        let id = match self
            .0
            .commit(Command {
                request_id: req.request_id,
                kind: CommandKind::CreateActor { actor, get_if_exists: req.get_if_exists },
            })
            .await?
        {
            Outcome::Actor(id) => id,
            Outcome::Rejected(r) => return Err(rejection_status(r)),
            o => return Err(Status::internal(format!("unexpected outcome {o:?}"))),
        };
        // The placement loop takes every actor created since its last pass in one pass
        // (a pass per creation scanned every actor and node each time).
        self.0.placement_wake.notify_one();
        Ok(Response::new(pb::CreateActorReply { actor: self.0.actor_info(&id) }))
    }

    async fn get_actor(
        &self,
        req: Request<pb::GetActorRequest>,
    ) -> Result<Response<pb::GetActorReply>, Status> {
        let req = req.into_inner();
        let deadline = Instant::now() + Duration::from_millis(req.wait_alive_ms);
        loop {
            let notified = self.0.actor_changed.notified();
            let info = if !req.actor_id.is_empty() {
                let id = ActorId::from_wire(req.actor_id.clone());
                self.0
                    .actor_info(&id)
                    .ok_or_else(|| Status::not_found(format!("no actor with id {id}")))?
            } else if !req.name.is_empty() {
                let ns = if req.namespace.is_empty() { DEFAULT_NAMESPACE } else { &req.namespace };
                let id = self
                    .0
                    .lock()
                    .sm
                    .named_actor(ns, &req.name)
                    .map(|a| a.actor_id.clone())
                    .ok_or_else(|| {
                        Status::not_found(format!(
                            "no actor named {:?} in namespace {:?}",
                            req.name, ns
                        ))
                    })?;
                self.0
                    .actor_info(&id)
                    .ok_or_else(|| Status::not_found(format!("no actor with id {id}")))?
            } else {
                return Err(Status::invalid_argument(
                    "give an actor_id or a name to look up an actor",
                ));
            };
            let settled = info.state == pb::ActorState::Alive as i32
                || info.state == pb::ActorState::Dead as i32;
            if settled || Instant::now() >= deadline {
                return Ok(Response::new(pb::GetActorReply { actor: Some(info) }));
            }
            let _ = tokio::time::timeout_at(deadline.into(), notified).await;
        }
    }

    async fn list_actors(
        &self,
        _req: Request<pb::ListActorsRequest>,
    ) -> Result<Response<pb::ListActorsReply>, Status> {
        let inner = self.0.lock();
        Ok(Response::new(pb::ListActorsReply {
            actors: inner
                .sm
                .actors
                .values()
                .map(|a| {
                    actor_to_proto(a, inner.actor_pending.get(&a.actor_id).map(|p| p.0.as_str()))
                })
                .collect(),
        }))
    }

    async fn kill_actor(
        &self,
        req: Request<pb::KillActorRequest>,
    ) -> Result<Response<pb::KillActorReply>, Status> {
        let req = req.into_inner();
        require_id("actor_id", &req.actor_id)?;
        let actor_id = ActorId::from_wire(req.actor_id);
        let target = {
            let inner = self.0.lock();
            let a = inner
                .sm
                .actors
                .get(&actor_id)
                .ok_or_else(|| Status::not_found(format!("no actor with id {actor_id}")))?;
            match &a.status {
                ActorStatus::Alive { node_id, worker_id, .. } => {
                    inner.sm.nodes.get(node_id).map(|n| (n.address.clone(), worker_id.clone()))
                }
                _ => None,
            }
        };
        // kill(no_restart=False) of a running actor: the node kills its worker and reports
        // the exit as not intended, and the head restarts the actor as after a crash. (Doing
        // it the other way round, a commit first, let the restart land on the very worker
        // the kill then ended, since the node still ran it for that actor.)
        if !req.no_restart
            && req.reason.is_empty()
            && let Some((addr, worker_id)) = &target
            && let Ok(true) = self.0.kill_actor_worker(addr, &actor_id, Some(worker_id), true).await
        {
            return Ok(Response::new(pb::KillActorReply {}));
        }
        let cause = if !req.reason.is_empty() {
            req.reason.clone()
        } else if req.no_restart {
            "killed by kill()".to_string()
        } else {
            "killed by kill(no_restart=False)".to_string()
        };
        if let Outcome::Rejected(r) = self
            .0
            .commit(Command {
                request_id: req.request_id,
                kind: CommandKind::ActorWorkerExited {
                    actor_id: actor_id.clone(),
                    worker_id: target.as_ref().map(|t| t.1.clone()),
                    intended: req.no_restart,
                    cause,
                },
            })
            .await?
        {
            return Err(rejection_status(r));
        }
        if let Some((addr, worker_id)) = target {
            self.0.kill_actor_worker(&addr, &actor_id, Some(&worker_id), false).await.map_err(
                |s| {
                    Status::unavailable(format!(
                        "actor {actor_id} is marked dead but its node did not confirm the kill: {}",
                        s.message()
                    ))
                },
            )?;
        }
        Ok(Response::new(pb::KillActorReply {}))
    }

    async fn report_actor_worker_exit(
        &self,
        req: Request<pb::ReportActorWorkerExitRequest>,
    ) -> Result<Response<pb::ReportActorWorkerExitReply>, Status> {
        let req = req.into_inner();
        require_id("actor_id", &req.actor_id)?;
        let outcome = self
            .0
            .commit(Command {
                request_id: req.request_id,
                kind: CommandKind::ActorWorkerExited {
                    actor_id: ActorId::from_wire(req.actor_id),
                    worker_id: (!req.worker_id.is_empty())
                        .then(|| WorkerId::from_wire(req.worker_id)),
                    intended: req.intended,
                    cause: req.detail,
                },
            })
            .await?;
        if let Outcome::Rejected(r) = outcome {
            return Err(rejection_status(r));
        }
        Ok(Response::new(pb::ReportActorWorkerExitReply {}))
    }

    async fn create_placement_group(
        &self,
        req: Request<pb::CreatePlacementGroupRequest>,
    ) -> Result<Response<pb::CreatePlacementGroupReply>, Status> {
        let info = self.0.create_placement_group(req.into_inner()).await?;
        Ok(Response::new(pb::CreatePlacementGroupReply { placement_group: Some(info) }))
    }

    async fn remove_placement_group(
        &self,
        req: Request<pb::RemovePlacementGroupRequest>,
    ) -> Result<Response<pb::RemovePlacementGroupReply>, Status> {
        self.0.remove_placement_group(req.into_inner()).await?;
        Ok(Response::new(pb::RemovePlacementGroupReply {}))
    }

    async fn get_placement_group(
        &self,
        req: Request<pb::GetPlacementGroupRequest>,
    ) -> Result<Response<pb::GetPlacementGroupReply>, Status> {
        let req = req.into_inner();
        let more_ids = req.more_ids.clone();
        let info = self.0.get_placement_group(req).await?;
        let more = self.0.pg_infos_by_id(&more_ids);
        Ok(Response::new(pb::GetPlacementGroupReply { placement_group: Some(info), more }))
    }

    async fn list_placement_groups(
        &self,
        _req: Request<pb::ListPlacementGroupsRequest>,
    ) -> Result<Response<pb::ListPlacementGroupsReply>, Status> {
        let inner = self.0.lock();
        let placement_groups =
            inner.sm.placement_groups.values().map(|p| self.0.pg_info(&inner, p)).collect();
        Ok(Response::new(pb::ListPlacementGroupsReply { placement_groups }))
    }

    async fn kv_put(
        &self,
        req: Request<pb::KvPutRequest>,
    ) -> Result<Response<pb::KvPutReply>, Status> {
        let req = req.into_inner();
        if req.key.is_empty() {
            return Err(Status::invalid_argument("kv key is empty"));
        }
        match self
            .0
            .commit(Command {
                request_id: req.request_id,
                kind: CommandKind::KvPut {
                    namespace: req.namespace,
                    key: req.key,
                    value: req.value,
                    overwrite: req.overwrite,
                },
            })
            .await?
        {
            Outcome::KvAdded(added) => Ok(Response::new(pb::KvPutReply { added })),
            Outcome::Rejected(r) => Err(rejection_status(r)),
            o => Err(Status::internal(format!("unexpected outcome {o:?}"))),
        }
    }

    async fn kv_get(
        &self,
        req: Request<pb::KvGetRequest>,
    ) -> Result<Response<pb::KvGetReply>, Status> {
        let req = req.into_inner();
        let inner = self.0.lock();
        let v = inner.sm.kv.get(&(req.namespace, req.key));
        Ok(Response::new(pb::KvGetReply {
            found: v.is_some(),
            value: v.cloned().unwrap_or_default(),
        }))
    }

    async fn kv_delete(
        &self,
        req: Request<pb::KvDeleteRequest>,
    ) -> Result<Response<pb::KvDeleteReply>, Status> {
        let req = req.into_inner();
        match self
            .0
            .commit(Command {
                request_id: req.request_id,
                kind: CommandKind::KvDelete { namespace: req.namespace, key: req.key },
            })
            .await?
        {
            Outcome::KvDeleted(deleted) => Ok(Response::new(pb::KvDeleteReply { deleted })),
            Outcome::Rejected(r) => Err(rejection_status(r)),
            o => Err(Status::internal(format!("unexpected outcome {o:?}"))),
        }
    }

    async fn kv_keys(
        &self,
        req: Request<pb::KvKeysRequest>,
    ) -> Result<Response<pb::KvKeysReply>, Status> {
        let req = req.into_inner();
        let inner = self.0.lock();
        let keys = inner
            .sm
            .kv
            .range((req.namespace.clone(), req.prefix.clone())..)
            .take_while(|((ns, k), _)| *ns == req.namespace && k.starts_with(&req.prefix))
            .map(|((_, k), _)| k.clone())
            .collect();
        Ok(Response::new(pb::KvKeysReply { keys }))
    }

    async fn report_task_events(
        &self,
        req: Request<pb::ReportTaskEventsRequest>,
    ) -> Result<Response<pb::ReportTaskEventsReply>, Status> {
        let mut guard = self.0.lock();
        let inner = &mut *guard;
        for e in req.into_inner().events {
            if !inner.tasks.contains_key(&e.task_id) {
                inner.task_order.push_back(e.task_id.clone());
                while inner.task_order.len() > MAX_TASKS_KEPT {
                    if let Some(old) = inner.task_order.pop_front() {
                        if let Some(t) = inner.tasks.remove(&old) {
                            inner.task_tally.forget(&t);
                        }
                        inner.tasks_dropped += 1;
                    }
                }
            }
            let t = inner.tasks.entry(e.task_id.clone()).or_insert_with(|| pb::TaskSummary {
                task_id: e.task_id.clone(),
                job_id: e.job_id.clone(),
                name: e.name.clone(),
                actor_id: e.actor_id.clone(),
                ..Default::default()
            });
            // LOGS-3: where the attempt's output lies; such an event changes no state.
            if let Some(info) = e.log_info {
                if e.attempt >= t.attempt {
                    t.log_info = Some(info);
                }
                if e.state.is_empty() {
                    continue;
                }
            }
            let counted = crate::metrics::TaskTally::slot(t);
            // Events from owner and executor may arrive in any order: a final
            // state is never overwritten by an earlier one.
            // A summary made from this very event has no state yet: any state wins.
            let rank = |s: &str| match s {
                "" => -1,
                "SUBMITTED" => 0,
                "RETRYING" => 1,
                "RUNNING" => 2,
                _ => 3,
            };
            if e.state == "SUBMITTED" {
                t.submitted_ms = e.time_ms;
            }
            if e.state == "RUNNING" && e.attempt >= t.attempt {
                t.started_ms = e.time_ms;
            }
            // Where it ran: the executor's RUNNING event, or the owner's
            // final event (the reply names the node) if that one was lost.
            if !e.node_id.is_empty() && (e.state == "RUNNING" || rank(&e.state) == 3) {
                t.node_id = e.node_id.clone();
                if !e.worker_id.is_empty() {
                    t.worker_id = e.worker_id.clone();
                }
            }
            if rank(&e.state) >= rank(&t.state) || e.attempt > t.attempt {
                t.state = e.state.clone();
                t.attempt = e.attempt;
                if rank(&e.state) == 3 {
                    t.finished_ms = e.time_ms;
                    t.error = e.error.clone();
                }
            }
            let now = crate::metrics::TaskTally::slot(t);
            if now != counted {
                inner.task_tally.moved(&t.job_id, &t.name, counted, now);
            }
        }
        Ok(Response::new(pb::ReportTaskEventsReply {}))
    }

    async fn list_tasks(
        &self,
        req: Request<pb::ListTasksRequest>,
    ) -> Result<Response<pb::ListTasksReply>, Status> {
        let limit = match req.into_inner().limit {
            0 => usize::MAX,
            n => n as usize,
        };
        let inner = self.0.lock();
        let tasks = inner
            .task_order
            .iter()
            .rev()
            .take(limit)
            .filter_map(|id| inner.tasks.get(id).cloned())
            .collect();
        Ok(Response::new(pb::ListTasksReply { tasks, dropped: inner.tasks_dropped }))
    }

    async fn get_replica_status(
        &self,
        _req: Request<pb::GetReplicaStatusRequest>,
    ) -> Result<Response<pb::GetReplicaStatusReply>, Status> {
        let h = &self.0;
        let st = h.replica_status().ok_or_else(|| Status::unavailable("the head is starting"))?;
        let addr = |id: u64| h.config.replica_address(id).unwrap_or_default();
        Ok(Response::new(pb::GetReplicaStatusReply {
            id: st.id,
            address: addr(st.id),
            role: st.role.name().to_string(),
            term: st.term,
            leader_id: st.leader_id,
            leader_address: if st.leader_id == 0 { String::new() } else { addr(st.leader_id) },
            leader_ready: st.leader_ready,
            commit_index: st.commit,
            applied_index: st.applied,
            first_index: st.first_index,
            last_index: st.last_index,
            snapshot_index: st.snapshot_index,
            peers: st
                .peers
                .iter()
                .map(|(id, m)| pb::ReplicaProgress {
                    id: *id,
                    address: addr(*id),
                    matched_index: *m,
                })
                .collect(),
            replicas: h.config.replicas(),
            data_dir: h
                .config
                .data_dir
                .as_ref()
                .map(|d| d.display().to_string())
                .unwrap_or_default(),
            last_snapshot_bytes: st.last_snapshot.bytes,
            last_snapshot_micros: st.last_snapshot.micros,
            snapshots_taken: st.snapshots_taken,
        }))
    }

    type SubscribeStream = ChangeStream;

    async fn subscribe(
        &self,
        req: Request<pb::SubscribeRequest>,
    ) -> Result<Response<Self::SubscribeStream>, Status> {
        let after = req.into_inner().after_seq;
        // Subscribe before reading the log so no change falls in between.
        let mut live = self.0.events.subscribe();
        let (backlog, resync) = {
            let inner = self.0.lock();
            let oldest = inner.changes.front().map(|c| c.seq).unwrap_or(inner.seq + 1);
            if after + 1 < oldest && after != 0 {
                // The client missed changes we no longer keep: send the current
                // state of everything instead, stamped with the latest seq.
                let seq = inner.seq;
                let mut snap: Vec<pb::StateChange> = Vec::new();
                for n in inner.sm.nodes.values() {
                    snap.push(pb::StateChange {
                        seq,
                        change: Some(pb::state_change::Change::Node(self.0.node_info(&inner, n))),
                    });
                }
                for j in inner.sm.jobs.values() {
                    snap.push(pb::StateChange {
                        seq,
                        change: Some(pb::state_change::Change::Job(job_to_proto(j))),
                    });
                }
                for a in inner.sm.actors.values() {
                    snap.push(pb::StateChange {
                        seq,
                        change: Some(pb::state_change::Change::Actor(actor_to_proto(a, None))),
                    });
                }
                for p in inner.sm.placement_groups.values() {
                    snap.push(pb::StateChange {
                        seq,
                        change: Some(pb::state_change::Change::PlacementGroup(
                            self.0.pg_info(&inner, p),
                        )),
                    });
                }
                (snap, true)
            } else {
                (inner.changes.iter().filter(|c| c.seq > after).cloned().collect::<Vec<_>>(), false)
            }
        };
        let mut last = backlog.last().map(|c| c.seq).unwrap_or(after);
        if resync {
            last = backlog.first().map(|c| c.seq).unwrap_or(after);
        }
        let (tx, rx) = tokio::sync::mpsc::channel(256);
        tokio::spawn(async move {
            for c in backlog {
                if tx.send(Ok(c)).await.is_err() {
                    return;
                }
            }
            loop {
                match live.recv().await {
                    Ok(c) if c.seq <= last => continue,
                    Ok(c) => {
                        last = c.seq;
                        if tx.send(Ok(c)).await.is_err() {
                            return;
                        }
                    }
                    Err(broadcast::error::RecvError::Lagged(n)) => {
                        let _ = tx
                            .send(Err(Status::data_loss(format!(
                                "subscriber fell behind by {n} changes; resubscribe after seq {last}"
                            ))))
                            .await;
                        return;
                    }
                    Err(broadcast::error::RecvError::Closed) => return,
                }
            }
        });
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }
}

impl Head {
    /// Ends driver job `job_id` (its non-detached actors' workers are stopped, its
    /// groups removed, its unfinished tasks failed); `how` says why in the tasks' error
    /// ("finished", "lost its driver ...").
    ///
    /// # Errors
    /// As [`Head::commit`]; `NOT_FOUND` for an unknown job.
    pub(crate) async fn finish_job(
        self: &Arc<Self>,
        request_id: String,
        job_id: JobId,
        how: &str,
    ) -> Result<(), Status> {
        let finished = job_id.to_string();
        // Remember which actors die with the job, to stop their workers.
        let before: Vec<(ActorId, String)> =
            self.alive_actor_agents(|a| a.job_id == job_id && !a.detached);
        if let Outcome::Rejected(r) = self
            .commit(Command {
                request_id,
                kind: CommandKind::FinishJob { job_id, end_time_ms: now_ms() },
            })
            .await?
        {
            return Err(rejection_status(r));
        }
        let why = format!("the task's job {finished} {how} before the task ended");
        self.after_jobs_ended(before, &HashMap::from([(finished, why)]));
        Ok(())
    }

    /// What the end of driver jobs does beyond their durable records (which ended their
    /// actors and groups): stops the workers of the actors that were alive (`actors`,
    /// read before the commit), and marks the jobs' tasks that are not FINISHED or FAILED
    /// as FAILED with the job's reason from `ended` (Ray's GCS does the same when a job
    /// ends); an owner's late FINISHED event still wins.
    pub(crate) fn after_jobs_ended(
        self: &Arc<Self>,
        actors: Vec<(ActorId, String)>,
        ended: &HashMap<String, String>,
    ) {
        for (actor_id, addr) in actors {
            let head = Arc::clone(self);
            tokio::spawn(async move {
                let _ = head.kill_actor_worker(&addr, &actor_id, None, false).await;
            });
        }
        if ended.is_empty() {
            return;
        }
        let now = now_ms();
        let mut inner = self.lock();
        for t in inner.tasks.values_mut() {
            if let Some(why) = ended.get(&t.job_id)
                && !matches!(t.state.as_str(), "FINISHED" | "FAILED")
            {
                t.state = "FAILED".into();
                t.error = why.clone();
                t.finished_ms = now;
            }
        }
    }

    /// The live actors matching `pred`, with their node agent's address.
    pub(crate) fn alive_actor_agents(
        &self,
        pred: impl Fn(&ActorRecord) -> bool,
    ) -> Vec<(ActorId, String)> {
        let inner = self.lock();
        inner
            .sm
            .actors
            .values()
            .filter(|a| pred(a))
            .filter_map(|a| match &a.status {
                ActorStatus::Alive { node_id, .. } => {
                    inner.sm.nodes.get(node_id).map(|n| (a.actor_id.clone(), n.address.clone()))
                }
                _ => None,
            })
            .collect()
    }
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
    #[error("head server: {0}")]
    Server(#[from] tonic::transport::Error),
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
    let router =
        tonic::transport::Server::builder().tcp_nodelay(true).add_service(svc).add_service(peer);
    let served = match tls {
        None => {
            router
                .serve_with_incoming_shutdown(tpuray_proto::incoming(listener), stopped(stop_rx))
                .await
        }
        Some(t) => {
            router
                .serve_with_incoming_shutdown(
                    tpuray_proto::tls::incoming(listener, t, "head"),
                    stopped(stop_rx),
                )
                .await
        }
    };
    if let Some(t) = http_task {
        let _ = t.await;
    }
    let _ = tokio::task::spawn_blocking(move || replica.stop()).await;
    served?;
    Ok(())
}
