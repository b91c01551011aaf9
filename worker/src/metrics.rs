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

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use tpuray_proto::metrics::{
    Exposition, HostRates, HostStat, Labels, ProcStat, Sampler, SeenSeries, labels,
};
use tpuray_proto::pb;
use tpuray_scheduler::ResourceSet;

use crate::agent::Agent;

/// At most this many series of user metrics per node; further ones are dropped and
/// counted in `tpuray_metrics_dropped_series_total`.
pub const MAX_USER_SERIES: usize = 10_000;

/// How often the sampler reads `/proc` (`TPURAY_METRICS_SAMPLE_INTERVAL_MS`, default
/// 2000; Ray's reporter: 5 s).
pub fn sample_interval() -> Duration {
    crate::run::env_duration_ms("TPURAY_METRICS_SAMPLE_INTERVAL_MS", 2_000)
        .max(Duration::from_millis(100))
}

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

    /// Tasks and actor calls each reporting process (by pid) last said it runs.
    pub fn running_by_pid(&self) -> HashMap<u32, u32> {
        let r = lock(&self.reports);
        let mut out = HashMap::new();
        for rep in r.reporters.values() {
            let n: u32 = rep.running.iter().map(|t| t.count).sum();
            *out.entry(rep.pid).or_default() += n;
        }
        out
    }

    /// Takes one process's report (METRICS-4). Returns whether every definition its
    /// points name is known here.
    pub fn report(&self, req: pb::ReportMetricsRequest) -> bool {
        let mut r = lock(&self.reports);
        let r = &mut *r;
        for d in req.defs {
            r.defs.entry(d.name.clone()).or_insert(d);
        }
        for t in &req.running {
            if r.running_seen.len() < MAX_USER_SERIES {
                r.running_seen.insert((req.job_id.clone(), t.name.clone(), t.is_retry));
            }
        }
        if !req.actor_class.is_empty() && r.actors_seen.len() < MAX_USER_SERIES {
            r.actors_seen.insert((req.job_id.clone(), req.actor_class.clone()));
        }
        let rep = r.reporters.entry(req.worker_id.clone()).or_default();
        rep.pid = req.pid;
        rep.job_id = req.job_id;
        rep.running = req.running;
        rep.actor_class = req.actor_class;
        let mut known = true;
        for p in req.points {
            let Some(def) = r.defs.get(&p.name) else {
                known = false;
                continue;
            };
            let kind = pb::metric_def::Kind::try_from(def.kind).unwrap_or_default();
            let shape_ok = p.tag_values.len() == def.tag_keys.len()
                && (kind != pb::metric_def::Kind::Histogram
                    || p.bucket_counts.len() == def.boundaries.len() + 1);
            if !shape_ok {
                continue; // another process defined the name differently: first wins
            }
            let key = (p.name.clone(), p.tag_values.clone());
            if !r.series.contains_key(&key) && r.series.len() >= MAX_USER_SERIES {
                r.dropped_series += 1;
                continue;
            }
            let s = r.series.entry(key).or_default();
            s.by_process.insert(
                req.worker_id.clone(),
                Point { value: p.value, buckets: p.bucket_counts, sum: p.sum, count: p.count },
            );
            s.last_writer = req.worker_id.clone();
        }
        known
    }

    /// Folds the series of processes that are gone into what they left, and forgets
    /// those processes (METRICS-4).
    fn retire_gone(&self, alive: impl Fn(&str, u32) -> bool) {
        let mut r = lock(&self.reports);
        let gone: HashSet<String> = r
            .reporters
            .iter()
            .filter(|(id, rep)| !alive(id, rep.pid))
            .map(|(id, _)| id.clone())
            .collect();
        if gone.is_empty() {
            return;
        }
        r.reporters.retain(|id, _| !gone.contains(id));
        let defs = r.defs.clone();
        for ((name, _), s) in r.series.iter_mut() {
            let gauge = defs.get(name).map(|d| d.kind) == Some(pb::metric_def::Kind::Gauge as i32);
            for id in &gone {
                if let Some(p) = s.by_process.remove(id) {
                    if gauge {
                        if s.last_writer == *id {
                            s.retired = p; // a gauge keeps its last value (as Ray's)
                        }
                    } else {
                        s.retired.add(&p);
                    }
                }
            }
        }
    }

    /// Reads `/proc` for the host and `pids` (METRICS-5). Blocking.
    pub fn sample(&self, pids: &[u32], disk_path: &std::path::Path) {
        let now = Instant::now();
        let host = tpuray_proto::metrics::host_stat();
        let mut sampler = lock(&self.sampler);
        let (host, rates) = sampler.host(now, host);
        let mut procs = HashMap::new();
        for &pid in pids {
            if let Some(st) = tpuray_proto::metrics::proc_stat(pid) {
                let cpu = sampler.process(now, pid, &st);
                procs.insert(pid, (st, cpu));
            }
        }
        sampler.retain_processes(&procs.keys().copied().collect());
        drop(sampler);
        *lock(&self.sample) =
            Sample { host, rates, procs, disk: tpuray_proto::metrics::disk_usage(disk_path) };
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

/// Runs the sampler until the process exits (METRICS-5).
pub fn spawn_sampler(agent: Arc<Agent>) {
    tokio::spawn(async move {
        let every = sample_interval();
        loop {
            let a = Arc::clone(&agent);
            let _ = tokio::task::spawn_blocking(move || {
                let mut pids: Vec<u32> = a.metrics_view().workers.iter().map(|w| w.pid).collect();
                pids.push(std::process::id());
                a.metrics.sample(&pids, &a.config.session_dir);
            })
            .await;
            tokio::time::sleep(every).await;
        }
    });
}

fn pid_alive(pid: u32) -> bool {
    pid != 0 && std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// The text of one scrape. Blocking (reads the store's folder).
pub fn render(agent: &Agent) -> String {
    let view = agent.metrics_view();
    let m = &agent.metrics;
    let live: HashSet<&str> = view.workers.iter().map(|w| w.worker_id.as_str()).collect();
    // A reporter is a worker of this agent, or a driver whose process still runs.
    m.retire_gone(|id, pid| live.contains(id) || pid_alive(pid));
    let session = m.session.get().cloned().unwrap_or_else(|| "session_unknown".into());
    let ip = agent
        .config
        .advertise_address
        .rsplit_once(':')
        .map_or(agent.config.advertise_address.clone(), |(h, _)| h.to_string());
    let mut e = Exposition::new(labels(&[
        ("SessionName", &session),
        ("Version", env!("CARGO_PKG_VERSION")),
        ("NodeAddress", &ip),
    ]));
    let mut seen = lock(&m.seen);
    let seen = &mut *seen;
    resources(&mut e, seen, &view);
    store(&mut e, &agent.config.store);
    let sample = lock(&m.sample).clone();
    let head = agent.config.is_head_node;
    node(&mut e, &sample, &ip, head);
    let reports = lock(&m.reports);
    executor(&mut e, seen, &view, &reports);
    components(&mut e, seen, &view, &reports, &sample, &ip);
    user_metrics(&mut e, &reports);
    drop(reports);
    workers(&mut e, &view);
    tpu(&mut e, seen, &view, &agent.config.labels);
    e.encode()
}

fn resources(e: &mut Exposition, seen: &mut SeenSeries, v: &AgentView) {
    let mut cur = BTreeMap::new();
    for (name, total) in v.total.iter() {
        let avail = v.available.get(name).to_f64();
        let used = (total.to_f64() - avail).max(0.0);
        cur.insert(labels(&[("Name", name), ("State", "AVAILABLE")]), avail);
        cur.insert(labels(&[("Name", name), ("State", "USED")]), used);
    }
    e.gauges_remembered(
        seen,
        "ray_resources",
        "Logical Ray resources broken per state {AVAILABLE, USED}",
        cur,
    );
}

fn store(e: &mut Exposition, store: &tpuray_objectstore::LocalStore) {
    let Ok(u) = store.usage_top(0) else { return };
    let help = "Object store memory by various sub-kinds on this node";
    let sealed = u.used_bytes.saturating_sub(u.writing_bytes) as f64;
    for (loc, st, v) in [
        ("MMAP_SHM", "SEALED", sealed),
        ("MMAP_SHM", "UNSEALED", u.writing_bytes as f64),
        ("SPILLED", "SEALED", u.spilled_bytes as f64),
    ] {
        e.gauge(
            "ray_object_store_memory",
            help,
            &labels(&[("Location", loc), ("ObjectState", st)]),
            v,
        );
    }
    let cap = u.capacity_bytes.map_or(0.0, |c| c as f64);
    e.gauge(
        "tpuray_object_store_capacity_bytes",
        "The store's capacity in memory (0: unlimited)",
        &[],
        cap,
    );
    e.gauge(
        "tpuray_object_store_pinned_bytes",
        "Bytes of objects mapped by a reader",
        &[],
        u.pinned_bytes as f64,
    );
    e.gauge(
        "tpuray_object_store_pooled_bytes",
        "Freed objects' memory kept for reuse (OBJ-9)",
        &[],
        u.pooled_bytes as f64,
    );
    for (loc, n) in [("MMAP_SHM", u.object_count), ("SPILLED", u.spilled_count)] {
        e.gauge(
            "tpuray_object_store_objects",
            "Sealed objects by location",
            &labels(&[("Location", loc)]),
            n as f64,
        );
    }
}

fn node(e: &mut Exposition, s: &Sample, ip: &str, head: bool) {
    let l = labels(&[
        ("ip", ip),
        ("IsHeadNode", if head { "true" } else { "false" }),
        ("RayNodeType", if head { "head" } else { "worker" }),
    ]);
    let h = &s.host;
    let used = h.mem_total.saturating_sub(h.mem_available) as f64;
    let mut g = |name: &str, help: &str, v: f64| e.gauge(name, help, &l, v);
    g("ray_node_cpu_utilization", "Total CPU usage on a ray node (percent)", s.rates.cpu_percent);
    g("ray_node_cpu_count", "Total CPUs available on a ray node", h.cpu_count as f64);
    g("ray_node_mem_used", "Memory usage on a ray node", used);
    g("ray_node_mem_available", "Memory available on a ray node", h.mem_available as f64);
    g("ray_node_mem_total", "Total memory on a ray node", h.mem_total as f64);
    g("ray_node_mem_used_host", "Host memory usage on a ray node", used);
    g("ray_node_mem_total_host", "Total host memory on a ray node", h.mem_total as f64);
    g("ray_node_mem_shared_bytes", "Total shared memory usage on a ray node", h.mem_shared as f64);
    if let Some((cur, max)) = h.cgroup_mem {
        g("ray_node_cgroup_mem_used", "Container memory usage on a ray node", cur as f64);
        g("ray_node_cgroup_mem_total", "Container memory limit on a ray node", max as f64);
    }
    if let Some((used, free)) = s.disk {
        g("ray_node_disk_usage", "Total disk usage (bytes) on a ray node", used as f64);
        g("ray_node_disk_free", "Total disk free (bytes) on a ray node", free as f64);
        let pct = if used + free > 0 { 100.0 * used as f64 / (used + free) as f64 } else { 0.0 };
        g(
            "ray_node_disk_utilization_percentage",
            "Total disk utilization (percentage) on a ray node",
            pct,
        );
    }
    g("ray_node_disk_io_read", "Total read from disk", h.disk_read as f64);
    g("ray_node_disk_io_write", "Total written to disk", h.disk_written as f64);
    g("ray_node_disk_io_read_speed", "Disk read speed (bytes/sec)", s.rates.disk_read_speed);
    g("ray_node_disk_io_write_speed", "Disk write speed (bytes/sec)", s.rates.disk_write_speed);
    g("ray_node_network_received", "Total network received", h.net_received as f64);
    g("ray_node_network_sent", "Total network sent", h.net_sent as f64);
    g(
        "ray_node_network_receive_speed",
        "Network receive speed (bytes/sec)",
        s.rates.net_receive_speed,
    );
    g("ray_node_network_send_speed", "Network send speed (bytes/sec)", s.rates.net_send_speed);
}

fn task_labels(job: &str, name: &str, is_retry: bool) -> Labels {
    labels(&[
        ("State", "RUNNING"),
        ("Name", name),
        ("IsRetry", if is_retry { "1" } else { "0" }),
        ("Source", "executor"),
        ("JobId", job),
    ])
}

fn actor_labels(job: &str, class: &str, state: &str) -> Labels {
    labels(&[("State", state), ("Name", class), ("Source", "executor"), ("JobId", job)])
}

/// Running tasks and actors of this node's workers, as their processes reported them.
fn executor(e: &mut Exposition, seen: &mut SeenSeries, v: &AgentView, r: &Reports) {
    let live: HashSet<&str> = v.workers.iter().map(|w| w.worker_id.as_str()).collect();
    let mut tasks: BTreeMap<Labels, f64> =
        r.running_seen.iter().map(|(j, n, retry)| (task_labels(j, n, *retry), 0.0)).collect();
    let mut actors: BTreeMap<Labels, f64> = BTreeMap::new();
    for (j, class) in &r.actors_seen {
        for st in ["IDLE", "RUNNING_TASK"] {
            actors.insert(actor_labels(j, class, st), 0.0);
        }
    }
    for (id, rep) in &r.reporters {
        if !live.contains(id.as_str()) {
            continue; // workers of this agent only
        }
        let job = rep.job_id.as_str();
        for t in &rep.running {
            *tasks.entry(task_labels(job, &t.name, t.is_retry)).or_default() += f64::from(t.count);
        }
        if !rep.actor_class.is_empty() {
            let busy = !rep.running.is_empty();
            for (st, on) in [("IDLE", !busy), ("RUNNING_TASK", busy)] {
                *actors.entry(actor_labels(job, &rep.actor_class, st)).or_default() +=
                    f64::from(u8::from(on));
            }
        }
    }
    e.gauges_remembered(
        seen,
        "ray_tasks",
        "Current number of tasks in a particular state (executor side: running)",
        tasks,
    );
    e.gauges_remembered(
        seen,
        "ray_actors",
        "Current number of actors in a particular state",
        actors,
    );
}

/// What a worker process runs, as Ray names worker processes (`ray::IDLE`, ...).
fn component_name(w: &WorkerView, rep: Option<&Reporter>) -> String {
    match rep {
        Some(r) if !r.actor_class.is_empty() => format!("ray::{}", r.actor_class),
        Some(r) if !r.running.is_empty() => format!("ray::{}", r.running[0].name),
        _ if w.state == "STARTING" => "ray::STARTING".into(),
        _ => "ray::IDLE".into(),
    }
}

/// One component family's value from (cpu %, rss, shared, fds).
type ComponentValue = fn(&[f64; 4]) -> f64;

fn components(
    e: &mut Exposition,
    seen: &mut SeenSeries,
    v: &AgentView,
    r: &Reports,
    s: &Sample,
    ip: &str,
) {
    // (component, pid label) → (cpu %, rss, shared, fds)
    let mut by: BTreeMap<(String, String), [f64; 4]> = BTreeMap::new();
    let mut add = |name: String, pid: String, p: u32| {
        if let Some((st, cpu)) = s.procs.get(&p) {
            let x = by.entry((name, pid)).or_default();
            x[0] += cpu;
            x[1] += st.rss_bytes as f64;
            x[2] += st.shared_bytes as f64;
            x[3] += st.num_fds as f64;
        }
    };
    let me = std::process::id();
    add("raylet".into(), me.to_string(), me);
    for w in &v.workers {
        add(component_name(w, r.reporters.get(&w.worker_id)), String::new(), w.pid);
    }
    let fams: [(&str, &str, ComponentValue); 7] = [
        ("ray_component_cpu_percentage", "CPU use of the components (percent of one CPU)", |x| {
            x[0]
        }),
        ("ray_component_rss_bytes", "RSS of the components", |x| x[1]),
        ("ray_component_rss_mb", "RSS of the components, MB", |x| x[1] / 1e6),
        ("ray_component_shared_bytes", "Shared memory of the components (top's SHR)", |x| x[2]),
        ("ray_component_uss_bytes", "USS of the components (RSS - shared)", |x| {
            (x[1] - x[2]).max(0.0)
        }),
        ("ray_component_uss_mb", "USS of the components, MB", |x| (x[1] - x[2]).max(0.0) / 1e6),
        ("ray_component_num_fds", "Open file descriptors of the components", |x| x[3]),
    ];
    for (name, help, f) in fams {
        let cur: BTreeMap<Labels, f64> = by
            .iter()
            .map(|((c, pid), x)| {
                let mut l = labels(&[("Component", c), ("ip", ip)]);
                if !pid.is_empty() {
                    l.push(("pid".into(), pid.clone()));
                }
                (l, f(x))
            })
            .collect();
        e.gauges_remembered(seen, name, help, cur);
    }
}

/// The exported name of a user metric (Ray prefixes `ray_`; counters end in `_total`).
pub fn exported_name(def: &pb::MetricDef) -> String {
    match pb::metric_def::Kind::try_from(def.kind).unwrap_or_default() {
        pb::metric_def::Kind::Counter => format!("ray_{}_total", def.name),
        _ => format!("ray_{}", def.name),
    }
}

fn user_metrics(e: &mut Exposition, r: &Reports) {
    use pb::metric_def::Kind;
    for ((name, tags), s) in &r.series {
        let Some(def) = r.defs.get(name) else { continue };
        let l: Labels = def.tag_keys.iter().cloned().zip(tags.iter().cloned()).collect();
        let out = exported_name(def);
        match Kind::try_from(def.kind).unwrap_or_default() {
            Kind::Gauge => {
                let v = s.by_process.get(&s.last_writer).unwrap_or(&s.retired).value;
                e.gauge(&out, &def.description, &l, v);
            }
            Kind::Counter => {
                let mut total = s.retired.clone();
                s.by_process.values().for_each(|p| total.add(p));
                e.counter(&out, &def.description, &l, total.value);
            }
            Kind::Histogram => {
                let mut total = s.retired.clone();
                s.by_process.values().for_each(|p| total.add(p));
                let mut cum = 0u64;
                let buckets: Vec<(f64, u64)> = def
                    .boundaries
                    .iter()
                    .zip(total.buckets.iter().chain(std::iter::repeat(&0)))
                    .map(|(le, n)| {
                        cum += n;
                        (*le, cum)
                    })
                    .collect();
                e.histogram(&out, &def.description, &l, &buckets, total.sum, total.count);
            }
            Kind::Unspecified => {}
        }
    }
    e.counter(
        "tpuray_metrics_dropped_series_total",
        "User metric series dropped because the node holds its maximum",
        &[],
        r.dropped_series as f64,
    );
}

fn workers(e: &mut Exposition, v: &AgentView) {
    for st in ["STARTING", "IDLE", "LEASED", "ACTOR"] {
        let n = v.workers.iter().filter(|w| w.state == st).count();
        e.gauge(
            "tpuray_workers",
            "Worker processes of this node by state",
            &labels(&[("State", st)]),
            n as f64,
        );
    }
}

/// Per chip of a TPU host: whether a worker process holds it, and whether that worker
/// runs work (leased or hosting an actor) rather than waiting idle (AGENT-7).
fn tpu(
    e: &mut Exposition,
    seen: &mut SeenSeries,
    v: &AgentView,
    node_labels: &tpuray_scheduler::Labels,
) {
    let Some(n) = v.tpu_chips else { return };
    let label = |k: &str| node_labels.get(&format!("tpuray.io/{k}")).unwrap_or("").to_string();
    let (ty, topo, slice, wid) = (
        label("tpu-pod-type"),
        label("tpu-topology"),
        label("tpu-slice-name"),
        label("tpu-worker-id"),
    );
    let mut held = vec![false; n as usize];
    let mut busy = vec![false; n as usize];
    for w in &v.workers {
        for &c in &w.tpu_chips {
            if let Some(h) = held.get_mut(c as usize) {
                *h = true;
                busy[c as usize] |= matches!(w.state, "LEASED" | "ACTOR");
            }
        }
    }
    let mut alloc = BTreeMap::new();
    let mut running = BTreeMap::new();
    for i in 0..n as usize {
        let l = labels(&[
            ("TpuIndex", &i.to_string()),
            ("TpuType", &ty),
            ("TpuTopology", &topo),
            ("Slice", &slice),
            ("TpuWorkerId", &wid),
        ]);
        alloc.insert(l.clone(), f64::from(u8::from(held[i])));
        running.insert(l, f64::from(u8::from(busy[i])));
    }
    e.gauges_remembered(
        seen,
        "tpuray_tpu_chip_allocated",
        "1 when a worker process holds the chip (TPU_VISIBLE_CHIPS)",
        alloc,
    );
    e.gauges_remembered(
        seen,
        "tpuray_tpu_chip_busy",
        "1 when the chip's worker runs work (leased, or hosting an actor)",
        running,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn def(name: &str, kind: pb::metric_def::Kind, keys: &[&str], bounds: &[f64]) -> pb::MetricDef {
        pb::MetricDef {
            name: name.into(),
            description: "d".into(),
            kind: kind as i32,
            tag_keys: keys.iter().map(|k| k.to_string()).collect(),
            boundaries: bounds.to_vec(),
        }
    }

    fn point(name: &str, tags: &[&str], value: f64) -> pb::MetricPoint {
        pb::MetricPoint {
            name: name.into(),
            tag_values: tags.iter().map(|t| t.to_string()).collect(),
            value,
            ..Default::default()
        }
    }

    fn text(m: &AgentMetrics) -> String {
        let mut e = Exposition::new(vec![]);
        user_metrics(&mut e, &lock(&m.reports));
        e.encode()
    }

    /// METRICS-4.
    #[test]
    fn counters_sum_processes_count_repeated_reports_once_and_survive_exits() {
        use pb::metric_def::Kind;
        let m = AgentMetrics::default();
        let d = def("reqs", Kind::Counter, &["route"], &[]);
        let report = |w: &str, v: f64, defs: Vec<pb::MetricDef>| pb::ReportMetricsRequest {
            worker_id: w.into(),
            pid: 0,
            defs,
            points: vec![point("reqs", &["/a"], v)],
            ..Default::default()
        };
        assert!(!m.report(report("w1", 2.0, vec![])), "an unknown definition is said so");
        assert!(m.report(report("w1", 2.0, vec![d.clone()])));
        assert!(m.report(report("w1", 2.0, vec![])), "the same total again counts once");
        assert!(m.report(report("w2", 3.0, vec![d])));
        assert!(text(&m).contains(r#"ray_reqs_total{route="/a"} 5"#), "{}", text(&m));
        m.retire_gone(|id, _| id == "w2");
        assert!(
            text(&m).contains(r#"ray_reqs_total{route="/a"} 5"#),
            "an exited process's total stays"
        );
        m.report(report("w2", 4.0, vec![]));
        assert!(text(&m).contains(r#"ray_reqs_total{route="/a"} 6"#), "{}", text(&m));
    }

    #[test]
    fn gauges_read_the_last_value_set_and_histograms_add_buckets() {
        use pb::metric_def::Kind;
        let m = AgentMetrics::default();
        let g = def("temp", Kind::Gauge, &[], &[]);
        let h = def("lat", Kind::Histogram, &[], &[1.0, 10.0]);
        let hp = |b: Vec<u64>, sum, count| pb::MetricPoint {
            name: "lat".into(),
            bucket_counts: b,
            sum,
            count,
            ..Default::default()
        };
        m.report(pb::ReportMetricsRequest {
            worker_id: "a".into(),
            defs: vec![g, h],
            points: vec![point("temp", &[], 1.0), hp(vec![1, 0, 1], 20.5, 2)],
            ..Default::default()
        });
        m.report(pb::ReportMetricsRequest {
            worker_id: "b".into(),
            points: vec![point("temp", &[], 7.0), hp(vec![0, 2, 0], 8.0, 2)],
            ..Default::default()
        });
        let t = text(&m);
        assert!(t.contains("ray_temp 7\n"), "{t}");
        assert!(t.contains(r#"ray_lat_bucket{le="1"} 1"#), "{t}");
        assert!(t.contains(r#"ray_lat_bucket{le="10"} 3"#), "{t}");
        assert!(t.contains(r#"ray_lat_bucket{le="+Inf"} 4"#), "{t}");
        assert!(t.contains("ray_lat_sum 28.5"), "{t}");
        // A histogram point with the wrong number of buckets is not taken.
        m.report(pb::ReportMetricsRequest {
            worker_id: "c".into(),
            points: vec![hp(vec![5], 1.0, 5)],
            ..Default::default()
        });
        assert!(text(&m).contains("ray_lat_count 4"));
    }

    #[test]
    fn executor_series_fall_to_zero_when_the_task_ends() {
        let m = AgentMetrics::default();
        let v = AgentView {
            workers: vec![WorkerView {
                worker_id: "w".into(),
                pid: 1,
                job_id: "j".into(),
                state: "LEASED",
                tpu_chips: vec![],
            }],
            ..Default::default()
        };
        let run = |n: u32| pb::ReportMetricsRequest {
            worker_id: "w".into(),
            job_id: "j".into(),
            running: if n > 0 {
                vec![pb::RunningTasks { name: "f".into(), is_retry: false, count: n }]
            } else {
                vec![]
            },
            ..Default::default()
        };
        let mut seen = SeenSeries::default();
        let scrape = |seen: &mut SeenSeries| {
            let mut e = Exposition::new(vec![]);
            executor(&mut e, seen, &v, &lock(&m.reports));
            e.encode()
        };
        m.report(run(2));
        m.report(run(0));
        let line = r#"ray_tasks{State="RUNNING",Name="f",IsRetry="0",Source="executor",JobId="j"}"#;
        // Reported running once, never scraped while running: still a series, at 0.
        assert!(scrape(&mut seen).contains(&format!("{line} 0")));
        m.report(run(2));
        assert!(scrape(&mut seen).contains(&format!("{line} 2")));
        m.report(run(0));
        assert!(scrape(&mut seen).contains(&format!("{line} 0")), "METRICS-2");
    }
}
