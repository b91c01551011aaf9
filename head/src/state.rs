//! The head's durable state machine (HEAD-1): every change to nodes, jobs,
//! actors and KV is a typed [`Command`] applied by [`StateMachine::apply`].
//!
//! The machine is deterministic and does no I/O: the replicated log
//! (`tpuray-replica`, see `replication.rs`) applies the same commands in the same order
//! on every head (HEAD-6). Soft state (heartbeats, usage, demand) lives beside it in
//! the server and never becomes a command (DESIGN.md §5).
//! Commands carry the client's request id; a retried request id is answered
//! with the first outcome and changes nothing (HEAD-2).

use std::collections::{BTreeMap, HashMap, VecDeque};

use serde::{Deserialize, Serialize};
use tpuray_proto::ids::{ActorId, JobId, NodeId, PlacementGroupId, WorkerId};
use tpuray_scheduler::{Bundle, LabelConstraint, Labels, PgStrategy, ResourceSet};

/// Default namespace when a client gives none (Ray uses an anonymous one per
/// job; named actors without a namespace live here).
pub const DEFAULT_NAMESPACE: &str = "default";

/// How many applied request ids are remembered for deduplication.
const DEDUP_CAPACITY: usize = 100_000;
/// Removed placement groups the state keeps (HEAD-9); once there are
/// [`REMOVED_PLACEMENT_GROUPS_SLACK`] more, the oldest are forgotten down to this many (a
/// forgotten id then answers "no placement group"). Ray's GCS bounds what it keeps of
/// destroyed actors the same way (`maximum_gcs_destroyed_actor_cached_count`).
pub const MAX_REMOVED_PLACEMENT_GROUPS: usize = 1000;
/// How far past [`MAX_REMOVED_PLACEMENT_GROUPS`] the removed groups may grow before the
/// oldest are forgotten, so that finding them (a sort) happens once per this many removals.
pub const REMOVED_PLACEMENT_GROUPS_SLACK: usize = 100;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum NodeStatus {
    Alive,
    Dead { reason: String },
}

/// A registered node, as durable state holds it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeRecord {
    pub node_id: NodeId,
    pub address: String,
    pub hostname: String,
    pub total: ResourceSet,
    pub labels: Labels,
    pub is_head_node: bool,
    pub start_time_ms: u64,
    pub session_dir: String,
    pub pid: u32,
    pub status: NodeStatus,
    /// The node's object store folder.
    pub object_store_dir: String,
    /// The port of the node agent's `/metrics` (`--metrics-export-port`; 0: none).
    pub metrics_export_port: u16,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum JobStatus {
    Running,
    Finished,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JobRecord {
    pub job_id: JobId,
    pub status: JobStatus,
    pub driver_address: String,
    pub driver_pid: u32,
    pub entrypoint: String,
    pub namespace: String,
    pub start_time_ms: u64,
    pub end_time_ms: u64,
    /// sha256 of the job's worker binary in the KV ("" when none).
    pub worker_binary_hash: String,
    /// The Jobs API submission whose entrypoint started this driver ("" for none).
    pub submission_id: String,
}

/// Where an actor is in its life. `Restarting` and `PendingCreation` both
/// wait for placement.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ActorStatus {
    PendingCreation,
    Alive { node_id: NodeId, worker_id: WorkerId, address: String, pid: u32 },
    Restarting { cause: String },
    Dead { cause: String },
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ActorRecord {
    pub actor_id: ActorId,
    pub job_id: JobId,
    pub name: String,
    pub namespace: String,
    pub class_name: String,
    /// Resources held while the actor runs.
    pub resources: ResourceSet,
    /// Resources needed to place it (Ray: 1 CPU unless `num_cpus` is given).
    pub placement_resources: ResourceSet,
    pub label_selector: Vec<LabelConstraint>,
    pub affinity: Option<(NodeId, bool)>,
    pub spread: bool,
    /// -1: restart forever.
    pub max_restarts: i64,
    pub num_restarts: u32,
    pub detached: bool,
    pub status: ActorStatus,
    /// The serialized creation task the actor's worker runs on every start.
    #[serde(with = "raw_bytes")]
    pub creation_task: Vec<u8>,
    /// Where the actor last ran (node, pid), kept after it restarts or dies.
    pub last_placement: Option<(NodeId, u32)>,
    /// The placement group bundle it runs in (index -1: any bundle).
    pub placement_group: Option<(PlacementGroupId, i32)>,
}

/// Byte strings as one length-prefixed copy: serde's default for `Vec<u8>` goes one
/// element at a time, which is slow for the 8 MiB chunks of a job's binary in the KV.
mod raw_bytes {
    use serde::de::{Error, SeqAccess, Visitor};
    use serde::{Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(v)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        d.deserialize_byte_buf(Bytes)
    }

    struct Bytes;

    impl<'de> Visitor<'de> for Bytes {
        type Value = Vec<u8>;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a byte string")
        }

        fn visit_bytes<E: Error>(self, v: &[u8]) -> Result<Vec<u8>, E> {
            Ok(v.to_vec())
        }

        fn visit_byte_buf<E: Error>(self, v: Vec<u8>) -> Result<Vec<u8>, E> {
            Ok(v)
        }

        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<u8>, A::Error> {
            let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0));
            while let Some(b) = seq.next_element()? {
                out.push(b);
            }
            Ok(out)
        }
    }
}

/// The KV map as a list of (namespace, key, value) with byte strings copied whole.
mod kv_map {
    use std::collections::BTreeMap;

    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    type Map = BTreeMap<(String, Vec<u8>), Vec<u8>>;

    #[derive(Serialize)]
    struct Ref<'a> {
        ns: &'a str,
        #[serde(with = "super::raw_bytes")]
        key: &'a [u8],
        #[serde(with = "super::raw_bytes")]
        value: &'a [u8],
    }

    #[derive(Deserialize)]
    struct Owned {
        ns: String,
        #[serde(with = "super::raw_bytes")]
        key: Vec<u8>,
        #[serde(with = "super::raw_bytes")]
        value: Vec<u8>,
    }

    pub fn serialize<S: Serializer>(m: &Map, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(m.iter().map(|((ns, key), value)| Ref { ns, key, value }))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Map, D::Error> {
        let v = Vec::<Owned>::deserialize(d)?;
        Ok(v.into_iter().map(|o| ((o.ns, o.key), o.value)).collect())
    }
}

/// Version byte in front of every encoded command (log entries) and snapshot.
/// 3: nodes record their `metrics_export_port`.
const FORMAT: u8 = 3;

/// A command as a Raft log entry: a version byte, then postcard.
pub fn encode_command(cmd: &Command) -> Vec<u8> {
    let mut out = vec![FORMAT];
    out.extend(postcard::to_stdvec(cmd).expect("commands always serialize"));
    out
}

/// A command from a Raft log entry.
///
/// # Errors
/// A message when the bytes are not a command of this format version.
pub fn decode_command(b: &[u8]) -> Result<Command, String> {
    match b.split_first() {
        Some((&FORMAT, rest)) => postcard::from_bytes(rest).map_err(|e| e.to_string()),
        Some((v, _)) => Err(format!("command format {v} (this head reads {FORMAT})")),
        None => Err("empty command".into()),
    }
}

impl ActorRecord {
    pub fn is_dead(&self) -> bool {
        matches!(self.status, ActorStatus::Dead { .. })
    }
    /// The scheduling strategy, node ids as strings.
    pub fn strategy(&self) -> tpuray_scheduler::Strategy<String> {
        match (&self.affinity, self.spread) {
            (Some((node, soft)), _) => {
                tpuray_scheduler::Strategy::NodeAffinity { node: node.to_string(), soft: *soft }
            }
            (None, true) => tpuray_scheduler::Strategy::Spread,
            (None, false) => tpuray_scheduler::Strategy::Default,
        }
    }

    pub fn restarts_left(&self) -> bool {
        self.max_restarts < 0 || i64::from(self.num_restarts) < self.max_restarts
    }
}

/// Where a placement group is in its life.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PgStatus {
    /// No bundle reserved yet.
    Pending,
    /// Every bundle reserved.
    Created,
    /// Some bundles were lost with their node; the others stay reserved.
    Rescheduling,
    Removed {
        reason: String,
    },
}

/// A TPU slice group request (TPU.md): every host of `num_slices` intact slices.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SliceSpec {
    pub accelerator_type: String,
    pub topology: Option<String>,
    pub num_slices: u32,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlacementGroupRecord {
    pub pg_id: PlacementGroupId,
    pub job_id: JobId,
    pub name: String,
    pub namespace: String,
    pub strategy: PgStrategy,
    /// Bundle `i` in order; a slice group has one per host once placed.
    pub bundles: Vec<Bundle>,
    pub slice: Option<SliceSpec>,
    pub detached: bool,
    pub status: PgStatus,
    /// The node holding each reserved bundle (same length as `bundles`).
    pub bundle_nodes: Vec<Option<NodeId>>,
    pub create_time_ms: u64,
}

impl PlacementGroupRecord {
    pub fn is_removed(&self) -> bool {
        matches!(self.status, PgStatus::Removed { .. })
    }
    /// Whether it still needs bundles placed.
    pub fn wants_placement(&self) -> bool {
        matches!(self.status, PgStatus::Pending | PgStatus::Rescheduling)
    }
}

/// A durable change. Each carries the request id it came from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Command {
    pub request_id: String,
    pub kind: CommandKind,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum CommandKind {
    RegisterNode(NodeRecord),
    MarkNodeDead {
        node_id: NodeId,
        reason: String,
    },
    RegisterJob(JobRecord),
    FinishJob {
        job_id: JobId,
        end_time_ms: u64,
    },
    CreateActor {
        actor: ActorRecord,
        get_if_exists: bool,
    },
    ActorAlive {
        actor_id: ActorId,
        node_id: NodeId,
        worker_id: WorkerId,
        address: String,
        pid: u32,
    },
    /// The actor's process or node died. Restarts when restarts remain and
    /// `intended` is false; otherwise the actor is dead.
    ActorWorkerExited {
        actor_id: ActorId,
        worker_id: Option<WorkerId>,
        intended: bool,
        cause: String,
    },
    CreatePlacementGroup(PlacementGroupRecord),
    /// Bundles reserved on node agents (both phases done): `(index, node)`. A slice group
    /// placed for the first time also fixes its bundle list (one per host).
    PlacementGroupPlaced {
        pg_id: PlacementGroupId,
        bundles: Vec<(u32, NodeId)>,
        slice_bundles: Option<Vec<Bundle>>,
    },
    /// Removes a group; actors inside it die with it.
    RemovePlacementGroup {
        pg_id: PlacementGroupId,
        reason: String,
    },
    KvPut {
        namespace: String,
        #[serde(with = "raw_bytes")]
        key: Vec<u8>,
        #[serde(with = "raw_bytes")]
        value: Vec<u8>,
        overwrite: bool,
    },
    KvDelete {
        namespace: String,
        #[serde(with = "raw_bytes")]
        key: Vec<u8>,
    },
    /// Jobs API submissions (HEAD-11, `submissions.rs`).
    Submission(crate::submissions::SubmissionCommand),
    /// Names the cluster once, when its first leader starts (later ones change nothing).
    InitCluster {
        cluster_id: String,
        created_ms: u64,
    },
}

/// What applying a command produced.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Outcome {
    Done,
    Node(NodeId),
    Job(JobId),
    Actor(ActorId),
    PlacementGroup(PlacementGroupId),
    KvAdded(bool),
    KvDeleted(bool),
    Rejected(Rejection),
    /// A job submission's id.
    Submission(String),
    /// Whether a stopped job had not ended yet.
    Stopped(bool),
    Deleted(bool),
}

/// A command the state machine refused, as data (it crosses the wire).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum Rejection {
    #[error("{0}")]
    AlreadyExists(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Invalid(String),
}

/// Something that changed, for the subscription stream.
#[derive(Clone, Debug, PartialEq)]
pub enum Changed {
    Node(NodeId),
    Job(JobId),
    Actor(ActorId),
    PlacementGroup(PlacementGroupId),
}

/// Durable cluster state; a snapshot is this struct serialized (`snapshot`/`restore`).
#[derive(Default, Debug, Serialize, Deserialize)]
pub struct StateMachine {
    /// Set once by [`CommandKind::InitCluster`].
    pub cluster_id: String,
    pub cluster_created_ms: u64,
    pub nodes: BTreeMap<NodeId, NodeRecord>,
    pub jobs: BTreeMap<JobId, JobRecord>,
    pub actors: BTreeMap<ActorId, ActorRecord>,
    /// (namespace, name) → actor, for actors that are not dead (HEAD-3: one
    /// live actor per name and namespace).
    pub named_actors: HashMap<(String, String), ActorId>,
    pub placement_groups: BTreeMap<PlacementGroupId, PlacementGroupRecord>,
    /// (namespace, name) → group, for groups not removed.
    pub named_placement_groups: HashMap<(String, String), PlacementGroupId>,
    #[serde(with = "kv_map")]
    pub kv: BTreeMap<(String, Vec<u8>), Vec<u8>>,
    /// Jobs API submissions by submission id (HEAD-11).
    pub submissions: BTreeMap<String, crate::submissions::SubmissionRecord>,
    applied: HashMap<String, Outcome>,
    applied_order: VecDeque<String>,
    /// Index of the last applied command.
    pub applied_index: u64,
}

impl StateMachine {
    pub fn new() -> Self {
        Self::default()
    }

    /// The whole state (with `extra`, the caller's own counters) as snapshot bytes.
    pub fn snapshot(&self, extra: u64) -> Vec<u8> {
        let mut out = vec![FORMAT];
        out.extend(postcard::to_stdvec(&(extra, self)).expect("the state always serializes"));
        out
    }

    /// The state and the caller's counter from snapshot bytes.
    ///
    /// # Errors
    /// A message when the bytes are not a snapshot of this format version.
    pub fn restore(b: &[u8]) -> Result<(Self, u64), String> {
        match b.split_first() {
            Some((&FORMAT, rest)) => {
                let (extra, sm): (u64, StateMachine) =
                    postcard::from_bytes(rest).map_err(|e| e.to_string())?;
                Ok((sm, extra))
            }
            Some((v, _)) => Err(format!("snapshot format {v} (this head reads {FORMAT})")),
            None => Err("empty snapshot".into()),
        }
    }

    /// Applies one command; returns its outcome and what changed. A request
    /// id seen before returns the first outcome and changes nothing (HEAD-2).
    pub fn apply(&mut self, cmd: Command) -> (Outcome, Vec<Changed>) {
        if !cmd.request_id.is_empty()
            && let Some(prev) = self.applied.get(&cmd.request_id)
        {
            return (prev.clone(), Vec::new());
        }
        self.applied_index += 1;
        let mut changed = Vec::new();
        let outcome = self.apply_kind(cmd.kind, &mut changed);
        if !cmd.request_id.is_empty() {
            self.applied.insert(cmd.request_id.clone(), outcome.clone());
            self.applied_order.push_back(cmd.request_id);
            while self.applied_order.len() > DEDUP_CAPACITY {
                if let Some(old) = self.applied_order.pop_front() {
                    self.applied.remove(&old);
                }
            }
        }
        (outcome, changed)
    }

    fn apply_kind(&mut self, kind: CommandKind, changed: &mut Vec<Changed>) -> Outcome {
        match kind {
            CommandKind::RegisterNode(rec) => {
                if let Some(existing) = self.nodes.get(&rec.node_id)
                    && matches!(existing.status, NodeStatus::Dead { .. })
                {
                    return Outcome::Rejected(Rejection::Invalid(format!(
                        "node {} was already declared dead; start a new node agent",
                        rec.node_id
                    )));
                }
                // HEAD-10: one live host per (slice, worker id); a duplicate would also
                // bring a second slice-head resource (TPU.md's known failures).
                let slot = |r: &NodeRecord| {
                    let l = &r.labels.0;
                    Some((
                        l.get("tpuray.io/tpu-slice-name")?.clone(),
                        l.get("tpuray.io/tpu-worker-id")?.clone(),
                    ))
                };
                if let Some(mine) = slot(&rec)
                    && let Some(other) = self.nodes.values().find(|n| {
                        n.node_id != rec.node_id
                            && n.status == NodeStatus::Alive
                            && slot(n).as_ref() == Some(&mine)
                    })
                {
                    return Outcome::Rejected(Rejection::AlreadyExists(format!(
                        "TPU slice {:?} already has a live host with TPU_WORKER_ID={} (node {} at {}): \
                         each host of a slice needs its own worker id (a restarted host may join once \
                         its old node is declared dead)",
                        mine.0, mine.1, other.node_id, other.address
                    )));
                }
                let id = rec.node_id.clone();
                self.nodes.insert(id.clone(), rec);
                changed.push(Changed::Node(id.clone()));
                Outcome::Node(id)
            }
            CommandKind::MarkNodeDead { node_id, reason } => {
                let Some(node) = self.nodes.get_mut(&node_id) else {
                    return Outcome::Rejected(Rejection::NotFound(format!("no node {node_id}")));
                };
                if node.status == NodeStatus::Alive {
                    node.status = NodeStatus::Dead { reason: reason.clone() };
                    changed.push(Changed::Node(node_id.clone()));
                    // Actors on the node lost their process with it.
                    let on_node: Vec<ActorId> = self
                        .actors
                        .values()
                        .filter(|a| matches!(&a.status, ActorStatus::Alive { node_id: n, .. } if *n == node_id))
                        .map(|a| a.actor_id.clone())
                        .collect();
                    for actor_id in on_node {
                        self.actor_exited(
                            &actor_id,
                            None,
                            false,
                            format!("the actor's node {node_id} died: {reason}"),
                            changed,
                        );
                    }
                    // Bundles on the node are lost; the group waits for them again.
                    for pg in self.placement_groups.values_mut().filter(|p| !p.is_removed()) {
                        let mut lost = false;
                        for slot in pg.bundle_nodes.iter_mut() {
                            if slot.as_ref() == Some(&node_id) {
                                *slot = None;
                                lost = true;
                            }
                        }
                        if lost {
                            pg.status = PgStatus::Rescheduling;
                            changed.push(Changed::PlacementGroup(pg.pg_id.clone()));
                        }
                    }
                }
                Outcome::Done
            }
            CommandKind::RegisterJob(job) => {
                let id = job.job_id.clone();
                if let Some(s) = self.submissions.get_mut(&job.submission_id) {
                    // Ray's `driver_info`: the last driver the submission started.
                    s.driver = Some((id.clone(), job.driver_address.clone(), job.driver_pid));
                }
                self.jobs.insert(id.clone(), job);
                changed.push(Changed::Job(id.clone()));
                Outcome::Job(id)
            }
            CommandKind::FinishJob { job_id, end_time_ms } => {
                self.apply_finish_job(job_id, end_time_ms, changed)
            }
            CommandKind::Submission(c) => self.apply_submission(c, changed),
            CommandKind::CreateActor { actor, get_if_exists } => {
                if !actor.name.is_empty() {
                    let key = (actor.namespace.clone(), actor.name.clone());
                    if let Some(existing) = self.named_actors.get(&key) {
                        if get_if_exists {
                            return Outcome::Actor(existing.clone());
                        }
                        return Outcome::Rejected(Rejection::AlreadyExists(format!(
                            "actor named {:?} already exists in namespace {:?}",
                            actor.name, actor.namespace
                        )));
                    }
                    self.named_actors.insert(key, actor.actor_id.clone());
                }
                let id = actor.actor_id.clone();
                self.actors.insert(id.clone(), actor);
                changed.push(Changed::Actor(id.clone()));
                Outcome::Actor(id)
            }
            CommandKind::ActorAlive { actor_id, node_id, worker_id, address, pid } => {
                let Some(actor) = self.actors.get_mut(&actor_id) else {
                    return Outcome::Rejected(Rejection::NotFound(format!("no actor {actor_id}")));
                };
                if actor.is_dead() {
                    return Outcome::Rejected(Rejection::Invalid(format!(
                        "actor {actor_id} is dead"
                    )));
                }
                actor.last_placement = Some((node_id.clone(), pid));
                actor.status = ActorStatus::Alive { node_id, worker_id, address, pid };
                changed.push(Changed::Actor(actor_id.clone()));
                Outcome::Actor(actor_id)
            }
            CommandKind::ActorWorkerExited { actor_id, worker_id, intended, cause } => {
                if !self.actors.contains_key(&actor_id) {
                    return Outcome::Rejected(Rejection::NotFound(format!("no actor {actor_id}")));
                }
                self.actor_exited(&actor_id, worker_id.as_ref(), intended, cause, changed);
                Outcome::Actor(actor_id)
            }
            CommandKind::CreatePlacementGroup(pg) => {
                // Clients may choose the id: never let one replace another group.
                if self.placement_groups.contains_key(&pg.pg_id) {
                    return Outcome::Rejected(Rejection::AlreadyExists(format!(
                        "placement group {} already exists",
                        pg.pg_id
                    )));
                }
                if !pg.name.is_empty() {
                    let key = (pg.namespace.clone(), pg.name.clone());
                    if self.named_placement_groups.contains_key(&key) {
                        return Outcome::Rejected(Rejection::AlreadyExists(format!(
                            "placement group named {:?} already exists in namespace {:?}",
                            pg.name, pg.namespace
                        )));
                    }
                    self.named_placement_groups.insert(key, pg.pg_id.clone());
                }
                let id = pg.pg_id.clone();
                self.placement_groups.insert(id.clone(), pg);
                changed.push(Changed::PlacementGroup(id.clone()));
                Outcome::PlacementGroup(id)
            }
            CommandKind::PlacementGroupPlaced { pg_id, bundles, slice_bundles } => {
                let Some(pg) = self.placement_groups.get_mut(&pg_id) else {
                    return Outcome::Rejected(Rejection::NotFound(format!(
                        "no placement group {pg_id}"
                    )));
                };
                if pg.is_removed() {
                    return Outcome::Rejected(Rejection::Invalid(format!(
                        "placement group {pg_id} was removed"
                    )));
                }
                if let Some(b) = slice_bundles {
                    pg.bundle_nodes = vec![None; b.len()];
                    pg.bundles = b;
                }
                for (i, node) in bundles {
                    match pg.bundle_nodes.get_mut(i as usize) {
                        Some(slot) if slot.is_none() => *slot = Some(node),
                        _ => {
                            return Outcome::Rejected(Rejection::Invalid(format!(
                                "bundle {i} of placement group {pg_id} is not waiting for a node"
                            )));
                        }
                    }
                }
                if pg.bundle_nodes.iter().all(Option::is_some) {
                    pg.status = PgStatus::Created;
                }
                changed.push(Changed::PlacementGroup(pg_id.clone()));
                Outcome::PlacementGroup(pg_id)
            }
            CommandKind::RemovePlacementGroup { pg_id, reason } => {
                if !self.placement_groups.contains_key(&pg_id) {
                    return Outcome::Rejected(Rejection::NotFound(format!(
                        "no placement group {pg_id}"
                    )));
                }
                self.remove_group(&pg_id, reason, changed);
                Outcome::PlacementGroup(pg_id)
            }
            CommandKind::KvPut { namespace, key, value, overwrite } => {
                let k = (namespace, key);
                if !overwrite && self.kv.contains_key(&k) {
                    return Outcome::KvAdded(false);
                }
                let added = self.kv.insert(k, value).is_none();
                Outcome::KvAdded(added)
            }
            CommandKind::KvDelete { namespace, key } => {
                Outcome::KvDeleted(self.kv.remove(&(namespace, key)).is_some())
            }
            CommandKind::InitCluster { cluster_id, created_ms } => {
                if self.cluster_id.is_empty() {
                    self.cluster_id = cluster_id;
                    self.cluster_created_ms = created_ms;
                }
                Outcome::Done
            }
        }
    }

    /// ACTOR-1: an exit that was not asked for counts against
    /// `max_restarts`, whatever its exit code; a stale report about an older
    /// worker of the same actor changes nothing.
    /// Ends a running driver job: its non-detached actors and placement groups end with it.
    pub(crate) fn apply_finish_job(
        &mut self,
        job_id: JobId,
        end_time_ms: u64,
        changed: &mut Vec<Changed>,
    ) -> Outcome {
        let Some(job) = self.jobs.get_mut(&job_id) else {
            return Outcome::Rejected(Rejection::NotFound(format!("no job {job_id}")));
        };
        if job.status == JobStatus::Running {
            job.status = JobStatus::Finished;
            job.end_time_ms = end_time_ms;
            changed.push(Changed::Job(job_id.clone()));
            // Non-detached actors die with their job (Ray's semantics).
            let owned: Vec<ActorId> = self
                .actors
                .values()
                .filter(|a| a.job_id == job_id && !a.detached && !a.is_dead())
                .map(|a| a.actor_id.clone())
                .collect();
            for actor_id in owned {
                self.actor_exited(
                    &actor_id,
                    None,
                    true,
                    format!("the actor's job {job_id} finished"),
                    changed,
                );
            }
            // Groups die with their job unless detached (Ray's lifetime).
            let groups: Vec<PlacementGroupId> = self
                .placement_groups
                .values()
                .filter(|p| p.job_id == job_id && !p.detached && !p.is_removed())
                .map(|p| p.pg_id.clone())
                .collect();
            for pg_id in groups {
                self.remove_group(&pg_id, format!("its job {job_id} finished"), changed);
            }
        }
        Outcome::Done
    }

    fn actor_exited(
        &mut self,
        actor_id: &ActorId,
        worker_id: Option<&WorkerId>,
        intended: bool,
        cause: String,
        changed: &mut Vec<Changed>,
    ) {
        let Some(actor) = self.actors.get_mut(actor_id) else {
            return;
        };
        if actor.is_dead() {
            return;
        }
        if let Some(w) = worker_id {
            match &actor.status {
                ActorStatus::Alive { worker_id: cur, .. } if cur == w => {}
                _ => return,
            }
        }
        if !intended && actor.restarts_left() {
            actor.num_restarts += 1;
            actor.status = ActorStatus::Restarting { cause };
        } else {
            let cause = if intended || actor.max_restarts == 0 {
                cause
            } else {
                format!(
                    "{cause} (restarted {} times, max_restarts={})",
                    actor.num_restarts, actor.max_restarts
                )
            };
            actor.status = ActorStatus::Dead { cause };
            if !actor.name.is_empty() {
                self.named_actors.remove(&(actor.namespace.clone(), actor.name.clone()));
            }
        }
        changed.push(Changed::Actor(actor_id.clone()));
    }

    /// Marks a group removed (keeping where its bundles were, for the agents to give them
    /// back) and its actors dead: what ran inside a removed group never restarts.
    fn remove_group(
        &mut self,
        pg_id: &PlacementGroupId,
        reason: String,
        changed: &mut Vec<Changed>,
    ) {
        let Some(pg) = self.placement_groups.get_mut(pg_id) else {
            return;
        };
        if pg.is_removed() {
            return;
        }
        pg.status = PgStatus::Removed { reason: reason.clone() };
        if !pg.name.is_empty() {
            self.named_placement_groups.remove(&(pg.namespace.clone(), pg.name.clone()));
        }
        changed.push(Changed::PlacementGroup(pg_id.clone()));
        let inside: Vec<ActorId> = self
            .actors
            .values()
            .filter(|a| !a.is_dead() && a.placement_group.as_ref().is_some_and(|p| p.0 == *pg_id))
            .map(|a| a.actor_id.clone())
            .collect();
        for actor_id in inside {
            self.actor_exited(
                &actor_id,
                None,
                true,
                format!("the actor's placement group {pg_id} was removed ({reason})"),
                changed,
            );
        }
        self.forget_old_removed_groups();
    }

    /// HEAD-9: keeps at most [`MAX_REMOVED_PLACEMENT_GROUPS`] plus
    /// [`REMOVED_PLACEMENT_GROUPS_SLACK`] removed groups; past that, forgets the oldest (by
    /// creation time, then id: the same choice on every replica) down to the maximum.
    /// Without it the state, and with it every snapshot, grows with each group ever made
    /// (a create/remove loop slowed down at each snapshot). Each removal costs one pass
    /// over the groups; the sort runs once per slack's worth of removals (it ran at every
    /// removal, cloning every id, and took 17% of the Raft thread in a create/remove loop).
    fn forget_old_removed_groups(&mut self) {
        let removed = self.placement_groups.values().filter(|p| p.is_removed()).count();
        if removed <= MAX_REMOVED_PLACEMENT_GROUPS + REMOVED_PLACEMENT_GROUPS_SLACK {
            return;
        }
        let mut by_age: Vec<(u64, &PlacementGroupId)> = self
            .placement_groups
            .values()
            .filter(|p| p.is_removed())
            .map(|p| (p.create_time_ms, &p.pg_id))
            .collect();
        by_age.sort_unstable();
        let oldest: Vec<PlacementGroupId> = by_age[..removed - MAX_REMOVED_PLACEMENT_GROUPS]
            .iter()
            .map(|(_, id)| (*id).clone())
            .collect();
        for id in oldest {
            self.placement_groups.remove(&id);
        }
    }

    /// The group with this name in this namespace, unless removed.
    pub fn named_placement_group(
        &self,
        namespace: &str,
        name: &str,
    ) -> Option<&PlacementGroupRecord> {
        self.named_placement_groups
            .get(&(namespace.to_string(), name.to_string()))
            .and_then(|id| self.placement_groups.get(id))
    }

    /// The live actor with this name in this namespace.
    pub fn named_actor(&self, namespace: &str, name: &str) -> Option<&ActorRecord> {
        self.named_actors
            .get(&(namespace.to_string(), name.to_string()))
            .and_then(|id| self.actors.get(id))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(id: &NodeId) -> NodeRecord {
        NodeRecord {
            node_id: id.clone(),
            address: "127.0.0.1:1".into(),
            hostname: "h".into(),
            total: ResourceSet::from_json(r#"{"CPU": 2}"#).unwrap(),
            labels: Labels::default(),
            is_head_node: false,
            start_time_ms: 0,
            session_dir: String::new(),
            pid: 1,
            status: NodeStatus::Alive,
            object_store_dir: String::new(),
            metrics_export_port: 0,
        }
    }

    fn actor(name: &str, max_restarts: i64) -> ActorRecord {
        ActorRecord {
            actor_id: ActorId::random(),
            job_id: JobId::random(),
            name: name.into(),
            namespace: DEFAULT_NAMESPACE.into(),
            class_name: "C".into(),
            resources: ResourceSet::new(),
            placement_resources: ResourceSet::new(),
            label_selector: vec![],
            affinity: None,
            spread: false,
            max_restarts,
            num_restarts: 0,
            detached: false,
            status: ActorStatus::PendingCreation,
            creation_task: vec![],
            last_placement: None,
            placement_group: None,
        }
    }

    fn cmd(kind: CommandKind) -> Command {
        Command { request_id: tpuray_proto::new_request_id(), kind }
    }

    #[test]
    fn retried_request_id_is_applied_once() {
        let mut sm = StateMachine::new();
        let a = actor("x", 0);
        let c = Command {
            request_id: "r1".into(),
            kind: CommandKind::CreateActor { actor: a.clone(), get_if_exists: false },
        };
        let (o1, ch1) = sm.apply(c.clone());
        let (o2, ch2) = sm.apply(c);
        assert_eq!(o1, o2);
        assert_eq!(ch1.len(), 1);
        assert!(ch2.is_empty());
        assert_eq!(sm.actors.len(), 1);
    }

    #[test]
    fn second_live_actor_with_same_name_is_rejected() {
        let mut sm = StateMachine::new();
        sm.apply(cmd(CommandKind::CreateActor { actor: actor("x", 0), get_if_exists: false }));
        let (o, _) =
            sm.apply(cmd(CommandKind::CreateActor { actor: actor("x", 0), get_if_exists: false }));
        assert!(matches!(o, Outcome::Rejected(Rejection::AlreadyExists(m)) if m.contains("\"x\"")));
    }

    #[test]
    fn actor_restarts_on_node_death_until_max_restarts_then_dies() {
        let mut sm = StateMachine::new();
        let n1 = NodeId::random();
        let n2 = NodeId::random();
        sm.apply(cmd(CommandKind::RegisterNode(node(&n1))));
        sm.apply(cmd(CommandKind::RegisterNode(node(&n2))));
        let a = actor("", 1);
        let id = a.actor_id.clone();
        sm.apply(cmd(CommandKind::CreateActor { actor: a, get_if_exists: false }));
        for n in [&n1, &n2] {
            sm.apply(cmd(CommandKind::ActorAlive {
                actor_id: id.clone(),
                node_id: n.clone(),
                worker_id: WorkerId::random(),
                address: "a".into(),
                pid: 1,
            }));
            sm.apply(cmd(CommandKind::MarkNodeDead { node_id: n.clone(), reason: "gone".into() }));
        }
        let rec = &sm.actors[&id];
        assert_eq!(rec.num_restarts, 1);
        assert!(rec.is_dead(), "{:?}", rec.status);
    }

    #[test]
    fn clean_exit_not_asked_for_counts_as_a_restart() {
        let mut sm = StateMachine::new();
        let a = actor("n", 2);
        let id = a.actor_id.clone();
        sm.apply(cmd(CommandKind::CreateActor { actor: a, get_if_exists: false }));
        sm.apply(cmd(CommandKind::ActorWorkerExited {
            actor_id: id.clone(),
            worker_id: None,
            intended: false,
            cause: "exit code 0".into(),
        }));
        assert_eq!(sm.actors[&id].num_restarts, 1);
        sm.apply(cmd(CommandKind::ActorWorkerExited {
            actor_id: id.clone(),
            worker_id: None,
            intended: true,
            cause: "killed".into(),
        }));
        assert!(sm.actors[&id].is_dead());
        assert!(sm.named_actor(DEFAULT_NAMESPACE, "n").is_none());
    }

    fn group(name: &str, job: &JobId, n: usize) -> PlacementGroupRecord {
        PlacementGroupRecord {
            pg_id: PlacementGroupId::random(),
            job_id: job.clone(),
            name: name.into(),
            namespace: DEFAULT_NAMESPACE.into(),
            strategy: PgStrategy::Pack,
            bundles: vec![
                Bundle {
                    demand: ResourceSet::from_json(r#"{"CPU": 1}"#).unwrap(),
                    label_selector: vec![]
                };
                n
            ],
            slice: None,
            detached: false,
            status: PgStatus::Pending,
            bundle_nodes: vec![None; n],
            create_time_ms: 0,
        }
    }

    fn placed(pg: &PlacementGroupId, bundles: Vec<(u32, NodeId)>) -> CommandKind {
        CommandKind::PlacementGroupPlaced { pg_id: pg.clone(), bundles, slice_bundles: None }
    }

    /// PG-1: clients choose group ids; a second group with a taken id never replaces the
    /// first.
    #[test]
    fn creating_a_group_with_a_taken_id_is_refused_and_keeps_the_first() {
        let mut sm = StateMachine::new();
        let first = group("", &JobId::random(), 1);
        let mut second = group("", &JobId::random(), 2);
        second.pg_id = first.pg_id.clone();
        let id = first.pg_id.clone();
        sm.apply(cmd(CommandKind::CreatePlacementGroup(first)));
        let (o, changed) = sm.apply(cmd(CommandKind::CreatePlacementGroup(second)));
        assert!(matches!(o, Outcome::Rejected(Rejection::AlreadyExists(_))), "{o:?}");
        assert!(changed.is_empty());
        assert_eq!(sm.placement_groups[&id].bundles.len(), 1);
    }

    #[test]
    fn group_is_created_once_every_bundle_is_placed_and_a_retry_reserves_nothing_twice() {
        let mut sm = StateMachine::new();
        let (n1, n2) = (NodeId::random(), NodeId::random());
        let pg = group("g", &JobId::random(), 2);
        let id = pg.pg_id.clone();
        sm.apply(cmd(CommandKind::CreatePlacementGroup(pg)));
        sm.apply(cmd(placed(&id, vec![(0, n1.clone())])));
        assert_eq!(sm.placement_groups[&id].status, PgStatus::Pending);
        let c = Command { request_id: "r".into(), kind: placed(&id, vec![(1, n2.clone())]) };
        sm.apply(c.clone());
        assert_eq!(sm.placement_groups[&id].status, PgStatus::Created);
        // The same request again changes nothing; a new one for a taken bundle is refused.
        let (_, ch) = sm.apply(c);
        assert!(ch.is_empty());
        let (o, _) = sm.apply(cmd(placed(&id, vec![(1, n1.clone())])));
        assert!(matches!(o, Outcome::Rejected(Rejection::Invalid(_))), "{o:?}");
        assert_eq!(sm.placement_groups[&id].bundle_nodes, vec![Some(n1), Some(n2)]);
    }

    #[test]
    fn node_death_sends_its_bundles_back_to_placement_keeping_the_others() {
        let mut sm = StateMachine::new();
        let (n1, n2) = (NodeId::random(), NodeId::random());
        sm.apply(cmd(CommandKind::RegisterNode(node(&n1))));
        sm.apply(cmd(CommandKind::RegisterNode(node(&n2))));
        let pg = group("", &JobId::random(), 2);
        let id = pg.pg_id.clone();
        sm.apply(cmd(CommandKind::CreatePlacementGroup(pg)));
        sm.apply(cmd(placed(&id, vec![(0, n1.clone()), (1, n2.clone())])));
        sm.apply(cmd(CommandKind::MarkNodeDead { node_id: n2, reason: "gone".into() }));
        let g = &sm.placement_groups[&id];
        assert_eq!(g.status, PgStatus::Rescheduling);
        assert_eq!(g.bundle_nodes, vec![Some(n1), None]);
    }

    #[test]
    fn removing_a_group_kills_its_actors_frees_its_name_and_placing_it_later_is_refused() {
        let mut sm = StateMachine::new();
        let job = JobId::random();
        let pg = group("g", &job, 1);
        let id = pg.pg_id.clone();
        sm.apply(cmd(CommandKind::CreatePlacementGroup(pg)));
        let (o, _) = sm.apply(cmd(CommandKind::CreatePlacementGroup(group("g", &job, 1))));
        assert!(matches!(o, Outcome::Rejected(Rejection::AlreadyExists(_))), "{o:?}");
        let mut a = actor("", -1);
        a.placement_group = Some((id.clone(), 0));
        let aid = a.actor_id.clone();
        sm.apply(cmd(CommandKind::CreateActor { actor: a, get_if_exists: false }));
        sm.apply(cmd(CommandKind::RemovePlacementGroup { pg_id: id.clone(), reason: "x".into() }));
        assert!(sm.actors[&aid].is_dead(), "restarts never bring back an actor of a removed group");
        assert!(sm.named_placement_group(DEFAULT_NAMESPACE, "g").is_none());
        let (o, _) = sm.apply(cmd(placed(&id, vec![(0, NodeId::random())])));
        assert!(matches!(o, Outcome::Rejected(_)), "{o:?}");
        let (o, _) = sm.apply(cmd(CommandKind::CreatePlacementGroup(group("g", &job, 1))));
        assert!(matches!(o, Outcome::PlacementGroup(_)), "the name is free again: {o:?}");
    }

    /// HEAD-9: the state keeps the newest removed groups only; live ones always stay.
    #[test]
    fn only_the_newest_removed_groups_are_kept_head_9() {
        let mut sm = StateMachine::new();
        let job = JobId::random();
        let live = group("", &job, 1);
        let live_id = live.pg_id.clone();
        sm.apply(cmd(CommandKind::CreatePlacementGroup(live)));
        let mut ids = Vec::new();
        let made = MAX_REMOVED_PLACEMENT_GROUPS + REMOVED_PLACEMENT_GROUPS_SLACK + 5;
        for i in 0..made {
            let mut g = group("", &job, 1);
            g.create_time_ms = 1 + i as u64;
            ids.push(g.pg_id.clone());
            sm.apply(cmd(CommandKind::CreatePlacementGroup(g)));
        }
        for id in &ids {
            sm.apply(cmd(CommandKind::RemovePlacementGroup {
                pg_id: id.clone(),
                reason: "x".into(),
            }));
        }
        let removed = sm.placement_groups.values().filter(|p| p.is_removed()).count();
        // Past max + slack (at the removal after it), the oldest went down to the max;
        // the 4 removals since are kept.
        assert_eq!(removed, MAX_REMOVED_PLACEMENT_GROUPS + 4);
        let forgotten = made - removed;
        assert!(
            ids[..forgotten].iter().all(|id| !sm.placement_groups.contains_key(id)),
            "oldest forgotten"
        );
        assert!(
            ids[forgotten..].iter().all(|id| sm.placement_groups.contains_key(id)),
            "newest kept"
        );
        assert!(sm.placement_groups.contains_key(&live_id), "a live group is never forgotten");
    }

    #[test]
    fn groups_die_with_their_job_unless_detached() {
        let mut sm = StateMachine::new();
        let job = JobId::random();
        sm.apply(cmd(CommandKind::RegisterJob(JobRecord {
            job_id: job.clone(),
            status: JobStatus::Running,
            driver_address: String::new(),
            driver_pid: 1,
            entrypoint: String::new(),
            namespace: DEFAULT_NAMESPACE.into(),
            start_time_ms: 0,
            end_time_ms: 0,
            worker_binary_hash: String::new(),
            submission_id: String::new(),
        })));
        let plain = group("", &job, 1);
        let mut detached = group("", &job, 1);
        detached.detached = true;
        let (p, d) = (plain.pg_id.clone(), detached.pg_id.clone());
        sm.apply(cmd(CommandKind::CreatePlacementGroup(plain)));
        sm.apply(cmd(CommandKind::CreatePlacementGroup(detached)));
        sm.apply(cmd(CommandKind::FinishJob { job_id: job, end_time_ms: 1 }));
        assert!(sm.placement_groups[&p].is_removed());
        assert!(!sm.placement_groups[&d].is_removed());
    }

    #[test]
    fn snapshot_restores_every_record_and_the_dedup_memory() {
        let mut sm = StateMachine::new();
        let n = NodeId::random();
        sm.apply(cmd(CommandKind::RegisterNode(node(&n))));
        let c = Command {
            request_id: "once".into(),
            kind: CommandKind::CreateActor { actor: actor("x", -1), get_if_exists: false },
        };
        let (first, _) = sm.apply(c.clone());
        sm.apply(cmd(CommandKind::KvPut {
            namespace: "ns".into(),
            key: b"k".to_vec(),
            value: b"v".to_vec(),
            overwrite: true,
        }));
        let bytes = sm.snapshot(42);
        let (mut back, extra) = StateMachine::restore(&bytes).unwrap();
        assert_eq!(extra, 42);
        assert_eq!(back.nodes, sm.nodes);
        assert_eq!(back.actors, sm.actors);
        assert_eq!(back.kv, sm.kv);
        assert!(back.named_actor(DEFAULT_NAMESPACE, "x").is_some());
        // HEAD-2 survives a snapshot: the retried request is answered, not applied.
        let (again, changed) = back.apply(c);
        assert_eq!(again, first);
        assert!(changed.is_empty());
        assert_eq!(back.actors.len(), 1);
    }

    #[test]
    fn commands_round_trip_through_the_log_encoding() {
        let c = cmd(CommandKind::KvDelete { namespace: "a".into(), key: vec![1, 2] });
        assert_eq!(decode_command(&encode_command(&c)).unwrap(), c);
        // Byte strings travel whole: a binary chunk costs its length plus a few bytes.
        let put = cmd(CommandKind::KvPut {
            namespace: "binaries".into(),
            key: b"k".to_vec(),
            value: vec![7; 1 << 20],
            overwrite: false,
        });
        let bytes = encode_command(&put);
        assert!(bytes.len() < (1 << 20) + 100, "{} bytes", bytes.len());
        assert_eq!(decode_command(&bytes).unwrap(), put);
        assert!(decode_command(&[9, 0]).unwrap_err().contains("format 9"));
        assert!(StateMachine::restore(&[]).is_err());
    }

    #[test]
    fn cluster_id_is_set_once() {
        let mut sm = StateMachine::new();
        for id in ["a", "b"] {
            sm.apply(cmd(CommandKind::InitCluster { cluster_id: id.into(), created_ms: 1 }));
        }
        assert_eq!(sm.cluster_id, "a");
    }

    #[test]
    fn dead_node_cannot_register_again() {
        let mut sm = StateMachine::new();
        let n = NodeId::random();
        sm.apply(cmd(CommandKind::RegisterNode(node(&n))));
        sm.apply(cmd(CommandKind::MarkNodeDead { node_id: n.clone(), reason: "x".into() }));
        let (o, _) = sm.apply(cmd(CommandKind::RegisterNode(node(&n))));
        assert!(matches!(o, Outcome::Rejected(_)));
    }

    #[test]
    fn head10_a_second_live_host_with_a_slices_worker_id_is_refused() {
        let tpu = |id: &NodeId, slice: &str, w: &str| {
            let mut r = node(id);
            r.labels.0.insert("tpuray.io/tpu-slice-name".into(), slice.into());
            r.labels.0.insert("tpuray.io/tpu-worker-id".into(), w.into());
            r
        };
        let mut sm = StateMachine::new();
        let (a, b, c, d) = (NodeId::random(), NodeId::random(), NodeId::random(), NodeId::random());
        assert!(matches!(
            sm.apply(cmd(CommandKind::RegisterNode(tpu(&a, "ix", "0")))).0,
            Outcome::Node(_)
        ));
        // The same node registering again (a retry) is fine; another slice's 0 too.
        assert!(matches!(
            sm.apply(cmd(CommandKind::RegisterNode(tpu(&a, "ix", "0")))).0,
            Outcome::Node(_)
        ));
        assert!(matches!(
            sm.apply(cmd(CommandKind::RegisterNode(tpu(&b, "iy", "0")))).0,
            Outcome::Node(_)
        ));
        let (o, _) = sm.apply(cmd(CommandKind::RegisterNode(tpu(&c, "ix", "0"))));
        match o {
            Outcome::Rejected(r) => {
                let m = r.to_string();
                assert!(
                    m.contains("TPU slice \"ix\" already has a live host with TPU_WORKER_ID=0"),
                    "{m}"
                );
            }
            _ => panic!("a duplicate worker id was accepted"),
        }
        // Once the first is declared dead, a restarted host takes its place.
        sm.apply(cmd(CommandKind::MarkNodeDead { node_id: a.clone(), reason: "x".into() }));
        assert!(matches!(
            sm.apply(cmd(CommandKind::RegisterNode(tpu(&d, "ix", "0")))).0,
            Outcome::Node(_)
        ));
    }
}
