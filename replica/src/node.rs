//! [`Node`]: one replica's `RawNode`, its [`LogStore`] and the [`Machine`] the log
//! drives, with the Ready handling in the order raft-rs documents (RAFT-1). No clocks,
//! no sockets and no threads: the caller ticks it, feeds it messages and sends what
//! [`Node::handle_ready`] returns, so the same code runs in the head's Raft thread
//! ([`crate::driver`]) and in the simulated network of the tests.
//!
//! The one clock read: [`NodeStatus`] (and the head's `GetReplicaStatus`) reports the
//! last snapshot's size, the time taking it took (serialising, writing, flushing) and how
//! many were taken; a statistic, never a decision. The simulated-network harness in
//! `tests/sim.rs` drives a `Node` directly: dropped, delayed, duplicated and reordered
//! messages, partitions, crash-restarts.

use std::collections::BTreeMap;

use raft::eraftpb::{Entry, EntryType, Message};
use raft::{RawNode, SnapshotStatus, StateRole};

use crate::kv::{Batch, KvStore, StoreError};
use crate::log::LogStore;

/// The deterministic state machine a log drives.
pub trait Machine {
    /// What applying one command produced (returned to its proposer).
    type Output;
    /// Applies the command of entry `index`. Called once per index, in index order
    /// (RAFT-3), and never for an index at or below a restored snapshot's.
    fn apply(&mut self, index: u64, data: &[u8]) -> Self::Output;
    /// The whole state after the last applied entry.
    fn snapshot(&mut self) -> Vec<u8>;
    /// Replaces the whole state with a snapshot taken at `index`.
    ///
    /// # Errors
    /// A message when `data` cannot be read.
    fn restore(&mut self, index: u64, data: &[u8]) -> Result<(), String>;
}

/// Settings of one replica.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    /// This replica's id (1-based; ids are positions in the peer list).
    pub id: u64,
    /// Every voter's id, this one included.
    pub voters: Vec<u64>,
    /// Ticks without a leader before an election (randomized up to twice this).
    pub election_tick: usize,
    /// Ticks between a leader's heartbeats.
    pub heartbeat_tick: usize,
    /// Applied entries between two snapshots of the machine.
    pub snapshot_every: u64,
    /// Entries kept in the log behind a snapshot for followers a little behind.
    pub keep_after_snapshot: u64,
    /// Largest batch of entries in one append message (bytes).
    pub max_size_per_msg: u64,
}

impl NodeConfig {
    /// Defaults for a replica `id` of `voters`.
    pub fn new(id: u64, voters: Vec<u64>) -> Self {
        Self {
            id,
            voters,
            election_tick: 10,
            heartbeat_tick: 2,
            snapshot_every: 10_000,
            keep_after_snapshot: 1_000,
            max_size_per_msg: 8 * 1024 * 1024,
        }
    }
}

/// A replica's role.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Follower,
    PreCandidate,
    Candidate,
    Leader,
}

impl Role {
    pub fn name(self) -> &'static str {
        match self {
            Role::Follower => "follower",
            Role::PreCandidate => "pre-candidate",
            Role::Candidate => "candidate",
            Role::Leader => "leader",
        }
    }
}

impl From<StateRole> for Role {
    fn from(r: StateRole) -> Self {
        match r {
            StateRole::Follower => Role::Follower,
            StateRole::PreCandidate => Role::PreCandidate,
            StateRole::Candidate => Role::Candidate,
            StateRole::Leader => Role::Leader,
        }
    }
}

/// Where a replica stands, for status pages and leader routing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeStatus {
    pub id: u64,
    pub role: Role,
    pub term: u64,
    /// 0 when no leader is known.
    pub leader_id: u64,
    /// A leader that has applied every entry up to the first of its own term, so its
    /// machine holds everything committed before it (reads and writes may start).
    pub leader_ready: bool,
    pub commit: u64,
    pub applied: u64,
    pub first_index: u64,
    pub last_index: u64,
    pub snapshot_index: u64,
    /// On a leader: each peer's (id, matched index).
    pub peers: Vec<(u64, u64)>,
    /// This replica's last snapshot of the machine (RAFT-4): its size and how long taking
    /// it took (the machine's serialisation, the write and the flush); zero before one.
    pub last_snapshot: SnapshotStats,
    /// Snapshots this replica took since it opened.
    pub snapshots_taken: u64,
}

/// Size and cost of one snapshot, for status and benchmarks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SnapshotStats {
    pub bytes: u64,
    pub micros: u64,
}

/// Why a proposal was not (or will not be) answered with an outcome.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ProposeError {
    #[error("this replica is not the leader (leader: {leader:?})")]
    NotLeader { leader: Option<u64> },
    #[error("the proposal's entry was replaced by another leader's")]
    Overwritten,
    #[error("the replica stopped")]
    Stopped,
}

/// A failure of the replica itself.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("raft: {0}")]
    Raft(#[from] raft::Error),
    #[error("cannot restore the state machine from the snapshot at index {index}: {detail}")]
    Restore { index: u64, detail: String },
}

/// What one round of Ready handling produced.
pub struct Effects<T, O> {
    /// Messages to send to peers (each names its `to`).
    pub messages: Vec<Message>,
    /// Answered proposals, in apply order.
    pub applied: Vec<(T, O)>,
    /// Proposals that will get no outcome here.
    pub dropped: Vec<(T, ProposeError)>,
}

impl<T, O> Default for Effects<T, O> {
    fn default() -> Self {
        Self { messages: Vec::new(), applied: Vec::new(), dropped: Vec::new() }
    }
}

/// Context of a proposed entry: (node id, incarnation, counter), so an entry is matched
/// to its proposer only, even across restarts and leader changes.
fn context(id: u64, incarnation: u64, n: u64) -> Vec<u8> {
    [id.to_be_bytes(), incarnation.to_be_bytes(), n.to_be_bytes()].concat()
}

/// One replica. `T` is the token a proposer gets back with its outcome.
pub struct Node<K: KvStore, M: Machine, T> {
    raw: RawNode<LogStore<K>>,
    machine: M,
    cfg: NodeConfig,
    incarnation: u64,
    next_proposal: u64,
    /// Proposals in flight by log index: (context, token).
    pending: BTreeMap<u64, (Vec<u8>, T)>,
    applied: u64,
    /// The index of the first entry of this replica's current leadership term.
    term_start: Option<u64>,
    last_role: Role,
    last_snapshot: SnapshotStats,
    snapshots_taken: u64,
}

impl<K: KvStore, M: Machine, T> Node<K, M, T> {
    /// Opens a replica over `kv`: restores the machine from the stored snapshot, then the
    /// log replays the committed entries after it (RAFT-5). A group of one voter elects
    /// itself at once.
    ///
    /// # Errors
    /// [`NodeError`] when the storage fails, the snapshot cannot be restored or the
    /// configuration is invalid.
    pub fn open(
        cfg: NodeConfig,
        kv: K,
        mut machine: M,
        incarnation: u64,
        logger: &slog::Logger,
    ) -> Result<Self, NodeError> {
        let store = LogStore::open(kv, &cfg.voters)?;
        let mut applied = 0;
        if let Some(snap) = store.stored_snapshot()? {
            let index = snap.get_metadata().index;
            machine
                .restore(index, &snap.data)
                .map_err(|detail| NodeError::Restore { index, detail })?;
            applied = index;
        }
        let rc = raft::Config {
            id: cfg.id,
            election_tick: cfg.election_tick,
            heartbeat_tick: cfg.heartbeat_tick,
            applied,
            max_size_per_msg: cfg.max_size_per_msg,
            max_inflight_msgs: 256,
            check_quorum: true,
            pre_vote: true,
            ..Default::default()
        };
        rc.validate()?;
        let mut raw = RawNode::new(&rc, store, logger)?;
        if cfg.voters == [cfg.id] {
            raw.campaign()?;
        }
        Ok(Self {
            raw,
            machine,
            cfg,
            incarnation,
            next_proposal: 1,
            pending: BTreeMap::new(),
            applied,
            term_start: None,
            last_role: Role::Follower,
            last_snapshot: SnapshotStats::default(),
            snapshots_taken: 0,
        })
    }

    pub fn machine(&self) -> &M {
        &self.machine
    }

    pub fn machine_mut(&mut self) -> &mut M {
        &mut self.machine
    }

    /// Advances the logical clock one tick.
    pub fn tick(&mut self) {
        self.raw.tick();
    }

    /// Hands a message from a peer to Raft (stale or malformed ones are dropped).
    pub fn step(&mut self, m: Message) {
        if let Err(e) = self.raw.step(m) {
            tracing::debug!(target: "raft", %e, "dropped a raft message");
        }
    }

    pub fn report_unreachable(&mut self, id: u64) {
        self.raw.report_unreachable(id);
    }

    pub fn report_snapshot(&mut self, id: u64, delivered: bool) {
        let st = if delivered { SnapshotStatus::Finish } else { SnapshotStatus::Failure };
        self.raw.report_snapshot(id, st);
    }

    fn leader(&self) -> Option<u64> {
        (self.raw.raft.leader_id != 0).then_some(self.raw.raft.leader_id)
    }

    /// Proposes `data` (only a leader takes proposals). The token comes back from
    /// [`Node::handle_ready`] with the machine's output once the entry is applied, or in
    /// `dropped` if it will not be.
    ///
    /// # Errors
    /// The token and [`ProposeError::NotLeader`] when this replica is not the leader.
    pub fn propose(&mut self, data: Vec<u8>, token: T) -> Result<(), (T, ProposeError)> {
        if self.raw.raft.state != StateRole::Leader {
            return Err((token, ProposeError::NotLeader { leader: self.leader() }));
        }
        let ctx = context(self.cfg.id, self.incarnation, self.next_proposal);
        self.next_proposal += 1;
        if self.raw.propose(ctx.clone(), data).is_err() {
            return Err((token, ProposeError::NotLeader { leader: self.leader() }));
        }
        let index = self.raw.raft.raft_log.last_index();
        self.pending.insert(index, (ctx, token));
        Ok(())
    }

    /// Handles one Ready, if there is one, in the documented order (RAFT-1): send
    /// messages, apply a snapshot, apply committed entries, append entries, persist the
    /// hard state (one atomic, flushed write: RAFT-2), send persisted messages, advance,
    /// then the LightReady's commit index, messages and committed entries, and
    /// `advance_apply`. Takes a snapshot of the machine when enough entries were applied.
    ///
    /// # Errors
    /// [`NodeError`] when the storage fails (the replica must stop: RAFT-2).
    pub fn handle_ready(&mut self) -> Result<Effects<T, M::Output>, NodeError> {
        let mut fx = Effects::default();
        self.note_role(&mut fx);
        if !self.raw.has_ready() {
            return Ok(fx);
        }
        let mut rd = self.raw.ready();
        fx.messages.extend(rd.take_messages());
        let mut batch = Batch::default();
        if !rd.snapshot().is_empty() {
            let snap = rd.snapshot().clone();
            let index = snap.get_metadata().index;
            self.raw.mut_store().apply_snapshot(&mut batch, &snap);
            self.machine
                .restore(index, &snap.data)
                .map_err(|detail| NodeError::Restore { index, detail })?;
            self.applied = index;
            // Our proposals up to the snapshot were applied or replaced: we cannot tell.
            let later = self.pending.split_off(&(index + 1));
            for (_, (_, t)) in std::mem::replace(&mut self.pending, later) {
                fx.dropped.push((t, ProposeError::Overwritten));
            }
        }
        let committed = rd.take_committed_entries();
        self.apply_entries(committed, &mut fx);
        if !rd.entries().is_empty() {
            self.raw.mut_store().append(&mut batch, rd.entries());
        }
        if let Some(hs) = rd.hs() {
            self.raw.mut_store().set_hard_state(&mut batch, hs);
        }
        let sync = rd.must_sync() || !batch.is_empty();
        self.raw.mut_store().persist(batch, sync)?;
        fx.messages.extend(rd.take_persisted_messages());
        let mut light = self.raw.advance(rd);
        if let Some(commit) = light.commit_index() {
            let mut batch = Batch::default();
            self.raw.mut_store().set_commit(&mut batch, commit);
            // Not required to be durable: a restart learns the commit index again.
            self.raw.mut_store().persist(batch, false)?;
        }
        fx.messages.extend(light.take_messages());
        let committed = light.take_committed_entries();
        self.apply_entries(committed, &mut fx);
        self.raw.advance_apply();
        self.maybe_snapshot()?;
        self.note_role(&mut fx);
        Ok(fx)
    }

    /// RAFT-3: each committed entry is applied once, in order; a proposal is answered
    /// when its own entry (matched by context) is applied.
    fn apply_entries(&mut self, entries: Vec<Entry>, fx: &mut Effects<T, M::Output>) {
        for e in entries {
            if e.index <= self.applied {
                continue;
            }
            self.applied = e.index;
            let mine = self.pending.remove(&e.index);
            if e.get_entry_type() != EntryType::EntryNormal || e.data.is_empty() {
                // A new leader's empty entry (membership is fixed: no conf changes).
                if let Some((_, t)) = mine {
                    fx.dropped.push((t, ProposeError::Overwritten));
                }
                continue;
            }
            let out = self.machine.apply(e.index, &e.data);
            match mine {
                Some((ctx, t)) if ctx[..] == e.context[..] => fx.applied.push((t, out)),
                Some((_, t)) => fx.dropped.push((t, ProposeError::Overwritten)),
                None => {}
            }
        }
    }

    /// RAFT-4: a snapshot is taken at an applied index; the log is compacted only up to
    /// it (minus a margin).
    fn maybe_snapshot(&mut self) -> Result<(), NodeError> {
        let snap_index = self.raw.store().snapshot_index();
        if self.applied < snap_index + self.cfg.snapshot_every || self.applied == 0 {
            return Ok(());
        }
        // The one clock read of this module: a statistic for status, never a decision.
        let started = std::time::Instant::now();
        let data = self.machine.snapshot();
        let bytes = data.len() as u64;
        let compact_to = self.applied.saturating_sub(self.cfg.keep_after_snapshot);
        let mut batch = Batch::default();
        let applied = self.applied;
        self.raw.mut_store().compact(&mut batch, applied, data, compact_to);
        self.raw.mut_store().persist(batch, true)?;
        self.last_snapshot = SnapshotStats { bytes, micros: started.elapsed().as_micros() as u64 };
        self.snapshots_taken += 1;
        tracing::debug!(target: "raft", index = applied, compact_to, "took a snapshot and compacted the log");
        Ok(())
    }

    /// Tracks leadership: a new leader notes where its term starts; a replica that stops
    /// being leader drops its pending proposals (their clients retry elsewhere, and
    /// request ids make the retry apply once).
    fn note_role(&mut self, fx: &mut Effects<T, M::Output>) {
        let role = Role::from(self.raw.raft.state);
        if role == Role::Leader && self.term_start.is_none() {
            self.term_start = Some(self.raw.raft.raft_log.last_index());
        }
        if role != Role::Leader {
            self.term_start = None;
            if self.last_role == Role::Leader || !self.pending.is_empty() {
                let leader = self.leader();
                for (_, (_, t)) in std::mem::take(&mut self.pending) {
                    fx.dropped.push((t, ProposeError::NotLeader { leader }));
                }
            }
        }
        self.last_role = role;
    }

    /// This replica's status.
    pub fn status(&self) -> NodeStatus {
        let raft = &self.raw.raft;
        let role = Role::from(raft.state);
        let peers = if role == Role::Leader {
            let mut v: Vec<(u64, u64)> =
                raft.prs().iter().map(|(id, pr)| (*id, pr.matched)).collect();
            v.sort_unstable();
            v
        } else {
            Vec::new()
        };
        NodeStatus {
            id: self.cfg.id,
            role,
            term: raft.term,
            leader_id: raft.leader_id,
            leader_ready: role == Role::Leader
                && self.term_start.is_some_and(|s| self.applied >= s),
            commit: raft.raft_log.committed,
            applied: self.applied,
            first_index: self.raw.store().first(),
            last_index: raft.raft_log.last_index(),
            snapshot_index: self.raw.store().snapshot_index(),
            peers,
            last_snapshot: self.last_snapshot,
            snapshots_taken: self.snapshots_taken,
        }
    }
}
