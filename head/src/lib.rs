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
//! - HEAD-6: `Head::commit` goes through the Raft log (`replication.rs`,
//!   `tpuray-replica`) and returns once the command is applied here; every head
//!   applies every committed command in log order.
//! - HEAD-7: only the serving leader answers `HeadService`; the others answer
//!   `UNAVAILABLE` naming the leader (`GetReplicaStatus` and `GetHeadInfo` excepted).
//! - HEAD-8: soft state belongs to one leadership term; a new leader restarts the
//!   death clocks, waits for node reports before placing, and reconciles actor
//!   workers and bundles with the agents.
//! - METRICS-1..3 (`metrics.rs`): `/metrics` needs no token and only reads; a series
//!   once exported is exported on every later scrape (0 when its count went away);
//!   cluster series come from the serving leader only.
//! - HEAD-12: a driver job whose driver process is gone ends (`drivers.rs`).
//! - HEAD-13: a heartbeat reply carries the cluster view as the changes since the
//!   version the agent holds (`view.rs`); the whole view only to an agent holding none,
//!   one from another leadership term, or one too old.
//! - The head is never on the task hot path: it places actors and tracks
//!   membership; tasks go through node-agent leases.
//!
//! Threads: RPCs, the death monitor and placement run on the tokio runtime the
//! caller provides; the Raft log runs on its own thread (which applies commands
//! and does the blocking `sled` I/O); no user code runs in the head process.

mod actors;
pub mod convert;
mod dashboard;
pub mod drivers;
pub mod http;
pub mod jobs;
mod liveness;
pub mod logs_api;
pub mod metrics;
mod nodes;
pub mod placement_groups;
pub mod replication;
mod serve_api;
pub mod server;
mod service;
pub mod slices;
pub mod state;
pub mod state_api;
pub mod submissions;
pub mod timeline;
mod view;

pub use http::DashboardConfig;
pub use server::{Head, HeadConfig, Ready, ServeError, serve};
