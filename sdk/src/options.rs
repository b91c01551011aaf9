//! Options for tasks and actors, with Ray's defaults: a task needs 1 CPU and
//! is retried 3 times on worker death; an actor needs 1 CPU to be placed and
//! none while it runs, and is not restarted (DESIGN.md §3).

use std::collections::BTreeMap;

/// Where to run.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum Scheduling {
    /// Pack, then spread (Ray's default hybrid policy).
    #[default]
    Default,
    Spread,
    /// Run on this node (`soft`: elsewhere when it cannot).
    NodeAffinity {
        node_id: String,
        soft: bool,
    },
    /// Run inside bundle `bundle_index` of a placement group (-1: any of its bundles), using
    /// the resources the bundle reserved (Ray's `PlacementGroupSchedulingStrategy`).
    PlacementGroup {
        placement_group_id: String,
        bundle_index: i32,
    },
}

impl Scheduling {
    /// Inside `pg`, bundle `bundle_index` (-1: any bundle).
    pub fn placement_group(pg: &crate::PlacementGroup, bundle_index: i32) -> Scheduling {
        Scheduling::PlacementGroup { placement_group_id: pg.id().to_string(), bundle_index }
    }

    /// The wire form.
    pub fn to_proto(&self) -> tpuray_proto::pb::SchedulingStrategy {
        use tpuray_proto::convert::{placement_group_to_proto, strategy_to_proto};
        use tpuray_scheduler::Strategy;
        match self {
            Scheduling::Default => strategy_to_proto(&Strategy::Default),
            Scheduling::Spread => strategy_to_proto(&Strategy::Spread),
            Scheduling::NodeAffinity { node_id, soft } => {
                strategy_to_proto(&Strategy::NodeAffinity { node: node_id.clone(), soft: *soft })
            }
            Scheduling::PlacementGroup { placement_group_id, bundle_index } => {
                placement_group_to_proto(placement_group_id, *bundle_index)
            }
        }
    }
}

/// Options of a remote function call.
#[derive(Clone, Debug, PartialEq)]
pub struct TaskOptions {
    /// CPUs (default 1).
    pub num_cpus: f64,
    pub num_gpus: f64,
    /// Other resources, e.g. `{"special": 1}`.
    pub resources: BTreeMap<String, f64>,
    /// Retries when the worker or node dies (default 3; -1: forever).
    pub max_retries: i32,
    /// Retry also when the function itself fails.
    pub retry_exceptions: bool,
    pub scheduling: Scheduling,
    /// Node label selector: `{"zone": "a"}`, `"!a"`, `"in(a,b)"` (Ray's syntax).
    pub label_selector: BTreeMap<String, String>,
    /// Display name (default: the function's path).
    pub name: Option<String>,
    /// Return objects the task produces (default 1; Ray's `num_returns`).
    pub num_returns: u32,
    /// The runtime environment's key in the KV namespace `runtime_env` ("" for none): the
    /// node agent starts the task's worker with it (environment variables, working dir).
    pub runtime_env_hash: String,
}

impl Default for TaskOptions {
    fn default() -> Self {
        Self {
            num_cpus: 1.0,
            num_gpus: 0.0,
            resources: BTreeMap::new(),
            max_retries: 3,
            retry_exceptions: false,
            scheduling: Scheduling::Default,
            label_selector: BTreeMap::new(),
            name: None,
            num_returns: 1,
            runtime_env_hash: String::new(),
        }
    }
}

impl TaskOptions {
    /// Adds one custom resource.
    pub fn resource(mut self, name: &str, amount: f64) -> Self {
        self.resources.insert(name.to_string(), amount);
        self
    }
    pub fn num_cpus(mut self, n: f64) -> Self {
        self.num_cpus = n;
        self
    }
    pub fn max_retries(mut self, n: i32) -> Self {
        self.max_retries = n;
        self
    }
    pub fn scheduling(mut self, s: Scheduling) -> Self {
        self.scheduling = s;
        self
    }
}

/// Options of an actor.
#[derive(Clone, Debug, PartialEq)]
pub struct ActorOptions {
    /// CPUs held while the actor runs; `None`: 1 to place it, 0 while it runs.
    pub num_cpus: Option<f64>,
    pub num_gpus: f64,
    pub resources: BTreeMap<String, f64>,
    /// A name makes the actor findable with `get_actor`.
    pub name: Option<String>,
    pub namespace: Option<String>,
    /// Keep the actor after its job ends.
    pub detached: bool,
    /// Restarts after its process or node dies (-1: forever; default 0).
    pub max_restarts: i64,
    /// Calls executed at once (default 1: strictly in order per caller).
    pub max_concurrency: u32,
    pub scheduling: Scheduling,
    pub label_selector: BTreeMap<String, String>,
    /// Return the existing actor with this name instead of failing.
    pub get_if_exists: bool,
    /// As [`TaskOptions::runtime_env_hash`].
    pub runtime_env_hash: String,
    /// Times a call is sent again when the actor dies while running it and restarts
    /// (Ray's `max_task_retries`; -1: forever; default 0).
    pub max_task_retries: i32,
}

impl Default for ActorOptions {
    fn default() -> Self {
        Self {
            num_cpus: None,
            num_gpus: 0.0,
            resources: BTreeMap::new(),
            name: None,
            namespace: None,
            detached: false,
            max_restarts: 0,
            max_concurrency: 1,
            scheduling: Scheduling::Default,
            label_selector: BTreeMap::new(),
            get_if_exists: false,
            runtime_env_hash: String::new(),
            max_task_retries: 0,
        }
    }
}
