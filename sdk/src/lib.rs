//! tpuray's Rust SDK and core worker: the code that drivers and worker
//! processes of both languages share (DESIGN.md §1, §8).
//!
//! - [`worker`]: the worker-process side: registers with its node agent and
//!   serves `WorkerService`; exits when its node agent dies (CORE-1).
//! - [`driver`]: the driver side: joins a cluster as a job and reads the
//!   cluster's nodes and resources.
//!
//! Tasks, objects and actors arrive with the core-worker issue; this crate
//! is where they live.

pub mod driver;
pub mod worker;

pub use driver::{Cluster, InitError, NodeSummary, init};
