//! The head's durable state machine (HEAD-1): every change to nodes, jobs,
//! actors and KV is a typed [`Command`] applied by [`StateMachine::apply`].
//!
//! The machine is deterministic and does no I/O, so the Raft issue can put a
//! replicated log under it unchanged. Soft state (heartbeats, usage, demand)
//! lives in `soft.rs` and never becomes a command (DESIGN.md §5).
//! Commands carry the client's request id; a retried request id is answered
//! with the first outcome and changes nothing (HEAD-2).

use std::collections::{BTreeMap, HashMap, VecDeque};

use serde::{Deserialize, Serialize};
use tpuray_proto::ids::{ActorId, JobId, NodeId, WorkerId};
use tpuray_scheduler::{LabelConstraint, Labels, ResourceSet};

/// Default namespace when a client gives none (Ray uses an anonymous one per
/// job; named actors without a namespace live here).
pub const DEFAULT_NAMESPACE: &str = "default";

/// How many applied request ids are remembered for deduplication.
const DEDUP_CAPACITY: usize = 100_000;

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
    pub creation_task: Vec<u8>,
    /// Where the actor last ran (node, pid), kept after it restarts or dies.
    pub last_placement: Option<(NodeId, u32)>,
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
    KvPut {
        namespace: String,
        key: Vec<u8>,
        value: Vec<u8>,
        overwrite: bool,
    },
    KvDelete {
        namespace: String,
        key: Vec<u8>,
    },
}

/// What applying a command produced.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Outcome {
    Done,
    Node(NodeId),
    Job(JobId),
    Actor(ActorId),
    KvAdded(bool),
    KvDeleted(bool),
    Rejected(Rejection),
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
}

/// Durable cluster state.
#[derive(Default, Debug)]
pub struct StateMachine {
    pub nodes: BTreeMap<NodeId, NodeRecord>,
    pub jobs: BTreeMap<JobId, JobRecord>,
    pub actors: BTreeMap<ActorId, ActorRecord>,
    /// (namespace, name) → actor, for actors that are not dead (HEAD-3: one
    /// live actor per name and namespace).
    pub named_actors: HashMap<(String, String), ActorId>,
    pub kv: BTreeMap<(String, Vec<u8>), Vec<u8>>,
    applied: HashMap<String, Outcome>,
    applied_order: VecDeque<String>,
    /// Index of the last applied command.
    pub applied_index: u64,
}

impl StateMachine {
    pub fn new() -> Self {
        Self::default()
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
                }
                Outcome::Done
            }
            CommandKind::RegisterJob(job) => {
                let id = job.job_id.clone();
                self.jobs.insert(id.clone(), job);
                changed.push(Changed::Job(id.clone()));
                Outcome::Job(id)
            }
            CommandKind::FinishJob { job_id, end_time_ms } => {
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
                }
                Outcome::Done
            }
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
        }
    }

    /// ACTOR-1: an exit that was not asked for counts against
    /// `max_restarts`, whatever its exit code; a stale report about an older
    /// worker of the same actor changes nothing.
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

    #[test]
    fn dead_node_cannot_register_again() {
        let mut sm = StateMachine::new();
        let n = NodeId::random();
        sm.apply(cmd(CommandKind::RegisterNode(node(&n))));
        sm.apply(cmd(CommandKind::MarkNodeDead { node_id: n.clone(), reason: "x".into() }));
        let (o, _) = sm.apply(cmd(CommandKind::RegisterNode(node(&n))));
        assert!(matches!(o, Outcome::Rejected(_)));
    }
}
