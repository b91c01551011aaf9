//! The head's durable state machine (HEAD-1): every change to nodes, jobs,
//! actors and KV is a typed [`Command`] applied by [`StateMachine::apply`].
//!
//! The machine is deterministic and does no I/O: the replicated log
//! (`tpuray-replica`, see `replication.rs`) applies the same commands in the same order
//! on every head (HEAD-6). Soft state (heartbeats, usage, demand) lives beside it in
//! the server and never becomes a command (DESIGN.md §5).
//! Commands carry the client's request id; a retried request id is answered
//! with the first outcome and changes nothing (HEAD-2).

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

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

impl ActorStatus {
    /// Whether an actor in this status waits for a node: pending creation or restarting.
    pub fn waits_for_node(&self) -> bool {
        matches!(self, ActorStatus::PendingCreation | ActorStatus::Restarting { .. })
    }
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
    /// Whether it waits for a node: pending creation or restarting.
    pub fn wants_placement(&self) -> bool {
        self.status.waits_for_node()
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
    /// Alive actors by node (actor → its worker), derived from `actors`: kept by the
    /// commands that change an actor's status and rebuilt by `restore`, not snapshotted.
    /// A node agent's reconcile reads its node's actors here instead of scanning every
    /// actor (issue 34: at 10,000 nodes and 20,000 actors the scan was a quarter of the
    /// head's CPU).
    #[serde(skip)]
    alive_on: HashMap<NodeId, HashMap<ActorId, WorkerId>>,
    /// The actors waiting for a node (pending creation or restarting), derived and kept
    /// like `alive_on`: a placement pass reads these instead of scanning every actor.
    #[serde(skip)]
    waiting_actors: BTreeSet<ActorId>,
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
                let (extra, mut sm): (u64, StateMachine) =
                    postcard::from_bytes(rest).map_err(|e| e.to_string())?;
                for a in sm.actors.values() {
                    if let ActorStatus::Alive { node_id, worker_id, .. } = &a.status {
                        let on = sm.alive_on.entry(node_id.clone()).or_default();
                        on.insert(a.actor_id.clone(), worker_id.clone());
                    }
                    if a.wants_placement() {
                        sm.waiting_actors.insert(a.actor_id.clone());
                    }
                }
                Ok((sm, extra))
            }
            Some((v, _)) => Err(format!("snapshot format {v} (this head reads {FORMAT})")),
            None => Err("empty snapshot".into()),
        }
    }

    /// The actors recorded alive on `node` (actor → its worker).
    pub fn alive_actors_on(&self, node: &NodeId) -> HashMap<ActorId, WorkerId> {
        self.alive_on.get(node).cloned().unwrap_or_default()
    }

    /// The actors waiting for a node (pending creation or restarting), in id order.
    pub fn waiting_actors(&self) -> impl Iterator<Item = &ActorRecord> {
        self.waiting_actors.iter().filter_map(|id| self.actors.get(id))
    }

    /// Sets an actor's status, keeping `alive_on` and `waiting_actors` in step.
    fn set_actor_status(&mut self, actor_id: &ActorId, status: ActorStatus) {
        let Some(actor) = self.actors.get_mut(actor_id) else { return };
        if status.waits_for_node() {
            self.waiting_actors.insert(actor_id.clone());
        } else {
            self.waiting_actors.remove(actor_id);
        }
        if let ActorStatus::Alive { node_id, .. } = &actor.status
            && let Some(on) = self.alive_on.get_mut(node_id)
        {
            on.remove(actor_id);
            if on.is_empty() {
                self.alive_on.remove(node_id);
            }
        }
        if let ActorStatus::Alive { node_id, worker_id, .. } = &status {
            let on = self.alive_on.entry(node_id.clone()).or_default();
            on.insert(actor_id.clone(), worker_id.clone());
        }
        actor.status = status;
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
            CommandKind::RegisterNode(rec) => self.apply_register_node(rec, changed),
            CommandKind::MarkNodeDead { node_id, reason } => {
                self.apply_mark_node_dead(node_id, reason, changed)
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
                self.apply_create_actor(actor, get_if_exists, changed)
            }
            CommandKind::ActorAlive { actor_id, node_id, worker_id, address, pid } => {
                self.apply_actor_alive(actor_id, node_id, worker_id, address, pid, changed)
            }
            CommandKind::ActorWorkerExited { actor_id, worker_id, intended, cause } => {
                self.apply_actor_worker_exited(actor_id, worker_id, intended, cause, changed)
            }
            CommandKind::CreatePlacementGroup(pg) => self.apply_create_group(pg, changed),
            CommandKind::PlacementGroupPlaced { pg_id, bundles, slice_bundles } => {
                self.apply_group_placed(pg_id, bundles, slice_bundles, changed)
            }
            CommandKind::RemovePlacementGroup { pg_id, reason } => {
                self.apply_remove_group(pg_id, reason, changed)
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

mod actors;
mod groups;
mod nodes;
#[cfg(test)]
mod tests;
