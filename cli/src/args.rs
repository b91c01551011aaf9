//! Command-line arguments and dispatch.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::{job, k8s, logs, microbench, procs, serve, show, timeline};

#[derive(Parser, Debug)]
#[command(
    name = "tpuray",
    version,
    about = "tpuray: Ray-style tasks and actors with TPU slices as first-class resources"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Start a head node (--head) or join a node to a cluster (--address).
    Start(StartArgs),
    /// Show nodes, TPU slices host by host, resource usage and pending or infeasible demand.
    Status(AddressArg),
    /// List cluster state: nodes, actors, jobs, tasks, placement-groups or objects.
    List(ListArgs),
    /// One node, actor, job, task, placement group or object, every field (JSON).
    Get(GetArgs),
    /// Tasks by function and state, actors by class and state, or objects (Ray's
    /// `ray summary`, from the head's state API).
    Summary(SummaryArgs),
    /// Show each node's object store: capacity, used, spilled, pinned and its largest objects.
    Memory(MemoryArgs),
    /// Stop every tpuray process started on this machine (those in its process registry:
    /// `$TPURAY_REGISTRY_DIR`, default /tmp/tpuray/registry).
    Stop(StopArgs),
    /// Write the cluster's task events as Chrome trace JSON (open it in Perfetto).
    Timeline(TimelineArgs),
    /// Ray's `ray microbenchmark` cases (Python SDK; `--rust`: Rust SDK), after the floor.
    Microbenchmark(MicrobenchmarkArgs),
    /// `tpuray.serve` applications (Ray Serve's CLI): `serve status|run|deploy|build`.
    #[command(
        subcommand,
        after_help = "`run`, `deploy` and `build` are the Python SDK's (they import your \
                      application): `tpuray serve run --help`, `tpuray serve deploy --help` and \
                      `tpuray serve build --help` list their arguments."
    )]
    Serve(ServeCommand),
    /// Submit, stop, delete, or list jobs (Ray's `ray job`, through the head's Jobs REST API).
    #[command(subcommand)]
    Job(JobCommand),
    /// Kubernetes: `k8s manifests` prints a cluster's objects (GKE TPU node pools) as YAML.
    #[command(subcommand)]
    K8s(K8sCommand),
    /// Log files of the cluster's nodes (Ray's `ray logs`): `logs [cluster] [GLOB]` lists
    /// them (prints the file when one matches), `logs actor|task|worker|job` prints the
    /// log of one.
    Logs(LogsArgs),
    /// Certificates for mutual TLS (`--tls-*` on `tpuray start`): `tls make-ca` once,
    /// then `tls make-cert` for each host.
    #[command(subcommand)]
    Tls(TlsCommand),
    #[command(name = "_head", hide = true)]
    Head(HeadArgs),
    #[command(name = "_agent", hide = true)]
    Agent(AgentArgs),
    #[command(name = "_worker", hide = true)]
    Worker,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum AuthMode {
    Token,
    Disabled,
}

#[derive(Args, Debug, Clone)]
pub struct ResourceFlags {
    /// Logical CPUs to advertise (default: detected).
    #[arg(long, allow_negative_numbers = true)]
    pub num_cpus: Option<f64>,
    /// GPUs to advertise (default: 0).
    #[arg(long, allow_negative_numbers = true)]
    pub num_gpus: Option<f64>,
    /// Custom resources as JSON, e.g. '{"special": 1}'.
    #[arg(long)]
    pub resources: Option<String>,
    /// Node labels, e.g. zone=a,tier=gold.
    #[arg(long)]
    pub labels: Option<String>,
    /// Object store capacity in bytes (default: 30% of available memory).
    #[arg(long)]
    pub object_store_memory: Option<u64>,
    /// Memory for tasks and actors in bytes (default: 70% of available memory minus the object store).
    #[arg(long)]
    pub memory: Option<u64>,
}

impl ResourceFlags {
    pub fn options(&self) -> tpuray_worker::AgentOptions {
        tpuray_worker::AgentOptions {
            num_cpus: self.num_cpus,
            num_gpus: self.num_gpus,
            resources_json: self.resources.clone(),
            labels: self.labels.clone(),
            object_store_memory: self.object_store_memory,
            memory: self.memory,
            env: std::env::vars().collect(),
        }
    }

    pub fn to_args(&self) -> Vec<String> {
        let mut v = Vec::new();
        if let Some(x) = self.num_cpus {
            v.extend(["--num-cpus".into(), x.to_string()]);
        }
        if let Some(x) = self.num_gpus {
            v.extend(["--num-gpus".into(), x.to_string()]);
        }
        if let Some(x) = &self.resources {
            v.extend(["--resources".into(), x.clone()]);
        }
        if let Some(x) = &self.labels {
            v.extend(["--labels".into(), x.clone()]);
        }
        if let Some(x) = self.object_store_memory {
            v.extend(["--object-store-memory".into(), x.to_string()]);
        }
        if let Some(x) = self.memory {
            v.extend(["--memory".into(), x.to_string()]);
        }
        v
    }
}

#[derive(Args, Debug)]
#[command(group(clap::ArgGroup::new("mode").required(true).args(["head", "address"])))]
pub struct StartArgs {
    /// Start the head node of a new cluster.
    #[arg(long, conflicts_with = "address")]
    pub head: bool,
    /// Join the cluster whose head is at HOST:PORT[,HOST:PORT...].
    #[arg(long)]
    pub address: Option<String>,
    /// The head's port (with --head; default 6379, or with --head-peers the port of
    /// this head's own entry, which others may reach through a proxy).
    #[arg(long)]
    pub port: Option<u16>,
    /// This node's IPv4 address as other hosts reach it (default: for a head, the
    /// address of the interface holding the default route; for a node joining a
    /// cluster, the address of the interface that routes to its head; 127.0.0.1 when
    /// there is no such route). Servers advertising a loopback address listen on it
    /// alone, any other on every address of the host (NET-3).
    #[arg(long, env = "TPURAY_NODE_IP_ADDRESS")]
    pub node_ip_address: Option<String>,
    /// The node agent's port (default: any free port).
    #[arg(long, default_value_t = 0)]
    pub node_manager_port: u16,
    /// Root folder for session files and logs (Ray's `--temp-dir`; `RAY_TMPDIR` there).
    #[arg(long, env = "TPURAY_TEMP_DIR", default_value = "/tmp/tpuray")]
    pub temp_dir: PathBuf,
    /// Stay in the foreground until the started processes stop.
    #[arg(long)]
    pub block: bool,
    /// Cluster token auth (with --head): on by default.
    #[arg(long, value_enum, default_value_t = AuthMode::Token)]
    pub auth_mode: AuthMode,
    /// Every head of a replicated head, HOST:PORT,HOST:PORT,... (with --head). This head
    /// listens on the port of its own entry; start the heads together (a majority must
    /// be up before the cluster serves).
    #[arg(long)]
    pub head_peers: Option<String>,
    /// This head's 1-based position in --head-peers (default: the entry whose host is, or
    /// starts with, `$HOSTNAME.`, as a StatefulSet pod's name is).
    #[arg(long, requires = "head_peers")]
    pub head_id: Option<u64>,
    /// Start the head process only, no node agent (a head replica on a machine that
    /// runs no work, or a head restarted from its --head-data-dir).
    #[arg(long, requires = "head")]
    pub head_only: bool,
    /// Where the head keeps its Raft log and snapshots (default: a folder in the
    /// session folder). A head restarted with the same folder recovers its state.
    #[arg(long)]
    pub head_data_dir: Option<PathBuf>,
    /// Where the node's object store spills objects that do not fit in
    /// --object-store-memory (default: `spill` in the session folder).
    #[arg(long)]
    pub spill_dir: Option<PathBuf>,
    /// The head's HTTP server (Jobs REST API, health, later the dashboard): its port
    /// (with --head; default 8265, or a free port with a warning when 8265 is taken; a
    /// given port that is taken is an error; 0 picks a free port).
    #[arg(long, requires = "head")]
    pub dashboard_port: Option<u16>,
    /// The address the HTTP server binds (default: as the head's own server binds,
    /// NET-3: its address when that is a loopback one, else every address).
    #[arg(long, requires = "head")]
    pub dashboard_host: Option<String>,
    /// The port of this node's Prometheus endpoint (`/metrics`, and Ray's agent health
    /// routes `/api/healthz`, `/api/local_raylet_healthz`; default: a free port). The
    /// targets are listed in `<temp-dir>/session_latest/prom_metrics_service_discovery.json`.
    #[arg(long)]
    pub metrics_export_port: Option<u16>,
    /// On SIGTERM the node agent drains: it tells the head it leaves (the node is dead
    /// at once), takes no new leases and lets running tasks finish for up to this many
    /// seconds before it stops them (0: stop at once). The default, 25, fits Kubernetes'
    /// default terminationGracePeriodSeconds of 30 with 5 s to stop the workers.
    #[arg(long, value_name = "SECONDS", default_value_t = DEFAULT_DRAIN_GRACE_S)]
    pub drain_grace_period: u64,
    /// Run the autoscaler in the head (with --head): a cluster config in Ray's shape,
    /// YAML or JSON (`provider: {type: local | kubernetes}`, `idle_timeout_minutes`,
    /// `available_node_types`; README "Autoscaling"). Nodes it starts stop with the head.
    #[arg(long, value_name = "FILE", requires = "head")]
    pub autoscaling_config: Option<PathBuf>,
    /// Mutual TLS (TLS-1): this node's certificate (PEM, signed by --tls-ca; make one
    /// with `tpuray tls make-cert`). With --tls-key and --tls-ca, every server and client
    /// of this node's processes (head, agent, workers, object transfer, HTTP) uses TLS;
    /// every process of the cluster must (drivers and the CLI through TPURAY_TLS_*).
    #[arg(long, env = "TPURAY_TLS_CERT", value_name = "PEM")]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, env = "TPURAY_TLS_KEY", value_name = "PEM")]
    pub tls_key: Option<PathBuf>,
    /// The cluster's CA certificate (PEM): peers must present a certificate it signed.
    #[arg(long, env = "TPURAY_TLS_CA", value_name = "PEM")]
    pub tls_ca: Option<PathBuf>,
    #[command(flatten)]
    pub resources: ResourceFlags,
}

/// `--drain-grace-period`'s default in seconds (the manifests' terminationGracePeriodSeconds
/// is this plus [`crate::k8s::TERMINATION_MARGIN_S`]).
pub const DEFAULT_DRAIN_GRACE_S: u64 = crate::k8s::DRAIN_GRACE_S as u64;

#[derive(Subcommand, Debug)]
pub enum TlsCommand {
    /// Make a cluster CA: writes OUT/ca.pem (give it to every process as --tls-ca or
    /// TPURAY_TLS_CA) and OUT/ca-key.pem (keep it private; only make-cert needs it).
    MakeCa(MakeCaArgs),
    /// Make a certificate signed by the CA in --ca for one host: writes OUT/cert.pem and
    /// OUT/key.pem. It names every --host entry and localhost, 127.0.0.1 and ::1, and
    /// serves as both server and client certificate (clients verify the host they dial).
    MakeCert(MakeCertArgs),
}

#[derive(Args, Debug)]
pub struct MakeCaArgs {
    /// The folder to write ca.pem and ca-key.pem to (made if missing).
    #[arg(long)]
    pub out: PathBuf,
}

#[derive(Args, Debug)]
pub struct MakeCertArgs {
    /// The folder holding ca.pem and ca-key.pem (from `tpuray tls make-ca`).
    #[arg(long)]
    pub ca: PathBuf,
    /// The host's names and IP addresses, comma-separated (NAME[,IP...]): every address
    /// other processes dial it by.
    #[arg(long)]
    pub host: String,
    /// The folder to write cert.pem and key.pem to (made if missing).
    #[arg(long)]
    pub out: PathBuf,
}

#[derive(Args, Debug)]
pub struct AddressArg {
    /// Head address (default: the cluster `tpuray start` left on this machine).
    #[arg(long)]
    pub address: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ListKind {
    Nodes,
    Actors,
    Jobs,
    Tasks,
    /// Placement groups, TPU slice groups included.
    PlacementGroups,
    /// Objects in the alive nodes' stores, largest first.
    Objects,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Format {
    Table,
    Json,
}

#[derive(Args, Debug)]
pub struct ListArgs {
    pub kind: ListKind,
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
    /// Show at most this many entries, newest tasks first (0: all), counted after
    /// --filter.
    #[arg(long, default_value_t = 100)]
    pub limit: usize,
    /// Keep rows whose field KEY equals (`KEY=VALUE`) or differs from (`KEY!=VALUE`)
    /// VALUE, strings compared without case (Ray's rules); repeat for several.
    #[arg(long = "filter", value_name = "KEY=VALUE")]
    pub filters: Vec<String>,
    /// Every field of each row in the table (JSON always has them all).
    #[arg(long)]
    pub detail: bool,
    #[command(flatten)]
    pub address: AddressArg,
}

#[derive(Args, Debug)]
pub struct GetArgs {
    pub kind: ListKind,
    /// The id (`node_id`, `actor_id`, `job_id`, `task_id`, `placement_group_id`,
    /// `object_id`; a prefix of at least 6 characters is enough when it is unique).
    pub id: String,
    #[command(flatten)]
    pub address: AddressArg,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum SummaryKind {
    Tasks,
    Actors,
    Objects,
}

#[derive(Args, Debug)]
pub struct SummaryArgs {
    pub kind: SummaryKind,
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
    #[command(flatten)]
    pub address: AddressArg,
}

#[derive(Args, Debug)]
pub struct MemoryArgs {
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
    /// How many of each node's largest objects to show (0: all).
    #[arg(long, default_value_t = 10)]
    pub top: u32,
    #[command(flatten)]
    pub address: AddressArg,
}

#[derive(Args, Debug)]
pub struct TimelineArgs {
    /// Where to write the trace (default: <temp dir>/tpuray-timeline-<UTC time>.json).
    #[arg(long, short)]
    pub output: Option<PathBuf>,
    /// Only the tasks of this job id.
    #[arg(long)]
    pub job_id: Option<String>,
    #[command(flatten)]
    pub address: AddressArg,
}

/// `tpuray logs`: Ray 2.60's `ray logs` (`ray/util/state/state_cli.py`), whose bare
/// form `ray logs GLOB` is `ray logs cluster GLOB`. Ray's two-letter short flags (`-id`,
/// `-ip`, `-pid`) are spelled `--node-id`, `--node-ip`, `--pid` here.
#[derive(Args, Debug)]
#[command(args_conflicts_with_subcommands = true)]
pub struct LogsArgs {
    #[command(subcommand)]
    pub kind: Option<LogsKind>,
    #[command(flatten)]
    pub cluster: LogsClusterArgs,
}

#[derive(Subcommand, Debug)]
pub enum LogsKind {
    /// List the log files matching GLOB on a node (the head node's by default); print
    /// the file when exactly one matches.
    Cluster(LogsClusterArgs),
    /// The log of an actor's worker process.
    Actor(LogsActorArgs),
    /// The part of its worker's log that a task wrote.
    Task(LogsTaskArgs),
    /// The log of a worker process, by pid.
    Worker(LogsWorkerArgs),
    /// The driver log of a job submitted with `tpuray job submit`.
    Job(LogsJobArgs),
}

/// What every `tpuray logs` form takes.
#[derive(Args, Debug, Clone)]
pub struct LogsCommon {
    /// Head address (HOST:PORT, or the dashboard's http://HOST:PORT).
    #[arg(long)]
    pub address: Option<String>,
    /// Follow the log as it grows (until interrupted).
    #[arg(long, short = 'f')]
    pub follow: bool,
    /// Lines from the end to print; -1 for the whole file.
    #[arg(long, default_value_t = 1000, allow_negative_numbers = true)]
    pub tail: i64,
    /// Seconds between looks for new lines with --follow.
    #[arg(long, hide = true)]
    pub interval: Option<f64>,
    /// Seconds the head may take for each request (not for --follow's wait).
    #[arg(long, default_value_t = 30)]
    pub timeout: u64,
}

/// Which node (default: the head node).
#[derive(Args, Debug, Clone)]
pub struct LogsNode {
    /// The node's id (a unique prefix is enough).
    #[arg(long)]
    pub node_id: Option<String>,
    /// The node's IP address (the head node first when several share it).
    #[arg(long)]
    pub node_ip: Option<String>,
}

#[derive(Args, Debug, Clone)]
pub struct LogsClusterArgs {
    /// A glob over the log files' names (default *).
    #[arg(default_value = "*")]
    pub glob: String,
    #[command(flatten)]
    pub node: LogsNode,
    #[command(flatten)]
    pub common: LogsCommon,
    /// How to decode the log (utf-8, the one supported).
    #[arg(long, default_value = "utf-8")]
    pub encoding: String,
    /// Undecodable bytes: strict (an error), replace or ignore.
    #[arg(long, default_value = "strict")]
    pub encoding_errors: String,
}

#[derive(Args, Debug, Clone)]
pub struct LogsActorArgs {
    /// The actor's id.
    #[arg(long, short = 'a')]
    pub id: Option<String>,
    /// The actor's worker process id (with --node-id or --node-ip, default the head node).
    #[arg(long)]
    pub pid: Option<u32>,
    #[command(flatten)]
    pub node: LogsNode,
    #[command(flatten)]
    pub common: LogsCommon,
    /// The stderr file instead of stdout.
    #[arg(long)]
    pub err: bool,
}

#[derive(Args, Debug, Clone)]
pub struct LogsTaskArgs {
    /// The task's id.
    #[arg(long)]
    pub id: String,
    /// Which attempt (0 is the first).
    #[arg(long, short = 'a', default_value_t = 0)]
    pub attempt_number: u32,
    #[command(flatten)]
    pub common: LogsCommon,
    /// The stderr file instead of stdout.
    #[arg(long)]
    pub err: bool,
}

#[derive(Args, Debug, Clone)]
pub struct LogsWorkerArgs {
    /// The worker's process id.
    #[arg(long)]
    pub pid: u32,
    #[command(flatten)]
    pub node: LogsNode,
    #[command(flatten)]
    pub common: LogsCommon,
    /// The stderr file instead of stdout.
    #[arg(long)]
    pub err: bool,
}

#[derive(Args, Debug, Clone)]
pub struct LogsJobArgs {
    /// The submission id (`raysubmit_...`).
    #[arg(long)]
    pub id: String,
    #[command(flatten)]
    pub common: LogsCommon,
}

#[derive(Subcommand, Debug)]
pub enum ServeCommand {
    /// Applications, deployments and replica states that the serve controller reports.
    Status(ServeStatusArgs),
    /// Deploy `module:app` (or a config file) and block until Ctrl-C, as Ray's `serve
    /// run` (Python SDK; `tpuray serve run --help` lists its arguments).
    Run(PythonServeArgs),
    /// Deploy a config file's applications declaratively and return, as Ray's `serve
    /// deploy` (Python SDK; `tpuray serve deploy --help` lists its arguments).
    Deploy(PythonServeArgs),
    /// Print (or write) the config file that deploys import paths, as Ray's `serve build`
    /// (Python SDK; `tpuray serve build --help` lists its arguments).
    Build(PythonServeArgs),
}

/// The arguments of a `tpuray serve` verb that the Python SDK's console script runs
/// (`tpuray.serve._cli`) before this CLI sees them; this CLI only names the verb in its
/// help and refuses it when run without the Python SDK (the native binary).
#[derive(Args, Debug)]
#[command(disable_help_flag = true)]
pub struct PythonServeArgs {
    /// The verb's arguments (see the Python SDK's `--help` of the verb).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    pub args: Vec<String>,
}

#[derive(Args, Debug)]
pub struct ServeStatusArgs {
    /// Print the controller's JSON document instead of the YAML-ish summary.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub address: AddressArg,
}

/// `tpuray job ...`: Ray's `ray job` verbs and flags (`dashboard/modules/job/cli.py`).
#[derive(Subcommand, Debug)]
pub enum JobCommand {
    /// Submits a job to be run on the cluster; without --no-wait, streams its logs until
    /// it finishes and exits 1 if it failed. Example: `tpuray job submit -- python my_script.py --arg=val`.
    Submit(Box<JobSubmitArgs>),
    /// Queries for the current status of a job.
    Status(JobIdArgs),
    /// Gets the logs of a job (-f: follow them until the job ends).
    Logs(JobLogsArgs),
    /// Attempts to stop a job, then waits for it to exit (unless --no-wait).
    Stop(JobStopArgs),
    /// Lists all jobs and their information.
    List(JobCommonArgs),
    /// Deletes a job that ended, and its information (not its logs on disk).
    Delete(JobIdArgs),
}

/// Flags every `tpuray job` verb takes (Ray's `--address` and `add_common_job_options`).
#[derive(Args, Debug, Clone, Default)]
pub struct JobCommonArgs {
    /// The job server: http://HOST:DASHBOARD_PORT, or a head's HOST:PORT (default:
    /// RAY_API_SERVER_ADDRESS, RAY_ADDRESS, TPURAY_ADDRESS, then the cluster `tpuray
    /// start` left on this machine).
    #[arg(long)]
    pub address: Option<String>,
    /// Headers sent with every request, as a JSON object: '{"Authorization": "Bearer ..."}'
    /// (default: RAY_JOB_HEADERS).
    #[arg(long)]
    pub headers: Option<String>,
    /// Whether to verify the server's TLS certificate (true/false), or a file or folder
    /// of trusted certificates (this build talks plain http only).
    #[arg(long, default_value = "True")]
    pub verify: String,
}

#[derive(Args, Debug)]
pub struct JobIdArgs {
    /// The job's submission id.
    #[arg(value_name = "JOB_ID")]
    pub job_id: String,
    #[command(flatten)]
    pub common: JobCommonArgs,
}

#[derive(Args, Debug)]
pub struct JobLogsArgs {
    /// The job's submission id.
    #[arg(value_name = "JOB_ID")]
    pub job_id: String,
    /// Follow the logs (like `tail -f`) until the job ends.
    #[arg(short = 'f', long)]
    pub follow: bool,
    #[command(flatten)]
    pub common: JobCommonArgs,
}

#[derive(Args, Debug)]
pub struct JobStopArgs {
    /// The job's submission id.
    #[arg(value_name = "JOB_ID")]
    pub job_id: String,
    /// Return at once instead of waiting for the job to exit.
    #[arg(long)]
    pub no_wait: bool,
    #[command(flatten)]
    pub common: JobCommonArgs,
}

#[derive(Args, Debug, Default)]
pub struct JobSubmitArgs {
    /// DEPRECATED: use --submission-id.
    #[arg(long)]
    pub job_id: Option<String>,
    /// Submission id for the job (default: one is generated).
    #[arg(long)]
    pub submission_id: Option<String>,
    /// A local YAML (or JSON) file holding a runtime_env.
    #[arg(long, value_name = "FILE")]
    pub runtime_env: Option<PathBuf>,
    /// A runtime_env as JSON, e.g. '{"pip": ["requests"]}'.
    #[arg(long, value_name = "JSON")]
    pub runtime_env_json: Option<String>,
    /// The folder the job runs in (uploaded), or a URI of a .zip; overrides the
    /// runtime_env's working_dir.
    #[arg(long)]
    pub working_dir: Option<String>,
    /// Metadata to attach to the job, as a JSON object of strings.
    #[arg(long, value_name = "JSON")]
    pub metadata_json: Option<String>,
    /// CPUs to reserve for the entrypoint command (apart from its tasks and actors).
    #[arg(long)]
    pub entrypoint_num_cpus: Option<f64>,
    /// GPUs to reserve for the entrypoint command.
    #[arg(long)]
    pub entrypoint_num_gpus: Option<f64>,
    /// Memory in bytes to reserve for the entrypoint command.
    #[arg(long)]
    pub entrypoint_memory: Option<u64>,
    /// Custom resources to reserve for the entrypoint command, as JSON: '{"TPU": 4}'.
    #[arg(long, value_name = "JSON")]
    pub entrypoint_resources: Option<String>,
    /// Label selector for the entrypoint command's node, as JSON: '{"zone": "a"}'.
    #[arg(long, value_name = "JSON")]
    pub entrypoint_label_selector: Option<String>,
    /// Do not stream the logs and wait for the job to exit.
    #[arg(long)]
    pub no_wait: bool,
    #[command(flatten)]
    pub common: JobCommonArgs,
    /// The entrypoint command, after `--`: its words are joined as a shell would quote them.
    #[arg(required = true, trailing_var_arg = true, value_name = "ENTRYPOINT")]
    pub entrypoint: Vec<String>,
}

/// `tpuray k8s ...`.
#[derive(Subcommand, Debug)]
pub enum K8sCommand {
    /// Prints, on stdout only, the YAML of a cluster: the head StatefulSet (1 or 3, a PVC
    /// each), CPU workers, and one StatefulSet per TPU slice (one pod per host). Apply it
    /// with `kubectl apply -f -` after creating the Secret `<name>-auth-token` (key `token`).
    Manifests(K8sManifestsArgs),
}

#[derive(Args, Debug)]
pub struct K8sManifestsArgs {
    /// The cluster's name, the prefix of every object (a DNS label, at most 40 characters).
    #[arg(long)]
    pub name: String,
    /// Head replicas: 1, or 3 for a Raft group that survives the loss of one.
    #[arg(long, default_value_t = 1)]
    pub heads: u32,
    /// CPU-only node agent pods (4 CPUs, 16 GiB each).
    #[arg(long, default_value_t = 0)]
    pub cpu_workers: u32,
    /// A TPU slice shape and how many such slices, ACCELERATOR_TYPE:COUNT, as TPU.md
    /// writes types: v6e-16, v5litepod-8 (or v5e-8), v4-32, v5p-16; repeat for several.
    #[arg(long = "slice", value_name = "ACCELERATOR_TYPE:COUNT")]
    pub slices: Vec<String>,
    /// All slices form one multislice job: each gets the MEGASCALE_* environment.
    #[arg(long)]
    pub multislice: bool,
    /// The container image with `tpuray` on PATH (see the repository's Dockerfile).
    #[arg(long)]
    pub image: String,
    /// The namespace of every object.
    #[arg(long, default_value = "default")]
    pub namespace: String,
}

#[derive(Args, Debug)]
pub struct StopArgs {
    /// Kill with SIGKILL at once instead of stopping gracefully.
    #[arg(long)]
    pub force: bool,
}

#[derive(Args, Debug, Default)]
pub struct MicrobenchmarkArgs {
    /// Run the task, actor, object and placement group cases from the Rust SDK instead of
    /// the Python SDK's.
    #[arg(long)]
    pub rust: bool,
    /// One JSON object per case ({"name", "mean", "sd", "unit"}) instead of text lines.
    #[arg(long)]
    pub json: bool,
    /// A short run for trying things out: no idle pause, one trial of 0.5 s per case.
    #[arg(long)]
    pub quick: bool,
    /// Only the cases whose name contains PATTERN (Ray's TESTS_TO_RUN; a|b: either).
    #[arg(long, value_name = "PATTERN")]
    pub filter: Option<String>,
    /// Leave out the cases whose name contains PATTERN (Ray's TESTS_TO_SKIP; a|b: either).
    #[arg(long, value_name = "PATTERN")]
    pub skip: Option<String>,
    /// Idle seconds before each case (default 10 as Ray's; 0 with --quick).
    #[arg(long, value_name = "SECONDS")]
    pub warmup_sleep: Option<f64>,
    /// Timed trials per case (default 4 as Ray's; 1 with --quick).
    #[arg(long)]
    pub trials: Option<usize>,
    /// Seconds per trial (default 2 as Ray's; 0.5 with --quick).
    #[arg(long, value_name = "SECONDS")]
    pub trial_seconds: Option<f64>,
    /// The Python interpreter with tpuray installed (default: the one running this CLI
    /// under `python -m tpuray`, else python3).
    #[arg(long)]
    pub python: Option<String>,
    /// Do not measure the floor (loopback RPC, raw loopback TCP, memcpy).
    #[arg(long)]
    pub no_floor: bool,
    /// Measure a debug build anyway (refused by default: its figures are not tpuray's);
    /// TPURAY_ALLOW_DEBUG_BUILD=1 does the same.
    #[arg(long)]
    pub allow_debug_build: bool,
}

#[derive(Args, Debug)]
pub struct HeadArgs {
    #[arg(long)]
    pub listen: String,
    #[arg(long)]
    pub session_dir: PathBuf,
    #[arg(long)]
    pub ready_file: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t = AuthMode::Token)]
    pub auth_mode: AuthMode,
    /// Every head's address, comma-separated (empty: a lone head).
    #[arg(long, default_value = "")]
    pub head_peers: String,
    #[arg(long, default_value_t = 1)]
    pub head_id: u64,
    /// The Raft log's folder.
    #[arg(long)]
    pub data_dir: PathBuf,
    #[arg(long)]
    pub dashboard_port: Option<u16>,
    #[arg(long)]
    pub dashboard_host: Option<String>,
    /// The autoscaler's cluster config (checked by `tpuray start`).
    #[arg(long)]
    pub autoscaling_config: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct AgentArgs {
    #[arg(long)]
    pub address: String,
    #[arg(long)]
    pub listen: String,
    #[arg(long)]
    pub session_dir: PathBuf,
    #[arg(long)]
    pub ready_file: Option<PathBuf>,
    #[arg(long)]
    pub head_node: bool,
    /// Which head this head node's agent belongs to, for the registry (REG-2).
    #[arg(long, default_value = "")]
    pub head_of: String,
    /// The object store's spill folder (default: `<session dir>/spill`).
    #[arg(long)]
    pub spill_dir: Option<PathBuf>,
    /// The port of the node's Prometheus endpoint (0: a free port).
    #[arg(long, default_value_t = 0)]
    pub metrics_export_port: u16,
    /// Seconds running tasks may take to finish after SIGTERM (AGENT-16).
    #[arg(long, default_value_t = DEFAULT_DRAIN_GRACE_S)]
    pub drain_grace_period: u64,
    #[command(flatten)]
    pub resources: ResourceFlags,
}

pub fn dispatch(cli: Cli) -> Result<i32> {
    match cli.command {
        Command::Start(a) => procs::start(a),
        Command::Status(a) => show::status(&resolve_address(a.address)?),
        Command::List(a) => {
            let filters = show::parse_filters(&a.filters)?;
            let opts =
                show::ListOptions { format: a.format, limit: a.limit, filters, detail: a.detail };
            show::list(&resolve_address(a.address.address)?, a.kind, &opts)
        }
        Command::Get(a) => show::get(&resolve_address(a.address.address)?, a.kind, &a.id),
        Command::Summary(a) => {
            show::summary(&resolve_address(a.address.address)?, a.kind, a.format)
        }
        Command::Memory(a) => show::memory(&resolve_address(a.address.address)?, a.format, a.top),
        Command::Stop(a) => procs::stop(a.force),
        Command::Timeline(a) => {
            timeline::run(&resolve_address(a.address.address)?, a.output, a.job_id.as_deref())
        }
        Command::Serve(ServeCommand::Status(a)) => {
            serve::status(&resolve_address(a.address.address)?, a.json)
        }
        Command::Serve(ServeCommand::Run(_) | ServeCommand::Deploy(_) | ServeCommand::Build(_)) => {
            bail!(
                "`tpuray serve run|deploy|build` are the Python SDK's: run them with the `tpuray` \
                 command that `pip install tpuray` installs (this is the native binary, which \
                 has only `tpuray serve status`)"
            )
        }
        Command::Job(c) => job::cmd::run(c),
        Command::K8s(K8sCommand::Manifests(a)) => {
            let slices =
                a.slices.iter().map(|s| k8s::parse_slice(s)).collect::<Result<Vec<_>>>()?;
            let spec = k8s::ClusterSpec {
                name: a.name,
                namespace: a.namespace,
                image: a.image,
                heads: a.heads,
                cpu_workers: a.cpu_workers,
                slices,
                multislice: a.multislice,
            };
            let yaml = k8s::render(&spec)?;
            use std::io::Write;
            std::io::stdout().write_all(yaml.as_bytes())?;
            Ok(0)
        }
        Command::Logs(a) => logs::run(a),
        Command::Tls(TlsCommand::MakeCa(a)) => crate::tls::make_ca_cmd(&a.out),
        Command::Tls(TlsCommand::MakeCert(a)) => crate::tls::make_cert_cmd(&a.ca, &a.host, &a.out),
        Command::Microbenchmark(a) => {
            // A driver of a cluster for minutes (--rust): a peer that hangs up must fail
            // that connection, not kill the run.
            ignore_sigpipe();
            microbench::run(a)
        }
        Command::Head(a) => {
            ignore_sigpipe();
            procs::run_head(a)
        }
        Command::Agent(a) => {
            ignore_sigpipe();
            procs::run_agent(a)
        }
        Command::Worker => {
            ignore_sigpipe();
            tpuray::worker::run_worker().context("worker process")?;
            Ok(0)
        }
    }
}

/// Long-running processes ignore SIGPIPE (the native binary's `main` leaves it ignored
/// for every command; this also covers a CLI run from elsewhere, e.g. embedded with its
/// disposition changed): a vectored write to a peer that hung up would otherwise kill a
/// head or agent instead of failing that one connection.
fn ignore_sigpipe() {
    // SAFETY: setting a signal disposition has no memory-safety preconditions; it runs
    // before the process starts its runtimes.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_IGN);
    }
}

/// `--address`, else `TPURAY_ADDRESS`, else the cluster `tpuray start --head`
/// left on this machine.
pub fn resolve_address(given: Option<String>) -> Result<String> {
    if let Some(a) =
        given.or_else(|| std::env::var("TPURAY_ADDRESS").ok()).filter(|a| !a.is_empty())
    {
        return Ok(a);
    }
    match tpuray_worker::registry::current_cluster() {
        Some(c) => Ok(c.address),
        None => bail!(
            "no cluster found on this machine: start one with `tpuray start --head`, or pass --address HOST:PORT"
        ),
    }
}
