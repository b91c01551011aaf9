//! tpuray's replicated log: tikv's `raft` crate (`RawNode`) over a narrow storage trait
//! of our own, driving a deterministic state machine. The head puts its
//! `StateMachine` under it; one head is a group of one voter on the same code path.
//!
//! - [`kv`]: the storage trait ([`kv::KvStore`]) with a `sled` implementation and an
//!   in-memory twin that pass the same test suite.
//! - [`log`]: the Raft log, hard state and snapshots over a [`kv::KvStore`].
//! - [`node`]: one replica's Ready handling, without clocks, sockets or threads (the
//!   simulated-network tests drive it directly).
//! - [`driver`]: a [`node::Node`] owned by one OS thread, with a wall-clock tick.
//!
//! Invariants:
//! - RAFT-1: one thread owns the `RawNode` and handles each Ready in the documented
//!   order, LightReady included (a one-voter group applies a command in the same round
//!   that persists it).
//! - RAFT-2: entries and hard state of a Ready are written in one atomic batch and
//!   flushed before its persisted messages are sent or `advance` is called; a storage
//!   failure stops the replica.
//! - RAFT-3: every committed entry is applied once, in index order, on every replica;
//!   a proposal is answered with the machine's output only when its own entry (matched
//!   by a per-incarnation context) is applied; otherwise it is answered with an error
//!   and its client retries (with the same request id, so the retry applies once).
//! - RAFT-4: snapshots are taken at an applied index; compaction never passes the
//!   snapshot, so the log stays bounded (`snapshot_every` + `keep_after_snapshot`).
//! - RAFT-5: a restarted replica restores its machine from the stored snapshot and
//!   replays the committed entries after it; nothing else of the machine is stored.
//! - Membership is fixed at start (the voters of `--head-peers`): no conf changes.

pub mod driver;
pub mod kv;
pub mod log;
pub mod logger;
pub mod node;

pub use driver::{Replica, Reply, Transport};
pub use kv::{KvStore, MemKv, SledKv, StoreError};
pub use node::{
    Effects, Machine, Node, NodeConfig, NodeError, NodeStatus, ProposeError, Role, SnapshotStats,
};
pub use raft::eraftpb::{Message, MessageType};

/// Encodes a Raft message for the wire (our own proto carries it as bytes).
pub fn encode_message(m: &Message) -> Vec<u8> {
    protobuf::Message::write_to_bytes(m).expect("raft messages always encode")
}

/// Decodes a Raft message from the wire.
///
/// # Errors
/// A message when the bytes are not a Raft message.
pub fn decode_message(b: &[u8]) -> Result<Message, String> {
    <Message as protobuf::Message>::parse_from_bytes(b).map_err(|e| e.to_string())
}
