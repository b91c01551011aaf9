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
    /// The task's worker exits after running this many tasks of the function (Ray's
    /// `max_calls`: reclaims what a library leaks, GPU memory say; 0: no limit).
    pub max_calls: u32,
    /// Tasks and actors this task creates without a scheduling strategy go to its
    /// placement group, any bundle, and capture theirs in turn (Ray's
    /// `placement_group_capture_child_tasks`).
    pub capture_child_tasks: bool,
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
            max_calls: 0,
            capture_child_tasks: false,
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
    /// Calls from this process to the actor that may be unfinished at once: one more
    /// is refused at submission with [`crate::Error::PendingCallsLimitExceeded`] (Ray's
    /// `max_pending_calls`; -1, the default: no limit).
    pub max_pending_calls: i32,
    /// Concurrency groups (Ray's `concurrency_groups`): each name and how many of its
    /// calls run at once, each group with executor threads of its own; calls in no
    /// named group share the default group of `max_concurrency`.
    pub concurrency_groups: BTreeMap<String, u32>,
    /// The group each method runs in when its call names none (Ray's
    /// `@ray.method(concurrency_group=...)`); every group named must be defined.
    pub method_groups: BTreeMap<String, String>,
    /// As [`TaskOptions::capture_child_tasks`], for the actor's methods.
    pub capture_child_tasks: bool,
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
            max_pending_calls: -1,
            concurrency_groups: BTreeMap::new(),
            method_groups: BTreeMap::new(),
            capture_child_tasks: false,
        }
    }
}

/// Options of one actor method call (Ray's `.options(...)` on a method, over the
/// method's `@ray.method` options and the handle's).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CallOptions {
    /// The concurrency group the call runs in ("": the method's, else the default).
    pub concurrency_group: String,
    /// Overrides the handle's `max_task_retries` for this call.
    pub max_task_retries: Option<i32>,
    /// Retry the call when the method raises (Ray's `retry_exceptions`), up to its
    /// `max_task_retries`.
    pub retry_exceptions: bool,
}
