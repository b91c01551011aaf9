//! The node agent's Prometheus endpoint: `/metrics` (and Ray's agent health routes
//! `/api/healthz`, `/api/local_raylet_healthz`, and Kubernetes' `/healthz`, `/readyz`)
//! on `--metrics-export-port`.
//!
//! What it exports, with Ray's names where Ray has the metric: the node's logical
//! resources (`ray_resources{Name,State}`), its object store (`ray_object_store_memory
//! {Location,ObjectState}`, spilled bytes included), the host (`ray_node_cpu_utilization`,
//! `ray_node_mem_*`, `ray_node_disk_*`, `ray_node_network_*`), the processes of the node
//! (`ray_component_*`: the agent as `raylet`, workers as `ray::<what they run>`), the
//! tasks and actor calls running in its workers (`ray_tasks{Source="executor"}`) and its
//! actors (`ray_actors{Source="executor"}`), and what Ray lacks (`tpuray_workers` by
//! state, `tpuray_tpu_chip_*` per chip). User metrics (`tpuray.util.metrics`) recorded in
//! this node's workers and drivers come in through `ReportMetrics` (METRICS-4) and are
//! exported here as Ray names them (`ray_<name>`, counters `ray_<name>_total`).
//!
//! - METRICS-1: no token; read-only.
//! - METRICS-2: a series once exported stays, as 0 when its count went away.
//! - METRICS-4: reports carry each process's totals, not increases: a report that
//!   arrives twice counts once; a counter of a process that exited keeps its last total
//!   (folded into the series when the process is gone), so counters never go back.
//! - METRICS-5: host rates (CPU, network, disk) and process CPU come from a sampler that
//!   reads `/proc` every [`sample_interval`] on a blocking thread; every scrape reads
//!   the newest sample, so two Prometheus servers scraping at different times see the
//!   same values (ray#63131).
//!
//! Scrapes run on a blocking thread (they read the object store's folder).
//!
//! Here: the state (`AgentMetrics`, what processes reported and the newest sample) and
//! the HTTP routes. By seam: `reports.rs` takes in the processes' reports (METRICS-4),
//! `sampler.rs` reads `/proc` (METRICS-5), `exposition.rs` renders a scrape's text.

mod exposition;
mod reports;
mod sampler;
#[cfg(test)]
mod tests;

pub use exposition::{exported_name, render};
pub use sampler::{sample_interval, spawn_sampler};

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, OnceLock};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use tpuray_proto::metrics::{HostRates, HostStat, ProcStat, Sampler, SeenSeries};
use tpuray_proto::pb;
use tpuray_scheduler::ResourceSet;

use crate::agent::Agent;

/// At most this many series of user metrics per node; further ones are dropped and
/// counted in `tpuray_metrics_dropped_series_total`.
pub const MAX_USER_SERIES: usize = 10_000;

/// A worker of this node as `/metrics` needs it (copied under the agent's lock).
#[derive(Clone, Debug)]
pub struct WorkerView {
    pub worker_id: String,
    pub pid: u32,
    pub job_id: String,
    /// STARTING, IDLE, LEASED or ACTOR.
    pub state: &'static str,
    pub tpu_chips: Vec<u32>,
}

/// What `/metrics` reads from the agent (`Agent::metrics_view`).
#[derive(Clone, Debug, Default)]
pub struct AgentView {
    pub total: ResourceSet,
    pub available: ResourceSet,
    pub workers: Vec<WorkerView>,
    /// This host's chip count, when it has TPU chips.
    pub tpu_chips: Option<u32>,
}

/// One process's user-metric series and running tasks, as it last reported them.
#[derive(Debug, Default)]
struct Reporter {
    pid: u32,
    job_id: String,
    running: Vec<pb::RunningTasks>,
    actor_class: String,
}

/// A series of a user metric: per reporting process, its latest report; plus what
/// processes that exited left (METRICS-4).
#[derive(Debug, Default)]
struct UserSeries {
    /// Counter totals, gauge values, or histogram (buckets, sum, count) per process.
    by_process: HashMap<String, Point>,
    retired: Point,
    /// The process that set a gauge last (a gauge is its last value, node-wide).
    last_writer: String,
}

#[derive(Clone, Debug, Default)]
struct Point {
    value: f64,
    buckets: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Point {
    fn add(&mut self, o: &Point) {
        self.value += o.value;
        if self.buckets.len() < o.buckets.len() {
            self.buckets.resize(o.buckets.len(), 0);
        }
        for (a, b) in self.buckets.iter_mut().zip(&o.buckets) {
            *a += b;
        }
        self.sum += o.sum;
        self.count += o.count;
    }
}

#[derive(Debug, Default)]
struct Reports {
    /// Every (job, task name, is retry) reported running and (job, actor class) reported
    /// hosted on this node, so their series read 0 afterwards even when no scrape saw
    /// them non-zero (METRICS-2; bounded by [`MAX_USER_SERIES`]).
    running_seen: std::collections::BTreeSet<(String, String, bool)>,
    actors_seen: std::collections::BTreeSet<(String, String)>,
    defs: HashMap<String, pb::MetricDef>,
    reporters: HashMap<String, Reporter>,
    series: BTreeMap<(String, Vec<String>), UserSeries>,
    dropped_series: u64,
}

/// The newest `/proc` sample (METRICS-5).
#[derive(Clone, Debug, Default)]
struct Sample {
    host: HostStat,
    rates: HostRates,
    /// pid → (stat, CPU percent since the previous sample).
    procs: HashMap<u32, (ProcStat, f64)>,
    disk: Option<(u64, u64)>,
}

/// The agent's metrics state (a field of [`Agent`]).
#[derive(Default)]
pub struct AgentMetrics {
    reports: Mutex<Reports>,
    sample: Mutex<Sample>,
    sampler: Mutex<Sampler>,
    seen: Mutex<SeenSeries>,
    /// `session_<cluster id>`, known once the node registered.
    session: OnceLock<String>,
    /// The bound port of `/metrics` (0 before it listens).
    pub port: OnceLock<u16>,
}

impl std::fmt::Debug for AgentMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentMetrics").finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl AgentMetrics {
    /// Sets the session name (`session_<cluster id>`, as the head's `/api/version`).
    pub fn set_cluster_id(&self, cluster_id: &str) {
        let _ = self.session.set(format!("session_{cluster_id}"));
    }
}

/// The agent's HTTP routes.
pub fn router(agent: Arc<Agent>) -> Router {
    Router::new()
        .route("/metrics", get(scrape))
        // Ray's agent health routes (DESIGN.md §13: no token).
        .route("/api/healthz", get(|| async { "success" }))
        .route("/api/local_raylet_healthz", get(|| async { "success" }))
        // Kubernetes probes (DESIGN.md §13, no token): the process answers; the node is
        // registered with the head and not draining (AGENT-16).
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .with_state(agent)
}

async fn readyz(State(agent): State<Arc<Agent>>) -> Response {
    use std::sync::atomic::Ordering;
    if agent.is_draining() {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready: the node is draining\n").into_response()
    } else if !agent.joined.load(Ordering::SeqCst) {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready: the node has not joined the head yet\n")
            .into_response()
    } else {
        (StatusCode::OK, "ready\n").into_response()
    }
}

async fn scrape(State(agent): State<Arc<Agent>>) -> Response {
    match tokio::task::spawn_blocking(move || render(&agent)).await {
        Ok(text) => {
            (StatusCode::OK, [(header::CONTENT_TYPE, tpuray_proto::metrics::CONTENT_TYPE)], text)
                .into_response()
        }
        Err(e) => {
            (StatusCode::INTERNAL_SERVER_ERROR, format!("metrics failed: {e}\n")).into_response()
        }
    }
}
