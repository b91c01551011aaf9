//! The tpuray head: cluster membership, jobs, actors, KV and the state-change
//! stream, served over gRPC (`HeadService`).
//!
//! Invariants (numbered where the code enforces them):
//! - HEAD-1: durable state changes only through [`state::Command`]s applied by
//!   [`state::StateMachine`]; soft state (heartbeats, usage, demand) never does.
//! - HEAD-2: a mutating call retried with the same request id is applied once.
//! - HEAD-3: at most one live actor per (namespace, name).
//! - HEAD-4: a node that misses heartbeats for the death timeout is declared
//!   dead even if its TCP connection stays open (a frozen process).
//! - HEAD-5: a placement group is recorded as placed only after every agent
//!   involved prepared and committed its bundles (`placement_groups`).
//! - The head is never on the task hot path: it places actors and tracks
//!   membership; tasks go through node-agent leases.
//!
//! Threads: everything runs on the tokio runtime the caller provides; no
//! user code runs in the head process.

pub mod convert;
pub mod placement_groups;
pub mod replication;
pub mod server;
pub mod state;

pub use server::{Head, HeadConfig, ServeError, serve};
