//! The one trait every node provider implements (`local`, `kubernetes`).
//!
//! Blocking: the autoscaler calls these on its own thread, one at a time.

use anyhow::Result;

use super::config::NodeType;
use super::decide::InstanceView;

/// Starts and stops instances: one host of a CPU type, every host of a slice together.
pub trait Provider: Send {
    /// What instance ids start with (Kubernetes: the cluster's name, since objects are
    /// named by them).
    fn id_prefix(&self) -> String {
        String::new()
    }
    /// Starts every host of `instance` (AUTOSCALE-1: a slice's hosts together, named
    /// `instance`). `now_ms` is recorded as its launch time.
    fn launch(&mut self, t: &NodeType, instance: &str, now_ms: u64) -> Result<()>;
    /// Stops every host of `instance` (unknown ids are ignored).
    fn terminate(&mut self, instance: &str) -> Result<()>;
    /// The instances it runs, each with why it lost a host when it did.
    fn instances(&mut self) -> Result<Vec<InstanceView>>;
    /// The head is stopping: stop everything started, and return once it has.
    fn shutdown(&mut self);
}
