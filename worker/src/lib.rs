//! The tpuray node agent (`tpuray start --address ...`, and one on the head
//! node): advertises the node's resources and labels, keeps a pool of worker
//! processes, grants worker leases with spillback, starts actor workers for
//! the head, and heartbeats to the head from a thread of its own.
//!
//! See `agent/mod.rs` for the invariants (AGENT-1..8, and where the others are kept)
//! and `tpuray_proto::registry` for the machine-wide process registry (REG-1).

pub mod agent;
pub mod binaries;
pub mod detect;
pub mod jobs;
pub mod ledger;
pub mod logfiles;
pub mod metrics;
/// The machine-wide process registry, shared with drivers (`tpuray_proto::registry`).
pub use tpuray_proto::registry;
pub mod run;
pub mod runtime_env;

pub use agent::{Agent, AgentConfig};
pub use run::{
    AgentOptions, StartError, StoreOptions, build_resources, object_store_bytes, serve_agent,
};
